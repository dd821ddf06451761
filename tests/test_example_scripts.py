"""The multi-GPU and benchmark shell scripts of examples/ and the scripts they call, on the CPU: the GPU work (the
recipe's runs, the benchmark's processes) is replaced by a stand-in `python3` / `python` on PATH that records its
calls and writes what the real one would leave behind."""

from __future__ import annotations

import json
import math
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import compare_loss_curves  # noqa: E402
import write_code_corpus  # noqa: E402

STAND_IN = """#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({{"argv": args, "triton_cache": os.environ.get("TRITON_CACHE_DIR")}}) + "\\n")
if args[:1] == ["-c"]:  # the imports checked: no datasets wheels to install, no DeepSpeed (unless FAKE_DEEPSPEED)
    no_deepspeed = args[1].startswith("import deepspeed") and not os.environ.get("FAKE_DEEPSPEED")
    sys.exit(1 if args[1] == "import datasets" or no_deepspeed else 0)
if any(a.endswith("write_code_corpus.py") for a in args):
    Path(args[-1]).write_text(json.dumps({{"text": "x"}}) + "\\n")
    sys.exit(0)
if any(a.endswith("save_initial_weights.py") for a in args):
    out = Path(args[2])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({{"made_with": args[3:]}}))
    sys.exit(0)
if any(a.endswith("pretrain.py") for a in args):
    out = Path(args[args.index("--output-dir") + 1])
    if out.name == os.environ.get("FAKE_FAIL"):
        sys.exit(1)
    init = Path(args[args.index("--init-from") + 1]) if "--init-from" in args else None
    out.mkdir(parents=True)
    (out / "train_log.jsonl").write_text('{{"step": 5, "loss": 1.0}}\\n{{"step": 5, "eval_loss": 1.0}}\\n')
    made_with = json.loads((init / "config.json").read_text())["made_with"] if init else None
    (out / "summary.json").write_text(json.dumps({{"init": made_with, "argv": args, "tokens_per_step": 8192}}))
    sys.exit(0)
if any(a.endswith("bench_continuous_batching.py") for a in args):
    sys.exit(3 if Path(args[args.index("--out") + 1]).name == os.environ.get("FAKE_FAIL") else 0)
os.execv(sys.executable, [sys.executable, *args])
"""


