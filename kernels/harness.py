"""What every benchmark and profiling script in `kernels/` shares: timing, clock sampling, peak memory, the device's
name and the result files.

Timings are medians: `bench_ms` (triton.testing.do_bench: L2 flushed between calls), `graph_ms` (CUDA-graph replay,
for launch-bound decoding shapes) and `cuda_ms` (CUDA events around a callable, for whole training steps that are
too long to repeat hundreds of times). Results are written atomically: a temporary name, then a rename.
"""

from __future__ import annotations

import cProfile
import gc
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import threading
import time
import weakref

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if ROOT not in sys.path:  # the scripts run from a checkout: `python kernels/<script>.py`
    sys.path.insert(0, ROOT)

GIB = 1024**3
# Where the measurements run: None follows torch (CUDA where it sees a GPU); `measure_on("cpu")` makes a script's CPU
# smoke run time wall-clock and name the CPU on a machine that has a GPU too.
_measured_device_type: str | None = None


def measure_on(device: str) -> None:
    """Time, synchronise, read peak memory and name the device as for `device` ("cuda", "cuda:N" or "cpu").
    "cuda:N" makes GPU N the current device: do_bench's events, the synchronisations, the peak memory and the
    device's name all follow the current device, not the one a tensor is on."""
    global _measured_device_type
    try:
        parsed = torch.device(device)
    except RuntimeError:  # not a torch device at all
        parsed = None
    if parsed is None or parsed.type not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} is not supported; allowed: cuda, cuda:N, cpu")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(f"device={device!r}: no CUDA device is visible; allowed here: cpu")
        if parsed.index is not None:
            if parsed.index >= count:
                raise ValueError(f"device={device!r}: {count} CUDA device(s) visible; allowed: cuda:0 to "
                                 f"cuda:{count - 1}, cpu")
            torch.cuda.set_device(parsed.index)
    _measured_device_type = parsed.type


def on_cuda() -> bool:
    """Whether the measurements run on a CUDA device (see `measure_on`)."""
    return _measured_device_type != "cpu" and torch.cuda.is_available()


