"""Forwards through one `disk` token lookup table with a device cache, from one thread and from two at once.

A forward picks its tokens' cache slots when it starts and its layers read them later: the slots must not be refilled
by another forward meanwhile (`DiskTokenLookupTable._disk_rows` keeps them out of the refill while the forward's row
ids are alive). A MemoryLLM and a FlexMemoryLLM with a small device cache run `--forwards` forwards of short random
prompts from one thread, then from each of two threads at once, each mode through a table of its own; every forward's
logits are compared with the same model's compute-mode logits for its prompt (no table, fp32 rows: equal to 1e-5 when
every row read is the token's own). Needs a CUDA device (the cache exists only there).

    python kernels/disk_table_threads.py --out results/
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading

import torch
from transformers import AutoModelForCausalLM

import hf_memffn  # noqa: F401 (registers the architectures)
from hf_memffn.conversion import export_tols
from hf_memffn.testing import tiny_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import environment, markdown_table, output_folder, refuse_counts_below, write_report  # noqa: E402


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def run_forwards(model, prompts, references, results, start: threading.Barrier | None) -> None:
    if start is not None:
        start.wait()
    with torch.no_grad():
        for prompt, reference in zip(prompts, references):
            results.append(relative(model(input_ids=prompt).logits, reference))
    torch.cuda.synchronize()


def measure(arch: str, forwards: int, cache_rows: int, tokens: int, seed: int) -> dict:
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config).to("cuda").eval()
    generator = torch.Generator().manual_seed(seed + 1)
    prompts = [[torch.randint(0, config.vocab_size, (1, tokens), generator=generator).cuda() for _ in range(forwards)]
               for _ in range(2)]
    with torch.no_grad():
        references = [[model(input_ids=prompt).logits for prompt in thread] for thread in prompts]
    outcome = {}
    with tempfile.TemporaryDirectory() as directory:
        export_tols(model, directory, format="fp32", progress=False)
        for mode in ("one thread", "two threads"):  # (each through a table of its own, its cache filled afresh)
            table = model.load_tols(directory, placement="disk", cache_rows=cache_rows)
            errors: list[list[float]] = [[], []]
            if mode == "two threads":
                start = threading.Barrier(2)
                threads = [threading.Thread(target=run_forwards, args=(model, prompts[i], references[i], errors[i],
                                                                       start)) for i in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            else:
                for i in range(2):
                    run_forwards(model, prompts[i], references[i], errors[i], None)
            flat = errors[0] + errors[1]
            outcome[mode] = {"forwards": len(flat), "wrong (relative error > 1e-5)": sum(e > 1e-5 for e in flat),
                             "max relative error": max(flat, default=float("nan")),
                             "cache lookups": int(table.cache_lookups), "cache hits": int(table.cache_hits)}
            print(f"{arch:16s} {mode:12s} {outcome[mode]}", flush=True)
            model.unload_tols()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forwards", type=int, default=200, help="forwards per thread")
    parser.add_argument("--cache-rows", type=int, default=256, help="rows of the table's device cache")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=output_folder, required=True,
                        help="folder for disk_table_threads.json and .md")
    args = parser.parse_args()
    refuse_counts_below(parser, args, forwards=1, cache_rows=1, tokens=1)
    if not torch.cuda.is_available():
        raise SystemExit("disk_table_threads.py measures the device cache, which exists only on a CUDA device")
    results = {arch: measure(arch, args.forwards, args.cache_rows, args.tokens, args.seed)
               for arch in ("memoryllm", "flex_memoryllm")}
    rows = [[arch, mode, f"{r[mode]['wrong (relative error > 1e-5)']} of {r[mode]['forwards']}",
             f"{r[mode]['max relative error']:.2e}"]
            for arch, r in results.items() for mode in ("one thread", "two threads")]
    environment_now = environment()
    text = "\n".join([f"Device: {environment_now['device']}", "",
                      *markdown_table(["architecture", "forwards from", "wrong forwards", "max relative error"], rows)])
    write_report(args.out, "disk_table_threads",
                 {"environment": environment_now, "arguments": vars(args), "results": results}, text + "\n")


if __name__ == "__main__":
    main()