def run_script(tmp_path: Path, script: str, *args: str, cwd: Path | None = None,
               **env: str) -> subprocess.CompletedProcess:
    """`bash examples/SCRIPT ARGS` (in `cwd`, by default this process's) with the stand-in as `python3` and `python`;
    its calls go to tmp_path/calls."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        for name in ("python3", "python"):
            (bin_dir / name).write_text(STAND_IN.format(python=sys.executable))
            (bin_dir / name).chmod(0o755)
    # (the package importable as an install makes it, for the scripts the stand-in runs: the tests may run from a
    # checkout that is not installed)
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": python_path,
                   "FAKE_LOG": str(tmp_path / "calls"), **env}
    return subprocess.run(["bash", str(ROOT / "examples" / script), *args], env=environment, capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def calls(tmp_path: Path, script_name: str) -> list[dict]:
    lines = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").is_file() else []
    return [call for call in map(json.loads, lines) if any(a.endswith(script_name) for a in call["argv"])]


def test_ddp_check_starts_afresh_with_other_settings_and_exits_1_after_a_failed_run(tmp_path):
    """The README's two calls (small preset, then PRESET=370M) with the default WORK: the second trains from 370M
    initial weights, not the first call's; a later call with the same settings reuses them and the one-GPU run.
    (The first call makes the one-GPU run alone: the initial weights are what the second must not take from it.)"""
    work = str(tmp_path / "the work")  # a space in the paths
    first = run_script(tmp_path, "ddp_check.sh", str(tmp_path / "small results"), "2", RUNS="single", WORK=work)
    assert first.returncode == 0, first.stderr
    second = run_script(tmp_path, "ddp_check.sh", str(tmp_path / "370M results"), "2", RUNS="single ddp", WORK=work,
                        PRESET="370M")
    assert second.returncode == 0, second.stderr
    summaries = json.loads((tmp_path / "370M results" / "summaries.json").read_text())
    assert sorted(summaries) == ["ddp", "single"]
    for summary in summaries.values():
        assert summary["init"][summary["init"].index("--preset") + 1] == "370M"
    assert len(calls(tmp_path, "save_initial_weights.py")) == 2
    again = run_script(tmp_path, "ddp_check.sh", str(tmp_path / "370M results"), "2", RUNS="ddp", WORK=work,
                       PRESET="370M")
    assert again.returncode == 0, again.stderr
    assert len(calls(tmp_path, "save_initial_weights.py")) == 2 and len(calls(tmp_path, "pretrain.py")) == 4
    assert "`" + work + "/single`" in (tmp_path / "370M results" / "comparison.md").read_text()

    # a run that fails: exit 1 at the end, and none of its (or the comparison's) files of the earlier call is left
    failed = run_script(tmp_path, "ddp_check.sh", str(tmp_path / "370M results"), "2", RUNS="ddp", WORK=work,
                        PRESET="370M", FAKE_FAIL="ddp")
    assert failed.returncode == 1 and "ddp FAILED" in failed.stdout and "failed runs: ddp" in failed.stderr
    left = {p.name for p in (tmp_path / "370M results").iterdir()}
    assert "ddp_train_log.jsonl" not in left and "comparison.md" not in left and "single_train_log.jsonl" in left
    assert sorted(json.loads((tmp_path / "370M results" / "summaries.json").read_text())) == ["single"]


@pytest.mark.parametrize("arch, overrides", [("flash_mhf", ["--config-overrides", "ffn_kernel=torch"]),
                                             ("llama", [])])
def test_ddp_check_gives_the_ffn_kernel_to_flash_mhf_initial_weights_only(tmp_path, arch, overrides):
    """ffn_kernel is a field of FlashMHFLlama's config alone: save_initial_weights.py refuses it for the others."""
    result = run_script(tmp_path, "ddp_check.sh", str(tmp_path / "results"), "2", RUNS="single",
                        WORK=str(tmp_path / "work"), ARCH=arch, KERNEL="torch")
    assert result.returncode == 0, result.stderr
    argv = calls(tmp_path, "save_initial_weights.py")[0]["argv"]
    assert argv[argv.index("--arch") + 1] == arch and argv[argv.index("--preset") + 2:] == overrides


def test_ddp_check_refuses_an_unknown_run_before_any_run(tmp_path):
    result = run_script(tmp_path, "ddp_check.sh", str(tmp_path / "results"), "2", RUNS="single fsdp",
                        WORK=str(tmp_path / "work"))
    assert result.returncode == 2 and "unknown run fsdp (allowed: single ddp fsdp2 zero2 zero3)" in result.stderr
    assert not calls(tmp_path, "pretrain.py")


