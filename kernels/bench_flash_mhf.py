"""Benchmark of the fused FlashMHF op against SwiGLU and the naive multi-head FFN (one GPU, one call).

    PYTHONPATH=. python kernels/bench_flash_mhf.py --out kernels/results

What it does, in order (everything lands in <out>/flash_mhf_bench.json, .md and .png):
1. correctness: Triton output and all five gradients against a float64 reference on the same inputs, for several
   shapes and dtypes, and the paper shape against the PyTorch reference path; timing stops here on failure;
2. the fused op at the paper's 1.3B FFN shape (Table 4) with Table 5's batch and lengths (B=8, H=16, d_h=128, E=15,
   d_e=384, L in 1536..16128, bf16; Table 5 itself times E=22): forward and
   forward+backward time, TFLOP/s (forward FLOPs = 6 B L H E d_e d_h, forward+backward = 3x) and peak memory,
   plus each backward kernel alone;
3. modules at d_model 2048: the FlashMHF FFN module (projections, query norm, router, op), eager, compiled and
   under activation checkpointing (its FLOPs counted once); SwiGLU (d_ff 5504, the paper's 1.3B baseline) eager and
   compiled; the naive materialising MH-FFN (only where it fits in memory);
4. decoding (L=1, batch 1..64): latency of the FlashMHF module and the op against SwiGLU (CUDA graphs);
5. a compiled training step of a tiny FlashMHFLlama model (when the package provides it).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (  # noqa: E402
    bench_ms, graph_ms, log, output_folder, peak_memory, refuse_counts_below, rel_err, save_figure, timed, write_json,
    write_text,
)
from hf_memffn import flash_mhf_gluon  # noqa: E402
from hf_memffn import flash_mhf_triton as kernels  # noqa: E402
from hf_memffn.flash_mhf_op import flash_mhf, flash_mhf_dense, flash_mhf_path  # noqa: E402

PAPER = dict(batch=8, num_heads=16, head_dim=128, num_subnetworks=15, subnetwork_size=384, d_model=2048)
SWIGLU_D_FF = 5504
LENGTHS = (1536, 4032, 8064, 16128)
DECODE_BATCHES = (1, 4, 16, 64)
ROUNDS = 3  # timings of the op per length (median reported)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def op_inputs(batch, num_heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, dtype, device="cuda"):
    q = torch.randn(batch, num_heads, seq_len, head_dim, device=device, dtype=dtype)
    weights = [
        (torch.randn(kv_heads, num_subnetworks, subnetwork_size, head_dim, device=device) * head_dim**-0.5).to(dtype)
        for _ in range(3)
    ]
    r = torch.softmax(torch.randn(batch, num_heads, seq_len, num_subnetworks, device=device), -1)
    return [q, *weights, r]


def op_flops(batch, num_heads, seq_len, head_dim, num_subnetworks, subnetwork_size) -> float:
    return 6.0 * batch * seq_len * num_heads * num_subnetworks * subnetwork_size * head_dim


# ------------------------------------------------------------------------------------------------------------
# 1. correctness
# ------------------------------------------------------------------------------------------------------------
def errors_against_reference(inputs) -> list[float]:
    """Relative errors of the Triton op's output and five gradients against the PyTorch reference path run in
    float32 on the same (q, k, u, v, r) and the same random incoming gradient."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = flash_mhf(*leaves, impl="triton")
    grad = torch.randn_like(out)
    out.backward(grad)
    reference = [t.float().clone().requires_grad_() for t in inputs]
    out_ref = flash_mhf(*reference, impl="torch")
    out_ref.backward(grad.float())
    return [rel_err(out, out_ref)] + [rel_err(a.grad, b.grad) for a, b in zip(leaves, reference)]


