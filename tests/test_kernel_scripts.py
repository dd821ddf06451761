"""The GPU benchmark and profiling scripts under kernels/ import and parse their arguments on a machine without a GPU,
the Nsight Compute summary can be rebuilt from the committed raw metrics, and the fused layer's kernels compile for
an H100 (sm_90) without one."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
# the scripts import this checkout, and whatever else PYTHONPATH names (e.g. another Triton, to check its builds)
SCRIPT_PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
SCRIPTS = ["bench_flash_mhf.py", "bench_flash_mhf_head_dims.py", "tune_flash_mhf.py", "profile_flash_mhf_kernels.py",
           "bench_token_lookup.py", "bench_models.py", "bench_memory_readout.py", "compile_check.py",
           "tune_flash_mhf_layer.py", "profile_flash_mhf_host.py", "profile_decode_host.py", "compare_host_time.py",
           "custom_op_overhead.py", "profile_compiled_step_host.py", "compare_forward_kernels.py", "ptxas_report.py",
           "profile_flash_mhf_memory.py", "compare_triton_builds.py", "compare_specialisation.py",
           "compare_inference_tuning.py", "launch_host_cpu.py", "bench_dq_reduction.py"]


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


# Runs each script's `--help` in one Python process (one import of torch and transformers for all of them) and prints
# {script: [exit code, what it printed]} as JSON.
HELP_RUNNER = """
import contextlib, io, json, os, runpy, sys
results = {}
for path in sys.argv[1:]:
    printed, code = io.StringIO(), 0
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code or 0
    except Exception as exc:  # reported by the test of that script
        code = repr(exc)
    results[os.path.basename(path)] = [code, printed.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def script_help():
    env = {**os.environ, "PYTHONPATH": SCRIPT_PYTHONPATH}
    result = subprocess.run([sys.executable, "-c", HELP_RUNNER, *(os.path.join(KERNELS, name) for name in SCRIPTS)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help(script_help, name):
    """Every script imports and parses its arguments without a GPU."""
    code, printed = script_help[name]
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


def test_model_benchmark_runs_end_to_end_on_cpu(tmp_path):
    """The whole-model benchmark's every part at the tiny preset (wall-clock times; only the script is checked)."""
    tasks = ["layer:tiny", "train:tiny:llama:eager", "train:tiny:flash_mhf:eager", "train:tiny:flash_mhf_unfused:eager",
             "train:tiny:flash_mhf:eager:1", "decode:tiny:llama+flash_mhf:eager", "profile:tiny",
             "profile_train:tiny:flash_mhf:eager:1", "profile_decode:tiny:flash_mhf:2"]
    result = run_script("bench_models.py", "--out", str(tmp_path), "--device", "cpu", "--seq-len", "32",
                        "--new-tokens", "3", "--decode-repeats", "2", "--archs", "llama", "flash_mhf", "--tasks", *tasks)
    assert result.returncode == 0, result.stderr[-3000:]
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


def test_model_benchmark_pairs_training_rounds_and_runs_tasks_on_several_devices(tmp_path):
    """A training task naming several models times them in alternating rounds (`paired_train_rows`); `--gpus 2` runs
    each task in a process of its own on the next free device (here both are the CPU) and merges one report, each row
    noting its device and task, a failed task's error kept; a decoding task runs with no other task beside it."""
    tasks = ["train:tiny:llama+kvffn:eager", "decode:tiny:llama:eager", "train:tiny:llama:eager", "bogus:tiny"]
    result = run_script("bench_models.py", "--out", str(tmp_path), "--device", "cpu", "--gpus", "2", "--seq-len", "16",
                        "--train-rounds", "4", "--train-round-steps", "1", "--new-tokens", "2", "--decode-batches", "1",
                        "--decode-repeats", "1", "--tasks", *tasks)
    assert result.returncode == 0, result.stderr[-3000:]
    events = [(kind, line.split(": ", 1)[1] if kind == "start" else line.split(" finished ")[1].split(": ")[0])
              for line in result.stdout.splitlines() if line.startswith("[")
              for kind in (("finish",) if " finished " in line else ("start",))]
    decode = events.index(("start", tasks[1]))
    assert events[decode - 1] == ("finish", tasks[0]) and events[decode + 1] == ("finish", tasks[1])
    data = json.loads((tmp_path / "models_bench.json").read_text())
    assert data["errors"] == ["bogus:tiny: ValueError(\"unknown task 'bogus:tiny'\")"] and data["tasks"] == tasks
    assert [row["task"] for row in data["decode"]] == [tasks[1]]
    assert [(row["arch"], row["task"]) for row in data["train"]] == [
        ("llama", tasks[0]), ("kvffn", tasks[0]), ("llama", tasks[2])]
    assert {row["gpu"] for row in data["train"]} <= {0, 1} and set(data["gpus"]) <= {"0", "1"}
    llama, kvffn, alone = data["train"]
    assert llama["round_paired_ratio"] == 1.0 and kvffn["interleaved_with"] == ["llama"]
    assert len(kvffn["round_median_step_ms"]) == 4 and "round_paired_ratio" not in alone
    low, high = kvffn["round_paired_ratio_quartiles"]
    assert low <= kvffn["round_paired_ratio"] <= high
    assert sorted(os.listdir(tmp_path / "tasks")) == [f"{i:02d}{suffix}" for i in range(4) for suffix in ("", ".log")]
    markdown = (tmp_path / "models_bench.md").read_text()
    assert "| x Llama by round pairs |" in markdown and "| GPU |" in markdown and "on one of 2 GPUs" in markdown
    assert "plot failed" not in result.stdout and (tmp_path / "models_bench.png").stat().st_size > 0


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


def test_model_benchmark_task_processes_get_the_options_given():
    """`--gpus`: each task's process gets every option that differs from its default, except those of the whole run."""
    bench_models = kernel_script("bench_models")
    captured = {}

    def capture(tasks, args, parser):
        captured.update(tasks=tasks, options=bench_models.forwarded_options(parser, args))
        return {}

    given = ["--device", "cpu", "--seq-len", "16", "--decode-batches", "1", "4", "--decode-processes",
             "--train-rounds", "3"]
    settings = ("run_on_gpus", "SEQ_LEN", "NEW_TOKENS", "BUILD_ON", "DECODE_REPEATS", "DECODE_COMPILE_MODE",
                "TRAIN_ROUNDS", "TRAIN_ROUND_STEPS")  # (main sets the module's settings from its options)
    saved = {name: getattr(bench_models, name) for name in settings}
    bench_models.run_on_gpus = capture
    try:
        bench_models.main(["--out", "unused", "--gpus", "2", "--deadline-s", "9", "--tasks", "layer:tiny", *given])
    finally:
        for name, value in saved.items():
            setattr(bench_models, name, value)
    assert captured["tasks"] == ["layer:tiny"]
    assert sorted(captured["options"]) == sorted(given)
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
    `h100x4_*`, `h200x4_*`, with `.*` for a file set) is committed under kernels/results or examples/results."""
    committed = {name for folder in ("kernels/results", "examples/results")
                 for _, _, names in os.walk(os.path.join(ROOT, folder)) for name in names}
    missing = []
    for doc in ("README.md", "docs/speed.md", "kernels/results/models/README.md", "kernels/flash_mhf_notes.md"):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as handle:
            text = handle.read()
        for cited in set(re.findall(r"`(?:[\w.]+/)*((?:h100|h200x4|h100x4)[A-Za-z0-9_.{},*\-]*)`", text)):
            for name in _brace_expansions(cited):
                pattern = re.escape(name[:-1]) + ".+" if name.endswith(".*") else re.escape(name).replace(r"\*", ".*")
                if not any(re.fullmatch(pattern, file) for file in committed):
                    missing.append(f"{doc}: {cited}")
    assert not missing, missing


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
    reduce-overhead mode, which the GPU runs time); a task outside that grammar says what it expects."""
    bench_models = kernel_script("bench_models")
    model = torch.nn.Linear(2, 2)
    assert bench_models.compiled_for_training(model, "eager") is model
    for mode in ("compiled", "cudagraphs"):  # torch.compile is lazy: nothing compiles here
        assert bench_models.compiled_for_training(model, mode)._orig_mod is model
    args = bench_models.argparse.Namespace(device="cpu")
    for task, expected in (("train:tiny:llama:graphs", "eager|compiled|cudagraphs[:<batch>]"),
                           ("train:tiny:llama:eager:x", "eager|compiled|cudagraphs[:<batch>]"),
                           ("profile_train:tiny:llama:eager:1:2",
                            "profile_train:<size>:<arch>[:eager|compiled|cudagraphs")):
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


def test_model_benchmark_decodes_each_model_in_its_own_process(tmp_path):
    """`--decode-processes`: the models of a decode task run in processes of their own and still take turns;
    `--decode-cpus` pins each process to a CPU after its warm-up; `--decode-profile` profiles each where it ran."""
    cpu = min(os.sched_getaffinity(0))
    result = run_script("bench_models.py", "--out", str(tmp_path), "--device", "cpu", "--new-tokens", "2",
                        "--decode-repeats", "4", "--decode-batches", "1", "--decode-processes", "--decode-profile",
                        "--decode-cpus", str(cpu), "--tasks", "decode:tiny:llama+kvffn+kvffn_no_bias:eager")
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "models_bench.json").read_text())
    assert data["errors"] == [] and [row["arch"] for row in data["decode"]] == ["llama", "kvffn", "kvffn_no_bias"]
    assert all(row["own_process"] and len(row["round_median_ms_per_step"]) == 4 for row in data["decode"])
    assert all(row["cpu"] == cpu for row in data["decode"])
    llama, kvffn = data["decode"][:2]
    assert llama["round_paired_ratio"] == 1.0 and llama["p10_ms_per_step"] <= llama["ms_per_step"]
    assert {row["round_paired_baseline"] for row in data["decode"]} == {"llama"}
    low, high = kvffn["round_paired_ratio_quartiles"]
    assert low <= kvffn["round_paired_ratio"] <= high
    assert f"KVFFN, own process, CPU {cpu}" in (tmp_path / "models_bench.md").read_text()
    # --decode-profile: each model's tables, taken in its own process after the timed rounds
    profiles = {name: data["profile"][name] for name in data["profile"]}
    assert set(profiles) == {f"decode_tiny_{arch}_eager_b1_in_task" for arch in ("llama", "kvffn", "kvffn_no_bias")}
    assert all(table["kernel_us_per_step"] > 0 for table in profiles.values())


