"""The FlashMHF layer's kernels as another Triton version builds them, timed on a GPU that has one Triton installed.

    python kernels/compare_triton_builds.py export --out BUILD [--label NAME]        # any machine, no GPU needed
    python kernels/compare_triton_builds.py time --builds BUILD [BUILD ...] --out DIR [--stem NAME]   # on the GPU

A user gets the Triton that their torch brings: PyPI's CUDA builds of torch pin Triton 3.6.0 (torch 2.11), 3.7.0
(2.12), 3.7.1 (2.13), 3.8.0 (2.14) and 3.9 (2.15). What changes from one version to the next is the compiled kernel
(the lowering, and the ptxas that assembles it), not how it is launched.
So the kernels can be built where a Triton is installed and timed, as cubins, on a GPU that has another one.

``export`` runs the layer's cases (`CASES`: the training forward and backward at the 370M and 1.3B presets' layer
shapes, the op's Gluon forward and weight-gradient kernels alone, decoding at 1 and 16 tokens; with ``--package``
another commit's weight-kernel schedules) on CPU tensors. A stand-in for Triton's CUDA driver reports an sm_90 GPU with
132 multiprocessors and launches nothing. So the installed Triton compiles every kernel for exactly the
specialisation that a real launch of these shapes gets (pointer alignment, integer values, constexprs), and BUILD/
receives each kernel's cubin, its launch metadata, its PTX parameter list and a digest of its PTX, case by case, with
the Triton version and its ptxas. ``TRITON_PTXAS_PATH`` (Triton 3.6) or ``TRITON_PTXAS_BLACKWELL_PATH`` (3.9) picks
another ptxas, as for any build.

``time`` runs the same cases on the GPU with the installed Triton. Then it loads each build's cubins into the
installed Triton's compiled kernels, whose launchers stay. A kernel is swapped only where its PTX parameters and
its launch metadata (shared memory aside) equal the installed build's: otherwise the case is reported as not
comparable. For each build it checks the case's outputs against the installed build's (relative error, and whether
they are equal to the bit), then times every case with each build in turn, over alternating rounds. A build
exported by the GPU's own Triton has the same PTX as the GPU compiles (the report says so for each kernel): that
checks the export, and its timings against the installed build's show how far apart two runs of the same code fall.
With ``--rounds 0`` nothing is timed: each build's kernels run once, in order, for a profiler (notes v30 has the
Nsight Compute command).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import torch  # noqa: E402
import triton  # noqa: E402

from harness import (  # noqa: E402
    bench_ms, environment, graph_ms, log, markdown_table, median, output_folder, refuse_counts_below, rel_err,
    write_json, write_report,
)

from ptxas_report import load_gluon_module, ptxas_release, tritons_ptxas  # noqa: E402

from hf_memffn import (  # noqa: E402
    flash_mhf_gluon, flash_mhf_layer_triton, flash_mhf_op, flash_mhf_triton, triton_launch,
)

EPS, GATE_EPS = 1e-5, 1e-6
HEAD_DIM = 128
MULTIPROCESSORS = 132  # an H100 SXM's, which the stand-in driver reports
L2_BYTES = 50 * 1024**2
# (preset, tokens of a training step, heads, sub-networks, sub-network width): the presets' FlashMHF layers
LAYERS = {"370M": (8 * 2048, 8, 7, 384), "1.3B": (4 * 2048, 16, 15, 384)}
# forward / backward: the layer's, as training runs them; forward_op / weights: the op's Gluon forward and weight
# gradient kernels alone, on the layer's queries and gates
CASES = [f"{role}:{preset}" for preset in LAYERS for role in ("forward", "backward", "forward_op", "weights")]
CASES += [f"decode:{preset}:{batch}" for preset in LAYERS for batch in (1, 16)]
# with --package OLD (a folder holding another commit's hf_memffn/flash_mhf_gluon.py): its Gluon forward alone, and
# (4bcb1fb's) its weight kernel's warp-specialised schedule with three or two buffers
# (`gluon_weight_gradients(schedule=..., buffers=...)`)
OLD_CASES = [f"old_forward_op:{preset}" for preset in LAYERS]
OLD_CASES += [f"old_weights_ws{buffers}:{preset}" for preset in LAYERS for buffers in (3, 2)]
# what must agree between two builds of a kernel for one's cubin to run under the other's launcher
LAUNCH_METADATA = ("num_warps", "num_ctas", "cluster_dims", "global_scratch_size", "global_scratch_align",
                   "profile_scratch_size", "profile_scratch_align", "launch_cooperative_grid", "launch_pdl",
                   "tensordesc_meta", "name")
KERNEL_MODULES = [flash_mhf_gluon, flash_mhf_triton, flash_mhf_layer_triton]  # --package adds the other's


def load_package(directory: str):
    """``DIRECTORY/hf_memffn/flash_mhf_gluon.py`` as a module of its own, its kernels added to those `jit_functions`
    finds."""
    module = load_gluon_module(directory, {})
    KERNEL_MODULES.append(module)
    return module


# --- the cases ----------------------------------------------------------------------------------------------------

def layer_inputs(preset: str, device, tokens: int | None = None, copies: int = 1, seed: int = 0):
    """(p, norm weight, router, [weights] * copies, grad_out), bf16 as in a bf16 model; p is one sequence of a
    training step's tokens [1, tokens, H * d_h], or for decoding (``tokens`` <= 64) one new token of each of
    ``tokens`` sequences [tokens, 1, H * d_h]."""
    train_tokens, heads, num_subnetworks, subnetwork_size = LAYERS[preset]
    tokens = tokens or train_tokens
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=torch.bfloat16)

    p = randn(tokens, 1, heads * HEAD_DIM) if tokens <= 64 else randn(1, tokens, heads * HEAD_DIM)
    norm = 1 + randn(HEAD_DIM, scale=0.2)
    router = randn(heads, HEAD_DIM, num_subnetworks, scale=HEAD_DIM**-0.5)
    weights = [randn(3 * heads, num_subnetworks, subnetwork_size, HEAD_DIM, scale=HEAD_DIM**-0.5)
               for _ in range(copies)]
    return p, norm, router, weights, randn(*p.shape)


class Case:
    """One case: its inputs on ``device``, ``run()`` (the layer's kernels as production calls them, returning their
    outputs) and ``timed()`` (what is timed: ``run`` for training, one decoding call per weight copy, enough copies to
    read them from HBM as a decoding step does, for decoding)."""

    def __init__(self, name: str, device, package=None):
        self.name, self.package = name, package
        role, preset, *batch = name.split(":")
        self.role, self.preset = role, preset
        if role.startswith("old_") and package is None:
            raise SystemExit(f"case {name}: needs --package")
        if role == "decode":
            weight_bytes = 3 * LAYERS[preset][1] * LAYERS[preset][2] * LAYERS[preset][3] * HEAD_DIM * 2
            copies = -(-3 * L2_BYTES // weight_bytes) if str(device).startswith("cuda") else 1
            self.p, self.norm, self.router, self.weights, _ = layer_inputs(preset, device, int(batch[0]), copies)
            return
        self.p, self.norm, self.router, self.weights, self.grad_out = layer_inputs(preset, device)
        if role != "forward":  # what the training forward keeps for the backward
            self.saved = self.forward()[1:]
        if role not in ("forward", "backward"):  # the op's inputs as the layer hands them to its kernels
            batch_size, length, width = self.p.shape

            def heads(t):
                return t.view(batch_size, length, width // HEAD_DIM, HEAD_DIM).transpose(1, 2)

            self.op_inputs = (heads(self.grad_out), heads(self.saved[0]), *self.weights[0].chunk(3), self.saved[1])

    def forward(self):
        return flash_mhf_op._layer_forward_keeping_queries(self.p, self.norm, self.router, self.weights[0], HEAD_DIM,
                                                           EPS, GATE_EPS)

    def run(self):
        if self.role == "forward_op":
            return flash_mhf_gluon.gluon_forward(*self.op_inputs[1:])[:1]
        if self.role == "weights":
            return flash_mhf_gluon.gluon_weight_gradients(*self.op_inputs)[:3]
        if self.role == "old_forward_op":
            return self.package.gluon_forward(*self.op_inputs[1:])[:1]
        if self.role.startswith("old_weights_ws"):
            buffers = int(self.role[len("old_weights_ws"):])
            return self.package.gluon_weight_gradients(*self.op_inputs, schedule="warp_specialised",
                                                       buffers=buffers)[:3]
        if self.role == "forward":
            return [t for t in self.forward() if t is not None]
        if self.role == "backward":
            return [t for t in flash_mhf_op._layer_backward_impl(self.grad_out, self.p, self.norm, self.router,
                                                                 self.weights[0], HEAD_DIM, EPS, GATE_EPS,
                                                                 saved=self.saved) if t is not None]
        return [flash_mhf_op._layer_forward_impl(self.p, self.norm, self.router, self.weights[0], HEAD_DIM, EPS,
                                                 GATE_EPS)]

    def timed(self):
        if self.role != "decode":
            return self.run()
        for weights in self.weights:
            flash_mhf_op._layer_forward_impl(self.p, self.norm, self.router, weights, HEAD_DIM, EPS, GATE_EPS)


# --- the kernels a case compiles ----------------------------------------------------------------------------------

def jit_functions(modules=None) -> dict:
    """{kernel: its name in its module} of every Triton and Gluon kernel of the layer's modules (or of ``modules``);
    an autotuner's kernel under the autotuner's name."""
    found = {}
    for module in KERNEL_MODULES if modules is None else modules:
        for name, value in vars(module).items():
            for fn in (value, getattr(value, "fn", None)):  # a kernel, or an autotuner's
                if isinstance(fn, triton.runtime.jit.JITFunction):
                    found.setdefault(fn, name)
    return found


def autotuners(modules=None) -> list:
    """The autotuners of the layer's modules (or of ``modules``)."""
    return [value for module in (KERNEL_MODULES if modules is None else modules) for value in vars(module).values()
            if isinstance(value, triton.runtime.autotuner.Autotuner)]