def check_correctness(results) -> bool:
    cases = [
        # (B, H, L, d_h, H_kv, E, d_e)
        (2, 4, 1, 128, 4, 3, 384),
        (2, 4, 37, 128, 2, 3, 48),
        (1, 2, 129, 64, 1, 1, 64),
        (2, 2, 200, 256, 2, 2, 96),
        (3, 8, 77, 128, 8, 15, 384),
    ]
    ok = True
    for index, case in enumerate(cases):
        for dtype in (torch.bfloat16, torch.float16, torch.float32) if index in (1, 4) else (torch.bfloat16,):
            torch.manual_seed(hash((case, str(dtype))) % 2**31)
            batch, num_heads, seq_len, head_dim, kv_heads, e, d_e = case
            exact = [t.double().requires_grad_() for t in op_inputs(batch, num_heads, seq_len, head_dim, kv_heads, e, d_e, torch.float32)]
            out_ref = flash_mhf_dense(*exact)
            grad = torch.randn_like(out_ref)
            out_ref.backward(grad)
            inputs = [t.detach().to(dtype if i < 4 else torch.float32).requires_grad_() for i, t in enumerate(exact)]
            out = flash_mhf(*inputs, impl="triton")
            out.backward(grad.to(dtype))
            errors = [rel_err(out, out_ref)] + [rel_err(x.grad, t.grad) for x, t in zip(inputs, exact)]
            passed = all(math.isfinite(x) and x < TOLERANCE[dtype] for x in errors)
            ok &= passed
            results["correctness"].append({"shape": case, "dtype": str(dtype), "rel_err_out_dq_dk_du_dv_dr": errors, "passed": passed})
            log(f"check {case} {dtype}: {'ok' if passed else 'FAIL'} " + " ".join(f"{x:.1e}" for x in errors))
    # the paper shape (one batch) against the PyTorch reference path in float32
    torch.manual_seed(0)
    errors = errors_against_reference(op_inputs(1, 16, 1536, 128, 16, 15, 384, torch.bfloat16))
    passed = all(x < TOLERANCE[torch.bfloat16] for x in errors)
    ok &= passed
    results["correctness"].append({"shape": "paper B=1 L=1536 vs torch reference (fp32)", "dtype": "bfloat16", "rel_err_out_dq_dk_du_dv_dr": errors, "passed": passed})
    log(f"check paper shape vs reference: {'ok' if passed else 'FAIL'} " + " ".join(f"{x:.1e}" for x in errors))
    return ok


# ------------------------------------------------------------------------------------------------------------
# 2. the op
# ------------------------------------------------------------------------------------------------------------
def kernel_report():
    """Registers, spills and shared memory of every compiled kernel variant (from triton's cache)."""
    report = []
    for name in ("_forward_kernel", "_backward_rows_kernel", "_backward_weights_kernel"):
        fn = getattr(kernels, name)
        caches = getattr(fn, "device_caches", None) or {}
        for device_cache in caches.values():
            cache = device_cache[0] if isinstance(device_cache, tuple) else device_cache
            for key, compiled in cache.items():
                try:
                    report.append({"kernel": name, "n_regs": compiled.n_regs, "n_spills": compiled.n_spills,
                                   "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
                                   "num_stages": compiled.metadata.num_stages, "key": str(key)[-160:]})
                except Exception:  # noqa: BLE001
                    pass
    for name in ("_forward_tuned", "_backward_rows_tuned", "_backward_weights_tuned"):
        tuner = getattr(kernels, name)
        timings = getattr(tuner, "configs_timings", None) or {}
        report.append({"autotuner": name, "cache": {str(k): str(v) for k, v in tuner.cache.items()},
                       "timings_ms": {str(c): [float(x) for x in t] if isinstance(t, (list, tuple)) else float(t) for c, t in timings.items()}})
    return report


def bench_op(results, lengths):
    """The fused op at the paper shape for every length, then its backward kernels alone at L=4032."""
    for seq_len in lengths:
        results["op"].append(op_row(seq_len))
    results["backward_kernels"] = kernel_times()


