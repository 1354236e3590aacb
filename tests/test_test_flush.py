"""The suite's own teardown: a transactional test's TRUNCATE that PostgreSQL
picks as a deadlock's victim (a worker settling that test's work holds one of
the tables) is run again, not reported as the test's error (tests/conftest.py)."""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import connection

from tests.conftest import _database_url

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_flush_chosen_as_a_deadlock_victim_runs_again():
    from budgets.models import InferencePool
    from tenants.models import Tenant

    Tenant.objects.create(name="T", slug="t-flush", cost_center="CC")
    early, late = Tenant._meta.db_table, InferencePool._meta.db_table
    statements = [f'TRUNCATE "{early}", "{late}" CASCADE;']
    with connection.cursor() as cursor:
        cursor.execute("SET deadlock_timeout = '100ms'")
    holder_ready, flush_waiting, errors = threading.Event(), threading.Event(), []

    def other_transaction():
        # the "worker": holds the later table, then wants the earlier one once
        # the TRUNCATE holds it (and waits for the later)
        try:
            with psycopg.connect(_database_url(), autocommit=False) as other:
                other.execute("SET deadlock_timeout = '10s'")  # so the flush's check fires first
                other.execute(f'SELECT 1 FROM "{late}" FOR UPDATE')
                other.execute(f'LOCK TABLE "{late}" IN ROW SHARE MODE')
                holder_ready.set()
                flush_waiting.wait(5)
                other.execute(f'SELECT 1 FROM "{early}" FOR UPDATE')
                other.commit()
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    thread = threading.Thread(target=other_transaction)
    thread.start()
    assert holder_ready.wait(5)
    # the flush takes the earlier table and then waits for the later one; the
    # other transaction is released to ask for the earlier table shortly after
    threading.Timer(0.05, flush_waiting.set).start()
    try:
        connection.ops.execute_sql_flush(statements)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET deadlock_timeout")
    thread.join(10)
    assert errors == []
    assert not Tenant.objects.exists()
