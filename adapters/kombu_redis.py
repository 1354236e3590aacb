"""A lane worker's pickup from its Redis queue: the messages waiting behind
the one that woke the consumer are taken in the same turn of its event
loop, each popped and recorded as unacknowledged in one atomic step.

Written against: kombu 5.7.0's Redis transport (``kombu.transport.redis``)
under Celery 5.7.0; Redis's Lua with its cjson library.

Replaces: kombu's one message per consumer turn. Stock, the consumer's
thread answers each message with a BRPOP's reply, then a second round trip
(a new redis-py pipeline: ZADD to the unacked index, HSET of the message to
the unacked hash) before Celery sees it, then sends the next BRPOP. Every
one of those socket waits gives up the GIL, and in a lane worker running a
hundred calls on its threads the consumer's thread waits for it again after
each: under a burst of arrivals the last message of a lane waited most of a
second to reach a thread while the pool sat idle. Here, once the stock read
has delivered the message BRPOP answered (``Channel._brpop_read``), one Lua
call (kombu_take.lua) pops up to the room the worker's QoS has left (at most TAKE_MAX) from
the same list and writes each one's unacknowledged entry exactly as kombu's
``QoS.append`` does (score: now, in seconds; value: ``[payload, exchange,
routing_key]``), and they are handed to the consumer (``Transport._deliver``)
in order, their own append keeping them in memory only (``_delivered``, for
the ack and a restore at shutdown). Popping and recording in one script
also closes, for these messages, the window kombu leaves between the BRPOP
and the append (a worker killed there loses the message). Redelivery is
kombu's own: ``restore_visible`` finds the entry after the visibility
timeout. Not taken in batches: a channel with a ``global_keyprefix``, and
messages of a priority other than 0 (kombu keeps those on other lists).

Installed by ``lane_pickup_install`` in each lane worker at start
(llm_platform/celery.py): kombu resolves the ``redis`` scheme (and
``redis+socket``) to this module's Transport from then on.

Measured gain: 256 streams started at once against the A100-calibrated
simulator, four alternated pairs on a 2-core machine (10 million additions
in 0.66 s): the lane's queue wait (admission to a worker thread) p99
261–294 ms against 315–500 one message per turn, and at 1,024 streams 395–868
against 1,569–2,698 ms; bench.cost's CPU per admitted request (zero-latency
pool) 3.71–3.75 ms against 4.17–4.33 (about 12 % less). Reproduce it with
``SLUICE_LANE_BATCHED_PICKUP=false`` against the default, alternated, for
bench.cost and bench.burst's Sluice path.

Guarded by: tests/adapters/test_kombu_redis.py (the unacked entries match
what kombu writes, the batch is bounded by the QoS's room, an entry left by
a killed worker is restored by kombu's own sweep)."""

from __future__ import annotations

import importlib.resources

import kombu.transport
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils.json import loads

# At most this many messages taken in one turn besides the one BRPOP
# answered: a turn of the consumer's loop stays a few milliseconds long.
TAKE_MAX = 64

# The take: pops and records each message in one script (its contract in its header).
TAKE = importlib.resources.files(__package__).joinpath("kombu_take.lua").read_text()


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS; a message ``Channel.take_more`` already recorded
    is appended in memory only."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: set[str] = set()

    def append(self, message, delivery_tag) -> None:
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            VirtualQoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS
    take_script = None

    def _brpop_read(self, **options):
        self.connection.delivered_queue = None
        delivered = super()._brpop_read(**options)
        queue = self.connection.delivered_queue
        if delivered and queue and not self.global_keyprefix:
            self.take_more(queue)
        return delivered

    def take_more(self, queue: str) -> int:
        """Pop and deliver the messages waiting on ``queue``'s list of
        priority 0, up to the QoS's room; returns how many."""
        room = self.qos.can_consume_max_estimate()
        count = TAKE_MAX if room is None else min(room, TAKE_MAX)
        if count <= 0:
            return 0
        with self.conn_or_acquire() as client:
            if self.take_script is None:
                self.take_script = client.register_script(TAKE)
            items = self.take_script(keys=[queue, self.unacked_index_key, self.unacked_key], args=[count],
                                     client=client)
        # Each is delivered even if one before it fails (that one stays
        # recorded, for the restore sweep, as kombu leaves a message whose
        # callback raised); the first failure is raised after.
        failure = None
        for item in items:
            payload = loads(item)
            self.qos.recorded.add(payload["properties"]["delivery_tag"])
            try:
                self.connection._deliver(payload, queue)
            except Exception as exc:  # noqa: BLE001 - raised below, once the others are delivered
                failure = failure or exc
        if failure is not None:
            raise failure
        return len(items)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with ``Channel`` above; it notes the queue of
    the message it delivers last (None for a message of another priority,
    which kombu keeps on another list)."""

    Channel = Channel
    delivered_queue: str | None = None

    def _deliver(self, message, queue):
        self.delivered_queue = None if (message.get("properties") or {}).get("priority") else queue
        super()._deliver(message, queue)


def lane_pickup_install() -> None:
    """From now on in this process, kombu's ``redis`` transport (and
    ``redis+socket``) is this module's: call before the consumer connects."""
    kombu.transport.TRANSPORT_ALIASES["redis"] = f"{__name__}:Transport"
    kombu.transport._transport_cache.pop("redis", None)
