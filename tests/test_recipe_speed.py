"""examples/recipe_speed.py on CPU: two eager runs of the recipe at the tiny preset, side by side, and its run specs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "reproduce"))
import prepare_data  # noqa: E402
import recipe_speed  # noqa: E402


def test_run_specs_name_the_allowed_values():
    assert recipe_speed.parse_run("flash_mhf:reduce-overhead:4") == {
        "arch": "flash_mhf", "mode": "reduce-overhead", "batch": 4, "name": "flash_mhf_reduce-overhead_b4"}
    assert recipe_speed.parse_run("llama:eager")["batch"] == 1
    for spec, allowed in (("gpt2:eager", "ARCH must be one of llama, flash_mhf"),
                          ("llama:fast", "MODE must be one of eager, default, reduce-overhead"),
                          ("llama:eager:0", "BATCH must be a positive integer"),
                          ("llama:eager:two", "BATCH must be a positive integer"),
                          ("llama", "expected ARCH:MODE")):
        with pytest.raises(argparse.ArgumentTypeError, match=allowed):
            recipe_speed.parse_run(spec)


def test_a_run_named_again_gets_a_row_of_its_own_and_each_row_a_ratio_to_the_first_at_its_batch():
    runs = [recipe_speed.parse_run(spec) for spec in ("llama:eager:2", "flash_mhf:eager:2", "llama:eager:2",
                                                      "llama:eager:2", "flash_mhf:eager:4")]
    recipe_speed.name_repeated_runs(runs)
    names = [run["name"] for run in runs]
    assert names == ["llama_eager_b2", "flash_mhf_eager_b2", "llama_eager_b2_2", "llama_eager_b2_3",
                     "flash_mhf_eager_b4"]
    rows = [{**run, "tokens_per_second": speed} for run, speed in zip(runs, (100.0, 80.0, 110.0, 90.0, 50.0))]
    recipe_speed.add_ratios(rows)
    assert [(row["ratio"], row["ratio_to"]) for row in rows] == [
        (1.0, names[0]), (0.8, names[0]), (1.1, names[0]), (0.9, names[0]), (1.0, names[4])]


@pytest.mark.slow
def test_two_recipe_runs_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the recipe's runs on the CPU, on a GPU machine too
    data = tmp_path / "data"
    prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                       "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "20000",
                       "--max-heldout-tokens", "2000", "--wiki", "no"])
    out = tmp_path / "results"
    result = recipe_speed.main(["--out", str(out), "--data-dir", str(data), "--work", str(tmp_path / "work"),
                                "--preset", "tiny", "--block-size", "32", "--steps", "6", "--logging-steps", "2",
                                "--skip-windows", "1", "--precision", "fp32",
                                "--runs", "llama:eager:2", "flash_mhf:eager:2"])
    rows = result["rows"]
    assert [row["name"] for row in rows] == ["llama_eager_b2", "flash_mhf_eager_b2"]
    for row in rows:
        assert row["returncode"] == 0 and "error" not in row, row
        assert row["tokens_per_second"] > 0 and len(row["windows"]) == 2  # windows 2 and 3 of 3
        assert row["ms_per_step"] == pytest.approx(1000 * 64 / row["tokens_per_second"], rel=0.01)
        assert (out / f"{row['name']}.log").is_file() and (out / f"{row['name']}_train_log.jsonl").is_file()
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio_to"] == "llama_eager_b2"
    assert json.loads((out / "recipe_speed.json").read_text())["rows"][1]["arch"] == "flash_mhf"
    table = (out / "recipe_speed.md").read_text()
    assert "| flash_mhf_eager_b2 | flash_mhf | eager | 2 |" in table and "cpu" in table
    assert not list(out.glob(".*.tmp"))
    assert not list((tmp_path / "work").glob("*_eager_b2*"))  # each run's folder (its saved model) is gone once read
    # the runs import the checkout the script imported, also where the package is not installed
    assert recipe_speed.run_environment()["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_missing_shards_are_refused_and_a_failed_run_is_a_row_that_says_so(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        recipe_speed.main(["--out", str(tmp_path / "results"), "--data-dir", str(tmp_path / "missing"),
                           "--runs", "llama:eager"])
    assert "--data-dir" in capsys.readouterr().err and not (tmp_path / "results").exists()
    with pytest.raises(ValueError, match="--vocab-size must be"):  # the default shards' vocabulary, out of range
        recipe_speed.main(["--out", str(tmp_path / "results"), "--work", str(tmp_path / "work"), "--vocab-size", "10",
                           "--runs", "llama:eager"])
    assert not (tmp_path / "results").exists()

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"")
    # a run whose process fails (a stand-in for the recipe, which would take seconds to import torch first)
    monkeypatch.setattr(recipe_speed, "recipe_command", lambda run, args, output_dir: [
        sys.executable, "-c", "import sys; print('the recipe failed'); sys.exit(3)"])
    result = recipe_speed.main(["--out", str(tmp_path / "results"), "--data-dir", str(data),
                                "--work", str(tmp_path / "work"), "--preset", "tiny", "--runs", "llama:eager"])
    (row,) = result["rows"]
    assert row["returncode"] == 3 and "the recipe failed" in " ".join(row["error"])
    assert "| llama_eager_b1 | llama | eager | 1 | failed: " in (tmp_path / "results" / "recipe_speed.md").read_text()



def stand_in_recipe(tmp_path, monkeypatch, windows: int, summary: dict) -> Path:
    """A data folder, and the recipe replaced by a process that logs `windows` speeds (10, 20, ... tokens/s) and
    writes `summary`; returns the data folder."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"")
    script = ("import json, pathlib, sys; out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True); "
              "(out / 'train_log.jsonl').write_text(''.join(json.dumps({'tokens_per_second': 10.0 * i}) + chr(10) "
              f"for i in range(1, {windows + 1}))); (out / 'summary.json').write_text(json.dumps({summary!r}))")
    monkeypatch.setattr(recipe_speed, "recipe_command", lambda run, args, output_dir: [
        sys.executable, "-c", script, str(output_dir)])
    return data


