"""Shared fixtures. Everything here is real: PostgreSQL (pytest-django's test
database), Redis, Celery workers, the simulated pool over HTTP."""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings


def pytest_configure(config):
    # The SDK's and httpx's per-request INFO lines drown real failures.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise pytest.UsageError("Sluice's tests run against PostgreSQL: set DATABASE_URL (make test does).")
    # As in the platform's processes (below): tests steer the simulated pool
    # per request, here too where a test runs the request path in-process.
    settings.SLUICE_SIM_CONTROLS = True
    _flush_retry_on_deadlock()


def _flush_retry_on_deadlock(attempts: int = 5):
    """A transactional test's teardown TRUNCATEs every table while the
    session's lane workers may still be settling work that test queued (a
    job's row update holds a row lock the TRUNCATE must wait for, and the
    update then waits on the TRUNCATE). PostgreSQL breaks that deadlock by
    failing one side; when the TRUNCATE is the one chosen, run it again: the
    worker's transaction has ended by then. Only the deadlock is retried."""
    import time as _time

    from django.db import OperationalError
    from django.db.backends.postgresql.operations import DatabaseOperations
    from psycopg import errors as pg_errors

    flush = DatabaseOperations.execute_sql_flush

    def execute_sql_flush(self, sql_list):
        for attempt in range(attempts):
            try:
                return flush(self, sql_list)
            except OperationalError as exc:
                if not isinstance(exc.__cause__, pg_errors.DeadlockDetected) or attempt == attempts - 1:
                    raise
                _time.sleep(0.1 * (attempt + 1))

    DatabaseOperations.execute_sql_flush = execute_sql_flush


def pytest_report_header(config):
    kind = "Redis Cluster" if settings.SLUICE_REDIS_CLUSTER else "Redis"
    return f"sluice: {kind} at {settings.REDIS_URL}, broker {settings.CELERY_BROKER_URL}"


@pytest.fixture(scope="session")
def redis_client():
    from budgets.redis.clients import get_redis

    client = get_redis()
    client.ping()
    return client


@pytest.fixture
def redis_of_its_own(settings):
    """The test's Redis is a neighbouring database of the session's, emptied
    before and after: lane workers the session started earlier (the
    ``platform`` fixture) consume the session database's lane queues, and a
    test that plays the worker itself, or watches a message it enqueued,
    must not have them take it first. Returns a client of that database;
    every Sluice client the test makes uses it too."""
    import redis

    from budgets.redis.clients import reset_clients

    if settings.SLUICE_REDIS_CLUSTER:
        pytest.skip("a Redis Cluster has one database")
    base, _, db = settings.REDIS_URL.rpartition("/")
    settings.REDIS_URL = f"{base}/{int(db) ^ 1}" if db.isdigit() else f"{settings.REDIS_URL}/1"
    reset_clients()
    own = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
    own.flushdb()
    try:
        yield own
    finally:
        own.flushdb()
        own.close()
        reset_clients()


@pytest.fixture(autouse=True)
def clean_redis(redis_client):
    """Each test starts with no buckets, leases or request records. Only our
    keys go: the Celery broker's queue bindings must survive. (On a cluster
    the scan visits every primary and the delete is split by slot.)"""
    keys = list(redis_client.scan_iter(match="sluice:*", count=1000))
    keep = {"sluice:workers:ready"}
    doomed = [k for k in keys if k not in keep]
    if doomed:
        redis_client.delete(*doomed)
    yield


def _database_url() -> str:
    db = settings.DATABASES["default"]
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    user = db.get("USER") or "postgres"
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{user}{password}@{host}:{port}/{db['NAME']}"


PLANTED_POOL_KEY_ENV = "SLUICE_TEST_POOL_API_KEY"


