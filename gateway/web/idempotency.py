"""Idempotency-Key for POST /v1/chat/completions: the same key with the same
body gets the same response, and the pool is called once; the same key with
another body is a 409. Keys are scoped to the workload and kept 24 hours.
(Jobs keep theirs in the Job table: gateway/core/jobs/lifecycle.py.) Bodies are
compared by gateway.core.request.chat.body_digest, as jobs' are."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from budgets.redis.clients import get_async_redis
from gateway.core import keys

TTL_MS = 24 * 3600 * 1000
POLL_S = 0.05
MAX_KEY_LENGTH = 255


@dataclass(frozen=True)
class Claim:
    state: str  # "new" (we run it), "done" (replay), "conflict", "pending"
    status: int = 0
    body: dict | None = None
    headers: dict | None = None


async def idempotency_claim(*, workload_id: int, key: str, digest: str) -> Claim:
    client = get_async_redis()
    redis_key = keys.idempotency(workload_id, key)
    if await client.set(redis_key, json.dumps({"digest": digest, "state": "pending"}), nx=True, px=TTL_MS):
        return Claim(state="new")
    raw = await client.get(redis_key)
    if raw is None:  # released between our SET and GET: try once more
        return await idempotency_claim(workload_id=workload_id, key=key, digest=digest)
    stored = json.loads(raw)
    if stored["digest"] != digest:
        return Claim(state="conflict")
    if stored["state"] == "done":
        return Claim(state="done", status=stored["status"], body=stored["body"], headers=stored["headers"])
    return Claim(state="pending")


async def idempotency_wait(*, workload_id: int, key: str, digest: str, timeout_s: float) -> Claim:
    """Wait for the first request with this key to finish, then replay it."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        claim = await idempotency_claim(workload_id=workload_id, key=key, digest=digest)
        if claim.state != "pending":
            return claim
        await asyncio.sleep(POLL_S)
    return Claim(state="pending")


async def idempotency_store(*, workload_id: int, key: str, digest: str, status: int, body: dict,
                            headers: dict[str, str]) -> None:
    value = {"digest": digest, "state": "done", "status": status, "body": body, "headers": headers}
    await get_async_redis().set(keys.idempotency(workload_id, key), json.dumps(value), px=TTL_MS)


async def idempotency_release(*, workload_id: int, key: str) -> None:
    """Forget a key whose request was refused before it ran: a retry may go."""
    await get_async_redis().delete(keys.idempotency(workload_id, key))
