"""Continuous-batching throughput: transformers' LlamaForCausalLM and the four architectures, side by side.

    python examples/bench_continuous_batching.py --out examples/results/continuous_batching_h100   # GPU, ~3 min
    python examples/bench_continuous_batching.py --preset tiny --requests 8 --device cpu --out /tmp/cb   # smoke run

Every model is built from the same preset (examples/presets.py; default `370M`: the paper's baseline shape, FlashMHF
its own equal-size column) with random weights in `--dtype`, and serves the same workload through transformers'
continuous batching (`init_continuous_batching`: paged KV cache, one flattened batch per step, new requests joining
as others finish): `--requests` requests submitted at once, prompt and generation lengths drawn uniformly from
`--prompt-lengths` and `--new-tokens` (seeded, identical for every model; EOS disabled, so each request generates
exactly its length). `--token-lookup` (default on when `--archs` has memoryllm, which it needs) adds a MemoryLLM
reading a bf16 token lookup table (`gpu` placement on CUDA, else `cpu`) with its memory FFN weights dropped.

Each model first runs a warm-up workload: as many requests, prompts drawn from the same range (another seed), an
eighth of the new tokens (kernel compilation, Triton autotuning, CUDA graph capture happen there), then the
timed one. Measured: wall time from the first submission to the last result, requests/s, generated
tokens/s, prompt + generated tokens/s, mean and p90 request latency and time to first token (from the submission of
all requests), the device memory of the weights (and table), and the Triton kernels compiled (or loaded from
Triton's disk cache) during the warm-up and during the timed workload, with the seconds they took, and the pauses of
Python's garbage collector during the timed workload; in the JSON also the model's forward steps in the warm-up and
each timed workload (`harness.ForwardSteps`: how many, their token counts met for the first time in the process, the
slowest steps, with the garbage collection inside them). `--profile-round N` profiles each model's round N.
`--synchronised-steps N` takes apart the first N steps of every timed workload: each one's host part and the device's
remainder, and the device blocks the caching allocator obtained within it (those steps then overlap nothing);
`--profiled-steps N` runs the host part of the first N of them under cProfile in the serving thread; each
timed workload also records the device memory allocated, reserved and free at its start. The
paged KV cache is sized by transformers from the free device memory (`--num-blocks` / `--max-batch-tokens` to fix it;
on the CPU, where transformers would size it from the whole RAM, it holds the workload's requests all at once).

`--rounds N` (N > 1) builds and warms up every model first, then serves the timed workload N times, the models taking
turns in an order rotated each round; each row then holds the medians over the rounds, and the ratio of the model's
generated tokens/s to Llama's in the same round (median, lowest and highest), which cancels what drifts between rounds.
Rows are written after every model (every round with --rounds), so a run cut short keeps what it measured.
Writes continuous_batching.json and continuous_batching.md (with the device) into --out, and prints the table; exits
1 when a model failed (its row holds the error).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))

from harness import (  # noqa: E402
    ForwardSteps,
    GcPauses,
    TritonCompilations,
    device_memory,
    environment,
    measure_on,
    median,
    output_folder,
    write_text,
)
from presets import ARCHITECTURE_NAMES, PRESETS, get_preset  # noqa: E402

LABELS = {"llama": "Llama (transformers)", "flash_mhf": "FlashMHFLlama", "memoryllm": "MemoryLLM",
          "flex_memoryllm": "FlexMemoryLLM", "kvffn": "KVFFN", "memoryllm_lookup": "MemoryLLM + lookup table"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the tokens per step transformers takes where memory allows (5.18 and later, whatever the memory on 5.17)
CPU_DEFAULT_MAX_BATCH_TOKENS = 8192


def length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN,MAX with 1 <= MIN <= MAX")
    return low, high


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="370M", choices=sorted(PRESETS),
                        help="model size from examples/presets.py (default 370M)")
    parser.add_argument("--archs", nargs="+", default=list(ARCHITECTURE_NAMES), choices=ARCHITECTURE_NAMES)
    parser.add_argument("--token-lookup", action=argparse.BooleanOptionalAction, default=None,
                        help="also run a MemoryLLM reading a bf16 token lookup table (memory FFN dropped); needs "
                        "memoryllm in --archs (default: on when it is there)")
    parser.add_argument("--requests", type=int, default=64, help="requests submitted at once (default 64)")
    parser.add_argument("--prompt-lengths", type=length_range, default=(32, 512), metavar="MIN,MAX")
    parser.add_argument("--new-tokens", type=length_range, default=(32, 256), metavar="MIN,MAX")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--num-blocks", type=int, default=None, help="paged KV cache blocks (default: transformers "
                                                                     "sizes it from free device memory; on the CPU, "
                                                                     "enough for the whole workload)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per step (default: transformers; on "
                        "the CPU, the workload's prompts and a token each, at most 8192)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="timed workloads per model, the models taking turns "
                                                              "(default 1: each model built, warmed up and timed "
                                                              "in turn)")
    parser.add_argument("--profile-round", type=int, default=None, metavar="N",
                        help="with --rounds: profile each model's timed round N (torch.profiler, host and device) "
                        "and write profile_<model>_round<N>.txt: its operations by host time, and the longest "
                        "events")
    parser.add_argument("--synchronised-steps", type=int, default=0, metavar="N",
                        help="synchronise the device around the first N forward steps of every timed workload and "
                        "record their host and device parts and allocator counters (default 0: none)")
    parser.add_argument("--profiled-steps", type=int, default=0, metavar="N",
                        help="of those, run the first N's host part under cProfile in the serving thread and keep "
                        "the costliest functions (default 0)")
    parser.add_argument("--out", type=output_folder, required=True, help="output directory")
    return parser


def workload(args, seed: int, count: int, new_token_scale: float = 1.0) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per request; `new_token_scale` shortens the generations (the warm-up)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = rng.randint(*args.prompt_lengths)
        new = max(1, int(rng.randint(*args.new_tokens) * new_token_scale))
        requests.append(([rng.randrange(3, args.vocab_size) for _ in range(prompt)], new))
    return requests


def build_model(arch: str, args, device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_memffn

    fields = dict(get_preset(args.preset).config_fields(arch), vocab_size=args.vocab_size)
    torch.manual_seed(args.seed)
    with torch.device(device):
        if arch == "llama":
            fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
            model = LlamaForCausalLM(LlamaConfig(**fields))
        else:
            model = AutoModelForCausalLM.from_config(hf_memffn.ARCHITECTURES[arch](**fields))
    return model.to(dtype).eval()


def paged_cache_config(args, requests, device: torch.device):
    """The continuous batching config: `--num-blocks` and `--max-batch-tokens` where given. Left to itself on the CPU,
    transformers sizes the paged cache from the machine's whole memory (5.17: 80% of it less this process's, later
    versions 60%), whatever other processes hold: the smoke run asked for 18 GiB on a 23 GiB machine and was killed;
    and 5.17, given the blocks only, sizes the tokens per step from that memory too (a 14.6 GB allocation). There the
    cache holds the workload's requests all at once instead, and a step takes at most all their prompts and one new
    token each, or transformers' own default where that is fewer."""
    from transformers import ContinuousBatchingConfig

    fields = {k: v for k, v in (("num_blocks", args.num_blocks), ("max_batch_tokens", args.max_batch_tokens))
              if v is not None}
    if device.type == "cpu":
        defaults = ContinuousBatchingConfig()
        page = getattr(defaults, "page_size", None) or defaults.block_size  # (5.17 calls it `block_size`)
        fields.setdefault("num_blocks", sum(-(-(len(prompt) + new) // page) for prompt, new in requests))
        fields.setdefault("max_batch_tokens", min(sum(len(prompt) + 1 for prompt, _ in requests),
                                                  CPU_DEFAULT_MAX_BATCH_TOKENS))
    return ContinuousBatchingConfig(**fields)


def run_workload(model, requests, args, record: bool) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                         max_new_tokens=max(new for _, new in requests))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in requests),
                          max_generated_length=generation_config.max_new_tokens, num_requests=len(requests))
    results = {}
    manager_context = model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=paged_cache_config(args, requests, model.device), block=True, timeout=30,
        workload_hints=hints)
    with manager_context as manager:
        start = time.perf_counter()
        for i, (prompt, new_tokens) in enumerate(requests):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new_tokens, record_timestamps=record)
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"the continuous batching loop stopped with {len(results)}/{len(requests)} done")
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    short = [i for i, (_, new) in enumerate(requests) if len(results[f"r{i}"].generated_tokens) != new]
    if short:
        raise RuntimeError(f"requests {short[:5]} did not generate their requested number of tokens")
    latencies = sorted(r.lifespan[1] - start for r in results.values())
    first_tokens = sorted(r.timestamps[0] - start for r in results.values() if r.timestamps)
    generated = sum(new for _, new in requests)
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {
        "wall_s": wall,
        "requests_per_s": len(requests) / wall,
        "generated_tokens_per_s": generated / wall,
        "total_tokens_per_s": (generated + prompt_tokens) / wall,
        "latency_mean_s": sum(latencies) / len(latencies),
        "latency_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
        "ttft_mean_s": sum(first_tokens) / len(first_tokens) if first_tokens else None,
        "attn_implementation": model.config._attn_implementation,
    }