@pytest.fixture(scope="session")
def platform(django_db_setup, django_db_blocker, redis_client):
    """The simulated pool, the gateway and one worker per lane, all pointed at
    this session's test database and Redis."""
    from gateway.core.lanes import LANE_NAMES, LANES
    from tests.platform_harness import HEALTH_TOKEN, Platform

    from llm_platform.processes import metrics_dir_prepare

    log_dir = Path(os.environ.get("SLUICE_TEST_LOG_DIR") or tempfile.mkdtemp(prefix="sluice-test-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({
        "DATABASE_URL": _database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "SLUICE_REDIS_CLUSTER": "true" if settings.SLUICE_REDIS_CLUSTER else "false",
        "SLUICE_AUTH_CACHE_S": "0.5",
        # Test receivers listen on plain http; private and loopback receivers
        # stay refused (tests that need one turn it on for themselves).
        "SLUICE_CALLBACK_ALLOW_HTTP": "1",
        # Few enough that the unknown-key throttle is reached quickly in a test.
        "SLUICE_API_KEY_FAILURES_PER_ADDRESS": "20",
        "PYTHONUNBUFFERED": "1",
        "DB_CONN_MAX_AGE": "0",
        # The processes add up their metrics here, as under `make run`.
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir_prepare(log_dir / "metrics")),
        "SLUICE_LOG_FORMAT": "json",
        # Secrets planted for tests/test_observability.py to look for in the
        # logs: the processes' secret key, and a pool API key a test pool
        # names (InferencePool.api_key_env).
        "DJANGO_SECRET_KEY": "planted-django-secret-" + secrets.token_hex(16),
        PLANTED_POOL_KEY_ENV: "sk-planted-pool-" + secrets.token_hex(16),
        # Tests steer the simulated pool per request ("sim" in a body).
        "SLUICE_SIM_CONTROLS": "true",
        # Test pools point at a dead port unless a test gives them the
        # simulator: probing them would shut them (503 pool_unavailable) under
        # tests that never call them. The probe tests start their own pacer.
        "SLUICE_POOL_PROBE_INTERVAL_S": "0",
        # Requests of lost workers are taken over by the tests that lose them
        # (tests/gateway/test_worker_loss.py), never first by the session's pacer.
        "SLUICE_TAKEOVER_SWEEP_S": "0",
        # Health details for the tests that read them (gateway/web/health.py).
        "SLUICE_HEALTH_TOKEN": HEALTH_TOKEN,
        # The Batch API's files: one directory the web process and the workers share.
        "SLUICE_FILES_DIR": str(log_dir / "files"),
    })
    # The session's workers keep the threads they start with (8: start_worker),
    # whatever the pools tests create: tests that fill a lane count on it.
    # Sizing by the pools is tests/gateway/test_lane_pool.py's, on its own workers.
    env.update({lane.concurrency_env: "8" for lane in LANES})
    harness = Platform(env=env, log_dir=log_dir, redis_client=redis_client)
    try:
        harness.start_sim(["--time-scale", "5"])
        harness.start_web()
        harness.start_pacer()
        lanes = list(LANE_NAMES)
        for lane in lanes:
            harness.start_worker(lane)
        harness.wait_workers_ready(lanes)
        yield harness
    finally:
        harness.stop_all()


@dataclass
class Caller:
    tenant: object
    workload: object
    reservation: object
    pool: object
    api_key: str


@pytest.fixture
def make_caller(transactional_db):
    """Create a pool (or reuse one), a tenant, a workload with a reservation
    and an API key. Bucket config reaches Redis on commit, as in production."""
    from budgets.models import InferencePool, Reservation
    from budgets.admission.pool_config import pool_config_push
    from tenants.models import Tenant, Workload
    from tenants.services import api_key_create

    counter = {"n": 0}

    def make_pool(*, base_url: str = "http://127.0.0.1:9/v1", provider_tpm: int = 1_000_000, provider_rpm: int = 10_000,
                  headroom: float = 0.8, burst_seconds: float = 15.0, max_concurrency: int = 256,
                  is_simulator: bool = True, served_models: list[str] | None = None, **extra):
        counter["n"] += 1
        pool = InferencePool(name=f"pool {counter['n']}", slug=f"pool-{counter['n']}-{os.getpid()}", base_url=base_url,
                             served_models=["sim-small", "sim-large"] if served_models is None else served_models,
                             provider_tpm=provider_tpm,
                             provider_rpm=provider_rpm, headroom=headroom, burst_seconds=burst_seconds,
                             max_concurrency=max_concurrency, is_simulator=is_simulator, **extra)
        pool.full_clean()
        pool.save()
        return pool

    def make(*, pool=None, tenant=None, workload_class: str = "interactive", reserved_tpm: int = 100_000,
             ceiling_tpm: int | None = None, lend_fraction: float = 0.0, rpm: int = 1_000, prompt_tokens_cap: int = 4_000,
             max_tokens_cap: int = 1_024, max_tokens_default: int = 64, queue_timeout_s: float = 10.0,
             max_concurrency: int = 0) -> Caller:
        counter["n"] += 1
        n = counter["n"]
        pool = pool or make_pool()
        tenant = tenant or Tenant.objects.create(name=f"Tenant {n}", slug=f"tenant-{n}", cost_center=f"CC-{n}")
        workload = Workload.objects.create(
            tenant=tenant, name=f"Workload {n}", slug=f"wl-{n}", workload_class=workload_class,
            prompt_tokens_cap=prompt_tokens_cap, max_tokens_cap=max_tokens_cap,
            max_tokens_default=max_tokens_default, queue_timeout_s=queue_timeout_s,
        )
        reservation = Reservation(workload=workload, pool=pool, reserved_tpm=reserved_tpm,
                                  ceiling_tpm=ceiling_tpm if ceiling_tpm is not None else reserved_tpm,
                                  lend_fraction=lend_fraction, rpm=rpm, max_concurrency=max_concurrency)
        reservation.full_clean()
        reservation.save()
        pool_config_push(pool=pool)  # also happens on commit; explicit so the test does not race it
        key = api_key_create(workload=workload, name="test")
        return Caller(tenant=tenant, workload=workload, reservation=reservation, pool=pool, api_key=key.raw_key)

    make.pool = make_pool
    return make
