"""A pytest plugin that times every `gc.collect()` call of a test session, per test file, and says where the calls
came from. It measured why `tests/conftest.py` freezes the imported objects out of collection:

    PYTHONPATH=tests python -m pytest -q -p gc_time_probe -p no:cacheprovider tests/test_trainer_features.py

(run it once as it is, and once with the `gc.freeze()` of `pytest_collection_finish` commented out). Not loaded by
the suite itself.
"""

from __future__ import annotations

import collections
import gc
import time
import traceback

_collect = gc.collect
_seconds_by_file: collections.Counter = collections.Counter()
_calls_by_file: collections.Counter = collections.Counter()
_seconds_by_caller: collections.Counter = collections.Counter()
_current_file = ["(collection)"]


def _timed_collect(*args, **kwargs):
    started = time.perf_counter()
    try:
        return _collect(*args, **kwargs)
    finally:
        seconds = time.perf_counter() - started
        _seconds_by_file[_current_file[0]] += seconds
        _calls_by_file[_current_file[0]] += 1
        caller = traceback.extract_stack(limit=3)[0]
        _seconds_by_caller[f"{caller.filename.split('site-packages/')[-1]}:{caller.lineno}"] += seconds


def pytest_configure(config):
    gc.collect = _timed_collect


def pytest_unconfigure(config):
    gc.collect = _collect


def pytest_runtest_setup(item):
    _current_file[0] = item.path.name


def pytest_terminal_summary(terminalreporter):
    terminalreporter.section("gc.collect() calls")
    for name, seconds in _seconds_by_file.most_common():
        terminalreporter.write_line(f"{seconds:8.2f} s {_calls_by_file[name]:5d} calls  {name}")
    terminalreporter.write_line("callers:")
    for caller, seconds in _seconds_by_caller.most_common(10):
        terminalreporter.write_line(f"{seconds:8.2f} s  {caller}")