def flash_mhf_kernel_path(model) -> str | None:
    """Which FlashMHF path the model's FFNs run (None for the other architectures)."""
    from hf_memffn.ffn_multihead import FlashMHFFeedForward

    for module in model.modules():
        if isinstance(module, FlashMHFFeedForward):
            return module.path_description()
    return None


def prepare_model(name: str, args, device, dtype, warmup_requests, table_dir: str | None):
    """(the model, its row: sizes, FFN path, warm-up time, compilations and steps, the token counts of the steps it
    has run)."""
    arch = "memoryllm" if name == "memoryllm_lookup" else name
    model = build_model(arch, args, device, dtype)
    counts = model.parameter_counts() if hasattr(model, "parameter_counts") else None
    total = sum(p.numel() for p in model.parameters())
    row = {"model": LABELS[name], "parameters": total, "active_parameters": counts["active"] if counts else total}
    if name == "memoryllm_lookup":
        from hf_memffn.conversion import export_tols

        start = time.perf_counter()
        export_tols(model, table_dir, format="bf16", device=device, progress=False)
        placement = "gpu" if device.type == "cuda" else "cpu"
        table = model.load_tols(table_dir, placement=placement, drop_memory_ffn=True, verify="size")
        row.update(table=f"bf16, placement {placement}, kernel {table.kernel}",
                   table_export_s=time.perf_counter() - start, active_parameters=sum(p.numel() for p in model.parameters()))
    row["flash_mhf_path"] = flash_mhf_kernel_path(model)
    table = getattr(getattr(model, "model", None), "token_lookup", None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    row["weights_gib"] = (weight_bytes + (table.device_bytes() if table is not None else 0)) / 2**30
    start = time.perf_counter()
    seen = set()
    with TritonCompilations() as compilations, ForwardSteps(model, seen) as steps:
        run_workload(model, warmup_requests, args, record=False)
    row["warmup_s"] = time.perf_counter() - start
    row["warmup_compilations"] = compilations.summary()
    row["warmup_steps"] = steps.summary()
    return model, row, seen


def timed_run(model, requests, args, seen: set) -> dict:
    """A timed workload; ``seen``: the token counts of the model's earlier steps."""
    memory_at_start = device_memory()
    with TritonCompilations() as compilations, GcPauses() as gc_pauses, \
            ForwardSteps(model, seen, args.synchronised_steps, args.profiled_steps) as steps:
        result = run_workload(model, requests, args, record=True)
    result["memory_at_start"] = memory_at_start
    result["compilations"] = compilations.summary()
    result["gc_pauses"] = gc_pauses.summary()
    result["steps"] = steps.summary(gc_pauses=gc_pauses)
    return result


@contextlib.contextmanager
def profiled(path: str, device):
    """torch.profiler over the block; writes to ``path`` the operations by host time and the 30 longest events, in
    the order they started. The host's operations are those of the thread that runs the block (the serving loop's
    thread is not among them); on CUDA, the CUDA runtime's calls and the kernels of every thread are."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        yield
    events = profiler.events()
    longest = sorted(events, key=lambda e: max(e.cpu_time_total, e.device_time_total), reverse=True)[:30]
    long = sorted(longest, key=lambda e: e.time_range.start)
    lines = [profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), "",
             "the 30 longest events (start ms from the profile's first event, host ms, device ms, thread, name):"]
    first = min((e.time_range.start for e in events), default=0)
    lines += [f"{(e.time_range.start - first) / 1e3:10.1f} {e.cpu_time_total / 1e3:9.1f} "
              f"{e.device_time_total / 1e3:9.1f} {e.thread:>8} {e.name}" for e in long]
    write_text(path, "\n".join(lines) + "\n")


def release(model, device) -> None:
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_one(name: str, args, device, dtype, requests, warmup_requests, table_dir: str | None) -> dict:
    model, row, seen = prepare_model(name, args, device, dtype, warmup_requests, table_dir)
    row.update(timed_run(model, requests, args, seen))
    release(model, device)
    return row


def summarise_rounds(row: dict, rounds: list[dict], baseline_rounds: list[dict] | None) -> dict:
    """The row of a model timed over several rounds: the medians of each measure, every round's numbers, and the
    ratio of its generated tokens/s to the baseline's of the same round (median, lowest, highest)."""
    summary = dict(row, rounds=rounds, attn_implementation=rounds[0]["attn_implementation"])
    for measure in ("wall_s", "requests_per_s", "generated_tokens_per_s", "total_tokens_per_s", "latency_mean_s",
                    "latency_p90_s", "ttft_mean_s"):
        values = [r[measure] for r in rounds if r.get(measure) is not None]
        summary[measure] = median(values) if values else None
    tunings = [r["compilations"].get("tuned") or {"configs": 0, "seconds": 0.0} for r in rounds]
    summary["compilations"] = {"count": sum(r["compilations"]["count"] for r in rounds),
                               "seconds": sum(r["compilations"]["seconds"] for r in rounds),
                               "per_round": [r["compilations"]["count"] for r in rounds],
                               "tuned": {"configs": sum(t["configs"] for t in tunings),
                                         "seconds": sum(t["seconds"] for t in tunings),
                                         "per_round": [t["configs"] for t in tunings]}}
    if baseline_rounds:
        ratios = [r["generated_tokens_per_s"] / b["generated_tokens_per_s"] for r, b in zip(rounds, baseline_rounds)]
        summary["x_baseline"] = {"median": median(ratios), "low": min(ratios), "high": max(ratios),
                                 "rounds": ratios}
    return summary


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _compilations(summary: dict | None) -> str:
    if not summary:
        return "-"
    text = f"{summary['count']} ({summary['seconds']:.1f} s)" if summary["count"] else "0"
    tuned = summary.get("tuned") or {}
    if tuned.get("configs"):
        text += f", {tuned['configs']} tuned ({tuned['seconds']:.1f} s)"
    return text


def to_markdown(report: dict) -> str:
    s = report["settings"]
    rounds = s.get("rounds", 1)
    lines = [
        f"# Continuous batching throughput, preset {s['preset']}",
        "",
        f"Device: {report['device']}; torch {report['versions']['torch']}, transformers "
        f"{report['versions']['transformers']}; {s['dtype']}, random weights.",
        f"Workload: {s['requests']} requests submitted at once, prompts {s['prompt_lengths'][0]}-"
        f"{s['prompt_lengths'][1]} tokens ({report['prompt_tokens']} in all), {s['new_tokens'][0]}-{s['new_tokens'][1]} "
        f"new tokens each ({report['generated_tokens']} in all), greedy, EOS disabled, vocab {s['vocab_size']}.",
    ]
    if rounds > 1:
        lines.append(f"{rounds} rounds, the models taking turns in an order rotated each round: medians over the "
                     "rounds; x Llama is the model's generated tokens/s over Llama's in the same round (median, "
                     "lowest-highest).")
    lines += [
        "Compiled: the Triton kernels compiled or loaded from Triton's disk cache during the warm-up / during the "
        "timed workload" + (" (all rounds)" if rounds > 1 else "") + ", with the seconds they took, and the "
        "configurations that Triton's autotuners benchmarked (\"tuned\"; their seconds include compiling them).",
        "",
        "| model | params (active) | requests/s | generated tok/s | " + ("x Llama | " if rounds > 1 else "")
        + "total tok/s | latency mean / p90 s | TTFT mean s | weights GiB | warm-up s | compiled | attention | "
        "FFN kernel / table |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if rounds > 1 else ""),
    ]
    for row in report["results"]:
        if "error" in row:
            lines.append(f"| {row['model']} | failed: {row['error']} |" + " |" * (10 + (rounds > 1)))
            continue
        ttft = f"{row['ttft_mean_s']:.2f}" if row.get("ttft_mean_s") is not None else "-"
        ratio = row.get("x_baseline")
        ratio = (f"{ratio['median']:.2f} ({ratio['low']:.2f}-{ratio['high']:.2f}) | " if ratio else "- | ") \
            if rounds > 1 else ""
        compiled = f"{_compilations(row.get('warmup_compilations'))} / {_compilations(row.get('compilations'))}"
        lines.append(
            f"| {row['model']} | {row['parameters'] / 1e6:.1f}M ({row['active_parameters'] / 1e6:.1f}M) | "
            f"{row['requests_per_s']:.2f} | {row['generated_tokens_per_s']:.0f} | {ratio}"
            f"{row['total_tokens_per_s']:.0f} | {row['latency_mean_s']:.2f} / {row['latency_p90_s']:.2f} | {ttft} | "
            f"{row['weights_gib']:.2f} | {row['warmup_s']:.1f} | {compiled} | {row['attn_implementation']} | "
            f"{row.get('table') or (row.get('flash_mhf_path') or '-').split(' (')[0]} |")
    lines += ["", f"Command: `{report['command']}`", ""]
    return "\n".join(lines)


def write_report(report: dict, out: str) -> str:
    markdown = to_markdown(report)
    from hf_memffn.run_records import run_record_json

    # (strict JSON: a rate that is not finite is null, named under `not_finite`: see hf_memffn.run_records)
    for name, text in (("continuous_batching.json", run_record_json(report, indent=2)),
                       ("continuous_batching.md", markdown)):
        write_text(os.path.join(out, name), text + "\n")
    return markdown


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, got {args.requests}")
    if args.vocab_size < 4:  # the prompts' ids are drawn from 3 to --vocab-size - 1
        parser.error(f"--vocab-size must be at least 4, got {args.vocab_size}")
    for option, value in (("--num-blocks", args.num_blocks), ("--max-batch-tokens", args.max_batch_tokens)):
        if value is not None and value < 1:
            parser.error(f"{option} must be at least 1 (or left out: transformers sizes it), got {value}")
    if args.synchronised_steps < 0 or not 0 <= args.profiled_steps <= args.synchronised_steps:
        parser.error(f"--synchronised-steps ({args.synchronised_steps}) must be 0 or more and --profiled-steps "
                     f"({args.profiled_steps}) from 0 to --synchronised-steps")
    if args.token_lookup and "memoryllm" not in args.archs:
        parser.error(f"--token-lookup runs a MemoryLLM reading a lookup table: it needs memoryllm in --archs, got "
                     f"{' '.join(args.archs)}")
    if args.token_lookup is None:
        args.token_lookup = "memoryllm" in args.archs
    if args.profile_round is not None and not (args.rounds > 1 and 1 <= args.profile_round <= args.rounds):
        parser.error(f"--profile-round must be a round from 1 to --rounds (> 1), got {args.profile_round} of "
                     f"{args.rounds}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    measure_on(str(device))  # (a CPU run on a machine with a GPU: memory, clocks and timings of the CPU)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    os.makedirs(args.out, exist_ok=True)
    requests = workload(args, args.seed, args.requests)
    # the warm-up submits as many requests with prompts of the same lengths (short generations), so that the batch
    # shapes of the timed run, which Triton compiles and autotunes for, were seen before the clock starts
    warmup_requests = workload(args, args.seed + 1, args.requests, new_token_scale=0.125)
    names = list(args.archs) + (["memoryllm_lookup"] if args.token_lookup else [])
    import transformers

    report = {
        "device": device_name(device),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "triton": environment()["triton"]},
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "dtype": str(dtype).replace("torch.", "")},
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "generated_tokens": sum(new for _, new in requests),
        "command": "python examples/bench_continuous_batching.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "results": [],
    }
    started = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {text}", flush=True)

    def record(rows: list[dict]) -> str:
        report["results"] = rows
        report["total_s"] = time.perf_counter() - started
        return write_report(report, args.out)  # after every step: a run cut short keeps what it measured

    with tempfile.TemporaryDirectory() as table_dir:
        if args.rounds == 1:
            rows = []
            for name in names:
                progress(f"{LABELS[name]} ...")
                try:
                    row = bench_one(name, args, device, dtype, requests, warmup_requests, table_dir)
                except Exception as error:  # one model failing still leaves the others' numbers
                    row = {"model": LABELS[name], "error": f"{type(error).__name__}: {error}"[:300]}
                rows.append(row)
                print(f"    {json.dumps(row)}", flush=True)
                markdown = record(rows)
        else:
            markdown = run_rounds(names, args, device, dtype, requests, warmup_requests, table_dir, progress, record)
    print(markdown)
    return report