def test_model_benchmark_decodes_another_package_beside_this_one(tmp_path):
    """`--other-package DIR`: a decode task's `<arch>@other` model is built from DIR's hf_memffn, in a process of its
    own, and takes turns with this checkout's models; `<arch>_plain_launch` decodes too."""
    other = tmp_path / "other"
    shutil.copytree(os.path.join(ROOT, "hf_memffn"), other / "hf_memffn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "imported_from"
    with open(other / "hf_memffn" / "__init__.py", "a", encoding="utf-8") as handle:
        handle.write(f"\nopen({str(marker)!r}, 'a').write(__file__ + '\\n')\n")
    result = run_script("bench_models.py", "--out", str(tmp_path / "out"), "--device", "cpu", "--new-tokens", "2",
                        "--decode-repeats", "2", "--decode-batches", "1", "--decode-processes",
                        "--other-package", str(other), "--tasks",
                        "decode:tiny:llama+kvffn+kvffn@other+kvffn_plain_launch:eager")
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "models_bench.json").read_text())
    assert data["errors"] == []
    assert [row["arch"] for row in data["decode"]] == ["llama", "kvffn", "kvffn@other", "kvffn_plain_launch"]
    assert marker.read_text().splitlines() == [str(other / "hf_memffn" / "__init__.py")]  # that one process alone
    assert "KVFFN, the other package, own process" in (tmp_path / "out" / "models_bench.md").read_text()
    refused = run_script("bench_models.py", "--out", str(tmp_path / "refused"), "--device", "cpu",
                         "--tasks", "decode:tiny:llama+kvffn@other:eager")
    assert "needs --decode-processes and --other-package" in refused.stderr


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


