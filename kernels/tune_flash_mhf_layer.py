"""Launch settings of the FlashMHF layer's norm/gate kernels (`hf_memffn/flash_mhf_layer_triton.py`), timed at the
370M and 1.3B training shapes (one GPU call).

    PYTHONPATH=. python kernels/tune_flash_mhf_layer.py --out DIR      # DIR/flash_mhf_layer_tune.{json,md}
    PYTHONPATH=. python kernels/tune_flash_mhf_layer.py --profile backward:1.3B   # two production launches, for ncu
    PYTHONPATH=. python kernels/tune_flash_mhf_layer.py --sums --out DIR   # the partial sums' kernel against PyTorch

For each shape it times the forward kernel (queries and gates from the input projection's output) and the backward
kernel (their gradients), first across router-product precisions at the production launch, then across launch
settings at the production precision (tokens per program and warps; for the backward also programs per
multiprocessor, software-pipelining stages, and whether the router's gradient is the product q^T dl or, transposed,
dl^T q). Every candidate's
outputs are checked against a float64 PyTorch computation of the same maths before it is timed; a candidate that
fails to compile or to match is reported, not timed. A copy of the kernel's input (`p.clone()`) is timed beside them:
both kernels read and write about that many bytes (the backward twice), so it is their floor.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import bench_ms, environment, log, markdown_table, rel_err, write_json, write_report  # noqa: E402

from hf_memffn import flash_mhf_layer_triton as layer  # noqa: E402
from hf_memffn.flash_mhf_gluon import gate_partial_slots  # noqa: E402

EPS, GATE_EPS = 1e-5, 1e-6
# (name, tokens, heads, head_dim, num_subnetworks): the presets' FlashMHF layers at their training batch (8 x 2048 and
# 4 x 2048 tokens)
SHAPES = [("370M", 8 * 2048, 8, 128, 7), ("1.3B", 4 * 2048, 16, 128, 15)]
FORWARD_LAUNCHES = [{"block_t": t, "num_warps": w} for t, w in itertools.product((16, 32, 64, 128), (2, 4, 8))]
# the backward loops over token blocks, so its software-pipelining depth (num_stages) is swept too; the router's
# gradient either from q^T grad_logits or, transposed, from grad_logits^T q
BACKWARD_LAUNCHES = [
    {"block_t": t, "num_warps": w, "programs_per_sm": s, "num_stages": n, "router_grad_transposed": transposed}
    for t, w, s, n, transposed in itertools.product((16, 32, 64), (2, 4), (2, 4, 8, 16), (1, 2, 3), (False, True))
]
TOLERANCE = 2e-2  # bf16 outputs against float64: a wrong kernel is off by O(1)
PRODUCTION_PRECISION = layer.router_precision(torch.bfloat16)


def inputs(tokens: int, heads: int, head_dim: int, num_subnetworks: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).cuda()

    p = randn(1, tokens, heads * head_dim).to(torch.bfloat16)
    norm = 1 + randn(head_dim, scale=0.2)
    router = randn(heads, head_dim, num_subnetworks, scale=head_dim**-0.5)
    grad_q = randn(1, tokens, heads * head_dim).to(torch.bfloat16)
    grad_r = randn(1, heads, tokens, num_subnetworks, scale=0.1)
    return p, norm, router, grad_q, grad_r


def reference(p, norm, router, grad_q, grad_r, head_dim: int):
    """float64 (q [B, L, H * d_h], r [B, H, L, E], dp, d norm, d router) of the layer's norm and gates."""
    leaves = [t.double().requires_grad_(True) for t in (p, norm, router)]
    batch, length, width = p.shape
    x = leaves[0].view(batch, length, width // head_dim, head_dim)
    q = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * leaves[1]
    scores = torch.sigmoid(torch.einsum("blhd,hde->bhle", q, leaves[2]))
    r = scores / (scores.sum(-1, keepdim=True) + GATE_EPS)
    torch.autograd.backward([q, r], [grad_q.double().view_as(q), grad_r.double()])
    return (q.detach().reshape(batch, length, width), r.detach(), *(leaf.grad for leaf in leaves))


def candidate_rows(shape, truth, tensors, role: str, settings) -> list[dict]:
    name, tokens, heads, head_dim, num_subnetworks = shape
    p, norm, router, grad_q, grad_r = tensors
    rows = []
    for launch, precision in settings:
        row = {"shape": name, "kernel": role, "precision": precision, **launch}
        try:
            if role == "forward":
                def run():
                    return layer.queries_and_gates(p, norm, router, head_dim, num_subnetworks, EPS, GATE_EPS,
                                                   launch=launch, precision=precision)
                outputs, expected = run(), truth[:2]
            else:
                def run():
                    return layer.queries_and_gates_backward(p, norm, router, grad_q, grad_r, head_dim, EPS, GATE_EPS,
                                                            launch=launch, precision=precision)
                outputs, expected = run(), truth[2:]
            row["rel_err"] = max(rel_err(a, b) for a, b in zip(outputs, expected))
            if not row["rel_err"] < TOLERANCE:
                row["error"] = f"relative error {row['rel_err']:.2e} above {TOLERANCE}"
            else:
                row["us"] = bench_ms(run) * 1e3
        except Exception as exc:  # noqa: BLE001 - a launch that does not compile is a result of the sweep
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        log(f"{name} {role:8s} {precision:6s} {launch}: "
            + (f"{row['us']:.1f} us (rel err {row['rel_err']:.1e})" if "us" in row else row["error"]))
        rows.append(row)
    return rows


def sweep(shape) -> tuple[list[dict], float]:
    name, tokens, heads, head_dim, num_subnetworks = shape
    tensors = inputs(tokens, heads, head_dim, num_subnetworks)
    truth = reference(*tensors, head_dim)
    copy_us = bench_ms(lambda: tensors[0].clone()) * 1e3
    log(f"{name}: copy of p ({tokens} x {heads * head_dim} bf16) {copy_us:.1f} us")
    rows = []
    for role, production, launches in (("forward", layer.GATES_LAUNCH, FORWARD_LAUNCHES),
                                        ("backward", layer.GATES_BACKWARD_LAUNCH, BACKWARD_LAUNCHES)):
        settings = [(production, precision) for precision in layer.ROUTER_PRECISIONS]
        settings += [(launch, PRODUCTION_PRECISION) for launch in launches if launch != production]
        rows += candidate_rows(shape, truth, tensors, role, settings)
    return rows, copy_us


def report(results: dict) -> str:
    env = results["environment"]
    lines = [f"# FlashMHF layer norm/gate kernels on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16 inputs. Production: router precision "
             f"`{results['production']['precision']}`, forward {results['production']['forward']}, backward "
             f"{results['production']['backward']}.", ""]
    for shape, copy_us in results["copy_us"].items():
        lines += [f"## {shape} (copy of p: {copy_us:.1f} us)", ""]
        rows = [r for r in results["rows"] if r["shape"] == shape]
        lines += markdown_table(
            ["kernel", "precision", "tokens/program", "warps", "programs/SM", "stages", "router gradient", "us",
             "rel. error"],
            [[r["kernel"], r["precision"], r["block_t"], r["num_warps"], r.get("programs_per_sm", "-"),
              r.get("num_stages", "default"),
              "-" if r["kernel"] == "forward" else ("transposed" if r.get("router_grad_transposed") else "q^T dl"),
              f"{r['us']:.1f}" if "us" in r else r.get("error", "-"),
              f"{r['rel_err']:.1e}" if "rel_err" in r else "-"] for r in rows])
        for role in ("forward", "backward"):
            timed = [r for r in rows if r["kernel"] == role and "us" in r]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                extra = ""
                if role == "backward":
                    product = "transposed" if best.get("router_grad_transposed") else "q^T dl"
                    extra = (f", {best['programs_per_sm']} programs/SM, {best.get('num_stages', 'default')} stages, "
                             f"router gradient {product}")
                lines.append(f"\nFastest {role}: {best['us']:.1f} us, {best['precision']}, "
                             f"{best['block_t']} tokens, {best['num_warps']} warps{extra}")
        lines.append("")
    return "\n".join(lines) + "\n"


def profile(role: str, shape_name: str) -> None:
    """Two launches of one kernel at its production settings (the first compiles; a profiler skips it)."""
    shape = {s[0]: s for s in SHAPES}[shape_name]
    _, tokens, heads, head_dim, num_subnetworks = shape
    p, norm, router, grad_q, grad_r = inputs(tokens, heads, head_dim, num_subnetworks)
    for _ in range(2):
        if role == "forward":
            layer.queries_and_gates(p, norm, router, head_dim, num_subnetworks, EPS, GATE_EPS)
        else:
            layer.queries_and_gates_backward(p, norm, router, grad_q, grad_r, head_dim, EPS, GATE_EPS)
    torch.cuda.synchronize()


def partial_sums(out: str) -> None:
    """The norm-weight and router partial sums added up at each shape, as the fused backward of the Gluon dq/dr kernel
    leaves them (`gate_partial_slots` per head): the finishing kernel against the PyTorch reductions it replaced
    (`gate_gradient_sums_reference`), after checking they agree; DIR/gate_gradient_sums.{json,md}."""
    rows = []
    for name, tokens, heads, head_dim, num_subnetworks in SHAPES:
        generator = torch.Generator().manual_seed(0)
        slots, width = gate_partial_slots(tokens), layer.e_dot(num_subnetworks)
        norm_parts = torch.randn(slots, heads, head_dim, generator=generator).cuda()
        router_parts = torch.randn(slots, heads, width, head_dim, generator=generator).cuda()
        norm = torch.ones(head_dim, device="cuda", dtype=torch.bfloat16)
        router = torch.ones(heads, head_dim, num_subnetworks, device="cuda", dtype=torch.bfloat16)
        kernel = layer.finish_gate_gradients(norm_parts, router_parts, norm, router, tokens)
        torch_ops = layer.gate_gradient_sums_reference(norm_parts, router_parts, norm, router)
        error = max(rel_err(a, b) for a, b in zip(kernel, torch_ops))
        row = {"shape": name, "slots": slots, "heads": heads, "rel_err": error,
               "kernel_us": 1e3 * bench_ms(lambda: layer.finish_gate_gradients(norm_parts, router_parts, norm, router,
                                                                                 tokens)),
               "torch_us": 1e3 * bench_ms(lambda: layer.gate_gradient_sums_reference(norm_parts, router_parts, norm,
                                                                                      router))}
        log(f"{name}: partial sums {row['kernel_us']:.1f} us (kernel) against {row['torch_us']:.1f} us (PyTorch), "
            f"rel. error {error:.1e}")
        rows.append(row)
    results = {"environment": environment(), "rows": rows}
    lines = [f"# The norm/gate backward's partial sums added up ({results['environment']['device']})", "",
             *markdown_table(["shape", "slots x heads", "kernel us", "PyTorch us", "rel. error"],
                             [[r["shape"], f"{r['slots']} x {r['heads']}", f"{r['kernel_us']:.1f}",
                               f"{r['torch_us']:.1f}", f"{r['rel_err']:.1e}"] for r in rows]), ""]
    write_report(out, "gate_gradient_sums", results, "\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--profile", choices=[f"{role}:{shape[0]}" for role in ("forward", "backward")
                                              for shape in SHAPES],
                        help="only launch one kernel twice at its production settings (for Nsight Compute)")
    parser.add_argument("--sums", action="store_true",
                        help="only time the partial sums' finishing kernel against PyTorch's reductions")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this sweep times GPU kernels")
    if args.profile:
        profile(*args.profile.split(":"))
        return 0
    if not args.out:
        parser.error("--out is required for the sweep")
    if args.sums:
        partial_sums(args.out)
        return 0
    results = {"environment": environment(), "rows": [], "copy_us": {},
               "production": {"precision": PRODUCTION_PRECISION, "forward": layer.GATES_LAUNCH,
                              "backward": layer.GATES_BACKWARD_LAUNCH}}
    for shape in SHAPES:
        try:
            rows, copy_us = sweep(shape)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            continue
        results["rows"] += rows
        results["copy_us"][shape[0]] = copy_us
        write_json(os.path.join(args.out, "flash_mhf_layer_tune.json"), results)
    write_report(args.out, "flash_mhf_layer_tune", results, report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