def test_counts_that_would_skew_the_measure_are_refused(tmp_path, capsys, monkeypatch):
    """--skip-windows -1 made the last window alone the speed; --steps 0 would have the recipe train epochs."""
    data = stand_in_recipe(tmp_path, monkeypatch, 4, {"tokens_per_step": 100, "parameters": {"total": 1}})
    common = ["--out", str(tmp_path / "results"), "--data-dir", str(data), "--work", str(tmp_path / "work"),
              "--preset", "tiny", "--runs", "llama:eager"]
    assert recipe_speed.main(common)["rows"][0]["windows"] == [30.0, 40.0]  # after the first 2 of 4
    for option, value, message in (("--skip-windows", "-1", "--skip-windows must be at least 0"),
                                   ("--steps", "0", "--steps must be at least 1"),
                                   ("--logging-steps", "0", "--logging-steps must be at least 1"),
                                   ("--block-size", "0", "--block-size must be at least 1"),
                                   ("--preset", "big", "invalid choice: 'big'")):
        with pytest.raises(SystemExit):
            recipe_speed.main([*common, option, value])
        assert message in capsys.readouterr().err


def test_the_results_name_the_library_versions(tmp_path, monkeypatch):
    """recipe_speed.{json,md} named the device but not the torch, transformers and triton the runs used."""
    import torch
    import transformers

    data = stand_in_recipe(tmp_path, monkeypatch, 1, {"tokens_per_step": 100, "device": "cpu",
                                                     "parameters": {"total": 1}})
    out = tmp_path / "results"
    result = recipe_speed.main(["--out", str(out), "--data-dir", str(data), "--work", str(tmp_path / "work"),
                                "--preset", "tiny", "--skip-windows", "0", "--runs", "llama:eager"])
    versions = json.loads((out / "recipe_speed.json").read_text())["versions"]
    assert versions == result["versions"]
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    table = (out / "recipe_speed.md").read_text()
    assert f"torch {torch.__version__}, transformers {transformers.__version__}" in table


def test_default_shards_come_from_the_standard_library_once_per_vocabulary_and_stream(tmp_path):
    """The shards were cached by vocabulary size alone: a later call needing a longer training stream (more --steps,
    a larger --block-size or batch) read the shorter stream built for an earlier one, repeating it unsaid."""
    work = tmp_path / "work"
    folder = recipe_speed.standard_library_shards(work, 300, 20_000)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] == 20_000 and meta["tokenizer"]["vocab_size"] <= 300
    assert "argparse.py" in meta["source"]["name"]
    built = (folder / "train.bin").stat().st_mtime_ns
    assert recipe_speed.standard_library_shards(work, 300, 20_000) == folder  # found, not built again
    assert (folder / "train.bin").stat().st_mtime_ns == built
    longer = recipe_speed.standard_library_shards(work, 300, 30_000)
    assert longer != folder and json.loads((longer / "meta.json").read_text())["splits"]["train"]["tokens"] == 30_000
    assert (folder / "train.bin").stat().st_mtime_ns == built  # the first stream is kept for calls of its settings


def test_standard_library_files_name_each_file_once(tmp_path, monkeypatch):
    """Ubuntu's Python links one `_sysconfigdata_*` module under two names; both names went to prepare_data, which
    refuses a file named twice, so the recipe's default data failed to build there."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").symlink_to(tmp_path / "a.py")
    (tmp_path / "c.py").write_text("y = 2\n")
    monkeypatch.setattr(recipe_speed.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert recipe_speed.standard_library_files() == [str(tmp_path / "a.py"), str(tmp_path / "c.py")]


def test_a_diverged_run_reads_its_loss_back_and_names_it_in_the_results(tmp_path, monkeypatch):
    """A run whose training loss diverged (NaN: null in summary.json, named under `not_finite`) was read as a bare
    null and written into recipe_speed.json as one, the same as a loss never logged: the row holds the NaN, and
    recipe_speed.json writes it as null named under `not_finite` (`hf_memffn.run_records`)."""
    import math

    from hf_memffn.run_records import read_run_record

    data = stand_in_recipe(tmp_path, monkeypatch, 1, {"tokens_per_step": 100, "device": "cpu", "train_loss": None,
                                                     "parameters": {"total": 1}, "not_finite": {"train_loss": "NaN"}})
    out = tmp_path / "results"
    result = recipe_speed.main(["--out", str(out), "--data-dir", str(data), "--work", str(tmp_path / "work"),
                                "--preset", "tiny", "--skip-windows", "0", "--runs", "llama:eager"])
    assert math.isnan(result["rows"][0]["final_train_loss"])
    text = (out / "recipe_speed.json").read_text()
    (row,) = json.loads(text, parse_constant=lambda constant: pytest.fail(f"{constant} is not JSON"))["rows"]
    assert row["final_train_loss"] is None and row["not_finite"] == {"final_train_loss": "NaN"}
    assert math.isnan(read_run_record(text)["rows"][0]["final_train_loss"])
