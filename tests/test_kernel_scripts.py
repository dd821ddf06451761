"""The GPU benchmark and profiling scripts under kernels/ import and parse their arguments on a machine without a GPU,
their reports are rebuilt from made-up or committed results, and the whole-model benchmark runs end to end on the
CPU. The kernels as built for an H100 are tested in `test_kernel_builds.py`."""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from kernel_scripts_support import KERNELS, ROOT, SCRIPT_PYTHONPATH, kernel_script

SCRIPTS = ["bench_flash_mhf.py", "bench_flash_mhf_head_dims.py", "tune_flash_mhf.py", "profile_flash_mhf_kernels.py",
           "bench_token_lookup.py", "bench_models.py", "bench_memory_readout.py", "compile_check.py",
           "tune_flash_mhf_layer.py", "profile_flash_mhf_host.py", "profile_decode_host.py", "compare_host_time.py",
           "custom_op_overhead.py", "profile_compiled_step_host.py", "compare_forward_kernels.py", "ptxas_report.py",
           "profile_flash_mhf_memory.py", "compare_triton_builds.py", "compare_specialisation.py",
           "compare_inference_tuning.py", "launch_host_cpu.py", "bench_dq_reduction.py", "profile_kvffn_layer.py",
           "disk_table_threads.py"]


