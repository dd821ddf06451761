"""Host time of a static-cache decoding step, measured without a GPU.

    python kernels/profile_decode_host.py --out DIR                  # the 370M presets' depth, ~3 min on a CPU
    python kernels/profile_decode_host.py --out DIR --size tiny --rounds 1 --archs llama kvffn   # smoke run

At the 370M preset a compiled static-cache `generate()` step on an H100 is about 1.2 ms of GPU kernels in a
2.3-3 ms step: the rest is host work that the CUDA graph does not hide. This script measures the part of that host
work that comes from the model's Python: each model decodes with `generate()` and a static cache while
`torch.compile` hands the traced graph to a backend that runs it once and then only returns those outputs. What is
left of a step is `generate()`'s own Python, dynamo's guard check and the bytecode around the graph (inductor's
wrapper and the graph launch are not included). The models have the preset's depth and parameter tensors with tiny
widths, since only the host is measured.

Beside the step, each model's row gives what dynamo's guard check alone takes: the inputs of one step are
recorded, and the check of the compiled entry is timed on them (it grows with the module attributes and parameters
that the forward reads).

Each measurement is a process of its own (no compile cache shared between models), and the models take turns over
`--rounds` rounds, so that the host's slow and fast minutes fall on all of them. `--rebuilt-signature` adds rows
where our models' forward has no stored signature, as before it had one: transformers' `generate()` then rebuilds it
through the decorators at every step (it does so for every model with its own code). Writes decode_host.json and
decode_host.md into --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    cpu_name, environment, log, markdown_table, median, output_folder, refuse_counts_below, write_json, write_text,
)
from bench_models import ARCHS, get_preset  # noqa: E402

REBUILT = ":rebuilt_signature"  # a variant's suffix: the forward without its stored signature
TINY_WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
               "head_dim": 16}
FLASH_MHF_WIDTHS = {"intermediate_size": 128, "ffn_num_heads": 2, "ffn_num_subnetworks": 2}


def worker(variant: str, size: str, calls: int, new_tokens: int) -> dict:
    """One model in this process: the median host time of a decoding step over `calls` `generate()` calls."""
    from transformers import CompileConfig

    import bench_models

    architecture, rebuilt = variant.removesuffix(REBUILT), variant.endswith(REBUILT)
    widths = {**TINY_WIDTHS, **(FLASH_MHF_WIDTHS if architecture.startswith("flash_mhf") else {})}
    model = bench_models.build_model(architecture, size, "cpu", **widths).float()
    if rebuilt:
        if architecture.startswith("llama"):
            raise ValueError("--rebuilt-signature applies to our models, not transformers' Llama")
        del inspect.unwrap(type(model).forward).__signature__  # (stored on the undecorated function)

    graph_inputs = []

    def replay_first_outputs(graph, example_inputs):
        graph_inputs.append(len(example_inputs))  # parameters, cache tensors and the step's own inputs
        outputs = graph(*example_inputs)
        return lambda *args: outputs

    compile_config = CompileConfig(fullgraph=True, backend=replay_first_outputs, mode=None)
    compile_config._compile_all_devices = True  # (generate() compiles on accelerators only unless told)
    model.generation_config.compile_config = compile_config
    generate = bench_models.decode_generator(model, 1, True, "cpu")
    generate(new_tokens)  # compiles
    medians = []
    for _ in range(calls):
        times = generate(new_tokens)
        medians.append(median([b - a for a, b in zip(times, times[1:])]))
    return {"variant": variant, "step_us": median(medians) * 1e6, "parameters": len(list(model.parameters())),
            "compiled_call": getattr(model, "_compiled_call", None) is not None,
            "graph_inputs": graph_inputs, "guard_check_us": guard_check_us(model, generate)}


def guard_check_us(model, generate, repeats: int = 2000) -> float:
    """Microseconds that dynamo's guard check of the compiled forward takes for a decoding step's inputs: the part
    of the step's host time that grows with what the model's Python reads (module attributes, parameters). The
    inputs of one step are recorded, then the check of the cache entry that `generate()` compiled is timed alone."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    compiled, recorded = model._compiled_call, {}

    def record(*args, **kwargs):
        recorded.update(args=args, kwargs=kwargs)
        return compiled(*args, **kwargs)

    model._compiled_call = record
    try:
        generate(2)
    finally:
        model._compiled_call = compiled
    forward = type(model).forward
    code = forward.__code__
    entries = _debug_get_cache_entry_list(code)
    if len(entries) != 1:
        raise RuntimeError(f"expected one compiled entry for {forward.__qualname__}, found {len(entries)}")
    if code.co_flags & inspect.CO_VARARGS and code.co_flags & inspect.CO_VARKEYWORDS and not code.co_kwonlyargcount:
        # a decorator's wrapper: wrapper(self, *args, **kwargs), or wrapper(*args, **kwargs) (transformers' own
        # deprecated-argument wrapper since 5.24)
        names, explicit = code.co_varnames, code.co_argcount
        positional = (model, *recorded["args"])
        frame_locals = dict(zip(names[:explicit], positional))
        frame_locals.update({names[explicit]: positional[explicit:], names[explicit + 1]: dict(recorded["kwargs"])})
    else:
        bound = inspect.signature(forward).bind(model, *recorded["args"], **recorded["kwargs"])
        bound.apply_defaults()
        frame_locals = dict(bound.arguments)
    frame_locals.update(zip(code.co_freevars, (cell.cell_contents for cell in forward.__closure__ or ())))
    check = entries[0].guard_manager.check
    with torch.no_grad():  # (generate() decodes without gradients; the guards check the grad mode)
        if not check(frame_locals):
            raise RuntimeError("the recorded inputs of a decoding step fail the compiled entry's guards: "
                               f"{entries[0].guard_manager.check_verbose(frame_locals)}")
        start = time.perf_counter()
        for _ in range(repeats):
            check(frame_locals)
        return (time.perf_counter() - start) / repeats * 1e6


