"""examples/compare_engine_profiles.py reads the committed two-GPU profiles into one table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RESULTS = EXAMPLES / "results" / "multi_gpu_h100x2"
sys.path.insert(0, str(EXAMPLES))
import compare_engine_profiles  # noqa: E402


def test_the_committed_profiles_give_one_row_per_engine_and_model(tmp_path):
    rows = compare_engine_profiles.main([
        str(RESULTS / "370M_profiled_flash_mhf"), str(RESULTS / "370M_profiled_llama"),
        "--markdown", str(tmp_path / "table.md"), "--json", str(tmp_path / "table.json"),
    ])
    assert [(r["model"], r["run"]) for r in rows] == [
        (model, run) for model in ("memffn_flash_mhf", "llama") for run in compare_engine_profiles.RUNS]
    assert json.loads((tmp_path / "table.json").read_text()) == rows
    assert (tmp_path / "table.md").read_text() == (RESULTS / "engine_profiles.md").read_text()
    assert {r["device"] for r in rows} == {"NVIDIA H100 80GB HBM3"}  # the table says which GPU measured it
    assert (tmp_path / "table.md").read_text().startswith("Device: NVIDIA H100 80GB HBM3.\n")
    for row in rows:  # each GPU's kernel time fits in its step; one GPU and DDP keep it busy
        assert 0 < row["kernel_ms_per_step"] <= row["wall_ms_per_step"]
        assert (row["gpu_idle_fraction"] < 0.15) == (row["run"] in ("single", "ddp"))


def test_the_table_footer_units_and_a_missing_profile():
    assert compare_engine_profiles.total_ms("Self CUDA time total: 1.714s", "Self CUDA") == pytest.approx(1714.0)
    assert compare_engine_profiles.total_ms("Self CPU time total: 663.728ms", "Self CPU") == pytest.approx(663.728)
    assert compare_engine_profiles.total_ms("Self CUDA time total: 12.5us", "Self CUDA") == pytest.approx(0.0125)
    with pytest.raises(ValueError, match="Self CUDA"):
        compare_engine_profiles.total_ms("no footer", "Self CUDA")
    with pytest.raises(SystemExit, match="--profile-steps"):
        compare_engine_profiles.main([str(RESULTS / "small_200_steps")])


def test_a_folder_without_profiles_among_others_is_refused_before_writing(tmp_path):
    """A mistyped folder after a good one left its rows out of the table, and the script exited 0."""
    with pytest.raises(SystemExit, match="370M_profiled_lama"):
        compare_engine_profiles.main([str(RESULTS / "370M_profiled_flash_mhf"), str(RESULTS / "370M_profiled_lama"),
                                      "--json", str(tmp_path / "table.json")])
    assert not (tmp_path / "table.json").exists()