def op_row(seq_len: int) -> dict:
    """Forward, forward+backward and backward of the op at one length, ROUNDS times each in turn; peak memory."""
    shape = dict(batch=PAPER["batch"], num_heads=16, seq_len=seq_len, head_dim=128, num_subnetworks=15, subnetwork_size=384)
    torch.manual_seed(0)
    q, k, u, v, r = op_inputs(8, 16, seq_len, 128, 16, 15, 384, torch.bfloat16)
    flops = op_flops(8, 16, seq_len, 128, 15, 384)
    leaves = [t.requires_grad_() for t in (q, k, u, v, r)]
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            flash_mhf(*leaves, impl="triton")

    def train():
        flash_mhf(*leaves, impl="triton").backward(grad)

    def backward():
        kernels.triton_backward(grad, *(t.detach() for t in leaves))

    # the three timed in turn, ROUNDS times: the clock drifts over seconds, so each reported time is the median
    # of its rounds (each round a do_bench median) and every round is kept with its clock
    rounds = []
    for _ in range(ROUNDS):
        rounds.append({"forward": timed(forward), "train": timed(train, grad_to_none=leaves),
                       "backward": timed(backward)})
    forward_ms, train_ms, rows_ms = (statistics.median(t[name]["ms"] for t in rounds)
                                     for name in ("forward", "train", "backward"))
    clocks = [t["train"]["sm_clock_mhz"] for t in rounds if t["train"]["sm_clock_mhz"]]
    mem = peak_memory(train, leaves=leaves, held=[grad])
    row = {
        "impl": "fused op (triton)", **shape, "forward_ms": forward_ms, "forward_tflops": flops / forward_ms * 1e-9,
        "train_ms": train_ms, "train_tflops": 3 * flops / train_ms * 1e-9, "backward_ms": rows_ms,
        "backward_tflops_counted_2x": 2 * flops / rows_ms * 1e-9, **mem,
        "train_tflops_rounds": [3 * flops / t["train"]["ms"] * 1e-9 for t in rounds],
        "train_sm_clock_mhz": statistics.median(clocks) if clocks else None, "rounds": rounds,
    }
    log(f"op L={seq_len}: fwd {forward_ms:.3f} ms {row['forward_tflops']:.0f} TFLOP/s | fwd+bwd {train_ms:.3f} ms "
        f"{row['train_tflops']:.0f} TFLOP/s (rounds " + " / ".join(f"{x:.0f}" for x in row["train_tflops_rounds"])
        + f", SM clock {row['train_sm_clock_mhz'] or float('nan'):.0f} MHz) | bwd {rows_ms:.3f} ms | "
        f"peak {mem['peak_gib']:.2f} GiB")
    return row


