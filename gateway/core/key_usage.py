"""When each API key was last used, written in batches: web processes note
uses in memory and push them to one Redis sorted set now and then
(``key_last_used_push``, ZADD GT keeps the latest time per key); a beat task
(``key_last_used_flush``) moves the set aside with RENAME, so uses noted
meanwhile land in a fresh set, and writes it to ``ApiKey.last_used_at``:
one UPDATE per key used since the last flush, never one per request."""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

from redis.exceptions import ResponseError

from budgets.redis.clients import REDIS_UNAVAILABLE, get_async_redis, get_redis, unavailable_note
from gateway.core import keys
from tenants.services import api_keys_mark_used


async def key_last_used_push(*, last_used: dict[int, float]) -> None:
    """One round trip: ``last_used`` maps key id -> unix seconds."""
    if last_used:
        await get_async_redis().zadd(keys.KEY_LAST_USED, {str(k): at for k, at in last_used.items()}, gt=True)


def key_last_used_at(*, key_id: int, stored: datetime | None, noted: float | None = None) -> datetime | None:
    """The freshest known use of a key: the database's, the uses pushed to
    Redis and not flushed yet (either set), and ``noted`` (unix seconds: a
    use this process holds and has not pushed). A page that read only the
    database would say "never" for a key used seconds before."""
    seen = [stored.timestamp()] if stored else []
    if noted:
        seen.append(noted)
    try:
        pipe = get_redis().pipeline(transaction=False)
        pipe.zscore(keys.KEY_LAST_USED, str(key_id))
        pipe.zscore(keys.KEY_LAST_USED_FLUSHING, str(key_id))
        seen.extend(score for score in pipe.execute() if score is not None)
    except REDIS_UNAVAILABLE:
        unavailable_note("API key last use")
    return datetime.fromtimestamp(max(seen), tz=dt_timezone.utc) if seen else None


def key_last_used_flush() -> int:
    """Write the noted uses to the database; returns how many keys changed.
    A flush that died after the RENAME left its set behind: it is merged
    back first, so nothing noted is lost."""
    client = get_redis()
    left = client.zrange(keys.KEY_LAST_USED_FLUSHING, 0, -1, withscores=True)
    if not left:
        try:
            client.rename(keys.KEY_LAST_USED, keys.KEY_LAST_USED_FLUSHING)
        except ResponseError as exc:  # no such key: nothing was used since the last flush
            if "no such key" in str(exc).lower():
                return 0
            raise
        left = client.zrange(keys.KEY_LAST_USED_FLUSHING, 0, -1, withscores=True)
    used = {int(member): datetime.fromtimestamp(score, tz=dt_timezone.utc) for member, score in left}
    changed = api_keys_mark_used(last_used=used)
    client.delete(keys.KEY_LAST_USED_FLUSHING)
    return changed
