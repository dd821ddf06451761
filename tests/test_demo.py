"""`hf-memffn demo --quick` end to end: every architecture trains, is saved, one reloads with remote code."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest
from transformers.utils import logging as transformers_logging

from hf_memffn import cli
from hf_memffn.architectures import ARCHITECTURE_NAMES, DISPLAY_NAMES


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    stdout, stderr = io.StringIO(), io.StringIO()  # neither is a terminal, as in a log file or CI
    bars_before = transformers_logging.is_progress_bar_enabled()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = cli.main(["demo", "--quick", "--out", str(out)])
    assert status == 0
    assert transformers_logging.is_progress_bar_enabled() == bars_before  # the demo restores transformers' bars
    return out, stdout.getvalue(), json.loads((out / "results.json").read_text()), stderr.getvalue()


def test_off_a_terminal_each_model_reports_one_line_and_no_progress_bar(quick_demo):
    *_, stderr = quick_demo
    assert "\r" not in stderr and "it/s" not in stderr and "step/s" not in stderr  # no bar of ours or transformers'
    lines = [line for line in stderr.splitlines() if " steps in " in line]
    assert [line.split(":")[0].strip() for line in lines] == [DISPLAY_NAMES[a] for a in ARCHITECTURE_NAMES]
    assert all("last loss" in line and "tokens/s" in line for line in lines)


def test_quick_demo_writes_every_output(quick_demo):
    out, _, summary, _ = quick_demo
    for name in ("results.json", "results.md", "loss_curves.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for arch in ARCHITECTURE_NAMES:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (out / arch / name).is_file(), (arch, name)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    assert summary["archs"] == list(ARCHITECTURE_NAMES)


def test_quick_demo_table_has_every_arch_and_learns(quick_demo):
    out, stdout, summary, _ = quick_demo
    markdown = (out / "results.md").read_text()
    for arch, result in zip(ARCHITECTURE_NAMES, summary["results"]):
        assert result["arch"] == arch
        assert DISPLAY_NAMES[arch] in markdown and DISPLAY_NAMES[arch] in stdout
        assert 0 < result["active_params"] <= result["total_params"]
        losses = result["losses"]
        assert len(losses) == summary["settings"]["steps"]
        assert all(math.isfinite(x) for x in losses) and math.isfinite(result["held_out_loss"])
        assert result["train_loss"] < losses[0] - 0.5, (arch, losses[0], result["train_loss"])
        assert 0.0 <= result["recall_greedy"] <= 1.0 and 0.0 <= result["recall"] <= 1.0
        assert result["tokens_per_second"] > 0
    memory = {r["arch"]: r for r in summary["results"]}["memoryllm"]
    assert memory["active_params"] < memory["total_params"]  # its FFNs on X0 become lookup tables
    assert 0 < summary["recall_chance"] < 0.2


def test_quick_demo_reload_with_remote_code_matches(quick_demo):
    _, stdout, summary, _ = quick_demo
    reload = summary["reload"]
    assert reload["directory"].endswith("flash_mhf")
    assert not reload["class"].startswith("hf_memffn.")  # loaded from the code saved beside the weights
    assert reload["matched"], reload
    assert len(reload["samples"]) == 5  # one held-out question per attribute
    assert all(item["prompt"] in stdout for item in reload["samples"])


def _exits_with_error(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


def test_bad_arguments_fail_before_writing(tmp_path, capsys):
    out = tmp_path / "never"
    _exits_with_error(capsys, ["demo", "--archs", "llama,gpt2", "--out", str(out)], "--archs")
    _exits_with_error(capsys, ["demo", "--steps", "0", "--out", str(out)], "--steps")
    _exits_with_error(capsys, ["demo", "--text-files", str(tmp_path / "missing.txt"), "--out", str(out)],
                      "--text-files")
    assert not out.exists()


def test_text_files_that_are_not_utf8_are_refused_naming_the_file(tmp_path, capsys):
    """A Latin-1 file was read with its accented letters replaced by U+FFFD, and trained on as such."""
    (tmp_path / "latin1.txt").write_bytes("Café au lait, crème brûlée.\n\nNaïve résumé.\n".encode("latin-1"))
    out = tmp_path / "never"
    _exits_with_error(capsys, ["demo", "--quick", "--text-files", str(tmp_path / "latin1.txt"), "--out", str(out)],
                      f"--text-files contains {str(tmp_path / 'latin1.txt')!r}, which is not UTF-8 text")
    assert not out.exists()


def test_an_empty_out_is_refused_not_taken_for_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # (--archs is bad too: the empty --out is the error named, found while the arguments are parsed)
    _exits_with_error(capsys, ["demo", "--out", "", "--archs", "gpt2"], "argument --out: '' is an empty path")
    assert list(tmp_path.iterdir()) == []


def test_dataset_without_datasets_package_is_a_clear_error(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    _exits_with_error(capsys, ["demo", "--quick", "--dataset", "some/dataset", "--out", str(tmp_path / "out")],
                      "pip install 'hf-memffn[train]' (or pip install datasets)")


def test_a_split_that_a_dataset_saved_alone_lacks_is_refused(tmp_path, capsys):
    """`--dataset-split validation` of a folder that `save_to_disk` wrote from one Dataset (no splits) trained on
    the whole dataset, described as its validation split."""
    datasets = pytest.importorskip("datasets")

    rows = [{"text": f"Paragraph {i} of the memory."} for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows, split="test").save_to_disk(str(tmp_path / "saved_test"))
    out = tmp_path / "never"
    _exits_with_error(capsys, ["demo", "--quick", "--dataset", str(tmp_path / "saved"), "--dataset-split", "validation",
                               "--out", str(out)], "--dataset-split='validation' is not a split of")
    _exits_with_error(capsys, ["demo", "--quick", "--dataset", str(tmp_path / "saved_test"), "--dataset-split",
                               "validation", "--out", str(out)], "allowed: train or test")
    assert not out.exists()


def test_text_files_of_windows_editors_give_paragraphs_without_byte_order_mark(tmp_path):
    """A file saved with a UTF-8 byte-order mark began its first paragraph with U+FEFF, trained on as text."""
    import argparse

    from hf_memffn import demo

    (tmp_path / "notes.txt").write_bytes("\ufeffFirst paragraph.\r\n\r\nSecond one.\r\n".encode("utf-8"))
    paragraphs, _ = demo._read_real_text(argparse.Namespace(text_files=[str(tmp_path / "notes.txt")], dataset=None,
                                                            max_chars=10_000))
    assert paragraphs == ["First paragraph.", "Second one."]


def test_text_files_switch_to_real_text(tmp_path):
    text = "\n\n".join(f"Paragraph {i}: the keys of the memory store patterns and the values store "
                       f"next tokens, read {i % 7} times." for i in range(60))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["demo", "--quick", "--archs", "llama", "--steps", "6", "--vocab-size", "300",
                  "--text-files", str(tmp_path / "a.txt"), "--out", str(out)])
    summary = json.loads((out / "results.json").read_text())
    (result,) = summary["results"]
    assert result["recall"] is None and summary["recall_chance"] is None
    assert math.isfinite(result["held_out_loss"])
    assert summary["reload"]["matched"]


def test_quick_demo_exports_lookup_tables_and_lookup_mode_matches(quick_demo):
    out, stdout, summary, _ = quick_demo
    lookup = summary["token_lookup"]
    assert set(lookup["formats"]) == {"fp32", "int8"}
    exact = lookup["formats"]["fp32"]
    assert exact["tokens_match"] and exact["logits_max_relative_diff"] < 1e-5
    assert exact["generated_lookup"] == exact["generated_compute"]
    assert lookup["formats"]["int8"]["size_bytes"] < exact["size_bytes"]
    assert (out / "memoryllm" / "token_lookup" / "fp32" / "token_lookup.safetensors.index.json").is_file()
    assert "token lookup tables" in stdout
    assert (out / "facts.txt").read_text().count("\n") > 10  # texts for `hf-memffn analyze`


def test_flash_mhf_torch_op_note_is_printed_once_on_a_gpu(tmp_path, monkeypatch):
    """On CUDA, FFN heads of a width the Triton kernels do not take (the default 32) run the PyTorch op, and the demo
    says so once (CUDA pretended: the run stops where the first model would start training)."""
    import torch

    from hf_memffn import demo

    class Stop(Exception):
        pass

    def stop_training(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(demo, "_parse_device", lambda value: torch.device("cuda"))
    monkeypatch.setattr(demo, "train", stop_training)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()), pytest.raises(Stop):
        cli.main(["demo", "--quick", "--archs", "flash_mhf", "--device", "cuda", "--out", str(tmp_path / "out")])
    notes = [line for line in stdout.getvalue().splitlines() if line.startswith("note: FlashMHFLlama")]
    assert len(notes) == 1 and "32 wide" in notes[0] and "--hidden-size 128" in notes[0], notes


def test_results_json_writes_null_for_a_diverged_runs_losses():
    """A diverged run's nan (or inf) loss was written as `NaN`, which strict JSON readers refuse: now `null`, the
    other numbers unchanged."""
    from dataclasses import asdict

    from hf_memffn.demo import ArchResult, results_json

    diverged = ArchResult(arch="kvffn", name="KVFFN", total_params=10, active_params=10, train_loss=math.nan,
                          held_out_loss=math.inf, recall=0.25, recall_greedy=None, tokens_per_second=100.0,
                          train_seconds=1.5, losses=[2.5, -math.inf, math.nan])
    text = results_json({"results": [asdict(diverged)], "recall_chance": None, "formats": {"int8": (0.0, math.nan)}})

    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")

    summary = json.loads(text, parse_constant=refuse)
    result = summary["results"][0]
    assert result["train_loss"] is None and result["held_out_loss"] is None and result["losses"] == [2.5, None, None]
    assert result["recall"] == 0.25 and result["tokens_per_second"] == 100.0 and result["total_params"] == 10
    assert summary["recall_chance"] is None and summary["formats"] == {"int8": [0.0, None],
                                                                       "not_finite": {"int8": {"1": "NaN"}}}


def test_a_diverged_memoryllm_finishes_the_run_with_null_losses(tmp_path):
    """A MemoryLLM whose training diverged stopped the demo at its token lookup export ("values that are not finite"),
    after every model had trained and before results.json was written; the reload check of a diverged model called
    the same nan logits of the reloaded model a mismatch."""
    out = tmp_path / "out"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        status = cli.main(["demo", "--quick", "--archs", "memoryllm", "--steps", "6", "--lr", "1e6", "--out", str(out)])
    assert status == 0
    summary = json.loads((out / "results.json").read_text())
    (result,) = summary["results"]
    assert result["train_loss"] is None and result["held_out_loss"] is None
    assert summary["token_lookup"] is None and not (out / "memoryllm" / "token_lookup").exists()
    assert "MemoryLLM diverged" in stdout.getvalue()
    assert summary["reload"]["matched"] and summary["reload"]["max_abs_logit_difference"] == 0.0


def test_a_rerun_with_other_settings_removes_the_earlier_runs_other_models(tmp_path):
    """A run into an --out of an earlier run with other settings left that run's model folders (another tokenizer,
    another world) and its facts.txt beside the new results; folders of a run with the same settings stay."""
    text = "\n\n".join(f"Paragraph {i}: the keys of the memory store patterns, read {i % 7} times." for i in range(40))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    for name in ("kvffn", "memoryllm"):
        (out / name).mkdir(parents=True)
        (out / name / "config.json").write_text("{}")
    (out / "facts.txt").write_text("Kirbes Tel lives in Oskport.\n")
    earlier = {"archs": ["llama", "kvffn"], "settings": {"steps": 600}, "data": "fact world (seed 0)", "results": []}
    (out / "results.json").write_text(json.dumps(earlier))
    argv = ["demo", "--quick", "--archs", "llama", "--steps", "2", "--vocab-size", "300", "--text-files",
            str(tmp_path / "a.txt"), "--out", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["llama", "loss_curves.png", "memoryllm", "results.json",
                                                     "results.md"]  # (memoryllm/: not the earlier run's)
    assert "kvffn/, facts.txt" in stdout.getvalue()

    summary = json.loads((out / "results.json").read_text())
    for key in ("archs", "model_folders"):  # as if kvffn had been trained before with these settings
        summary[key].append("kvffn")
    (out / "results.json").write_text(json.dumps(summary))
    (out / "kvffn").mkdir()
    (out / "kvffn" / "config.json").write_text("{}")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(argv) == 0
    assert (out / "kvffn" / "config.json").is_file()
    summary = json.loads((out / "results.json").read_text())
    assert summary["archs"] == ["llama"] and summary["model_folders"] == ["kvffn", "llama"]

    # a run with another seed removes the folder kept by the run with the same settings: it listed the kept folder
    # in `model_folders`, where before only `archs` (what it trained) was listed and kvffn/ of the first world stayed
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(argv + ["--seed", "1"]) == 0
    assert not (out / "kvffn").exists() and "wrote: kvffn/" in stdout.getvalue()
    assert json.loads((out / "results.json").read_text())["model_folders"] == ["llama"]


def test_the_reload_script_loads_the_tokenizer_without_asking_to_trust_the_code(tmp_path):
    """The reload runs where `hf_memffn` cannot be imported, so `AutoTokenizer` meets a model type it does not know in
    config.json and, without `trust_remote_code`, asked `[y/N]` on the terminal, into the output the demo captures:
    the demo stood still for transformers' 15 s prompt timeout. It trusts the code it loads the model with."""
    from transformers import AutoModelForCausalLM

    from hf_memffn import demo
    from hf_memffn.testing import tiny_config, tiny_tokenizer

    demo.save_model(AutoModelForCausalLM.from_config(tiny_config("kvffn")), tiny_tokenizer(), tmp_path / "kvffn")
    (tmp_path / "prompts.json").write_text(json.dumps(["the key"]))
    done = subprocess.run([sys.executable, "-c", demo._RELOAD_SCRIPT, str(tmp_path / "kvffn"), "cpu",
                           str(tmp_path / "prompts.json"), str(tmp_path / "reload.json")],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trust_remote_code" not in done.stdout + done.stderr
    assert len(json.loads((tmp_path / "reload.json").read_text())["generated"]) == 1


def test_a_run_stopped_before_its_results_leaves_no_results_of_other_models(tmp_path, monkeypatch):
    """A run with other settings stopped (Ctrl-C, SIGTERM) after saving its models, before results.json, left the
    earlier run's results.json, results.md and loss curves beside the new models, describing models the folder no
    longer held. The earlier run's results and folders go before the first model is written."""
    from hf_memffn import demo

    text = "\n\n".join(f"Paragraph {i}: the keys of the memory store patterns, read {i % 7} times." for i in range(40))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    (out / "kvffn").mkdir(parents=True)
    (out / "kvffn" / "config.json").write_text("{}")
    for name in ("results.md", "loss_curves.png"):
        (out / name).write_text("of the earlier run")
    earlier = {"archs": ["llama", "kvffn"], "settings": {"steps": 600}, "data": "fact world (seed 0)", "results": []}
    (out / "results.json").write_text(json.dumps(earlier))

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "reload_and_generate", stopped)  # (every model is saved by then)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--quick", "--archs", "llama", "--steps", "2", "--vocab-size", "300", "--text-files",
                  str(tmp_path / "a.txt"), "--out", str(out)])
    assert stop.value.code == 130
    assert sorted(p.name for p in out.iterdir()) == ["llama"] and (out / "llama" / "config.json").is_file()


