"""The second baseline of the mixed scenario: the minimal two-class priority
gateway a team would write in an afternoon.

* one asyncio priority queue; short = prompt under 2,000 characters and
  max_tokens under 128, served before long;
* 2 workers calling the pool;
* a 5 s queue timeout (simulated seconds: divided by --time-scale), 503 past it;
* max_tokens clamped to 1,024.

No budgets, no tenants, no lanes: it shows what priority alone buys.
``python -m bench.baseline_gateway --port 8300 --upstream http://127.0.0.1:8100/v1``"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

SHORT_PROMPT_CHARS = 2_000
SHORT_MAX_TOKENS = 128
MAX_TOKENS_CLAMP = 1_024
WORKERS = 2
QUEUE_TIMEOUT_S = 5.0
SHORT, LONG = 0, 1  # queue priorities: lower first


def prompt_chars(messages: Any) -> int:
    total = 0
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text", "")) for part in content if isinstance(part, dict))
    return total


def classify(body: dict[str, Any]) -> int:
    """SHORT or LONG. A request without max_tokens gets the pool's default,
    which we cannot see, so it counts as long."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    short = prompt_chars(body.get("messages")) < SHORT_PROMPT_CHARS and isinstance(max_tokens, int) \
        and max_tokens < SHORT_MAX_TOKENS
    return SHORT if short else LONG


def clamp(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(out.get(name), int) and out[name] > MAX_TOKENS_CLAMP:
            out[name] = MAX_TOKENS_CLAMP
    return out


@dataclass(order=True)
class Job:
    priority: int
    seq: int
    body: dict[str, Any] = field(compare=False)
    enqueued: float = field(compare=False, default=0.0)
    started: asyncio.Event = field(compare=False, default_factory=asyncio.Event)
    done: asyncio.Future | None = field(compare=False, default=None)
    abandoned: bool = field(compare=False, default=False)


class PriorityGateway:
    def __init__(self, send, *, workers: int = WORKERS, queue_timeout_s: float = QUEUE_TIMEOUT_S) -> None:
        """``send(body) -> (status, headers, bytes)`` calls the pool."""
        self._send = send
        self._queue: asyncio.PriorityQueue[Job] = asyncio.PriorityQueue()
        self._seq = itertools.count()
        self.workers = workers
        self.queue_timeout_s = queue_timeout_s
        self._tasks: list[asyncio.Task] = []
        self.stats = {"short": 0, "long": 0, "queue_timeout": 0, "served": 0}

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    async def submit(self, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        priority = classify(body)
        self.stats["short" if priority == SHORT else "long"] += 1
        job = Job(priority, next(self._seq), clamp(body), time.monotonic())
        job.done = asyncio.get_running_loop().create_future()
        await self._queue.put(job)
        try:
            await asyncio.wait_for(job.started.wait(), self.queue_timeout_s)
        except asyncio.TimeoutError:
            if not job.started.is_set():
                job.abandoned = True  # a worker skips it: fail fast, never call the pool late
                self.stats["queue_timeout"] += 1
                return 503, {"retry-after": "1"}, json.dumps({"error": {
                    "message": "queued longer than the queue timeout", "type": "server_error", "param": None,
                    "code": "queue_timeout"}}).encode()
        return await job.done

    async def _worker(self) -> None:
        while True:
            job = await self._queue.get()
            if job.abandoned:
                continue
            job.started.set()
            try:
                result = await self._send(job.body)
            except Exception as exc:  # the pool is unreachable: a 502, as a proxy would answer
                result = (502, {}, json.dumps({"error": {"message": str(exc), "type": "server_error", "param": None,
                                                         "code": "upstream_error"}}).encode())
            self.stats["served"] += 1
            if not job.done.done():
                job.done.set_result(result)


def create_app(upstream: str, time_scale: float = 1.0):
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(600.0, connect=5.0),
                               limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    async def send(body):
        response = await client.post("/chat/completions", json=body)
        keep = {k: v for k, v in response.headers.items() if k.startswith(("retry-after", "x-ratelimit", "x-sim"))}
        return response.status_code, keep, response.content

    gateway = PriorityGateway(send, queue_timeout_s=QUEUE_TIMEOUT_S / time_scale)

    async def chat(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return JSONResponse({"error": {"message": "invalid JSON", "type": "invalid_request_error", "param": None,
                                           "code": None}}, status_code=400)
        status, headers, content = await gateway.submit(body)
        return Response(content, status_code=status, headers=headers, media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "queue_depth": gateway.depth, **gateway.stats})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        gateway.start()
        try:
            yield
        finally:
            await gateway.stop()
            await client.aclose()

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])], lifespan=lifespan)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--upstream", default="http://127.0.0.1:8100/v1")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    uvicorn.run(create_app(args.upstream, args.time_scale), host=args.host, port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