def test_ddp_check_gives_the_zero_runs_their_deepspeed_json_from_any_directory(tmp_path):
    """The ZeRO configs name their DeepSpeed JSON relative to the repository root (accelerate reads it from the
    current directory): run from another directory, each ZeRO run is given its JSON by the script's own path."""
    result = run_script(tmp_path, "ddp_check.sh", str(tmp_path / "results"), "2", RUNS="zero2 zero3 ddp",
                        WORK=str(tmp_path / "work"), FAKE_DEEPSPEED="1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    launches = [call["argv"] for call in calls(tmp_path, "pretrain.py")]
    assert len(launches) == 3
    for argv, stage in zip(launches, ("2", "3")):
        json_file = Path(argv[argv.index("--deepspeed_config_file") + 1])
        assert json_file.is_absolute() and json_file.samefile(ROOT / "examples" / "accelerate" / f"ds_zero{stage}.json")
    assert "--deepspeed_config_file" not in launches[2]


@pytest.fixture(scope="module")
def fsdp2_check_done(tmp_path_factory) -> Path:
    """A folder holding the `results` and `work` that a call of fsdp2_check.sh which succeeded leaves, made once: the
    earlier call that each test of a failed call copies and then follows."""
    done = tmp_path_factory.mktemp("fsdp2_check_done")
    result = run_script(done, "fsdp2_check.sh", str(done / "results"), "2", WORK=str(done / "work"))
    assert result.returncode == 0, result.stderr
    return done


def after_fsdp2_check(done: Path, tmp_path: Path) -> tuple[Path, str]:
    """RESULTS_DIR and WORK of a call that succeeded (`fsdp2_check_done`'s), copied into tmp_path for the next call."""
    for name in ("results", "work"):
        shutil.copytree(done / name, tmp_path / name, symlinks=True)
    return tmp_path / "results", str(tmp_path / "work")


def test_fsdp2_check_exits_1_after_a_failed_compile_run_and_keeps_no_earlier_compile_results(tmp_path,
                                                                                             fsdp2_check_done):
    assert (fsdp2_check_done / "results" / "comparison_compile.json").is_file()
    results, work = after_fsdp2_check(fsdp2_check_done, tmp_path)
    failed = run_script(tmp_path, "fsdp2_check.sh", str(results), "2", WORK=work, FAKE_FAIL="fsdp2-compile")
    assert failed.returncode == 1 and "torch.compile run FAILED" in failed.stdout
    left = {p.name for p in results.iterdir()}
    assert "comparison_compile.json" not in left and "fsdp2_compile_train_log.jsonl" not in left
    assert {"comparison.md", "summaries.json"} <= left


@pytest.mark.parametrize("failing", ["single", "fsdp2"])
def test_fsdp2_check_keeps_no_earlier_results_after_a_failed_run(tmp_path, fsdp2_check_done, failing):
    """A failed one-GPU or FSDP2 run exited non-zero but left the earlier call's comparison, train logs and
    summaries in RESULTS_DIR, read as this call's."""
    results, work = after_fsdp2_check(fsdp2_check_done, tmp_path)
    failed = run_script(tmp_path, "fsdp2_check.sh", str(results), "2", WORK=work, FAKE_FAIL=failing)
    assert failed.returncode != 0
    assert not list(results.iterdir())


def test_cold_cache_first_step_exits_1_after_a_failed_process_and_warm_needs_cold(tmp_path):
    out = tmp_path / "out dir"
    result = run_script(tmp_path, "cold_cache_first_step.sh", str(out), "3", FAKE_FAIL="cold_eager")
    assert result.returncode == 1 and "cold_eager failed" in result.stdout
    caches = {call["argv"][call["argv"].index("--out") + 1]: call["triton_cache"]
              for call in calls(tmp_path, "bench_continuous_batching.py")}
    assert list(caches) == [str(out / name) for name in ("cold", "warm", "cold_again", "cold_eager")]
    assert caches[str(out / "warm")] == caches[str(out / "cold")] != caches[str(out / "cold_again")]
    for runs, message in (("warm", "name cold before it"), ("warm cold", "name cold before it"),
                          ("cold wram", "unknown run wram")):
        refused = run_script(tmp_path, "cold_cache_first_step.sh", str(tmp_path / "other"), "3", RUNS=runs)
        assert refused.returncode == 2 and message in refused.stdout
    assert len(calls(tmp_path, "bench_continuous_batching.py")) == 4  # the refused calls ran nothing


def test_cold_cache_first_step_keeps_no_earlier_results_of_a_failed_process(tmp_path):
    """A process that failed before writing left the earlier call's results in its folder, beside its new log."""
    out = tmp_path / "out"
    for name in ("cold", "cold_again"):
        (out / name).mkdir(parents=True)
        (out / name / "continuous_batching.json").write_text("{}")
    result = run_script(tmp_path, "cold_cache_first_step.sh", str(out), "3", RUNS="cold cold_again",
                        FAKE_FAIL="cold")
    assert result.returncode == 1 and "cold failed" in result.stdout
    assert not (out / "cold").exists() and (out / "cold.log").is_file()


def write_run(folder: Path, losses: dict[int, float], tokens_per_step: int) -> Path:
    folder.mkdir()
    (folder / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n"
                                                    for s, v in losses.items()))
    (folder / "summary.json").write_text(json.dumps({"tokens_per_step": tokens_per_step}))
    return folder


