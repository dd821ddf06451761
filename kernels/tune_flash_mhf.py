"""Launch configurations and variants of the three FlashMHF kernels, timed one by one at a paper shape (one GPU call).

    python kernels/tune_flash_mhf.py --out DIR                          # the sweep: DIR/flash_mhf_tune.json
    python kernels/tune_flash_mhf.py --profile weights:production:128,64,8,2   # one launch of one kernel, for ncu
    python kernels/tune_flash_mhf.py --head-dim 64 --out DIR   # other head sizes: DIR/flash_mhf_tune_dh64.json
    python kernels/tune_flash_mhf.py --configs forward:128,64,8,3 rows:128,64,8,2 --out DIR   # chosen launches

Every candidate is launched directly (no autotuner), its outputs are checked against the production kernel's
(poisoned with NaN before each launch, so unwritten elements fail), then timed with ``triton.testing.do_bench``
(median). Executed TFLOP/s count the products each kernel really runs, in units of one forward-sized product
(2 B L H E d_e d_h FLOPs): forward 3, dq/dr kernel 5, dK/dU/dV kernel 6, the one-kernel backward of
``flash_mhf_variants.backward_fused`` 8. The last lines estimate forward+backward from the fastest candidate of each
kernel, counted as the benchmark counts it (3x the forward's FLOPs). ``--roles`` limits the sweep to some kernels.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

import triton  # noqa: E402
import triton.testing  # noqa: E402

import flash_mhf_variants as variants  # noqa: E402
from bench_flash_mhf import op_flops, op_inputs  # noqa: E402
from harness import output_folder, refuse_counts_below, rel_err, write_json  # noqa: E402
from hf_memffn import flash_mhf_gluon  # noqa: E402
from hf_memffn import flash_mhf_triton as kernels  # noqa: E402

SHAPE = dict(batch=8, num_heads=16, head_dim=128, num_subnetworks=15, subnetwork_size=384)
UNITS = {"forward": 3, "rows": 5, "weights": 6, "weights_ku": 5, "weights_v": 3, "backward": 8}
# which of the role's outputs a kernel writes (the dK/dU/dV roles share one launch signature)
WRITTEN = {"forward": (0,), "rows": (0, 1), "weights": (0, 1, 2), "weights_ku": (0, 1), "weights_v": (2,),
           "backward": (0, 1, 2, 3, 4)}
# (role, variant) -> (kernel, its compile-time switches); see flash_mhf_variants.py for what the switches mean
VARIANTS = {
    ("forward", "production"): (lambda: kernels._forward_kernel, {"TENSOR_DESCRIPTORS": True}),
    ("forward", "pointers"): (lambda: kernels._forward_kernel, {"TENSOR_DESCRIPTORS": False}),
    ("rows", "production"): (lambda: kernels._backward_rows_kernel, {}),
    ("weights", "production"): (lambda: kernels._backward_weights_kernel, {"TENSOR_DESCRIPTORS": True}),
    ("weights", "pointers"): (lambda: kernels._backward_weights_kernel, {"TENSOR_DESCRIPTORS": False}),
    # the explicitly scheduled Gluon kernels (hf_memffn/flash_mhf_gluon.py), each with one launch shape (backward: 128
    # rows and 64 columns per block; forward: 192 rows in three warp groups, 64 columns); the configuration tuples
    # below only label them
    ("weights", "gluon"): (None, {"GLUON": True}),
    ("rows", "gluon"): (None, {"GLUON": True}),
    ("forward", "gluon"): (None, {"GLUON": True}),
    ("weights", "short_lived"): (lambda: variants.weights_transposed, {"SHORT_LIVED": True}),
    ("weights", "seq_rt"): (lambda: variants.weights_transposed, {"SEQUENCE_BLOCKS": True, "GATE": "transposed"}),
    ("weights_ku", "transposed"): (lambda: variants.weights_transposed, {"WITH_V": False}),
    ("weights_ku", "columns"): (lambda: variants.weights_columns, {"GRADS": "ku"}),
    ("weights_v", "columns"): (lambda: variants.weights_columns, {"GRADS": "v"}),
    ("weights_v", "seq"): (lambda: variants.weights_columns, {"GRADS": "v", "SEQUENCE_BLOCKS": True}),
    ("weights_v", "seq_rt"): (lambda: variants.weights_columns,
                              {"GRADS": "v", "SEQUENCE_BLOCKS": True, "GATE": "transposed"}),
    # leaves the gate out: a different function, timed (not checked) to see what the gate costs
    ("weights_v", "seq_nogate"): (lambda: variants.weights_columns,
                                  {"GRADS": "v", "SEQUENCE_BLOCKS": True, "GATE": "none"}),
    ("backward", "atomic"): (lambda: variants.backward_fused, {"DQ_REDUCE": "atomic"}),
    ("backward", "descriptor"): (lambda: variants.backward_fused, {"DQ_REDUCE": "descriptor"}),
    ("backward", "descriptor_halves"): (lambda: variants.backward_fused, {"DQ_REDUCE": "descriptor", "DQ_HALVES": True}),
}
# (role, variant, (BLOCK_L, BLOCK_N, num_warps, num_stages)); the first of each role is the reference
CANDIDATES = [
    ("forward", "production", (128, 64, 8, 3)),
    ("forward", "production", (128, 64, 8, 4)),
    ("forward", "production", (128, 128, 8, 2)),
    ("forward", "pointers", (128, 64, 8, 3)),
    ("forward", "pointers", (128, 128, 8, 2)),
    ("forward", "gluon", (192, 64, 12, 3)),
    ("rows", "production", (128, 64, 8, 3)),
    ("rows", "production", (128, 64, 8, 2)),
    ("rows", "production", (128, 32, 8, 3)),
    ("rows", "gluon", (128, 64, 8, 3)),
    ("weights", "production", (128, 64, 8, 2)),
    ("weights", "gluon", (128, 64, 8, 2)),
    ("weights", "production", (128, 32, 8, 3)),
    ("weights", "production", (64, 32, 4, 2)),
    ("weights", "pointers", (128, 64, 8, 2)),
    ("weights", "pointers", (64, 32, 4, 2)),
    ("weights", "short_lived", (128, 64, 8, 2)),
    ("weights", "seq_rt", (128, 64, 8, 2)),
    ("weights_ku", "transposed", (128, 64, 8, 2)),
    ("weights_ku", "columns", (32, 128, 8, 3)),
    ("weights_ku", "columns", (32, 64, 4, 3)),
    ("weights_v", "columns", (64, 128, 8, 3)),
    ("weights_v", "seq", (64, 128, 8, 3)),
    ("weights_v", "seq_rt", (64, 128, 8, 3)),
    ("weights_v", "seq_nogate", (64, 128, 8, 3)),
    ("backward", "descriptor", (128, 64, 8, 1)),
    ("backward", "descriptor_halves", (128, 64, 8, 1)),
    ("backward", "atomic", (128, 64, 8, 1)),
]

# the sweeps at the other head sizes (production kernels; configurations that compile without spills, or with few,
# for sm_90 with Triton 3.6)
HEAD_DIM_CANDIDATES = {
    64: ["forward:128,64,8,3", "forward:128,64,8,2", "forward:128,128,8,2", "forward:128,128,8,3", "forward:64,64,4,3",
         "forward:128,64,4,3", "forward:64,128,8,2", "forward:64,128,4,3", "rows:128,64,8,2", "rows:128,64,8,3",
         "rows:64,64,4,3", "rows:64,64,8,3", "rows:128,32,8,3", "rows:64,64,4,2", "weights:128,64,8,2",
         "weights:128,64,8,3", "weights:128,32,4,2", "weights:128,32,8,3", "weights:64,64,8,3", "weights:64,64,4,3",
         "weights:64,64,8,2"],
    256: ["forward:64,64,8,2", "forward:64,32,8,2", "forward:64,32,8,3", "forward:128,32,8,2", "forward:128,16,8,3",
          "forward:64,16,8,3", "rows:64,16,4,3", "rows:64,16,4,2", "rows:128,16,8,2", "rows:128,16,8,3",
          "rows:128,32,8,2", "weights:64,16,8,2", "weights:64,16,4,2", "weights:64,16,4,3", "weights:64,16,8,3",
          "weights:64,32,8,2"],
}


class Problem:
    def __init__(self, seq_len: int):
        torch.manual_seed(0)
        self.seq_len = seq_len
        self.q, self.k, self.u, self.v, self.r = op_inputs(SHAPE["batch"], SHAPE["num_heads"], seq_len, SHAPE["head_dim"],
                                                           SHAPE["num_heads"], SHAPE["num_subnetworks"],
                                                           SHAPE["subnetwork_size"], torch.bfloat16)
        self.grad = torch.randn_like(self.q)
        self.p = kernels._problem(self.q, self.k)
        self.unit_flops = op_flops(SHAPE["batch"], SHAPE["num_heads"], seq_len, SHAPE["head_dim"],
                                   SHAPE["num_subnetworks"], SHAPE["subnetwork_size"]) / 3
        self.constants = dict(D_H=SHAPE["head_dim"], D_E=SHAPE["subnetwork_size"], **kernels._kernel_flags(self.q.dtype))
        self.strides = (*kernels._row_strides(self.q), *kernels._row_strides(self.grad))

    def outputs(self, role):
        like = {"forward": (self.q,), "rows": (self.q, self.r),
                "backward": (self.q, self.r, self.k, self.u, self.v)}.get(role, (self.k, self.u, self.v))
        return [torch.full_like(t, float("nan")) for t in like]

    def launcher(self, role, variant, config, outs):
        block_l, block_n, warps, stages = config
        kernel, switches = VARIANTS[(role, variant)]
        if switches.get("GLUON") and role == "forward":
            return lambda: flash_mhf_gluon.gluon_forward(self.q, self.k, self.u, self.v, self.r, out=outs[0])[1]
        if switches.get("GLUON") and role == "rows":
            return lambda: flash_mhf_gluon.gluon_rows_gradients(self.grad, self.q, self.k, self.u, self.v, self.r,
                                                                outputs=outs)[2]
        if switches.get("GLUON"):
            return lambda: flash_mhf_gluon.gluon_weight_gradients(self.grad, self.q, self.k, self.u, self.v, self.r,
                                                                  outputs=outs)[3]
        fn = kernel()
        meta = dict(BLOCK_L=block_l, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **self.constants, **switches)
        p, q, k, u, v, r, grad = self.p, self.q, self.k, self.u, self.v, self.r, self.grad
        if switches.get("GATE") == "transposed":
            r = self.r.transpose(-1, -2).contiguous()
        row_blocks = triton.cdiv(p["total_rows"], block_l)
        if switches.get("TENSOR_DESCRIPTORS") and role == "forward":
            k, u, v = (kernels._weight_descriptor(w, block_n) for w in (k, u, v))
        if role == "forward":
            return lambda: fn[(row_blocks, p["kv_heads"], 1)](
                q, k, u, v, r, outs[0], *kernels._row_strides(q), *kernels._row_strides(outs[0]), *p["sizes"], 1, 0,
                ACCUMULATE=False, **meta)
        if role == "rows":
            return lambda: fn[(row_blocks, p["kv_heads"])](
                q, k, u, v, r, grad, *outs, *self.strides, *p["sizes"], 0, E_POW2=16, **meta)
        column_blocks = p["num_subnetworks"] * p["subnetwork_size"] // block_n
        if role == "backward":
            return self.fused_launcher(fn, meta, column_blocks, outs)
        if switches.get("TENSOR_DESCRIPTORS"):
            q, grad = (kernels._sequence_descriptor(t, block_l) for t in (q, grad))
        return lambda: fn[(column_blocks, p["kv_heads"], 1)](
            q, k, u, v, r, grad, *outs, *self.strides, *p["sizes"], 1, 0, ACCUMULATE=False, **meta)

    def fused_launcher(self, fn, meta, column_blocks, outs):
        """The one-kernel backward: zero the float32 dq/dr buffers, launch, cast (all three timed)."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        p, q = self.p, self.q
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_r = torch.zeros(self.r.shape, dtype=torch.float32, device=q.device)
        target = grad_q
        if meta["DQ_REDUCE"] == "descriptor":
            width = q.shape[-1] // 2 if meta.get("DQ_HALVES") else q.shape[-1]
            target = TensorDescriptor.from_tensor(grad_q.view(-1, *q.shape[2:]), [1, meta["BLOCK_L"], width])

        def launch():
            grad_q.zero_()
            grad_r.zero_()
            compiled = fn[(column_blocks, p["kv_heads"])](
                q, self.k, self.u, self.v, self.r, self.grad, target, grad_r, *outs[2:], *self.strides,
                *p["sizes"][:5], **meta)
            outs[0].copy_(grad_q)
            outs[1].copy_(grad_r)
            return compiled

        return launch