# Runs scripts one after another in one Python process (one import of torch and transformers for all of them), each
# as `python SCRIPT ARGS` runs it (its `__main__` block), and prints {group: {"script args": [exit code or error, what
# it printed, what it wrote to stderr]}} as JSON. Its argument: [[group, script path, args], ...].
SCRIPT_RUNNER = """
import contextlib, io, json, os, runpy, sys
results = {}
for group, path, args in json.loads(sys.argv[1]):
    printed, written, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [path, *args]
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(written):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else str(stop.code)
    except Exception as exc:  # reported by the test of that run
        code = repr(exc)
    results.setdefault(group, {})[" ".join([os.path.basename(path), *args])] = [code, printed.getvalue(),
                                                                              written.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """The runs of the tests that read only what scripts do with their arguments, made in one process with the GPUs
    hidden (as on a machine without one): {group: (the folder the group's runs were given, {"script args": (exit
    code or error, what it printed, what it wrote to stderr)})}. Each group's runs are those its function gives."""
    groups = {"help": help_runs, "no_out": no_out_runs, "counts": gpu_script_count_runs,
              "out_is_a_file": out_is_a_file_runs}
    folders = {group: tmp_path_factory.mktemp(group) for group in groups}
    runs = [[group, path, args] for group, make_runs in groups.items() for path, args in make_runs(folders[group])]
    env = {**os.environ, "PYTHONPATH": SCRIPT_PYTHONPATH, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", SCRIPT_RUNNER, json.dumps(runs)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    return {group: (folders[group], outcomes.get(group, {})) for group in groups}


def help_runs(folder):
    return [[os.path.join(KERNELS, name), ["--help"]] for name in SCRIPTS]


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help(script_runs, name):
    """Every script imports and parses its arguments without a GPU."""
    code, printed, _ = script_runs["help"][1][f"{name} --help"]
    assert code == 0, code
    assert "usage" in printed


def test_tune_candidates_parse():
    tune_flash_mhf = kernel_script("tune_flash_mhf")
    for head_dim, specs in tune_flash_mhf.HEAD_DIM_CANDIDATES.items():
        candidates = tune_flash_mhf.explicit_candidates(specs)
        roles = [role for role, _, _ in candidates]
        assert roles == sorted(roles, key=["forward", "rows", "weights"].index), head_dim
        assert all(len(config) == 4 for _, _, config in candidates)
    with pytest.raises(SystemExit, match="role must be one of"):
        tune_flash_mhf.explicit_candidates(["backward:128,64,8,2"])


@pytest.mark.parametrize("spec, expected", [
    ("weights:gluonn:128,64,8,2", "with role:variant one of forward:production, "),
    ("weights:128,64,8,2", "with role:variant one of"),
    ("weights:gluon:128,64,8", "(four integers), got 'weights:gluon:128,64,8'"),
])
def test_tune_profile_launch_is_checked_before_looking_for_a_gpu(spec, expected, monkeypatch):
    """`tune_flash_mhf.py --profile` with a variant that does not exist or a configuration that is not four integers
    is refused naming the option and what it takes, before the GPU is looked for (on a GPU it was a KeyError or an
    unpacking error's traceback)."""
    tune_flash_mhf = kernel_script("tune_flash_mhf")
    monkeypatch.setattr(sys, "argv", ["tune_flash_mhf.py", "--profile", spec])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (as on a GPU machine: no GPU work is reached)
    monkeypatch.setattr(tune_flash_mhf, "profile", lambda args: pytest.fail("profiled a launch it should refuse"))
    with pytest.raises(SystemExit) as refused:
        tune_flash_mhf.main()
    assert str(refused.value.code).startswith("--profile: expected") and expected in str(refused.value.code)
    assert tune_flash_mhf.profiled_launch("weights:gluon:128,64,8,2") == ("weights", "gluon", (128, 64, 8, 2))


# the scripts that stopped, naming `--out`, when run without it
NO_OUT_SCRIPTS = ["bench_flash_mhf.py", "bench_flash_mhf_head_dims.py", "bench_token_lookup.py",
                  "profile_flash_mhf_memory.py", "profile_flash_mhf_step.py", "tune_flash_mhf.py"]


def no_out_runs(folder):
    runs = [[os.path.join(KERNELS, name), []] for name in NO_OUT_SCRIPTS]
    return runs + [[os.path.join(KERNELS, "tune_flash_mhf.py"), ["--profile", "weights:gluon:128,64,8,2"]]]


def test_no_script_writes_into_the_committed_results_unasked(script_runs):
    """A benchmark run writes where `--out` says: no script of kernels/ has a default for it (so a rerun cannot
    replace a committed result in `kernels/results/`), and those that used to stop, naming `--out`, before any work.
    `tune_flash_mhf.py --profile` (one launch for a profiler, nothing written) still runs without it."""
    defaults = [path for path in glob.glob(os.path.join(KERNELS, "*.py"))
                if re.search(r"""add_argument\(\s*["']--out["'][^)]*default""", open(path).read())]
    assert defaults == []
    _, outcomes = script_runs["no_out"]
    for name in NO_OUT_SCRIPTS:
        code, _, written = outcomes[name]
        assert code == 2 and "--out" in written.splitlines()[-1], (name, code, written)
    code, _, _ = outcomes["tune_flash_mhf.py --profile weights:gluon:128,64,8,2"]
    assert code == "tune_flash_mhf.py needs a CUDA GPU"  # past the arguments, stopped only for want of a GPU


def test_decode_sweep_reads_another_package_and_reports():
    """`tune_flash_mhf_layer.py --decode`: another copy of the package is imported under its own name (here this
    checkout's, without running its registrations again), every launch it sweeps is a full DECODE_LAUNCH, and the
    report names the production, the other package's and the fastest launch of each shape."""
    tune = kernel_script("tune_flash_mhf_layer")
    from hf_memffn import flash_mhf_layer_triton

    other = tune.other_layer_module(ROOT)
    assert other is not flash_mhf_layer_triton and other.__name__ == "hf_memffn_other.flash_mhf_layer_triton"
    assert other.DECODE_LAUNCH == flash_mhf_layer_triton.DECODE_LAUNCH
    assert all(set(launch) == set(flash_mhf_layer_triton.DECODE_LAUNCH)
               for launch in tune.DECODE_LAUNCHES + tune.DECODE_LAUNCHES_WIDE)
    production = dict(flash_mhf_layer_triton.DECODE_LAUNCH)
    fastest = {**production, "block_n": 32, "weights_first": False}
    rows = [{"shape": "370M", "rows": 1, "package": "this", "weights_sum_us": 6.0, "us": 9.0, **production},
            {"shape": "370M", "rows": 1, "package": "this", "weights_sum_us": 6.0, "us": 8.0, **fastest},
            {"shape": "370M", "rows": 1, "package": "other", "weights_sum_us": 6.0, "us": 11.0, "launch": "x"},
            {"shape": "370M", "rows": 4, "package": "this", "weights_sum_us": 6.0, "error": "OutOfResources",
             **fastest}]
    results = {"environment": {"device": "GPU", "torch": "2", "triton": "3"}, "production": production, "rows": rows}
    text = tune.decode_report(results)
    assert "| 370M | 1 | 6.00 | 9.00 | 11.00 | 8.00 | 32 cols, " in text, text
    assert "weights after gates" in text and "OutOfResources" in text

    ones = torch.ones(4)
    checked = [{}, {}, {}]
    tune.check_and_time(checked[0], lambda: (ones,), (ones,), lambda: 1.5)
    tune.check_and_time(checked[1], lambda: (2 * ones,), (ones,), lambda: 1.5)
    tune.check_and_time(checked[2], lambda: (ones[:-5],), (ones,), lambda: 1.5)
    assert checked[0] == {"rel_err": 0.0, "us": 1.5}
    assert "above" in checked[1]["error"] and "us" not in checked[1]
    assert "error" in checked[2] and "us" not in checked[2]


def test_ncu_summary_rebuilds_from_committed_csv(tmp_path, monkeypatch):
    source = os.path.join(KERNELS, "results", "ncu")
    for role in ("forward", "rows", "weights"):
        shutil.copy(os.path.join(source, f"ncu_raw_{role}_before_gate_prefetch.csv"), tmp_path / f"ncu_{role}.csv")
    shutil.copy(os.path.join(source, "ncu_summary_before_gate_prefetch.json"), tmp_path / "ncu_summary.json")
    monkeypatch.setattr(sys, "argv", ["profile_flash_mhf_kernels.py", "--out", str(tmp_path), "--from-csv"])
    kernel_script("profile_flash_mhf_kernels").main()
    summary = json.loads((tmp_path / "ncu_summary.json").read_text())
    weights = summary["kernels"]["weights"]
    assert 40 < weights["tensor pipe active %"] < 60
    assert weights["stalls per issued instruction"]["long_scoreboard"] > 1
    assert "| tensor pipe active % |" in (tmp_path / "ncu_summary.md").read_text()


def test_model_benchmark_runs_end_to_end_on_cpu(tmp_path, bench_models_main, monkeypatch):
    """The whole-model benchmark's every part at the tiny preset (wall-clock times; only the script is checked), its
    run in this process with two timed steps per training row."""
    tasks = ["layer:tiny", "train:tiny:llama:eager", "train:tiny:flash_mhf:eager", "train:tiny:flash_mhf_unfused:eager",
             "train:tiny:flash_mhf:eager:1", "decode:tiny:llama+flash_mhf:eager", "profile:tiny",
             "profile_train:tiny:flash_mhf:eager:1", "profile_decode:tiny:flash_mhf:2"]
    monkeypatch.setattr(bench_models_main, "TRAIN_STEPS", 2)
    returned = bench_models_main.main(["--out", str(tmp_path), "--device", "cpu", "--seq-len", "16", "--new-tokens",
                                       "3", "--decode-repeats", "2", "--archs", "llama", "flash_mhf",
                                       "--tasks", *tasks])
    assert returned["errors"] == []  # (what the script's `__main__` turns into exit status 0)
    data = json.loads((tmp_path / "models_bench.json").read_text())
    assert data["errors"] == [] and data["tasks"] == tasks
    assert [(row["arch"], row["mode"], row["batch"]) for row in data["train"]] == [  # the preset's batch, or the task's
        ("llama", "eager", 2), ("flash_mhf", "eager", 2), ("flash_mhf_unfused", "eager", 2), ("flash_mhf", "eager", 1)]
    assert all(row["tokens_per_s"] > 0 and row["host_ms"] > 0 for row in data["train"])
    # the models of a decode task take turns, round by round, at each batch size
    assert [(row["batch"], row["arch"]) for row in data["decode"]] == [
        (1, "llama"), (1, "flash_mhf"), (16, "llama"), (16, "flash_mhf")]
    assert all(row["decode_tokens_per_s"] > 0 and len(row["round_median_ms_per_step"]) == 2 for row in data["decode"])
    assert data["decode"][1]["interleaved_with"] == ["llama"]
    assert "unfused layer" in data["train"][2]["ffn_path"] and "torch reference" in data["train"][1]["ffn_path"]
    assert {"flash_mhf_layer_fwd_bwd", "decode_step_b1_flash_mhf", "train_step_tiny_flash_mhf_b1",
            "decode_tiny_flash_mhf_static_b2_generate_3_tokens"} <= set(data["profile"])
    train_profile = data["profile"]["train_step_tiny_flash_mhf_b1"]
    assert train_profile["families_us_per_step"] and train_profile["host_top"]
    markdown = (tmp_path / "models_bench.md").read_text()
    assert "| x Llama |" in markdown and "FlashMHFLlama, unfused layer" in markdown and "| ms/step by round |" in markdown
    assert "| host ms |" in markdown


def test_compiled_layer_task_times_each_layer_under_torch_compile(monkeypatch):
    """`layer:<size>:compiled`: each layer but FlashMHF's kernel variants goes through `torch.compile` once, its rows
    say so and time no decoding step; the task's form is checked like the others'."""
    bench_models = kernel_script("bench_models")
    compiled = []

    def recording_compile(module, **kwargs):
        compiled.append(module)
        return module

    monkeypatch.setattr(bench_models, "SEQ_LEN", 8)
    monkeypatch.setattr(bench_models.torch, "compile", recording_compile)
    monkeypatch.setattr(importlib.import_module("harness"), "_measured_device_type", "cpu")  # (also on a GPU machine)
    bench_models.check_task("layer:tiny:compiled")
    with pytest.raises(ValueError, match=r"expected layer:<size>\[:compiled\]"):
        bench_models.check_task("layer:tiny:eager")
    results = {"layer": []}
    args = argparse.Namespace(device="cpu")
    bench_models.run_task("layer:tiny:compiled", args, results)
    rows = results["layer"]
    assert [row["layer"] for row in rows] == [name for name in bench_models.ffn_layers("tiny", "cpu")[0]
                                              if name not in bench_models.LAYER_KERNELS]
    assert len(compiled) == len(rows) and all(row["mode"] == "compiled" for row in rows)
    assert all(row["decode_b1_graph_us"] is None and row["train_ms"] > 0 for row in rows)
    environment = {"device": "cpu", "torch": "-", "triton": "-", "transformers": "-"}
    markdown = bench_models.report({"layer": rows, "environment": environment})
    assert "| tiny | 16 | FlashMHF, `torch.compile` |" in markdown


BREAKDOWN_SOURCE = "kernels/results/models/h200_compiled_step_breakdown_run.json"


def test_kvffn_layer_profile_runs_on_the_cpu(tmp_path, monkeypatch):
    """`profile_kvffn_layer.py` at the tiny preset: the other layouts compute the block's function from its weights; a
    row per layer and mode (torch.compile stood in by the module itself), each with its kernels, in JSON and markdown."""
    script = kernel_script("profile_kvffn_layer")
    layers = script.layers("tiny", "cpu")
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    names = list(layers)
    plain = layers["KV-FFN, no biases"](x)
    for name in ("KV-FFN, no biases, keys then values", "KV-FFN, no biases, two projections"):
        torch.testing.assert_close(layers[name](x), plain, rtol=2e-2, atol=1e-3, msg=name)
    monkeypatch.setattr(script.torch, "compile", lambda module, **kwargs: module)
    monkeypatch.setattr(script.bench_models, "SEQ_LEN", 8)
    monkeypatch.setattr(sys, "argv", ["profile_kvffn_layer.py", "--out", str(tmp_path), "--device", "cpu", "--sizes",
                                      "tiny", "--seq-len", "8"])
    script.main()
    data = json.loads((tmp_path / "kvffn_layer_profile.json").read_text())
    assert [(row["mode"], row["layer"]) for row in data["rows"]] == [
        (mode, name) for mode in ("eager", "compiled") for name in names]
    assert all(row["train_ms"] > 0 and row["top"] and row["tokens"] == 2 * 8 for row in data["rows"])
    markdown = (tmp_path / "kvffn_layer_profile.md").read_text()
    assert "| tiny | compiled | KV-FFN, no biases, two projections |" in markdown


def test_compiled_step_breakdown_reproduces_its_committed_table(tmp_path, capsys):
    """`compiled_step_breakdown.py` on the committed whole-model result gives the committed breakdown, and its parts
    add up: the FFN layers and everything else make the profiled kernel time."""
    script = kernel_script("compiled_step_breakdown")
    script.main([os.path.join(ROOT, BREAKDOWN_SOURCE), "--out", str(tmp_path)])
    made = json.loads((tmp_path / "compiled_step_breakdown.json").read_text())
    committed_path = os.path.join(ROOT, "kernels/results/models/h200_compiled_step_breakdown.json")
    with open(committed_path) as handle:
        assert made == json.load(handle)
    assert [part["size"] for part in made["breakdown"]] == ["370M", "1.3B"]
    for part in made["breakdown"]:
        for column in part["columns"].values():
            assert column["ffn_layers_ms"] + column["rest_ms"] == pytest.approx(column["kernel_ms"])
            assert column["ffn_layer_mode"] == "compiled"
        base = part["columns"][part["baseline"]]["kernel_ms"]
        assert [p["baseline_over_model"] for p in part["projections"]] == pytest.approx(
            [base / p["kernel_ms"] for p in part["projections"]])
    capsys.readouterr()
    with pytest.raises(SystemExit) as missing:
        script.main([os.path.join(ROOT, BREAKDOWN_SOURCE), "--out", str(tmp_path), "--sizes", "tiny"])
    assert missing.value.code == 2 and "run the task layer:tiny:compiled" in capsys.readouterr().err


# what bench_models.main() sets from its options: the module's settings and the harness's measured device (it also
# raises dynamo's recompile limit to at least 64, which is left so)
MAIN_SETS = {"bench_models": ("SEQ_LEN", "NEW_TOKENS", "BUILD_ON", "DECODE_REPEATS", "DECODE_COMPILE_MODE",
                              "TRAIN_ROUNDS", "TRAIN_ROUND_STEPS", "OTHER_PACKAGE_DIR"),
             "harness": ("_measured_device_type",)}


@pytest.fixture
def bench_models_main(monkeypatch):
    """bench_models imported in this process, whose `main()` the test may call (its task processes are the only
    processes started): what `main()` sets is put back after the test, and the processes it starts import this
    checkout, as `run_script`'s."""
    bench_models = kernel_script("bench_models")
    for module_name, names in MAIN_SETS.items():
        module = importlib.import_module(module_name)
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setenv("PYTHONPATH", SCRIPT_PYTHONPATH)
    return bench_models


def test_model_benchmark_pairs_training_rounds_and_runs_tasks_on_several_devices(tmp_path, bench_models_main, capsys):
    """A training task naming several models times them in alternating rounds (`paired_train_rows`); `--gpus 2` runs
    each task in a process of its own on the next free device (here both are the CPU) and merges one report, each row
    noting its device and task; a decoding task runs with no other task beside it. A mistyped task ends the run before
    any starts, and a task that fails in its process is an error in the report.
    (The run's own process is this one: only the task processes import torch and transformers again.)"""
    with pytest.raises(SystemExit):
        bench_models_main.main(["--out", str(tmp_path), "--device", "cpu", "--gpus", "2", "--tasks", "layer:tiny",
                                "bogus:tiny"])
    assert "--tasks: unknown task 'bogus:tiny': a task is one of layer:<size>" in capsys.readouterr().err
    assert not os.listdir(tmp_path)
    tasks = ["train:tiny:llama+kvffn:eager", "train:tiny:llama:eager", "decode:tiny:llama:eager"]
    bench_models_main.main(["--out", str(tmp_path), "--device", "cpu", "--gpus", "2", "--seq-len", "16",
                            "--train-rounds", "4", "--train-round-steps", "1", "--new-tokens", "2",
                            "--decode-batches", "1", "--decode-repeats", "1", "--tasks", *tasks])
    printed = capsys.readouterr().out
    events = [(kind, line.split(": ", 1)[1] if kind == "start" else line.split(" finished ")[1].split(": ")[0])
              for line in printed.splitlines() if line.startswith("[")
              for kind in (("finish",) if " finished " in line else ("start",))]
    # both training tasks at once, then the decoding task once neither runs
    assert events[:2] == [("start", tasks[0]), ("start", tasks[1])] and sorted(events[2:4]) == [
        ("finish", tasks[0]), ("finish", tasks[1])] and events[4:] == [("start", tasks[2]), ("finish", tasks[2])]
    data = json.loads((tmp_path / "models_bench.json").read_text())
    assert data["errors"] == [] and data["tasks"] == tasks
    assert [row["task"] for row in data["decode"]] == [tasks[2]]
    assert [(row["arch"], row["task"]) for row in data["train"]] == [
        ("llama", tasks[0]), ("kvffn", tasks[0]), ("llama", tasks[1])]
    assert {row["gpu"] for row in data["train"]} == {0, 1} and set(data["gpus"]) == {"0", "1"}
    llama, kvffn, alone = data["train"]
    assert llama["round_paired_ratio"] == 1.0 and kvffn["interleaved_with"] == ["llama"]
    assert len(kvffn["round_median_step_ms"]) == 4 and "round_paired_ratio" not in alone
    low, high = kvffn["round_paired_ratio_quartiles"]
    assert low <= kvffn["round_paired_ratio"] <= high
    assert sorted(os.listdir(tmp_path / "tasks")) == [f"{i:02d}{suffix}" for i in range(3) for suffix in ("", ".log")]
    markdown = (tmp_path / "models_bench.md").read_text()
    assert "| x Llama by round pairs |" in markdown and "| GPU |" in markdown and "on one of 2 GPUs" in markdown
    assert "plot failed" not in printed and (tmp_path / "models_bench.png").stat().st_size > 0
    # a task whose process ended without results, and one whose process caught an error of its own
    child = json.loads((tmp_path / "tasks" / "01" / "models_bench.json").read_text())
    finished = {0: (tasks[0], 0, None, "exit code 1: Traceback | RuntimeError('boom')"),
                1: (tasks[1], 1, {**child, "errors": [f"{tasks[1]}: OSError()"]}, "ok")}
    merged = bench_models_main.merge_task_results(tasks, finished, argparse.Namespace(out=str(tmp_path)))
    assert merged["errors"] == [f"{tasks[0]}: exit code 1: Traceback | RuntimeError('boom')", f"{tasks[1]}: OSError()"]
    assert [(row["task"], row["gpu"]) for row in merged["train"]] == [(tasks[1], 1)]


def test_model_benchmark_lora_variants_train_the_adapters_alone(tmp_path, bench_models_main):
    """`<arch>_lora`: PEFT's LoRA on the architecture's `LORA_TARGET_MODULES`, every other weight frozen;
    `flash_mhf_lora_bank_gradients`: the same, FlashMHF's sub-network banks requiring a gradient too. A paired
    training task runs them side by side."""
    import hf_memffn

    for architecture in hf_memffn.architectures.ARCHITECTURE_NAMES:
        model = bench_models_main.build_model(f"{architecture}_lora", "tiny", "cpu")
        trained = [name for name, param in model.named_parameters() if param.requires_grad]
        assert trained and all(".lora_" in name for name in trained), architecture
    model = bench_models_main.build_model("flash_mhf_lora_bank_gradients", "tiny", "cpu")
    trained = {name.rpartition(".")[2] for name, param in model.named_parameters() if param.requires_grad
               and ".lora_" not in name}
    assert trained == {"key_up_value"}
    task = "train:tiny:llama_lora+flash_mhf_lora+flash_mhf_lora_bank_gradients:eager"
    bench_models_main.main(["--out", str(tmp_path), "--device", "cpu", "--seq-len", "16", "--train-rounds", "2",
                            "--train-round-steps", "1", "--tasks", task])
    rows = json.loads((tmp_path / "models_bench.json").read_text())["train"]
    assert [row["arch"] for row in rows] == ["llama_lora", "flash_mhf_lora", "flash_mhf_lora_bank_gradients"]
    assert "FlashMHFLlama, LoRA r16" in (tmp_path / "models_bench.md").read_text()


def test_model_benchmark_lookup_variants_decode_from_the_models_own_table():
    """`memoryllm_lookup` and `flex_memoryllm_lookup[_torch]`: the model built as the plain architecture, its memory FFN
    exported as a table that it then reads, its weights dropped, the logits unchanged; training tasks refuse them.
    (`_lookup_triton` needs a GPU.)"""
    bench_models = kernel_script("bench_models")
    ids = torch.randint(3, 200, (2, 9))
    for architecture in ("memoryllm", "flex_memoryllm"):
        computed = bench_models.build_model(architecture, "tiny", "cpu").float().eval()
        for variant in (f"{architecture}_lookup", f"{architecture}_lookup_torch"):
            looked_up = bench_models.build_model(variant, "tiny", "cpu").float().eval()
            table = looked_up.model.token_lookup
            assert looked_up.model.memory is None and (table.placement, table.kernel) == ("cpu", "torch")
            with torch.no_grad():
                expected, got = computed(input_ids=ids).logits, looked_up(input_ids=ids).logits
            assert (got - expected).norm() / expected.norm() < 2e-2  # (the table holds bf16 rows)
    with pytest.raises(ValueError, match="a lookup variant is one of memoryllm_lookup"):
        bench_models.build_model("kvffn_lookup", "tiny", "cpu")
    with pytest.raises(ValueError, match="decodes only"):
        bench_models.run_task("train:tiny:llama+memoryllm_lookup:eager", argparse.Namespace(device="cpu"), {})


def test_model_benchmark_refuses_a_profiled_training_step_of_a_lookup_variant(tmp_path, bench_models_main, capsys):
    """A lookup variant cannot train (its memory FFN's weights are dropped and the table refuses gradients), so
    `profile_train:<size>:<lookup variant>` is refused with the other tasks before the first runs, as a `train` task
    is, rather than failing when its turn comes."""
    bench_models = bench_models_main
    for task in ("profile_train:tiny:memoryllm_lookup", "profile_train:tiny:flex_memoryllm_lookup_torch:eager:1"):
        with pytest.raises(ValueError, match="decodes only"):
            bench_models.check_task(task)
    with pytest.raises(SystemExit) as refused:
        bench_models.main(["--out", str(tmp_path), "--device", "cpu", "--tasks", "layer:tiny",
                           "profile_train:tiny:memoryllm_lookup"])
    assert refused.value.code == 2 and "decodes only" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    bench_models.check_task("profile_decode:tiny:memoryllm_lookup")


def test_model_benchmark_builds_kvffn_without_its_biases():
    """`kvffn_no_bias`: KVFFN built with `kvffn_bias=False`, the same parameters less the FFN's biases."""
    bench_models = kernel_script("bench_models")
    with_bias, without = (bench_models.build_model(arch, "tiny", "cpu") for arch in ("kvffn", "kvffn_no_bias"))
    names = [{name for name, _ in model.named_parameters()} for model in (with_bias, without)]
    dropped = names[0] - names[1]
    assert without.config.kvffn_bias is False and names[1] < names[0]
    assert all(".mlp." in name and name.endswith(".bias") for name in dropped)
    layers = {f"model.layers.{i}" for i in range(len(without.model.layers))}
    assert {name.split(".mlp.")[0] for name in dropped} == layers  # (every layer's FFN loses its biases)


def test_model_benchmark_task_processes_get_the_options_given(bench_models_main, monkeypatch):
    """`--gpus`: each task's process gets every option that differs from its default, except those of the whole run."""
    bench_models = bench_models_main
    captured = {}

    def capture(tasks, args, parser):
        captured.update(tasks=tasks, options=bench_models.forwarded_options(parser, args))
        return {}

    given = ["--device", "cpu", "--seq-len", "16", "--decode-batches", "1", "4", "--decode-processes",
             "--train-rounds", "3"]
    monkeypatch.setattr(bench_models, "run_on_gpus", capture)
    bench_models.main(["--out", "unused", "--gpus", "2", "--deadline-s", "9", "--tasks", "layer:tiny", *given])
    assert captured["tasks"] == ["layer:tiny"]
    assert sorted(captured["options"]) == sorted(given)
    # the options that chose the default tasks are not given to the tasks' processes (each gets --tasks)
    bench_models.main(["--out", "unused", "--gpus", "2", "--sizes", "tiny", "--compile", *given])
    assert {"train:tiny:kvffn:eager", "train:370M:llama:compiled"} <= set(captured["tasks"])
    assert "--sizes" not in captured["options"] and "--compile" not in captured["options"]
    with pytest.raises(SystemExit):
        bench_models.main(["--out", "unused", "--train-rounds", "0", "--device", "cpu"])


def _brace_expansions(name: str) -> list[str]:
    """`a_{b,c}.md` -> [`a_b.md`, `a_c.md`], as bash expands the names the docs write."""
    match = re.search(r"\{([^{}]*)\}", name)
    if not match:
        return [name]
    return [expanded for alternative in match.group(1).split(",")
            for expanded in _brace_expansions(name[:match.start()] + alternative + name[match.end():])]


def test_every_result_file_the_docs_name_exists():
    """Each GPU result file that README.md, docs/speed.md, the results index and the kernel notes cite (`h100_*`,
    `h100x4_*`, `h200_*`, `h200x4_*`, with `.*` for a file set) is committed under kernels/results or
    examples/results."""
    committed = {name for folder in ("kernels/results", "examples/results")
                 for _, _, names in os.walk(os.path.join(ROOT, folder)) for name in names}
    missing = []
    for doc in ("README.md", "docs/speed.md", "kernels/results/models/README.md", "kernels/flash_mhf_notes.md"):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as handle:
            text = handle.read()
        for cited in set(re.findall(r"`(?:[\w.]+/)*((?:h100|h200)[A-Za-z0-9_.{},*\-]*)`", text)):
            for name in _brace_expansions(cited):
                pattern = re.escape(name[:-1]) + ".+" if name.endswith(".*") else re.escape(name).replace(r"\*", ".*")
                if not any(re.fullmatch(pattern, file) for file in committed):
                    missing.append(f"{doc}: {cited}")
    assert not missing, missing


def test_every_example_result_path_the_docs_name_exists():
    """Each `examples/results/...` path the README, docs and kernel notes cite (a study folder, a file in it, with
    bash's braces and `.*` for a file set) is committed."""
    documents = ["README.md", "kernels/results/models/README.md", "kernels/flash_mhf_notes.md"]
    documents += [os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(ROOT, "docs")))
                  if name.endswith(".md")]
    cited_paths, missing = 0, []
    for doc in documents:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as handle:
            text = handle.read()
        for cited in set(re.findall(r"`(examples/results/[^`\s]*)`", text)):
            for path in _brace_expansions(cited.rstrip("/")):
                cited_paths += 1
                if not glob.glob(os.path.join(ROOT, path)):  # `name.*` matches as a glob
                    missing.append(f"{doc}: {cited}")
    assert cited_paths > 20 and not missing, missing