def test_compare_loss_curves_refuses_runs_of_other_tokens_per_step(tmp_path, capsys):
    losses = {5: 3.0, 10: 2.5, 15: 2.2, 20: 2.1}
    reference = write_run(tmp_path / "single", losses, 8192)
    same = write_run(tmp_path / "ddp", losses, 8192)
    larger = write_run(tmp_path / "batch32", losses, 16384)
    assert compare_loss_curves.main([str(reference), str(same)])["runs"][str(same)]["within_noise"]
    with pytest.raises(SystemExit):
        compare_loss_curves.main([str(reference), str(larger), "--json", str(tmp_path / "out.json")])
    assert "different tokens per step" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_compare_loss_curves_refuses_runs_that_logged_other_windows_of_steps(tmp_path, capsys):
    """The loss logged at a step is the mean since the previous log: a run of --logging-steps 10 was compared at
    step 10 (steps 1-10) with a reference of --logging-steps 5 (steps 6-10) as if they were the same measure."""
    reference = write_run(tmp_path / "single", {5: 3.0, 10: 2.5, 15: 2.2, 20: 2.1}, 8192)
    coarser = write_run(tmp_path / "ddp", {10: 2.75, 20: 2.15}, 8192)
    with pytest.raises(SystemExit):
        compare_loss_curves.main([str(reference), str(coarser), "--json", str(tmp_path / "out.json")])
    assert "at step 10, steps 1-10 against 6-10" in capsys.readouterr().err and not (tmp_path / "out.json").exists()
    # a run that also logged at a checkpoint (--save-steps 12) holds other windows after it
    checkpointed = write_run(tmp_path / "fsdp2", {5: 3.0, 10: 2.5, 12: 2.3, 15: 2.2, 20: 2.1}, 8192)
    with pytest.raises(SystemExit):
        compare_loss_curves.main([str(reference), str(checkpointed)])
    assert "at step 15, steps 13-15 against 11-15" in capsys.readouterr().err
    # the steps of one run a subset of the other's, over the same windows: compared
    shorter = write_run(tmp_path / "zero2", {5: 3.0, 10: 2.5}, 8192)
    assert compare_loss_curves.main([str(reference), str(shorter)])["runs"][str(shorter)]["train_loss_difference"][
        "steps"] == 2


