"""Faults that must lose no accepted work and charge nothing twice: Redis
losing its state, leases whose worker vanished, the database going away
under a worker."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
import pytest

from budgets.admission import keys
from budgets.admission.buckets import admit
from budgets.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "still there?"}]


def _other_connection():
    """A PostgreSQL connection of the test's own, outside Django, to hold a
    lock (a migration's) while the platform works."""
    import psycopg
    from django.db import connection

    params = connection.get_connection_params()
    return psycopg.connect(**{k: v for k, v in params.items() if k in ("dbname", "user", "password", "host", "port")},
                           autocommit=False)


@contextlib.contextmanager
def _batch_worker_instead(platform, redis_client, name: str, env: dict[str, str], tmp_path, *, concurrency: int):
    """The batch lane served, inside the block, by a worker started with
    ``env`` (once it is ready); the session's batch worker back after it."""
    from llm_platform import processes
    from tests.platform_harness import Process

    platform.stop_worker("batch")
    hostname = f"batch@{socket.gethostname()}"
    redis_client.hdel("sluice:workers:ready", hostname)
    worker = Process(name, processes.worker_command(lane="batch", concurrency=concurrency), env, tmp_path).start()
    try:
        deadline = time.monotonic() + 60
        while not redis_client.hexists("sluice:workers:ready", hostname):
            worker.assert_alive()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield worker
    finally:
        worker.stop()
        platform.start_worker("batch")
        platform.wait_workers_ready(["batch"])


def test_bucket_config_lost_by_redis_is_rebuilt_on_the_next_request(platform, make_caller, redis_client):
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"))
    # given Redis restarted empty (the pool's config and buckets are gone)
    redis_client.delete(keys.pool_config(caller.pool.id), keys.pool_workloads(caller.pool.id),
                        keys.pool_buckets(caller.pool.id))
    # then the next request rebuilds them from the database and goes through
    response = httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {caller.api_key}"},
                          json={"model": "sim-small", "messages": HELLO, "max_tokens": 5})
    assert response.status_code == 200, response.text
    assert redis_client.hget(keys.pool_config(caller.pool.id), f"{caller.workload.id}.E.tok.rate") is not None


def test_expired_leases_are_reaped_once_and_recorded(make_caller, redis_client):
    from gateway.worker.execution import leases_reap
    from gateway.core.request.records import RequestRecord
    from gateway.core import keys as gateway_keys

    caller = make_caller()
    admission = admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id="req_lost", input_tokens=10,
                      output_tokens=20, lease_ttl_ms=1)
    record = RequestRecord(
        request_id="req_lost", tenant_id=caller.tenant.id, workload_id=caller.workload.id, pool_id=caller.pool.id,
        pool_base_url=caller.pool.base_url, pool_api_key_env="", model="sim-small", lane="interactive", borrowed=False,
        estimated_input_tokens=10, estimated_output_tokens=20, admitted_ms=admission.admitted_ms,
        deadline_ms=admission.admitted_ms + 1, payload={},
    )
    redis_client.hset(gateway_keys.request_record("req_lost"), mapping=record.to_redis())
    time.sleep(0.01)
    assert leases_reap(pool_ids=[caller.pool.id]) == 1
    assert leases_reap(pool_ids=[caller.pool.id]) == 0
    row = UsageRecord.objects.get(request_id="req_lost")
    assert row.status == "lease_expired"
    # the estimate stays charged (the pool may have served it), nothing more
    counters = redis_client.hgetall(keys.pool_counters(caller.pool.id))
    assert int(counters[f"{caller.workload.id}.debited_tok"]) == 30
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0
    # a late redelivery finds no record and does not call the pool
    from gateway.worker.execution import request_execute

    assert request_execute(request_id="req_lost") == "missing"