def _models_result(stem: str) -> dict:
    with open(os.path.join(ROOT, "kernels", "results", "models", f"{stem}.json"), encoding="utf-8") as handle:
        return json.load(handle)


def _training_rows(stem: str, size: str, mode: str) -> dict:
    """The training rows of one size and mode of a committed whole-model result, by architecture."""
    return {row["arch"]: row for row in _models_result(stem)["train"] if row["size"] == size and row["mode"] == mode}


def _readme_row(readme: str, opening: str) -> list[str]:
    line = next(line for line in readme.splitlines() if line.startswith(f"| {opening}"))
    return [cell.strip() for cell in line.strip("|").split("|")[1:]]


def test_readme_training_rows_are_the_committed_results_they_name():
    """The README's full table: eager training, compiled training as a user of transformers 5.17 sees it, and peak
    training memory are the paired ratios (medians over rounds) and memory ratios of the H100 result files it names,
    to two decimals (MemoryLLM's eager memory, 0.8750009 of Llama's, had been quoted as 0.87)."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    columns = ["flash_mhf", "memoryllm", "flex_memoryllm", "kvffn"]

    def ratio(rows, arch):
        return f"{rows[arch]['round_paired_ratio']:.2f}"

    eager = [_training_rows("h100_paired_other_models", "370M", "eager"),
             _training_rows("h100_decode_token_lookup_and_1.3B_eager", "1.3B", "eager")]
    assert all(rows["llama"]["peak_gib"] and "H100" in _models_result(stem)["environment"]["device"]
               for rows, stem in zip(eager, ["h100_paired_other_models", "h100_decode_token_lookup_and_1.3B_eager"]))
    assert _readme_row(readme, "eager training tokens/s, 370M / 1.3B") == [
        f"{ratio(eager[0], arch)} / {ratio(eager[1], arch)}" for arch in columns]

    compiled = [_training_rows("h100_paired_other_models", size, "compiled") for size in ("370M", "1.3B")]
    flash_mhf = [_training_rows("h100_weight_tiles_split", size, "compiled") for size in ("370M", "1.3B")]
    plain_llama = _readme_row(readme, "the same as a user of transformers 5.17")
    assert plain_llama[0].startswith(f"{ratio(flash_mhf[0], 'flash_mhf')} / {ratio(flash_mhf[1], 'flash_mhf')} (")
    assert plain_llama[1:] == [f"{ratio(compiled[0], arch)} / {ratio(compiled[1], arch)}" for arch in columns[1:]]

    def memory(rows, arch):
        return f"{rows[arch]['peak_gib'] / rows['llama']['peak_gib']:.2f}"

    memory_cells = _readme_row(readme, "peak training memory, 370M eager / 370M compiled / 1.3B compiled (Llama: "
                               + " / ".join(f"{rows['llama']['peak_gib']:.1f}" for rows in (eager[0], *compiled))
                               + " GiB)")
    flash_mhf_memory = [memory(eager[0], "flash_mhf"), *(memory(rows, "flash_mhf") for rows in flash_mhf)]
    assert memory_cells[0] == "**" + " / ".join(flash_mhf_memory) + "**"
    assert memory_cells[1:] == [" / ".join(memory(rows, arch) for rows in (eager[0], *compiled))
                                for arch in columns[1:]]


def test_readme_static_decode_kernel_time_is_the_committed_profiles():
    """The README's row of the GPU's kernel time per static-cache step (Llama's over the model's) and the range the
    Decoding summary draws from it (it said 5-11% below Llama, where FlexMemoryLLM's profile at batch 1 is 4.4%
    below) are the profiles of the result files the row names."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

    def kernel_ratios(stem, arch, size="370M"):
        profiles = _models_result(stem)["profile"]
        return [profiles[f"decode_{size}_llama_static_b{batch}_in_task"]["kernel_us_per_step"]
                / profiles[f"decode_{size}_{arch}_static_b{batch}_in_task"]["kernel_us_per_step"] for batch in (1, 16)]

    def cell(ratios):
        return " / ".join(f"{ratio:.2f}" for ratio in ratios)

    stem = "h100_decode_all_models_and_token_lookup"
    flash_mhf = kernel_ratios("h100_decode_split_sum_370M_static", "flash_mhf")
    flash_mhf_1_3b = kernel_ratios("h100_decode_split_sum_1.3B_static", "flash_mhf", "1.3B")
    assert _readme_row(readme, "the GPU's kernel time of a static-cache step") == [
        f"**{cell(flash_mhf)}** (1.3B: {cell(flash_mhf_1_3b)})",
        f"{cell(kernel_ratios(stem, 'memoryllm'))}; {cell(kernel_ratios(stem, 'memoryllm_lookup'))}",
        f"{cell(kernel_ratios(stem, 'flex_memoryllm'))}; {cell(kernel_ratios(stem, 'flex_memoryllm_lookup'))}",
        cell(kernel_ratios(stem, "kvffn"))]

    def below(ratios):  # the percentages less kernel time than Llama's, lowest-highest
        cuts = sorted(round(100 * (1 - 1 / ratio)) for ratio in ratios)
        return f"{cuts[0]}-{cuts[-1]}%"

    others = [ratio for arch in ("flex_memoryllm", "kvffn") for ratio in kernel_ratios(stem, arch)]
    summary = " ".join(readme.split("- **Decoding** at these sizes")[1].split("\n- ")[0].split())
    memoryllm, memoryllm_lookup = (below(kernel_ratios(stem, arch)) for arch in ("memoryllm", "memoryllm_lookup"))
    assert (f"step is {below(others + flash_mhf + flash_mhf_1_3b)} below Llama's for every architecture "
            f"({memoryllm} for MemoryLLM, {memoryllm_lookup} when it decodes from its token lookup table)") in summary


def test_readme_token_lookup_targets_are_the_committed_benchmarks():
    """The README's token lookup benchmark: the CUDA-graph decoding ratios to the dense model and the cut in peak
    device memory are those of `kernels/results/token_lookup.json` (a 48.6% cut had been quoted as 48%)."""
    with open(os.path.join(ROOT, "kernels", "results", "token_lookup.json"), encoding="utf-8") as handle:
        decode = json.load(handle)["decode"]
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

    def speed(placement, batch):
        graph = f"graph/b{batch}"
        return f"{decode[f'{placement}/{graph}']['tokens_per_s'] / decode[f'dense/{graph}']['tokens_per_s']:.2f}x"

    def memory_cut(batch):
        graph = f"graph/b{batch}"
        return f"{100 * (1 - decode[f'cpu/{graph}']['peak_mem_gib'] / decode[f'dense/{graph}']['peak_mem_gib']):.0f}%"

    targets = " ".join(readme.split("- Targets (CUDA graph decoding, batch 1):")[1].split("\n- ")[0].split())
    assert targets.startswith(f"lookup `gpu` = **{speed('gpu', 1)}** the dense model's tokens/s")
    assert f"`cpu` + cache = **{speed('cpu', 1)}** (target >= 1.2x) with **{memory_cut(1)} less**" in targets
    assert f"({memory_cut(16)} less at batch 16;" in targets
    assert f"At batch 16: {speed('gpu', 16)} (`gpu`) and {speed('cpu', 16)} (`cpu`)." in targets


def test_compiled_step_host_report_and_idle_layer_ops():
    """`profile_compiled_step_host.py`: the table from a result (fixture numbers), and the stand-in operators that
    allocate the layer's outputs, launch nothing and are put back afterwards."""
    probe = kernel_script("profile_compiled_step_host")
    from hf_memffn import flash_mhf_op

    def line(step, host):
        return {"step_ms": step, "host_ms": host, "gc_ms_per_step": 0.0}

    results = {"environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6",
                               "transformers": "5.17"},
               "args": {"size": "370M", "batch": 1, "rounds": 3, "steps": 8},
               "models": [{"name": "FlashMHFLlama", "layers": 21,
                           "summary": {"real": line(47.7, 49.9), "layer ops doing nothing": line(26.9, 28.5)},
                           "launchers_alone": {"forward_host_us": 204.0, "forward_gpu_us": 258.0,
                                               "backward_host_us": 500.0, "backward_gpu_us": 505.0}}]}
    text = probe.report(results)
    assert "| FlashMHFLlama | layer ops doing nothing | 26.9 | 28.5 | 1.36 | 0.00 |" in text
    assert "14.8 ms of host time per step over 21 layers" in text
    names = ("_layer_forward_impl", "_layer_forward_keeping_queries", "_layer_backward_impl")
    saved = [getattr(flash_mhf_op, name) for name in names]
    p, weights, router = torch.randn(1, 4, 8), torch.randn(6, 3, 4, 4), torch.randn(2, 4, 3)
    with probe.layer_ops_doing_nothing():
        assert flash_mhf_op._layer_forward_impl(p, None, None, weights, 4, 1e-6, 1e-6).shape == p.shape
        # training's forward: the output, q, r [B, H, L, E] and the gates' totals [B, H, L], as the operator's fake
        # promises them to the compiled graph
        idle = flash_mhf_op._layer_forward_keeping_queries(p, None, router, weights, 4, 1e-6, 1e-6)
        assert [(tuple(t.shape), t.dtype) for t in idle] == [
            ((1, 4, 8), p.dtype), ((1, 4, 8), p.dtype), ((1, 2, 4, 3), torch.float32), ((1, 2, 4), torch.float32)]
        grads = flash_mhf_op._layer_backward_impl(p, p, None, router, weights, 4, 1e-6, 1e-6, saved=idle[1:])
        assert [None if g is None else g.shape for g in grads] == [p.shape, None, (2, 4, 3), weights.shape]
    assert [getattr(flash_mhf_op, name) for name in names] == saved


