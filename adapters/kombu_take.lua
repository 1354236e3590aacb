-- The batched pickup's take (adapters/kombu_redis.py), one message at a time.
-- KEYS: 1 the queue's list, 2 kombu's unacked index (zset), 3 its unacked hash.
-- ARGV: 1 how many at most.
-- Each message popped is recorded as kombu's QoS.append records one (index
-- score: now in seconds; hash value: [payload, exchange, routing_key]). A
-- message it cannot read as kombu's (not JSON, no delivery tag) goes back
-- where it was, the next for kombu's own read, and the take stops.
-- Returns the messages taken, oldest first.
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
local out = {}
for _ = 1, tonumber(ARGV[1]) do
  local item = redis.call('RPOP', KEYS[1])
  if not item then break end
  local ok, message = pcall(cjson.decode, item)
  local props = ok and type(message) == 'table' and message['properties']
  local info = type(props) == 'table' and props['delivery_info']
  local tag = type(props) == 'table' and props['delivery_tag']
  if type(info) ~= 'table' or type(tag) ~= 'string' then
    redis.call('RPUSH', KEYS[1], item)
    break
  end
  redis.call('ZADD', KEYS[2], now, tag)
  redis.call('HSET', KEYS[3], tag,
             '[' .. item .. ',' .. cjson.encode(info['exchange'] or '') .. ',' .. cjson.encode(info['routing_key'] or '') .. ']')
  out[#out + 1] = item
end
return out
