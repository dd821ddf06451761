"""The fused FlashMHF layer (query norm, gates and op between the projections) against a float64 ground truth.

The Triton tests run on CUDA in this process, and on CPU in a child pytest under TRITON_INTERPRET=1
(`test_layer_kernels_under_interpreter_in_subprocess`, as in test_flash_mhf_op.py).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch

from hf_memffn import flash_mhf_layer_triton, flash_mhf_op
from hf_memffn.flash_mhf_op import flash_mhf_dense, flash_mhf_layer, flash_mhf_layer_path
from hf_memffn.testing import tiny_config
from triton_interpreter import DEVICE, ON_GPU, cases_by_dtype, needs_kernels, run_under_interpreter

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
EPS, GATE_EPS = 1e-5, 1e-6

# (batch, seq_len, heads, head_dim, kv_heads, num_subnetworks, subnetwork_size, norm, router)
LAYER_CASES = [
    pytest.param((2, 37, 2, 64, 1, 3, 48, True, True), id="ragged-grouped-prologue_path"),
    pytest.param((3, 1, 2, 64, 2, 4, 32, True, True), id="L1-decode_kernel"),
    pytest.param((1, 70, 2, 128, 1, 1, 64, True, False), id="E1-no_router-mh_ffn"),
    pytest.param((2, 9, 2, 64, 1, 2, 32, False, True), id="no_norm-decode_kernel"),
    pytest.param((1, 80, 2, 256, 2, 2, 32, True, True), id="dh256"),
    pytest.param((1, 5, 2, 128, 1, 1, 64, True, False), id="E1-no_router-decode_kernel"),
    pytest.param((2, 3, 2, 256, 2, 2, 32, True, True), id="dh256-decode_kernel"),
    pytest.param((1, 37, 3, 64, 3, 1, 48, False, False), id="no_norm-no_router-ragged_token_blocks"),
]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def layer_inputs(batch, seq_len, heads, head_dim, kv_heads, num_subnetworks, subnetwork_size, norm, router, seed=0):
    """float64 tensors on DEVICE: p, norm weight (or None), router (or None), k, u, v."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    p = randn(batch, seq_len, heads * head_dim)
    norm_weight = 1 + randn(head_dim, scale=0.2) if norm else None
    router_weight = randn(heads, head_dim, num_subnetworks, scale=head_dim**-0.5) if router else None
    weights = [randn(kv_heads, num_subnetworks, subnetwork_size, head_dim, scale=head_dim**-0.5) for _ in range(3)]
    return [None if t is None else t.to(DEVICE) for t in (p, norm_weight, router_weight, *weights)]


