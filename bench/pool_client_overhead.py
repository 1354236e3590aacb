"""Micro-bench (issue 9): the worker's CPU per non-streamed pool call, three
ways: the openai SDK's ``chat.completions.with_raw_response.create``; a plain
POST on the same SDK client's httpx client (no SDK request building: what
``pool_post`` does for https:// and proxied pools); and ``pool_post``
on a plain http:// pool (the standard library's http.client over kept-alive
connections). Same simulator, same process, same run.

CPU is this process's (``time.process_time``), not wall time; the two ways
alternate in blocks so drift of the machine hits both alike. The result is
a ratio, never an absolute target.

Run alone: ``python -m bench.pool_client_overhead [--calls N]``."""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import time

import httpx

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))  # no database, no sessions: any will do

import django  # noqa: E402

django.setup()

from bench.common import log  # noqa: E402
from gateway.worker.pool_client import _chat_request, _chat_send, pool_post, pool_client  # noqa: E402
from llm_platform.processes import free_port, sim_command  # noqa: E402

BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "Say hello in a few words."}],
        "max_tokens": 16}


def _sim_up(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the simulator exited")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)  # polling with a deadline
    raise RuntimeError("the simulator did not come up")


def main(calls: int = 2_000, blocks: int = 10) -> dict:
    port = free_port()
    proc = subprocess.Popen(sim_command(port=port, extra=["--zero-latency", "--seed", "1"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _sim_up(f"http://127.0.0.1:{port}/healthz", proc)
        client = pool_client(base_url=f"http://127.0.0.1:{port}/v1", api_key_env="")
        ways = {
            "sdk": lambda: client.chat.completions.with_raw_response.create(**BODY).text,
            "httpx": lambda: _chat_send(client, _chat_request(client, path="chat/completions", body=BODY, accept="application/json"),
                                        stream=False).text,
            "http.client": lambda: pool_post(client, body=BODY).text,
        }
        for way in ways.values():  # warm both
            for _ in range(50):
                way()
        cpu = {name: 0.0 for name in ways}
        per_block = max(1, calls // blocks)
        for _ in range(blocks):
            for name, way in ways.items():
                started = time.process_time()
                for _ in range(per_block):
                    way()
                cpu[name] += time.process_time() - started
        n = per_block * blocks
        ms = {name: 1000 * total / n for name, total in cpu.items()}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    result = {"calls_each": n, "ms_cpu_per_call": ms, "httpx_over_sdk": ms["httpx"] / ms["sdk"],
              "http_client_over_sdk": ms["http.client"] / ms["sdk"]}
    log(f"pool client: SDK {ms['sdk']:.3f} ms CPU per call, plain POST on httpx {ms['httpx']:.3f} ms "
        f"({result['httpx_over_sdk']:.2f}x the SDK's), on http.client {ms['http.client']:.3f} ms "
        f"({result['http_client_over_sdk']:.2f}x), {n} calls each")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2_000)
    main(calls=parser.parse_args().calls)