def test_model_benchmark_training_modes_and_bad_tasks():
    """A training task runs eager, compiled, or compiled and replayed from CUDA graphs (`cudagraphs`: inductor's
    reduce-overhead mode, which the GPU runs time); a task outside the grammar, or naming a preset or model that does
    not exist, says what it expects (`check_task`, which `main` runs on every task first)."""
    bench_models = kernel_script("bench_models")
    model = torch.nn.Linear(2, 2)
    assert bench_models.compiled_for_training(model, "eager") is model
    for mode in ("compiled", "cudagraphs"):  # torch.compile is lazy: nothing compiles here
        assert bench_models.compiled_for_training(model, mode)._orig_mod is model
    args = bench_models.argparse.Namespace(device="cpu")
    for task, expected in (("train:tiny:llama:graphs", "eager|compiled|cudagraphs[:<batch>]"),
                           ("train:tiny:llama:eager:x", "eager|compiled|cudagraphs[:<batch>]"),
                           ("profile_train:tiny:llama:eager:1:2",
                            "profile_train:<size>:<arch>[:eager|compiled|cudagraphs"),
                           ("decode:tiny:llama:compiled", "decode:<size>:<arch>[+<arch>...]:eager|static"),
                           ("train:tiny:llama+lama:eager", "architecture 'lama' is not one of llama, flash_mhf"),
                           ("train:tiny:kvffn@other:eager", "an @other model decodes only"),
                           ("decode:tiny:llama+kvffn+llama:eager", "llama named more than once"),
                           ("layer:huge", "task 'layer:huge': preset='huge' is not one of")):
        with pytest.raises(ValueError, match=re.escape(expected)):
            bench_models.run_task(task, args, {"train": [], "profile": {}})


def test_kernel_families_and_the_op_kernels_a_row_runs():
    """A profile's kernels by family (the decoder's `_rms_norm_forward_kernel` is not the op's forward), and the
    `flash_mhf_triton_forward` row, which keeps the op's forward off the Gluon kernel for its measurement only."""
    from hf_memffn import flash_mhf_layer_triton, flash_mhf_triton

    bench_models = kernel_script("bench_models")
    assert bench_models.kernel_family("_rms_norm_forward_kernel") == "decoder norm/rotary (Triton)"
    for name in ("_forward_kernel", "_warp_specialised_forward_kernel", "_rows_gradients_kernel"):
        assert bench_models.kernel_family(name) == "FlashMHF op"
    with bench_models.op_kernels("flash_mhf_triton_forward"):
        assert flash_mhf_triton._gluon_roles == {"rows", "weights"}
    with bench_models.op_kernels("flash_mhf"):
        assert flash_mhf_triton._gluon_roles == set(flash_mhf_triton.GLUON_ROLES)
    assert flash_mhf_triton._gluon_roles == set(flash_mhf_triton.GLUON_ROLES)
    # the row of the norm/gate backward as it was launched before its tf32 sweep
    launch = flash_mhf_layer_triton.GATES_BACKWARD_LAUNCH
    from hf_memffn import flash_mhf_op

    with bench_models.op_kernels("flash_mhf_previous_gate_launch"):
        assert flash_mhf_layer_triton.GATES_BACKWARD_LAUNCH == flash_mhf_layer_triton.PREVIOUS_GATES_BACKWARD_LAUNCH
        assert not flash_mhf_op.GATES_IN_ROWS_KERNEL
    assert flash_mhf_layer_triton.GATES_BACKWARD_LAUNCH == launch and flash_mhf_op.GATES_IN_ROWS_KERNEL
    from hf_memffn import modeling_memffn

    with bench_models.op_kernels("flash_mhf_inline_rotary_tables"):
        assert not modeling_memffn.ROTARY_TABLES_OPERATOR
    assert modeling_memffn.ROTARY_TABLES_OPERATOR
    with bench_models.op_kernels("flash_mhf_separate_gates_backward"):
        assert not flash_mhf_op.GATES_IN_ROWS_KERNEL
    assert flash_mhf_op.GATES_IN_ROWS_KERNEL
    from hf_memffn import flash_mhf_gluon

    with bench_models.op_kernels("flash_mhf_whole_weight_tiles"):
        assert not flash_mhf_gluon.SPLIT_WEIGHT_TILES
    assert flash_mhf_gluon.SPLIT_WEIGHT_TILES
    with pytest.raises(ValueError, match="expected some of forward, rows, weights"):
        with flash_mhf_triton.gluon_kernels("backward"):
            pass