def test_decode_cpus_are_a_cpu_list_and_need_decoding_processes(tmp_path):
    """`--decode-cpus` reads Linux CPU lists and refuses to run without `--decode-processes` (nothing to pin)."""
    bench_models = kernel_script("bench_models")
    assert bench_models.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert bench_models.decode_cpus(None) is None and bench_models.decode_cpus("2,5") == [2, 5]
    with pytest.raises(ValueError, match="--decode-cpus='fast'"):
        bench_models.decode_cpus("fast")
    result = run_script("bench_models.py", "--out", str(tmp_path), "--device", "cpu", "--decode-cpus", "0",
                        "--tasks", "decode:tiny:llama:eager")
    assert result.returncode == 2 and "needs --decode-processes" in result.stderr
    assert not (tmp_path / "models_bench.json").exists()


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


def test_decode_host_profile_runs_each_model_in_its_own_process(tmp_path):
    """`profile_decode_host.py`: the host time of a static-cache step, each model (and the variant whose forward
    rebuilds its signature) measured in a process of its own."""
    result = run_script("profile_decode_host.py", "--out", str(tmp_path), "--size", "tiny", "--rounds", "1",
                        "--calls", "1", "--new-tokens", "3", "--archs", "llama", "kvffn", "--rebuilt-signature")
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "decode_host.json").read_text())
    assert list(data["rounds"]) == ["llama", "kvffn", "kvffn:rebuilt_signature"]
    assert all(len(rounds) == 1 and rounds[0] > 0 for rounds in data["rounds"].values())
    assert data["parameters"]["kvffn"] > data["parameters"]["llama"]  # (its biases)
    assert data["graph_inputs"]["kvffn"][0] - data["graph_inputs"]["llama"][0] == (
        data["parameters"]["kvffn"] - data["parameters"]["llama"])  # (one compiled graph; each parameter an input)
    # dynamo's guard check of the compiled forward, timed alone on a recorded step's inputs (which must pass it)
    assert all(len(times) == 1 and 0 < times[0] < 1e5 for times in data["guard_check_us"].values())
    markdown = (tmp_path / "decode_host.md").read_text()
    assert "host us per step" in markdown and "guard check" in markdown


@pytest.mark.slow
def test_layer_kernels_compile_for_hopper():
    """Ahead-of-time compilation for sm_90 (Triton's bundled ptxas, no GPU): lowering errors and launches that would
    not fit in shared memory fail here rather than on the GPU; and no kernel keeps anything in local memory (a spill
    would show there), under Triton 3.6 and 3.9 alike (`kernels/flash_mhf_notes.md`, v29)."""
    pytest.importorskip("triton")
    result = run_script("compile_check.py", "--quick")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 failure(s)" in result.stdout
    kernels = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(kernels) > 50
    spilling = [line for line in kernels if not re.search(r", \d+ registers, 0 bytes local$", line)]
    assert not spilling, spilling


