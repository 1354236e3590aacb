"""What the gateway tests share: the official SDK pointed at the platform
under test, and the pool's counters (the ``caller`` fixture is in conftest.py)."""

from __future__ import annotations

import openai

from budgets.admission import keys


def sdk(platform, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def counters(redis_client, pool_id: int) -> dict[str, int]:
    return {k: int(v) for k, v in redis_client.hgetall(keys.pool_counters(pool_id)).items()}