def test_compare_loss_curves_says_when_it_cannot_tell_the_noise_and_refuses_a_run_twice(tmp_path, capsys):
    """With one logged loss the reference's noise is unknown: no verdict (null in the JSON, which stays strict JSON,
    "-" in the table), where a NaN noise had called every run outside it. A run given twice is refused."""
    reference = write_run(tmp_path / "single", {5: 3.0}, 8192)
    other = write_run(tmp_path / "ddp", {5: 3.0}, 8192)
    compare_loss_curves.main([str(reference), str(other), "--json", str(tmp_path / "out.json"),
                              "--markdown", str(tmp_path / "out.md")])
    result = json.loads((tmp_path / "out.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert result["reference_train_noise"] is None and result["runs"][str(other)]["within_noise"] is None
    assert "(under two logged losses)" in (tmp_path / "out.md").read_text()
    with pytest.raises(SystemExit):
        compare_loss_curves.main([str(reference), str(tmp_path / "single" / ".." / "single")])
    assert "given more than once" in capsys.readouterr().err


def test_compare_loss_curves_reports_a_run_that_diverged_at_some_steps_as_not_within_noise(tmp_path):
    """A run whose loss was NaN at some steps had a mean difference of NaN but, `max` passing over a NaN that is not
    first, a largest difference of its finite steps' (0.01 here), as if it had stayed close to the reference."""
    reference = write_run(tmp_path / "single", {1: 5.0, 2: 4.6, 3: 4.3, 4: 4.1, 5: 3.9}, 8192)
    diverged = write_run(tmp_path / "ddp", {1: 5.01, 2: math.nan, 3: math.nan, 4: 4.11, 5: 3.91}, 8192)
    entry = compare_loss_curves.main([str(reference), str(diverged)])["runs"][str(diverged)]
    train = entry["train_loss_difference"]
    assert math.isnan(train["max_abs"]) and math.isnan(train["mean_abs"])
    assert entry["within_noise"] is False


@pytest.mark.parametrize("bad_loss", [math.nan, math.inf], ids=["nan", "inf"])
def test_compare_loss_curves_takes_a_reference_that_diverged(tmp_path, bad_loss):
    """A reference whose loss was NaN or infinite at a step stopped the comparison with an AttributeError from
    `statistics.pstdev` (its noise). The noise is that of its finite losses; the other run is not within it."""
    reference = write_run(tmp_path / "single", {1: 5.0, 2: 4.6, 3: bad_loss, 4: 4.1, 5: 3.9, 6: 3.8}, 8192)
    other = write_run(tmp_path / "ddp", {1: 5.0, 2: 4.6, 3: 4.3, 4: 4.1, 5: 3.9, 6: 3.8}, 8192)
    result = compare_loss_curves.main([str(reference), str(other), "--json", str(tmp_path / "out.json")])
    finite_losses = {1: 5.0, 2: 4.6, 4: 4.1, 5: 3.9, 6: 3.8}
    assert result["reference_train_noise"] == pytest.approx(compare_loss_curves.curve_noise(finite_losses))
    assert result["runs"][str(other)]["within_noise"] is False
    assert json.loads((tmp_path / "out.json").read_text())["runs"][str(other)]["train_loss_difference"][
        "max_abs"] is None


def test_compare_loss_curves_writes_a_diverged_run_as_strict_json(tmp_path):
    """The differences of a run that diverged went into the JSON as `NaN`, which strict readers refuse."""
    reference = write_run(tmp_path / "single", {1: 5.0, 2: 4.6, 3: 4.3, 4: 4.1, 5: 3.9}, 8192)
    diverged = write_run(tmp_path / "ddp", {1: 5.01, 2: 4.62, 3: 4.31, 4: 4.11, 5: math.nan}, 8192)
    compare_loss_curves.main([str(reference), str(diverged), "--json", str(tmp_path / "out.json")])
    result = json.loads((tmp_path / "out.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    entry = result["runs"][str(diverged)]
    assert entry["train_loss_difference"]["max_abs"] is None and entry["train_loss_difference"]["steps"] == 5
    assert entry["train_loss_difference"]["other_last"] is None and entry["within_noise"] is False


def test_compare_loss_curves_refuses_a_folder_without_a_train_log(tmp_path, capsys):
    """A mistyped run folder failed with a traceback (`FileNotFoundError`) instead of the usage and the run named."""
    reference = write_run(tmp_path / "single", {5: 3.0, 10: 2.5}, 8192)
    with pytest.raises(SystemExit):
        compare_loss_curves.main([str(reference), str(tmp_path / "fsdp"), "--json", str(tmp_path / "out.json")])
    assert "hold no train_log.jsonl" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_compare_loss_curves_writes_its_files_whole_or_not_at_all(tmp_path, monkeypatch):
    reference = write_run(tmp_path / "single", {5: 3.0, 10: 2.5}, 8192)
    other = write_run(tmp_path / "ddp", {5: 3.1, 10: 2.4}, 8192)
    out = tmp_path / "comparison.md"
    compare_loss_curves.main([str(reference), str(other), "--markdown", str(out)])
    before = out.read_text()
    real_write_text = Path.write_text

    def disk_full(path, text, *args, **kwargs):  # half the text reaches the disk, then the write fails
        real_write_text(path, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError):
        compare_loss_curves.main([str(reference), str(other), "--markdown", str(out)])
    monkeypatch.undo()
    assert out.read_text() == before


def test_scripts_without_their_output_argument_print_their_usage(tmp_path, monkeypatch):
    """Run without the path they write to, the scripts name what they take instead of a shell or Python error."""
    result = run_script(tmp_path, "cold_cache_first_step.sh")
    assert result.returncode == 2 and "usage: bash examples/cold_cache_first_step.sh OUT_DIR" in result.stdout
    script = str(ROOT / "examples" / "write_code_corpus.py")
    monkeypatch.setattr(sys, "argv", [script])
    with pytest.raises(SystemExit) as stopped:  # (the script's `__main__` block, run in this process)
        runpy.run_path(script, run_name="__main__")
    # (a message, which Python prints to stderr, exiting with status 1)
    assert isinstance(stopped.value.code, str)
    assert "usage: python examples/write_code_corpus.py OUT.jsonl" in stopped.value.code


@pytest.mark.parametrize("option", ["--help", "-h"])
def test_write_code_corpus_takes_an_option_for_no_path(tmp_path, monkeypatch, option):
    """`--help` was taken for the path of the corpus: the stdlib's 8 MB were written to a file named `--help`."""
    monkeypatch.chdir(tmp_path)
    script = str(ROOT / "examples" / "write_code_corpus.py")
    monkeypatch.setattr(sys, "argv", [script, option])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(script, run_name="__main__")
    assert "usage: python examples/write_code_corpus.py OUT.jsonl" in str(stopped.value.code)
    assert not list(tmp_path.iterdir())


def test_write_code_corpus_interrupted_leaves_no_corpus(tmp_path, monkeypatch):
    """ddp_check.sh reuses a corpus it finds, so an interrupted write must not leave one."""
    real_read_text = Path.read_text
    read = []

    def interrupted(path, *args, **kwargs):
        read.append(path)
        if len(read) == 3:
            raise KeyboardInterrupt
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_code_corpus.main(str(tmp_path / "corpus.jsonl"))
    assert not (tmp_path / "corpus.jsonl").exists()


def test_write_code_corpus_writes_a_linked_module_once(tmp_path, monkeypatch):
    """A module linked under two names (Ubuntu's `_sysconfigdata_*`) is one document, not two."""
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    (stdlib / "a.py").write_text("x = 1\n")
    (stdlib / "b.py").symlink_to(stdlib / "a.py")
    monkeypatch.setattr(write_code_corpus.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    write_code_corpus.main(str(tmp_path / "corpus.jsonl"))
    assert (tmp_path / "corpus.jsonl").read_text().splitlines() == ['{"text": "x = 1\\n"}']


def test_write_code_corpus_is_the_same_wherever_python_is_installed(tmp_path, monkeypatch):
    """The standard library's `test` package was left out by a folder named `test` anywhere in the path: a Python
    installed under one (`/home/test/.pyenv/...`) gave an empty corpus, which ddp_check.sh then reused."""
    stdlib = tmp_path / "test" / "lib"
    (stdlib / "test").mkdir(parents=True)
    (stdlib / "a.py").write_text("x = 1\n")
    (stdlib / "test" / "test_a.py").write_text("assert True\n")
    monkeypatch.setattr(write_code_corpus.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    write_code_corpus.main(str(tmp_path / "corpus.jsonl"))
    assert (tmp_path / "corpus.jsonl").read_text().splitlines() == ['{"text": "x = 1\\n"}']


def test_write_code_corpus_reads_sources_as_utf8_whatever_the_locale(tmp_path):
    """The sources were read in the locale's encoding with errors ignored: under an ASCII locale (LC_ALL=C without
    UTF-8 mode) every non-ASCII character of the corpus was dropped."""
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    (stdlib / "a.py").write_text('NAME = "café ☃"\n', encoding="utf-8")
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); import write_code_corpus; "
              f"write_code_corpus.sysconfig.get_paths = lambda: {{'stdlib': {str(stdlib)!r}}}; "
              f"write_code_corpus.main({str(tmp_path / 'corpus.jsonl')!r})")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "corpus.jsonl").read_text(encoding="utf-8")) == {"text": 'NAME = "café ☃"\n'}


def test_compare_loss_curves_names_the_differences_that_are_not_finite(tmp_path):
    """The comparison's JSON wrote a diverged run's NaN differences as a bare `null`, as if never measured, where the
    recipe's own files name such a value under `not_finite`: it names them too, and reads back as NaN."""
    from hf_memffn.run_records import read_run_record

    reference = write_run(tmp_path / "single", {1: 5.0, 2: 4.6, 3: 4.3, 4: 4.1, 5: 3.9}, 8192)
    diverged = write_run(tmp_path / "ddp", {1: 5.01, 2: 4.62, 3: 4.31, 4: 4.11, 5: math.nan}, 8192)
    compare_loss_curves.main([str(reference), str(diverged), "--json", str(tmp_path / "out.json")])
    text = (tmp_path / "out.json").read_text()
    train = json.loads(text)["runs"][str(diverged)]["train_loss_difference"]
    assert train["not_finite"] == {"max_abs": "NaN", "mean_abs": "NaN", "other_last": "NaN"}
    back = read_run_record(text)["runs"][str(diverged)]["train_loss_difference"]
    assert math.isnan(back["max_abs"]) and math.isnan(back["other_last"]) and back["reference_last"] == 3.9


def test_compare_loss_curves_leaves_out_a_last_log_line_cut_short(tmp_path, capsys):
    """A run stopped while appending to its train_log.jsonl (or one still writing it) leaves a last line cut short:
    the comparison was refused with json's "Unterminated string starting at: line 1 column 13", naming neither the
    file nor the line. That line is left out, as `--resume` drops it; a line that is no record before the last is
    refused naming the file and the line."""
    reference = write_run(tmp_path / "single", {1: 5.0, 2: 4.6, 3: 4.3}, 8192)
    stopped = write_run(tmp_path / "ddp", {1: 5.0, 2: 4.6, 3: 4.3}, 8192)
    log = stopped / "train_log.jsonl"
    log.write_text(log.read_text() + '{"step": 4, "lo')
    entry = compare_loss_curves.main([str(reference), str(stopped)])["runs"][str(stopped)]
    assert entry["train_loss_difference"]["steps"] == 3
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], lines[-1], *lines[1:-1]]) + "\n")
    with pytest.raises(SystemExit):
        compare_loss_curves.main([str(reference), str(stopped)])
    assert f"{log}: line 2 is no record of examples/pretrain.py's log" in capsys.readouterr().err


def test_compare_loss_curves_names_an_unreadable_summary_and_writes_into_a_new_folder(tmp_path, capsys):
    """A run whose summary.json is no JSON (cut short) was refused with json's "Expecting value", naming no file; a
    --json or --markdown path in a folder not made yet failed, after the table was printed, with a FileNotFoundError
    traceback naming the file's temporary name. The summary is named; the folder is made."""
    reference = write_run(tmp_path / "single", {1: 5.0, 2: 4.6, 3: 4.3}, 8192)
    other = write_run(tmp_path / "ddp", {1: 5.0, 2: 4.6, 3: 4.3}, 8192)
    out = tmp_path / "comparisons" / "ddp"
    compare_loss_curves.main([str(reference), str(other), "--json", str(out / "out.json"),
                              "--markdown", str(out / "out.md")])
    assert json.loads((out / "out.json").read_text())["reference"] == str(reference)
    assert (out / "out.md").read_text().startswith("Reference:")
    (other / "summary.json").write_text('{"tokens_per_step": 81')
    with pytest.raises(SystemExit):
        compare_loss_curves.main([str(reference), str(other)])
    assert f"{other / 'summary.json'} is no summary of examples/pretrain.py" in capsys.readouterr().err
