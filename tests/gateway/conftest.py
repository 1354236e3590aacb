"""Fixtures of the gateway tests; a module that defines its own ``caller`` uses that one."""

from __future__ import annotations

import pytest


@pytest.fixture
def caller(platform, make_caller):
    """A workload (and its key) on a pool that is the platform's simulator."""
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    return make_caller(pool=pool)


@pytest.fixture
def breaker(settings):
    """A circuit that three failures in a row open, for ten minutes (the
    circuit and held-work tests move its times themselves)."""
    settings.SLUICE_CIRCUIT_FAILURES = 3
    settings.SLUICE_CIRCUIT_OPEN_S = 600.0
    return settings


@pytest.fixture
def key_lookups_close_their_connections(monkeypatch):
    """Key lookups (gateway/web/auth.py) run in executor threads; their
    database connections are closed after each, or they would hold the test
    database open at teardown."""
    from django.db import connection

    from gateway.web import auth

    load = auth._load_context

    def load_and_close(raw_key):
        try:
            return load(raw_key)
        finally:
            connection.close()

    monkeypatch.setattr(auth, "_load_context", load_and_close)
