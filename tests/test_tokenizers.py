"""Where a tokenizer's ranks are parsed (llm_tokens.get_encoding): once per
process and name, by one caller while the others wait for it; in the web
process, never on the event loop (the default tokenizer at the process's
start, another pool's on a thread: gateway/web/dispatch.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import tiktoken

import llm_tokens
from gateway.web import dispatch
from llm_platform.processes import ROOT

NAME = "o200k_base"


@pytest.fixture
def slow_unloaded(monkeypatch):
    """``NAME`` as if this process had not loaded it yet, its load slowed
    to a parse's length and counted."""
    loads = []
    real = tiktoken.get_encoding

    def load(name):
        loads.append(name)
        time.sleep(0.3)
        return real(name)

    monkeypatch.setattr(tiktoken, "get_encoding", load)
    kept = llm_tokens._encodings.pop(NAME, None)
    yield loads
    if kept is not None:
        llm_tokens._encodings[NAME] = kept


def test_callers_of_an_encoding_being_loaded_wait_for_that_one_load(slow_unloaded):
    assert not llm_tokens.encoding_loaded(NAME)
    got = []
    threads = [threading.Thread(target=lambda: got.append(llm_tokens.get_encoding(NAME))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert slow_unloaded == [NAME]
    assert len(got) == 8 and all(encoding is got[0] for encoding in got)
    assert llm_tokens.encoding_loaded(NAME)
    assert llm_tokens.count_text_tokens("hello world", NAME) == 2


def test_a_pools_tokenizer_not_loaded_yet_is_loaded_off_the_event_loop(slow_unloaded):
    async def run() -> int:
        ticks = 0
        loading = asyncio.ensure_future(dispatch._tokenizers_loaded([SimpleNamespace(tokenizer=NAME)] * 3))
        while not loading.done():
            await asyncio.sleep(0.01)
            ticks += 1
        await loading
        return ticks

    ticks = asyncio.run(run())
    assert slow_unloaded == [NAME]  # three pools, one tokenizer: one load
    assert llm_tokens.encoding_loaded(NAME)
    # The loop kept turning through the 0.3 s load (on the loop: no turn at all).
    assert ticks >= 10
    asyncio.run(dispatch._tokenizers_loaded([SimpleNamespace(tokenizer=NAME)]))
    assert slow_unloaded == [NAME]  # loaded: no second load


def test_the_web_process_parses_the_default_tokenizer_before_its_first_request():
    probe = ("import llm_platform.asgi, llm_tokens; from budgets.models import InferencePool; "
             "print(llm_tokens.encoding_loaded(InferencePool._meta.get_field('tokenizer').default))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
