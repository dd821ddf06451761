"""Where the host's time goes in the FlashMHF layer (one GPU call): Python's cProfile over training steps of the FFN
block at the 370M shape (8 x 2048 tokens), over forwards of the same tokens without gradients, and over decoding
steps (one token), after a warm-up.

    PYTHONPATH=. python kernels/profile_flash_mhf_host.py --out DIR     # DIR/flash_mhf_host_profile.{json,txt}

A training step of the whole model is bound by the host when the host takes longer to issue a layer's kernels than
the GPU takes to run them; this names the Python functions that take the host's time, by own time and by cumulative
time, with the host and GPU time per step beside them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import TRAIN_BATCH, ffn_layers  # noqa: E402
from harness import cuda_ms, environment, log, median, synchronize, write_json, write_text  # noqa: E402

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this profiles the host side of GPU launches")
    layers, hidden = ffn_layers("370M", "cuda")
    results = {"environment": environment(), "profiles": {}}
    for name in ("FlashMHF", "Llama MLP d_ff=2752"):
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
    write_text(os.path.join(args.out, "flash_mhf_host_profile.txt"),
               "\n\n".join(f"## {key}\nhost {p['host_ms_per_step']:.3f} ms/step, GPU {p['gpu_ms_per_step']:.3f} ms/step\n"
                           f"{p['text']['tottime']}\n{p['text']['cumtime']}" for key, p in results["profiles"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