def test_a_lease_whose_row_the_database_refuses_is_reaped_again_and_charged_once(make_caller, redis_client):
    """The reaper writes an expired lease's row before it lets the lease go:
    the database failing that row (here: a lock past this connection's
    lock_timeout) leaves the lease for the next pass, which writes the row
    once and settles nothing twice."""
    from django.db import OperationalError, connection

    from gateway.core import keys as gateway_keys
    from gateway.core.request.records import RequestRecord
    from gateway.worker.execution import leases_reap

    caller = make_caller()
    admission = admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id="req_held_row",
                      input_tokens=10, output_tokens=20, lease_ttl_ms=1)
    record = RequestRecord(
        request_id="req_held_row", tenant_id=caller.tenant.id, workload_id=caller.workload.id,
        pool_id=caller.pool.id, pool_base_url=caller.pool.base_url, pool_api_key_env="", model="sim-small",
        lane="interactive", borrowed=False, estimated_input_tokens=10, estimated_output_tokens=20,
        admitted_ms=admission.admitted_ms, deadline_ms=admission.admitted_ms + 1, payload={},
    )
    redis_client.hset(gateway_keys.request_record("req_held_row"), mapping=record.to_redis())
    time.sleep(0.01)
    locker = _other_connection()
    # given the ledger table locked, and this connection giving up on a lock after 0.2 s
    try:
        locker.execute(f"LOCK TABLE {UsageRecord._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        # when the reaper finds the expired lease
        with pytest.raises(OperationalError):
            leases_reap(pool_ids=[caller.pool.id])
    finally:
        locker.rollback()
        locker.close()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    # then the lease is still there for the next pass
    assert redis_client.zscore(keys.pool_leases(caller.pool.id), "req_held_row") is not None
    # which writes the row once and lets it go
    assert leases_reap(pool_ids=[caller.pool.id]) == 1
    assert leases_reap(pool_ids=[caller.pool.id]) == 0
    assert list(UsageRecord.objects.filter(request_id="req_held_row").values_list("status", flat=True)) == \
        ["lease_expired"]
    # and the estimate was charged once
    counters = redis_client.hgetall(keys.pool_counters(caller.pool.id))
    assert int(counters[f"{caller.workload.id}.debited_tok"]) == 30
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0


class CuttableProxy:
    """A TCP proxy to PostgreSQL that the test can cut and restore: the
    database going away, for one worker only."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self.open = threading.Event()
        self.open.set()
        self._writers: set = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader, writer):
        if not self.open.is_set():
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.open.clear()

        def close_all():
            for writer in list(self._writers):
                writer.close()
            self._writers.clear()

        self._loop.call_soon_threadsafe(close_all)

    def restore(self) -> None:
        self.open.set()

    def stop(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)


def test_database_outage_under_a_worker_loses_nothing(platform, make_caller, redis_client, tmp_path):
    from django.conf import settings

    from gateway.models import Job

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, workload_class="batch")
    db = settings.DATABASES["default"]
    proxy = CuttableProxy(int(db.get("PORT") or 5432))
    # given the batch lane's only worker reaches PostgreSQL through the proxy
    worker_url = f"postgres://{db.get('USER') or 'postgres'}@127.0.0.1:{proxy.port}/{db['NAME']}"
    try:
        with _batch_worker_instead(platform, redis_client, "batch-proxied",
                                   {**platform.env, "DATABASE_URL": worker_url, "DB_CONN_MAX_AGE": "60"}, tmp_path,
                                   concurrency=2):
            platform.sim_reset()
            # when the database goes away while jobs are accepted and running
            proxy.cut()
            ids = []
            for n in range(3):
                response = httpx.post(f"{platform.base_url}/v1/jobs", timeout=30,
                                      headers={"Authorization": f"Bearer {caller.api_key}"},
                                      json={"model": "sim-small", "messages": HELLO, "max_tokens": 9,
                                            "sim": {"output_tokens": 4 + n}})
                assert response.status_code == 202
                ids.append(response.json()["id"])
            time.sleep(3)  # the worker calls the pool, then fails to write the ledger
            assert UsageRecord.objects.filter(workload=caller.workload).count() == 0
            # and comes back
            proxy.restore()
            deadline = time.monotonic() + 60
            while Job.objects.filter(pk__in=ids, status="succeeded").count() < 3:
                assert time.monotonic() < deadline, list(Job.objects.filter(pk__in=ids).values_list("status", flat=True))
                time.sleep(0.2)
    finally:
        proxy.stop()
    # then every job ran once: the pool was called three times, not more
    rows = list(UsageRecord.objects.filter(workload=caller.workload))
    assert len(rows) == 3
    assert sorted(r.actual_output_tokens for r in rows) == [4, 5, 6]
    assert platform.sim_stats()["completed"] == 3
    counters = redis_client.hgetall(keys.pool_counters(pool.id))
    assert int(counters[f"{caller.workload.id}.debited_tok"]) == sum(r.actual_input_tokens + r.actual_output_tokens
                                                                     for r in rows)


def test_keys_a_web_process_knows_are_served_while_its_database_is_away(platform, make_caller, tmp_path):
    """PostgreSQL away from a web process: a key it checked before is
    served from what it knew, for SLUICE_AUTH_STALE_S at most (the request
    runs: admission, lane and pool live in Redis and the workers); a key it
    never saw, or a job, is answered 503 database_unavailable, not a 500;
    once the database is back, the process's connections are replaced."""
    from django.conf import settings

    from llm_platform import processes
    from tests.platform_harness import Process, free_port, wait_http

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    known, unseen = make_caller(pool=pool), make_caller(pool=pool)
    db = settings.DATABASES["default"]
    proxy = CuttableProxy(int(db.get("PORT") or 5432))
    port = free_port()
    web_url = f"http://127.0.0.1:{port}"
    env = {**platform.env, "DB_CONN_MAX_AGE": "60",
           "DATABASE_URL": f"postgres://{db.get('USER') or 'postgres'}@127.0.0.1:{proxy.port}/{db['NAME']}",
           # a known key lapses from the cache after 1 s, is served stale for 4 s
           "SLUICE_AUTH_CACHE_S": "1", "SLUICE_AUTH_STALE_S": "4", "SLUICE_AUTH_REVOCATION_POLL_S": "0.5"}
    web = Process("web-db-proxied", processes.web_command(port=port), env, tmp_path).start()

    def chat(caller) -> httpx.Response:
        return httpx.post(f"{web_url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {caller.api_key}"},
                          json={"model": "sim-small", "messages": HELLO, "max_tokens": 5})

    def unanswered() -> dict[str, float]:
        """sluice_web_key_checks_unanswered_total on /metrics, by answer."""
        text = httpx.get(f"{web_url}/metrics", timeout=30).text
        return {sample.labels["answer"]: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "sluice_web_key_checks_unanswered_total"}

    try:
        wait_http(f"{web_url}/healthz", web)
        # given a key the web process checked
        assert chat(known).status_code == 200
        counted = unanswered()
        checked = time.monotonic()
        # when its database goes away, and the key's cache entry lapses
        proxy.cut()
        time.sleep(1.5)
        served = chat(known)
        refused = chat(unseen)
        job = httpx.post(f"{web_url}/v1/jobs", timeout=30, headers={"Authorization": f"Bearer {known.api_key}"},
                         json={"model": "sim-small", "messages": HELLO, "max_tokens": 5})
        late_s = checked + 4.5 - time.monotonic()
        if late_s > 0:
            time.sleep(late_s)  # past the stale bound
        lapsed = chat(known)
        proxy.restore()
        # then the known key is served, the unseen one is a 503 with a retry
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] > 0
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "database_unavailable"
        assert int(refused.headers["Retry-After"]) >= 1
        # and a job, which needs the database, is a 503 too
        assert job.status_code == 503 and job.json()["error"]["code"] == "database_unavailable", job.text
        # and not past the stale bound
        assert lapsed.status_code == 503 and lapsed.json()["error"]["code"] == "database_unavailable"
        # and once the database is back both keys are checked and served again
        deadline = time.monotonic() + 10
        while chat(unseen).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert chat(known).status_code == 200
        # and /metrics counted the checks the database did not answer
        now = unanswered()
        assert now["served"] - counted["served"] >= 1 and now["refused"] - counted["refused"] >= 2
    finally:
        web.stop()
        proxy.stop()