def explicit_candidates(specs):
    """``role:BLOCK_L,BLOCK_N,warps,stages`` (production variant) -> CANDIDATES entries, ordered by role."""
    candidates = []
    for spec in specs:
        role, _, config = spec.partition(":")
        if (role, "production") not in VARIANTS:
            sys.exit(f"--configs: role must be one of forward, rows, weights, got {role!r}")
        if not re.fullmatch(r"\d+,\d+,\d+,\d+", config):
            sys.exit(f"--configs: expected role:BLOCK_L,BLOCK_N,warps,stages (four integers), got {spec!r}")
        candidates.append((role, "production", tuple(int(x) for x in config.split(","))))
    order = ["forward", "rows", "weights"]
    return sorted(candidates, key=lambda c: order.index(c[0]))


def profiled_launch(spec: str):
    """``role:variant:BLOCK_L,BLOCK_N,warps,stages`` (`--profile`) -> (role, variant, configuration)."""
    role, variant, config = spec.split(":") if spec.count(":") == 2 else ("", "", "")
    if (role, variant) not in VARIANTS:
        sys.exit(f"--profile: expected role:variant:BLOCK_L,BLOCK_N,warps,stages with role:variant one of "
                 f"{', '.join(f'{r}:{v}' for r, v in VARIANTS)}, got {spec!r}")
    if not re.fullmatch(r"\d+,\d+,\d+,\d+", config):
        sys.exit(f"--profile: expected role:variant:BLOCK_L,BLOCK_N,warps,stages (four integers), got {spec!r}")
    return role, variant, tuple(int(x) for x in config.split(","))


