"""Where the Triton kernels' tests run: in this process on a CUDA machine, and on a CPU machine in a child pytest with
TRITON_INTERPRET=1 (Triton reads it when it is first imported, which other test files do earlier in the session)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_memffn import flash_mhf_triton

REPO_ROOT = Path(__file__).resolve().parents[1]
CHILD_FLAG = "MEMFFN_TRITON_INTERPRETER_CHILD"
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS_RUN_HERE = flash_mhf_triton.TRITON_AVAILABLE and (ON_GPU or flash_mhf_triton.triton_interpreting())
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE, reason="Triton kernels run on CUDA, or on CPU in the file's interpreter subprocess test"
)


def cases_by_dtype(cases: list, dtypes: list) -> list:
    """`pytest.param`s of (case, dtype): every pair where the kernels run compiled; in the interpreter, where a pair
    takes about a second of a CPU, each case once (in the dtypes taken in turn) and the first case in every dtype, so
    that every case and every dtype still runs."""
    def pair(case, dtype):
        return pytest.param(*case.values, dtype, id=f"{case.id}-{str(dtype).removeprefix('torch.')}")

    if not flash_mhf_triton.triton_interpreting():
        return [pair(case, dtype) for case in cases for dtype in dtypes]
    return ([pair(cases[0], dtype) for dtype in dtypes]
            + [pair(case, dtypes[index % len(dtypes)]) for index, case in enumerate(cases) if index])


def run_under_interpreter(test_file: str, selection: str, timeout: int = 900) -> None:
    """Runs the tests of `test_file` that `-k selection` picks in a child pytest under Triton's interpreter, and
    fails with its output if any fails (skips where the kernels run in this process)."""
    if ON_GPU:
        pytest.skip("the kernels run in-process on this CUDA machine")
    if not flash_mhf_triton.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    if os.environ.get(CHILD_FLAG) or flash_mhf_triton.triton_interpreting():
        pytest.skip("already running under the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_FLAG: "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # -v names each test the selection takes, so that a kernel test it leaves out (skipped here, never run) is found
    command = [sys.executable, "-m", "pytest", str(test_file), "-v", "-k", selection, "-p", "no:cacheprovider"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"interpreter run failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]
    taken = set(re.findall(r"::(test_\w+)", result.stdout))
    left_out = [name for name in kernel_tests(test_file) if name not in taken]
    assert not left_out, f"-k {selection!r} leaves out {left_out}: they would run nowhere on a CPU"


def kernel_tests(test_file: str) -> list[str]:
    """The tests of `test_file` (already imported by pytest) marked `needs_kernels` as a whole."""
    path = Path(test_file).resolve()
    module = next(module for module in list(sys.modules.values())
                  if getattr(module, "__file__", None) and Path(module.__file__).resolve() == path)
    return [name for name, function in vars(module).items() if name.startswith("test_")
            and any(mark == needs_kernels.mark for mark in getattr(function, "pytestmark", []))]
