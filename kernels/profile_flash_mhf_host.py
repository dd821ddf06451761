"""Where the host's time goes in the FlashMHF layer (one GPU call): Python's cProfile over training steps of the FFN
block at the 370M shape (8 x 2048 tokens), over forwards of the same tokens without gradients, and over decoding
steps (one token), after a warm-up.

    PYTHONPATH=. python kernels/profile_flash_mhf_host.py --out DIR     # DIR/flash_mhf_host_profile.{json,txt}

Before the profiles, each piece of the layer is timed alone without a profiler (`--parts`: the host's microseconds
to issue one call, the median over calls each started on an idle GPU, and the GPU's), from one aten launch up to the
module's training step, so the cost of each Python layer between the module and the kernels reads as a difference.

A training step of the whole model is bound by the host when the host takes longer to issue a layer's kernels than
the GPU takes to run them; this names the Python functions that take the host's time, by own time and by cumulative
time, with the host and GPU time per step beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import TRAIN_BATCH, ffn_layers  # noqa: E402
from harness import (  # noqa: E402
    back_to_back_us, cuda_ms, environment, host_issue_ms, log, median, output_folder, refuse_counts_below,
    synchronize, write_json, write_text,
)

SEQ_LEN = 2048


def host_profile(fn, steps: int, top: int = 30) -> dict:
    """cProfile of `steps` calls of `fn` (after a warm-up): host ms per step (no sync inside), GPU ms per step, and
    the top functions by own and by cumulative time."""
    for _ in range(3):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    host_ms = (time.perf_counter() - start) / steps * 1e3  # the time to issue (the GPU may still be running)
    synchronize()
    gpu_ms = median(cuda_ms(fn, steps, warmup=1))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    synchronize()
    stats = pstats.Stats(profiler)
    rows = {}
    for key in ("tottime", "cumtime"):
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats(key).print_stats(top)
        rows[key] = stream.getvalue()
    entries = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    table = [{"function": f"{os.path.basename(file)}:{line}({name})", "calls_per_step": calls / steps,
              "own_us_per_step": own / steps * 1e6, "cumulative_us_per_step": cumulative / steps * 1e6}
             for (file, line, name), (_, calls, own, cumulative, _) in entries]
    return {"steps": steps, "host_ms_per_step": host_ms, "gpu_ms_per_step": gpu_ms, "by_own_time": table,
            "text": rows}


ISSUE_MODES = ("idle", "back-to-back")  # --issue


def issue_us(fn, calls: int, mode: str = "idle") -> float:
    """Host microseconds to issue one call of `fn`, after a warm-up. "idle": the median over calls each started on an
    idle GPU (a piece that launches many kernels never waits for a full launch queue, but the host's speed between
    calls shows); "back-to-back": the mean over `calls` calls issued without synchronising (steadier, but a piece of
    more launches than the queue holds over those calls reads the GPU's rate)."""
    for _ in range(3):
        fn()
    if mode == "idle":
        return median(host_issue_ms(fn, calls)) * 1e3
    return back_to_back_us(fn, calls)


def part_timings(module, hidden: int, calls: int, profile_parts: tuple = (), mode: str = "idle") -> list[dict]:
    """Host and GPU time per call of each piece of the fused FlashMHF layer at 8 x 2048 tokens and at one token; with
    `profile_parts` (names or their first words), a cProfile of those pieces instead."""
    from hf_memffn import flash_mhf_gluon, flash_mhf_layer_triton, flash_mhf_op, flash_mhf_triton

    x = torch.randn(TRAIN_BATCH["370M"], SEQ_LEN, hidden, device="cuda", dtype=torch.bfloat16)
    p = module.in_proj(x).detach()
    norm_weight, router = module.query_norm.weight.detach(), module.router.detach()
    eps, gate_eps, head_dim = module.query_norm.variance_epsilon, module.gate_eps, module.head_dim
    k, u, v = (w.detach() for w in module.subnetwork_weights())
    num_subnetworks = k.shape[1]
    q, r = flash_mhf_layer_triton.queries_and_gates(p, norm_weight, router, head_dim, num_subnetworks, eps, gate_eps)
    batch, length, width = p.shape
    q4 = q.view(batch, length, width // head_dim, head_dim).transpose(1, 2)
    grad_heads = torch.randn_like(q4)
    grad_q = torch.randn_like(p)
    grad_r = torch.randn_like(r)
    small = torch.randn(16, device="cuda")
    step = torch.randn(1, 1, width, device="cuda", dtype=torch.bfloat16)
    weights = module.key_up_value.detach()
    layer_args = (norm_weight, router, weights, head_dim, eps, gate_eps)
    leaf = x.clone().requires_grad_()
    params = list(module.parameters())

    def module_train():
        module(leaf).backward(x)
        for tensor in (leaf, *params):
            tensor.grad = None

    parts = {
        "one aten add (16 floats)": lambda: small.add(1.0),
        "torch.empty_like(p)": lambda: torch.empty_like(p),
        "queries_and_gates (norm + gates kernel)": lambda: flash_mhf_layer_triton.queries_and_gates(
            p, norm_weight, router, head_dim, num_subnetworks, eps, gate_eps),
        "triton_forward (op forward, autotuned launch)": lambda: flash_mhf_triton.triton_forward(q4, k, u, v, r),
        "gluon_rows_gradients (dq, dr)": lambda: flash_mhf_gluon.gluon_rows_gradients(grad_heads, q4, k, u, v, r),
        "gluon_weight_gradients (dK, dU, dV)": lambda: flash_mhf_gluon.gluon_weight_gradients(
            grad_heads, q4, k, u, v, r),
        "triton_backward (both)": lambda: flash_mhf_triton.triton_backward(grad_heads, q4, k, u, v, r),
        "queries_and_gates_backward": lambda: flash_mhf_layer_triton.queries_and_gates_backward(
            p, norm_weight, router, grad_q, grad_r, head_dim, eps, gate_eps),
        "_layer_forward_impl": lambda: flash_mhf_op._layer_forward_impl(p, *layer_args),
        "_layer_backward_impl": lambda: flash_mhf_op._layer_backward_impl(grad_q, p, *layer_args),
        "flash_mhf_layer, no grad": lambda: flash_mhf_op.flash_mhf_layer(
            p, norm_weight, router, weights, eps=eps, gate_eps=gate_eps),
        "module forward, no grad": lambda: module(x),
        "module forward + backward": module_train,
        "decode_forward (1 token)": lambda: flash_mhf_layer_triton.decode_forward(
            step, norm_weight, router, k, u, v, eps, gate_eps),
        "module forward, 1 token": lambda: module(step),
    }
    rows = []
    for name, fn in parts.items() if not profile_parts else ():
        with torch.no_grad() if "backward" not in name else contextlib.nullcontext():
            host = issue_us(fn, calls, mode)
            gpu = median(cuda_ms(fn, 20, warmup=1)) * 1e3
        rows.append({"part": name, "host_us": host, "gpu_us": gpu})
        log(f"{name}: host {host:.1f} us/call, GPU {gpu:.1f} us/call")
    for name, fn in parts.items():
        if any(name.startswith(prefix) for prefix in profile_parts):
            with torch.no_grad() if "backward" not in name else contextlib.nullcontext():
                profile = host_profile(fn, calls, top=25)
            rows.append({"part": name, "host_us": profile["host_ms_per_step"] * 1e3,
                         "gpu_us": profile["gpu_ms_per_step"] * 1e3, "cprofile": profile["text"]["tottime"]})
            log(f"## {name}\n{profile['text']['tottime']}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parts", type=int, default=100, help="calls per piece in the part timings (0: skip them)")
    parser.add_argument("--issue", choices=ISSUE_MODES, default="idle", help="how the part timings issue the calls")
    parser.add_argument("--no-cprofile", action="store_true", help="only the part timings")
    parser.add_argument("--cprofile-parts", nargs="*", default=(),
                        help="cProfile these pieces of the part timings (names' first words) instead of timing all")
    args = parser.parse_args(argv)
    refuse_counts_below(parser, args, steps=1, parts=0)  # (no step: a division by zero after the part timings)
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this profiles the host side of GPU launches")
    layers, hidden = ffn_layers("370M", "cuda")
    results = {"environment": environment(), "profiles": {}, "parts": [], "issue": args.issue}
    if args.parts:
        results["parts"] = part_timings(next(m for key, m in layers.items() if key == "FlashMHF"), hidden, args.parts,
                                        tuple(args.cprofile_parts), args.issue)
        llama_mlp = next(m for key, m in layers.items() if key.startswith("Llama MLP"))
        x = torch.randn(TRAIN_BATCH["370M"], SEQ_LEN, hidden, device="cuda", dtype=torch.bfloat16)
        leaf = x.clone().requires_grad_()

        def llama_train():
            llama_mlp(leaf).backward(x)
            for tensor in (leaf, *llama_mlp.parameters()):
                tensor.grad = None

        step = torch.randn(1, 1, hidden, device="cuda", dtype=torch.bfloat16)
        for name, fn in (("Llama MLP forward, no grad", lambda: llama_mlp(x)),
                         ("Llama MLP forward + backward", llama_train),
                         ("Llama MLP forward, 1 token", lambda: llama_mlp(step))):
            with torch.no_grad() if "backward" not in name else contextlib.nullcontext():
                row = {"part": name, "host_us": issue_us(fn, args.parts, args.issue),
                       "gpu_us": median(cuda_ms(fn, 20)) * 1e3}
            results["parts"].append(row)
            log(f"{name}: host {row['host_us']:.1f} us/call, GPU {row['gpu_us']:.1f} us/call")
        write_json(os.path.join(args.out, "flash_mhf_host_profile.json"), results)
    for name in () if args.no_cprofile else ("FlashMHF", "Llama MLP d_ff=2752"):
        module = next(m for key, m in layers.items() if key.startswith(name))
        x = torch.randn(TRAIN_BATCH["370M"], SEQ_LEN, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        params = list(module.parameters())

        def train():
            module(x).backward(grad)
            for tensor in (x, *params):
                tensor.grad = None

        def forward():  # the layer bench's "fwd ms": a forward over all tokens without gradients
            with torch.no_grad():
                module(x)

        step = torch.randn(1, 1, hidden, device="cuda", dtype=torch.bfloat16)

        def decode():
            with torch.no_grad():
                module(step)

        for label, fn in (("train", train), ("forward", forward), ("decode", decode)):
            profile = host_profile(fn, args.steps)
            results["profiles"][f"{name} {label}"] = profile
            log(f"{name} {label}: host {profile['host_ms_per_step']:.3f} ms/step to issue, GPU "
                f"{profile['gpu_ms_per_step']:.3f} ms/step")
            log(profile["text"]["tottime"])
    write_json(os.path.join(args.out, "flash_mhf_host_profile.json"), results)
    parts = "".join(f"{row['part']}: host {row['host_us']:.1f} us, GPU {row['gpu_us']:.1f} us per call\n"
                    for row in results["parts"])
    profiles = "\n\n".join(
        f"## {key}\nhost {p['host_ms_per_step']:.3f} ms/step, GPU {p['gpu_ms_per_step']:.3f} ms/step\n"
        f"{p['text']['tottime']}\n{p['text']['cumtime']}" for key, p in results["profiles"].items())
    write_text(os.path.join(args.out, "flash_mhf_host_profile.txt"),
               f"## Parts (host and GPU microseconds per call, {environment()['device']})\n{parts}\n{profiles}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
