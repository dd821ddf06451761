"""Token lookup tables on the GPU: kernel checks, then decoding speed and device memory, MemoryLLM vs dense Llama.

    python kernels/bench_token_lookup.py --out kernels/results            # ~1B-like shape (24 x 2048, vocab 50k)
    python kernels/bench_token_lookup.py --small --out /tmp/tol_bench      # a quick smoke run
    python kernels/bench_token_lookup.py --formats --layers 8 --hidden 256 --heads 4 --kv-heads 2 \
        --intermediate 704 --vocab 8000 --out kernels/results                # format sweep (CPU is enough)

1. Kernel checks (fresh random inputs): the Triton gather/dequantize/add kernel against a float64 reference for
   fp32/bf16/int8/int4 rows, and the cache-or-host gather kernel reading a pinned table in place.
2. Both models are built from configs with random bf16 weights on the GPU, with equal total parameters (MemoryLLM's
   memory FFN has the dense model's FFN shape). Modes: dense; MemoryLLM compute; MemoryLLM lookup with the table on
   the GPU (`gpu`), in pinned host memory with a device cache (`cpu`), memory-mapped from disk with the cache
   (`disk`); the memory FFN weights are dropped in lookup modes. Each mode: decode tokens/s at batch 1 and 16,
   (a) in eager `generate()`: extra tokens / extra time between two generate() lengths (prefill excluded), and
   (b) with a static KV cache and the decode step captured as one CUDA graph (same loop for both models; the next
   token and position are updated inside the graph), timed with CUDA events over the replays; and the peak device
   memory (weights, table or cache, KV cache, activations).
3. The time to export the full bf16 table.

Writes token_lookup.json and token_lookup.md into --out.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    GIB, environment, output_folder, peak_memory_gib, refuse_counts_below, reset_peak_memory, write_json,
    write_text,
)


def check_kernels() -> dict:
    from hf_memffn.token_lookup import TokenLookupFormat, dequantize_rows, quantize_rows
    from hf_memffn.token_lookup_triton import gather_rows_triton, lookup_add_triton

    torch.manual_seed(0)
    results = {}
    d, layers, vocab, tokens = 2048, 6, 1000, 37
    for name in ("fp32", "bf16", "int8", "int4"):
        fmt = TokenLookupFormat(name=name)
        fmt.check_model(layers, d)  # default group sizes
        values = torch.randn(vocab, layers * d, device="cuda")
        encoded = quantize_rows(values, fmt)
        rows, scales = encoded["rows"], encoded.get("scales")
        ids = torch.randint(0, vocab, (tokens,), device="cuda")
        for hidden_dtype in (torch.float32, torch.bfloat16):
            hidden = torch.randn(tokens, d, device="cuda").to(hidden_dtype)
            worst = 0.0
            for k in range(layers):
                out = lookup_add_triton(hidden, ids, rows, scales, k, d, name, fmt.group_size or 1)
                columns = d // 2 if name == "int4" else d
                sl = rows[ids.long()][:, k * columns:(k + 1) * columns]
                sc = None
                if scales is not None:
                    g = d // fmt.group_size
                    sc = scales[ids.long()][:, k * g:(k + 1) * g]
                ref = hidden.double() + dequantize_rows(sl, sc, fmt).double()
                err = float((out.double() - ref).norm() / ref.norm())
                worst = max(worst, err)
            results[f"lookup_add/{name}/{str(hidden_dtype)[6:]}"] = worst
    # gather: half the tokens cached, the rest read from a pinned host table in place
    from hf_memffn.token_lookup import _host_mapped_alias

    host = torch.randn(vocab, 4099).to(torch.bfloat16).pin_memory()
    alias = _host_mapped_alias(host, torch.device("cuda", torch.cuda.current_device()))
    cache_tokens = torch.randperm(vocab)[:300]
    cache = host[cache_tokens].cuda()
    slot = torch.full((vocab,), -1, dtype=torch.int32)
    slot[cache_tokens] = torch.arange(300, dtype=torch.int32)
    ids = torch.randint(0, vocab, (500,))
    out = gather_rows_triton(ids.cuda(), slot.cuda(), cache, alias)
    results["gather/bf16/cache+host"] = float((out.cpu().float() - host[ids].float()).abs().max())
    return results


def build_models(args, which: str):
    import hf_memffn  # noqa: F401
    from hf_memffn.testing import tiny_config
    from transformers import AutoModelForCausalLM

    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                 max_position_embeddings=4096, intermediate_size=args.intermediate, tie_word_embeddings=False)
    if which == "dense":
        config = tiny_config("llama", **shape)
    else:
        config = tiny_config("memoryllm", **shape)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def decode_speed(model, batch: int, graphed: bool, args, generator) -> dict:
    prompt = zipf_tokens(batch, args.prompt, args.vocab, generator).cuda()
    if graphed:
        return graph_decode_speed(model, prompt, args)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, disable_compile=True)
    short, long = args.new_tokens_short, args.new_tokens_long
    model.generate(prompt, max_new_tokens=short, **kwargs)  # warm-up
    torch.cuda.synchronize()
    reset_peak_memory()
    times = {}
    for n in (short, long, short, long):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        times.setdefault(n, []).append(time.perf_counter() - start)
        assert out.shape[1] == prompt.shape[1] + n
    extra = min(times[long]) - min(times[short])
    return {"tokens_per_s": batch * (long - short) / extra, "peak_mem_gib": peak_memory_gib()}


def graph_decode_speed(model, prompt, args) -> dict:
    """Greedy decoding with a static KV cache, one decode step captured as a CUDA graph and replayed: the next token,
    position and cache length are updated inside the graph, so the timing is the model's own decode step."""
    from transformers import StaticCache

    from hf_memffn.modeling_memffn import CACHE_KWARG  # (the cache argument's name in this transformers)

    batch, length = prompt.shape
    steps = args.new_tokens_long
    cache = StaticCache(config=model.config, max_cache_len=length + steps + 8)
    is_llama = model.config.model_type == "llama"
    reset_peak_memory()
    with torch.no_grad():
        positions = torch.arange(length, device="cuda")
        extra = {"cache_position": positions} if is_llama else {}
        logits = model(input_ids=prompt, **{CACHE_KWARG: cache}, use_cache=True,
                       position_ids=positions.expand(batch, -1), **extra).logits
        token = logits[:, -1:].argmax(-1)
        position = torch.full((1,), length, device="cuda", dtype=torch.long)

        def step():
            extra = {"cache_position": position} if is_llama else {}
            out = model(input_ids=token, **{CACHE_KWARG: cache}, use_cache=True,
                        position_ids=position.expand(batch, 1), **extra).logits
            token.copy_(out[:, -1:].argmax(-1))
            position.add_(1)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replays = steps - 3 - 1
        for _ in range(2):  # warm replays
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays - 2):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    return {"tokens_per_s": batch * (replays - 2) / seconds, "step_ms": 1000 * seconds / (replays - 2),
            "peak_mem_gib": peak_memory_gib()}