def measure(variant: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--size", args.size,
               "--calls", str(args.calls), "--new-tokens", str(args.new_tokens), "--out", args.out]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{variant}: the measuring process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(results: dict) -> str:
    env, args = results["environment"], results["args"]
    lines = [f"# Host time of a static-cache decoding step ({args['size']} depth, tiny widths)", "",
             f"{env['cpu']}; torch {env['torch']}, transformers {env['transformers']}. Each model in a process of "
             f"its own, {args['rounds']} rounds in turn, {args['calls']} `generate()` calls of {args['new_tokens']} "
             "tokens per round; the compiled graph replaced by its first outputs (what is left: `generate()`, "
             "dynamo's guards, the bytecode around the graph).", ""]
    base = median(results["rounds"]["llama"]) if "llama" in results["rounds"] else None
    guards = results.get("guard_check_us", {})
    rows = []
    for variant, rounds in results["rounds"].items():
        step = median(rounds)
        rows.append([variant, results["parameters"][variant],
                     " / ".join(map(str, results.get("graph_inputs", {}).get(variant, []))) or "-", f"{step:.0f}",
                     f"{step - base:+.0f}" if base else "-",
                     f"{median(guards[variant]):.0f}" if guards.get(variant) else "-",
                     " / ".join(f"{t:.0f}" for t in rounds)])
    lines += markdown_table(["model", "parameter tensors", "compiled graph's inputs", "host us per step", "vs Llama",
                             "of which dynamo's guard check, us", "by round"], rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True, help="directory for decode_host.{json,md}")
    parser.add_argument("--size", default="370M", help="preset of examples/presets.py whose depth the models take")
    parser.add_argument("--archs", nargs="+", choices=ARCHS,
                        default=["llama", "flash_mhf", "memoryllm", "flex_memoryllm", "kvffn", "kvffn_no_bias"],
                        help="models of kernels/bench_models.py (kvffn_no_bias: KVFFN without its biases)")
    parser.add_argument("--rebuilt-signature", action="store_true",
                        help="also our models with the forward's signature rebuilt at every step")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=10, help="timed generate() calls per measurement")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        get_preset(args.size)
    except ValueError as error:
        parser.error(f"--size: {error}")
    refuse_counts_below(parser, args, rounds=1, calls=1, new_tokens=2)  # (a step: the time between two tokens)
    if args.worker:
        print(json.dumps(worker(args.worker, args.size, args.calls, args.new_tokens)))
        return {}
    variants = list(args.archs)
    if args.rebuilt_signature:
        variants += [f"{arch}{REBUILT}" for arch in args.archs if not arch.startswith("llama")]
    results = {"environment": {**environment(), "cpu": cpu_name()}, "args": vars(args), "rounds": {v: [] for v in variants},
               "parameters": {},
               "graph_inputs": {}, "guard_check_us": {}}
    start = time.perf_counter()
    for round_index in range(args.rounds):
        for variant in variants:
            row = measure(variant, args)
            results["rounds"][variant].append(row["step_us"])
            results["guard_check_us"].setdefault(variant, []).append(row["guard_check_us"])
            results["parameters"][variant] = row["parameters"]
            results["graph_inputs"][variant] = row["graph_inputs"]
            log(f"[{time.perf_counter() - start:.0f} s] round {round_index + 1} {variant}: {row['step_us']:.0f} us")
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "decode_host.json"), results)
        write_text(os.path.join(args.out, "decode_host.md"), report(results))
    log(report(results))
    return results


if __name__ == "__main__":
    main()