def log(*parts) -> None:
    print(*parts, flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench_ms(fn, grad_to_none=None, warmup: int = 50, rep: int = 300) -> float:
    if not on_cuda():  # CPU smoke runs of the scripts: wall-clock median of a few calls
        return median(wall_ms(fn, 3))
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def graph_ms(fn, rep: int = 200) -> float | None:
    """Median time of `fn` replayed from a CUDA graph, over about `rep` ms of replays (None without CUDA)."""
    if not on_cuda():
        return None
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def wall_ms(fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def cuda_ms(fn, steps: int, warmup: int = 2) -> list[float]:
    """Times of `steps` calls of `fn` (after `warmup` calls), each between two CUDA events, in ms (wall-clock times
    without CUDA)."""
    for _ in range(warmup):
        fn()
    if not on_cuda():
        return wall_ms(fn, steps)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def host_issue_ms(fn, steps: int) -> list[float]:
    """The host's time to return from each of `steps` calls of `fn`, each started on an idle GPU: how long the host
    takes to issue the work. Where `fn` launches more kernels than the launch queue holds (about a thousand), the host
    also waits for the GPU once the queue is full, so a host time near the step's time alone does not show that the
    host bounds the step; how the step's time scales with its work does."""
    times = []
    for _ in range(steps):
        synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    synchronize()
    return times


def back_to_back_us(fn, calls: int) -> float:
    """Microseconds per call of `calls` calls of `fn` issued without synchronising, from an idle GPU: the host's time
    to issue one call where each is little GPU work (a call of more launches than the launch queue holds over those
    calls reads the GPU's rate instead)."""
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    synchronize()
    return elapsed / calls * 1e6


def synchronize() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    if on_cuda():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float | None:
    """Peak CUDA memory allocated since the last `reset_peak_memory` (None without CUDA)."""
    return torch.cuda.max_memory_allocated() / GIB if on_cuda() else None


def refuse_counts_below(parser, args, **least: int) -> None:
    """`parser.error` for the first option (`name=least`, its dest) whose value, or any of its values, is under
    `least`: counts a measurement cannot run with (no round, no step), refused before any work."""
    for name, minimum in least.items():
        value = getattr(args, name)
        if min(value if isinstance(value, list) else [value]) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be at least {minimum}, got {value}")


def output_folder(text: str) -> str:
    """The argparse type of `--out`: a folder to write the results into, existing or not yet (a file is refused
    before any work, not met at the first write after a measurement); the package's own check."""
    from hf_memffn.cli_args import output_dir

    return output_dir(text)


def median(values) -> float:
    return float(statistics.median(values))


class TritonCompilations:
    """Records the Triton kernels compiled (or loaded from Triton's disk cache) while active, with the seconds each
    took, through Triton's JIT hooks (`triton.knobs.runtime`, Triton 3.6 to 3.9): the cache hook runs before a
    kernel missing from the in-memory cache is built, the post-compile hook after. A kernel is named by its function,
    or by ``names`` ({kernel: name}) where that holds it (two builds of one function). It also records each
    configuration an autotuner benchmarks (``Autotuner._bench``, the same in Triton 3.6 to 3.9), with the seconds it
    took: a tuning key met for the first time stops the caller for the benchmark of every configuration. And it
    records each compiled kernel's first launch ("loaded"; `CompiledKernel._init_handles`, the same in Triton 3.6 to
    3.9), which loads its module onto the device and builds the launcher of its argument list: Triton compiles that
    launcher from C source with the host's compiler unless its disk cache holds it, a few tenths of a second, so a
    kernel compiled ahead (``JITFunction.warmup``) but first launched while serving stops that step. Without Triton
    it records nothing."""

    # the compiled kernels whose first launch a record has seen, in this process (a stand-in driver loads no module,
    # so that a kernel is not counted again by the next record)
    _first_launched: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, names: dict | None = None):
        self.events: list[tuple[str, float]] = []
        self.tunings: list[tuple[str, float]] = []  # (kernel, seconds) per configuration benchmarked
        self.loads: list[tuple[str, float]] = []  # (kernel, seconds) per first launch of a compiled kernel
        self.names = names or {}
        self._started: dict = {}
        self._saved = None
        self._saved_bench = self._saved_init = None

    def _before(self, *_, **kwargs):
        self._started[kwargs.get("key")] = time.perf_counter()
        return None  # a true value would tell Triton to skip the compilation

    def _name(self, function, fallback: str = "?") -> str:
        return self.names.get(getattr(function, "jit_function", function)) or getattr(function, "name", None) \
            or getattr(getattr(function, "fn", None), "__name__", None) or fallback

    def _after(self, *_, **kwargs):
        start = self._started.pop(kwargs.get("key"), None)
        name = self._name(kwargs.get("fn"), str(kwargs.get("repr", "?")).split("[")[0])
        self.events.append((name, time.perf_counter() - start if start is not None else float("nan")))
        return None

    def __enter__(self):
        try:
            from triton import knobs
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.autotuner import Autotuner
        except ImportError:
            return self
        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        self._saved_bench = bench = Autotuner._bench
        record = self

        def timed_bench(autotuner, *args, **kwargs):
            start = time.perf_counter()
            try:
                return bench(autotuner, *args, **kwargs)
            finally:
                record.tunings.append((record._name(autotuner.fn), time.perf_counter() - start))

        Autotuner._bench = timed_bench
        self._saved_init = init_handles = CompiledKernel._init_handles

        def timed_init(kernel):
            # a first initialisation: no module loaded yet
            if getattr(kernel, "module", None) is not None or kernel in TritonCompilations._first_launched:
                return init_handles(kernel)
            TritonCompilations._first_launched.add(kernel)
            start = time.perf_counter()
            try:
                return init_handles(kernel)
            finally:
                function = getattr(getattr(kernel, "src", None), "fn", None)  # the JIT function it was compiled from
                name = record.names.get(function) or getattr(function, "__name__", None) or getattr(kernel, "name", "?")
                record.loads.append((name, time.perf_counter() - start))

        CompiledKernel._init_handles = timed_init
        return self

    def __exit__(self, *_):
        if self._saved is not None:
            from triton import knobs
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.autotuner import Autotuner

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
            Autotuner._bench = self._saved_bench
            CompiledKernel._init_handles = self._saved_init
            self._saved = self._saved_bench = self._saved_init = None

    def summary(self) -> dict:
        """{"count", "seconds", "kernels": {name: compilations}, "tuned": {"configs", "seconds", "kernels"},
        "loaded": {"count", "seconds", "kernels"}}: the compilations, the configurations benchmarked by autotuners
        (their seconds include the compilations of the configurations not yet built), and the first launches."""
        kernels: dict[str, int] = {}
        for name, _ in self.events:
            kernels[name] = kernels.get(name, 0) + 1
        tuned: dict[str, int] = {}
        for name, _ in self.tunings:
            tuned[name] = tuned.get(name, 0) + 1
        loaded: dict[str, int] = {}
        for name, _ in self.loads:
            loaded[name] = loaded.get(name, 0) + 1
        return {"count": len(self.events), "seconds": sum(seconds for _, seconds in self.events), "kernels": kernels,
                "tuned": {"configs": len(self.tunings), "seconds": sum(seconds for _, seconds in self.tunings),
                          "kernels": tuned},
                "loaded": {"count": len(self.loads), "seconds": sum(seconds for _, seconds in self.loads),
                           "kernels": loaded}}


class GcPauses:
    """The pauses of Python's garbage collector while in a `with` block (``gc.callbacks``): how many, per
    generation, and the longest. A full collection of a process holding many objects (a model, compiled kernels)
    stops every Python thread for a noticeable time."""

    def __init__(self):
        self.pauses: list[tuple[int, float, float]] = []  # (generation, seconds, start on the host clock)
        self._start = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.pauses.append((info.get("generation", -1), time.perf_counter() - self._start, self._start))
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_):
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        longest = max(self.pauses, key=lambda pause: pause[1], default=(None, 0.0, None))
        return {"count": len(self.pauses), "seconds": sum(seconds for _, seconds, _ in self.pauses),
                "per_generation": {g: sum(1 for gen, _, _ in self.pauses if gen == g) for g in (0, 1, 2)},
                "longest_s": longest[1], "longest_generation": longest[0]}


