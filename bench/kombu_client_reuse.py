"""Micro-bench for adapters/kombu.py: what one synchronous redis-py client
per connection pool saves against kombu's own Redis channel, which builds a
new client for every command or pipeline it sends.

Two measures, each with kombu's channel and with Sluice's, in one process
against the broker's Redis:

- ``_create_client()``: CPU per call;
- a message's broker path as a lane worker sees it (the web side pushes
  the message itself: gateway/core/task_message.py): its delivery with ack
  emulation (``basic_get(no_ack=False)`` writes the unacked entry) and the
  ack that removes it; CPU per message, its publish not counted.

CPU is this process's (``time.process_time``), not wall time; the two
channels alternate in blocks so drift of the machine hits both alike.

Run alone: ``python -m bench.kombu_client_reuse [--calls N] [--messages N]``."""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
import uuid

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))  # no database, no sessions: any will do

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from kombu import Connection, Exchange, Queue  # noqa: E402
from kombu.transport import redis as kombu_redis  # noqa: E402

from adapters.kombu import Transport  # noqa: E402

BLOCKS = 7


def _create_client_us(channel, calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        channel._create_client()
    return (time.process_time() - started) / calls * 1e6


def _message_us(conn: Connection, queue: Queue, messages: int) -> float:
    channel = conn.default_channel
    name = queue.name
    with conn.Producer() as producer:
        for n in range(messages):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=name)
    started = time.process_time()
    for _ in range(messages):
        channel.basic_get(name, no_ack=False).ack()
    return (time.process_time() - started) / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="_create_client calls per block")
    parser.add_argument("--messages", type=int, default=2_000, help="messages per block")
    parser.add_argument("--url", default=settings.CELERY_BROKER_URL)
    args = parser.parse_args()

    ways = {"kombu": kombu_redis.Transport, "sluice": Transport}
    conns = {way: Connection(args.url, transport=cls) for way, cls in ways.items()}
    name = f"sluice-bench-kombu-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    clients: dict[str, list[float]] = {way: [] for way in ways}
    messages: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for conn in conns.values():
            queue(conn.default_channel).declare()
            _message_us(conn, queue, 50)  # warm: connections made, scripts loaded
        for _ in range(BLOCKS):
            for way, conn in conns.items():
                clients[way].append(_create_client_us(conn.default_channel, args.calls))
                messages[way].append(_message_us(conn, queue, args.messages))
    finally:
        queue(conns["kombu"].default_channel).delete()
        for conn in conns.values():
            conn.release()

    for way in ways:
        print(f"{way:>6}: _create_client {statistics.median(clients[way]):7.2f} us/call "
              f"(blocks {', '.join(f'{v:.2f}' for v in clients[way])}); "
              f"deliver+ack {statistics.median(messages[way]):7.1f} us CPU/message "
              f"(blocks {', '.join(f'{v:.1f}' for v in messages[way])})")
    saved = statistics.median(messages["kombu"]) - statistics.median(messages["sluice"])
    print(f"saved per message: {saved:.1f} us CPU "
          f"({saved / statistics.median(messages['kombu']) * 100:.1f}% of the broker path's)")


if __name__ == "__main__":
    main()