def test_spill_instructions_are_placed_by_the_loops_that_issue_products():
    """`ptxas_report.hot_loop_spills` on made-up listings: a hot loop is one that issues HGMMA and holds no smaller
    such loop, nor straddles a shorter one; a spill inside it counts, one before or after it (or in a loop without
    products) does not."""
    ptxas_report = kernel_script("ptxas_report")
    sass = """
        /*0000*/   STL [R1], R3 ;
    .L_x_1:
        /*0010*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
    .L_x_2:
        /*0020*/   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8], R5 ;
        /*0030*/   @!P0 BRA `(.L_x_2) ;
        /*0040*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR6], R24 ;
        /*0050*/   @P1 STL [R1+0x4], R24 ;
        /*0060*/   @P2 BRA `(.L_x_1) ;
    .L_x_3:
        /*0070*/   LDL R5, [R1+0x8] ;
        /*0080*/   @P3 BRA `(.L_x_3) ;
        /*0090*/   LDL.LU R3, [R1] ;
        /*00a0*/   EXIT ;
    """
    assert ptxas_report.hot_loop_spills(sass) == {"hot_loops": 1, "spill_instructions_in_hot_loops": 1,
                                                  "spill_instructions_elsewhere": 3}
    # warp-specialised code: two partitions' product loops one after the other, and a longer backward branch that
    # straddles the second loop's end (how the partitions are laid out) with a spill of the epilogue in its range
    sass = """
    .L_x_1:
        /*0010*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/   @P0 BRA `(.L_x_1) ;
        /*0030*/   STL [R1], R3 ;
    .L_x_2:
        /*0040*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
    .L_x_3:
        /*0050*/   LDL R5, [R1] ;
        /*0060*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR6], R24 ;
        /*0070*/   @P1 BRA `(.L_x_2) ;
        /*0080*/   LDL.LU R3, [R1] ;
        /*0090*/   NOP ;
        /*00a0*/   NOP ;
        /*00b0*/   @P2 BRA `(.L_x_3) ;
        /*00c0*/   EXIT ;
    """
    assert ptxas_report.hot_loop_spills(sass) == {"hot_loops": 2, "spill_instructions_in_hot_loops": 1,
                                                  "spill_instructions_elsewhere": 2}


def test_token_lookup_format_sweep_on_the_cpu(tmp_path):
    """`bench_token_lookup.py --formats` runs without a GPU: every format's size, table error and loss change, in a
    JSON that names the device and versions and a markdown table (both written whole through the harness)."""
    result = run_script("bench_token_lookup.py", "--formats", "--layers", "4", "--hidden", "64", "--heads", "2",
                        "--kv-heads", "1", "--intermediate", "128", "--vocab", "500", "--out", str(tmp_path),
                        hide_gpus=True)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "token_lookup_formats.json").read_text())
    assert data["device"] == "CPU" and data["torch"] == torch.__version__
    formats = {row["format"]: row for row in data["formats"]}
    assert formats["fp32"]["max_relative_error"] == 0.0 and formats["fp32"]["loss_delta"] == 0.0
    assert formats["int4"]["size_bytes"] < formats["int8"]["size_bytes"] < formats["bf16"]["size_bytes"]
    assert formats["bf16 drop_layers=[1]"]["max_relative_error"] == 1.0  # a dropped layer counts as error 1
    assert "| int8 |" in (tmp_path / "token_lookup_formats.md").read_text()
    assert not list(tmp_path.glob("*.tmp*"))


