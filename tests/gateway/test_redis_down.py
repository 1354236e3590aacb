"""With Redis unreachable the gateway answers 503 with Retry-After within a
second: never a 500, never a hang."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.platform_harness import HEALTH_TOKEN, Process, free_port, wait_http

pytestmark = pytest.mark.django_db(transaction=True)


def test_redis_unreachable_is_a_fast_503(platform, make_caller, tmp_path):
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"))
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    from llm_platform import processes

    env = {**platform.env, "REDIS_URL": dead_redis, "CELERY_BROKER_URL": dead_redis}
    web = Process("web-no-redis", processes.web_command(port=port), env, tmp_path).start()
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", web)
        for _ in range(3):
            started = time.monotonic()
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                                  headers={"Authorization": f"Bearer {caller.api_key}"},
                                  json={"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]})
            elapsed = time.monotonic() - started
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "budget_unavailable"
            assert response.headers["retry-after"] == "1"
            assert elapsed < 1.5
        # alive, but not ready: a load balancer stops sending it work
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json() == {"status": "ok"}
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert (ready.status_code, ready.json()) == (503, {"status": "unavailable"})
        detailed = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10,
                             headers={"Authorization": f"Bearer {HEALTH_TOKEN}"}).json()
        assert detailed["redis"]["ok"] is False and detailed["database"]["ok"] is True
    finally:
        web.stop()
