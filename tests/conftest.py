"""Suite-wide settings.

The README's test command runs the suite in two worker processes (pytest-xdist, `-n 2 --dist loadfile`: each test
file stays in one worker, so module fixtures are built once). Each worker then gets its share of the CPU cores for
torch's own threads and for the processes its tests start, instead of every worker spinning on all of them.
"""

from __future__ import annotations

import os

import torch


def _share_cores_between_workers() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_cores_between_workers()