def kernel_times() -> dict:
    """The three kernels the op runs at L=4032 (forward, dq/dr, dK/dU/dV), and the Triton ones beside them."""
    q, k, u, v, r = op_inputs(8, 16, 4032, 128, 16, 15, 384, torch.bfloat16)
    grad = torch.randn_like(q)
    flops = op_flops(8, 16, 4032, 128, 15, 384)
    p = kernels._problem(q, k)
    strides = (*kernels._row_strides(q), *kernels._row_strides(grad))
    constants = dict(D_H=128, D_E=384, **kernels._kernel_flags(q.dtype))
    bucket = kernels._tune_bucket(p["total_rows"] * p["kv_heads"])
    dq, dr = torch.empty_like(q), torch.empty_like(r)
    dk, du, dv = (torch.empty_like(k) for _ in range(3))

    out = torch.empty_like(q)
    forward_descriptors = kernels._use_tensor_descriptors(q.device, None)
    k_forward, u_forward, v_forward = ((kernels._weight_descriptor(w, 64) for w in (k, u, v)) if forward_descriptors
                                       else (k, u, v))

    def triton_forward():
        kernels._forward_tuned[lambda m: (triton_cdiv(p["total_rows"], m["BLOCK_L"]), 16, 1)](
            q, k_forward, u_forward, v_forward, r, out, *kernels._row_strides(q), *kernels._row_strides(out),
            *p["sizes"], 1, bucket, ACCUMULATE=False, TENSOR_DESCRIPTORS=forward_descriptors, **constants)

    def gluon_forward():
        flash_mhf_gluon.gluon_forward(q, k, u, v, r, out=out)

    def triton_rows():
        kernels._backward_rows_tuned[lambda m: (triton_cdiv(p["total_rows"], m["BLOCK_L"]), 16)](
            q, k, u, v, r, grad, dq, dr, *strides, *p["sizes"], bucket, E_POW2=16, **constants)

    def gluon_rows():
        flash_mhf_gluon.gluon_rows_gradients(grad, q, k, u, v, r, outputs=(dq, dr))

    # as triton_backward launches it: q and dO through tensor descriptors on Hopper (block shapes set by the tuner)
    descriptors = kernels._use_tensor_descriptors(q.device, None)
    q_rows, grad_rows = (kernels._sequence_descriptor(t, 128) for t in (q, grad)) if descriptors else (q, grad)

    def triton_weights():
        kernels._backward_weights_tuned[lambda m: (15 * 384 // m["BLOCK_N"], 16, 1)](
            q_rows, k, u, v, r, grad_rows, dk, du, dv, *strides, *p["sizes"], 1, bucket, ACCUMULATE=False,
            TENSOR_DESCRIPTORS=descriptors, **constants)

    def gluon_weights():
        flash_mhf_gluon.gluon_weight_gradients(grad, q, k, u, v, r, outputs=[dk, du, dv])

    # the backward kernels the op runs here (kernels.row_gradient_kernel, kernels.weight_gradient_kernel), and the
    # Triton ones beside them
    forward_kernel = kernels.forward_kernel(q, k)
    rows_kernel, weights_kernel = kernels.row_gradient_kernel(q, k), kernels.weight_gradient_kernel(q, k)
    forward_ms = bench_ms(gluon_forward if forward_kernel == "gluon" else triton_forward)
    triton_forward_ms = bench_ms(triton_forward) if forward_kernel == "gluon" else forward_ms
    rows_ms = bench_ms(gluon_rows if rows_kernel == "gluon" else triton_rows)
    triton_rows_ms = bench_ms(triton_rows) if rows_kernel == "gluon" else rows_ms
    weights_ms = bench_ms(gluon_weights if weights_kernel == "gluon" else triton_weights)
    triton_weights_ms = bench_ms(triton_weights) if weights_kernel == "gluon" else weights_ms
    # FLOPs actually executed: rows kernel 5 GEMMs (M, N, dA, dq x2), weights kernel 6 (M, N, dA, dK, dU, dV)
    unit = flops / 3
    times = {
        "L": 4032, "forward_kernel": forward_kernel, "forward_kernel_ms": forward_ms,
        "forward_kernel_tflops_executed": 3 * unit / forward_ms * 1e-9, "triton_forward_kernel_ms": triton_forward_ms,
        "rows_kernel": rows_kernel, "rows_kernel_ms": rows_ms,
        "rows_kernel_tflops_executed": 5 * unit / rows_ms * 1e-9, "triton_rows_kernel_ms": triton_rows_ms,
        "weights_kernel": weights_kernel, "weights_kernel_ms": weights_ms,
        "weights_kernel_tflops_executed": 6 * unit / weights_ms * 1e-9, "triton_weights_kernel_ms": triton_weights_ms,
    }
    log(f"forward kernel L=4032 ({forward_kernel}) {forward_ms:.3f} ms ({3 * unit / forward_ms * 1e-9:.0f} TFLOP/s; "
        f"Triton kernel {triton_forward_ms:.3f} ms)")
    log(f"backward kernels L=4032: dq/dr ({rows_kernel}) {rows_ms:.3f} ms ({5 * unit / rows_ms * 1e-9:.0f} TFLOP/s "
        f"executed; Triton kernel {triton_rows_ms:.3f} ms), dK/dU/dV ({weights_kernel}) {weights_ms:.3f} ms "
        f"({6 * unit / weights_ms * 1e-9:.0f} TFLOP/s executed; Triton kernel {triton_weights_ms:.3f} ms)")
    return times


def triton_cdiv(a, b):
    return (a + b - 1) // b


# ------------------------------------------------------------------------------------------------------------
# 3. modules
# ------------------------------------------------------------------------------------------------------------
class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LocalFlashMHF(nn.Module):
    """The FlashMHF FFN built from the op (used when the package's module is not there)."""

    def __init__(self, d_model, num_heads, num_subnetworks, subnetwork_size, kernel="triton", dense=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.in_proj = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.router = nn.Parameter(torch.randn(num_heads, self.head_dim, num_subnetworks) * 0.02)
        shape = (num_heads, num_subnetworks, subnetwork_size, self.head_dim)
        self.key, self.up, self.value = (nn.Parameter(torch.randn(shape) * 0.02) for _ in range(3))
        self.kernel, self.dense = kernel, dense

    def forward(self, x):
        batch, length, _ = x.shape
        q = self.in_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        q = (F.rms_norm(q.float(), (self.head_dim,), eps=1e-6) * self.norm_weight).to(x.dtype)
        scores = torch.sigmoid(torch.einsum("bhld,hde->bhle", q.float(), self.router.float()))
        gates = scores / (scores.sum(-1, keepdim=True) + 1e-6)
        if self.dense:
            heads = flash_mhf_dense(q, self.key.to(q.dtype), self.up.to(q.dtype), self.value.to(q.dtype), gates.to(q.dtype))
        else:
            heads = flash_mhf(q, self.key, self.up, self.value, gates, impl=self.kernel)
        return self.out_proj(heads.transpose(1, 2).reshape(batch, length, -1))


class CheckpointedModule(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


class TokenChunkedRecompute(nn.Module):
    """The package module with `ffn_recompute_chunk_tokens` set: only the input is kept for the backward pass and the
    activations are recomputed chunk by chunk of tokens (`hf_memffn.ffn_multihead.recompute_in_token_chunks`)."""

    def __init__(self, inner, chunk_tokens):
        super().__init__()
        self.inner = inner
        self.chunk_tokens = chunk_tokens

    def forward(self, x):
        from hf_memffn.ffn_multihead import recompute_in_token_chunks

        if not torch.is_grad_enabled():
            return self.inner(x)
        return recompute_in_token_chunks(self.inner, x, self.chunk_tokens)


RECOMPUTE_CHUNK_TOKENS = (2048, 4096)


def package_flash_mhf_module():
    """The package's FlashMHF FFN at the paper's size, or None if it is not importable."""
    try:
        from hf_memffn import FlashMHFLlamaConfig
        from hf_memffn.ffn_multihead import FlashMHFFeedForward
    except Exception as exc:  # noqa: BLE001
        log(f"package FlashMHF module unavailable ({exc!r}); using the benchmark's own module")
        return None
    config = FlashMHFLlamaConfig(
        hidden_size=PAPER["d_model"], intermediate_size=PAPER["num_subnetworks"] * PAPER["subnetwork_size"],
        num_attention_heads=16, num_key_value_heads=16, ffn_num_heads=PAPER["num_heads"],
        ffn_num_subnetworks=PAPER["num_subnetworks"], ffn_kernel="triton",
    )
    module = FlashMHFFeedForward(config)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02)
    return module


def module_rows(results, lengths, compile_modules):
    d_model = PAPER["d_model"]
    package_module = package_flash_mhf_module()
    flash_name = "FlashMHF module (hf_memffn.ffn)" if package_module is not None else "FlashMHF module (bench-local)"
    flash_module = package_module if package_module is not None else LocalFlashMHF(d_model, 16, 15, 384)
    modules = {
        flash_name: flash_module,
        f"SwiGLU d_ff={SWIGLU_D_FF}": SwiGLU(d_model, SWIGLU_D_FF),
        "naive MH-FFN (materialising)": LocalFlashMHF(d_model, 16, 15, 384, dense=True),
    }
    for module in modules.values():
        module.to("cuda", torch.bfloat16)
    variants = [(name, module, False) for name, module in modules.items()]
    # the same module with activation checkpointing: only its input is kept for the backward pass
    checkpointed = CheckpointedModule(modules[flash_name])
    variants.insert(1, (flash_name + " + activation checkpointing", checkpointed, False))
    if package_module is not None:
        for chunk_tokens in RECOMPUTE_CHUNK_TOKENS:
            chunked = TokenChunkedRecompute(modules[flash_name], chunk_tokens)
            variants.insert(1, (f"{flash_name} + token-chunked recompute ({chunk_tokens})", chunked, False))
    if compile_modules:
        variants.insert(1, (flash_name + " compiled", torch.compile(modules[flash_name], dynamic=True, fullgraph=True), True))
        variants.insert(3, (f"SwiGLU d_ff={SWIGLU_D_FF} compiled", torch.compile(modules[f"SwiGLU d_ff={SWIGLU_D_FF}"], dynamic=True), True))
    op_flop = lambda seq_len: op_flops(8, 16, seq_len, 128, 15, 384)  # noqa: E731
    for seq_len in lengths:
        tokens = PAPER["batch"] * seq_len
        for name, module, _ in variants:
            if name.startswith("naive") and seq_len > 1536:
                results["module"].append({"module": name, "L": seq_len, "skipped": "materialises [B,H,L,E*d_e]: out of memory"})
                continue
            if name.startswith("SwiGLU"):
                flops = 6.0 * tokens * d_model * SWIGLU_D_FF
            else:
                flops = op_flop(seq_len) + 2 * 2 * tokens * d_model * d_model
            try:
                x = torch.randn(PAPER["batch"], seq_len, d_model, device="cuda", dtype=torch.bfloat16) * 0.5
                grad = torch.randn_like(x)
                with torch.no_grad():
                    forward_ms = bench_ms(lambda: module(x))
                x.requires_grad_(True)
                params = list(module.parameters())

                def train():
                    module(x).backward(grad)

                train_ms = bench_ms(train, grad_to_none=[x, *params])
                mem = peak_memory(train, leaves=[x, *params], held=[grad])
                row = {"module": name, "L": seq_len, "forward_ms": forward_ms, "forward_tflops": flops / forward_ms * 1e-9,
                       "train_ms": train_ms, "train_tflops": 3 * flops / train_ms * 1e-9, **mem}
                log(f"module {name} L={seq_len}: fwd {forward_ms:.3f} ms ({row['forward_tflops']:.0f}) | fwd+bwd {train_ms:.3f} ms "
                    f"({row['train_tflops']:.0f}) | peak {mem['peak_gib']:.2f} GiB")
            except torch.cuda.OutOfMemoryError:
                row = {"module": name, "L": seq_len, "skipped": "out of memory"}
                log(f"module {name} L={seq_len}: out of memory")
            results["module"].append(row)
            x = grad = None
            for p in module.parameters():
                p.grad = None
            torch.cuda.empty_cache()
    return modules, flash_name


def decode_rows(results, modules, flash_name):
    d_model = PAPER["d_model"]
    flash, swiglu = modules[flash_name], modules[f"SwiGLU d_ff={SWIGLU_D_FF}"]
    for batch in DECODE_BATCHES:
        x = torch.randn(batch, 1, d_model, device="cuda", dtype=torch.bfloat16)
        q, k, u, v, r = op_inputs(batch, 16, 1, 128, 16, 15, 384, torch.bfloat16)
        with torch.no_grad():
            row = {
                "batch": batch,
                "flash_module_us": graph_ms(lambda: flash(x)) * 1e3,
                "op_us": graph_ms(lambda: flash_mhf(q, k, u, v, r, impl="triton")) * 1e3,
                "swiglu_us": graph_ms(lambda: swiglu(x)) * 1e3,
                "flash_module_us_no_graph": bench_ms(lambda: flash(x)) * 1e3,
                "swiglu_us_no_graph": bench_ms(lambda: swiglu(x)) * 1e3,
            }
        results["decode"].append(row)
        log(f"decode batch={batch}: FlashMHF module {row['flash_module_us']:.1f} us (op {row['op_us']:.1f}) | SwiGLU {row['swiglu_us']:.1f} us")


def compiled_training_step(results):
    try:
        from hf_memffn import FlashMHFLlamaForCausalLM
        from hf_memffn.testing import tiny_config
    except Exception as exc:  # noqa: BLE001
        results["compiled_training_step"] = {"skipped": f"package model unavailable: {exc!r}"}
        return
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # d_h = 256 / 4 = 64 and d_e = 128 / 2 = 64: shapes the kernels support
    config = tiny_config("flash_mhf", hidden_size=256, intermediate_size=128, ffn_num_heads=4, ffn_num_subnetworks=2,
                         ffn_num_kv_heads=2, ffn_kernel="triton")
    torch.manual_seed(0)
    model = FlashMHFLlamaForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 33), device="cuda")
    eager_loss = model(input_ids=ids, labels=ids).loss
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    grad_err = max(rel_err(p.grad, eager_grads[n]) for n, p in model.named_parameters() if n in eager_grads and "mlp" in n)
    optimizer.step()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    ffn = model.model.layers[0].mlp
    ffn_compiled = torch.compile(ffn, fullgraph=True)
    h = torch.randn(2, 33, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ffn_compiled(h).sum().backward()
    results["compiled_training_step"] = {
        "eager_loss": float(eager_loss), "compiled_loss": float(loss), "max_rel_err_ffn_grads_compiled_vs_eager": grad_err,
        "graph_breaks": {str(k): v for k, v in breaks.items()}, "ffn_fullgraph_fwd_bwd": "ok",
    }
    log(f"compiled training step: loss eager {float(eager_loss):.4f} compiled {float(loss):.4f}, "
        f"FFN grad rel err {grad_err:.1e}, graph breaks {sum(breaks.values())}, FFN fullgraph fwd+bwd ok")


# ------------------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------------------
def write_outputs(results, out_dir):
    write_json(os.path.join(out_dir, "flash_mhf_bench.json"), results)
    lines = [f"# FlashMHF benchmark on {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}; bf16; B=8, H=16, d_h=128, E=15, d_e=384, d_model=2048. "
             "TFLOP/s: forward FLOPs = 6 B L H E d_e d_h (+ 4 B L d^2 for the module projections; SwiGLU 6 B L d d_ff), "
             "forward+backward = 3x forward. Peak memory = what one forward+backward allocates at its peak, plus the "
             "module's (or op's) parameters, its inputs and the incoming gradient; stale gradients are cleared first "
             "and the other benchmarked modules' weights are not counted.", ""]
    if results["op"]:
        lines += ["## Fused op", "", "Forward, forward+backward and backward were timed in turn, three rounds; each time is the median of its "
                  "rounds. The SM clock is the median over the forward+backward rounds of nvidia-smi's reading (every 50 ms).", "",
                  "| L | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd TFLOP/s per round | SM clock MHz | peak GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results["op"]:
            per_round = " / ".join(f"{x:.0f}" for x in r.get("train_tflops_rounds", []))
            clock = f"{r['train_sm_clock_mhz']:.0f}" if r.get("train_sm_clock_mhz") else "-"
            lines.append(f"| {r['seq_len']} | {r['forward_ms']:.3f} | {r['forward_tflops']:.0f} | {r['train_ms']:.3f} | "
                         f"{r['train_tflops']:.0f} | {per_round or '-'} | {clock} | {r['peak_gib']:.2f} |")
    if results.get("backward_kernels"):
        b = results["backward_kernels"]
        if "forward_kernel_ms" in b:
            lines += ["", f"Forward kernel at L=4032 ({b['forward_kernel']} kernel) {b['forward_kernel_ms']:.3f} ms "
                      f"({b['forward_kernel_tflops_executed']:.0f} TFLOP/s executed, 3 GEMMs; the Triton forward kernel "
                      f"{b['triton_forward_kernel_ms']:.3f} ms)."]
        lines += ["", f"Backward kernels at L=4032: dq/dr ({b.get('rows_kernel', 'triton')} kernel) {b['rows_kernel_ms']:.3f} ms "
                  f"({b['rows_kernel_tflops_executed']:.0f} TFLOP/s executed, 5 GEMMs; the Triton dq/dr kernel "
                  f"{b.get('triton_rows_kernel_ms', b['rows_kernel_ms']):.3f} ms), "
                  f"dK/dU/dV ({b.get('weights_kernel', 'triton')} kernel) {b['weights_kernel_ms']:.3f} ms "
                  f"({b['weights_kernel_tflops_executed']:.0f} TFLOP/s executed, 6 GEMMs; the Triton weight kernel "
                  f"{b.get('triton_weights_kernel_ms', b['weights_kernel_ms']):.3f} ms)."]
    if results["module"]:
        lines += ["", "## Modules", "", "| module | L | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak GiB |", "|---|---|---|---|---|---|---|"]
        for r in results["module"]:
            if "skipped" in r:
                lines.append(f"| {r['module']} | {r['L']} | - | - | - | - | {r['skipped']} |")
            else:
                lines.append(f"| {r['module']} | {r['L']} | {r['forward_ms']:.3f} | {r['forward_tflops']:.0f} | {r['train_ms']:.3f} | {r['train_tflops']:.0f} | {r['peak_gib']:.2f} |")
    if results["decode"]:
        lines += ["", "## Decoding (L=1), CUDA-graph replay", "", "| batch | FlashMHF module us | op us | SwiGLU us |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['flash_module_us']:.1f} | {r['op_us']:.1f} | {r['swiglu_us']:.1f} |" for r in results["decode"]]
    if results.get("error"):
        lines += ["", "The run stopped at an error (the JSON's `error` holds its traceback); the tables hold what was "
                  "measured before it."]
    md = "\n".join(lines) + "\n"
    write_text(os.path.join(out_dir, "flash_mhf_bench.md"), md)
    try:
        plot(results, os.path.join(out_dir, "flash_mhf_bench.png"))
    except Exception as exc:  # noqa: BLE001
        log(f"plot failed: {exc!r}")
    return md


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    series = {}
    for r in results["op"]:
        series.setdefault("fused op", []).append((r["seq_len"], r["forward_tflops"], r["train_tflops"], r["peak_gib"]))
    for r in results["module"]:
        if "skipped" not in r:
            series.setdefault(r["module"], []).append((r["L"], r["forward_tflops"], r["train_tflops"], r["peak_gib"]))
    for name, points in series.items():
        xs = [p[0] for p in points]
        axes[0].plot(xs, [p[1] for p in points], marker="o", label=name)
        axes[1].plot(xs, [p[2] for p in points], marker="o", label=name)
        axes[2].plot(xs, [p[3] for p in points], marker="o", label=name)
    for ax, title in zip(axes, ("forward TFLOP/s", "forward+backward TFLOP/s", "peak memory fwd+bwd (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (B=8)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"FlashMHF vs SwiGLU, bf16, {results['device']}")
    fig.tight_layout()
    save_figure(fig, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True,
                        help="folder for flash_mhf_bench.{json,md,png} (kernels/results holds the committed run)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--skip", nargs="*", default=[], choices=["modules", "compile", "decode", "train_step"])
    args = parser.parse_args()
    refuse_counts_below(parser, args, lengths=1)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    import triton

    results = {
        "device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "command": " ".join(sys.argv), "correctness": [], "op": [], "module": [], "decode": [],
    }
    # the path depends on shapes, dtype and device only: expanded views, no memory
    paper_q = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16).expand(8, 16, 4032, 128)
    paper_k = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16).expand(16, 15, 384, 128)
    results["path"] = flash_mhf_path(paper_q, paper_k)
    log(f"{results['device']} torch {results['torch']} triton {results['triton']}; path at the paper shape: "
        f"{results['path']}")
    start = time.time()
    sections = [("correctness", None), ("op", None), ("modules", None), ("decode", None), ("train_step", None)]
    try:
        results["correctness_passed"] = check_correctness(results)
        log(f"[{time.time() - start:.0f}s] correctness {'passed' if results['correctness_passed'] else 'FAILED'}")
        if not results["correctness_passed"]:
            write_outputs(results, args.out)
            raise SystemExit(1)
        bench_op(results, args.lengths)
        results["kernel_report"] = kernel_report()
        write_outputs(results, args.out)
        log(f"[{time.time() - start:.0f}s] op done")
        modules = None
        if "modules" not in args.skip:
            modules, flash_name = module_rows(results, args.lengths, "compile" not in args.skip)
            write_outputs(results, args.out)
            log(f"[{time.time() - start:.0f}s] modules done")
        if modules is not None and "decode" not in args.skip:
            decode_rows(results, modules, flash_name)
            log(f"[{time.time() - start:.0f}s] decode done")
        if "train_step" not in args.skip:
            compiled_training_step(results)
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001 - keep what was measured
        results["error"] = traceback.format_exc()
        log(results["error"])
    del sections
    results["seconds"] = time.time() - start
    finish(results, args.out)


def finish(results, out_dir):
    """Writes the results and their table, and prints the table; a run that stopped at an error keeps what it measured
    and ends with exit status 1."""
    print(write_outputs(results, out_dir))
    if results.get("error"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
