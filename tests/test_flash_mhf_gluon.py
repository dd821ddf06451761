"""The Gluon weight-gradient kernel (Hopper only): dK, dU, dV against the float64 ground truth on the GPU, and a
compile for sm_90 on any machine (Gluon has no interpreter, so that is what CPU CI can check)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hf_memffn import flash_mhf_gluon, flash_mhf_triton
from hf_memffn.flash_mhf_op import flash_mhf, flash_mhf_dense, flash_mhf_path

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not (ON_HOPPER and flash_mhf_gluon.GLUON_AVAILABLE),
                                  reason="the Gluon kernel runs on Hopper GPUs only")
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def weight_gradient_truth(q, k, u, v, r, grad_out):
    leaves = [t.double().requires_grad_(True) for t in (q, k, u, v, r)]
    flash_mhf_dense(*leaves).backward(grad_out.double())
    return [leaf.grad for leaf in leaves[1:4]]


def gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, 128, generator=generator)
    k, u, v = (torch.randn(kv_heads, num_subnetworks, subnetwork_size, 128, generator=generator) * 128**-0.5
               for _ in range(3))
    r = torch.rand(batch, heads, seq_len, num_subnetworks, generator=generator)
    r = r / r.sum(-1, keepdim=True)
    grad_out = torch.randn(batch, heads, seq_len, 128, generator=generator)
    q, k, u, v, grad_out = (t.to("cuda", dtype) for t in (q, k, u, v, grad_out))
    return q, k, u, v, r.cuda(), grad_out


@needs_hopper
@pytest.mark.parametrize(
    "batch,heads,seq_len,kv_heads,num_subnetworks,subnetwork_size,dtype",
    [
        pytest.param(2, 2, 200, 2, 3, 64, torch.bfloat16, id="ragged_L-bf16"),
        pytest.param(1, 4, 129, 2, 2, 128, torch.float16, id="two_heads_per_group-L129-fp16"),
        pytest.param(3, 1, 1, 1, 1, 64, torch.bfloat16, id="L1-E1"),
        pytest.param(1, 2, 384, 1, 2, 384, torch.bfloat16, id="de384-one_group"),
    ],
)
def test_gluon_weight_gradients_match_float64(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size,
                                              dtype):
    q, k, u, v, r, grad_out = gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype,
                                           seed=seq_len)
    grads = flash_mhf_gluon.gluon_weight_gradients(grad_out, q, k, u, v, r)[:3]
    expected = weight_gradient_truth(q, k, u, v, r, grad_out)
    errors = {name: relative_error(g, e) for name, g, e in zip(("dk", "du", "dv"), grads, expected)}
    assert all(g.dtype == dtype for g in grads)
    assert all(err < TOLERANCE[dtype] for err in errors.values()), errors


@needs_hopper
def test_gluon_kernel_reads_strided_queries():
    """q as the module makes it (a transposed view of [B, L, H, d_h]) and an unaligned grad_out copy."""
    q, k, u, v, r, grad_out = gluon_inputs(2, 2, 100, 2, 2, 64, torch.bfloat16, seed=3)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    grads = flash_mhf_gluon.gluon_weight_gradients(grad_out, q_strided, k, u, v, r)[:3]
    expected = weight_gradient_truth(q, k, u, v, r, grad_out)
    assert all(relative_error(g, e) < 3e-2 for g, e in zip(grads, expected))


@needs_hopper
def test_op_uses_the_gluon_kernel_where_it_applies_and_says_so():
    generator = torch.Generator().manual_seed(0)
    # 8 weight groups x 24 column blocks of 64: more programs than SMs, and enough rows to autotune
    q = torch.randn(1, 8, 2048, 128, generator=generator).cuda().bfloat16()
    k = (torch.randn(8, 4, 384, 128, generator=generator) * 128**-0.5).cuda().bfloat16()
    assert "Gluon" in flash_mhf_path(q, k)
    assert flash_mhf_triton.weight_gradient_kernel(q, k) == "gluon"
    assert flash_mhf_triton.weight_gradient_kernel(q.float(), k.float()) == "triton"
    assert flash_mhf_triton.weight_gradient_kernel(q[:, :, :16], k) == "triton"  # too small to autotune
    leaves = [t.clone().requires_grad_(True) for t in (q, k, k * 0.5, k * 0.25)]
    r = torch.rand(1, 8, 2048, 4, device="cuda").requires_grad_(True)
    flash_mhf(*leaves, r).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def _ptxas_available() -> bool:
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    except ImportError:
        return False
    return os.path.exists(path) or shutil.which("ptxas") is not None


@pytest.mark.skipif(not (flash_mhf_gluon.GLUON_AVAILABLE and _ptxas_available()),
                    reason="needs triton's Gluon API and ptxas")
def test_gluon_kernel_compiles_for_hopper():
    """Compiled for sm_90 without a GPU: the schedule builds, fits in shared memory and issues its 32 wgmmas per row
    block per warp group (4 products of 8 k-steps: [gate | up], dO V^T, dV, [dK | dU])."""
    report = flash_mhf_gluon.compile_for_hopper(torch.bfloat16, subnetwork_size=384)
    assert report["shared_memory"] <= 227 * 1024, report
    assert report["wgmma_per_row_block"] == 32, report