# The caching allocator's counters that `ForwardSteps` reads around a synchronised step: blocks obtained from and
# returned to the device (cudaMalloc / cudaFree), and the retries after a failed cudaMalloc, each of which frees the
# cached blocks and synchronises the device.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_counters() -> dict:
    """`ALLOCATOR_COUNTERS` of the current CUDA device (zeros without CUDA, or where this torch lacks a counter)."""
    stats = torch.cuda.memory_stats() if on_cuda() else {}
    return {name: stats.get(name, 0) for name in ALLOCATOR_COUNTERS}


def device_memory() -> dict:
    """GiB allocated and reserved by torch's caching allocator, and free on the device (None without CUDA)."""
    if not on_cuda():
        return {"allocated_gib": None, "reserved_gib": None, "free_gib": None}
    return {"allocated_gib": torch.cuda.memory_allocated() / GIB, "reserved_gib": torch.cuda.memory_reserved() / GIB,
            "free_gib": torch.cuda.mem_get_info()[0] / GIB}


PROFILE_FUNCTIONS = 25  # functions kept from a profiled step, by their own time and by time including callees


def costliest_functions(profiler: cProfile.Profile, count: int = PROFILE_FUNCTIONS) -> dict:
    """A cProfile run's ``count`` costliest functions by their own time ("own") and by their time with what they
    called ("cumulative"), each as [file:line(function), calls, own seconds, cumulative seconds], and the total."""
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own, cumulative, callers)}
    rows = [[f"{os.path.basename(file)}:{line}({name})", calls, own, cumulative]
            for (file, line, name), (_, calls, own, cumulative, _) in stats.items()]
    return {"total_s": sum(row[2] for row in rows),
            "own": sorted(rows, key=lambda row: -row[2])[:count],
            "cumulative": sorted(rows, key=lambda row: -row[3])[:count]}


