"""Where the host's time goes in a compiled training step, FlashMHFLlama beside transformers' Llama (one GPU call).

    PYTHONPATH=. python kernels/profile_compiled_step_host.py --out DIR [--size 370M] [--batch 1]
                                                              # DIR/compiled_step_host.{json,md}

At small batches a compiled training step is bound by the host: the GPU waits while Python issues the step's ~1,300
kernels. For each model (`--archs`, default Llama given sdpa's causal flag and FlashMHFLlama), after compiling
(`torch.compile`, default mode) and warming up:

1. the step's time (CUDA events) and the host's time to issue it from an idle GPU, in `--rounds` rounds;
2. the same with Python's garbage collector frozen after the warm-up (`gc.freeze()`), and the collector's own time
   per step (`gc.callbacks`);
3. for FlashMHFLlama, the same compiled graph with the fused layer's two operators doing no work (their
   implementations swapped for functions that only allocate the outputs), alternating with the real ones round by
   round: the difference is what the layer's launchers cost the step in place, to set against the launchers timed
   alone at the same shape (`_layer_forward_impl` and `_layer_backward_impl` called directly, per layer);
4. a cProfile of a few steps (Python functions by own and cumulative time) and the torch profiler's host operators
   by self and by total CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402
from bench_models import DISPLAY, VOCAB_SIZE, build_model, release  # noqa: E402
from harness import (  # noqa: E402
    cuda_ms,
    environment,
    host_issue_ms,
    log,
    markdown_table,
    measure_on,
    median,
    output_folder,
    refuse_counts_below,
    synchronize,
    write_json,
    write_report,
)
from profile_flash_mhf_host import host_profile  # noqa: E402

STEPS = 8  # steps per timing round


class CollectorClock:
    """Time spent in Python's garbage collector while in a `with` block, by generation."""

    def __enter__(self):
        self.seconds, self.collections, self._start = [0.0, 0.0, 0.0], [0, 0, 0], None
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def timing_round(step, steps: int) -> dict:
    with CollectorClock() as collector:
        host = host_issue_ms(step, steps)
    return {"step_ms": median(cuda_ms(step, steps, warmup=1)), "host_ms": median(host),
            "gc_ms_per_step": sum(collector.seconds) / steps * 1e3,
            "gc_collections_per_step": [c / steps for c in collector.collections]}


