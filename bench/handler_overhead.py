"""The /v1 handler's own cost: CPU per refused /v1 request (GET /v1/models
without a key, a 401 its view decides on the loop, no Redis or database)
through the middleware-free handler (adapters/django.py, as
llm_platform/asgi.py routes /v1) and through Django's stock ASGIHandler
with the project's MIDDLEWARE (and, to tell the two apart, with none),
all called in-process (no server, no sockets), 8 callers at once, rounds alternated A/B so that a machine's
drift hits both alike. CPU is this process's (``time.process_time``: the
threads Django's handler starts count too).

Run alone: ``python -m bench.handler_overhead [--rounds 5] [--requests 3000]``
(with the settings' environment: DATABASE_URL, REDIS_URL; neither is used
by the request measured)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")

from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.test import override_settings  # noqa: E402

from llm_platform.asgi import application, django_application  # noqa: E402  (sets Django up)

CALLERS = 8
SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
         "path": "/v1/models", "raw_path": b"/v1/models", "query_string": b"", "root_path": "",
         "headers": [(b"host", b"localhost")], "client": ("127.0.0.1", 5000), "server": ("localhost", 80)}


async def _one(app) -> int:
    status = 0
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays until it has its answer

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(dict(SCOPE), receive, send)
    return status


async def _round(app, requests: int) -> float:
    """CPU microseconds per request over ``requests`` requests."""
    per_caller = requests // CALLERS

    async def caller() -> None:
        for _ in range(per_caller):
            assert await _one(app) == 401

    started = time.process_time()
    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return (time.process_time() - started) / (per_caller * CALLERS) * 1e6


async def main(rounds: int, requests: int) -> dict[str, list[float]]:
    with override_settings(MIDDLEWARE=[]):
        django_bare = ASGIHandler()
    handlers = {"middleware-free": application, "django-stock": django_application, "django-no-mw": django_bare}
    for app in handlers.values():  # warm: imports, the default executor, caches
        await _round(app, CALLERS * 50)
    results: dict[str, list[float]] = {name: [] for name in handlers}
    for _ in range(rounds):
        for name, app in handlers.items():
            results[name].append(await _round(app, requests))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the access log and django.request lines would measure the log handler
    results = asyncio.run(main(args.rounds, args.requests))
    for name, per_request in results.items():
        print(f"{name:15} µs CPU per refusal: median {statistics.median(per_request):.0f}, "
              f"range {min(per_request):.0f}-{max(per_request):.0f}, rounds {[round(v) for v in per_request]}")
    a, b = statistics.median(results["middleware-free"]), statistics.median(results["django-stock"])
    print(f"saved per refusal: {b - a:.0f} µs ({(b - a) / b:.0%} of the stock handler's)")