def sweep(args):
    problem = Problem(args.seq_len)
    if args.configs:
        candidates = explicit_candidates(args.configs)
    elif SHAPE["head_dim"] in HEAD_DIM_CANDIDATES:
        candidates = explicit_candidates(HEAD_DIM_CANDIDATES[SHAPE["head_dim"]])
    else:
        candidates = CANDIDATES
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "shape": {**SHAPE, "seq_len": args.seq_len}, "candidates": []}
    references = {}
    for role, variant, config in candidates:
        if (args.roles and role not in args.roles) or (args.variants and variant not in args.variants):
            continue
        outs = problem.outputs(role)
        launch = problem.launcher(role, variant, config, outs)
        row = {"kernel": role, "variant": variant, "BLOCK_L": config[0], "BLOCK_N": config[1], "num_warps": config[2],
               "num_stages": config[3]}
        try:
            compiled = launch()
            torch.cuda.synchronize()
            row.update(n_regs=compiled.n_regs, n_spills=compiled.n_spills)
            family = role.split("_")[0]
            written_outs = [outs[i] for i in WRITTEN[role]]
            if family == "backward" and family not in references:
                references[family] = [*references["rows"], *references["weights"]]
            if family not in references:
                references[family] = [t.clone() for t in outs]
                row["max_rel_err"] = 0.0
            else:
                row["max_rel_err"] = max(rel_err(outs[i], references[family][i]) for i in WRITTEN[role])
            written = all(bool(torch.isfinite(t).all()) for t in written_outs)
            row["correct"] = written and row["max_rel_err"] < 2e-2
            if VARIANTS[(role, variant)][1].get("GATE") == "none":
                row.update(correct=written, timing_only=True)
            if row["correct"]:
                ms = float(triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median"))
                row.update(ms=ms, tflops_executed=UNITS[role] * problem.unit_flops / ms * 1e-9)
        except Exception as exc:  # noqa: BLE001 - a candidate that does not build is a result too
            row.update(correct=False, error=repr(exc)[:300])
        results["candidates"].append(row)
        print(f"{role:8s} {variant:12s} {str(config):18s} regs {row.get('n_regs', '-')!s:>4} spills "
              f"{row.get('n_spills', '-')!s:>4} err {row.get('max_rel_err', float('nan')):.1e} "
              f"{row.get('ms', float('nan')):7.3f} ms {row.get('tflops_executed', float('nan')):5.0f} TFLOP/s"
              + ("" if row["correct"] else f"  FAILED {row.get('error', '')}"), flush=True)
    best = {}
    for row in results["candidates"]:
        if row["correct"] and not row.get("timing_only") and (row["kernel"] not in best or row["ms"] < best[row["kernel"]]["ms"]):
            best[row["kernel"]] = row
    if "weights_ku" in best and "weights_v" in best:
        split = best["weights_ku"]["ms"] + best["weights_v"]["ms"]
        if "weights" not in best or split < best["weights"]["ms"]:
            best["weights"] = {"variant": f"columns split: ku {best['weights_ku']['variant']} + v", "ms": split,
                               **{k: (best["weights_ku"][k], best["weights_v"][k]) for k in ("BLOCK_L", "BLOCK_N", "num_warps", "num_stages")}}
    if all(role in best for role in ("forward", "rows", "weights")):
        total = sum(best[role]["ms"] for role in ("forward", "rows", "weights"))
        reference = sum(next(r["ms"] for r in results["candidates"] if r["kernel"] == role and r["correct"])
                        for role in ("forward", "rows", "weights"))
        results["estimate"] = {
            "best": {role: {k: best[role][k] for k in ("variant", "BLOCK_L", "BLOCK_N", "num_warps", "num_stages", "ms")}
                     for role in ("forward", "rows", "weights")},
            "fwd_bwd_ms": total, "fwd_bwd_tflops_counted": 9 * problem.unit_flops / total * 1e-9,
            "reference_fwd_bwd_ms": reference, "reference_tflops_counted": 9 * problem.unit_flops / reference * 1e-9,
        }
        print(f"fastest of each kernel: {total:.2f} ms = {results['estimate']['fwd_bwd_tflops_counted']:.0f} TFLOP/s "
              f"counted (first candidates: {reference:.2f} ms = {results['estimate']['reference_tflops_counted']:.0f})")
    if "forward" in best and "backward" in best:
        total = best["forward"]["ms"] + best["backward"]["ms"]
        results["estimate_one_kernel_backward"] = {
            "best": {role: {k: best[role][k] for k in ("variant", "BLOCK_L", "BLOCK_N", "num_warps", "num_stages", "ms")}
                     for role in ("forward", "backward")},
            "fwd_bwd_ms": total, "fwd_bwd_tflops_counted": 9 * problem.unit_flops / total * 1e-9}
        print(f"forward + one-kernel backward: {total:.2f} ms = "
              f"{results['estimate_one_kernel_backward']['fwd_bwd_tflops_counted']:.0f} TFLOP/s counted")
    os.makedirs(args.out, exist_ok=True)
    name = "flash_mhf_tune.json" if SHAPE["head_dim"] == 128 else f"flash_mhf_tune_dh{SHAPE['head_dim']}.json"
    path = os.path.join(args.out, name)
    write_json(path, results)


def profile(args):
    role, variant, config = profiled_launch(args.profile)
    problem = Problem(args.seq_len)
    outs = problem.outputs(role)
    launch = problem.launcher(role, variant, config, outs)
    launch()  # compile (ncu skips this launch)
    launch()
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder,
                        help="folder for the sweep's flash_mhf_tune*.json (needed unless --profile)")
    parser.add_argument("--seq-len", type=int, default=4032)
    parser.add_argument("--roles", nargs="*", help="only these kernels (forward rows weights weights_v backward ...)")
    parser.add_argument("--variants", nargs="*", help="only these variants (production gluon pointers ...)")
    parser.add_argument("--profile", help="role:variant:BLOCK_L,BLOCK_N,warps,stages (one launch after a warm-up)")
    parser.add_argument("--head-dim", type=int, default=SHAPE["head_dim"], choices=(64, 128, 256))
    parser.add_argument("--configs", nargs="*", help="role:BLOCK_L,BLOCK_N,warps,stages of the production kernels, "
                        "timed instead of the built-in list (the first of each role is the reference)")
    args = parser.parse_args()
    refuse_counts_below(parser, args, seq_len=1)
    if args.out is None and args.profile is None:
        parser.error("--out is required for the sweep (only --profile runs without it)")
    for option, allowed in (("roles", {role for role, _ in VARIANTS}), ("variants", {name for _, name in VARIANTS})):
        unknown = sorted(set(getattr(args, option) or ()) - allowed)
        if unknown:
            parser.error(f"--{option}: {', '.join(unknown)} not among {', '.join(sorted(allowed))}")
    if args.roles and "backward" in args.roles and not {"rows", "weights"} <= set(args.roles):
        # (the fused backward is checked against the outputs of the rows and weights kernels of the same sweep)
        parser.error("--roles: backward is checked against the rows and weights kernels; add rows weights")
    if args.configs:
        explicit_candidates(args.configs)  # (its errors before any GPU work)
    if args.profile:
        profiled_launch(args.profile)
    SHAPE["head_dim"] = args.head_dim
    if not torch.cuda.is_available():
        sys.exit("tune_flash_mhf.py needs a CUDA GPU")
    profile(args) if args.profile else sweep(args)


if __name__ == "__main__":
    main()