def forget_compiled(modules=None) -> None:
    """Empties every kernel's compiled-kernel cache (and the launch shortcuts that keep compiled kernels, the
    autotuners' picks, and the record of the splits' sum compiled for inference), so that what a case compiles and
    tunes is what it runs."""
    for fn in jit_functions(modules):
        fn.device_caches.clear()
    for autotuner in autotuners(modules):
        autotuner.cache.clear()
    triton_launch.clear()
    flash_mhf_triton._PICKED.clear()
    flash_mhf_gluon._ADD_SPLITS_COMPILED.clear()


def compiled_kernels(device_key) -> list[tuple[str, object]]:
    """(function name, compiled kernel) of everything compiled since `forget_compiled`, in compile order per
    function."""
    kernels = []
    for fn in jit_functions():
        if device_key in fn.device_caches:
            kernels += [(fn.__name__, compiled) for compiled in fn.device_caches[device_key][0].values()]
    return kernels


def ptx_parameters(ptx: str) -> list[str]:
    """The kernel's parameter declarations, without their names: what the launcher must pass."""
    entry = re.search(r"\.entry\s+\S+\s*\((.*?)\)", ptx, re.S)
    if entry is None:
        raise RuntimeError("no .entry in the PTX")
    return [re.sub(r"\s+\S+_param_\d+", "", line.strip().rstrip(",")) for line in entry.group(1).splitlines()
            if line.strip()]