def test_ptxas_report_of_the_gluon_kernels(tmp_path):
    """`ptxas_report.py` compiles the Gluon kernels for sm_90 on the CPU and assembles them as Triton does: the
    weight, row and forward kernels keep the loops that issue their products free of spills (spills there made the
    weight kernel's other schedules slower, notes v20-v23). Outside those loops a lowering may keep a few values in
    local memory: Triton 3.7 and 3.8 keep one value of the dq/dr kernel's there, computed before its column loop for
    dq's store after it (4 bytes: one store and one load per program), as 3.6 does in the norm/gate backward (notes
    v29, v32). It compiles them without a launch's pointer-alignment specialisation: at a launch's, Triton 3.9 spilled in
    the forward (notes v30, `compare_triton_builds.py`). A kernel of another package copy is named by its folder,
    with module settings."""
    from hf_memffn import flash_mhf_gluon

    if not flash_mhf_gluon.GLUON_AVAILABLE:
        pytest.skip(f"no Gluon API: {flash_mhf_gluon.GLUON_IMPORT_ERROR}")
    other = tmp_path / "other"
    (other / "hf_memffn").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "hf_memffn", "flash_mhf_gluon.py"), other / "hf_memffn")
    kernels = ["weights", "rows", "forward", f"{other}:add_forward_splits:FORWARD_STAGES=2"]
    result = run_script("ptxas_report.py", "--out", str(tmp_path), "--stem", "report", "--kernels", *kernels)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    (ptxas,) = data["ptxas"]
    rows = {row["kernel"]: row["by_ptxas"][ptxas["label"]] for row in data["kernels"]}
    assert list(rows) == ["weights", "rows", "forward", "other:add_forward_splits FORWARD_STAGES=2"]
    for name in ("weights", "rows", "forward"):
        row = rows[name]
        assert row["registers"] <= 255 and not row["wgmma_serialised"], (name, row)
        assert row["hot_loops"] >= 1 and row["spill_instructions_in_hot_loops"] == 0, (name, row)
        assert max(row["spill_store_bytes"], row["spill_load_bytes"]) <= 16, (name, row)
    assert "| weights |" in (tmp_path / "report.md").read_text()
    result = run_script("ptxas_report.py", "--out", str(tmp_path), "--kernels", f"{other}:forward:NO_SUCH=1")
    assert result.returncode != 0 and "has no setting NO_SUCH" in result.stderr


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
    result = run_script("compare_host_time.py", str(work), "2", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "out" / "host_time.json").read_text())
    assert data["device"] == "GPU X"
    assert data["parts_host_us"]["triton_forward"] == {"before": [100.0, 200.0], "after": [80.0, 160.0]}
    markdown = (tmp_path / "out" / "host_time.md").read_text()
    assert "| triton_forward | 100.0 / 200.0 | 80.0 / 160.0 | 0.80 |" in markdown
    assert "(200 calls back to back, no synchronisation between them)" in markdown
    assert "| 370M flash_mhf batch 1 | 80.0 / 80.0 | 64.0 / 64.0 | 0.80 |" in markdown


def test_inference_kernels_compile_once_whatever_the_number_of_tokens(tmp_path):
    """`compare_specialisation.py --compile-only` compiles, for an H100 on the CPU, a decoding step's kernels at 1, 2
    and 16 tokens, the layer's inference forward at 100, 128, 2048, 3000, 2500, 4800, 4096 and 4097 tokens and its
    training step at two lengths, with the package's kernels and with their inference builds specialised on every
    argument (Triton's default). Inference compiles each kernel once, at its first call, whatever the number of tokens
    (a continuous-batching step or a prompt of a new length compiles nothing more); the autotuned forward is tuned
    once per size class (3000 tokens: the configurations benchmarked again, none compiled again; 2500, the same
    class: nothing). The specialised builds compile again for sizes that are 1, a multiple of 16, or neither.
    Training launches the kernels as they are, specialised (its shapes are fixed), in both sets alike. The arguments
    that bound a mask along a contiguous dimension stay specialised."""
    pytest.importorskip("triton")
    result = run_script("compare_specialisation.py", "--compile-only", "--out", str(tmp_path), hide_gpus=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "specialisation.json").read_text())
    package, specialised = report["compilations"]["package"], report["compilations"]["specialised"]
    assert list(package) == ["decode 1", "decode 2", "decode 16", "forward 100", "forward 128", "forward 2048",
                             "forward 3000", "forward 2500", "forward 4800", "forward 4096", "forward 4097",
                             "train 2 x 496", "train 2 x 500"]
    # 100 tokens: the Triton forward (too few rows for the Gluon one); 2048: the autotuned Triton forward, each of
    # its configurations compiled as the autotuner benchmarks it; 4800: the Gluon forward with no row block split,
    # which compiles the splits' sum too, for the first prompt whose last round is split (4096)
    first_calls = ["decode 1", "forward 100", "forward 2048", "forward 4800"]
    assert "_add_forward_splits_any_size" in package["forward 4800"]
    # every kernel a call launches for the first time was compiled by that call: the splits' sum, compiled ahead at
    # 4800 tokens, is loaded there too, not at the first split prompt (4096), where loading it would stop serving
    loaded = report["loaded"]["package"]
    assert "_add_forward_splits_any_size" in loaded["forward 4800"] and not loaded["forward 4096"], loaded
    assert all(set(loaded[call]) <= set(package[call]) for call in package), (loaded, package)
    tuned = report["tuned"]["package"]
    assert tuned["forward 2048"] == tuned["forward 3000"] == package["forward 2048"]["_forward_any_size"] > 1
    assert not any(configs for call, configs in tuned.items() if call not in ("forward 2048", "forward 3000")), tuned
    for call in [name for name in package if not name.startswith("train")]:
        assert all(count == 1 for count in package[call].values()) or call == "forward 2048", (call, package[call])
        assert bool(package[call]) == (call in first_calls), (call, package[call])
    assert {"_decode_kernel", "_rms_norm_forward_any_size", "_rotary_any_size", "_queries_and_gates_any_size",
            "_warp_specialised_forward_any_size", "_forward_any_size"} <= {
        name for call in first_calls for name in package[call]}
    assert specialised["decode 2"] and specialised["forward 128"] and specialised["forward 4097"]
    assert package["train 2 x 496"] == specialised["train 2 x 496"] and "_queries_and_gates_kernel" in package[
        "train 2 x 496"]
    assert package["train 2 x 500"] == specialised["train 2 x 500"]  # training's kernels specialise in both sets
    unspecialised = report["unspecialised"]
    assert unspecialised["_decode_kernel"] == ["num_tokens", "blocks_per_split"]
    assert unspecialised["_split_sum_kernel"] == ["num_splits"]  # num_elements bounds the contiguous mask
    assert not any(name.startswith("stride") or name in ("num_cols", "num_elements", "hidden_size")
                   for names in unspecialised.values() for name in names)
    assert "Compilations in all" in (tmp_path / "specialisation.md").read_text()


