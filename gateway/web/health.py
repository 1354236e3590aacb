"""Health, kept apart from pool status:

- liveness (``/healthz``): this process answers. Nothing else is checked, so
  a load balancer or an orchestrator restarts a process only when the
  process itself is stuck.
- readiness (``/readyz``): this gateway can admit work: the database and
  Redis answer (each within a short timeout). Pools are not part of it: one
  dead pool out of many must not pull every gateway instance out of its load
  balancer; it refuses only its own workloads (503 pool_unavailable).

Anonymous callers learn only up or down. Platform admins (a staff session)
and callers presenting ``SLUICE_HEALTH_TOKEN`` also get the details: each
check's outcome and every active pool's last probe (read from Redis, where
the pacer's prober keeps it; a health check never calls a pool).

Both are served by the middleware-free API handler (llm_platform/asgi.py),
so the session is read here, not by middleware."""

from __future__ import annotations

import asyncio
import hmac
from importlib import import_module

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import aget_user
from django.db import connection
from django.http import HttpRequest

from budgets.admission.pool_status import pool_statuses
from budgets.redis.clients import get_async_redis, get_redis
from budgets.models import InferencePool
from gateway.core.db_threads import database_off_loop
from tenants.roles import user_is_platform_admin

DATABASE_TIMEOUT_S = 2.0
REDIS_TIMEOUT_S = 1.0


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _database_ping() -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        # A worker thread of sync_to_async: leave no connection behind.
        connection.close()


async def _database_check() -> tuple[bool, str]:
    try:
        await asyncio.wait_for(sync_to_async(_database_ping, thread_sensitive=False)(), timeout=DATABASE_TIMEOUT_S)
        return True, "ok"
    except Exception as exc:  # report, never raise: this is the health check
        return False, _short(exc)


async def _redis_check() -> tuple[bool, str]:
    try:
        await asyncio.wait_for(get_async_redis().ping(), timeout=REDIS_TIMEOUT_S)
        return True, "ok"
    except Exception as exc:
        return False, _short(exc)


def _pools_report() -> dict[str, dict]:
    """Every active pool's status as its prober last recorded it."""
    try:
        pools = list(InferencePool.objects.filter(is_active=True).order_by("slug").values_list("pk", "slug"))
        statuses = pool_statuses(pool_ids=[pk for pk, _ in pools], client=get_redis())
        return {slug: statuses[pk].as_dict() for pk, slug in pools}
    finally:
        connection.close()


async def health_details_allowed(request: HttpRequest) -> bool:
    """The token (constant-time compare) or a platform admin's session."""
    token = settings.SLUICE_HEALTH_TOKEN
    presented = request.headers.get("Authorization", "")
    if token and presented.startswith("Bearer ") and hmac.compare_digest(presented[7:].strip().encode(),
                                                                         token.encode()):
        return True
    session_key = request.COOKIES.get(settings.SESSION_COOKIE_NAME)
    if not session_key:
        return False
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    try:
        return user_is_platform_admin(await aget_user(request))
    except Exception:  # noqa: BLE001 - no database, no details; the answer itself must not fail
        return False


async def liveness_report(*, detailed: bool) -> dict:
    if not detailed:
        return {"status": "ok"}
    ready, report = await readiness_report(detailed=True)
    return {"status": "ok", "ready": ready, **{k: v for k, v in report.items() if k != "status"}}


async def readiness_report(*, detailed: bool) -> tuple[bool, dict]:
    (db_ok, db_detail), (redis_ok, redis_detail) = await asyncio.gather(_database_check(), _redis_check())
    ready = db_ok and redis_ok
    report: dict = {"status": "ready" if ready else "unavailable"}
    if detailed:
        report["database"] = {"ok": db_ok, "detail": db_detail}
        report["redis"] = {"ok": redis_ok, "detail": redis_detail}
        if ready:
            try:
                report["pools"] = await database_off_loop(_pools_report)()
            except Exception as exc:  # noqa: BLE001
                report["pools_error"] = _short(exc)
    return ready, report
