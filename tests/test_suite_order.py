"""The suite's own order (tests/conftest.py): under the README's `-n 2 --dist loadfile` each file runs whole in one
worker, handed out in the order collected, so the longest files are collected first."""

from __future__ import annotations

from pathlib import Path

import conftest


def test_the_longest_files_exist_and_are_collected_first(request):
    names = {path.name for path in Path(__file__).parent.glob("test_*.py")}
    assert set(conftest.LONGEST_FILES) <= names, set(conftest.LONGEST_FILES) - names  # a renamed file: update the list
    collected = list(dict.fromkeys(item.path.name for item in request.session.items))
    first = [name for name in conftest.LONGEST_FILES if name in collected]
    assert collected[:len(first)] == first
    assert request.config.option.__dict__.get("loadscopereorder") in (None, False)  # xdist keeps this order