def test_model_benchmark_decodes_each_model_in_its_own_process_and_another_package_beside_them(tmp_path,
                                                                                               bench_models_main,
                                                                                               monkeypatch):
    """`--decode-processes`: the models of a decode task run in processes of their own and still take turns;
    `--decode-cpus` pins each process to a CPU after its warm-up; `--decode-profile` profiles each where it ran.
    `--other-package DIR`: the task's `<arch>@other` model is built from DIR's hf_memffn, in a process of its own, and
    takes turns with this checkout's models; `<arch>_plain_launch` decodes too. (One run of the script for both; the
    run's own process is this one, which has imported this checkout's hf_memffn.)"""
    other = tmp_path / "other"
    shutil.copytree(os.path.join(ROOT, "hf_memffn"), other / "hf_memffn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "imported_from"
    with open(other / "hf_memffn" / "__init__.py", "a", encoding="utf-8") as handle:
        handle.write(f"\nopen({str(marker)!r}, 'a').write(__file__ + '\\n')\n")
    cpu = min(os.sched_getaffinity(0))
    architectures = ["llama", "kvffn@other", "kvffn_plain_launch"]
    out = tmp_path / "out"
    bench_models_main.main(["--out", str(out), "--device", "cpu", "--new-tokens", "2", "--decode-repeats", "4",
                            "--decode-batches", "1", "--decode-processes", "--decode-profile",
                            "--decode-cpus", str(cpu), "--other-package", str(other),
                            "--tasks", f"decode:tiny:{'+'.join(architectures)}:eager"])
    data = json.loads((out / "models_bench.json").read_text())
    assert data["errors"] == [] and [row["arch"] for row in data["decode"]] == architectures
    assert all(row["own_process"] and len(row["round_median_ms_per_step"]) == 4 for row in data["decode"])
    assert all(row["cpu"] == cpu for row in data["decode"])
    llama, kvffn = data["decode"][:2]  # (kvffn from the other package)
    assert llama["round_paired_ratio"] == 1.0 and llama["p10_ms_per_step"] <= llama["ms_per_step"]
    assert {row["round_paired_baseline"] for row in data["decode"]} == {"llama"}
    low, high = kvffn["round_paired_ratio_quartiles"]
    assert low <= kvffn["round_paired_ratio"] <= high
    markdown = (out / "models_bench.md").read_text()
    assert f"KVFFN, the other package, own process, CPU {cpu}" in markdown
    assert "KVFFN, Triton's launch on every call, own process" in markdown
    # --decode-profile: each model's tables, taken in its own process after the timed rounds
    profiles = {name: data["profile"][name] for name in data["profile"]}
    assert set(profiles) == {f"decode_tiny_{arch}_eager_b1_in_task" for arch in architectures}
    assert all(table["kernel_us_per_step"] > 0 for table in profiles.values())
    assert marker.read_text().splitlines() == [str(other / "hf_memffn" / "__init__.py")]  # that one process alone
    # without those two options, an `@other` model is refused
    monkeypatch.setattr(bench_models_main, "OTHER_PACKAGE_DIR", None)  # (as the run above left it: unset)
    with pytest.raises(ValueError, match="needs --decode-processes and --other-package"):
        bench_models_main.run_task("decode:tiny:llama+kvffn@other:eager",
                                   argparse.Namespace(device="cpu", decode_processes=False), {})


def test_decode_rounds_pair_with_the_first_model_when_the_task_has_no_llama(monkeypatch):
    """A decode task without Llama (e.g. `flash_mhf_triton_forward+flash_mhf`) pairs every model's rounds with its
    first model's, and the report names that model beside the ratio."""
    bench_models = kernel_script("bench_models")

    class FixedSteps:  # a decoder whose steps take the given seconds, round after round
        def __init__(self, step_s):
            self.step_s = step_s

        def start_warm_up(self, batch):
            return lambda: {"warmup_s": 0.0}

        def steps(self, batch):
            return [self.step_s] * 3

    monkeypatch.setattr(bench_models, "DECODE_REPEATS", 4)  # (quartiles need four rounds)
    decoders = {"flash_mhf_triton_forward": FixedSteps(0.0030), "flash_mhf": FixedSteps(0.0025)}
    rows, _ = bench_models.decode_rows(decoders, "tiny", 1, static=True)
    first, second = rows
    assert first["round_paired_baseline"] == second["round_paired_baseline"] == "flash_mhf_triton_forward"
    assert first["round_paired_ratio"] == 1.0 and second["round_paired_ratio"] == pytest.approx(1.2)
    assert bench_models.paired_ratio_cell(second) == (
        "1.20 (1.20-1.20) x FlashMHFLlama, the op's forward on the Triton kernel")
    assert bench_models.paired_ratio_cell({"arch": "kvffn", "round_paired_ratio_to_llama": 0.97}) == "0.97"


def test_decode_compile_mode_sets_the_static_cache_compile_config(monkeypatch):
    """`--decode-compile-mode default`: static-cache generate() compiles without CUDA graphs; the default leaves
    generate()'s own configuration (CUDA graphs) alone."""
    bench_models = kernel_script("bench_models")
    model = bench_models.build_model("llama", "tiny", "cpu")
    default_config = model.generation_config.compile_config
    bench_models.decode_generator(model, 1, True, "cpu")
    assert model.generation_config.compile_config is default_config
    monkeypatch.setattr(bench_models, "DECODE_COMPILE_MODE", "default")
    bench_models.decode_generator(model, 1, True, "cpu")
    assert model.generation_config.compile_config.mode == "default"


def test_decode_cpus_are_a_cpu_list_and_need_decoding_processes(tmp_path, bench_models_main, capsys, monkeypatch):
    """`--decode-cpus` reads Linux CPU lists and refuses to run without `--decode-processes` (nothing to pin)."""
    bench_models = bench_models_main
    monkeypatch.setattr(bench_models.os, "sched_getaffinity", lambda pid: set(range(8)))  # (CPUs 0-7 available)
    assert bench_models.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert bench_models.decode_cpus(None) is None and bench_models.decode_cpus("2,5") == [2, 5]
    with pytest.raises(ValueError, match="--decode-cpus='fast'"):
        bench_models.decode_cpus("fast")
    with pytest.raises(SystemExit) as refused:
        bench_models.main(["--out", str(tmp_path), "--device", "cpu", "--decode-cpus", "0",
                           "--tasks", "decode:tiny:llama:eager"])
    assert refused.value.code == 2 and "needs --decode-processes" in capsys.readouterr().err
    assert not (tmp_path / "models_bench.json").exists()


def test_decode_cpus_refuses_lists_it_cannot_pin_before_any_model_is_built(tmp_path, bench_models_main, capsys,
                                                                         monkeypatch):
    """A `--decode-cpus` list that is no CPU list, holds a range from high to low (which names no CPU, alone or among
    others) or names a CPU this process may not run on is a one-line usage error before any work, not a traceback, a
    run left unpinned or pinned to fewer CPUs than named, or a task that fails once its models have been built and
    compiled."""
    bench_models = bench_models_main
    monkeypatch.setattr(bench_models.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for spec, expected in (("fast", "--decode-cpus='fast' is not 'gpu' or a CPU list"),
                           ("5-2", "--decode-cpus='5-2' is not 'gpu' or a CPU list"),
                           ("0,5-2", "--decode-cpus='0,5-2' is not 'gpu' or a CPU list"),  # (not CPU 0 alone)
                           ("2,9", "--decode-cpus='2,9': CPU 9 not among the CPUs available to this process (0, 1, 2, "
                                   "3)")):
        with pytest.raises(SystemExit) as refused:
            bench_models.main(["--out", str(tmp_path), "--device", "cpu", "--decode-processes", "--decode-cpus", spec,
                               "--tasks", "decode:tiny:llama:eager"])
        assert refused.value.code == 2 and expected in capsys.readouterr().err, spec
    assert not list(tmp_path.iterdir())
    assert bench_models.decode_cpus("1-3") == [1, 2, 3]


def test_llama_with_the_causal_flag_matches_llama_and_refuses_padding():
    """bench_models' `llama_causal_flag` row: transformers' Llama with sdpa's causal flag in place of the mask gives
    Llama's logits, also compiled, and refuses inputs the flag cannot stand for."""
    bench_models = kernel_script("bench_models")
    flag, llama = (bench_models.build_model(arch, "tiny", "cpu").float() for arch in ("llama_causal_flag", "llama"))
    ids = torch.randint(3, 1000, (2, 16))
    with torch.no_grad():
        expected = llama(input_ids=ids).logits
        torch.testing.assert_close(flag(input_ids=ids).logits, expected)
        torch.testing.assert_close(torch.compile(flag)(input_ids=ids).logits, expected)
        with pytest.raises(ValueError, match="padding mask"):
            flag(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_llama_with_extra_inputs_has_more_parameters_and_the_same_logits():
    """bench_models' `llama_extra_inputs` row: transformers' Llama with zero parameters added to each decoder layer's
    output, as many per layer as KVFFN's biases: the logits are Llama's, eager and compiled, with more parameters."""
    bench_models = kernel_script("bench_models")
    extra, llama = (bench_models.build_model(arch, "tiny", "cpu").float() for arch in ("llama_extra_inputs", "llama"))
    layers = llama.config.num_hidden_layers
    assert len(list(extra.parameters())) - len(list(llama.parameters())) == bench_models.EXTRA_INPUTS_PER_LAYER * layers
    ids = torch.randint(3, 1000, (2, 16))
    with torch.no_grad():
        expected = llama(input_ids=ids).logits
        torch.testing.assert_close(extra(input_ids=ids).logits, expected)
        torch.testing.assert_close(torch.compile(extra)(input_ids=ids).logits, expected)


def test_decode_host_profile_runs_each_model_in_its_own_process(tmp_path, monkeypatch, capsys):
    """`profile_decode_host.py`: the host time of a static-cache step, each model (and the variant whose forward
    rebuilds its signature) measured in a process of its own. (The run's own process is this one.)"""
    monkeypatch.setenv("PYTHONPATH", SCRIPT_PYTHONPATH)  # (the measuring processes import this checkout)
    kernel_script("profile_decode_host").main(["--out", str(tmp_path), "--size", "tiny", "--rounds", "1", "--calls",
                                               "1", "--new-tokens", "3", "--archs", "kvffn", "--rebuilt-signature"])
    data = json.loads((tmp_path / "decode_host.json").read_text())
    assert list(data["rounds"]) == ["kvffn", "kvffn:rebuilt_signature"]
    assert all(len(rounds) == 1 and rounds[0] > 0 for rounds in data["rounds"].values())
    # one compiled graph, whose inputs are every parameter, the cache's tensors and the step's own inputs
    assert [len(data["graph_inputs"][variant]) for variant in data["rounds"]] == [1, 1]
    assert data["graph_inputs"]["kvffn"] == data["graph_inputs"]["kvffn:rebuilt_signature"]
    assert data["graph_inputs"]["kvffn"][0] > data["parameters"]["kvffn"]
    # dynamo's guard check of the compiled forward, timed alone on a recorded step's inputs (which must pass it)
    assert all(len(times) == 1 and 0 < times[0] < 1e5 for times in data["guard_check_us"].values())
    markdown = (tmp_path / "decode_host.md").read_text()
    assert "host us per step" in markdown and "guard check" in markdown
    for option, value, message in (("--size", "huge", "--size: preset='huge' is not one of"),
                                   ("--new-tokens", "1", "--new-tokens must be at least 2, got 1"),
                                   ("--rounds", "0", "--rounds must be at least 1, got 0")):
        with pytest.raises(SystemExit) as refused:
            kernel_script("profile_decode_host").main(["--out", str(tmp_path / "refused"), option, value])
        assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_token_lookup_format_sweep_on_the_cpu(tmp_path, monkeypatch):
    """`bench_token_lookup.py --formats` runs without a GPU: every format's size, table error and loss change, in a
    JSON that names the device and versions and a markdown table (both written whole through the harness)."""
    bench_token_lookup = kernel_script("bench_token_lookup")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (as where no GPU is visible)
    monkeypatch.setattr(sys, "argv", ["bench_token_lookup.py", "--formats", "--layers", "4", "--hidden", "64",
                                      "--heads", "2", "--kv-heads", "1", "--intermediate", "128", "--vocab", "500",
                                      "--out", str(tmp_path)])
    bench_token_lookup.main()
    data = json.loads((tmp_path / "token_lookup_formats.json").read_text())
    assert data["device"] == "CPU" and data["torch"] == torch.__version__
    formats = {row["format"]: row for row in data["formats"]}
    assert formats["fp32"]["max_relative_error"] == 0.0 and formats["fp32"]["loss_delta"] == 0.0
    assert formats["int4"]["size_bytes"] < formats["int8"]["size_bytes"] < formats["bf16"]["size_bytes"]
    assert formats["bf16 drop_layers=[1]"]["max_relative_error"] == 1.0  # a dropped layer counts as error 1
    assert "| int8 |" in (tmp_path / "token_lookup_formats.md").read_text()
    assert not list(tmp_path.glob("*.tmp*"))


def test_host_time_comparison_tables(tmp_path):
    """`compare_host_time.py` pairs the two trees' rounds of part timings and training steps into one table."""
    work = tmp_path / "work"
    for round_ in (1, 2):
        for tree, scale in (("before", 1.0), ("after", 0.8)):
            parts = {"environment": {"device": "GPU X"}, "issue": "back-to-back",
                     "parts": [{"part": "triton_forward", "host_us": 100.0 * scale * round_, "gpu_us": 600.0}]}
            train = {"environment": {"device": "GPU X"},
                     "train": [{"size": "370M", "arch": "flash_mhf", "batch": 1, "step_ms": 80.0 * scale,
                                "host_ms": 79.0 * scale}]}
            for kind, name, data in (("parts", "flash_mhf_host_profile.json", parts),
                                     ("train", "models_bench.json", train)):
                folder = work / f"{kind}_{tree}_{round_}"
                folder.mkdir(parents=True)
                (folder / name).write_text(json.dumps(data))
    assert kernel_script("compare_host_time").main([str(work), "2", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "host_time.json").read_text())
    assert data["device"] == "GPU X"
    assert data["parts_host_us"]["triton_forward"] == {"before": [100.0, 200.0], "after": [80.0, 160.0]}
    markdown = (tmp_path / "out" / "host_time.md").read_text()
    assert "| triton_forward | 100.0 / 200.0 | 80.0 / 160.0 | 0.80 |" in markdown
    assert "(200 calls back to back, no synchronisation between them)" in markdown
    assert "| 370M flash_mhf batch 1 | 80.0 / 80.0 | 64.0 / 64.0 | 0.80 |" in markdown


def test_host_time_comparison_keeps_each_round_in_its_place_when_a_run_left_nothing(tmp_path):
    """A round whose run of one tree left no result (it failed or ran out of time) is shown as "-" in its place: the
    tree's other rounds do not move up beside the other tree's first, and the medians are of the rounds there are."""
    work = tmp_path / "work"
    for round_, tree, host_us in ((1, "after", 80.0), (2, "before", 200.0), (2, "after", 160.0)):
        folder = work / f"parts_{tree}_{round_}"
        folder.mkdir(parents=True)
        (folder / "flash_mhf_host_profile.json").write_text(json.dumps(
            {"environment": {"device": "GPU X"}, "parts": [{"part": "triton_forward", "host_us": host_us}]}))
    assert kernel_script("compare_host_time").main([str(work), "2", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "host_time.json").read_text())
    assert data["parts_host_us"]["triton_forward"] == {"before": [None, 200.0], "after": [80.0, 160.0]}
    assert "| triton_forward | - / 200.0 | 80.0 / 160.0 | 0.60 |" in (tmp_path / "out" / "host_time.md").read_text()


def test_host_time_comparison_script_goes_on_past_a_run_that_failed(tmp_path):
    """`compare_host_time.sh`: a run that fails (here each, without a GPU) is reported with its log and the rounds go
    on to the tables of what ran; it stopped the whole call at the first failure, silently, its other rounds lost."""
    (tmp_path / "before").mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRAIN_TASKS": "", "TMPDIR": str(tmp_path),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    result = subprocess.run(["bash", os.path.join(KERNELS, "compare_host_time.sh"), str(tmp_path / "before"),
                             str(tmp_path / "out"), "1"], capture_output=True, text=True, env=env, timeout=300)
    printed = result.stdout.splitlines()
    assert [line.split(" (exit status")[0] for line in printed] == [
        "round 1, after: the parts' run failed", "round 1, after: done",
        "round 1, before: the parts' run failed", "round 1, before: done"], result.stdout
    assert all(os.path.isfile(line.split(", see ")[1]) for line in printed if "failed" in line)
    assert result.returncode == 2 and "holds no run of rounds 1 to 1" in result.stderr  # (compare_host_time.py's)


def test_inference_tuning_comparison_needs_a_gpu(tmp_path, monkeypatch):
    """`compare_inference_tuning.py` times the autotuned Triton forward, which runs on CUDA only: without a GPU it
    says so (exit status 1, the message on stderr) and writes nothing."""
    compare_inference_tuning = kernel_script("compare_inference_tuning")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (as where no GPU is visible)
    with pytest.raises(SystemExit, match="needs a CUDA GPU") as refused:
        compare_inference_tuning.main(["--out", str(tmp_path)])
    assert isinstance(refused.value.code, str)  # (which Python prints to stderr, exiting with status 1)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not (shutil.which("strip") and shutil.which("xz")), reason="needs binutils' strip and xz")
def test_carried_triton_packs_a_wheel_in_two_parts_and_unpacks_what_launching_needs(tmp_path):
    """`kernels/carried_triton.sh` on a made-up wheel: the CUDA tools (both ptxas binaries: Triton 3.9 compiles sm_90
    with `ptxas-blackwell`) stay with their execute bits back, and the AMD backend's Python stays (Triton imports every
    backend its entry points name); the profiler, the CUPTI libraries and the AMD code generator are left out."""
    tools = ["ptxas", "ptxas-blackwell", "cuobjdump", "nvdisasm"]
    kept = ["triton/__init__.py", *(f"triton/backends/nvidia/bin/{tool}" for tool in tools),
            "triton/backends/nvidia/include/cuda.h", "triton/backends/amd/__init__.py",
            "triton/backends/amd/lib/ocml.bc", "triton-0.0.1.dist-info/entry_points.txt"]
    dropped = ["triton/backends/nvidia/lib/cupti/libcupti.so", "triton/backends/nvidia/lib/cupti-blackwell/libcupti.so",
               "triton/backends/amd/lib/libtriton_amd_codegen.so", "triton/_C/libproton.so", "triton/profiler/__init__.py",
               "triton/instrumentation/libGPUInstrumentationTestLib.so", "triton/plugins/libMLIRDialectPlugin.so",
               "triton/FileCheck"]
    wheel = tmp_path / "triton-0.0.1-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in kept + dropped:
            archive.writestr(name, "__version__ = '0.0.1'\n" if name == "triton/__init__.py" else name)
        archive.write(shutil.which("true"), "triton/_C/libtriton.so")  # an ELF file that `strip` takes
    script = os.path.join(KERNELS, "carried_triton.sh")
    env = {**os.environ, "CARRIED_TRITON_STAGE": str(tmp_path / "stage")}
    for args in (["pack", str(wheel), str(tmp_path / "packed")], ["stage", str(tmp_path / "packed" / "part1")],
                 ["unpack", str(tmp_path / "packed" / "part2"), str(tmp_path / "site")]):
        done = subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
    assert "Triton 0.0.1 from" in done.stdout
    site = tmp_path / "site"
    assert all((site / name).is_file() for name in kept + ["triton/_C/libtriton.so"])
    assert not any((site / name).exists() for name in dropped)
    for tool in tools:
        assert os.access(site / "triton/backends/nvidia/bin" / tool, os.X_OK)
    assert sorted(p.name for p in (tmp_path / "packed").iterdir()) == ["part1", "part2"]  # no half-written parts


@pytest.mark.skipif(not shutil.which("xz"), reason="needs xz")
def test_carried_packages_travel_as_wheels_or_compressed_trees_and_install_into_a_site(tmp_path):
    """`kernels/carried_packages.sh` on two made-up pure-Python wheels: the one above the size limit travels as an xz
    tree, the other as its wheel; `install` puts both where `PYTHONPATH` finds them, metadata included."""
    wheels = {}
    for name, size in (("smallpkg", 100), ("largepkg", 50_000)):
        wheel = tmp_path / f"{name}-1.0-py3-none-any.whl"
        info = f"{name}-1.0.dist-info"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{name}/__init__.py", f"NAME = '{name}'\n" + "#" * size + "\n")
            archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
            archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            archive.writestr(f"{info}/RECORD", "")
        wheels[name] = wheel
    script = os.path.join(KERNELS, "carried_packages.sh")
    env = {**os.environ, "CARRIED_COMPRESS_ABOVE_BYTES": "10000"}
    packed, site = tmp_path / "packed", tmp_path / "site"
    for args in (["pack", str(packed), *map(str, wheels.values())], ["install", str(packed), str(site)]):
        done = subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in packed.iterdir()) == ["largepkg-1.0.tar.xz", "smallpkg-1.0-py3-none-any.whl"]
    code = "import importlib.metadata as m, largepkg, smallpkg; print(largepkg.NAME, smallpkg.NAME, m.version('largepkg'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert done.stdout.split() == ["largepkg", "smallpkg", "1.0"], done.stderr


def test_llama_mask_under_compile_follows_the_installed_transformers_and_torch(tmp_path):
    """`kernels/llama_mask_under_compile.py` reads from the compiled graph whether transformers' Llama hands sdpa its
    causal flag: from transformers 5.18 with torch 2.12 or later it does (then the benchmark's flagged-Llama ratios
    are the ones a user sees), before either it builds a mask (`results/models/llama_mask_under_compile/`)."""
    import transformers
    from packaging.version import Version

    script = kernel_script("llama_mask_under_compile")
    expected = (Version(transformers.__version__).release >= (5, 18)
                and Version(torch.__version__.split("+")[0]).release >= (2, 12))
    assert script.main(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "llama_mask_under_compile.json").read_text())
    assert result["llama_gets_the_causal_flag"] is expected


def test_task_processes_do_not_merge_an_earlier_runs_results(tmp_path, bench_models_main, monkeypatch):
    """`--gpus`: a task whose process ends without writing results is an error, not the rows that an earlier run left
    in the same task folder (another task's, from another device)."""
    bench_models = bench_models_main
    stale = {"environment": {"device": "an earlier run's GPU"}, "train": [{"arch": "llama", "size": "tiny"}],
             "decode": [], "layer": [], "profile": {}, "errors": []}
    (tmp_path / "tasks" / "00").mkdir(parents=True)
    (tmp_path / "tasks" / "00" / "models_bench.json").write_text(json.dumps(stale))
    popen = subprocess.Popen
    monkeypatch.setattr(bench_models.subprocess, "Popen",  # (a task process that fails before it writes anything)
                        lambda command, **kwargs: popen([sys.executable, "-c", "raise SystemExit(3)"], **kwargs))
    monkeypatch.setattr(bench_models, "finish", lambda results, out: results)
    monkeypatch.setattr(bench_models, "forwarded_options", lambda parser, args: [])
    args = argparse.Namespace(out=str(tmp_path), gpus=2, deadline_s=None, device="cpu")
    merged = bench_models.run_on_gpus(["train:tiny:flash_mhf:eager"], args, None)
    assert merged["train"] == [] and merged["gpus"] == {}
    assert merged["errors"] == ["train:tiny:flash_mhf:eager: exit code 3: "]