@contextlib.contextmanager
def layer_ops_doing_nothing():
    """The fused FlashMHF layer's operators allocate their outputs and launch nothing (the compiled graph calls the
    module-level implementations at run time, so no recompilation): inference's forward, training's forward (which
    keeps q, r and the gates' totals) and the backward."""
    from hf_memffn import flash_mhf_op

    def forward(p, norm_weight, router, weights, head_dim, eps, gate_eps):
        return torch.empty_like(p)

    def forward_keeping_queries(p, norm_weight, router, weights, head_dim, eps, gate_eps, totals=True):
        batch, length, width = p.shape
        gates = p.new_empty(batch, width // head_dim, length, weights.shape[1], dtype=torch.float32)
        kept = gates.new_empty(gates.shape[:-1]) if totals and router is not None else None
        return torch.empty_like(p), torch.empty_like(p), gates, kept

    def backward(grad_out, p, norm_weight, router, weights, head_dim, eps, gate_eps, saved=None):
        optional = [None if t is None else torch.empty_like(t) for t in (norm_weight, router)]
        return (torch.empty_like(p), *optional, torch.empty_like(weights))

    names = ("_layer_forward_impl", "_layer_forward_keeping_queries", "_layer_backward_impl")
    saved = [getattr(flash_mhf_op, name) for name in names]
    for name, stand_in in zip(names, (forward, forward_keeping_queries, backward)):
        setattr(flash_mhf_op, name, stand_in)
    try:
        yield
    finally:
        for name, function in zip(names, saved):
            setattr(flash_mhf_op, name, function)


def fused_layers(model) -> list:
    from hf_memffn.ffn_multihead import FlashMHFFeedForward

    return [m for m in model.modules() if isinstance(m, FlashMHFFeedForward)]


def launchers_alone(module, batch: int, steps: int) -> dict:
    """Host and GPU microseconds of one layer's forward and backward launchers at the step's shape, called directly."""
    from hf_memffn import flash_mhf_op

    width = module.num_heads * module.head_dim
    p = torch.randn(batch, bench_models.SEQ_LEN, width, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(p)
    norm_weight = None if module.query_norm is None else module.query_norm.weight.detach()
    router = None if module.router is None else module.router.detach()
    eps = getattr(module.query_norm, "variance_epsilon", 1e-6)  # (no norm: eps is not read)
    args = (norm_weight, router, module.key_up_value.detach(), module.head_dim, eps, module.gate_eps)
    out = {}
    for name, fn in (("forward", lambda: flash_mhf_op._layer_forward_impl(p, *args)),
                     ("backward", lambda: flash_mhf_op._layer_backward_impl(grad, p, *args))):
        for _ in range(3):
            fn()
        out[f"{name}_host_us"] = median(host_issue_ms(fn, steps * 4)) * 1e3
        out[f"{name}_gpu_us"] = median(cuda_ms(fn, steps)) * 1e3
    return out


def torch_profiler_tables(step, steps: int, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        synchronize()
    events = prof.key_averages()

    def table(key):
        ranked = sorted(events, key=lambda e: -getattr(e, key))[:top]
        return [(e.key[:110], e.count / steps, getattr(e, key) / steps) for e in ranked]

    return {"self_cpu_us_per_step": table("self_cpu_time_total"), "total_cpu_us_per_step": table("cpu_time_total")}


def measure(architecture: str, size: str, batch: int, rounds: int, steps: int, profile_steps: int,
            device: str = "cuda") -> dict:
    model = build_model(architecture, size, device)
    model.train()
    ids = torch.randint(3, VOCAB_SIZE, (batch, bench_models.SEQ_LEN), device=device)
    step = bench_models.training_step(model, ids, "compiled")
    start = time.perf_counter()
    step()
    synchronize()
    result = {"arch": architecture, "name": DISPLAY.get(architecture, architecture), "size": size, "batch": batch,
              "layers": model.config.num_hidden_layers, "first_step_s": time.perf_counter() - start}
    for _ in range(2):
        step()
    layers = fused_layers(model)
    variants = {"real": contextlib.nullcontext}
    if layers:
        variants["layer ops doing nothing"] = layer_ops_doing_nothing
    rows = {name: [] for name in variants}
    for _ in range(rounds):
        for name, context in variants.items():
            with context():
                step()
                rows[name].append(timing_round(step, steps))
    gc.collect()
    gc.freeze()
    try:
        rows["gc frozen"] = [timing_round(step, steps) for _ in range(rounds)]
    finally:
        gc.unfreeze()
    result["rounds"] = rows
    result["summary"] = {name: {key: median(r[key] for r in runs) for key in ("step_ms", "host_ms", "gc_ms_per_step")}
                         for name, runs in rows.items()}
    if layers and device == "cuda":
        result["launchers_alone"] = launchers_alone(layers[0], batch, steps)
    for name, line in result["summary"].items():
        log(f"{architecture} {name}: step {line['step_ms']:.1f} ms, host {line['host_ms']:.1f} ms, "
            f"gc {line['gc_ms_per_step']:.2f} ms")
    if profile_steps:
        cprofile = host_profile(step, profile_steps, top=40)
        result["cprofile"] = {"host_ms_per_step": cprofile["host_ms_per_step"], "by_own_time": cprofile["by_own_time"],
                              "text": cprofile["text"]}
        log(cprofile["text"]["tottime"])
        result["torch_profiler"] = torch_profiler_tables(step, profile_steps)
    model = step = None  # (the step closure holds the compiled model)
    release()
    return result


def report(results: dict) -> str:
    env = results["environment"]
    lines = [f"# Host time of a compiled training step, {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
             f"{results['args']['size']}, {results['args']['batch']} x {bench_models.SEQ_LEN} tokens, "
             "`torch.compile` default mode, "
             f"medians over {results['args']['rounds']} rounds of {results['args']['steps']} steps.", ""]
    rows = []
    for model in results["models"]:
        for name, line in model["summary"].items():
            rows.append([model["name"], name, f"{line['step_ms']:.1f}", f"{line['host_ms']:.1f}",
                         f"{line['host_ms'] / model['layers']:.2f}", f"{line['gc_ms_per_step']:.2f}"])
    lines += markdown_table(["model", "variant", "step ms", "host ms", "host ms per layer", "GC ms per step"], rows)
    for model in results["models"]:
        alone = model.get("launchers_alone")
        if alone:
            per_step = (alone["forward_host_us"] + alone["backward_host_us"]) * model["layers"] / 1e3
            lines += ["", f"{model['name']}: the layer's launchers called directly at this shape: forward host "
                          f"{alone['forward_host_us']:.0f} us (GPU {alone['forward_gpu_us']:.0f}), backward host "
                          f"{alone['backward_host_us']:.0f} us (GPU {alone['backward_gpu_us']:.0f}); "
                          f"{per_step:.1f} ms of host time per step over {model['layers']} layers."]
    for model in results["models"]:
        if "cprofile" not in model:
            continue
        lines += ["", f"## {model['name']}: Python functions by own time (cProfile, per step)", ""]
        lines += markdown_table(["function", "calls", "own us", "cumulative us"],
                                [[r["function"], f"{r['calls_per_step']:.0f}", f"{r['own_us_per_step']:.0f}",
                                  f"{r['cumulative_us_per_step']:.0f}"] for r in model["cprofile"]["by_own_time"]])
        lines += ["", f"## {model['name']}: host operators by total CPU time (torch profiler, per step)", ""]
        lines += markdown_table(["operator", "calls", "total CPU us"],
                                [[name, f"{calls:.0f}", f"{us:.0f}"]
                                 for name, calls, us in model["torch_profiler"]["total_cpu_us_per_step"]])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--size", default="370M")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--archs", nargs="+", default=["llama_causal_flag", "flash_mhf"], choices=bench_models.ARCHS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per timing round")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps under each profiler (0: no profiles)")
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (the fused layer does not run)")
    args = parser.parse_args(argv)
    refuse_counts_below(parser, args, batch=1, rounds=1, steps=1, profile_steps=0)
    try:
        bench_models.get_preset(args.size)
    except ValueError as error:
        parser.error(f"--size: {error}")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: this profiles the host side of a compiled step's GPU launches")
    measure_on("cpu" if args.cpu else "cuda")  # (--cpu: timed and named as the CPU on a machine with a GPU too)
    results = {"environment": environment(), "args": vars(args), "models": []}
    for architecture in args.archs:
        results["models"].append(measure(architecture, args.size, args.batch, args.rounds, args.steps,
                                         args.profile_steps, "cpu" if args.cpu else "cuda"))
        write_json(os.path.join(args.out, "compiled_step_host.json"), results)
    write_report(args.out, "compiled_step_host", results, report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