class ForwardSteps:
    """The forward calls of a module while in a `with` block: each call's number of tokens (its ``input_ids``'
    elements, or ``inputs_embeds``' but the last dimension) and its start on the host clock. The time from one start
    to the next is a whole step of a serving loop: the forward's launches, what the loop does between steps, and the
    wait for the GPU where the loop reads the step's outputs. ``seen`` (shared between recorders) holds the token
    counts met before, so a summary can say which ones this block met first.

    With ``synchronised_steps`` = N, the first N calls are taken apart: the device is synchronised before the call
    starts and again when it returns, so a call's time splits into its host part (until ``forward`` returns, the
    launches) and the device's remainder (the wait at the second synchronisation), and the caching allocator's
    counters (`ALLOCATOR_COUNTERS`) are read on both sides. That changes those steps' timing (nothing overlaps them),
    so a benchmark asks for it only where it looks into a step. Calls made while a CUDA graph is being captured are
    recorded but not synchronised. The first ``profiled_steps`` of them also run their host part under cProfile, in
    the thread that calls the module (a serving loop's own), and keep its `PROFILE_FUNCTIONS` costliest functions."""

    def __init__(self, module: torch.nn.Module, seen: set | None = None, synchronised_steps: int = 0,
                 profiled_steps: int = 0):
        if synchronised_steps < 0:
            raise ValueError(f"synchronised_steps={synchronised_steps} must be 0 or more")
        if not 0 <= profiled_steps <= synchronised_steps:
            raise ValueError(f"profiled_steps={profiled_steps} must be from 0 to synchronised_steps="
                             f"{synchronised_steps}")
        self.module, self.seen = module, seen if seen is not None else set()
        self.synchronised_steps, self.profiled_steps = synchronised_steps, profiled_steps
        self._profiler = None
        self.steps: list[tuple[float, int]] = []  # (start, tokens)
        self.details: list[dict] = []  # the synchronised steps, in order
        self._handles, self._open = [], None  # the allocator counters before a synchronised call in progress

    def _hook(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        tokens = ids.numel() if ids is not None else (embeds[..., 0].numel() if embeds is not None else 0)
        if len(self.steps) < self.synchronised_steps and not (on_cuda() and torch.cuda.is_current_stream_capturing()):
            synchronize()
            self._open = allocator_counters()
            if len(self.details) < self.profiled_steps:
                self._profiler = cProfile.Profile()
                self._profiler.enable()
        self.steps.append((time.perf_counter(), tokens))

    def _post_hook(self, _module, _args, _kwargs, _output) -> None:
        if self._open is None:
            return
        returned = time.perf_counter()
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.disable()
        synchronize()
        finished = time.perf_counter()
        start, tokens = self.steps[-1]
        after = allocator_counters()
        self.details.append({"step": len(self.steps) - 1, "tokens": tokens, "host_s": returned - start,
                             "device_wait_s": finished - returned,
                             **{name: after[name] - self._open[name] for name in ALLOCATOR_COUNTERS}})
        if profiler is not None:
            self.details[-1]["profile"] = costliest_functions(profiler)
        self._open = None

    def __enter__(self):
        self._handles = [self.module.register_forward_pre_hook(self._hook, with_kwargs=True),
                         self.module.register_forward_hook(self._post_hook, with_kwargs=True)]
        return self

    def __exit__(self, *_):
        for handle in self._handles:
            handle.remove()
        if self._profiler is not None:  # a call that raised
            self._profiler.disable()
        self._handles, self._open, self._profiler = [], None, None

    def summary(self, slowest: int = 5, gc_pauses: GcPauses | None = None) -> dict:
        """Steps, the distinct token counts, those not met before this block (and now added to ``seen``), and the
        ``slowest`` steps as [seconds, tokens, first time this token count was met, seconds of garbage collection
        that started within the step (with ``gc_pauses``, else None)]. The last step has no next one to end it
        (what follows it is the loop's shutdown), so it has no time. With synchronised steps, ``synchronised``
        lists them: each one's host part, the device's remainder and the allocator counters' increase."""
        steps, first_met = [], set()
        for index, (start, tokens) in enumerate(self.steps):
            new = tokens not in self.seen and tokens not in first_met
            if new:
                first_met.add(tokens)
            if index + 1 < len(self.steps):
                end = self.steps[index + 1][0]
                collected = None if gc_pauses is None else sum(
                    seconds for _, seconds, begun in gc_pauses.pauses if start <= begun < end)
                steps.append((end - start, tokens, new, collected))
        self.seen.update(first_met)
        longest = sorted(steps, key=lambda step: -step[0])[:slowest]
        summary = {"steps": len(self.steps), "token_counts": len({tokens for _, tokens in self.steps}),
                   "first_met": sorted(first_met), "seconds_in_first_met": sum(s for s, _, new, _ in steps if new),
                   "slowest": [list(step) for step in longest]}
        if self.synchronised_steps:
            summary["synchronised"] = [
                dict(detail, step_s=steps[detail["step"]][0] if detail["step"] < len(steps) else None)
                for detail in self.details]
        return summary


def nvidia_smi_id() -> str:
    """The current CUDA device as `nvidia-smi -i` names it: its entry of CUDA_VISIBLE_DEVICES where that is set
    (nvidia-smi does not read it, so index 0 of a process that sees only GPU 3 is GPU 0 to nvidia-smi)."""
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


class ClockSampler:
    """SM clock (MHz) and board power (W) from `nvidia-smi` every 50 ms while in a `with` block: an H100 at its power
    limit changes its clock by 15% within seconds, so timings record the clock they ran at."""

    def __init__(self):
        self.available = shutil.which("nvidia-smi") is not None and on_cuda()

    def __enter__(self):
        self.samples, self.stop = [], threading.Event()
        if self.available:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            line = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                   "-i", nvidia_smi_id()], capture_output=True, text=True).stdout
            try:
                clock, power = (float(x) for x in line.strip().split(","))
                self.samples.append((clock, power))
            except ValueError:
                pass
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.stop.set()
        if self.available:
            self.thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"sm_clock_mhz": None, "power_w": None, "samples": 0}
        clocks, powers = zip(*self.samples)
        return {"sm_clock_mhz": median(clocks), "sm_clock_min_mhz": min(clocks), "power_w": median(powers),
                "samples": len(clocks)}