def zipf_tokens(batch, length, vocab, generator):
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = 1.0 / ranks
    return torch.multinomial((probs / probs.sum()).float(), batch * length, replacement=True,
                             generator=generator).view(batch, length)


def reset_compiled(model=None):
    torch._dynamo.reset()
    for attr in ("_compiled_call", "_last_compile_config"):
        if model is not None and hasattr(model, attr):
            delattr(model, attr)
    gc.collect()
    torch.cuda.empty_cache()


def bench_mode(results, label, model, args):
    generator = torch.Generator().manual_seed(0)
    for graphed in (False, True):
        for batch in (1, 16):
            key = f"{label}/{'graph' if graphed else 'eager'}/b{batch}"
            if graphed and label == "disk":
                results["decode"][key] = {"error": "not capturable: the disk placement reads the token ids on the "
                                                   "host every step to fill its cache"}
                continue
            try:
                results["decode"][key] = decode_speed(model, batch, graphed, args, generator)
            except Exception as error:  # keep the other measurements
                results["decode"][key] = {"error": f"{type(error).__name__}: {error}"[:400]}
                traceback.print_exc()
            print(key, results["decode"][key], flush=True)
            save(results, args)
        reset_compiled(model)


def save(results, args):
    write_json(os.path.join(args.out, "token_lookup.json"), results)
    lines = [f"# Token lookup tables: decoding on {results['device']}", "",
             f"Shape: {results['shape']}", "",
             "| mode | eager b1 tok/s | eager b16 tok/s | CUDA graph b1 tok/s | CUDA graph b16 tok/s | peak mem b1 / b16 (GiB, CUDA graph) |",
             "| --- | --- | --- | --- | --- | --- |"]
    labels = sorted({k.split("/")[0] for k in results["decode"]}, key=list(MODES).index)
    for label in labels:
        cells = []
        for kind in ("eager/b1", "eager/b16", "graph/b1", "graph/b16"):
            entry = results["decode"].get(f"{label}/{kind}", {})
            cells.append(f"{entry['tokens_per_s']:.1f}" if "tokens_per_s" in entry else ("error" if entry else "-"))
        mem = [results["decode"].get(f"{label}/graph/b{b}", {}).get("peak_mem_gib") for b in (1, 16)]
        cells.append(" / ".join(f"{m:.2f}" if m is not None else "-" for m in mem))
        lines.append(f"| {MODES[label]} | " + " | ".join(cells) + " |")
    lines += ["", "Kernel checks (relative error vs float64, or max abs diff for the gather):", ""]
    lines += [f"- {k}: {v:.2e}" for k, v in results.get("kernel_checks", {}).items()]
    if "export" in results:
        e = results["export"]
        lines += ["", f"Export of the full bf16 table: {e['seconds']:.1f} s, {e['size_bytes'] / GIB:.2f} GiB, "
                      f"{e['num_shards']} shards"]
    for k, v in results.get("notes", {}).items():
        lines.append(f"- {k}: {v}")
    write_text(os.path.join(args.out, "token_lookup.md"), "\n".join(lines) + "\n")


