"""Launch settings of the FlashMHF layer's norm/gate kernels (`hf_memffn/flash_mhf_layer_triton.py`), timed at the
370M and 1.3B training shapes (one GPU call).

    PYTHONPATH=. python kernels/tune_flash_mhf_layer.py --out DIR      # DIR/flash_mhf_layer_tune.{json,md}
    PYTHONPATH=. python kernels/tune_flash_mhf_layer.py --profile backward:1.3B   # two production launches, for ncu
    PYTHONPATH=. python kernels/tune_flash_mhf_layer.py --sums --out DIR   # the partial sums' kernel against PyTorch
    PYTHONPATH=. python kernels/tune_flash_mhf_layer.py --decode --out DIR [--other-package OTHER]   # decode kernel

For each shape it times the forward kernel (queries and gates from the input projection's output) and the backward
kernel (their gradients), first across router-product precisions at the production launch, then across launch
settings at the production precision (tokens per program and warps; for the backward also programs per
multiprocessor, software-pipelining stages, and whether the router's gradient is the product q^T dl or, transposed,
dl^T q). Every candidate's
outputs are checked against a float64 PyTorch computation of the same maths before it is timed; a candidate that
fails to compile or to match is reported, not timed. A copy of the kernel's input (`p.clone()`) is timed beside them:
both kernels read and write about that many bytes (the backward twice), so it is their floor.

`--decode` sweeps the decode kernel's launch (`DECODE_LAUNCH`: columns per step, warps, pipelining stages, programs
per multiprocessor, whether the first weight tiles are asked for before the norm and gates) at the presets' FlashMHF
layers, one token per row at 1, 4, 16 and 64 rows, as `decode_forward` runs it (the splits' sum included). A
decoding step reads every layer's weights once, from HBM: each call here gets a weight copy of its own, as many copies
as make three times the L2 cache, all called in one CUDA graph. For scale, a PyTorch sum over each copy (one kernel
reading the same bytes) is timed the same way. With `--other-package OTHER` (a copy of an earlier commit's package,
`git archive <commit> hf_memffn | tar -x -C OTHER`) its `decode_forward` is timed beside, at its own launch settings.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
import os
import sys
import traceback
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    bench_ms, environment, graph_ms, log, markdown_table, output_folder, rel_err, write_json, write_report,
)

from hf_memffn import flash_mhf_layer_triton as layer  # noqa: E402
from hf_memffn.flash_mhf_op import flash_mhf_layer_reference  # noqa: E402
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


def check_and_time(row: dict, run, expected, time_us) -> None:
    """Fills ``row`` with the largest relative error of ``run()``'s outputs against ``expected`` and, if it is within
    TOLERANCE, with ``time_us()``; a launch that fails to compile or to match gets ``row["error"]`` instead (a result
    of the sweep, not its end)."""
    try:
        row["rel_err"] = max(rel_err(a, b) for a, b in zip(run(), expected))
        if not row["rel_err"] < TOLERANCE:
            row["error"] = f"relative error {row['rel_err']:.2e} above {TOLERANCE}"
        else:
            row["us"] = time_us()
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def candidate_rows(shape, truth, tensors, role: str, settings) -> list[dict]:
    name, tokens, heads, head_dim, num_subnetworks = shape
    p, norm, router, grad_q, grad_r = tensors
    rows = []
    for launch, precision in settings:
        row = {"shape": name, "kernel": role, "precision": precision, **launch}
        if role == "forward":
            def run():
                return layer.queries_and_gates(p, norm, router, head_dim, num_subnetworks, EPS, GATE_EPS,
                                               launch=launch, precision=precision)
            expected = truth[:2]
        else:
            def run():
                return layer.queries_and_gates_backward(p, norm, router, grad_q, grad_r, head_dim, EPS, GATE_EPS,
                                                        launch=launch, precision=precision)
            expected = truth[2:]
        check_and_time(row, run, expected, lambda: bench_ms(run) * 1e3)
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


# The decode kernel. (name, heads (= weight groups), head_dim, num_subnetworks, subnetwork_size): the presets' layers
DECODE_SHAPES = [("370M", 8, 128, 7, 384), ("1.3B", 16, 128, 15, 384)]
DECODE_ROWS = (1, 4, 16, 64)
# The first sweep (`results/models/h100_decode_tune_first_sweep.md`: 32/64/128 columns x 4/8 warps x 1/2/4 programs
# per multiprocessor x the first tiles before/after the gates, 3 stages) found 128 columns and 8 warps slower
# everywhere; this sweep keeps the rest and adds the pipelining depth. With `--decode-wide` it runs the first sweep.
DECODE_LAUNCHES = [
    {"block_n": n, "num_warps": 4, "num_stages": st, "programs_per_sm": pps, "weights_first": True}
    for n, st, pps in itertools.product((32, 64), (2, 3), (1, 2, 4))
] + [{**layer.DECODE_LAUNCH, "weights_first": False}]
DECODE_LAUNCHES_WIDE = [
    {"block_n": n, "num_warps": w, "num_stages": 3, "programs_per_sm": pps, "weights_first": first}
    for n, w, pps, first in itertools.product((32, 64, 128), (4, 8), (1, 2, 4), (False, True))
]


def other_layer_module(directory: str):
    """`flash_mhf_layer_triton` of the hf_memffn package in ``directory``, imported under another name (its
    ``__init__``, which registers the architectures, is not run)."""
    name = "hf_memffn_other"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(os.path.abspath(directory), "hf_memffn")]
        sys.modules[name] = package
    return importlib.import_module(f"{name}.flash_mhf_layer_triton")


def decode_inputs(rows: int, heads: int, head_dim: int, num_subnetworks: int, subnetwork_size: int, copies: int):
    """(p [rows, 1, H * d_h], norm weight, router [H, d_h, E], [K|U|V per weight copy]), bf16 on the GPU; each copy
    is one [3, H, E, d_e, d_h] tensor, as the layer keeps them (`key_up_value`)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to("cuda", torch.bfloat16)

    p = randn(rows, 1, heads * head_dim)
    norm = 1 + randn(head_dim, scale=0.2)
    router = randn(heads, head_dim, num_subnetworks, scale=head_dim**-0.5)
    shape = (heads, num_subnetworks, subnetwork_size, head_dim)
    weights = [randn(3, *shape, scale=head_dim**-0.5) for _ in range(copies)]
    return p, norm, router, weights


