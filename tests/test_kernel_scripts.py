"""The GPU benchmark and profiling scripts under kernels/ import and parse their arguments on a machine without a GPU,
and the Nsight Compute summary can be rebuilt from the committed raw metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
SCRIPTS = ["bench_flash_mhf.py", "bench_flash_mhf_head_dims.py", "tune_flash_mhf.py", "profile_flash_mhf_kernels.py",
           "bench_token_lookup.py"]


def run_script(name, *args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, os.path.join(KERNELS, name), *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help(name):
    result = run_script(name, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout


def test_tune_candidates_parse():
    sys.path.insert(0, KERNELS)
    try:
        import tune_flash_mhf
    finally:
        sys.path.remove(KERNELS)
    for head_dim, specs in tune_flash_mhf.HEAD_DIM_CANDIDATES.items():
        candidates = tune_flash_mhf.explicit_candidates(specs)
        roles = [role for role, _, _ in candidates]
        assert roles == sorted(roles, key=["forward", "rows", "weights"].index), head_dim
        assert all(len(config) == 4 for _, _, config in candidates)
    with pytest.raises(SystemExit, match="role must be one of"):
        tune_flash_mhf.explicit_candidates(["backward:128,64,8,2"])


def test_ncu_summary_rebuilds_from_committed_csv(tmp_path):
    source = os.path.join(KERNELS, "results", "ncu")
    for role in ("forward", "rows", "weights"):
        shutil.copy(os.path.join(source, f"ncu_raw_{role}_before_gate_prefetch.csv"), tmp_path / f"ncu_{role}.csv")
    shutil.copy(os.path.join(source, "ncu_summary_before_gate_prefetch.json"), tmp_path / "ncu_summary.json")
    result = run_script("profile_flash_mhf_kernels.py", "--out", str(tmp_path), "--from-csv")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "ncu_summary.json").read_text())
    weights = summary["kernels"]["weights"]
    assert 40 < weights["tensor pipe active %"] < 60
    assert weights["stalls per issued instruction"]["long_scoreboard"] > 1
    assert "| tensor pipe active % |" in (tmp_path / "ncu_summary.md").read_text()
