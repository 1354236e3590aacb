"""Brownouts, outages and dead workers, through the real processes: the
gateway adapts to upstream 429s, retries cannot amplify an outage, and a
worker killed mid-call loses no work and charges nothing twice."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from budgets.admission import keys
from budgets.models import UsageRecord
from gateway.models import Job

from tests.gateway.ledger import ledger_rows

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Status check."}]


def chat(platform, api_key: str, *, max_tokens: int, output_tokens: int, session: str | None = None,
         latency_ms: int | None = None) -> httpx.Response:
    sim = {"output_tokens": output_tokens}
    if latency_ms:
        sim["latency_ms"] = latency_ms
    headers = {"Authorization": f"Bearer {api_key}"}
    if session:
        headers["X-Session-Id"] = session
    return httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=60, headers=headers,
                      json={"model": "sim-small", "messages": HELLO, "max_tokens": max_tokens, "sim": sim})


def test_gateway_adapts_to_a_brownout_and_interactive_keeps_its_rate(platform, make_caller, redis_client):
    # given a pool configured for 1,600 tokens/s of admission, whose real
    # capacity drops to ~500 tokens/s (6,000 tokens per simulated minute at
    # time-scale 5 = 12 s of real time)
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", provider_tpm=120_000)
    interactive = make_caller(pool=pool, reserved_tpm=12_000, ceiling_tpm=12_000, prompt_tokens_cap=100,
                              max_tokens_cap=100)
    batch = make_caller(pool=pool, workload_class="batch", reserved_tpm=12_000, ceiling_tpm=96_000,
                        prompt_tokens_cap=100, max_tokens_cap=400)
    platform.sim_reset()
    platform.sim_capacity(tpm=6_000)
    stop_at = time.monotonic() + 36
    interactive_log: list[tuple[float, int, str]] = []
    upstream_429s: list[tuple[float, int]] = []
    started = time.monotonic()

    def interactive_client() -> None:
        next_at = time.monotonic()
        while next_at < stop_at:
            time.sleep(max(0.0, next_at - time.monotonic()))
            response = chat(platform, interactive.api_key, max_tokens=60, output_tokens=60)
            code = response.json().get("error", {}).get("code", "") if response.status_code != 200 else ""
            interactive_log.append((time.monotonic() - started, response.status_code, code))
            next_at += 0.5  # ~140 tokens/s, well inside its 200 tokens/s reservation

    def batch_client() -> None:
        while time.monotonic() < stop_at:
            response = chat(platform, batch.api_key, max_tokens=400, output_tokens=380)
            if response.status_code == 429 and response.headers.get("retry-after-ms"):
                time.sleep(min(1.0, int(response.headers["retry-after-ms"]) / 1000))

    def watch_upstream() -> None:
        while time.monotonic() < stop_at:
            upstream_429s.append((time.monotonic() - started, platform.sim_stats()["rejected_429"]))
            time.sleep(0.5)

    try:
        threads = [threading.Thread(target=interactive_client), threading.Thread(target=watch_upstream)]
        threads += [threading.Thread(target=batch_client) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        platform.sim_reset()
    # then the gateway runs the pool at the provider's stated limit (its
    # x-ratelimit-limit-tokens, 30,000 per real minute, over the configured
    # 120,000: budgets/admission/provider_limits.py)...
    assert float(redis_client.hget(keys.pool_capacity(pool.id), "prov_factor")) == 0.25
    # ...upstream 429s, if any, stopped: none in the last 8 seconds
    increases = [t for (t, n), (_, prev) in zip(upstream_429s[1:], upstream_429s) if n > prev]
    assert not increases or max(increases) < 36 - 8, upstream_429s
    # ...and interactive kept its rate: every call of the last 12 s succeeded
    late = [entry for entry in interactive_log if entry[0] > 36 - 12]
    assert len(late) >= 20
    assert all(status == 200 for _, status, _ in late), late


def test_a_five_call_chain_during_an_outage_cannot_amplify(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    httpx.post(f"{platform.sim_url}/admin/outage", json={"seconds": 600, "status": 503}).raise_for_status()
    try:
        # when six agents each run a chain of five calls against a failing pool
        def chain(n: int) -> list[int]:
            return [chat(platform, caller.api_key, max_tokens=10, output_tokens=5, session=f"agent-{n}").status_code
                    for _ in range(5)]

        with concurrent.futures.ThreadPoolExecutor(6) as executor:
            statuses = [s for result in executor.map(chain, range(6)) for s in result]
        attempts = platform.sim_stats()["requests_total"]
    finally:
        httpx.post(f"{platform.sim_url}/admin/outage", json={"seconds": 0})
    # then every call failed cleanly, and the pool saw at most 1.1 attempts per call
    assert statuses == [502] * 30
    assert 30 <= attempts <= 33
    rows = ledger_rows(30, workload=caller.workload)
    assert len(rows) == 30
    assert sum(r.attempts for r in rows) == attempts
    assert all(r.status == "upstream_error" for r in rows)


def test_a_worker_killed_mid_call_loses_no_work_and_charges_once(platform, make_caller, redis_client, tmp_path):
    from tests.platform_harness import Process
    from llm_platform import processes
    import socket

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, workload_class="batch")
    platform.sim_reset()
    # given the batch lane served by a worker whose broker hands unacknowledged
    # messages back after 6 s (production: an hour, above every time limit)
    env = {**platform.env, "SLUICE_VISIBILITY_TIMEOUT_S": "6", "SLUICE_TASK_TIME_LIMIT_S": "5",
           "SLUICE_UNACKED_RESTORE_INTERVAL_S": "1"}
    platform.stop_worker("batch")

    def fragile_worker(name: str) -> Process:
        worker = Process(name, processes.worker_command(lane="batch", concurrency=2), env, tmp_path).start()
        deadline = time.monotonic() + 60
        while not redis_client.hexists("sluice:workers:ready", f"batch@{socket.gethostname()}"):
            worker.assert_alive()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        return worker

    redis_client.hdel("sluice:workers:ready", f"batch@{socket.gethostname()}")
    first = fragile_worker("batch-first")
    try:
        # when a job is mid-call (15 s of simulated latency = 3 s real at time-scale 5)
        response = httpx.post(f"{platform.base_url}/v1/jobs", timeout=30,
                              headers={"Authorization": f"Bearer {caller.api_key}"},
                              json={"model": "sim-small", "messages": HELLO, "max_tokens": 30,
                                    "sim": {"output_tokens": 7, "latency_ms": 15_000}})
        job_id = response.json()["id"]
        deadline = time.monotonic() + 20
        while platform.sim_stats()["requests_total"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # the pool is now working on it (3 s of latency)
        # and its worker dies without a chance to clean up
        first.kill()
        redis_client.hdel("sluice:workers:ready", f"batch@{socket.gethostname()}")
        second = fragile_worker("batch-second")
        try:
            deadline = time.monotonic() + 40
            while Job.objects.get(pk=job_id).status not in Job.FINAL:
                assert time.monotonic() < deadline, "the job was lost"
                time.sleep(0.2)
        finally:
            second.stop()
    finally:
        first.stop()
        platform.start_worker("batch")
        platform.wait_workers_ready(["batch"])
    # then the job completed once: one ledger row, buckets charged exactly
    # what the pool reported for the call that finished
    job = Job.objects.get(pk=job_id)
    assert job.status == "succeeded"
    rows = list(UsageRecord.objects.filter(workload=caller.workload))
    assert len(rows) == 1
    stats = platform.sim_stats()
    assert stats["completed"] == 1
    counters = {k: int(v) for k, v in redis_client.hgetall(keys.pool_counters(pool.id)).items()}
    assert counters[f"{caller.workload.id}.debited_tok"] == rows[0].actual_input_tokens + rows[0].actual_output_tokens
    assert rows[0].actual_output_tokens == 7