def record_plotted_bars(monkeypatch) -> dict:
    """{label: heights} of every bar group a plot draws from now on."""
    from matplotlib.axes import Axes

    plotted, bar = {}, Axes.bar

    def recording_bar(self, xs, heights, *args, label=None, **kwargs):
        plotted[label] = list(heights)
        return bar(self, xs, heights, *args, label=label, **kwargs)

    monkeypatch.setattr(Axes, "bar", recording_bar)
    return plotted


def test_model_benchmark_plot_and_report_name_the_model_each_ratio_is_to(tmp_path, monkeypatch):
    """Rounds paired with a model other than Llama (a task without Llama), or a model decoding alone (paired with
    itself), give no ratio to Llama: the plot of ratios to Llama takes the ratio of throughputs to Llama's row where
    there is one, and the report names the model a paired ratio is to, or has none."""
    bench_models = kernel_script("bench_models")
    plotted = record_plotted_bars(monkeypatch)

    def row(arch, task, tokens_per_s, baseline, ratio, others):
        return {"arch": arch, "size": "370M", "batch": 1, "mode": "eager", "decode_tokens_per_s": tokens_per_s,
                "ms_per_step": 1e3 / tokens_per_s, "round_paired_baseline": baseline, "round_paired_ratio": ratio,
                "round_paired_ratio_quartiles": None, "interleaved_with": others, "task": task}

    decode = [row("llama", "decode:370M:llama:eager", 100.0, "llama", 1.0, []),
              row("flash_mhf", "decode:370M:flash_mhf:eager", 50.0, "flash_mhf", 1.0, []),
              row("flash_mhf_triton_forward", "pair", 60.0, "flash_mhf_triton_forward", 1.0, ["kvffn"]),
              row("kvffn", "pair", 90.0, "flash_mhf_triton_forward", 1.5, ["flash_mhf_triton_forward"])]
    results = {"environment": {"device": "cpu", "torch": "-", "triton": "-", "transformers": "-"}, "decode": decode}
    bench_models.plot(results, str(tmp_path / "models_bench.png"))
    assert plotted == {"Llama (transformers)": [1.0], "FlashMHFLlama": [0.5]}
    text = bench_models.report(results)
    assert "| FlashMHFLlama | 50 | 20.00 | 0.50 | - |" in text
    assert "| KVFFN | 90 | 11.11 | - | 1.50 x FlashMHFLlama, the op's forward on the Triton kernel |" in text
    assert "| 60 | 16.67 | - | 1.00 x FlashMHFLlama, the op's forward on the Triton kernel |" in text


def test_model_benchmark_report_says_which_tasks_it_lacks(tmp_path, bench_models_main):
    """The tasks that `--deadline-s` skipped are listed in the report; the files written after each task list the tasks
    still to come, so those of a run cut short do not read as a whole run."""
    bench_models = bench_models_main
    tasks = ["layer:tiny", "train:tiny:llama:eager"]
    bench_models.main(["--out", str(tmp_path), "--device", "cpu", "--deadline-s", "0", "--tasks", *tasks])
    data = json.loads((tmp_path / "models_bench.json").read_text())
    assert data["skipped"] == tasks and data["unfinished"] == []
    markdown = (tmp_path / "models_bench.md").read_text()
    assert "- train:tiny:llama:eager: skipped, past `--deadline-s`" in markdown
    environment = {"device": "cpu", "torch": "-", "triton": "-", "transformers": "-"}
    text = bench_models.report({"environment": environment, "unfinished": ["train:tiny:llama:eager"]})
    assert "- train:tiny:llama:eager: not finished when this was written" in text
    merged = bench_models.merge_task_results(tasks, {1: (tasks[1], None, None, "skipped")},
                                             argparse.Namespace(out=str(tmp_path)))
    assert merged["unfinished"] == ["layer:tiny"] and merged["skipped"] == ["train:tiny:llama:eager"]


def test_model_benchmark_refuses_options_and_batches_it_cannot_measure(tmp_path, bench_models_main, capsys):
    """A decoding step is the time between two tokens: `--new-tokens` below 2 is refused before any model is built,
    as are empty sequences and batches; a task's batch of 0 is refused rather than read as the preset's."""
    bench_models = bench_models_main
    for option, value in (("--new-tokens", "1"), ("--seq-len", "0"), ("--decode-batches", "0")):
        with pytest.raises(SystemExit) as refused:
            bench_models.main(["--out", str(tmp_path), "--device", "cpu", option, value, "--tasks", "layer:tiny"])
        assert refused.value.code == 2 and f"{option} must be at least" in capsys.readouterr().err
    # the options that choose the default tasks would be ignored beside --tasks: refused, naming them
    for options in (["--sizes", "tiny"], ["--compile"], ["--decode-sizes", "tiny", "--compile-sizes", "tiny"]):
        with pytest.raises(SystemExit) as refused:
            bench_models.main(["--out", str(tmp_path), "--device", "cpu", *options, "--tasks", "layer:tiny"])
        error = capsys.readouterr().err
        assert refused.value.code == 2 and "choose the default tasks" in error, options
        assert all(option in error for option in options if option.startswith("--")), (options, error)
    for task in ("train:tiny:llama:eager:0", "profile_train:tiny:llama:eager:0", "profile_decode:tiny:llama:0"):
        with pytest.raises(ValueError, match="expected"):
            bench_models.check_task(task)
    bench_models.check_task("train:tiny:llama:eager:10")
    assert not list(tmp_path.iterdir())


def test_model_benchmark_refuses_a_deadline_and_another_package_task_it_cannot_honour(tmp_path, bench_models_main,
                                                                                      capsys):
    """A `--deadline-s` below 0 (every task skipped, the run ending as a success) or not a number (a NaN compares
    false: none skipped) is refused; a decode task's `<arch>@other` model without `--decode-processes` and
    `--other-package` is refused with the other tasks before the first runs, not once the tasks before it have run."""
    bench_models = bench_models_main
    for value in ("-5", "nan"):
        with pytest.raises(SystemExit) as refused:
            bench_models.main(["--out", str(tmp_path), "--device", "cpu", "--deadline-s", value, "--tasks",
                               "layer:tiny"])
        assert refused.value.code == 2 and "--deadline-s must be 0 or more seconds" in capsys.readouterr().err, value
    for options in ([], ["--decode-processes"]):
        with pytest.raises(SystemExit) as refused:
            bench_models.main(["--out", str(tmp_path), "--device", "cpu", *options, "--tasks", "layer:tiny",
                               "decode:tiny:llama+kvffn@other:eager"])
        assert refused.value.code == 2, options
        assert "an @other model needs --decode-processes and --other-package" in capsys.readouterr().err, options
    assert not list(tmp_path.iterdir())


def test_model_benchmark_plot_keeps_the_other_packages_models(tmp_path, monkeypatch):
    """A decode task's `<arch>@other` model (`--other-package`: the change a run measures) has a bar in the plot of
    ratios to Llama beside this checkout's model, as it has a row in the report."""
    bench_models = kernel_script("bench_models")
    plotted = record_plotted_bars(monkeypatch)
    archs = ["llama", "kvffn", "kvffn@other"]
    decode = [{"arch": arch, "size": "tiny", "batch": 1, "mode": "eager", "decode_tokens_per_s": 100.0,
               "ms_per_step": 10.0, "round_paired_baseline": "llama", "round_paired_ratio": ratio,
               "round_paired_ratio_quartiles": None, "interleaved_with": [a for a in archs if a != arch],
               "task": "decode:tiny:llama+kvffn+kvffn@other:eager"} for arch, ratio in zip(archs, (1.0, 0.9, 0.8))]
    results = {"environment": {"device": "cpu", "torch": "-", "triton": "-", "transformers": "-"}, "decode": decode}
    bench_models.plot(results, str(tmp_path / "models_bench.png"))
    assert plotted == {"Llama (transformers)": [1.0], "KVFFN": [0.9], "KVFFN, the other package": [0.8]}
    assert "| KVFFN, the other package |" in bench_models.report(results)
    # LoRA rows are paired with Llama under the same LoRA: their bars are its ratios too (the plot was left empty)
    plotted.clear()
    archs = ["llama_lora", "flash_mhf_lora"]
    train = [{"arch": arch, "size": "tiny", "batch": 2, "mode": "compiled", "tokens_per_s": 100.0,
              "round_paired_baseline": "llama_lora", "round_paired_ratio": ratio, "interleaved_with": [],
              "task": "train:tiny:llama_lora+flash_mhf_lora:compiled"} for arch, ratio in zip(archs, (1.0, 1.5))]
    bench_models.plot({**results, "decode": [], "train": train}, str(tmp_path / "lora.png"))
    assert plotted == {"Llama (transformers), LoRA r16": [1.0], "FlashMHFLlama, LoRA r16": [1.5]}


def test_memory_readout_benchmark_times_and_names_the_device_asked_for(monkeypatch, capsys):
    """`bench_memory_readout.py --device cpu` (its default) times wall-clock and names the CPU on a machine that has a
    GPU too (here one pretended), as the tensors it times are on the CPU."""
    script = kernel_script("bench_memory_readout")
    harness = importlib.import_module("harness")
    monkeypatch.setattr(harness, "_measured_device_type", harness._measured_device_type)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA pretended")
    script.main(["--device", "cpu", "--layers", "2", "--tokens", "8", "--hidden", "4"])
    printed = capsys.readouterr().out
    assert "readout backward over 2 layers" in printed and "NVIDIA" not in printed


def test_token_lookup_benchmark_checks_its_modes_and_keeps_the_table_folder_given(tmp_path, monkeypatch, capsys):
    """`bench_token_lookup.py --modes` names modes of MODES (a typo is refused before any work, not skipped), and a
    `--table-dir` given keeps the table exported into it (only a folder of the script's own is removed)."""
    script = kernel_script("bench_token_lookup")
    monkeypatch.setattr(sys, "argv", ["bench_token_lookup.py", "--out", str(tmp_path), "--modes", "dense,gpus"])
    with pytest.raises(SystemExit) as refused:
        script.main()
    assert refused.value.code == 2 and "'gpus' not among dense, compute, gpu" in capsys.readouterr().err

    class Model:  # what main() asks of the MemoryLLM it builds (no GPU here)
        model = argparse.Namespace(token_lookup=None)

        def parameter_counts(self):
            return {}

        def load_tols(self, *args, **kwargs):
            return argparse.Namespace(device_bytes=lambda: 0)

    def export(model, directory, **kwargs):
        open(os.path.join(directory, "table.bin"), "w").close()
        return {"size_bytes": 0, "num_shards": 1}

    monkeypatch.setattr(script, "check_kernels", lambda: {})
    monkeypatch.setattr(script, "build_models", lambda args, which: Model())
    monkeypatch.setattr(script, "bench_mode", lambda results, label, model, args: None)
    monkeypatch.setattr(importlib.import_module("hf_memffn.conversion"), "export_tols", export)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    table = tmp_path / "table"
    table.mkdir()
    monkeypatch.setattr(sys, "argv", ["bench_token_lookup.py", "--out", str(tmp_path), "--modes", "gpu",
                                      "--table-dir", str(table)])
    script.main()
    assert (table / "table.bin").exists()