def code_digest(ptx: str) -> str:
    """A hash of the kernel's PTX without its source locations (``.loc``, ``.file`` and the debug sections, which
    name the source file's path): equal for two builds of the same code from different folders. A cubin's bytes
    are not, as its line table holds the path."""
    ptx = re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\s*\}", "", ptx, flags=re.S)
    lines = [line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file", "//"))]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def metadata_of(compiled) -> dict:
    return json.loads(json.dumps(compiled.metadata._asdict(), default=lambda o: getattr(o, "__dict__", str(o))))


def ptxas_in_use() -> str:
    path = tritons_ptxas()
    return f"{path} ({ptxas_release(path)})"


# --- export: compile on a machine without a GPU -------------------------------------------------------------------

STAND_IN_HANDLE = "stand-in: nothing loaded"  # the module and function a kernel "loads" under `StandInHopper`


class StandInHopper:
    """What Triton asks of its CUDA driver while it specialises and compiles, answered for an sm_90 GPU; a launch
    does nothing. A compiled kernel "loads" once (its module and function are `STAND_IN_HANDLE`, not None, so
    Triton does not build its launcher again at every launch) until `compiling_for_hopper` ends."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.utils = types.SimpleNamespace(
            load_binary=lambda name, kernel, shared, device: (STAND_IN_HANDLE, STAND_IN_HANDLE, 0, 0, 1024),
            unload_module=lambda module: None,  # Triton 3.8 and later unload a kernel's module when it is collected
            get_device_properties=lambda device: {"max_shared_mem": 232448, "multiprocessor_count": MULTIPROCESSORS,
                                                  "max_num_regs": 65536, "warpSize": 32},
        )

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None

    def get_benchmarker(self):
        """An autotuner's benchmark: each configuration launched once (compiled, launching nothing), all equally
        fast, so the autotuner keeps the first."""
        def bench(kernel_call, quantiles=None, **kwargs):
            kernel_call()
            return [1.0] * len(quantiles) if quantiles else 1.0

        return bench


@contextlib.contextmanager
def compiling_for_hopper():
    """Within the block, the layer's code takes CPU tensors for an H100's: Triton's driver is `StandInHopper`, and
    the package's questions about the device get an H100's answers."""
    from triton.runtime.driver import driver

    patches = [
        (flash_mhf_triton, "_num_sms", lambda device: MULTIPROCESSORS),
        (flash_mhf_triton, "_capability_of", lambda device: (9, 0)),
        (flash_mhf_layer_triton, "_num_sms", lambda device: MULTIPROCESSORS),
        (flash_mhf_gluon, "multiprocessor_count", lambda device: MULTIPROCESSORS),
        (flash_mhf_gluon, "gluon_reason_for", lambda *args: None),
        (flash_mhf_triton, "gluon_reason_for", lambda *args: None),
        (triton_launch, "CACHED", False),
    ]
    for module in KERNEL_MODULES[3:]:  # another package's
        patches.append((module, "gluon_reason_for", lambda *args: None))
        if hasattr(module, "multiprocessor_count"):
            patches.append((module, "multiprocessor_count", lambda device: MULTIPROCESSORS))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    flash_mhf_triton._kernels_for.cache_clear()
    active = getattr(driver, "_active", None)  # None until something asked for the driver
    driver.set_active(StandInHopper())
    try:
        yield
    finally:
        driver.set_active(active)
        unload_stand_in_handles()
        for module, name, value in saved:
            setattr(module, name, value)
        flash_mhf_triton._kernels_for.cache_clear()
        for autotuner in autotuners():  # an autotuner keeps the benchmarker it first asked the driver for
            vars(autotuner).pop("do_bench", None)


def unload_stand_in_handles() -> None:
    """Every compiled kernel that "loaded" under the stand-in (in a kernel's cache, or kept by `triton_launch`) loads
    again at its next launch, from the driver active then: on a machine with a GPU, the kernel itself."""
    kept = [entry[0] for entry in triton_launch._compiled.values()]
    cached = [compiled for fn in jit_functions() for cache in fn.device_caches.values()
              for compiled in cache[0].values()]
    for compiled in kept + cached:
        if getattr(compiled, "module", None) is STAND_IN_HANDLE:
            compiled.module = compiled.function = compiled._run = None


def export(out: str, label: str | None, cases: list[str], package=None) -> None:
    os.makedirs(out, exist_ok=True)
    manifest = {"label": label or f"triton {triton.__version__}", "triton": triton.__version__,
                "ptxas": ptxas_in_use(), "environment": environment(), "cases": {}}
    with compiling_for_hopper():
        for name in cases:
            case = Case(name, "cpu", package)
            forget_compiled()
            case.run()
            entries = []
            for function, compiled in compiled_kernels(0):
                cubin = compiled.asm["cubin"]
                digest = hashlib.sha256(cubin).hexdigest()[:16]
                path = os.path.join(out, f"{function}-{digest}.cubin")
                if not os.path.exists(path):
                    with open(f"{path}.tmp", "wb") as handle:
                        handle.write(cubin)
                    os.replace(f"{path}.tmp", path)
                entries.append({"function": function, "cubin": os.path.basename(path), "sha256": digest,
                                "metadata": metadata_of(compiled), "code": code_digest(compiled.asm["ptx"]),
                                "ptx_parameters": ptx_parameters(compiled.asm["ptx"])})
            manifest["cases"][name] = entries
            log(f"{name}: {', '.join(e['function'] for e in entries)}")
    write_json(os.path.join(out, "manifest.json"), manifest)
    log(f"{manifest['label']}: {sum(len(v) for v in manifest['cases'].values())} kernels in {out}")


# --- time: on the GPU ---------------------------------------------------------------------------------------------

def same_launch_value(ours, theirs) -> bool:
    """Whether two builds' values of a launch metadata field mean the same launch: equal, where a newer Triton may
    add dictionary keys whose value is false (3.9's ``is_im2col`` of each tensor descriptor)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return all(same_launch_value(ours.get(key), theirs.get(key)) if key in ours and key in theirs
                   else not (ours.get(key) or theirs.get(key)) for key in {*ours, *theirs})
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(map(same_launch_value, ours, theirs))
    return ours == theirs


def comparable(native, entry: dict) -> str | None:
    """Why ``entry`` (a build's kernel) cannot run under ``native``'s launcher, or None when it can."""
    if ptx_parameters(native.asm["ptx"]) != entry["ptx_parameters"]:
        return "PTX parameters differ"
    ours = metadata_of(native)
    differing = [key for key in LAUNCH_METADATA if not same_launch_value(ours.get(key), entry["metadata"].get(key))]
    return f"launch metadata differ: {', '.join(differing)}" if differing else None


@contextlib.contextmanager
def cubins_of(swaps: list):
    """Within the block, each (compiled kernel, cubin bytes, shared memory) of ``swaps`` runs that cubin."""
    from triton.compiler.compiler import make_backend

    saved = []
    for compiled, cubin, shared in swaps:
        saved.append((compiled, compiled.kernel, compiled.metadata, compiled.packed_metadata))
        compiled.kernel = cubin
        compiled.metadata = compiled.metadata._replace(shared=shared)
        compiled.packed_metadata = make_backend(compiled.metadata.target).pack_metadata(compiled.metadata)
        compiled.module = compiled.function = compiled._run = None
    try:
        yield
    finally:
        for compiled, kernel, metadata, packed in saved:
            compiled.kernel, compiled.metadata, compiled.packed_metadata = kernel, metadata, packed
            compiled.module = compiled.function = compiled._run = None


def time_case(name: str, builds: list[dict], rounds: int, package=None) -> dict:
    case = Case(name, "cuda", package)
    forget_compiled()
    expected = [t.clone() for t in case.run()]
    torch.cuda.synchronize()
    native = compiled_kernels(triton.runtime.driver.active.get_current_device())
    result = {"case": name, "kernels": [function for function, _ in native], "builds": {}}
    variants = {"installed": []}
    for build in builds:
        entries = build["manifest"]["cases"].get(name)
        row = result["builds"][build["label"]] = {}
        if entries is None or [e["function"] for e in entries] != result["kernels"]:
            row["error"] = (f"the build compiled {[e['function'] for e in entries or []]}, "
                            f"the installed Triton {result['kernels']}")
            continue
        reasons = [comparable(compiled, entry) for (_, compiled), entry in zip(native, entries)]
        if any(reasons):
            row["error"] = "; ".join(f"{e['function']}: {r}" for e, r in zip(entries, reasons) if r)
            continue
        row["same_code"] = [code_digest(compiled.asm["ptx"]) == e["code"] for (_, compiled), e in zip(native, entries)]
        row["shared_memory"] = [e["metadata"]["shared"] for e in entries]
        swaps = [(compiled, build["cubins"][e["cubin"]], e["metadata"]["shared"])
                 for (_, compiled), e in zip(native, entries)]
        try:
            with cubins_of(swaps):
                outputs = case.run()
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 (a cubin the driver cannot load is a result, not the end)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            continue
        row["rel_err"] = max(rel_err(a, b) for a, b in zip(outputs, expected))
        row["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(outputs, expected))
        variants[build["label"]] = swaps
    result["shared_memory_installed"] = [compiled.metadata.shared for _, compiled in native]
    timer = (lambda fn: graph_ms(fn) * 1e3) if case.role == "decode" else (lambda fn: bench_ms(fn) * 1e3)
    times = {label: [] for label in variants}
    for index in range(rounds):
        order = list(variants)
        order = order[index % len(order):] + order[:index % len(order)]
        for label in order:
            with cubins_of(variants[label]):
                case.timed()  # loads the cubins, outside any graph capture
                torch.cuda.synchronize()
                times[label].append(timer(case.timed))
    result["rounds_us"] = times
    if not rounds:  # (a profiler's run: each build's kernels launched once, by the check above)
        result["us"] = {label: None for label in times}
        return result
    result["us"] = {label: median(values) for label, values in times.items()}
    for label in variants:
        if label != "installed":
            result["builds"][label]["installed_over_build"] = result["us"]["installed"] / result["us"][label]
    log(f"{name}: " + ", ".join(f"{label} {us:.1f} us" for label, us in result["us"].items()))
    return result


def load_build(directory: str) -> dict:
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as handle:
        manifest = json.load(handle)
    cubins = {}
    for entries in manifest["cases"].values():
        for entry in entries:
            if entry["cubin"] not in cubins:
                with open(os.path.join(directory, entry["cubin"]), "rb") as handle:
                    cubins[entry["cubin"]] = handle.read()
    return {"label": manifest["label"], "manifest": manifest, "cubins": cubins}


def fmt_us(us) -> str | None:
    return None if us is None else f"{us:.1f}"


def report(results: dict) -> str:
    labels = [build["label"] for build in results["builds"]]
    lines = [f"# The layer's kernels built by other Tritons, launched by Triton {results['environment']['triton']}",
             "", f"Device: {results['environment']['device']}; torch {results['environment']['torch']}. "
             f"`python kernels/compare_triton_builds.py time` ({results['rounds']} alternating rounds; median us: "
             "do_bench for training, CUDA-graph replay over weight copies that exceed the L2 cache for decoding).", ""]
    for build in results["builds"]:
        lines.append(f"- {build['label']}: Triton {build['triton']}, ptxas {build['ptxas']}")
    lines.append("")
    header = ["case", "kernels", "build", "us", "installed / build", "rel err to installed", "bitwise equal",
              "same PTX as installed", "shared memory"]
    rows = []
    for case in results["cases"]:
        rows.append([case["case"], ", ".join(case["kernels"]), f"installed (Triton {results['environment']['triton']})",
                     fmt_us(case["us"]["installed"]), None, None, None, None,
                     " / ".join(map(str, case["shared_memory_installed"]))])
        for label in labels:
            build = case["builds"][label]
            if "error" in build:
                rows.append(["", "", label, build["error"], None, None, None, None, None])
                continue
            ratio = build.get("installed_over_build")
            rows.append(["", "", label, fmt_us(case["us"][label]), None if ratio is None else f"{ratio:.3f}",
                         f"{build['rel_err']:.1e}", "yes" if build["bitwise_equal"] else "no",
                         " / ".join("yes" if same else "no" for same in build["same_code"]),
                         " / ".join(map(str, build["shared_memory"]))])
    return "\n".join(lines + markdown_table(header, rows)) + "\n"


def time_builds(directories: list[str], out: str, stem: str, cases: list[str], rounds: int,
                package=None) -> None:
    builds = [load_build(d) for d in directories]
    labels = [build["label"] for build in builds]
    # (a build's rows, times and ratios are kept under its label: a second build of that label, or one labelled as
    # the installed Triton's, would replace them)
    clashing = sorted({label for label in labels if labels.count(label) > 1 or label == "installed"})
    if clashing:
        raise SystemExit(f"time: --builds: the label {', '.join(map(repr, clashing))} names more than one build or "
                         "the installed Triton's; allowed: one label per build, not 'installed' (export --label NAME)")
    if not torch.cuda.is_available():
        raise SystemExit("time: needs a CUDA GPU (export runs anywhere)")
    results = {"environment": environment(), "installed_ptxas": ptxas_in_use(), "rounds": rounds,
               "builds": [{"label": b["label"], "triton": b["manifest"]["triton"], "ptxas": b["manifest"]["ptxas"],
                           "directory": d} for b, d in zip(builds, directories)],
               "cases": []}
    for name in cases:
        results["cases"].append(time_case(name, builds, rounds, package))
        write_json(os.path.join(out, f"{stem}.partial.json"), results)  # what a call cut short still returns
    write_report(out, stem, results, report(results))
    os.remove(os.path.join(out, f"{stem}.partial.json"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="compile the cases' kernels for sm_90 with the installed Triton")
    exporting.add_argument("--out", type=output_folder, required=True)
    exporting.add_argument("--label", help="the build's name in reports (default: 'triton VERSION')")
    exporting.add_argument("--cases", nargs="+", choices=CASES + OLD_CASES,
                           help="default: all (with --package, the old_* ones too; old_weights_* need 4bcb1fb's)")
    exporting.add_argument("--package", help="a folder with another commit's hf_memffn/flash_mhf_gluon.py")
    timing = commands.add_parser("time", help="time the cases with the installed Triton and each build's cubins")
    timing.add_argument("--builds", nargs="+", required=True)
    timing.add_argument("--out", type=output_folder, required=True)
    timing.add_argument("--stem", default="triton_builds")
    timing.add_argument("--cases", nargs="+", choices=CASES + OLD_CASES,
                        help="default: all (with --package, the old_* ones too; old_weights_* need 4bcb1fb's)")
    timing.add_argument("--package", help="the folder the builds were exported with --package from")
    timing.add_argument("--rounds", type=int, default=5,
                        help="0: no timing, only the check (each build's kernels launched once, the installed "
                        "Triton's first, then the builds' in the order given: for a profiler such as ncu)")
    args = parser.parse_args(argv)
    if args.command == "time":
        refuse_counts_below(parser, args, rounds=0)
    package = load_package(args.package) if args.package else None
    cases = args.cases or CASES + (OLD_CASES if package else [])
    if args.command == "export":
        export(args.out, args.label, cases, package)
    else:
        time_builds(args.builds, args.out, args.stem, cases, args.rounds, package)
    return 0


if __name__ == "__main__":
    sys.exit(main())
