"""A worker lost mid-call (SIGKILL, OOM, a host gone) is noticed by its
silent heartbeat within seconds, and its request is taken over exactly once:
run again by a live worker while the retry deadline allows, finished with
the pool's stored answer if there is one, or else settled as ``worker_lost``,
charged on its estimate (the pool may have run it). A late finish by the old
worker settles and publishes nothing a second time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import socket
import time

import httpx
import pytest

from budgets.admission import keys
from budgets.redis.clients import redis_now_ms
from budgets.models import UsageRecord
from gateway.core import keys as gateway_keys
from gateway.core.request.finish import request_finish
from gateway.core.request.records import (FINISH, LOST, QUEUED, REAP, REQUEUE, RUNNING, SUPERSEDED, WATCH, WORKER, Outcome,
                                  RequestRecord, claim_call, publish_call)
from gateway.core.request.takeover import lost_requests_reap, request_take_over
from gateway.worker.execution import _answer_keep_settled, request_execute
from gateway.worker.heartbeat import Heartbeats
from gateway.web.dispatch import _await_outcome, _StreamFirstWait
from tests.gateway.stored import HELLO, RedisMonitor, admitted

pytestmark = pytest.mark.django_db(transaction=True)

DEAD_WORKER = "worker@lost-host:4242"


def counters(redis_client, pool_id: int) -> dict[str, int]:
    return {k: int(v) for k, v in redis_client.hgetall(keys.pool_counters(pool_id)).items()}


def started_by_a_worker_that_dies(redis_client, record: RequestRecord) -> None:
    claim = claim_call(WORKER, record, holder=DEAD_WORKER).run()
    assert (claim.verdict, claim.generation, claim.changed) == (WORKER, 0, True)
    assert redis_client.get(gateway_keys.request_heartbeat(record.request_id)) == f"0|{DEAD_WORKER}"
    # while its heartbeat lives, nobody takes it over
    assert claim_call(WATCH, record).run().verdict == RUNNING
    assert claim_call(REAP, record).run().verdict == RUNNING
    # then its heartbeat runs out (what SLUICE_HEARTBEAT_TTL_S does to a dead worker's)
    redis_client.delete(gateway_keys.request_heartbeat(record.request_id))


def run_again_once(platform, request_id: str, *, output_tokens: int) -> UsageRecord:
    """Wait for the ledger row of a request a live worker runs again after a
    takeover; it settled ok, once, with one call at the pool. Returns the row."""
    deadline = time.monotonic() + 30
    while not UsageRecord.objects.filter(request_id=request_id).exists():
        assert time.monotonic() < deadline, "the request was not run again"
        time.sleep(0.1)
    row = UsageRecord.objects.get(request_id=request_id)
    assert (row.status, row.actual_output_tokens) == ("ok", output_tokens)
    assert platform.sim_stats()["requests_total"] == 1
    return row


def wait_for_redis_clock(ms: float) -> None:
    deadline = time.monotonic() + 10
    while redis_now_ms() <= ms:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.redis_cluster
def test_a_silent_worker_is_taken_over_and_its_request_run_again_once(platform, make_caller, redis_client):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    record = admitted(redis_client, caller, "req_silent")
    started_by_a_worker_that_dies(redis_client, record)
    # when the waiting web side looks (once a heartbeat interval)
    claim = claim_call(WATCH, record).run()
    # then it takes the request over as delivery 1, once
    assert (claim.verdict, claim.generation, claim.changed) == (REQUEUE, 1, True)
    again = claim_call(WATCH, record).run()
    assert (again.verdict, again.generation, again.changed) == (QUEUED, 1, False)
    assert claim_call(REAP, record).run().changed is False
    # and the dead worker's own message, handed out again by the broker, is dropped unrun
    assert request_execute(request_id="req_silent", generation=0) == SUPERSEDED
    assert platform.sim_stats()["requests_total"] == 0
    # and delivery 1 calls the pool once and settles on what it reported
    assert request_execute(request_id="req_silent", generation=1) == "ok"
    assert platform.sim_stats()["requests_total"] == 1
    row = UsageRecord.objects.get(request_id="req_silent")
    assert (row.status, row.actual_output_tokens) == ("ok", 7)
    assert counters(redis_client, pool.id)[f"{caller.workload.id}.debited_tok"] == \
        row.actual_input_tokens + row.actual_output_tokens
    assert redis_client.zcard(keys.pool_leases(pool.id)) == 0
    # and the old worker coming back late with another answer changes nothing
    before = counters(redis_client, pool.id)
    late = Outcome(status="ok", body={"late": True}, input_tokens=500, output_tokens=500, attempts=1)
    request_finish(record=record, outcome=late, pool_called=True)
    assert counters(redis_client, pool.id) == before
    assert UsageRecord.objects.filter(request_id="req_silent").count() == 1
    published = redis_client.lrange(gateway_keys.request_result("req_silent"), 0, -1)
    assert [json.loads(raw)["output_tokens"] for raw in published] == [7]


@pytest.mark.redis_cluster
def test_a_lost_call_that_cannot_start_again_in_time_is_charged_on_its_estimate(make_caller, redis_client):
    # given a call whose retry deadline is 1.5 s after admission, started by
    # a worker that then died
    caller = make_caller()
    record = admitted(redis_client, caller, "req_too_late", queue_s=1.5, retry_s=1.5)
    started_by_a_worker_that_dies(redis_client, record)
    wait_for_redis_clock(record.retry_deadline_ms)
    # when the waiting web side notices, past the retry deadline
    claim = claim_call(WATCH, record).run()
    assert (claim.verdict, claim.changed) == (LOST, True)
    request_take_over(record=record, claim=claim)
    # then the caller's outcome is a 503 worker_lost with Retry-After
    outcome = Outcome.from_json(redis_client.lpop(gateway_keys.request_result("req_too_late")))
    assert (outcome.http_status, outcome.body["error"]["code"], outcome.retry_after_ms) == (503, "worker_lost", 1000)
    # and the ledger and the buckets charge the estimate, marked as such
    row = UsageRecord.objects.get(request_id="req_too_late")
    assert (row.status, row.error, row.actual_input_tokens, row.actual_output_tokens) == ("worker_lost", "worker_lost",
                                                                                          12, 30)
    wid = caller.workload.id
    assert counters(redis_client, caller.pool.id)[f"{wid}.debited_tok"] == 42
    assert counters(redis_client, caller.pool.id)[f"{wid}.admitted_req"] == 1
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0
    # and nobody acts on it again: not the web side, not a late delivery
    assert claim_call(WATCH, record).run().changed is False
    assert request_execute(request_id="req_too_late", generation=0) == LOST
    assert UsageRecord.objects.filter(request_id="req_too_late").count() == 1
    assert counters(redis_client, caller.pool.id)[f"{wid}.debited_tok"] == 42


@pytest.mark.redis_cluster
def test_a_redelivery_no_worker_starts_in_time_is_settled_by_the_late_one(make_caller, redis_client, settings):
    # given a lost worker's request put back on its lane, with 0.2 s to start
    settings.SLUICE_REDELIVERY_WAIT_S = 0.2
    caller = make_caller()
    record = admitted(redis_client, caller, "req_no_taker")
    started_by_a_worker_that_dies(redis_client, record)
    claim = claim_call(WATCH, record).run()
    assert (claim.verdict, claim.generation) == (REQUEUE, 1)
    wait_for_redis_clock(claim.now_ms + 200)
    # when the new delivery reaches a worker after its start-by time
    # then that worker settles it as lost, without calling the pool
    assert request_execute(request_id="req_no_taker", generation=1) == LOST
    row = UsageRecord.objects.get(request_id="req_no_taker")
    assert (row.status, row.actual_input_tokens + row.actual_output_tokens) == ("worker_lost", 42)
    assert counters(redis_client, caller.pool.id)[f"{caller.workload.id}.debited_tok"] == 42
    # and the waiting web side learns it from the outcome and the state alike
    assert json.loads(redis_client.lindex(gateway_keys.request_result("req_no_taker"), 0))["status"] == "worker_lost"
    assert claim_call(WATCH, record).run().verdict == "published"


@pytest.mark.redis_cluster
def test_a_lost_worker_whose_answer_was_stored_is_finished_with_it(platform, make_caller, redis_client):
    # given a worker that got the pool's answer, stored it and died before settling
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    record = admitted(redis_client, caller, "req_answered")
    started_by_a_worker_that_dies(redis_client, record)
    answer = Outcome(status="ok", body={"id": "chatcmpl-stored"}, input_tokens=9, output_tokens=4, attempts=1)
    redis_client.set(gateway_keys.request_response("req_answered"), answer.to_json(), px=60_000)
    # when the waiting web side takes it over
    claim = claim_call(WATCH, record).run()
    assert (claim.verdict, claim.generation, claim.changed) == (FINISH, 1, True)
    request_take_over(record=record, claim=claim)
    # then it is finished with the stored answer: the pool is not called again
    assert platform.sim_stats()["requests_total"] == 0
    row = UsageRecord.objects.get(request_id="req_answered")
    assert (row.status, row.actual_input_tokens, row.actual_output_tokens) == ("ok", 9, 4)
    assert counters(redis_client, pool.id)[f"{caller.workload.id}.debited_tok"] == 13
    assert Outcome.from_json(redis_client.lpop(gateway_keys.request_result("req_answered"))).body == \
        {"id": "chatcmpl-stored"}


@pytest.mark.redis_cluster
def test_the_reaper_takes_over_what_no_web_process_watches(platform, make_caller, redis_client):
    # given a request (a job, or one whose web process is gone too) whose worker died
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    record = admitted(redis_client, caller, "req_orphan", output_tokens=5)
    started_by_a_worker_that_dies(redis_client, record)
    # when the reaper passes, twice
    assert lost_requests_reap(pool_ids=[pool.id]) == 1
    assert lost_requests_reap(pool_ids=[pool.id]) == 0
    # then a live worker of its lane runs it (delivery 1) and it settles once
    row = run_again_once(platform, "req_orphan", output_tokens=5)
    assert counters(redis_client, pool.id)[f"{caller.workload.id}.debited_tok"] == \
        row.actual_input_tokens + row.actual_output_tokens


def test_a_sweep_claims_only_the_requests_whose_heartbeat_has_gone_quiet(platform, make_caller, redis_client):
    # given twenty calls whose worker renews their heartbeats, and one whose worker died
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    running = [admitted(redis_client, caller, f"req_beating_{i:02d}") for i in range(20)]
    for record in running:
        assert claim_call(WORKER, record, holder="worker@live-host:7").run().verdict == WORKER
    lost = admitted(redis_client, caller, "req_quiet", output_tokens=5)
    started_by_a_worker_that_dies(redis_client, lost)

    # when the reaper passes, every command Redis runs watched
    monitor = RedisMonitor(redis_client)
    try:
        moved = lost_requests_reap(pool_ids=[pool.id])
    finally:
        commands = monitor.stop()

    # then it took over the quiet one alone
    assert moved == 1
    assert {redis_client.get(gateway_keys.request_owner(record.request_id)) for record in running} == {"worker:0"}
    # and of the running ones it read the owner and the heartbeat, in one
    # round trip with the others', and nothing else: no record, no claim
    touched = [text.split()[0].strip('"').upper() for client, text in commands
               if client != "lua" and "req_beating_" in text]
    assert (len(touched), set(touched)) == (40, {"GET"})
    # and the quiet one, claimed, is run again once by a live worker of its lane
    run_again_once(platform, "req_quiet", output_tokens=5)


@pytest.mark.redis_cluster
def test_the_pacer_takes_over_what_no_web_process_watches_once_its_sweep_is_due(
        platform, make_caller, redis_client, settings, monkeypatch):
    # given two requests whose worker died, watched by no web process, and a
    # pacer stepping in this process (the session's own pacers do not sweep)
    from gateway.worker import pacer

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    swept, unswept = (admitted(redis_client, caller, request_id, output_tokens=5)
                      for request_id in ("req_swept", "req_unswept"))
    started_by_a_worker_that_dies(redis_client, swept)
    settings.SLUICE_TAKEOVER_SWEEP_S = 5.0

    def owner(record) -> str:
        return redis_client.get(gateway_keys.request_owner(record.request_id))

    # when the pacer steps before its sweep is due
    monkeypatch.setattr(pacer, "_takeover_next", time.monotonic() + 60)
    pacer.pacer_step()
    # then the request stays with its lost worker
    assert owner(swept) == "worker:0"
    # when the sweep comes due and the pacer steps twice
    monkeypatch.setattr(pacer, "_takeover_next", 0.0)
    pacer.pacer_step()
    pacer.pacer_step()
    # then it was put back on its lane as delivery 1, once: a live worker of
    # its lane runs it and it settles once
    assert owner(swept).startswith("queued:1:") or owner(swept) == "worker:1"
    run_again_once(platform, "req_swept", output_tokens=5)
    # and with the sweep off (0), a due pacer step leaves a lost request alone
    started_by_a_worker_that_dies(redis_client, unswept)
    settings.SLUICE_TAKEOVER_SWEEP_S = 0
    monkeypatch.setattr(pacer, "_takeover_next", 0.0)
    pacer.pacer_step()
    assert owner(unswept) == "worker:0"


@pytest.mark.redis_cluster
def test_a_worker_lost_between_its_answers_publish_and_its_ledger_row_is_finished_by_the_reaper(
        make_caller, redis_client):
    # given a worker that stored, settled and published its own answer in one
    # round trip (the caller has it), and then died before its ledger row
    caller = make_caller()
    record = admitted(redis_client, caller, "req_published")
    assert claim_call(WORKER, record, holder=DEAD_WORKER).run().verdict == WORKER
    answer = Outcome(status="ok", body={"id": "chatcmpl-published"}, input_tokens=9, output_tokens=4, attempts=1)
    assert _answer_keep_settled(redis_client, record, answer, signals=[]) == (answer, True, True)
    assert Outcome.from_json(redis_client.lindex(gateway_keys.request_result("req_published"), 0)) == answer
    # while its heartbeat lives, it is writing its row: nobody acts
    assert claim_call(REAP, record).run().changed is False
    assert lost_requests_reap(pool_ids=[caller.pool.id]) == 0
    redis_client.delete(gateway_keys.request_heartbeat(record.request_id))
    # and the web side, which has its answer, does not act either
    watch = claim_call(WATCH, record).run()
    assert (watch.verdict, watch.changed) == ("published", False)
    assert not UsageRecord.objects.filter(request_id="req_published").exists()
    # when the reaper passes, twice
    assert lost_requests_reap(pool_ids=[caller.pool.id]) == 1
    assert lost_requests_reap(pool_ids=[caller.pool.id]) == 0
    # then the row is written on the published answer, once; the buckets are
    # charged once and the caller's answer is not published again
    row = UsageRecord.objects.get(request_id="req_published")
    assert (row.status, row.actual_input_tokens, row.actual_output_tokens) == ("ok", 9, 4)
    assert counters(redis_client, caller.pool.id)[f"{caller.workload.id}.debited_tok"] == 13
    assert redis_client.llen(gateway_keys.request_result("req_published")) == 1
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0
    # and the dead worker's message, handed out again, finds it finished
    assert request_execute(request_id="req_published", generation=0) == RUNNING
    assert UsageRecord.objects.filter(request_id="req_published").count() == 1
    assert counters(redis_client, caller.pool.id)[f"{caller.workload.id}.debited_tok"] == 13


def test_a_running_call_keeps_its_heartbeat_until_it_ends(make_caller, redis_client, settings):
    # given fast heartbeats: a beat every 0.1 s, lost after 0.4 s of silence
    settings.SLUICE_HEARTBEAT_INTERVAL_S = 0.1
    settings.SLUICE_HEARTBEAT_TTL_S = 0.4
    caller = make_caller()
    record = admitted(redis_client, caller, "req_beating")
    beats = Heartbeats()
    assert claim_call(WORKER, record, holder=beats.holder).run().verdict == WORKER
    # when the call runs for three times the TTL
    with beats.kept(request_id="req_beating", generation=0):
        until = time.monotonic() + 1.2
        while time.monotonic() < until:
            # then the watchers see it alive throughout
            assert claim_call(WATCH, record).run().verdict == RUNNING
            time.sleep(0.05)
        assert beats.running() == {"req_beating": 0}
    # and once the process stops beating, it is taken over within the TTL
    deadline = time.monotonic() + 2
    while redis_client.exists(gateway_keys.request_heartbeat("req_beating")):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert claim_call(WATCH, record).run().verdict == REQUEUE


@pytest.mark.slow
def test_a_worker_killed_under_load_is_noticed_and_every_caller_answered_within_10s(platform, make_caller,
                                                                                     redis_client, tmp_path):
    from llm_platform import processes
    from tests.platform_harness import Process, WORKER_READY_KEY

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    # given two interactive workers of 20 threads (as on two hosts) in place of the platform's one
    platform.stop_worker("interactive")
    workers = {}
    for name in ("survivor", "victim"):
        command = processes.worker_command(lane="interactive", concurrency=20)
        command[command.index("-n") + 1] = f"interactive-{name}@%h"
        redis_client.hdel(WORKER_READY_KEY, f"interactive-{name}@{socket.gethostname()}")
        workers[name] = Process(f"worker-interactive-{name}", command, platform.env, tmp_path).start()
    try:
        deadline = time.monotonic() + 60
        for name, worker in workers.items():
            while not redis_client.hexists(WORKER_READY_KEY, f"interactive-{name}@{socket.gethostname()}"):
                worker.assert_alive()
                assert time.monotonic() < deadline
                time.sleep(0.1)

        # when 40 callers each send a request that takes the pool 2.5 s
        # (12.5 simulated seconds at time-scale 5)
        def call(n: int) -> tuple[int, str, float]:
            response = httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {caller.api_key}"},
                                  json={"model": "sim-small", "messages": HELLO, "max_tokens": 20,
                                        "sim": {"output_tokens": 5, "latency_ms": 12_500}})
            code = "" if response.status_code == 200 else response.json()["error"]["code"]
            return response.status_code, code, time.monotonic()

        with concurrent.futures.ThreadPoolExecutor(40) as executor:
            futures = [executor.submit(call, n) for n in range(40)]
            # and one worker is SIGKILLed while all 40 calls are in flight
            beats = {}
            deadline = time.monotonic() + 30
            while len(beats) < 40:
                assert time.monotonic() < deadline, f"only {len(beats)} calls started"
                beats = {key: redis_client.get(key) for key in redis_client.scan_iter(match="sluice:req:*:hb")}
                time.sleep(0.05)
            victim_holder = f"worker@{socket.gethostname()}:{workers['victim'].popen.pid}:"
            held_by_victim = sum(1 for value in beats.values() if value and victim_holder in value)
            time.sleep(0.3)
            killed_at = time.monotonic()
            workers["victim"].kill()
            answers = [future.result() for future in futures]
    finally:
        for worker in workers.values():
            worker.stop()
        platform.start_worker("interactive")
        platform.wait_workers_ready(["interactive"])
    # then the victim held calls, and every caller was answered within 10 s of the kill
    assert 0 < held_by_victim < 40
    assert max(at for _, _, at in answers) - killed_at < 10.0
    kinds = sorted({(status, code) for status, code, _ in answers})
    assert set(kinds) <= {(200, ""), (503, "worker_lost")}, kinds
    served = sum(1 for status, _, _ in answers if status == 200)
    lost = 40 - served
    # and the victim's unfinished calls that were not lost went to the pool a
    # second time (those it finished just before dying were not), nobody else's
    assert 40 < platform.sim_stats()["requests_total"] <= 40 + held_by_victim - lost
    # and the ledger has one row per request, as its caller was told
    deadline = time.monotonic() + 20
    while UsageRecord.objects.filter(workload=caller.workload).count() < 40:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    rows = list(UsageRecord.objects.filter(workload=caller.workload))
    assert len(rows) == 40
    assert sorted(r.status for r in rows) == ["ok"] * served + ["worker_lost"] * lost
    assert all(r.actual_output_tokens == 5 for r in rows if r.status == "ok")
    # and the buckets charged exactly what the ledger did
    charged = sum(r.actual_input_tokens + r.actual_output_tokens for r in rows)
    assert counters(redis_client, pool.id)[f"{caller.workload.id}.debited_tok"] == charged
    assert redis_client.zcard(keys.pool_leases(pool.id)) == 0


# -- a stream's wait for its first chunk -------------------------------------------


def test_a_stream_waiting_for_its_first_chunk_costs_one_claim_a_look_and_takes_an_outcome_without_its_marker(
        make_caller, redis_client, settings):
    # given a streamed request nobody runs yet, watched every 0.2 s
    settings.SLUICE_HEARTBEAT_INTERVAL_S = 0.2
    caller = make_caller()
    record = dataclasses.replace(admitted(redis_client, caller, "req_no_marker"), stream=True)
    result_key = gateway_keys.request_result(record.request_id)
    outcome = Outcome(status="ok", body={"id": "chatcmpl-1"}, input_tokens=12, output_tokens=7, attempts=1,
                      streamed=True)

    async def waited() -> tuple[Outcome, float]:
        first = _StreamFirstWait(record)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # then, after three looks, its outcome is published without the
        # stream's end marker (a finish stopped between the two)
        loop.call_later(0.7, lambda: publish_call(record, outcome).run())
        try:
            # the context is read only when the wait gives up at its deadline (10 s away)
            got = await asyncio.wait_for(_await_outcome(None, record, wait=first), 5)
        finally:
            first.close()
        return got, loop.time() - started

    monitor = RedisMonitor(redis_client)
    try:
        got, waited_s = asyncio.run(waited())
    finally:
        commands = monitor.stop()

    # then the next look finds it published and takes it: the caller is answered
    assert (got.status, got.output_tokens, got.body) == ("ok", 7, {"id": "chatcmpl-1"})
    assert 0.7 <= waited_s < 1.5
    assert redis_client.llen(result_key) == 0
    # and each look before it was one claim, with no read of the result list between
    own = [text for kind, text in commands if kind != "lua" and record.request_id in text]
    pops = [text for text in own if text.upper().startswith(("LPOP", "BLPOP"))]
    claims = [text for text in own if text.upper().startswith("EVALSHA")]
    assert len(pops) == 1
    assert 4 <= len(claims) <= 6
