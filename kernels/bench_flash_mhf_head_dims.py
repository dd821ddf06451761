"""The fused FlashMHF op, autotuned as users get it, at each supported head size (one GPU call):

    PYTHONPATH=. python kernels/bench_flash_mhf_head_dims.py --out kernels/results

B=8, H=16, L=4032, E=15, d_e=384, bf16, d_h in {64, 128, 256}. For each head size: output and all five gradients
against the PyTorch reference path in float32 on one sequence of the same inputs (timing stops on failure), then
forward and forward+backward time and TFLOP/s (forward FLOPs = 6 B L H E d_e d_h, forward+backward = 3x) and the launch
configuration the autotuner chose for each kernel. Writes <out>/flash_mhf_head_dims.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

from bench_flash_mhf import TOLERANCE, errors_against_reference, op_flops, op_inputs  # noqa: E402
from harness import bench_ms, output_folder, write_json, write_text  # noqa: E402
from hf_memffn import flash_mhf_triton as kernels  # noqa: E402
from hf_memffn.flash_mhf_op import flash_mhf  # noqa: E402

SHAPE = dict(batch=8, num_heads=16, seq_len=4032, num_subnetworks=15, subnetwork_size=384)
HEAD_DIMS = (64, 128, 256)
TUNERS = {"forward": "_forward_tuned", "dq/dr": "_backward_rows_tuned", "dK/dU/dV": "_backward_weights_tuned"}


def tuned_configs(head_dim: int) -> dict:
    """The configuration each autotuner settled on for this head size (its cache key starts with D_H)."""
    chosen = {}
    for kernel, name in TUNERS.items():
        for key, config in getattr(kernels, name).cache.items():
            if key[0] == head_dim:
                chosen[kernel] = (config.kwargs["BLOCK_L"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    return chosen


def check(head_dim: int) -> list[float]:
    torch.manual_seed(head_dim)
    return errors_against_reference(op_inputs(1, SHAPE["num_heads"], SHAPE["seq_len"], head_dim, SHAPE["num_heads"],
                                              SHAPE["num_subnetworks"], SHAPE["subnetwork_size"], torch.bfloat16))


def measure(head_dim: int) -> dict:
    torch.manual_seed(0)
    q, k, u, v, r = op_inputs(SHAPE["batch"], SHAPE["num_heads"], SHAPE["seq_len"], head_dim, SHAPE["num_heads"],
                              SHAPE["num_subnetworks"], SHAPE["subnetwork_size"], torch.bfloat16)
    flops = op_flops(SHAPE["batch"], SHAPE["num_heads"], SHAPE["seq_len"], head_dim, SHAPE["num_subnetworks"],
                     SHAPE["subnetwork_size"])
    forward_ms = bench_ms(lambda: flash_mhf(q, k, u, v, r, impl="triton"))
    leaves = [t.requires_grad_() for t in (q, k, u, v, r)]
    grad = torch.randn_like(q)
    train_ms = bench_ms(lambda: flash_mhf(*leaves, impl="triton").backward(grad), grad_to_none=leaves)
    return {"forward_ms": forward_ms, "forward_tflops": flops / forward_ms * 1e-9, "train_ms": train_ms,
            "train_tflops": 3 * flops / train_ms * 1e-9, "configs": tuned_configs(head_dim)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True, help="folder for flash_mhf_head_dims.{json,md}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_flash_mhf_head_dims.py needs a CUDA GPU")
    import triton

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "command": " ".join(["python", *sys.argv]),
               "shape": SHAPE, "rows": []}
    for head_dim in HEAD_DIMS:
        errors = check(head_dim)
        passed = all(x < TOLERANCE[torch.bfloat16] for x in errors)
        row = {"head_dim": head_dim, "rel_err_out_dq_dk_du_dv_dr": errors, "correct": passed}
        if passed:
            row.update(measure(head_dim))
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        if not passed:
            break

    lines = [f"# FlashMHF op by head size on {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}; bf16; B=8, H=16, L=4032, E=15, d_e=384; autotuned "
             f"launches; `{results['command']}`. Configurations are (BLOCK_L, BLOCK_N, warps, stages).", "",
             "| d_h | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | forward | dq/dr | dK/dU/dV | max rel. err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if not row["correct"]:
            lines.append(f"| {row['head_dim']} | failed the correctness check | | | | | | | "
                         f"{max(row['rel_err_out_dq_dk_du_dv_dr']):.1e} |")
            continue
        configs = [str(row["configs"].get(kernel, "-")) for kernel in TUNERS]
        lines.append(f"| {row['head_dim']} | {row['forward_ms']:.3f} | {row['forward_tflops']:.0f} | {row['train_ms']:.3f} "
                     f"| {row['train_tflops']:.0f} | " + " | ".join(configs)
                     + f" | {max(row['rel_err_out_dq_dk_du_dv_dr']):.1e} |")
    # (strict JSON: a relative error that is not finite, a failed check's, is written as null)
    write_json(os.path.join(args.out, "flash_mhf_head_dims.json"), results)
    write_text(os.path.join(args.out, "flash_mhf_head_dims.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(row["correct"] for row in results["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
