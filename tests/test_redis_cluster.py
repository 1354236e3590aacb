"""Sluice on Redis Cluster. Every Lua script's KEYS share one hash slot and
none is empty (a cluster routes a script by its keys and refuses keys in two
slots); and the tests marked ``redis_cluster`` (admission, settlement, the
deadline claim, the outcome hand-back, lost workers, the pacer, jobs, the
budget-accuracy test) pass against a real 3-master cluster that this test
starts, with the Celery broker on a plain Redis beside it, exactly as an
operator runs it (README, "Production")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import dj_database_url
import pytest
from django.conf import settings
from redis.crc import key_slot

from budgets.admission.buckets import admit_call, settle_call
from budgets.admission.capacity import capacity_signal_call
from budgets.admission.spend_holds import SpendHold, spend_hold_call, spend_reconcile_call, spend_settle_call
from budgets.redis.clients import get_redis
from budgets.ledger.rejections import rejection_count_call
from gateway.core.metrics import departure_call
from gateway.core.request.records import WATCH, WORKER, Outcome, RequestRecord, claim_call, publish_call, record_claim_steps
from gateway.worker.lane_slot import SlotHold, lane_signal_steps
from gateway.worker.retry import RetryPolicy, retry_budget_earn_call
from llm_platform.processes import ROOT
from tests.redis_servers import LocalRedisCluster, PlainRedis

# The marked tests live here; the child run collects only these.
MARKED_PATHS = ["tests/budgets/test_admission.py", "tests/budgets/test_spend_admission.py", "tests/gateway",
                "tests/test_redis_cluster.py"]


def _one_slot(keys: list[str]) -> set[int]:
    assert all(keys), f"an empty key name: {keys}"
    return {key_slot(key.encode()) for key in keys}


def test_every_script_call_names_keys_of_one_slot_and_none_empty():
    record = RequestRecord(
        request_id="req_0123abcd", tenant_id=1, workload_id=2, pool_id=3, pool_base_url="http://pool/v1",
        pool_api_key_env="", model="m", lane="interactive", borrowed=False, estimated_input_tokens=1,
        estimated_output_tokens=1, admitted_ms=0.0, deadline_ms=1.0, payload={},
    )
    hold = SpendHold(tenant_id=1, workload_id=2, cost_micro=5, month="2026-01", month_end_ms=1.0)
    calls = [
        admit_call(pool_id=3, workload_id=2, request_id="req_0123abcd", input_tokens=1, output_tokens=1,
                   lease_ttl_ms=1),
        settle_call(pool_id=3, workload_id=2, request_id="req_0123abcd", actual_input_tokens=1,
                    actual_output_tokens=1),
        # A tenant's spend spans its pools: its keys carry the tenant's tag, in
        # scripts of their own (never together with a pool's keys).
        spend_hold_call(hold, request_id="req_0123abcd", lease_ttl_ms=1),
        spend_settle_call(tenant_id=1, month="2026-01", request_id="req_0123abcd", actual_cost_micro=4),
        spend_reconcile_call(tenant_id=1, month="2026-01", caps_micro={"T1": 10}, ledger_micro={"T1": 3},
                             in_ledger=[]),
        claim_call(WORKER, record), claim_call(WATCH, record),
        publish_call(record, Outcome(status="ok")),
        rejection_count_call(pool_id=3, workload_id=2, tenant_id=1, reason="workload_tpm", estimated_tokens=1,
                             retry_after_ms=1),
        departure_call(pool_id=3, lane="interactive", request_id="req_0123abcd", time_in_system_ms=1),
    ]
    # A worker's read of the record and its claim run as one composed script.
    read_and_claim = [step.call for step in record_claim_steps("req_0123abcd", generation=0, holder="w")]
    assert len(_one_slot([key for call in read_and_claim for key in call.keys])) == 1
    calls += read_and_claim
    for call in calls:
        assert len(_one_slot(call.keys)) == 1, (call.script.name, call.keys)
    # What a worker reports of one pool answer runs as one composed script
    # (a RoundTrip): all of its calls' keys share the pool's slot.
    answer = Outcome(status="ok", upstream_ms=10, output_tokens=3, upstream_status=200)
    signals = [*(step.call for step in lane_signal_steps(record, answer, hold=SlotHold())),
               capacity_signal_call(pool_id=3, event="ok", latency_per_token_ms=1.0),
               retry_budget_earn_call(pool_id=3, policy=RetryPolicy.from_settings())]
    assert len(_one_slot([key for call in signals for key in call.keys])) == 1
    assert {key_slot(k.encode()) for call in calls[2:5] for k in call.keys} == {key_slot(b"{tenant:1}")}


def test_a_cluster_without_a_broker_of_its_own_is_refused():
    env = {**os.environ, "SLUICE_REDIS_CLUSTER": "true", "CELERY_BROKER_URL": ""}
    result = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, capture_output=True,
                            text=True, env={**env, "DJANGO_SETTINGS_MODULE": "llm_platform.settings"}, timeout=60)
    assert result.returncode != 0
    assert "SLUICE_REDIS_CLUSTER=true needs CELERY_BROKER_URL" in result.stderr


@pytest.mark.redis_cluster
def test_the_clients_are_the_kind_the_setting_names():
    from redis.cluster import RedisCluster

    client = get_redis()
    assert isinstance(client, RedisCluster) is settings.SLUICE_REDIS_CLUSTER
    assert client.ping() is True


def _child_database_url() -> str:
    """The child run's own database (pytest-django prefixes test_)."""
    url = dj_database_url.parse(os.environ["DATABASE_URL"])
    user = url.get("USER") or "postgres"
    password = f":{url['PASSWORD']}" if url.get("PASSWORD") else ""
    return (f"postgres://{user}{password}@{url.get('HOST') or '127.0.0.1'}:{url.get('PORT') or 5432}/"
            f"{url['NAME']}_cluster")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_marked_tests_pass_on_a_three_master_redis_cluster(tmp_path):
    if settings.SLUICE_REDIS_CLUSTER:
        pytest.skip("this run is the cluster run")
    # given a 3-master Redis Cluster and a plain Redis for the broker
    cluster = LocalRedisCluster(tmp_path / "cluster").start()
    broker = PlainRedis(tmp_path / "broker").start()
    try:
        env = {**os.environ, "REDIS_URL": cluster.url, "SLUICE_REDIS_CLUSTER": "true",
               "CELERY_BROKER_URL": broker.url, "DATABASE_URL": _child_database_url(),
               "SLUICE_TEST_LOG_DIR": str(tmp_path / "logs")}
        pytest_args = [sys.executable, "-m", "pytest", "-m", "redis_cluster", "-p", "no:randomly", *MARKED_PATHS]
        collected = subprocess.run([*pytest_args, "--collect-only", "-q"], cwd=ROOT, env=env, capture_output=True,
                                   text=True, timeout=120)
        expected = re.search(r"(\d+)/\d+ tests collected", collected.stdout)
        assert expected, collected.stdout[-3000:] + collected.stderr[-3000:]
        # when the marked tests run against them
        junit = tmp_path / "cluster-run.xml"
        result = subprocess.run([*pytest_args, "-q", "--junitxml", str(junit), "--basetemp", str(tmp_path / "child")],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
        # then every one of them ran and passed (the client-kind test among them: on the cluster)
        assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]
        suite = ET.parse(junit).getroot().find("testsuite")
        counts = {name: int(suite.get(name)) for name in ("tests", "failures", "errors", "skipped")}
        assert counts == {"tests": int(expected.group(1)), "failures": 0, "errors": 0, "skipped": 0}
        assert counts["tests"] >= 30
        # and every master served scripts: the keys spread over all three shards
        for node in cluster.nodes():
            stats = node.info("commandstats")
            assert stats.get("cmdstat_evalsha", {}).get("calls", 0) > 0, node
    finally:
        broker.stop()
        cluster.stop()