def timed(fn, grad_to_none=None) -> dict:
    """`bench_ms` with the SM clock and power sampled while it runs."""
    with ClockSampler() as sampler:
        ms = bench_ms(fn, grad_to_none=grad_to_none)
    return {"ms": ms, **sampler.summary()}


def peak_memory(fn, leaves=(), held=()) -> dict:
    """Peak memory of one call of `fn`: what it allocates at its peak, plus the bytes of `leaves` (parameters and
    inputs; their stale gradients are cleared first) and `held` (the incoming gradient). Other tensors on the device
    are not counted."""
    for tensor in leaves:
        tensor.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - before
    own = sum(t.numel() * t.element_size() for t in (*leaves, *held))
    for tensor in leaves:
        tensor.grad = None
    return {"peak_gib": (above + own) / GIB, "peak_above_inputs_gib": above / GIB}


def cpu_name() -> str:
    """The processor's model name and core count, as the device of a measurement on the CPU (`platform.processor()`
    gives the architecture, "x86_64", or nothing at all on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'unknown processor'}, {os.cpu_count()} cores"


def environment() -> dict:
    """The device and the versions a result was measured with."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.cuda.get_device_name() if on_cuda() else cpu_name()
    return {"device": device, "torch": torch.__version__, "triton": triton_version,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary name (`hf_memffn.atomic_write`), so a reader never sees half a
    file and a write that fails leaves nothing beside the results."""
    from hf_memffn.atomic_write import write_atomic

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, text)


def save_figure(figure, path: str, dpi: int = 110) -> None:
    """A matplotlib figure saved to `path` through a temporary name (`hf_memffn.atomic_write`), in the format its
    suffix names: a plot that fails or is interrupted while being written leaves neither half an image nor a
    temporary file beside the results."""
    from hf_memffn.atomic_write import atomic_output

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_output(path) as temporary:  # (its name ends in ".tmp": the format is given, not guessed from it)
        figure.savefig(temporary, format=os.path.splitext(path)[1].lstrip(".") or "png", dpi=dpi)


def write_json(path: str, data) -> None:
    """`data` as strict JSON at `path`: a number that is not finite (a diverged or failed measurement) is written as
    `null` and named under `not_finite` (`hf_memffn.run_records`), not as the `NaN` or `Infinity` that strict readers
    refuse; other objects as their `str`. `read_json` reads it back."""
    from hf_memffn.run_records import run_record_json

    write_text(path, run_record_json(data, indent=1, default=str) + "\n")


def read_json(path: str):
    """A file of `write_json`, each number that is not finite a float again (NaN, or an infinity)."""
    from hf_memffn.run_records import read_run_record

    with open(path, encoding="utf-8") as handle:
        return read_run_record(handle.read())


def write_report(out: str, stem: str, results: dict, text: str) -> None:
    """A measurement's results as `<out>/<stem>.json` and its table as `<out>/<stem>.md`, and the table printed."""
    write_json(os.path.join(out, f"{stem}.json"), results)
    write_text(os.path.join(out, f"{stem}.md"), text)
    log(text)


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("-" if cell is None else str(cell) for cell in row) + " |" for row in rows]
    return lines
