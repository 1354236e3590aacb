"""The request path's processes freeze what they keep for life and collect the
youngest generation less often (llm_platform/gc_tuning.py)."""

from __future__ import annotations

import subprocess
import sys

from llm_platform.gc_tuning import YOUNG_THRESHOLD


def test_gc_tune_freezes_the_heap_and_raises_the_young_threshold():
    # given a fresh interpreter with Python's own collector settings
    code = ("import gc; from llm_platform.gc_tuning import gc_tune; before = gc.get_threshold(); gc_tune(); "
            "print(before[0], gc.get_threshold()[0], gc.get_threshold()[1:] == before[1:], gc.get_freeze_count() > 0)")
    # when it tunes its collector
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    # then what was alive is frozen and the youngest generation waits longer; the older ones are as they were
    assert out == ["700", str(YOUNG_THRESHOLD), "True", "True"]


def test_the_web_process_module_tunes_its_collector_once_built():
    # given the ASGI module as uvicorn imports it, in a process of its own
    code = ("import gc, os; os.environ.setdefault('DJANGO_SECRET_KEY', 'x' * 50); import llm_platform.asgi; "
            "print(gc.get_threshold()[0], gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    # then its collector is tuned as above
    assert out == [str(YOUNG_THRESHOLD), "True"]