def test_tune_sweep_refuses_roles_variants_and_configs_it_does_not_have(tmp_path, monkeypatch, capsys):
    """`tune_flash_mhf.py`: `--roles` and `--variants` name those of VARIANTS, and `--configs` four integers; a typo
    is refused (before the GPU is looked for) rather than sweeping nothing or failing in the middle."""
    script = kernel_script("tune_flash_mhf")
    for given, expected in ((["--roles", "forwrd"], "--roles: forwrd not among backward, forward"),
                            (["--variants", "glun"], "--variants: glun not among"),
                            (["--configs", "forward:128,64,8"], "expected role:BLOCK_L,BLOCK_N,warps,stages")):
        monkeypatch.setattr(sys, "argv", ["tune_flash_mhf.py", "--out", str(tmp_path), *given])
        with pytest.raises(SystemExit) as refused:
            script.main()
        assert expected in f"{refused.value.code}{capsys.readouterr().err}", given
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["tune_flash_mhf.py", "--out", str(tmp_path), "--roles", "forward", "weights_v",
                                      "--variants", "gluon", "--configs", "rows:128,64,8,2"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        script.main()


def test_compiled_step_host_smoke_run_names_the_cpu(tmp_path, monkeypatch):
    """`profile_compiled_step_host.py --cpu` measures on the CPU, and its results name the CPU, on a machine that has a
    GPU too (here one pretended; the measurement itself stood in)."""
    script = kernel_script("profile_compiled_step_host")
    harness = importlib.import_module("harness")
    monkeypatch.setattr(harness, "_measured_device_type", harness._measured_device_type)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA pretended")
    measured_on_cuda = []

    def measure(architecture, size, batch, rounds, steps, profile_steps, device):
        measured_on_cuda.append(harness.on_cuda())
        return {"name": architecture, "layers": 1, "summary": {}}

    monkeypatch.setattr(script, "measure", measure)
    script.main(["--out", str(tmp_path), "--cpu", "--archs", "llama"])
    data = json.loads((tmp_path / "compiled_step_host.json").read_text())
    assert measured_on_cuda == [False] and "NVIDIA" not in data["environment"]["device"]


@pytest.mark.parametrize("name", ["compare_inference_tuning", "compare_specialisation"])
def test_comparison_scripts_refuse_no_rounds_before_any_work(name, tmp_path, capsys):
    """`--rounds 0` would time nothing: refused by the harness's shared check, naming the option, before any work."""
    with pytest.raises(SystemExit) as refused:
        kernel_script(name).main(["--out", str(tmp_path / "out"), "--rounds", "0"])
    assert refused.value.code == 2 and "--rounds must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_clock_sampler_reads_the_gpu_the_process_sees(monkeypatch):
    """`harness.ClockSampler` asks nvidia-smi about the process's own GPU: nvidia-smi does not read
    CUDA_VISIBLE_DEVICES, so a task process of `bench_models.py --gpus` that sees only GPUs 2 and 3 samples GPU 2 (its
    device 0), not nvidia-smi's GPU 0."""
    harness = kernel_script("harness")
    sampler, asked = harness.ClockSampler(), []

    def run(command, **kwargs):
        asked.append(command[command.index("-i") + 1])
        sampler.stop.set()
        return subprocess.CompletedProcess(command, 0, stdout="1755, 690.5\n")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(harness.subprocess, "run", run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    sampler.available = True
    with sampler:
        sampler.thread.join()
    assert asked == ["2"] and sampler.summary()["sm_clock_mhz"] == 1755.0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert harness.nvidia_smi_id() == "0"


@pytest.mark.parametrize("name, given, expected", [
    ("bench_triton_launch", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("bench_triton_launch", ["--calls", "0"], "--calls must be at least 1, got 0"),
    ("profile_compiled_step_host", ["--cpu", "--size", "tiny", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("profile_compiled_step_host", ["--cpu", "--size", "tiny", "--steps", "0"], "--steps must be at least 1, got 0"),
    ("profile_compiled_step_host", ["--cpu", "--size", "tiny", "--archs", "llama", "lama"],
     "argument --archs: invalid choice: 'lama'"),
    ("bench_token_lookup", ["--new-tokens-short", "8", "--new-tokens-long", "8"],
     "--new-tokens-long must be greater than --new-tokens-short (8), got 8"),
    ("bench_token_lookup", ["--new-tokens-short", "0"], "--new-tokens-short must be at least 1, got 0"),
    ("bench_token_lookup", ["--new-tokens-short", "2", "--new-tokens-long", "6"],
     "--new-tokens-long must be at least 7, got 6"),
    ("bench_triton_launch", ["--size", "999M"], "--size: preset='999M' is not one of"),
    ("profile_compiled_step_host", ["--cpu", "--size", "999M"], "--size: preset='999M' is not one of"),
    ("launch_host_cpu", ["--number", "0"], "--number must be at least 1, got 0"),
    ("launch_host_cpu", ["--repeat", "0"], "--repeat must be at least 1, got 0"),
])
def test_host_time_scripts_refuse_counts_and_models_they_cannot_measure(name, given, expected, tmp_path, capsys):
    """`bench_triton_launch.py` and `profile_compiled_step_host.py` refuse no round, no call or step per round (no
    median to report) and a model `bench_models.py` does not build, naming the option, before any work: not a
    statistics error once the first model has been compiled and measured. `bench_token_lookup.py` refuses a long
    decode no longer than the short one (its tokens/s is over the extra tokens) or too short to time a graph replay."""
    with pytest.raises(SystemExit) as refused:
        kernel_script(name).main(["--out", str(tmp_path / "out"), *given])
    assert refused.value.code == 2 and expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_model_benchmark_refuses_a_preset_without_a_training_batch(tmp_path, bench_models_main, capsys):
    """A preset that `TRAIN_BATCH` lacks (128M) is refused for the tasks that take the preset's training batch, before
    any model is built, rather than failing each such task with a KeyError once its models are built; a training task
    that gives its own batch, and the decoding tasks, take it."""
    bench_models = bench_models_main
    assert "128M" not in bench_models.TRAIN_BATCH
    for task in ("layer:128M", "layer:128M:compiled", "profile:128M", "train:128M:llama:eager",
                 "profile_train:128M:llama:compiled"):
        with pytest.raises(ValueError, match="preset 128M has no training batch here; allowed: 370M, 1.3B"):
            bench_models.check_task(task)
    for task in ("train:128M:llama+flash_mhf:compiled:8", "profile_train:128M:llama:eager:8",
                 "decode:128M:llama:eager", "profile_decode:128M:llama"):
        bench_models.check_task(task)
    with pytest.raises(SystemExit) as refused:
        bench_models.main(["--out", str(tmp_path), "--device", "cpu", "--sizes", "128M"])
    assert refused.value.code == 2 and "--tasks: task 'layer:128M': preset 128M" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_model_benchmark_exit_status_says_a_task_failed(tmp_path, bench_models_main, monkeypatch):
    """A run whose report lists a failed task still writes its files, and ends with `FAILED_TASKS_EXIT`; with `--gpus`,
    a task process that ends so, its error in its results, is that error once in the merged report."""
    # (the flagged Llama refuses the padding mask that generate() passes: a task that fails once its model is built)
    monkeypatch.setattr(sys, "argv", ["bench_models.py", "--out", str(tmp_path), "--device", "cpu", "--new-tokens",
                                      "2", "--decode-batches", "1", "--decode-repeats", "1",
                                      "--tasks", "decode:tiny:llama_causal_flag:eager"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the script puts its folders on it again)
    with pytest.raises(SystemExit) as stopped:  # (the script's `__main__` block, run in this process)
        runpy.run_path(os.path.join(KERNELS, "bench_models.py"), run_name="__main__")
    assert stopped.value.code == 1
    data = json.loads((tmp_path / "models_bench.json").read_text())
    assert len(data["errors"]) == 1 and "only for sequences without a padding mask" in data["errors"][0]
    bench_models = bench_models_main
    task = "train:tiny:flash_mhf:eager"
    child = {"environment": bench_models.environment(), "train": [], "decode": [], "layer": [], "profile": {},
             "errors": [f"{task}: RuntimeError('boom')"]}
    writes = (f"import json, os; os.makedirs({str(tmp_path / 'tasks' / '00')!r}, exist_ok=True); "
              f"json.dump({child!r}, open({str(tmp_path / 'tasks' / '00' / 'models_bench.json')!r}, 'w')); "
              f"raise SystemExit({bench_models.FAILED_TASKS_EXIT})")
    popen = subprocess.Popen
    monkeypatch.setattr(bench_models.subprocess, "Popen",
                        lambda command, **kwargs: popen([sys.executable, "-c", writes], **kwargs))
    monkeypatch.setattr(bench_models, "finish", lambda results, out: results)
    monkeypatch.setattr(bench_models, "forwarded_options", lambda parser, args: [])
    args = argparse.Namespace(out=str(tmp_path), gpus=2, deadline_s=None, device="cpu")
    merged = bench_models.run_on_gpus([task], args, None)
    assert merged["errors"] == [f"{task}: RuntimeError('boom')"]
    assert merged["gpus"] == {"0": child["environment"]["device"]}


# the scripts that write into the folder --out (kernels/ and the example benchmarks), each with what else it needs to
# get past its arguments
OUT_SCRIPTS = {"bench_models.py": [], "bench_flash_mhf.py": [], "tune_flash_mhf.py": [],
               "tune_flash_mhf_layer.py": [], "profile_flash_mhf_host.py": [], "profile_flash_mhf_kernels.py": [],
               "profile_flash_mhf_memory.py": [], "profile_flash_mhf_step.py": [], "profile_kvffn_layer.py": [],
               "compiled_step_breakdown.py": [os.path.join(ROOT, BREAKDOWN_SOURCE)], "compare_forward_kernels.py": [],
               "compare_inference_tuning.py": [], "compare_specialisation.py": [],
               "compare_triton_builds.py": ["export"], "bench_dq_reduction.py": [], "bench_flash_mhf_head_dims.py": [],
               "bench_token_lookup.py": [], "bench_triton_launch.py": [], "custom_op_overhead.py": [],
               "launch_host_cpu.py": [], "llama_mask_under_compile.py": [], "profile_compiled_step_host.py": [],
               "profile_decode_host.py": [], "ptxas_report.py": [], "disk_table_threads.py": [],
               os.path.join("..", "examples", "bench_continuous_batching.py"): [],
               os.path.join("..", "examples", "recipe_speed.py"): []}


def out_is_a_file_runs(folder):
    """The runs of the test below: each script given `folder`'s `a_file`, written here, as `--out`."""
    taken = folder / "a_file"
    taken.write_text("kept\n")
    return [[os.path.join(KERNELS, name), [*before, "--out", str(taken)]] for name, before in OUT_SCRIPTS.items()]


def test_scripts_refuse_an_out_that_is_a_file(script_runs):
    """`--out` naming a file is refused as the arguments are read, naming the option, before any work: not a
    FileExistsError at the first write, once a measurement has run."""
    folder, outcomes = script_runs["out_is_a_file"]
    taken = folder / "a_file"
    for name, before in OUT_SCRIPTS.items():
        code, _, written = outcomes[" ".join([os.path.basename(name), *before, "--out", str(taken)])]
        assert code == 2 and "argument --out: " in written and "is a file; allowed: a directory" in written, (
            name, code, written[-500:])
    assert taken.read_text() == "kept\n" and os.listdir(folder) == ["a_file"]


def strict_json(text: str):
    """`text` read as strict JSON: `NaN`, `Infinity` and `-Infinity` are refused, as browsers and `jq` refuse them."""
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_harness_writes_numbers_that_are_not_finite_as_null(tmp_path):
    """A diverged or failed measurement (nan, inf) is written as `null`, so every reader of strict JSON can read the
    file; other numbers and objects are written as before."""
    harness = kernel_script("harness")
    path = tmp_path / "results.json"
    harness.write_json(str(path), {"loss": math.nan, "rounds": [1.5, math.inf, (-math.inf, 2)],
                                   "device": torch.device("cpu")})
    assert strict_json(path.read_text()) == {"loss": None, "rounds": [1.5, None, [None, 2]], "device": "cpu",
                                             "not_finite": {"loss": "NaN",
                                                            "rounds": {"1": "Infinity", "2": {"0": "-Infinity"}}}}


def test_harness_write_that_fails_leaves_no_temporary_file(tmp_path):
    """A table that cannot be written (here a character UTF-8 cannot encode) raises and leaves nothing in the results
    folder: not a `<name>.tmp<pid>` file beside the committed results."""
    harness = kernel_script("harness")
    with pytest.raises(UnicodeEncodeError):
        harness.write_text(str(tmp_path / "report.md"), "a table \ud800")
    assert os.listdir(tmp_path) == []
    harness.write_text(str(tmp_path / "report.md"), "a table\n")
    assert os.listdir(tmp_path) == ["report.md"] and (tmp_path / "report.md").read_text() == "a table\n"


def test_harness_names_the_processor_of_a_measurement_on_the_cpu(monkeypatch):
    """A result measured on the CPU (the host-time scripts, a smoke run) names the processor, its model and cores, as
    a GPU result names the GPU: not "cpu", nor the architecture that `platform.processor()` gives on Linux."""
    harness = kernel_script("harness")
    monkeypatch.setattr(harness, "_measured_device_type", "cpu")
    device = harness.environment()["device"]
    assert device == harness.cpu_name() and device.endswith(f", {os.cpu_count()} cores")
    with open("/proc/cpuinfo", encoding="utf-8") as handle:
        model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), None)
    if model is not None:  # (some architectures' cpuinfo has no model name)
        assert device.startswith(model)


def _two_training_rows() -> list[dict]:
    """A whole-model training row of Llama and one of FlashMHFLlama, made up, as `bench_models.report` reads them."""
    return [{"arch": arch, "size": "tiny", "mode": "eager", "batch": 2, "seq_len": 16, "params": 1e6,
             "tokens_per_s": tokens_per_s, "step_ms": 32e3 / tokens_per_s, "host_ms": 1.0, "peak_gib": None}
            for arch, tokens_per_s in (("llama", 1000.0), ("flash_mhf", 1200.0))]


@pytest.mark.filterwarnings("ignore:No artists with labels")  # (the op plot of a run that measured nothing)
def test_plots_that_fail_while_written_leave_no_file_beside_the_results(tmp_path, monkeypatch):
    """The whole-model and op benchmarks' plots are written through a temporary name: a plot that fails while being
    written (here a full disk) leaves neither half an image nor a temporary file beside the results, whose JSON and
    table are written whole; a plot that succeeds is a PNG at its own name."""
    from matplotlib.figure import Figure

    def half_written(figure, target, **kwargs):
        with open(target, "wb") as handle:
            handle.write(b"\x89PNG, half")
        raise OSError(28, "No space left on device")

    environment = {"device": "stand-in", "torch": "-", "triton": "-", "transformers": "-"}
    models = {"environment": environment, "train": _two_training_rows(), "errors": []}
    op = {"device": "stand-in", "torch": "-", "triton": "-", "op": [], "module": [], "decode": []}
    bench_models, bench_flash_mhf = kernel_script("bench_models"), kernel_script("bench_flash_mhf")
    with monkeypatch.context() as patched:
        patched.setattr(Figure, "savefig", half_written)
        bench_models.finish(models, str(tmp_path / "models"))
        bench_flash_mhf.finish(op, str(tmp_path / "op"))
    assert sorted(os.listdir(tmp_path / "models")) == ["models_bench.json", "models_bench.md"]
    assert sorted(os.listdir(tmp_path / "op")) == ["flash_mhf_bench.json", "flash_mhf_bench.md"]
    bench_models.finish(models, str(tmp_path / "models"))
    assert sorted(os.listdir(tmp_path / "models")) == ["models_bench.json", "models_bench.md", "models_bench.png"]
    assert (tmp_path / "models" / "models_bench.png").read_bytes().startswith(b"\x89PNG\r\n")


def test_harness_measures_on_the_gpu_named_and_refuses_one_not_there(monkeypatch):
    """`measure_on("cuda:N")` makes GPU N the current device: do_bench's events, the synchronisations, the peak memory
    and the device's name follow the current device, not the one the timed tensors are on. A GPU that is not there is
    refused naming the device and the allowed values, not met as an AssertionError at the first tensor."""
    harness = kernel_script("harness")
    monkeypatch.setattr(harness, "_measured_device_type", harness._measured_device_type)
    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    harness.measure_on("cuda:1")
    harness.measure_on("cuda")  # (the current device, whichever it is)
    assert selected == [1] and harness._measured_device_type == "cuda"
    with pytest.raises(ValueError, match=r"device='cuda:2': 2 CUDA device\(s\) visible; allowed: cuda:0 to cuda:1"):
        harness.measure_on("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda': no CUDA device is visible; allowed here: cpu"):
        harness.measure_on("cuda")
    harness.measure_on("cpu")
    assert selected == [1] and harness._measured_device_type == "cpu"


def test_cpu_host_scripts_name_the_cpu_they_measured_on(tmp_path, monkeypatch):
    """`custom_op_overhead.py` and `launch_host_cpu.py` time CPU tensors: on a machine with a GPU too (here one
    pretended) their results name the CPU, not the GPU that took no part."""
    harness = kernel_script("harness")
    monkeypatch.setattr(harness, "_measured_device_type", None)  # (as a script starts: torch's choice)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA pretended")
    overhead = kernel_script("custom_op_overhead")
    monkeypatch.setattr(overhead, "dispatch_us", lambda: {"plain function": 1.0, "custom operator": 2.0})
    monkeypatch.setattr(overhead, "compiled_output_code", lambda: [])
    assert overhead.main(["--out", str(tmp_path / "overhead")]) == 0
    launches = kernel_script("launch_host_cpu")
    monkeypatch.setattr(launches.flash_mhf_gluon, "GLUON_AVAILABLE", True)
    monkeypatch.setattr(launches.builds, "compiling_for_hopper", contextlib.nullcontext)
    monkeypatch.setattr(launches, "measure", lambda number, repeat: [{"what": "a launch", "us_per_call": 1.0}])
    launches.main(["--out", str(tmp_path / "launches"), "--number", "1", "--repeat", "1"])
    for path in (tmp_path / "overhead" / "custom_op_overhead.json", tmp_path / "launches" / "launch_host_cpu.json"):
        assert "NVIDIA" not in json.loads(path.read_text())["environment"]["device"], path
    assert "NVIDIA" not in (tmp_path / "overhead" / "custom_op_overhead.txt").read_text()
    assert f"driver on {harness.cpu_name()} (triton" in (tmp_path / "launches" / "launch_host_cpu.md").read_text()


def test_head_size_benchmark_writes_a_failed_check_as_strict_json(tmp_path, monkeypatch):
    """`bench_flash_mhf_head_dims.py` writes its results through the harness: a check whose errors are not finite (a
    kernel writing NaN, the failure the file is read for) is written as `null` and named under `not_finite`, not as
    the `NaN` strict readers refuse, and the run ends with exit status 1."""
    script = kernel_script("bench_flash_mhf_head_dims")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "stand-in")
    monkeypatch.setattr(script, "check", lambda head_dim: [math.nan] * 6)
    monkeypatch.setattr(sys, "argv", ["bench_flash_mhf_head_dims.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        script.main()
    assert stopped.value.code == 1
    data = strict_json((tmp_path / "flash_mhf_head_dims.json").read_text())
    assert data["rows"] == [{"head_dim": 64, "rel_err_out_dq_dk_du_dv_dr": [None] * 6, "correct": False,
                             "not_finite": {"rel_err_out_dq_dk_du_dv_dr": {str(i): "NaN" for i in range(6)}}}]
    assert "failed the correctness check" in (tmp_path / "flash_mhf_head_dims.md").read_text()
    assert sorted(os.listdir(tmp_path)) == ["flash_mhf_head_dims.json", "flash_mhf_head_dims.md"]


def test_host_time_comparison_refuses_a_work_folder_without_runs(tmp_path, capsys):
    """`compare_host_time.py` given a work folder that is missing or holds none of the rounds' runs (a typo, or the
    wrong rounds), or no round, stops naming the argument: it wrote a report of nothing on an unknown device."""
    script = kernel_script("compare_host_time")
    (tmp_path / "empty").mkdir()
    for given, expected in (([str(tmp_path / "missing"), "2"], "is not a folder"),
                            ([str(tmp_path / "empty"), "2"], "holds no run of rounds 1 to 2"),
                            ([str(tmp_path / "empty"), "0"], "rounds must be at least 1, got 0")):
        with pytest.raises(SystemExit) as refused:
            script.main([*given, str(tmp_path / "out")])
        assert refused.value.code == 2 and expected in capsys.readouterr().err, given
    assert not (tmp_path / "out").exists()


# (script, its arguments, the last line it writes to stderr): counts refused before a GPU is looked for
GPU_SCRIPT_COUNTS = [
    ("compare_forward_kernels.py", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("profile_flash_mhf_host.py", ["--steps", "0"], "--steps must be at least 1, got 0"),
    ("bench_flash_mhf.py", ["--lengths", "1536", "0"], "--lengths must be at least 1, got [1536, 0]"),
    ("tune_flash_mhf.py", ["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    ("profile_flash_mhf_memory.py", ["--length", "0"], "--length must be at least 1, got 0"),
    # (the fused backward's reference is the rows and weights kernels' outputs: without them each candidate failed)
    ("tune_flash_mhf.py", ["--roles", "backward"], "backward is checked against the rows and weights kernels"),
    ("profile_flash_mhf_step.py", ["--steps", "0"], "--steps must be at least 1, got 0"),
]


def gpu_script_count_runs(folder):
    out = str(folder / "out")
    runs = [[os.path.join(KERNELS, name), ["--out", out, *given]] for name, given, _ in GPU_SCRIPT_COUNTS]
    return runs + [[os.path.join(KERNELS, "profile_flash_mhf_memory.py"), ["--out", out]]]


def test_gpu_scripts_refuse_counts_they_cannot_measure_before_looking_for_a_gpu(script_runs):
    """No round, step or token to time (a median of nothing or a division by zero once every kernel has compiled) is
    refused naming the option, before any work, as is a fused-backward sweep without its reference kernels;
    `profile_flash_mhf_memory.py` without a GPU says it needs one (not an AssertionError from torch)."""
    folder, outcomes = script_runs["counts"]
    out = str(folder / "out")
    for name, given, expected in GPU_SCRIPT_COUNTS:
        code, _, written = outcomes[" ".join([name, "--out", out, *given])]
        assert code == 2 and expected in written.splitlines()[-1], (name, code, written[-500:])
    code, _, _ = outcomes[f"profile_flash_mhf_memory.py --out {out}"]
    assert code == "profile_flash_mhf_memory.py needs a CUDA GPU"
    assert not os.listdir(folder)


@pytest.mark.filterwarnings("ignore:No artists with labels")  # (the plot of a run that measured nothing)
def test_flash_mhf_benchmark_that_stopped_at_an_error_keeps_what_it_measured_and_exits_1(tmp_path, capsys):
    """An exception in one section is kept in the JSON, the table says the run stopped, and the script ends with exit
    status 1 (it ended with 0, so a scheduled run looked like a success); a run without one ends normally."""
    bench = kernel_script("bench_flash_mhf")
    results = {"device": "stand-in", "torch": torch.__version__, "triton": "-", "op": [], "module": [], "decode": []}
    bench.finish(dict(results), str(tmp_path / "fine"))
    assert "stopped at an error" not in (tmp_path / "fine" / "flash_mhf_bench.md").read_text()
    with pytest.raises(SystemExit) as stopped:
        bench.finish({**results, "error": "Traceback ...\nRuntimeError: boom\n"}, str(tmp_path / "failed"))
    assert stopped.value.code == 1
    assert "RuntimeError: boom" in strict_json((tmp_path / "failed" / "flash_mhf_bench.json").read_text())["error"]
    assert "stopped at an error" in (tmp_path / "failed" / "flash_mhf_bench.md").read_text()

def test_compiled_step_breakdown_refuses_results_it_cannot_read_and_sizes_no_preset_has(tmp_path, capsys):
    """A result file that is missing, not JSON or not a results object, and a size that no preset has, are refused
    naming what is wrong (not a traceback, nor the advice to run a task that bench_models.py would refuse)."""
    source = os.path.join(ROOT, BREAKDOWN_SOURCE)
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    for given, expected in (([source, "--sizes", "999M"], "--sizes: preset='999M' is not one of"),
                            ([str(tmp_path / "missing.json")], "No such file or directory"),
                            ([str(tmp_path / "broken.json")], "Expecting property name"),
                            ([str(tmp_path / "list.json")], "holds no results object")):
        with pytest.raises(SystemExit) as refused:
            kernel_script("compiled_step_breakdown").main([*given, "--out", str(tmp_path / "out")])
        written = capsys.readouterr().err
        assert refused.value.code == 2 and expected in written.splitlines()[-1], (given, written[-500:])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, given, expected", [
    ("bench_memory_readout", ["--layers", "0"], "--layers must be at least 1, got 0"),
    ("bench_memory_readout", ["--tokens", "0"], "--tokens must be at least 1, got 0"),
    ("bench_memory_readout", ["--device", "mps"], "--device: device='mps' is not supported; allowed: cuda, cuda:N"),
    ("bench_memory_readout", ["--device", "gpu"], "--device: device='gpu' is not supported; allowed: cuda, cuda:N"),
    ("bench_memory_readout", ["--device", "cuda"], "--device: device='cuda': no CUDA device is visible; allowed here"),
    ("profile_kvffn_layer", ["--out", "OUT", "--device", "cpu", "--sizes", "tiny", "--seq-len", "0"],
     "--seq-len must be at least 1, got 0"),
])
def test_readout_and_kvffn_layer_scripts_refuse_counts_and_devices_they_cannot_measure(name, given, expected,
                                                                                        tmp_path, monkeypatch, capsys):
    """No layer, token or sequence position to time (an AttributeError, or a run that times empty tensors), and a
    device the harness does not time on, are refused naming the option, before any tensor is made or file written."""
    harness = kernel_script("harness")
    monkeypatch.setattr(harness, "_measured_device_type", harness._measured_device_type)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (as where no GPU is visible)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *(str(tmp_path / "out") if arg == "OUT" else arg for arg in given)])
    with pytest.raises(SystemExit) as refused:
        kernel_script(name).main()  # (each reads its arguments from sys.argv)
    written = capsys.readouterr().err
    assert refused.value.code == 2 and expected in written.splitlines()[-1], written[-500:]
    assert not os.listdir(tmp_path)


def test_triton_builds_timing_refuses_negative_rounds(tmp_path, capsys):
    """`compare_triton_builds.py time --rounds` takes 0 (the check only, for a profiler) or more, refused below before
    any build is read."""
    compare = kernel_script("compare_triton_builds")
    with pytest.raises(SystemExit) as stopped:
        compare.main(["time", "--builds", str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--rounds", "-1"])
    assert stopped.value.code == 2
    assert "--rounds must be at least 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_triton_builds_timing_refuses_builds_it_would_report_under_one_label(tmp_path):
    """`compare_triton_builds.py time` keeps each build's rows under its label: two builds of one label (two exports
    of one Triton without `--label`) or a build labelled "installed" are refused naming the label, before the GPU is
    looked for; the second build replaced the first's rows, or the installed Triton's times."""
    compare = kernel_script("compare_triton_builds")
    for label, folders in (("triton 3.9.0", ["a", "b"]), ("installed", ["c"])):
        for folder in folders:
            (tmp_path / folder).mkdir()
            (tmp_path / folder / "manifest.json").write_text(json.dumps(
                {"label": label, "triton": "3.9.0", "ptxas": "12.8", "cases": {}}))
        with pytest.raises(SystemExit) as stopped:
            compare.main(["time", "--builds", *(str(tmp_path / folder) for folder in folders), "--out",
                          str(tmp_path / "out")])
        assert f"the label {label!r} names more than one build or the installed" in str(stopped.value.code), label
    assert not (tmp_path / "out").exists()


def test_harness_names_numbers_that_are_not_finite_and_its_readers_get_them_back(tmp_path):
    """The kernel scripts' results wrote a diverged or failed measurement as a bare null, the same as a value never
    measured: it is null and named under `not_finite` (`hf_memffn.run_records`), `harness.read_json` gives the NaN
    and infinities back, and compare_host_time.py reads a result through it."""
    harness = kernel_script("harness")
    path = tmp_path / "parts_a_1" / "flash_mhf_host_profile.json"
    harness.write_json(str(path), {"loss": math.nan, "rounds": [1.5, math.inf, (-math.inf, 2)], "device": "cpu"})
    written = strict_json(path.read_text())
    assert written["not_finite"] == {"loss": "NaN", "rounds": {"1": "Infinity", "2": {"0": "-Infinity"}}}
    read = harness.read_json(str(path))
    assert math.isnan(read["loss"]) and read["rounds"] == [1.5, math.inf, [-math.inf, 2]]
    loaded = kernel_script("compare_host_time").load(str(tmp_path), "parts", "a", 1)
    assert math.isnan(loaded["loss"]) and loaded["rounds"][1] == math.inf


def test_scripts_refuse_an_out_they_cannot_write(tmp_path, monkeypatch, read_only_folder):
    """`--out` (`harness.output_folder`, the package's check) in a folder this user cannot write, existing or to be
    created there, is refused as the arguments are read, naming the read-only folder: not a PermissionError at the
    first write, once the measurements have run. (Run as root, which writes anywhere, the folder's mode is read by
    `os.access` as for another user.)"""
    harness = kernel_script("harness")
    read_only = read_only_folder
    for out in (read_only, read_only / "results"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{re.escape(repr(str(read_only)))}.*not writable"):
            harness.output_folder(str(out))
    assert harness.output_folder(str(tmp_path / "results")) == str(tmp_path / "results")
