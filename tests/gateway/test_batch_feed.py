"""The pacer's feed of running batches, step by step against the real
database and Redis (the platform's own pacer stopped meanwhile): a workload's lines in flight are bounded
across all its batches, oldest batch first; another workload has its own
room; a delayed line the delayed set lost is put back; a pending line is
made due exactly once however many pacers feed at once."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import close_old_connections
from django.utils import timezone

from gateway.core import keys
from gateway.core.batches.lifecycle import LOST_LINE_S, batches_step
from gateway.models import Batch, Job

pytestmark = pytest.mark.django_db(transaction=True)


def _batch(caller, lines: int, *, created_ago_s: float = 0) -> Batch:
    batch = Batch.objects.create(tenant=caller.tenant, workload=caller.workload, endpoint="/v1/chat/completions",
                                 status=Batch.Status.IN_PROGRESS, total=lines,
                                 expires_at=timezone.now() + timedelta(hours=24))
    Batch.objects.filter(pk=batch.pk).update(created_at=timezone.now() - timedelta(seconds=created_ago_s))
    Job.objects.bulk_create([
        Job(tenant=caller.tenant, workload=caller.workload, batch=batch, line=i + 1, custom_id=f"c{i}",
            status=Job.Status.PENDING, body={"model": "sim-small", "messages": [{"role": "user", "content": "x"}]},
            deadline=batch.expires_at)
        for i in range(lines)])
    return batch


def _by_status(batch: Batch) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in Job.objects.filter(batch=batch).values_list("status", flat=True):
        counts[status] = counts.get(status, 0) + 1
    return counts


@pytest.fixture
def flushed(platform, redis_client):
    """The delayed set empty, and the session platform's pacer stopped: these
    tests are the pacer (it shares their database and Redis)."""
    platform.pacer.stop()
    redis_client.delete(keys.DELAYED_JOBS)
    try:
        yield redis_client
    finally:
        redis_client.delete(keys.DELAYED_JOBS)
        platform.start_pacer()


def test_a_workloads_lines_in_flight_are_bounded_across_its_batches_oldest_first(make_caller, flushed, settings):
    settings.SLUICE_BATCH_LINES_IN_FLIGHT = 10
    caller = make_caller()
    older, newer = _batch(caller, 8, created_ago_s=60), _batch(caller, 8)
    other = _batch(make_caller(pool=caller.pool), 15)
    batches_step()
    assert _by_status(older) == {"delayed": 8}
    assert _by_status(newer) == {"delayed": 2, "pending": 6}  # what the older one left of the 10
    assert _by_status(other) == {"delayed": 10, "pending": 5}  # its own room
    assert flushed.zcard(keys.DELAYED_JOBS) == 20
    # a step with nothing finished feeds nothing more
    batches_step()
    assert flushed.zcard(keys.DELAYED_JOBS) == 20
    # three of the older batch's lines finish: three more start, in file order
    done = list(Job.objects.filter(batch=older).order_by("line")[:3])
    Job.objects.filter(pk__in=[j.pk for j in done]).update(status=Job.Status.SUCCEEDED)
    batches_step()
    assert _by_status(newer) == {"delayed": 5, "pending": 3}
    assert list(Job.objects.filter(batch=newer, status="delayed").order_by("line").values_list("line", flat=True)) \
        == [1, 2, 3, 4, 5]


def test_a_delayed_line_the_delayed_set_lost_is_put_back(make_caller, flushed):
    caller = make_caller()
    batch = _batch(caller, 3)
    batches_step()
    assert flushed.zcard(keys.DELAYED_JOBS) == 3
    # Redis loses the set; the lines have waited longer than LOST_LINE_S
    flushed.delete(keys.DELAYED_JOBS)
    Job.objects.filter(batch=batch).update(release_at=timezone.now() - timedelta(seconds=LOST_LINE_S + 1))
    batches_step()
    assert flushed.zcard(keys.DELAYED_JOBS) == 3
    assert set(flushed.zrange(keys.DELAYED_JOBS, 0, -1)) == {str(j) for j in Job.objects.filter(batch=batch)
                                                            .values_list("id", flat=True)}


def test_pacers_feeding_at_once_make_each_line_due_once(make_caller, flushed, settings):
    settings.SLUICE_BATCH_LINES_IN_FLIGHT = 1000
    settings.SLUICE_BATCH_POOL_SHARE = 1.0
    caller = make_caller(pool=make_caller.pool(max_concurrency=1000))
    batch = _batch(caller, 300)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def pacer():
        try:
            start.wait()
            batches_step()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            close_old_connections()

    threads = [threading.Thread(target=pacer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert _by_status(batch) == {"delayed": 300}
    assert flushed.zcard(keys.DELAYED_JOBS) == 300


def test_batch_lines_take_at_most_their_share_of_a_pools_in_flight_limit(make_caller, flushed, settings):
    settings.SLUICE_BATCH_POOL_SHARE = 0.25
    shared = make_caller.pool(max_concurrency=20)  # a share of 5 for every batch on it
    first, second = make_caller(pool=shared, rpm=100), make_caller(pool=shared, rpm=100)
    a, b = _batch(first, 10, created_ago_s=60), _batch(second, 10)
    elsewhere = _batch(make_caller(pool=make_caller.pool(max_concurrency=8)), 10)  # a share of 2
    batches_step()
    assert _by_status(a) == {"delayed": 5, "pending": 5}  # the older batch fed first
    assert _by_status(b) == {"pending": 10}
    assert _by_status(elsewhere) == {"delayed": 2, "pending": 8}
    # two of the first workload's lines finish: the pool's share has two places again
    Job.objects.filter(pk__in=list(Job.objects.filter(batch=a, status="delayed").values_list("pk", flat=True)[:2])) \
        .update(status=Job.Status.SUCCEEDED)
    batches_step()
    assert _by_status(a) == {"delayed": 5, "pending": 3, "succeeded": 2}
    assert _by_status(b) == {"pending": 10}


def test_queued_lines_whose_records_redis_lost_are_settled_from_the_ledger(make_caller, flushed, settings):
    from budgets.ledger.writer import LedgerEntry, usage_record_write

    caller = make_caller()
    batch = _batch(caller, 3)
    long_ago = timezone.now() - timedelta(seconds=settings.SLUICE_BATCH_LINE_QUEUE_S
                                          + settings.SLUICE_UPSTREAM_TIMEOUT_S + LOST_LINE_S + 5)
    lines = list(Job.objects.filter(batch=batch).order_by("line"))
    for job, request_id in zip(lines, ("req_billed", "req_unbilled", "req_alive")):
        Job.objects.filter(pk=job.pk).update(status=Job.Status.QUEUED, request_id=request_id, released_at=long_ago)
    # the first ran and is in the ledger; the third's record is still in Redis (its worker has it)
    usage_record_write(entry=LedgerEntry(
        request_id="req_billed", created_at=timezone.now(), tenant_id=caller.tenant.id, workload_id=caller.workload.id,
        pool_id=caller.pool.id, model="sim-small", lane="batch", status="ok", borrowed=False,
        estimated_input_tokens=10, estimated_output_tokens=5, actual_input_tokens=9, actual_output_tokens=5,
        queue_wait_ms=1, upstream_ms=10, ttft_ms=5, total_ms=12, attempts=1, error="", api_key_id=None,
        usage_source="pool"))
    flushed.hset(keys.request_record("req_alive"), "request_id", "req_alive")
    try:
        batches_step()
    finally:
        flushed.delete(keys.request_record("req_alive"))
    billed, unbilled, alive = (Job.objects.get(pk=j.pk) for j in lines)
    assert (billed.status, billed.reason) == ("failed", "result_lost")
    assert unbilled.status in ("pending", "delayed")  # back to run again (the same step may feed it)
    assert alive.status == "queued"


def test_a_line_released_but_never_enqueued_goes_back_to_pending_within_a_minute(make_caller, flushed):
    from budgets.admission import keys as budget_keys

    # given lines a pacer marked queued and admitted (their leases in Redis)
    # and was killed before enqueueing (no request record)
    caller = make_caller()
    batch = _batch(caller, 3)
    stale = timezone.now() - timedelta(seconds=LOST_LINE_S + 5)
    lines = list(Job.objects.filter(batch=batch).order_by("line"))
    for job, request_id, released_at in zip(lines, ("req_unsent", "req_unsent_new", "req_sent"),
                                            (stale, timezone.now(), stale)):
        Job.objects.filter(pk=job.pk).update(status=Job.Status.QUEUED, request_id=request_id, released_at=released_at)
        flushed.hset(budget_keys.lease(caller.pool.id, request_id), "wid", str(caller.workload.id))
    flushed.hset(keys.request_record("req_sent"), "request_id", "req_sent")  # this one reached its lane
    try:
        # when the pacer's next step looks at the batch
        batches_step()
    finally:
        for request_id in ("req_unsent", "req_unsent_new", "req_sent"):
            flushed.delete(budget_keys.lease(caller.pool.id, request_id), keys.request_record(request_id))
    unsent, recent, sent = (Job.objects.get(pk=j.pk) for j in lines)
    # then the stale unsent one runs again; a just-released one and one on its lane are left alone
    assert unsent.status in ("pending", "delayed")
    assert (recent.status, sent.status) == ("queued", "queued")


def _validating(caller, lines: int) -> Batch:
    import json

    from gateway.core.batches.files import file_write
    from gateway.models import BatchFile

    body = {"model": "sim-small", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    stored = file_write(tenant_id=caller.tenant.id, workload_id=caller.workload.id, purpose=BatchFile.Purpose.BATCH,
                        filename="in.jsonl", lines=(json.dumps({"custom_id": f"v{i}", "method": "POST",
                                                                "url": "/v1/chat/completions", "body": body}).encode()
                                                    + b"\n" for i in range(lines)))
    return Batch.objects.create(tenant=caller.tenant, workload=caller.workload, endpoint="/v1/chat/completions",
                                input_file=stored, expires_at=timezone.now() + timedelta(hours=24))


def test_two_validators_at_once_write_the_lines_once(make_caller, redis_client):
    from gateway.core.batches.lifecycle import batch_validate

    batch = _validating(make_caller(), 3000)
    results: list[str] = []
    start = threading.Barrier(2)

    def validator():
        try:
            start.wait()
            results.append(batch_validate(batch_id=batch.id))
        finally:
            close_old_connections()

    threads = [threading.Thread(target=validator) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) in (["in_progress", "running"], ["in_progress", "skipped"])
    batch.refresh_from_db()
    assert (batch.status, batch.total) == ("in_progress", 3000)
    assert Job.objects.filter(batch=batch, status="pending").count() == 3000
    assert sorted(Job.objects.filter(batch=batch).values_list("line", flat=True)) == list(range(1, 3001))


def test_a_cancel_while_validating_ends_the_batch_and_the_lines_written_go(make_caller, redis_client):
    from gateway.core.batches.lifecycle import batch_cancel, batch_validate

    batch = _validating(make_caller(), 20_000)
    outcome: list[str] = []
    validator = threading.Thread(target=lambda: (outcome.append(batch_validate(batch_id=batch.id)),
                                                 close_old_connections()))
    validator.start()
    deadline = time.monotonic() + 60
    while not Job.objects.filter(batch=batch).exists():  # some lines written: it is mid-file
        assert time.monotonic() < deadline and validator.is_alive()
        time.sleep(0.01)
    cancelled = batch_cancel(Batch.objects.get(pk=batch.id))
    validator.join()
    assert cancelled.status == "cancelled"
    assert outcome == ["cancelled"]
    assert not Job.objects.filter(batch=batch).exists()
    batch.refresh_from_db()
    assert batch.status == "cancelled"