def decode_sweep(shape, launches: list[dict], other=None) -> list[dict]:
    name, heads, head_dim, num_subnetworks, subnetwork_size = shape
    weight_bytes = 3 * heads * num_subnetworks * subnetwork_size * head_dim * 2
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(2, math.ceil(3 * l2_bytes / weight_bytes))
    rows_out = []
    for rows in DECODE_ROWS:
        p, norm, router, weights = decode_inputs(rows, heads, head_dim, num_subnetworks, subnetwork_size, copies)
        k, u, v = weights[0].unbind(0)
        truth = flash_mhf_layer_reference(p.double(), norm.double(), router.double(), k.double(), u.double(),
                                          v.double(), head_dim, EPS, GATE_EPS)
        sum_us = graph_ms(lambda: [kuv.sum() for kuv in weights], rep=40) * 1e3 / copies
        log(f"decode {name} rows={rows}: a sum over one layer's weights ({weight_bytes / 1e6:.1f} MB) {sum_us:.2f} us, "
            f"{copies} weight copies")
        candidates = [("this", launch) for launch in launches]
        if other is not None:
            candidates.append(("other", None))
        for package, launch in candidates:
            module = layer if package == "this" else other
            row = {"shape": name, "rows": rows, "package": package, "weights_sum_us": sum_us,
                   **(launch or {"launch": getattr(module, "DECODE_LAUNCH", "DECODE_BLOCK_N=64")})}
            extra = {} if launch is None else {"launch": launch}

            def run_all():  # one call per weight copy
                return [module.decode_forward(p, norm, router, *kuv.unbind(0), EPS, GATE_EPS, **extra)
                        for kuv in weights]

            check_and_time(row, lambda: (module.decode_forward(p, norm, router, k, u, v, EPS, GATE_EPS, **extra),),
                           (truth,), lambda: graph_ms(run_all, rep=40) * 1e3 / copies)
            log(f"decode {name} rows={rows} {package} {launch or ''}: "
                + (f"{row['us']:.2f} us (rel err {row['rel_err']:.1e})" if "us" in row else row["error"]))
            rows_out.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows_out