def run_rounds(names, args, device, dtype, requests, warmup_requests, table_dir, progress, record) -> str:
    """Every model built and warmed up, then ``args.rounds`` timed workloads each, the models taking turns."""
    models, rows, seen, failed = {}, {}, {}, {}
    for name in names:
        progress(f"{LABELS[name]}: build and warm up ...")
        try:
            models[name], rows[name], seen[name] = prepare_model(name, args, device, dtype, warmup_requests,
                                                                 table_dir)
        except Exception as error:
            failed[name] = {"model": LABELS[name], "error": f"{type(error).__name__}: {error}"[:300]}
    rounds = {name: [] for name in models}
    markdown = ""
    for index in range(args.rounds):
        order = list(models)[index % max(1, len(models)):] + list(models)[:index % max(1, len(models))]
        for name in order:
            progress(f"round {index + 1}/{args.rounds}: {LABELS[name]} ...")
            try:
                if args.profile_round == index + 1:
                    with profiled(os.path.join(args.out, f"profile_{name}_round{index + 1}.txt"), device):
                        rounds[name].append(timed_run(models[name], requests, args, seen[name]))
                else:
                    rounds[name].append(timed_run(models[name], requests, args, seen[name]))
            except Exception as error:
                failed[name] = {"model": LABELS[name], "error": f"{type(error).__name__}: {error}"[:300]}
                release(models.pop(name), device)
                rounds.pop(name)
        complete = [name for name in names if name in rounds and rounds[name]]
        baseline = rounds.get("llama") if "llama" in complete else None
        summaries = {name: summarise_rounds(rows[name], rounds[name], baseline if name != "llama" else None)
                     for name in complete}
        markdown = record([summaries.get(name) or failed.get(name) for name in names
                           if name in summaries or name in failed])
    return markdown


if __name__ == "__main__":
    # a model that failed leaves its error in its row and the others their numbers; the exit status says it failed
    raise SystemExit(1 if any("error" in row for row in main()["results"]) else 0)
