"""Rejections counted in Redis per minute and flushed to the database in
batches, against a real Redis and PostgreSQL: exact counts, a handful of
writes for a storm, idempotent and crash-safe flushes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import redis as redis_lib
from django.db import connection
from django.test.utils import CaptureQueriesContext

from budgets.admission import keys
from budgets.redis import scripts as redis_scripts
from budgets.ledger import rejections
from budgets.errors import BudgetUnavailable
from budgets.models import RejectionSample, RejectionStat
from budgets.ledger.rejections import rejection_count, rejection_count_call, rejections_flush
from tests.people import world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

AFTER = 3600  # flush as if an hour had passed: every minute is closed


def count(world, *, reason="workload_tpm", workload=None, tokens=120, retry_after_ms=1500):
    workload = workload or world.wl_a
    rejection_count(pool_id=world.pool.id, workload_id=workload.id, tenant_id=workload.tenant_id, reason=reason,
                    estimated_tokens=tokens, retry_after_ms=retry_after_ms)


def flush():
    return rejections_flush(now_s=time.time() + AFTER)


def stat_totals() -> Counter:
    totals: Counter = Counter()
    for wid, reason, n in RejectionStat.objects.values_list("workload_id", "reason", "count"):
        totals[(wid, reason)] += n
    return totals


def test_one_rejection_becomes_one_stat_and_one_sample(world):
    count(world, tokens=321, retry_after_ms=2500)
    result = flush()
    assert (result.stats, result.samples, result.pending) == (1, 1, 0)
    stat = RejectionStat.objects.get()
    assert (stat.workload_id, stat.tenant_id, stat.pool_id, stat.reason, stat.count) == (
        world.wl_a.id, world.tenant_a.id, world.pool.id, "workload_tpm", 1)
    assert stat.minute.second == 0 and stat.minute.microsecond == 0
    sample = RejectionSample.objects.get()
    assert (sample.reason, sample.estimated_tokens, sample.retry_after_ms) == ("workload_tpm", 321, 2500)


def test_open_minute_is_not_flushed_yet(world):
    count(world)
    assert rejections_flush().minutes == 0  # the current minute has not ended
    assert RejectionStat.objects.count() == 0


def test_storm_of_5000_rejections_is_a_handful_of_writes_with_exact_counts(world, settings):
    # given a storm: 5,000 rejections over two workloads and three reasons
    plan = Counter()
    reasons = ["workload_tpm", "pool_tpm", "workload_rpm"]
    for i in range(5_000):
        workload = world.wl_a if i % 3 else world.wl_b
        reason = reasons[i % len(reasons)]
        count(world, workload=workload, reason=reason)
        plan[(workload.id, reason)] += 1
    # when one flush moves it to the database
    with CaptureQueriesContext(connection) as queries:
        result = flush()
    writes = [q["sql"] for q in queries.captured_queries if q["sql"].lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))]
    # then the counts are exact, the samples capped, and the writes few
    assert stat_totals() == plan
    assert sum(plan.values()) == 5_000
    assert len(writes) <= 4, writes
    per_minute_field = Counter((s.at.replace(second=0, microsecond=0), s.workload_id, s.reason)
                               for s in RejectionSample.objects.all())
    assert per_minute_field and max(per_minute_field.values()) <= settings.SLUICE_REJECTION_SAMPLES_PER_MINUTE
    assert result.pending == 0


def test_flush_is_idempotent(world):
    for _ in range(7):
        count(world)
    flush()
    # a flush that died after writing leaves the minute pending: redo it
    minute = RejectionStat.objects.get().minute
    pending_key = keys.rejection_pending_minutes(world.pool.id)
    from budgets.redis.clients import get_redis

    get_redis().zadd(pending_key, {str(int(minute.timestamp())): int(minute.timestamp())})
    flush()
    flush()
    assert stat_totals() == Counter({(world.wl_a.id, "workload_tpm"): 7})
    assert RejectionSample.objects.count() == 5


def test_late_rejection_for_a_flushed_minute_is_counted_exactly(world, redis_client):
    # given a minute already flushed with 3 rejections
    for _ in range(3):
        count(world)
    flush()
    minute = int(RejectionStat.objects.get().minute.timestamp())
    # when a late rejection for that same minute arrives (e.g. a slow web process)
    rejection_count_call(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                         reason="workload_tpm", estimated_tokens=1, retry_after_ms=None, now_s=minute + 30).run()
    flush()
    # then the database holds the minute's full count, not the late part alone
    assert RejectionStat.objects.get().count == 4


def test_a_rejection_during_the_flush_keeps_the_minute_pending(world, redis_client, monkeypatch):
    for _ in range(2):
        count(world)
    real_bulk_create = RejectionStat.objects.bulk_create

    def bulk_create_then_a_rejection_arrives(*args, **kwargs):
        created = real_bulk_create(*args, **kwargs)
        minute = int(args[0][0].minute.timestamp())
        rejection_count_call(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                             reason="workload_tpm", estimated_tokens=1, retry_after_ms=None, now_s=minute + 30).run()
        return created

    monkeypatch.setattr(RejectionStat.objects, "bulk_create", bulk_create_then_a_rejection_arrives)
    assert flush().pending == 1
    monkeypatch.undo()
    assert flush().pending == 0
    assert RejectionStat.objects.get().count == 3


def test_the_async_caller_counts_the_same_way(world):
    async def storm():
        await asyncio.gather(*[
            rejection_count_call(pool_id=world.pool.id, workload_id=world.wl_b.id, tenant_id=world.tenant_b.id,
                                 reason="pool_saturated", estimated_tokens=10, retry_after_ms=None).run_async()
            for _ in range(50)
        ])

    asyncio.run(storm())
    flush()
    assert stat_totals() == Counter({(world.wl_b.id, "pool_saturated"): 50})
    assert set(RejectionSample.objects.values_list("retry_after_ms", flat=True)) == {None}


def test_rejections_without_a_pool_are_kept_too(world):
    rejection_count(pool_id=None, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id, reason="no_reservation",
                    estimated_tokens=0, retry_after_ms=None)
    flush()
    stat = RejectionStat.objects.get()
    assert (stat.pool_id, stat.reason, stat.count) == (None, "no_reservation", 1)
    # and a second flush of the same minute upserts the same row (NULL pool is one key)
    rejection_count(pool_id=None, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id, reason="no_reservation",
                    estimated_tokens=0, retry_after_ms=None)
    flush()
    assert RejectionStat.objects.get().count in (1, 2)  # 2 when both fell in one minute
    assert sum(RejectionStat.objects.values_list("count", flat=True)) == 2


def test_counting_never_raises_when_redis_is_away(world, monkeypatch):
    dead = redis_lib.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    monkeypatch.setattr(redis_scripts, "get_redis", lambda: dead)
    count(world)  # no exception


def test_the_async_call_reports_redis_away_as_budget_unavailable(world, monkeypatch):
    # The /v1 views swallow it (losing a counter beats failing the answer);
    # what they get is the one translation every Redis call shares.
    import redis.asyncio as aioredis

    async def dead_async():
        dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        await rejection_count_call(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                                   reason="workload_tpm", estimated_tokens=1, retry_after_ms=1).run_async(dead)

    with pytest.raises(BudgetUnavailable):
        asyncio.run(dead_async())


def test_samples_of_deleted_workloads_are_dropped(world):
    from tenants.models import Workload

    orphan = Workload.objects.create(tenant=world.tenant_a, name="gone", slug=f"gone-{world.pool.slug}")
    count(world, workload=orphan)
    count(world)
    Workload.objects.filter(pk=orphan.pk).delete()
    flush()
    assert list(RejectionStat.objects.values_list("workload_id", flat=True)) == [world.wl_a.id]


# --- the web process's tally ---------------------------------------------------------


def test_a_tally_of_a_storm_is_counted_exactly_in_one_round_trip(world, redis_client, settings):
    # given 500 refusals of two reasons noted in memory within one minute
    settings.SLUICE_REJECTION_SAMPLES_PER_MINUTE = 5
    tally = rejections.RejectionTally()
    now_s = time.time()
    for i in range(500):
        tally.note(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                   reason="workload_tpm" if i % 5 else "pool_tpm", estimated_tokens=i, retry_after_ms=100,
                   message=f"refusal {i}", now_s=now_s)
    (minute_key, fields), = tally.minutes.items()
    assert {f: n for f, (n, _) in fields.items()} == {
        f"{world.wl_a.id}|{world.tenant_a.id}|workload_tpm": 400, f"{world.wl_a.id}|{world.tenant_a.id}|pool_tpm": 100}
    # when it is sent: one script call for the pool's minute
    rejections._tally.put_back(tally.take())
    before = redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert asyncio.run(rejections.rejection_tally_send()) is True
    after = redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert after - before <= 2  # the EVALSHA (and a NOSCRIPT retry on a fresh Redis)
    assert not rejections._tally
    # then the flush writes the exact counts and the first 5 samples of each reason, oldest first
    flush()
    assert stat_totals() == Counter({(world.wl_a.id, "workload_tpm"): 400, (world.wl_a.id, "pool_tpm"): 100})
    assert sorted(RejectionSample.objects.values_list("estimated_tokens", flat=True)) == [0, 1, 2, 3, 4, 5, 6, 10, 15, 20]


def test_a_tally_adds_to_what_other_processes_counted_and_keeps_the_sample_limit(world, settings):
    settings.SLUICE_REJECTION_SAMPLES_PER_MINUTE = 5
    now_s = time.time()
    for _ in range(3):  # another process, one at a time
        rejection_count(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                        reason="workload_tpm", estimated_tokens=1, retry_after_ms=1, now_s=now_s)
    for _ in range(4):
        rejections._tally.note(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                               reason="workload_tpm", estimated_tokens=2, retry_after_ms=1, now_s=now_s)
    asyncio.run(rejections.rejection_tally_send())
    flush()
    assert stat_totals() == Counter({(world.wl_a.id, "workload_tpm"): 7})
    assert sorted(RejectionSample.objects.values_list("estimated_tokens", flat=True)) == [1, 1, 1, 2, 2]


def test_a_tally_redis_refused_is_kept_for_the_next_send(world, monkeypatch):
    import redis.asyncio as aioredis

    rejections._tally.note(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                           reason="workload_tpm", estimated_tokens=1, retry_after_ms=1)

    async def send_to_a_dead_redis():
        dead = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
        monkeypatch.setattr(rejections.ScriptCall, "run_async",
                            lambda self, client=None, _real=rejections.ScriptCall.run_async: _real(self, dead))
        return await rejections.rejection_tally_send()

    assert asyncio.run(send_to_a_dead_redis()) is False
    monkeypatch.undo()
    rejections._tally.note(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                           reason="workload_tpm", estimated_tokens=1, retry_after_ms=1)
    assert asyncio.run(rejections.rejection_tally_send()) is True
    flush()
    assert stat_totals() == Counter({(world.wl_a.id, "workload_tpm"): 2})


def test_noted_rejections_reach_redis_within_a_tick_without_a_send_call(world, settings):
    settings.SLUICE_REJECTION_PUSH_S = 0.2

    async def storm():
        for _ in range(3):
            for _ in range(10):
                rejections.rejection_note(pool_id=world.pool.id, workload_id=world.wl_b.id,
                                          tenant_id=world.tenant_b.id, reason="pool_tpm", estimated_tokens=1,
                                          retry_after_ms=None)
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 2
        while rejections._tally and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await rejections._tally_sender

    asyncio.run(storm())
    flush()
    assert stat_totals() == Counter({(world.wl_b.id, "pool_tpm"): 30})


def test_what_is_left_of_the_tally_is_sent_at_exit(world):
    # given refusals noted by a process whose event loop is gone
    for _ in range(3):
        rejections._tally.note(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                               reason="workload_tpm", estimated_tokens=1, retry_after_ms=1)
    # when it exits (llm_platform/asgi.py registers this with atexit)
    assert rejections.rejection_tally_send_at_exit() is True
    # then every count reached Redis and the database
    flush()
    assert stat_totals() == Counter({(world.wl_a.id, "workload_tpm"): 3})
