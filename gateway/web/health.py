"""Reachability of what a request needs: the database, Redis, each pool."""

from __future__ import annotations

import asyncio

import httpx
from asgiref.sync import sync_to_async
from django.db import connection

from budgets.models import InferencePool
from budgets.admission.redis_client import get_async_redis


def _database_check() -> tuple[bool, str, list[tuple[str, str]]]:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        pools = [(p.slug, p.base_url) for p in InferencePool.objects.filter(is_active=True)]
        return True, "ok", pools
    except Exception as exc:  # report, never raise: this is the health check
        return False, f"{type(exc).__name__}: {exc}"[:300], []


async def _redis_check() -> tuple[bool, str]:
    try:
        await asyncio.wait_for(get_async_redis().ping(), timeout=1.0)
        return True, "ok"
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"[:300]


async def _pool_check(client: httpx.AsyncClient, base_url: str) -> tuple[bool, str]:
    try:
        response = await client.get(base_url.rstrip("/") + "/models")
        # 401/403 still proves the pool answers; only no answer or 5xx is down.
        return response.status_code < 500, f"HTTP {response.status_code}"
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"[:300]


async def health_report() -> dict:
    db_ok, db_detail, pools = await sync_to_async(_database_check, thread_sensitive=False)()
    redis_ok, redis_detail = await _redis_check()
    async with httpx.AsyncClient(timeout=2.0) as client:
        results = await asyncio.gather(*[_pool_check(client, url) for _, url in pools])
    pool_report = {slug: {"ok": ok, "detail": detail} for (slug, _), (ok, detail) in zip(pools, results)}
    healthy = db_ok and redis_ok and all(ok for ok, _ in results)
    return {
        "status": "ok" if healthy else "degraded",
        "database": {"ok": db_ok, "detail": db_detail},
        "redis": {"ok": redis_ok, "detail": redis_detail},
        "pools": pool_report,
    }
