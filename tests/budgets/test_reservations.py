"""Reservations, lending and ceilings under concurrent load (docs/architecture.md: I2-I4),
with the layout a platform team would start with: chat 60% of the pool
reserved and lending half of it, a summarizer 30% reserved with a 50%
ceiling, a nightly enrichment 10%, scheduled."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from budgets.admission.buckets import admit
from budgets.errors import Rejected
from budgets.models import Reservation

pytestmark = pytest.mark.django_db(transaction=True)

# provider 300,000 TPM x headroom 0.8 = 240,000 TPM = 4,000 tokens/s; 2 s of burst.
POOL = dict(provider_tpm=300_000, provider_rpm=1_000_000, headroom=0.8, burst_seconds=2.0)
REQUEST_TOKENS = 100


def layout(make_caller):
    pool = make_caller.pool(**POOL)
    chat = make_caller(pool=pool, reserved_tpm=144_000, ceiling_tpm=200_000, lend_fraction=0.5, rpm=100_000,
                       prompt_tokens_cap=100, max_tokens_cap=100)
    summarizer = make_caller(pool=pool, workload_class="batch", reserved_tpm=72_000, ceiling_tpm=120_000, rpm=100_000,
                             prompt_tokens_cap=100, max_tokens_cap=100)
    nightly = make_caller(pool=pool, workload_class="scheduled", reserved_tpm=24_000, ceiling_tpm=24_000, rpm=100_000,
                          prompt_tokens_cap=100, max_tokens_cap=100)
    return pool, chat, summarizer, nightly


def attempt(caller) -> Rejected | None:
    try:
        admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=uuid.uuid4().hex, input_tokens=0,
              output_tokens=REQUEST_TOKENS, lease_ttl_ms=600_000)
        return None
    except Rejected as rejected:
        return rejected


class Driver:
    """Sends REQUEST_TOKENS-sized requests for one workload, either paced at
    ``tokens_per_s`` on an absolute schedule or as fast as it can."""

    def __init__(self, caller, *, tokens_per_s: float | None, threads: int = 1):
        self.caller = caller
        self.tokens_per_s = tokens_per_s
        self.threads = threads
        self.admitted = 0
        self.rejections: list[str] = []
        self.lock = threading.Lock()

    def run(self, stop_at: float) -> list[threading.Thread]:
        def paced() -> None:
            interval = REQUEST_TOKENS / self.tokens_per_s
            next_at = time.monotonic()
            while next_at < stop_at:
                time.sleep(max(0.0, next_at - time.monotonic()))
                self._record(attempt(self.caller))
                next_at += interval

        def flood() -> None:
            while time.monotonic() < stop_at:
                self._record(attempt(self.caller))

        target = paced if self.tokens_per_s else flood
        workers = [threading.Thread(target=target) for _ in range(self.threads)]
        for worker in workers:
            worker.start()
        return workers

    def _record(self, outcome: Rejected | None) -> None:
        with self.lock:
            if outcome is None:
                self.admitted += 1
            else:
                self.rejections.append(outcome.reason)

    @property
    def admitted_tokens(self) -> int:
        return self.admitted * REQUEST_TOKENS


def drive(drivers: list[Driver], seconds: float) -> float:
    started = time.monotonic()
    stop_at = started + seconds
    threads = [t for d in drivers for t in d.run(stop_at)]
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def test_i2_and_i3_reservations_hold_while_the_summarizer_floods(make_caller):
    pool, chat, summarizer, nightly = layout(make_caller)
    # given chat sending below its unlent half (72,000 TPM = 1,200 tokens/s)
    # and nightly below its reservation (400 tokens/s), while the summarizer
    # floods with four threads
    chat_driver = Driver(chat, tokens_per_s=1_000)
    nightly_driver = Driver(nightly, tokens_per_s=300)
    flood = Driver(summarizer, tokens_per_s=None, threads=4)
    elapsed = drive([chat_driver, nightly_driver, flood], seconds=4.0)
    # then neither protected workload was ever refused for budget (I2)
    assert chat_driver.rejections == []
    assert nightly_driver.rejections == []
    assert chat_driver.admitted >= 30 and nightly_driver.admitted >= 9
    # and the summarizer never passed its ceiling: 2,000 tokens/s + 4,000 burst (I3)
    assert flood.admitted_tokens <= 4_000 + 2_000 * elapsed + REQUEST_TOKENS
    # while it was refused plenty, for its ceiling or for the pool
    assert set(flood.rejections) <= {"workload_tpm", "pool_tpm"}
    assert len(flood.rejections) > 0


def test_i4_a_lone_workload_borrows_up_to_its_ceiling(make_caller):
    pool, chat, summarizer, nightly = layout(make_caller)
    # given everyone else idle, when the summarizer floods alone
    flood = Driver(summarizer, tokens_per_s=None, threads=2)
    elapsed = drive([flood], seconds=3.0)
    # then it reaches its ceiling (burst + 2,000 tokens/s), far past its
    # reservation (1,200 tokens/s), and not beyond
    ceiling_tokens = 4_000 + 2_000 * elapsed
    assert flood.admitted_tokens >= 0.9 * ceiling_tokens
    assert flood.admitted_tokens <= ceiling_tokens + REQUEST_TOKENS
    assert flood.admitted_tokens > 2_400 + 1_200 * elapsed + 2 * REQUEST_TOKENS


def test_strict_reservation_is_not_lent(make_caller):
    # given nightly idle (lend 0) and chat idle (lend 0.5), the summarizer can
    # borrow unreserved capacity and chat's lent half, never nightly's
    pool, chat, summarizer, nightly = layout(make_caller)
    admitted = 0
    while attempt(summarizer) is None:
        admitted += 1
        assert admitted < 1_000
    # whatever the summarizer took, nightly's full bucket (24,000 TPM x 2 s)
    # and chat's unlent half (72,000 TPM x 2 s) are still there
    for _ in range(800 // REQUEST_TOKENS):
        assert attempt(nightly) is None
    for _ in range(2_400 // REQUEST_TOKENS):
        assert attempt(chat) is None


def test_reservation_changes_reach_admission_without_a_restart(make_caller):
    pool = make_caller.pool(burst_seconds=15.0)
    caller = make_caller(pool=pool, reserved_tpm=6_000, ceiling_tpm=6_000, prompt_tokens_cap=100, max_tokens_cap=100)
    # a 2,000-token request does not fit a 1,500-token ceiling bucket
    big = dict(pool_id=pool.id, workload_id=caller.workload.id, input_tokens=0, output_tokens=2_000, lease_ttl_ms=60_000)
    with pytest.raises(Rejected) as excinfo:
        admit(request_id="r1", **big)
    assert excinfo.value.reason == "request_too_large"
    # when an admin raises the ceiling (a save, as Django admin does)
    reservation = Reservation.objects.get(pk=caller.reservation.pk)
    reservation.ceiling_tpm = 12_000
    reservation.save()
    # then the very next admission uses it
    admitted = admit(request_id="r2", **big)
    assert admitted.rate_limits.remaining_tokens == 1_000
