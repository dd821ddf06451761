"""Suite-wide settings.

The README's test command runs the suite in two worker processes (pytest-xdist, `-n 2 --dist loadfile`: each test
file stays in one worker, so module fixtures are built once). Each worker then gets its share of the CPU cores for
torch's own threads and for the processes its tests start, instead of every worker spinning on all of them.

The files are handed to the workers longest first (`LONGEST_FILES`), so that neither worker is left running a long
file at the end while the other idles; xdist's own order (most tests first) put the slow files with few tests last.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

# The files that take longest on a 2-core machine, longest first (per-file time of a whole run); every other file
# follows them in the order collected. Only the order changes: a file missing here still runs.
LONGEST_FILES = (
    "test_kernel_scripts.py", "test_flash_mhf_layer.py", "test_packaging.py", "test_kernel_builds.py", "test_study.py",
    "test_export_robustness.py", "test_recipe_speed.py", "test_continuous_batching.py", "test_parallel.py",
    "test_onnx_export.py", "test_lm_eval.py", "test_decoder_kernels.py", "test_recipe.py", "test_serving.py",
    "test_recipe_args.py", "test_demo.py", "test_flash_mhf_op.py", "test_trainer_features.py", "test_ffn_kernels.py",
)


# transformers 5.25 and later fetch kernels from the Hub for the layers they know (SiLU, RMSNorm) whenever a model loads
# onto a GPU (`use_kernels` defaults to True there): the tests run offline, as any machine without a network must, with
# that off (the worker processes and the processes their tests start inherit it)
os.environ.setdefault("USE_HUB_KERNELS", "NO")


def _share_cores_between_workers() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_cores_between_workers()


@pytest.fixture(autouse=True)
def _same_random_state_for_every_test():
    """Each test starts from one random state, whatever ran before it in its worker: a test drawing its inputs
    without a seed of its own sees the same inputs on every run and in any order, so its failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)


def pytest_configure(config):
    # keep the collected order below when xdist groups the tests by file (it would sort the files by test count)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    # transformers and accelerate call gc.collect() often (after each checkpoint shard, at each Trainer's end); each
    # full collection walked every object that importing torch, transformers and the tests made, about a third of a
    # second here, 27 s of test_trainer_features.py's 34 (`tests/gc_time_probe.py` measures it). Frozen, those
    # objects are left out of every collection (they live as long as the process anyway); what the tests make is
    # still collected.
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # (collected at exit as before: extension modules such as Triton's check their objects went)


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: each file's tests keep order


@pytest.fixture
def read_only_folder(tmp_path, monkeypatch):
    """An empty folder `tmp_path / "read_only"` that this user cannot write into, as `os.access` answers for it: its
    mode is 0o555, and `os.access` is made to answer for it as for a user other than root, which writes anywhere (the
    suite may run as root). Writable again after the test, so that pytest can remove it."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: (
        False if mode & os.W_OK and os.path.realpath(path) == str(folder) else access(path, mode, **kwargs)))
    yield folder
    folder.chmod(0o755)
