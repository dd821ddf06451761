"""Where the time of one FlashMHF forward+backward goes at the paper shape (one GPU call):

    python kernels/profile_flash_mhf_step.py --out DIR        # DIR/flash_mhf_step_profile.json

The benchmark times the op's forward+backward (a training step through autograd) and, apart, its forward and its
backward kernels. This script compares the two ways at B=8, H=16, d_h=128, E=15, d_e=384 (bf16):

* ``rounds``: the forward, the backward (``triton_backward``) and the training step timed with
  ``triton.testing.do_bench`` (median) in turn, several rounds, with the SM clock and board power that
  ``nvidia-smi`` reports while each is timed (sampled every 50 ms);
* ``kernels``: the torch profiler's GPU time of every kernel inside the training step against the same kernels
  launched alone, and the step's GPU idle time (its span on the GPU minus the time some kernel was running).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

import triton  # noqa: E402

from bench_flash_mhf import op_flops, op_inputs  # noqa: E402
from harness import output_folder, refuse_counts_below, timed, write_json  # noqa: E402
from hf_memffn.flash_mhf_op import flash_mhf, flash_mhf_path  # noqa: E402
from hf_memffn import flash_mhf_triton as kernels  # noqa: E402


def kernel_times(fn, steps: int) -> dict:
    """GPU time per kernel name (ms per step) over ``steps`` calls of fn, the GPU span per step and its idle part."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel = {}
    intervals = []
    for event in events:
        start, end = event.time_range.start, event.time_range.end  # microseconds
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + (end - start) / 1000 / steps
        intervals.append((start, end))
    intervals.sort()
    busy, current_start, current_end = 0.0, None, None
    for start, end in intervals:
        if current_end is None or start > current_end:
            if current_end is not None:
                busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    return {"kernels_ms": {name[:120]: ms for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])},
            "gpu_busy_ms_per_step": busy / 1000 / steps, "gpu_span_ms_per_step": span / 1000 / steps}


def measure(seq_len: int, rounds: int, steps: int) -> dict:
    torch.manual_seed(0)
    q, k, u, v, r = op_inputs(8, 16, seq_len, 128, 16, 15, 384, torch.bfloat16)
    grad = torch.randn_like(q)
    flops = op_flops(8, 16, seq_len, 128, 15, 384)
    leaves = [t.requires_grad_() for t in (q, k, u, v, r)]

    def forward():
        with torch.no_grad():
            flash_mhf(q, k, u, v, r, impl="triton")

    def backward():
        kernels.triton_backward(grad, q.detach(), k.detach(), u.detach(), v.detach(), r.detach())

    def train():
        flash_mhf(*leaves, impl="triton").backward(grad)

    def fresh_train():  # as do_bench runs train: no gradient to accumulate into
        for tensor in leaves:
            tensor.grad = None
        train()

    def apart():
        forward()
        backward()

    result = {"seq_len": seq_len, "path": flash_mhf_path(q, k), "rounds": []}
    for _ in range(rounds):
        row = {"forward": timed(forward), "backward": timed(backward), "train": timed(train, grad_to_none=leaves)}
        row["train_minus_parts_ms"] = row["train"]["ms"] - row["forward"]["ms"] - row["backward"]["ms"]
        row["train_tflops"] = 3 * flops / row["train"]["ms"] * 1e-9
        result["rounds"].append(row)
        print(f"L={seq_len}: fwd {row['forward']['ms']:.3f} bwd {row['backward']['ms']:.3f} "
              f"train {row['train']['ms']:.3f} ms ({row['train_tflops']:.0f} TFLOP/s; "
              f"train - parts {row['train_minus_parts_ms']:+.3f} ms) | SM clock "
              + " / ".join(f"{row[k]['sm_clock_mhz'] or float('nan'):.0f}" for k in ("forward", "backward", "train"))
              + " MHz", flush=True)
    for tensor in leaves:
        tensor.grad = None
    result["kernels"] = {"train": kernel_times(fresh_train, steps), "forward_then_backward": kernel_times(apart, steps)}
    for name, profiled in result["kernels"].items():
        print(f"L={seq_len} {name}: GPU busy {profiled['gpu_busy_ms_per_step']:.3f} ms of a "
              f"{profiled['gpu_span_ms_per_step']:.3f} ms span per step", flush=True)
        for kernel, ms in list(profiled["kernels_ms"].items())[:6]:
            print(f"    {ms:8.3f} ms  {kernel[:90]}", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True, help="folder for flash_mhf_step_profile.json")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4032, 8064])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps")
    args = parser.parse_args()
    refuse_counts_below(parser, args, seq_lens=1, steps=1)
    if not torch.cuda.is_available():
        sys.exit("profile_flash_mhf_step.py needs a CUDA GPU")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "command": " ".join(sys.argv),
               "lengths": [measure(seq_len, args.rounds, args.steps) for seq_len in args.seq_lens]}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "flash_mhf_step_profile.json")
    write_json(path, results)


if __name__ == "__main__":
    main()