def decode_report(results: dict) -> str:
    env = results["environment"]
    lines = [f"# FlashMHF decode kernel launches on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16. `decode_forward` per call, each call on a weight "
             f"copy of its own (HBM, not L2), median of CUDA-graph replays. Production: `{results['production']}`.",
             ""]
    summary = []
    for shape in DECODE_SHAPES:
        for rows in DECODE_ROWS:
            timed = [r for r in results["rows"] if r["shape"] == shape[0] and r["rows"] == rows and "us" in r]
            if not timed:
                continue
            ours = [r for r in timed if r["package"] == "this"]
            best = min(ours, key=lambda r: r["us"]) if ours else None
            production = next((r for r in timed if r["package"] == "this"
                               and all(r[key] == value for key, value in results["production"].items())), None)
            other = next((r for r in timed if r["package"] == "other"), None)
            summary.append([shape[0], rows, f"{timed[0]['weights_sum_us']:.2f}", fmt_us(production), fmt_us(other),
                            fmt_us(best), "-" if best is None else launch_text(best)])
    lines += markdown_table(["layer", "rows", "sum over the weights us", "production us", "other package us",
                             "fastest us", "fastest launch"], summary)
    lines += ["", "## Every launch", ""]
    lines += markdown_table(
        ["layer", "rows", "launch", "us", "rel. error"],
        [[r["shape"], r["rows"], "other package" if r["package"] == "other" else launch_text(r),
          f"{r['us']:.2f}" if "us" in r else r.get("error", "-"),
          f"{r['rel_err']:.1e}" if "rel_err" in r else "-"] for r in results["rows"]])
    return "\n".join(lines) + "\n"


def fmt_us(row) -> str:
    return "-" if row is None else f"{row['us']:.2f}"


def launch_text(row) -> str:
    return (f"{row['block_n']} cols, {row['num_warps']} warps, {row['num_stages']} stages, "
            f"{row['programs_per_sm']}/SM, weights {'first' if row['weights_first'] else 'after gates'}")


def decode(out: str, other_dir: str | None, wide: bool = False) -> None:
    other = other_layer_module(other_dir) if other_dir else None
    launches = DECODE_LAUNCHES_WIDE if wide else DECODE_LAUNCHES
    results = {"environment": environment(), "production": layer.DECODE_LAUNCH, "rows": [],
               "other_package": other_dir}
    for shape in DECODE_SHAPES:
        try:
            results["rows"] += decode_sweep(shape, launches, other)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        write_json(os.path.join(out, "flash_mhf_decode_tune.json"), results)
    write_report(out, "flash_mhf_decode_tune", results, decode_report(results))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder)
    parser.add_argument("--profile", choices=[f"{role}:{shape[0]}" for role in ("forward", "backward")
                                              for shape in SHAPES],
                        help="only launch one kernel twice at its production settings (for Nsight Compute)")
    parser.add_argument("--sums", action="store_true",
                        help="only time the partial sums' finishing kernel against PyTorch's reductions")
    parser.add_argument("--decode", action="store_true", help="only sweep the decode kernel's launch settings")
    parser.add_argument("--decode-wide", action="store_true", help="with --decode: the first, wider sweep")
    parser.add_argument("--other-package", help="with --decode: a directory holding another hf_memffn package, "
                        "whose decode_forward is timed beside")
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
    if args.decode:
        decode(args.out, args.other_package, args.decode_wide)
        return 0
    if args.other_package or args.decode_wide:
        parser.error("--other-package and --decode-wide go with --decode")
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