def test_a_database_that_holds_key_lookups_up_holds_no_caller_past_the_wait(platform, make_caller, tmp_path):
    """PostgreSQL that neither answers nor fails a key's lookup (here: the
    key table locked by another connection, as a migration would): a web
    process answers within SLUICE_AUTH_LOOKUP_WAIT_S, serving a key it
    checked before and refusing one it never saw 503 database_unavailable,
    and serves both once the lock goes."""
    from llm_platform import processes
    from tenants.models import ApiKey
    from tests.platform_harness import Process, free_port, wait_http

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    known, unseen = make_caller(pool=pool), make_caller(pool=pool)
    port = free_port()
    web_url = f"http://127.0.0.1:{port}"
    # a known key lapses from the cache after 1 s; lookups are waited for 1 s
    env = {**platform.env, "SLUICE_AUTH_CACHE_S": "1", "SLUICE_AUTH_LOOKUP_WAIT_S": "1"}
    web = Process("web-db-held", processes.web_command(port=port), env, tmp_path).start()

    def chat(caller) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        response = httpx.post(f"{web_url}/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {caller.api_key}"},
                              json={"model": "sim-small", "messages": HELLO, "max_tokens": 5})
        return response, time.monotonic() - started

    locker = _other_connection()
    try:
        wait_http(f"{web_url}/healthz", web)
        # given a key the web process checked, then the key table locked
        assert chat(known)[0].status_code == 200
        locker.execute(f"LOCK TABLE {ApiKey._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        time.sleep(1.2)  # the known key's cache entry lapses
        # when both keys call
        served, served_s = chat(known)
        refused, refused_s = chat(unseen)
        locker.rollback()  # the lock goes
        # then neither waited for the lock (bounds, not timings: the lookup
        # wait is 1 s, the lock was held for seconds)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] > 0
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "database_unavailable"
        assert int(refused.headers["Retry-After"]) >= 1
        assert served_s < 5 and refused_s < 5
        # and once the lock is gone both keys are served
        deadline = time.monotonic() + 10
        while chat(unseen)[0].status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert chat(known)[0].status_code == 200
    finally:
        locker.close()
        web.stop()


def test_a_ledger_the_database_holds_up_holds_no_lane_thread(platform, make_caller, redis_client, tmp_path):
    """PostgreSQL that neither writes nor fails a ledger row (here: the
    ledger table locked by another connection, as a migration would): a
    lane's only thread waits SLUICE_WORKER_DB_WAIT_S for its row, then goes
    back to new calls while the row is retried, so call after call is
    answered; once the lock goes every row lands once and nothing is
    charged or called twice."""
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, workload_class="batch")
    # given the batch lane served by one worker with one thread, whose calls
    # wait 1 s for their ledger rows
    with _batch_worker_instead(platform, redis_client, "batch-one-thread",
                               {**platform.env, "SLUICE_WORKERS_BATCH": "1", "SLUICE_WORKER_DB_WAIT_S": "1"},
                               tmp_path, concurrency=1):
        platform.sim_reset()
        locker = _other_connection()
        try:
            # when the ledger table is locked and three calls come one after another
            locker.execute(f"LOCK TABLE {UsageRecord._meta.db_table} IN ACCESS EXCLUSIVE MODE")
            with httpx.Client(timeout=20) as client:
                answers = [client.post(f"{platform.base_url}/v1/chat/completions",
                                       headers={"Authorization": f"Bearer {caller.api_key}"},
                                       json={"model": "sim-small", "messages": HELLO, "max_tokens": 9,
                                             "sim": {"output_tokens": 4 + n}}) for n in range(3)]
        finally:
            locker.close()  # the lock goes
        # then each was answered, the one thread freed from the row before it
        assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
        assert [a.json()["usage"]["completion_tokens"] for a in answers] == [4, 5, 6]
        # and the rows land once the lock is gone, one per call
        deadline = time.monotonic() + 60
        while UsageRecord.objects.filter(workload=caller.workload).count() < 3:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(2)  # any retry still due finds its row written
    rows = list(UsageRecord.objects.filter(workload=caller.workload))
    assert sorted(r.actual_output_tokens for r in rows) == [4, 5, 6]
    assert platform.sim_stats()["completed"] == 3
    counters = redis_client.hgetall(keys.pool_counters(pool.id))
    assert int(counters[f"{caller.workload.id}.debited_tok"]) == sum(r.actual_input_tokens + r.actual_output_tokens
                                                                     for r in rows)