def layer_truth(p, norm_weight, router, k, u, v):
    """The layer's maths in plain autograd (float64 inputs give the ground truth)."""
    batch, length, width = p.shape
    head_dim = k.shape[-1]
    q = p.view(batch, length, width // head_dim, head_dim).transpose(1, 2)
    if norm_weight is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight
    if router is None:  # r = 1 for every sub-network
        gates = q.new_ones((*q.shape[:-1], k.shape[1]))
    else:
        scores = torch.sigmoid(torch.einsum("bhld,hde->bhle", q, router))
        gates = scores / (scores.sum(-1, keepdim=True) + GATE_EPS)
    return flash_mhf_dense(q, k, u, v, gates).transpose(1, 2).reshape(batch, length, width)


def check_layer(inputs, dtype, parameter_dtype=torch.float32, **layer_kwargs):
    """Runs flash_mhf_layer in `dtype` (norm and router weights in `parameter_dtype`) and compares its output and every
    gradient with the float64 truth; returns the errors."""
    grad_out = torch.randn(inputs[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    truth_leaves = [None if t is None else t.clone().requires_grad_(True) for t in inputs]
    expected = layer_truth(*truth_leaves)
    expected.backward(grad_out)
    p, norm_weight, router = (None if t is None else t.to(dtype if i == 0 else parameter_dtype).requires_grad_(True)
                              for i, t in enumerate(inputs[:3]))
    weights = torch.cat(inputs[3:]).to(dtype).requires_grad_(True)  # k, u, v stacked, as the module holds them
    out = flash_mhf_layer(p, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS, **layer_kwargs)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    out.backward(grad_out.to(dtype))
    assert weights.grad is not None and weights.grad.dtype == dtype
    grads = [None if t is None else t.grad for t in (p, norm_weight, router)] + list(weights.grad.chunk(3))
    errors = {"out": relative_error(out, expected)}
    for name, grad, leaf, truth in zip(("p", "norm", "router", "k", "u", "v"), grads,
                                       (p, norm_weight, router, weights, weights, weights), truth_leaves):
        if truth is None:
            continue
        assert grad is not None and grad.dtype == leaf.dtype, name
        errors[name] = relative_error(grad, truth.grad)
    assert max(errors.values()) < TOLERANCE[dtype], errors
    return errors


# ------------------------------------------------------------------------------------------------------------
# The reference (unfused) layer, on any device
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", LAYER_CASES[:3])
def test_unfused_layer_matches_float64(case):
    check_layer(layer_inputs(*case), torch.float32, impl="torch")


@pytest.mark.parametrize("case", LAYER_CASES[:4])
def test_float64_layer_keeps_float64_precision(case):
    """A float64 layer (`model.double()`; the PyTorch path, as the kernels take 16- and 32-bit floats) against the
    float64 truth: the query norm and the gates had run in float32 around the float64 op, leaving its output and
    gradients float32-close (relative errors about 1e-7) rather than float64-close."""
    errors = check_layer(layer_inputs(*case), torch.float64, parameter_dtype=torch.float64, impl="torch")
    assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_unfused_layer_without_a_router_weighs_every_subnetwork_by_one(impl):
    """router=None with several sub-networks: r = 1 for each, as the kernels of the fused layer take it (the unfused
    layer had refused with an error about an `r` of one column, which its caller never passed)."""
    check_layer(layer_inputs(2, 5, 2, 64, 1, 3, 32, True, False), torch.float32, impl=impl, fused=False)


def test_path_names_the_unfused_layer_on_cpu():
    p, _, _, k, _, _ = layer_inputs(1, 3, 2, 64, 2, 2, 32, True, True)
    assert flash_mhf_layer_path(p, k).startswith("unfused layer")
    assert "fusion switched off" in flash_mhf_layer_path(p, k, fused=False)


def test_path_of_a_long_input_allocates_no_queries():
    """The path follows from the queries' shape, dtype and device: saying it for an input allocates no queries of its
    size (the FFN module says it at its first forward, where they would add a copy of its input to the peak memory;
    here an input of 2**48 values, a view of one, whose queries could not be allocated at all)."""
    k = layer_inputs(1, 1, 2, 64, 2, 2, 32, False, False)[3].float()
    p = torch.empty(1, 1, 1, device=DEVICE).expand(2**20, 2**20, 2 * 64)
    for fused in (True, False):
        assert flash_mhf_layer_path(p, k, fused=fused).startswith(("fused layer", "unfused layer"))


def test_layer_rejects_bad_shapes():
    p, norm, router, k, u, v = layer_inputs(1, 3, 2, 64, 2, 2, 32, True, True)
    weights = torch.cat([k, u, v])
    with pytest.raises(ValueError, match="multiple of head_dim"):
        flash_mhf_layer(p[..., :-1], norm, router, weights, eps=EPS, gate_eps=GATE_EPS)
    with pytest.raises(ValueError, match=r"\[batch, seq_len, heads \* head_dim\]"):
        flash_mhf_layer(p[0], norm, router, weights, eps=EPS, gate_eps=GATE_EPS)
    with pytest.raises(ValueError, match=r"weights must be \[3 \* kv_heads, .*got shape \(2, 2, 32, 64\)"):
        flash_mhf_layer(p, norm, router, k, eps=EPS, gate_eps=GATE_EPS)


@pytest.mark.parametrize("fused", [True, False])
def test_layer_rejects_weights_that_do_not_fit_the_heads(fused):
    """Checked before either path runs: the kernels would read past the router or the norm weight, or leave a head
    unwritten, where the reference would broadcast or raise."""
    p, norm, router, k, u, v = layer_inputs(1, 3, 3, 64, 1, 2, 32, True, True)
    weights = torch.cat([k, u, v])
    cases = [
        ("kv_heads=2 .* must divide the heads of p", dict(weights=torch.cat([k, k, u, u, v, v]))),
        (r"norm_weight must be \[head_dim\] = \(64,\); got shape \(32,\)", dict(norm_weight=norm[:32])),
        (r"router must be \[heads, head_dim, num_subnetworks\] = \(3, 64, 2\); got shape \(1, 64, 2\)",
         dict(router=router[:1])),
        (r"router must be .*got shape \(3, 64, 3\)", dict(router=torch.cat([router, router[..., :1]], -1))),
    ]
    for message, change in cases:
        arguments = dict(norm_weight=norm, router=router, weights=weights) | change
        with pytest.raises(ValueError, match=message):
            flash_mhf_layer(p, arguments["norm_weight"], arguments["router"], arguments["weights"], eps=EPS,
                            gate_eps=GATE_EPS, fused=fused)


@pytest.mark.parametrize("fused", [True, False])
def test_layer_rejects_inputs_that_are_not_floating_point(fused):
    """As `flash_mhf` refuses integer q, k, u, v and r: integer or boolean weights (or input) are named, not cast to
    p's dtype and run."""
    p, norm, router, k, u, v = (t.float() for t in layer_inputs(1, 3, 2, 64, 1, 2, 32, True, True))
    weights = torch.cat([k, u, v])
    cases = {"p": dict(p=p.long()), "norm_weight": dict(norm_weight=norm.long()), "router": dict(router=router > 0),
             "weights": dict(weights=weights.to(torch.int32))}
    for name, change in cases.items():
        arguments = dict(p=p, norm_weight=norm, router=router, weights=weights) | change
        with pytest.raises(ValueError, match=f"{name} must be a floating-point tensor; got dtype torch.(int|bool)"):
            flash_mhf_layer(**arguments, eps=EPS, gate_eps=GATE_EPS, fused=fused)


# ------------------------------------------------------------------------------------------------------------
# Triton (CUDA, or the interpreter)
# ------------------------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("case, dtype", cases_by_dtype(LAYER_CASES, [torch.bfloat16, torch.float16, torch.float32]))
def test_triton_layer_matches_float64(case, dtype):
    inputs = layer_inputs(*case)
    p, _, _, k, _, _ = inputs
    tokens = p.shape[0] * p.shape[1]
    path = flash_mhf_layer_path(p.to(dtype), k.to(dtype), impl="triton")
    assert path.startswith("fused layer"), path
    assert ("decode kernel" in path) == (tokens <= flash_mhf_op.DECODE_MAX_TOKENS), path
    training = flash_mhf_layer_path(p.to(dtype).requires_grad_(True), k.to(dtype), impl="triton")
    assert training.startswith("fused layer") and "decode kernel" not in training, training  # (check_layer's path)
    check_layer(inputs, dtype, impl="triton")


@needs_kernels
@pytest.mark.parametrize("case, dtype", cases_by_dtype(LAYER_CASES, [torch.bfloat16, torch.float16, torch.float32]))
def test_triton_layer_inference_matches_float64(case, dtype):
    """Without gradients the layer runs other kernels than training: the decode kernel (norm, gates and op in one) for
    up to DECODE_MAX_TOKENS tokens, the kernels' builds for any number of tokens above; their output against float64
    for every variant (no norm, no router, grouped weights, each head width, ragged token blocks)."""
    inputs = layer_inputs(*case)
    expected = layer_truth(*inputs)
    p = inputs[0].to(dtype)
    norm_weight, router = (None if t is None else t.float() for t in inputs[1:3])
    weights = torch.cat(inputs[3:]).to(dtype)
    with torch.no_grad():
        out = flash_mhf_layer(p, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton")
    assert out.dtype == dtype and out.shape == p.shape
    error = relative_error(out, expected)
    assert error < TOLERANCE[dtype], error


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [LAYER_CASES[0], LAYER_CASES[1], LAYER_CASES[3]])
def test_triton_layer_with_16_bit_norm_and_router_matches_float64(case, dtype):
    """A model cast to 16 bits holds its norm weight and router in that dtype too: training (their gradients in that
    dtype) and inference (the decode kernel at L1) against float64."""
    check_layer(layer_inputs(*case), dtype, parameter_dtype=dtype, impl="triton")
    inputs = layer_inputs(*case)
    p, norm_weight, router = (None if t is None else t.to(dtype) for t in inputs[:3])
    with torch.no_grad():
        out = flash_mhf_layer(p, norm_weight, router, torch.cat(inputs[3:]).to(dtype), eps=EPS, gate_eps=GATE_EPS,
                              impl="triton")
    assert relative_error(out, layer_truth(*inputs)) < TOLERANCE[dtype]


@needs_kernels
@pytest.mark.parametrize("case", [LAYER_CASES[0], LAYER_CASES[1]])
def test_triton_layer_reads_router_and_norm_weight_views(case):
    """The norm weight and the router as views that are not contiguous (what a tied or sliced parameter gives): the
    fused layer reads their values, not their storage in order, for inference and training."""
    p, norm_weight, router, k, u, v = (None if t is None else t.float() for t in layer_inputs(*case))
    weights = torch.cat([k, u, v])
    norm_view = torch.stack([norm_weight, torch.zeros_like(norm_weight)], -1)[:, 0]
    router_view = router.transpose(1, 2).contiguous().transpose(1, 2)
    assert not norm_view.is_contiguous() and not router_view.is_contiguous()
    for grad in (False, True):
        outputs, gradients = [], []
        for norm_arg, router_arg, fused in ((norm_view, router_view, True), (norm_weight, router, False)):
            leaves = [t.clone().requires_grad_(grad) for t in (p, norm_arg, router_arg)]
            with torch.set_grad_enabled(grad):
                out = flash_mhf_layer(*leaves, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton", fused=fused)
            outputs.append(out.detach())
            if grad:
                out.backward(torch.ones_like(out))
                gradients.append([leaf.grad for leaf in leaves])
        assert relative_error(outputs[0], outputs[1]) < 1e-5
        for fused_grad, unfused_grad in zip(*gradients):
            assert relative_error(fused_grad, unfused_grad) < 1e-4


@needs_kernels
@pytest.mark.parametrize("case", [LAYER_CASES[0], LAYER_CASES[1]])
def test_triton_layer_takes_weights_of_another_dtype_in_another_layout(case):
    """Stacked weights in another dtype than p and not contiguous (the sub-network axis outermost in memory): cast to
    p's dtype, the kernels read their values, not their storage in order, in inference (the decode kernel at L1) and
    training (their gradient in their own dtype)."""
    inputs = layer_inputs(*case)
    expected = layer_truth(*inputs)
    grad_out = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    truth_weights = torch.cat(inputs[3:]).requires_grad_(True)
    (expected_grad,) = torch.autograd.grad(layer_truth(*inputs[:3], *truth_weights.chunk(3)), truth_weights, grad_out)
    p, norm_weight, router = (t.float() for t in inputs[:3])
    weights = torch.cat(inputs[3:]).transpose(0, 1).contiguous().transpose(0, 1)  # float64, [3 * H_kv, E, ...] view
    assert not weights.is_contiguous()
    with torch.no_grad():
        out = flash_mhf_layer(p, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton")
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    weights.requires_grad_(True)
    out = flash_mhf_layer(p, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton")
    out.backward(grad_out.float())
    assert weights.grad.dtype == torch.float64
    errors = {"out": relative_error(out, expected), "weights": relative_error(weights.grad, expected_grad)}
    assert max(errors.values()) < TOLERANCE[torch.float32], errors


@needs_kernels
def test_fused_layer_refuses_a_second_derivative():
    """The fused layer's backward is not differentiable again: a gradient of its gradient (a gradient penalty added to
    the loss) raises instead of leaving the layer's share out of it."""
    p, norm_weight, router, k, u, v = (t.float() for t in layer_inputs(*LAYER_CASES[0].values[0]))
    p.requires_grad_(True)
    out = flash_mhf_layer(p, norm_weight, router, torch.cat([k, u, v]), eps=EPS, gate_eps=GATE_EPS, impl="triton")
    (grad,) = torch.autograd.grad(out.square().sum(), p, create_graph=True)
    penalty = grad.square().sum()
    assert penalty.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.sum() + penalty).backward()


@needs_kernels
@pytest.mark.parametrize("fused", [True, False])
def test_triton_layer_refuses_empty_subnetwork_weights_by_name(fused):
    """A layer whose weights hold no sub-network: refused by name on the Triton path, fused or not (the fused layer
    had run its kernels on them and failed inside Triton)."""
    p, norm_weight, _, k, u, v = (t.float() for t in layer_inputs(1, 3, 2, 64, 1, 2, 32, True, True))
    weights = torch.cat([k, u, v])[:, :0]
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="num_subnetworks=0, subnetwork_size=32"):
            flash_mhf_layer(p.requires_grad_(grad), norm_weight, None, weights, eps=EPS, gate_eps=GATE_EPS,
                            impl="triton", fused=fused)
    assert "num_subnetworks=0" in flash_mhf_layer_path(p, weights[:1], impl="triton", fused=fused)


@needs_kernels
def test_triton_layer_with_no_tokens():
    p, norm_weight, router, k, u, v = (t.float() for t in layer_inputs(*LAYER_CASES[0].values[0]))
    weights = torch.cat([k, u, v])
    empty = p[:0]
    with torch.no_grad():
        assert flash_mhf_layer(empty, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS,
                               impl="triton").shape == empty.shape
    empty = empty.clone().requires_grad_(True)
    out = flash_mhf_layer(empty, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton")
    out.sum().backward()
    assert out.shape == empty.shape and empty.grad.shape == empty.shape


@needs_kernels
@pytest.mark.parametrize("operators", [False, True], ids=["eager", "through_the_operators"])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen_weights", "trained_weights"])
def test_triton_layer_with_frozen_weights_launches_no_weight_gradient_kernel(frozen, operators, monkeypatch):
    """Sub-network weights that need no gradient (LoRA on the projections freezes them) get none, and their kernel,
    the layer's longest, is not launched; the other gradients are the float64 truth's either way. Also through the
    training operators that compiled graphs call (here under a dispatch mode, which calls them too)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_memffn import flash_mhf_triton

    launched = []

    def recording_launch(kernel, *args, **kwargs):
        launched.append(kernel)
        return launch(kernel, *args, **kwargs)

    launch = flash_mhf_triton.launch
    monkeypatch.setattr(flash_mhf_triton, "launch", recording_launch)
    inputs = layer_inputs(*LAYER_CASES[0].values[0])
    truth_leaves = [t.clone().requires_grad_(True) for t in inputs]
    expected = layer_truth(*truth_leaves)
    grad_out = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected.backward(grad_out)
    p, norm_weight, router = (t.float().requires_grad_(True) for t in inputs[:3])
    weights = torch.cat(inputs[3:]).float().requires_grad_(not frozen)
    with FlopCounterMode(display=False) if operators else contextlib.nullcontext():
        out = flash_mhf_layer(p, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton")
        out.backward(grad_out.float())
    assert (flash_mhf_triton._backward_weights_kernel in launched) == (not frozen)
    assert (weights.grad is None) == frozen
    errors = {name: relative_error(leaf.grad, truth.grad)
              for name, leaf, truth in zip(("p", "norm", "router"), (p, norm_weight, router), truth_leaves)}
    if not frozen:
        errors["weights"] = relative_error(weights.grad, torch.cat([t.grad for t in truth_leaves[3:]]))
    assert max(errors.values()) < TOLERANCE[torch.float32], errors


@needs_kernels
@pytest.mark.parametrize("launch", [
    pytest.param(dict(flash_mhf_layer_triton.GATES_BACKWARD_LAUNCH), id="production"),
    pytest.param({"block_t": 16, "num_warps": 2, "programs_per_sm": 1, "num_stages": 1,
                  "router_grad_transposed": True}, id="16_tokens-transposed_router_gradient"),
    pytest.param({"block_t": 32, "num_warps": 4, "programs_per_sm": 2, "num_stages": 3,
                  "router_grad_transposed": False}, id="32_tokens-3_stages"),
])
def test_triton_gates_backward_launches_match_float64(launch):
    """Every launch setting the tuning sweep times gives the norm/gate backward's float64 gradients (dP, norm weight,
    router), also where the programs loop over several token blocks and the last block is ragged."""
    batch, length, heads, head_dim, num_subnetworks = 2, 45, 3, 64, 5
    generator = torch.Generator().manual_seed(3)
    p = torch.randn(batch, length, heads * head_dim, generator=generator, dtype=torch.float64)
    norm_weight = 1 + 0.2 * torch.randn(head_dim, generator=generator, dtype=torch.float64)
    router = torch.randn(heads, head_dim, num_subnetworks, generator=generator, dtype=torch.float64) * head_dim**-0.5
    grad_q = torch.randn(p.shape, generator=generator, dtype=torch.float64)
    grad_r = 0.1 * torch.randn(batch, heads, length, num_subnetworks, generator=generator, dtype=torch.float64)
    leaves = [t.clone().to(DEVICE).requires_grad_(True) for t in (p, norm_weight, router)]
    x = leaves[0].view(batch, length, heads, head_dim)
    q = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * leaves[1]
    scores = torch.sigmoid(torch.einsum("blhd,hde->bhle", q, leaves[2]))
    r = scores / (scores.sum(-1, keepdim=True) + GATE_EPS)
    torch.autograd.backward([q, r], [grad_q.to(DEVICE).view_as(q), grad_r.to(DEVICE)])
    grads = flash_mhf_layer_triton.queries_and_gates_backward(
        p.to(DEVICE, torch.float32), norm_weight.to(DEVICE, torch.float32), router.to(DEVICE, torch.float32),
        grad_q.to(DEVICE, torch.float32), grad_r.to(DEVICE, torch.float32), head_dim, EPS, GATE_EPS, launch=launch,
        precision="ieee")
    for name, grad, leaf in zip(("p", "norm", "router"), grads, leaves):
        assert grad.shape == leaf.shape and grad.is_contiguous(), name
        assert relative_error(grad, leaf.grad) < TOLERANCE[torch.float32], name


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("launch", [
    pytest.param(dict(flash_mhf_layer_triton.DECODE_LAUNCH), id="production"),
    pytest.param({"block_n": 32, "num_warps": 4, "num_stages": 1, "programs_per_sm": 1, "weights_first": False},
                 id="32_columns-one_split_per_head-weights_after_gates"),
    pytest.param({"block_n": 16, "num_warps": 8, "num_stages": 3, "programs_per_sm": 64, "weights_first": True},
                 id="16_columns-one_block_per_program"),
    pytest.param({"block_n": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "weights_first": True},
                 id="128_columns-narrowed_to_the_subnetwork"),
])
def test_triton_decode_launches_match_float64(launch, dtype):
    """Every launch setting the decode sweep times (`tune_flash_mhf_layer.py --decode`) gives the layer's float64
    output: column blocks narrowed to divide d_e, a head's blocks in one program or one block per program, the first
    weight tiles loaded before or after the gates, grouped weights, and two token blocks (the second ragged)."""
    p, norm, router, k, u, v = layer_inputs(20, 1, 4, 64, 2, 3, 64, True, True, seed=5)
    expected = layer_truth(p, norm, router, k, u, v)
    out = flash_mhf_layer_triton.decode_forward(p.to(dtype), norm.float(), router.float(), k.to(dtype), u.to(dtype),
                                                v.to(dtype), EPS, GATE_EPS, launch=launch)
    assert out.dtype == dtype and out.shape == p.shape
    assert relative_error(out, expected) < TOLERANCE[dtype]
    if ON_GPU:  # (the interpreter runs the programs one after another, in order)
        again = flash_mhf_layer_triton.decode_forward(p.to(dtype), norm.float(), router.float(), k.to(dtype),
                                                      u.to(dtype), v.to(dtype), EPS, GATE_EPS, launch=launch)
        assert torch.equal(again, out)  # the splits are added in a fixed order


def test_gates_backward_programs_keep_a_bounded_cache_over_many_token_counts():
    """The norm/gate backward's split (programs per head, token blocks per program) is kept per number of tokens,
    which changes from batch to batch (dynamic padding, packed sequences): a run that meets thousands of token counts
    keeps a bounded number of them, and the answers stay those of the uncached function."""
    programs = flash_mhf_layer_triton._backward_programs
    programs.cache_clear()
    try:
        for num_tokens in range(1, 1025):
            assert programs(num_tokens, 4, 132, 16, 4) == programs.__wrapped__(num_tokens, 4, 132, 16, 4)
        assert programs.cache_info().currsize <= 256
    finally:
        programs.cache_clear()


@needs_kernels
def test_triton_decode_adds_more_splits_than_one_load_takes():
    """68 programs split one head's columns (one 16-column block each), more than the splits' sum reads per step
    (DECODE_SUM_BLOCK_S): the sum loops over them and still gives the float64 output."""
    launch = {**flash_mhf_layer_triton.DECODE_LAUNCH, "block_n": 16, "programs_per_sm": 64}
    p, norm, router, k, u, v = layer_inputs(1, 1, 1, 64, 1, 17, 64, True, True, seed=8)
    assert 17 * 64 // 16 > flash_mhf_layer_triton.DECODE_SUM_BLOCK_S
    out = flash_mhf_layer_triton.decode_forward(p.float(), norm.float(), router.float(), k.float(), u.float(),
                                                v.float(), EPS, GATE_EPS, launch=launch)
    assert relative_error(out, layer_truth(p, norm, router, k, u, v)) < TOLERANCE[torch.float32]


@needs_kernels
@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs the programs one after another, in order")
def test_triton_decode_is_the_same_from_run_to_run():
    """Decoding with the fused layer gives bit-identical outputs from call to call (no atomics: on a GPU, programs
    finish in a different order every time), at a shape where many programs split each head's columns."""
    p, norm, router, k, u, v = (t.to(torch.bfloat16) for t in layer_inputs(16, 1, 4, 128, 4, 8, 256, True, True,
                                                                            seed=6))
    first = flash_mhf_layer_triton.decode_forward(p, norm, router, k, u, v, EPS, GATE_EPS)
    for _ in range(50):
        assert torch.equal(flash_mhf_layer_triton.decode_forward(p, norm, router, k, u, v, EPS, GATE_EPS), first)


@needs_kernels
def test_triton_gate_totals():
    """With ``totals``, the norm/gate forward kernel also gives sum_E sigmoid(q W) + gate_eps per row (what the
    fused backward gets the sigmoid scores back from: s = r * total), and None without a router."""
    p, norm, router, _, _, _ = (None if t is None else t.float()
                                for t in layer_inputs(2, 45, 3, 64, 1, 5, 32, True, True, seed=4))
    q, r, totals = flash_mhf_layer_triton.queries_and_gates(p, norm, router, 64, 5, EPS, GATE_EPS, precision="ieee",
                                                            totals=True)
    x = p.double().view(2, 45, 3, 64)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm.double()
    scores = torch.sigmoid(torch.einsum("blhd,hde->bhle", x, router.double()))
    assert totals.shape == (2, 3, 45) and totals.dtype == torch.float32
    assert relative_error(totals, scores.sum(-1) + GATE_EPS) < 1e-6
    assert relative_error(r * totals[..., None], scores) < 1e-6
    assert flash_mhf_layer_triton.queries_and_gates(p, norm, None, 64, 1, EPS, GATE_EPS, totals=True)[2] is None


@needs_kernels
@pytest.mark.parametrize("norm,router", [(True, True), (False, True), (True, False)])
def test_triton_gate_gradient_sums(norm, router):
    """The partial sums' finishing kernel: the sums over slots (and heads, for the norm weight) in the parameters'
    dtypes and layouts, the router's [H, d_h, E] from [slots, H, E_DOT, d_h] partial sums."""
    generator = torch.Generator().manual_seed(7)
    slots, heads, head_dim, num_subnetworks = 70, 3, 64, 5
    norm_parts = torch.randn(slots, heads, head_dim, generator=generator).to(DEVICE) if norm else None
    router_parts = torch.randn(slots, heads, 16, head_dim, generator=generator).to(DEVICE) if router else None
    norm_weight = torch.ones(head_dim, device=DEVICE, dtype=torch.bfloat16) if norm else None
    router_weight = torch.ones(heads, head_dim, num_subnetworks, device=DEVICE) if router else None
    grad_norm, grad_router = flash_mhf_layer_triton.finish_gate_gradients(norm_parts, router_parts, norm_weight,
                                                                          router_weight, num_tokens=1)
    if norm:
        assert grad_norm.dtype == torch.bfloat16
        torch.testing.assert_close(grad_norm, norm_parts.double().sum((0, 1)).bfloat16())
    else:
        assert grad_norm is None
    if router:
        assert grad_router.shape == router_weight.shape and grad_router.is_contiguous()
        expected = router_parts[:, :, :num_subnetworks].double().sum(0).transpose(1, 2)
        torch.testing.assert_close(grad_router.double(), expected, rtol=1e-5, atol=1e-5)
    else:
        assert grad_router is None


@needs_kernels
def test_triton_fused_gates_need_the_gluon_rows_kernel():
    """Asked to run the norm/gate backward where the Triton dq/dr kernel runs, the op's backward says so instead of
    leaving the layer's gradients unwritten."""
    from hf_memffn import flash_mhf_gluon, flash_mhf_triton

    p, norm, router, k, u, v = (None if t is None else t.float() for t in layer_inputs(1, 20, 2, 64, 2, 2, 32, True,
                                                                                       True))
    q = p.view(1, 20, 2, 64).transpose(1, 2)
    r = torch.full((1, 2, 20, 2), 0.5, device=DEVICE)
    gates = flash_mhf_gluon.FusedGates(p.view(20, 128), norm, router, None, torch.empty(20, 128, device=DEVICE), None,
                                       None, EPS)
    with pytest.raises(ValueError, match="fused_gates needs the Gluon dq/dr kernel"):
        flash_mhf_triton.triton_backward(torch.ones_like(q), q, k, u, v, r, fused_gates=gates)


ON_HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon dq/dr kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("norm,router,num_subnetworks", [(True, True, 5), (False, True, 3), (True, False, 1)],
                         ids=["norm-router", "no_norm", "no_router-mh_ffn"])
def test_gates_backward_inside_the_rows_kernel_matches_float64(norm, router, num_subnetworks):
    """Where the op's dq/dr kernel is the Gluon kernel (large enough problems, one head per weight group), the layer's
    norm/gate backward runs inside it: every gradient against float64, over two ragged sequences."""
    inputs = layer_inputs(2, 2100, 8, 128, 8, num_subnetworks, 128, norm, router, seed=5)
    p, _, _, k, _, _ = inputs
    assert flash_mhf_op._gates_in_rows_kernel(p.new_empty(2, 8, 2100, 128).bfloat16(), k.bfloat16())
    assert "norm/gate backward inside the Gluon dq/dr kernel" in flash_mhf_layer_path(p.bfloat16(), k.bfloat16())
    check_layer(inputs, torch.bfloat16, impl="triton")
    # grouped heads keep the norm/gate backward kernel of its own
    grouped = layer_inputs(2, 2100, 8, 128, 4, 2, 128, True, True, seed=6)
    assert not flash_mhf_op._gates_in_rows_kernel(p.new_empty(2, 8, 2100, 128).bfloat16(), grouped[3].bfloat16())
    check_layer(grouped, torch.bfloat16, impl="triton")


@needs_kernels
def test_triton_layer_inference_matches_training_forward():
    """Without gradients the kernels run directly (no custom-op dispatch); the result is the same."""
    p, norm, router, k, u, v = (None if t is None else t.to(torch.bfloat16 if i in (0, 3, 4, 5) else torch.float32)
                                for i, t in enumerate(layer_inputs(2, 40, 2, 64, 1, 2, 32, True, True)))
    weights = torch.cat([k, u, v])
    with torch.no_grad():
        direct = flash_mhf_layer(p, norm, router, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton")
    through_op = flash_mhf_layer(p.requires_grad_(True), norm, router, weights, eps=EPS, gate_eps=GATE_EPS,
                                 impl="triton")
    torch.testing.assert_close(direct, through_op.detach(), rtol=0, atol=0)


@needs_kernels
def test_triton_layer_opcheck():
    p, norm, router, k, u, v = layer_inputs(1, 70, 2, 64, 2, 2, 32, True, True)
    args = (p.float().requires_grad_(True), norm.float(), router.float().requires_grad_(True),
            torch.cat([k, u, v]).float().requires_grad_(True), 64, EPS, GATE_EPS)
    torch.library.opcheck(flash_mhf_op._layer_op, args, test_utils=("test_schema", "test_faketensor",
                                                                  "test_autograd_registration"))
    # the backward operator's outputs have the strides its fake kernel says (a compiled graph asserts them): the
    # router's gradient in float32 too, where no cast copies the [H, d_h, E] slice of the padded partial sums
    backward_args = (torch.randn_like(p.float()), *(t.detach() if torch.is_tensor(t) else t for t in args))
    torch.library.opcheck(flash_mhf_op._registered("flash_mhf_layer_backward"), backward_args,
                          test_utils=("test_schema", "test_faketensor"))
    # training's operators: the forward also returns q, r and the totals, the backward takes them
    torch.library.opcheck(flash_mhf_op._training_layer_op, args, test_utils=("test_schema", "test_faketensor",
                                                                          "test_autograd_registration"))
    out, q, r, totals = flash_mhf_op._training_layer_op(*(t.detach() if torch.is_tensor(t) else t for t in args))
    torch.testing.assert_close(out, flash_mhf_op._layer_op(*args).detach(), rtol=0, atol=0)
    from_queries_args = (*backward_args[:5], q, r, totals, *backward_args[5:])
    torch.library.opcheck(flash_mhf_op._registered("flash_mhf_layer_backward_from_queries"), from_queries_args,
                          test_utils=("test_schema", "test_faketensor"))


@needs_kernels
@pytest.mark.parametrize("arch_kwargs", [{}, {"ffn_variant": "mh_ffn", "ffn_num_subnetworks": 1}, {"ffn_num_kv_heads": 1}],
                         ids=["flash_mhf", "mh_ffn", "grouped"])
def test_model_logits_fused_match_unfused(arch_kwargs):
    """A tiny FlashMHFLlama in float32 gives the same logits and gradients on the fused and the unfused path (one
    decoder layer: its FFN's gradient flows on through attention to the embeddings; under the interpreter every
    further layer only repeats the same kernels' programs in Python)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("flash_mhf", hidden_size=128, ffn_num_heads=2, intermediate_size=64, ffn_kernel="triton",
                         num_hidden_layers=1, **arch_kwargs)
    fused = AutoModelForCausalLM.from_config(config).to(DEVICE)
    unfused = copy.deepcopy(fused)
    for module in unfused.modules():
        if hasattr(module, "fused_layer"):
            module.fused_layer = False
    ids = torch.randint(0, config.vocab_size, (2, 40), device=DEVICE)
    out_fused, out_unfused = fused(ids, labels=ids), unfused(ids, labels=ids)
    torch.testing.assert_close(out_fused.logits, out_unfused.logits, rtol=1e-4, atol=1e-4)
    out_fused.loss.backward()
    out_unfused.loss.backward()
    for (name, a), b in zip(fused.named_parameters(), unfused.parameters()):
        assert relative_error(a.grad, b.grad) < 1e-4, name
    mlp = fused.model.layers[0].mlp
    assert mlp.path_description(torch.empty(2, 40, 128, device=DEVICE)).startswith("fused layer")


@needs_kernels
def test_fused_layer_path_follows_the_layer_when_only_the_output_projection_trains(monkeypatch):
    """With every parameter frozen but `out_proj` (which reads the layer's output), the layer records no gradient and
    runs the decode kernel for a few tokens: the path said the training kernels, counting `out_proj` among the layer's
    inputs. With the sub-network weights trainable it runs, and says, the training kernels."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("flash_mhf", hidden_size=64, ffn_num_heads=1, ffn_num_kv_heads=1, intermediate_size=64,
                         ffn_kernel="triton", num_hidden_layers=1)
    model = AutoModelForCausalLM.from_config(config).to(DEVICE).train()
    mlp = model.model.layers[0].mlp
    decoded = []
    decode_forward = flash_mhf_op.decode_forward
    monkeypatch.setattr(flash_mhf_op, "decode_forward", lambda *args: decoded.append(1) or decode_forward(*args))
    x = torch.randn(1, 3, 64, device=DEVICE)
    model.requires_grad_(False)
    mlp.out_proj.requires_grad_(True)
    assert "the Triton decode kernel" in mlp.path_description(mlp.in_proj(x))
    mlp(x).sum().backward()
    assert decoded == [1]
    mlp.key_up_value.requires_grad_(True)
    assert "the Triton decode kernel" not in mlp.path_description(mlp.in_proj(x))
    mlp(x).sum().backward()
    assert decoded == [1] and mlp.key_up_value.grad is not None


def test_layer_kernels_under_interpreter_in_subprocess():
    run_under_interpreter(__file__, "triton or fused")


@needs_kernels
def test_fused_layer_traces_without_graph_break():
    """torch.compile(fullgraph=True) traces the FFN with the fused layer (forward and backward through the custom
    operator's fake and autograd registrations), and gives the eager result; also for one decoding token."""
    torch.manual_seed(0)
    config = tiny_config("flash_mhf", hidden_size=128, ffn_num_heads=2, intermediate_size=64, ffn_kernel="triton")
    from transformers import AutoModelForCausalLM

    mlp = AutoModelForCausalLM.from_config(config).to(DEVICE).model.layers[0].mlp
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    for shape in ((2, 40, 128), (3, 1, 128)):
        x = torch.randn(*shape, device=DEVICE, requires_grad=True)
        expected = mlp(x)
        (grad_expected,) = torch.autograd.grad(expected.sum(), x)
        actual = compiled(x)
        (grad_actual,) = torch.autograd.grad(actual.sum(), x)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_actual, grad_expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_training_steps_replayed_from_cuda_graphs_match_eager():
    """A tiny FlashMHFLlama (fused layer, float32) compiled with mode="reduce-overhead": the steps replayed from CUDA
    graphs give the eager step's loss and gradients, step after step (the layer's launches read nothing from the host
    that changes between steps)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("flash_mhf", hidden_size=128, ffn_num_heads=2, intermediate_size=64, ffn_kernel="triton")
    model = AutoModelForCausalLM.from_config(config).to(DEVICE)
    assert model.model.layers[0].mlp.path_description(torch.empty(2, 40, 128, device=DEVICE)).startswith("fused")
    compiled = torch.compile(model, mode="reduce-overhead")
    for step in range(4):  # warm-up, recording, then replays; new tokens every step
        ids = torch.randint(0, config.vocab_size, (2, 40), device=DEVICE)
        expected = model(ids, labels=ids).loss
        expected_grads = torch.autograd.grad(expected, list(model.parameters()))
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
        for (name, parameter), grad in zip(model.named_parameters(), expected_grads):
            assert relative_error(parameter.grad, grad) < 1e-4, (step, name)
            parameter.grad = None


def saved_activation_bytes(module, x) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward of ``module(x)`` (views of a
    parameter, such as FlashMHF's key, up and value, are the parameter)."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            saved[tensor.data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(saved.values())


@needs_kernels
def test_fused_layer_keeps_only_the_projections_inputs_and_the_queries_for_backward():
    """The fused FFN keeps x, p = in_proj(x), the queries q (p's dtype), the gates r and their totals (float32, E + 1
    values per token and head) and the heads' output (the out_proj input) for its backward, nothing of the
    [tokens, E * d_e] activations; the unfused layer keeps its float32 intermediates too."""
    torch.manual_seed(0)
    config = tiny_config("flash_mhf", hidden_size=128, ffn_num_heads=2, intermediate_size=64, ffn_kernel="triton")
    from transformers import AutoModelForCausalLM

    mlp = AutoModelForCausalLM.from_config(config).to(DEVICE).model.layers[0].mlp
    x = torch.randn(2, 80, 128, device=DEVICE, requires_grad=True)
    tokens, width = x.shape[0] * x.shape[1], mlp.in_proj.out_features
    fused = saved_activation_bytes(mlp, x)
    heads, subnetworks = mlp.num_heads, mlp.num_subnetworks
    assert fused == tokens * ((x.shape[-1] + 3 * width) * x.element_size() + heads * (subnetworks + 1) * 4)
    mlp.fused_layer = False
    assert saved_activation_bytes(mlp, x) >= fused + tokens * width * 4  # at least a float32 copy of the queries


def test_fused_layer_keeps_under_a_third_of_what_swiglu_keeps_at_370m():
    """At the 370M preset, with the layers `kernels/bench_models.py` compares, the fused layer keeps x, p, q and the
    heads' output, and 8 heads x (7 gates + 1 total) float32 values (the formula the test above checks): 4224 16-bit
    values per token, where the SwiGLU MLP of equal parameters keeps 14592: 3.45x less, the paper's 3-5x."""
    kernels = str(Path(__file__).resolve().parents[1] / "kernels")
    sys.path.insert(0, kernels)
    try:
        import bench_models
    finally:
        sys.path.remove(kernels)
    layers, hidden = bench_models.ffn_layers("370M", "cpu")
    swiglu = next(layer for name, layer in layers.items() if name.startswith("SwiGLU")).float()
    x = torch.randn(1, 4, hidden, requires_grad=True)
    swiglu_per_token = saved_activation_bytes(swiglu, x) / (4 * x.element_size())
    flash_mhf = layers["FlashMHF"]
    gates = flash_mhf.num_heads * (flash_mhf.num_subnetworks + 1) * 2  # float32: two 16-bit values each
    fused_per_token = hidden + 3 * flash_mhf.in_proj.out_features + gates
    assert (swiglu_per_token, fused_per_token) == (14592, 4224)


@needs_kernels
@pytest.mark.parametrize("case", [LAYER_CASES[0], LAYER_CASES[1], LAYER_CASES[2]])
def test_fused_layer_counts_the_flops_of_the_unfused_one(case):
    """Under FlopCounterMode the fused layer runs as its operators, which count as the products they compute would
    count as torch's own: forward + backward, training and inference, the same total as the unfused layer (the
    router's einsum and the op's own count), and the op's count that of the dense autograd version."""
    from torch.utils.flop_counter import FlopCounterMode

    p, norm_weight, router, k, u, v = (None if t is None else t.float().requires_grad_(True)
                                       for t in layer_inputs(*case))
    weights = torch.cat((k, u, v)).detach().requires_grad_(True)
    totals = {}
    for fused in (True, False):
        for grad in (True, False):
            with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as counter:
                out = flash_mhf_layer(p, norm_weight, router, weights, eps=EPS, gate_eps=GATE_EPS, impl="triton",
                                      fused=fused)
                if grad:
                    out.sum().backward()
            totals[fused, grad] = counter.get_total_flops()
            operators = {str(operator) for operator in counter.get_flop_counts()["Global"]}
            assert any("flash_mhf_layer" in name for name in operators) == fused, operators
    assert totals[True, True] == totals[False, True] > totals[True, False] == totals[False, False] > 0, totals
    batch, length, heads, head_dim, _, subnetworks, subnetwork_size, _, with_router = case
    rows = batch * length * heads
    forward = 6 * rows * subnetworks * subnetwork_size * head_dim + (2 * rows * head_dim * subnetworks if with_router
                                                                     else 0)
    assert totals[True, False] == forward and totals[True, True] == 3 * forward, (totals, forward)


def test_op_counts_the_flops_of_the_dense_version():
    """The op's FlopCounterMode count (forward and backward operators) equals what FlopCounterMode counts for
    `flash_mhf_dense`, the plain autograd version whose three einsums materialise every activation."""
    from torch.utils.flop_counter import FlopCounterMode

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=generator)
    k, u, v = (torch.randn(2, 3, 32, 16, generator=generator) for _ in range(3))
    r = torch.rand(2, 4, 5, 3, generator=generator)
    counts = []
    for function in (lambda *inputs: flash_mhf_op.flash_mhf(*inputs, impl="torch"), flash_mhf_dense):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, u, v, r)]
        with FlopCounterMode(display=False) as counter:
            function(*inputs).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 3 * 6 * (2 * 4 * 5) * 3 * 32 * 16, counts
