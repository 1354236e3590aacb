"""Background probes of every active pool, so that one dead pool refuses only
its own workloads (503 pool_unavailable, budgets/admission/admit.lua) while
the gateway's health and every other pool carry on.

The prober is a thread of the pacer process (``manage.py run_pacer``), not a
beat task: beat's tasks run on the housekeeping lane, which is the batch
lane's worker pool (gateway/core/lanes.py), so a batch flood, the load most
likely to meet a failing pool, would hold probes back for as long as it
lasts. The pacer is already the gateway's clock-driven loop and runs on every
host; a round is claimed in Redis (``POOL_PROBE_ROUND``, held for one
interval) so N pacers still probe each pool once per interval, and when one
host goes the next pacer takes over within an interval.

A probe is ``GET <base_url>/models`` with the pool's key: any answer below 500
(401 and 404 included) proves the server is there; no answer within the
timeout, or a 5xx, is a failure. ``budgets/admission/probe.lua`` turns failures in a row into
the pool's down mark."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import httpx
from django.conf import settings
from django.db import close_old_connections, connection

from budgets.admission.pool_status import pool_probe_record_call
from budgets.redis.clients import get_redis
from budgets.models import InferencePool
from gateway.core import keys
from gateway.worker.pool_client import pool_api_key, pool_tls_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeTarget:
    pool_id: int
    slug: str
    base_url: str
    api_key_env: str


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str
    latency_ms: int


def probe_targets() -> list[ProbeTarget]:
    return [ProbeTarget(pool_id=pk, slug=slug, base_url=base_url, api_key_env=api_key_env)
            for pk, slug, base_url, api_key_env in InferencePool.objects.filter(is_active=True).order_by("pk")
            .values_list("pk", "slug", "base_url", "api_key_env")]


async def _probe(client: httpx.AsyncClient, target: ProbeTarget) -> ProbeResult:
    api_key = pool_api_key(api_key_env=target.api_key_env)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    try:
        response = await client.get(target.base_url.rstrip("/") + "/models", headers=headers)
    except httpx.HTTPError as exc:
        return ProbeResult(ok=False, detail=f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__,
                           latency_ms=int((time.monotonic() - started) * 1000))
    latency_ms = int((time.monotonic() - started) * 1000)
    # 401/403/404 still prove the pool answers; only no answer or a 5xx is down.
    return ProbeResult(ok=response.status_code < 500, detail=f"HTTP {response.status_code}", latency_ms=latency_ms)


async def _probe_all(targets: list[ProbeTarget], timeout_s: float) -> list[ProbeResult]:
    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, verify=pool_tls_context()) as client:
        return list(await asyncio.gather(*[_probe(client, target) for target in targets]))


def pools_probe(*, targets: list[ProbeTarget] | None = None) -> dict[int, ProbeResult]:
    """Probe the pools at once (concurrently, each within the timeout) and
    record every result; returns them by pool id."""
    targets = probe_targets() if targets is None else targets
    if not targets:
        return {}
    results = asyncio.run(_probe_all(targets, settings.SLUICE_POOL_PROBE_TIMEOUT_S))
    client = get_redis()
    for target, result in zip(targets, results):
        down_until_ms = pool_probe_record_call(
            pool_id=target.pool_id, ok=result.ok, detail=result.detail, latency_ms=result.latency_ms,
            interval_s=settings.SLUICE_POOL_PROBE_INTERVAL_S, failures_to_down=settings.SLUICE_POOL_PROBE_FAILURES,
        ).run(client)
        if not result.ok:
            logger.warning("pool %s did not answer its probe (%s)%s", target.slug, result.detail,
                           "; it admits nothing until it does" if down_until_ms else "")
    return {target.pool_id: result for target, result in zip(targets, results)}


def probe_round_claim(*, interval_s: float) -> bool:
    """True for the one pacer that probes this round (the claim lapses just
    before the next round is due)."""
    return bool(get_redis().set(keys.POOL_PROBE_ROUND, "1", nx=True, px=max(1, int(interval_s * 900))))


def prober_run(*, stop: threading.Event, interval_s: float) -> None:
    """Probe every ``interval_s`` until ``stop`` is set (by the pacer's main
    thread, never by a signal handler: see gateway/worker/pacer.py)."""
    logger.info("pool prober running every %.1fs", interval_s)
    try:
        while not stop.is_set():
            try:
                if probe_round_claim(interval_s=interval_s):
                    pools_probe()
            except Exception:  # noqa: BLE001 - Redis or the database away: try again next round
                logger.warning("pool probe round failed", exc_info=True)
            finally:
                close_old_connections()
            stop.wait(interval_s)
    finally:
        connection.close()


def prober_start(*, stop: threading.Event) -> threading.Thread | None:
    """The prober thread, or None when probing is off (interval 0)."""
    interval_s = settings.SLUICE_POOL_PROBE_INTERVAL_S
    if interval_s <= 0:
        return None
    # A daemon: a probe stuck past its timeout must not hold the process's exit.
    thread = threading.Thread(target=prober_run, kwargs={"stop": stop, "interval_s": interval_s},
                              name="pool-prober", daemon=True)
    thread.start()
    return thread
