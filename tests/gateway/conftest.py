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
    """Key lookups and revocation polls (gateway/web/auth.py) run in executor
    threads; their database connections are closed after each, or they would
    hold the test database open at teardown."""
    from django.db import connection

    from gateway.web import auth

    def closing(read):
        def read_and_close(*args, **kwargs):
            try:
                return read(*args, **kwargs)
            finally:
                connection.close()
        return read_and_close

    monkeypatch.setattr(auth, "_load_context", closing(auth._load_context))
    monkeypatch.setattr(auth, "api_key_changes", closing(auth.api_key_changes))
