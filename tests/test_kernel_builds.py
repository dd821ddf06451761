"""The fused layer's kernels as Triton builds them for an H100 (sm_90), on a machine without one: they compile, keep
spills out of the loops that issue their products, compile once for inference whatever the number of tokens, and
build under a stand-in for Triton's CUDA driver exactly what a launch builds; the kept launches pass the launcher what
Triton's launch passes; the host-time and dq-reduction scripts run on the CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from kernel_scripts_support import KERNELS, ROOT, SCRIPT_PYTHONPATH, kernel_script, run_script


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
    with pytest.raises(SystemExit, match="has no setting NO_SUCH"):  # (what the script stops with, in this process)
        kernel_script("ptxas_report").load_gluon_module(str(other), {"NO_SUCH": 1})


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
