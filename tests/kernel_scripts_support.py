"""What the tests of the scripts under kernels/ share: where the scripts are, and how a test imports or runs one."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
# the scripts import this checkout, and whatever else PYTHONPATH names (e.g. another Triton, to check its builds)
SCRIPT_PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))


def kernel_script(name: str):
    """A script of ``kernels/`` imported as a module (its own imports of the other scripts resolve)."""
    sys.path.insert(0, KERNELS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(KERNELS)


def run_script(name, *args, hide_gpus=False):
    env = {**os.environ, "PYTHONPATH": SCRIPT_PYTHONPATH, **({"CUDA_VISIBLE_DEVICES": ""} if hide_gpus else {})}
    return subprocess.run([sys.executable, os.path.join(KERNELS, name), *args], capture_output=True, text=True,
                          env=env, timeout=300)