def test_inference_tuning_comparison_needs_a_gpu(tmp_path):
    """`compare_inference_tuning.py` times the autotuned Triton forward, which runs on CUDA only: without a GPU it
    says so and writes nothing."""
    result = run_script("compare_inference_tuning.py", "--out", str(tmp_path), hide_gpus=True)
    assert result.returncode == 1 and "needs a CUDA GPU" in result.stderr
    assert not list(tmp_path.iterdir())


def test_triton_build_export_compiles_what_a_launch_compiles(tmp_path, monkeypatch):
    """`compare_triton_builds.py export` runs a decoding case on CPU tensors under a stand-in for Triton's CUDA driver:
    the installed Triton compiles the kernels a launch of that case compiles (the decode kernel and the splits' sum),
    and the manifest gives each one's cubin, launch metadata, PTX parameters and code digest. The launches ask for
    floating-point fusion themselves (`triton_launch.COMPILE_OPTIONS`), so Triton 3.9 does not warn that its default
    will change. A build whose metadata differs only by keys that a newer Triton adds with false values launches the
    same way; one whose PTX parameters differ does not."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    builds = kernel_script("compare_triton_builds")
    result = run_script("compare_triton_builds.py", "export", "--out", str(tmp_path), "--cases", "decode:370M:1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entries = manifest["cases"]["decode:370M:1"]
    assert [entry["function"] for entry in entries] == ["_decode_kernel", "_split_sum_kernel"]
    for entry in entries:
        assert (tmp_path / entry["cubin"]).stat().st_size > 1000
        assert entry["metadata"]["target"]["arch"] == 90 and entry["metadata"]["num_warps"] == 4
        assert entry["metadata"]["enable_fp_fusion"] is True
        assert entry["ptx_parameters"] and all(p.startswith(".param") for p in entry["ptx_parameters"])
    assert not list(tmp_path.glob("*.tmp*"))
    assert "TRITON_DEFAULT_FP_FUSION" not in result.stderr
    old = [{"swizzle": 3, "block_size": [64, 64]}]
    assert builds.same_launch_value(old, [{"swizzle": 3, "block_size": [64, 64], "is_im2col": False}])
    assert not builds.same_launch_value(old, [{"swizzle": 3, "block_size": [64, 64], "is_im2col": True}])
    assert not builds.same_launch_value(old, [{"swizzle": 2, "block_size": [64, 64]}])
    ptx = (".version 8.7\n.file 1 \"/a/flash_mhf_gluon.py\"\n.entry k(\n"
           "\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1\n)\n{\n\t.loc 1 10 5\n\tret;\n}\n")
    assert builds.ptx_parameters(ptx) == [".param .u64 .ptr .global .align 1", ".param .u32"]
    assert builds.code_digest(ptx) == builds.code_digest(ptx.replace("/a/", "/elsewhere/").replace("10 5", "12 1"))
    assert builds.code_digest(ptx) != builds.code_digest(ptx.replace("ret;", "exit;"))


def test_gluon_kernels_keep_spills_out_of_their_product_loops_at_their_launch(tmp_path):
    """The Gluon forward, dq/dr (with the layer's norm/gate backward) and weight kernels, compiled by the installed
    Triton for exactly what a 1.3B training step launches (`compare_triton_builds.py export`: the launch's pointer
    alignment and integer specialisation, which `compile_for_hopper` leaves out): no spill instruction in the loops
    that issue their products (under Triton 3.9 the forward once reloaded a spilled value there every iteration,
    notes v30). The same for the weight kernel of a 370M step, which splits its last round's tiles into row ranges
    and so also launches the kernel that adds up their shares (at 1.3B it splits none)."""
    from hf_memffn import flash_mhf_gluon

    if not flash_mhf_gluon.GLUON_AVAILABLE:
        pytest.skip(f"no Gluon API: {flash_mhf_gluon.GLUON_IMPORT_ERROR}")
    ptxas_report = kernel_script("ptxas_report")
    result = run_script("compare_triton_builds.py", "export", "--out", str(tmp_path), "--cases", "forward_op:1.3B",
                        "backward:1.3B", "backward:370M")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    cubins = {case: {entry["function"]: entry["cubin"] for entry in entries}
              for case, entries in manifest["cases"].items()}
    assert "_add_weight_splits_kernel" in cubins["backward:370M"]
    assert "_add_weight_splits_kernel" not in cubins["backward:1.3B"]
    for case, function, loops in (("forward_op:1.3B", "_warp_specialised_forward_kernel", 3),
                                  ("backward:1.3B", "_rows_gradients_kernel", 2),
                                  ("backward:1.3B", "_weight_gradients_kernel", 1),
                                  ("backward:370M", "_weight_gradients_kernel", 1)):
        listing = subprocess.run([ptxas_report.tritons_nvdisasm(), "-c", str(tmp_path / cubins[case][function])],
                                 capture_output=True, text=True)
        assert listing.returncode == 0, listing.stderr[-2000:]
        where = ptxas_report.hot_loop_spills(listing.stdout)
        assert where["hot_loops"] == loops and where["spill_instructions_in_hot_loops"] == 0, (case, function, where)


def test_stand_in_driver_loads_each_kernel_once_and_unloads_them_after(monkeypatch):
    """Under `compare_triton_builds.compiling_for_hopper`, a compiled kernel builds its launcher at its first launch
    only (its module and function are the stand-in's handle, not None, so host timings on the CPU do not count
    Triton's launcher set-up on every launch); when the block ends, every kernel it loaded, those `triton_launch`
    keeps among them, loads again at its next launch, from the driver then active (a GPU's, where there is one)."""
    from hf_memffn import flash_mhf_gluon, triton_launch

    if not flash_mhf_gluon.GLUON_AVAILABLE:
        pytest.skip(f"no Gluon API: {flash_mhf_gluon.GLUON_IMPORT_ERROR}")
    builds = kernel_script("compare_triton_builds")
    launchers = []

    def counting_launcher(self, src, metadata):
        launchers.append(metadata.name)
        return lambda *args: None

    monkeypatch.setattr(builds.StandInHopper, "launcher_cls", counting_launcher)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with builds.compiling_for_hopper():
        triton_launch.CACHED = True
        builds.forget_compiled()
        case = builds.Case("forward:370M", "cpu")
        case.run()
        first = len(launchers)
        for _ in range(3):
            case.run()
        assert first >= 2 and len(launchers) == first, launchers
        kept = [entry[0] for entry in triton_launch._compiled.values()]
        compiled = [kernel for _, kernel in builds.compiled_kernels(0)]
        assert kept and all(kernel.module is builds.STAND_IN_HANDLE for kernel in kept + compiled)
    assert triton_launch.CACHED  # (put back as it was before the block)
    assert all(kernel.module is None and kernel._run is None for kernel in kept + compiled)
    builds.forget_compiled()


def _launcher_argument(value):
    """A launcher argument as the comparison below sees it: a tensor or a descriptor's base by dtype, shape and
    strides (the second call allocates its outputs anew), a descriptor by every other field, the rest as it is."""
    if isinstance(value, torch.Tensor):
        return "tensor", value.dtype, tuple(value.shape), value.stride()
    if hasattr(value, "block_shape") and hasattr(value, "base"):
        return ("descriptor", _launcher_argument(value.base),
                *((name, field) for name, field in sorted(vars(value).items()) if name != "base"))
    return value


def test_kept_launches_pass_the_launcher_what_tritons_launch_passes(monkeypatch):
    """The FlashMHF layer on CPU tensors under a stand-in for Triton's CUDA driver
    (`compare_triton_builds.compiling_for_hopper`): training's forward and backward at the 370M preset's shape (the
    three Gluon kernels, the two splits' sums, the norm/gate kernels), inference's forward at 200 tokens (the Triton
    forward's build for any size, its fixed configuration) and 2048 (its autotuned configuration), and a training step
    of 2 x 496 tokens (the Triton backward kernels). After a first call of each (which compiles and tunes) and with
    the kept kernels forgotten, the next call launches each kernel through Triton (`JITFunction.run`), the one after
    launches none through it (`triton_launch.launch` launches the kept compiled kernels), and Triton's launcher
    receives the same arguments from both, in the same order (descriptors included)."""
    from hf_memffn import flash_mhf_gluon, flash_mhf_op, triton_launch

    if not flash_mhf_gluon.GLUON_AVAILABLE:
        pytest.skip(f"no Gluon API: {flash_mhf_gluon.GLUON_IMPORT_ERROR}")
    from triton.runtime.jit import JITFunction

    builds = kernel_script("compare_triton_builds")
    launched, through_triton = [], []

    def recording_launcher(self, src, metadata):
        def launcher(grid_x, grid_y, grid_z, stream, function, packed, launch_metadata, enter, exit_, *args):
            launched.append((metadata.name, (grid_x, grid_y, grid_z), [_launcher_argument(a) for a in args]))
        return launcher

    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: through_triton.append(self.__name__) or run(
        self, *a, **k))
    monkeypatch.setattr(builds.StandInHopper, "launcher_cls", recording_launcher)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    settings = (builds.HEAD_DIM, builds.EPS, builds.GATE_EPS)

    def inference(tokens):
        p, norm, router, (weights,), _ = builds.layer_inputs("370M", "cpu", tokens)
        return lambda: flash_mhf_op._layer_forward_impl(p, norm, router, weights, *settings)

    def training_step(batch, length):
        p, norm, router, (weights,), grad = builds.layer_inputs("370M", "cpu", batch * length)
        p, grad = p.view(batch, length, -1), grad.view(batch, length, -1)

        def step():
            saved = flash_mhf_op._layer_forward_keeping_queries(p, norm, router, weights, *settings)
            flash_mhf_op._layer_backward_impl(grad, p, norm, router, weights, *settings, saved=saved[1:])
        return step

    with builds.compiling_for_hopper():  # (which switches the kept launches off, and puts them back after)
        triton_launch.CACHED = True
        builds.forget_compiled()
        calls = [builds.Case(name, "cpu").run for name in ("forward:370M", "backward:370M")]
        calls += [inference(200), inference(2048), training_step(2, 496)]
        for call in calls:
            call()
        triton_launch.clear()
        compiled = len(builds.compiled_kernels(0))
        recorded = []
        for _ in range(2):
            launched.clear(), through_triton.clear()
            for call in calls:
                call()
            recorded.append((list(launched), list(through_triton)))
        # nothing compiled again: the launches through Triton found what the first calls compiled (the autotuned
        # forward's picked configuration too, its options passed in the autotuner's order)
        assert len(builds.compiled_kernels(0)) == compiled
        builds.forget_compiled()
    (first, first_through_triton), (second, second_through_triton) = recorded
    names = [name for name, _, _ in first]
    assert {"_warp_specialised_forward_kernel", "_add_forward_splits_kernel", "_rows_gradients_kernel",
            "_weight_gradients_kernel", "_add_weight_splits_kernel", "_queries_and_gates_kernel",
            "_gate_gradient_sums_kernel", "_forward_kernel", "_backward_rows_kernel",
            "_backward_weights_kernel"} <= set(names), names
    # every kernel went through Triton in the first of the two calls (a launch of inference's build for any size may
    # already find the compiled kernel that an earlier launch of another size kept: its sizes are not in the key)
    assert set(first_through_triton) == set(names) and not second_through_triton, second_through_triton
    assert second == first


def test_launch_host_times_every_piece_on_the_cpu(tmp_path):
    """`launch_host_cpu.py` (no GPU): each piece of the layer's launches timed under the stand-in driver, both ways,
    written as a table and JSON; the kept launches are switched back on afterwards."""
    from hf_memffn import flash_mhf_gluon, triton_launch

    if not flash_mhf_gluon.GLUON_AVAILABLE:
        pytest.skip(f"no Gluon API: {flash_mhf_gluon.GLUON_IMPORT_ERROR}")
    results = kernel_script("launch_host_cpu").main(["--out", str(tmp_path), "--number", "2", "--repeat", "1"])
    assert [row["what"] for row in results["rows"]][:4] == [
        "layer training forward, kept launches", "layer training forward, Triton's launch on every call",
        "layer backward, kept launches", "layer backward, Triton's launch on every call"]
    assert len(results["rows"]) == 9 and all(row["us_per_call"] > 0 for row in results["rows"])
    assert triton_launch.CACHED
    assert "compiled[grid]" in (tmp_path / "launch_host_cpu.md").read_text()


def test_dq_reduction_adds_every_share_on_the_cpu(tmp_path):
    """`bench_dq_reduction.py --device cpu` (Triton's interpreter, no GPU): the element atomics add every column
    block's share, the plain stores leave one of them; nothing is timed and the report says so."""
    env = {**os.environ, "PYTHONPATH": SCRIPT_PYTHONPATH, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, os.path.join(KERNELS, "bench_dq_reduction.py"), "--out", str(tmp_path),
                             "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "dq_reduction.json").read_text())
    checks = {row["way"]: row for row in results["checks"]}
    assert checks["element atomics"]["values"] == [6.0] and checks["element atomics"]["ok"]
    assert set(checks["plain stores"]["values"]) <= {1.0, 2.0, 3.0}
    assert results["reductions"] == [] and "nothing was timed" in (tmp_path / "dq_reduction.md").read_text()
    # bad input: the field and what it allows
    refused = subprocess.run([sys.executable, os.path.join(KERNELS, "bench_dq_reduction.py"), "--out", str(tmp_path),
                              "--device", "cpu", "--presets", "7B"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert refused.returncode == 2 and "--presets: ['7B'] unknown; allowed: 370M, 1.3B" in refused.stderr


def test_dq_reduction_report_rebuilds_the_committed_table():
    """The committed H100 table (whose one-kernel columns came from the weight kernel's experiment at 65fa0a7) is what
    the script's report makes of the committed JSON."""
    results_dir = os.path.join(KERNELS, "results", "gluon")
    with open(os.path.join(results_dir, "h100_dq_reduction_one_kernel.json"), encoding="utf-8") as handle:
        results = json.load(handle)
    with open(os.path.join(results_dir, "h100_dq_reduction_one_kernel.md"), encoding="utf-8") as handle:
        assert kernel_script("bench_dq_reduction").report(results) == handle.read()