def test_results_json_names_the_numbers_that_are_not_finite_as_the_recipes_files_do():
    """results.json wrote a diverged run's NaN or infinite loss as a bare `null`, as if never measured, where the
    recipe's summary.json and train_log.jsonl name such a value under `not_finite`. Each object of results.json now
    names its own fields (a list field its items by index), and `read_run_record` gives the numbers back."""
    from dataclasses import asdict

    from hf_memffn.demo import ArchResult, results_json
    from hf_memffn.run_records import read_run_record

    diverged = ArchResult(arch="kvffn", name="KVFFN", total_params=10, active_params=10, train_loss=math.nan,
                          held_out_loss=math.inf, recall=0.25, recall_greedy=None, tokens_per_second=100.0,
                          train_seconds=1.5, losses=[2.5, -math.inf, math.nan])
    text = results_json({"results": [asdict(diverged)], "recall_chance": None, "total_seconds": 3.0})
    result = json.loads(text, parse_constant=lambda name: pytest.fail(name))["results"][0]
    assert result["train_loss"] is None and result["held_out_loss"] is None and result["recall_greedy"] is None
    assert result["not_finite"] == {"train_loss": "NaN", "held_out_loss": "Infinity",
                                    "losses": {"1": "-Infinity", "2": "NaN"}}
    read = read_run_record(text)
    (back,) = read["results"]
    assert math.isnan(back["train_loss"]) and back["held_out_loss"] == math.inf and back["recall_greedy"] is None
    assert back["losses"][:2] == [2.5, -math.inf] and math.isnan(back["losses"][2]) and "not_finite" not in back
    assert read["recall_chance"] is None and read["total_seconds"] == 3.0 and "not_finite" not in read


def test_a_failed_save_of_the_loss_curves_closes_their_figure(tmp_path, monkeypatch):
    """The loss curves' figure was closed only after it was saved: a save that failed (a full disk, a folder that
    cannot be written) left it open in pyplot, one more figure for each call in a process that goes on."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from hf_memffn.demo import QUICK, ArchResult, plot_losses

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    result = ArchResult(arch="llama", name="Llama", total_params=10, active_params=10, train_loss=2.0,
                        held_out_loss=2.1, recall=None, recall_greedy=None, tokens_per_second=1.0, train_seconds=1.0,
                        losses=[3.0, 2.5, 2.0])
    open_before = plt.get_fignums()
    with pytest.raises(OSError, match="No space left"):
        plot_losses([result], QUICK, tmp_path / "loss_curves.png")
    assert plt.get_fignums() == open_before and not list(tmp_path.iterdir())