FORMAT_SWEEP = [
    ("fp32", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {}),
    ("lowrank", {"energy": 0.95}), ("lowrank", {"rank": 64}), ("bf16", {"drop_layers": "middle quarter"}),
]


def format_sweep(args) -> None:
    """Every format on one random MemoryLLM: size on disk, table error, held-out loss change (CPU or GPU)."""
    import hf_memffn  # noqa: F401
    from hf_memffn.conversion import export_tols
    from hf_memffn.testing import tiny_config
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = tiny_config("memoryllm", vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.hidden // args.heads, intermediate_size=args.intermediate)
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    eval_ids = zipf_tokens(4, 128, args.vocab, torch.Generator().manual_seed(1))
    rows = []
    for name, options in FORMAT_SWEEP:
        options = dict(options)
        if options.get("drop_layers") == "middle quarter":
            quarter = max(args.layers // 4, 1)
            start = (args.layers - quarter) // 2
            options["drop_layers"] = list(range(start, start + quarter))
        with tempfile.TemporaryDirectory() as directory:
            report = export_tols(model, directory, format=name, progress=False, eval_input_ids=eval_ids, **options)
        label = name + "".join(f" {k}={v}" for k, v in options.items())
        rows.append({"format": label, **{k: report[k] for k in ("size_bytes", "max_relative_error",
                                                              "mean_relative_error", "loss_compute", "loss_delta",
                                                              "seconds")}, "ranks": report["ranks"]})
        print(rows[-1], flush=True)
    shape = f"{args.layers} layers, hidden {args.hidden}, memory width {args.intermediate}, vocab {args.vocab}"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    write_json(os.path.join(args.out, "token_lookup_formats.json"),
               {**environment(), "device": device_name, "shape": shape, "formats": rows})
    lines = [f"# Token lookup table formats ({device_name})", "",
             f"Random-weight MemoryLLM ({shape}); held-out loss on 4 x 128 Zipf-distributed token ids "
             f"(compute-mode loss {rows[0]['loss_compute']:.4f}). Relative error per (token, layer) vector; "
             "a dropped layer counts as error 1.", "",
             "| format | size on disk | vs fp32 | max rel. error | mean rel. error | loss change | ranks |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        ranks = "" if not row["ranks"] else f"{min(row['ranks'])}-{max(row['ranks'])}"
        lines.append(f"| {row['format']} | {row['size_bytes'] / 2**20:.2f} MiB | "
                     f"{row['size_bytes'] / rows[0]['size_bytes']:.3f} | {row['max_relative_error']:.2e} | "
                     f"{row['mean_relative_error']:.2e} | {row['loss_delta']:+.2e} | {ranks} |")
    write_text(os.path.join(args.out, "token_lookup_formats.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


MODES = {"dense": "dense Llama", "compute": "MemoryLLM, compute", "gpu": "MemoryLLM, lookup gpu",
         "cpu": "MemoryLLM, lookup cpu + cache", "disk": "MemoryLLM, lookup disk + cache"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True, help="folder for token_lookup{,_formats}.{json,md}")
    parser.add_argument("--small", action="store_true", help="4 layers, hidden 512, vocab 8k (smoke run)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=50000)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens-short", type=int, default=8)
    parser.add_argument("--new-tokens-long", type=int, default=72)
    parser.add_argument("--cache-rows", type=int, default=1024)
    parser.add_argument("--table-dir", default=None,
                        help="where to export the table, kept there (default: a temp dir, removed at the end)")
    parser.add_argument("--modes", default="dense,compute,gpu,cpu,disk", help=f"some of {','.join(MODES)}")
    parser.add_argument("--formats", action="store_true",
                        help="only the format sweep (size / error / loss change of every format; runs on CPU too)")
    args = parser.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab = 4, 512, 8, 4, 1408, 8000
    if args.formats:
        format_sweep(args)
        return
    # (the graphed decode takes 3 warm-up steps, the captured one and 2 warm replays before timing any replay)
    refuse_counts_below(parser, args, new_tokens_short=1, new_tokens_long=7)
    if args.new_tokens_long <= args.new_tokens_short:  # (tokens/s is over the extra tokens of the longer run)
        parser.error(f"--new-tokens-long must be greater than --new-tokens-short ({args.new_tokens_short}), "
                     f"got {args.new_tokens_long}")
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes {args.modes!r}: {', '.join(map(repr, unknown))} not among {', '.join(MODES)}")
    results = {**environment(),
               "shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")},
               "decode": {}, "notes": {"cache_rows": args.cache_rows,
                                       "prompt": f"{args.prompt} Zipf-distributed token ids"}}
    results["kernel_checks"] = check_kernels()
    print(results["kernel_checks"], flush=True)
    save(results, args)

    if "dense" in modes:
        model = build_models(args, "dense")
        results["params_dense"] = sum(p.numel() for p in model.parameters())
        bench_mode(results, "dense", model, args)
        del model
        reset_compiled()

    from hf_memffn.conversion import export_tols

    model = build_models(args, "memoryllm")
    results["params_memoryllm"] = model.parameter_counts()
    if "compute" in modes:
        bench_mode(results, "compute", model, args)
    table_dir = args.table_dir or tempfile.mkdtemp(prefix="tol_bench_")
    torch.cuda.synchronize()
    start = time.perf_counter()
    report = export_tols(model, table_dir, format="bf16", batch_size=2048, progress=False)
    results["export"] = {"seconds": time.perf_counter() - start, "size_bytes": report["size_bytes"],
                         "num_shards": report["num_shards"], "format": "bf16"}
    print("export", results["export"], flush=True)
    save(results, args)
    start = time.perf_counter()
    model.load_tols(table_dir, placement="gpu", verify="full", drop_memory_ffn=True)
    results["notes"]["load_gpu_verify_full_s"] = round(time.perf_counter() - start, 2)
    base = model.model
    for placement in ("gpu", "cpu", "disk"):
        if placement not in modes:
            continue
        base.token_lookup = None
        gc.collect()
        torch.cuda.empty_cache()
        start = time.perf_counter()
        table = model.load_tols(table_dir, placement=placement, verify="size", cache_rows=args.cache_rows)
        results["notes"][f"load_{placement}_s"] = round(time.perf_counter() - start, 2)
        results["notes"][f"table_device_gib_{placement}"] = round(table.device_bytes() / GIB, 3)
        bench_mode(results, placement, model, args)
    if args.table_dir is None:  # (a folder given is the user's, the table kept in it)
        shutil.rmtree(table_dir, ignore_errors=True)
    save(results, args)
    print(open(os.path.join(args.out, "token_lookup.md")).read())


if __name__ == "__main__":
    main()
