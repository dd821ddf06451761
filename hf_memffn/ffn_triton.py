"""Triton kernels for the element-wise part of KV-FFN: `act(key) * value` (or `act(key) + value`) from the output of
its joint key/value projection, forward and backward.

`KVFeedForward.key_value_proj` writes key i and value i side by side (outputs 2i and 2i + 1, so that a contiguous
share of its rows, as tensor parallelism cuts it, holds matching keys and values). As PyTorch operations the keys and
values are stride-2 views: in eager mode the activation and the product each read the whole interleaved tensor, and
the backward stacks the two gradients into the interleaved layout with one more pass. Here each direction is one pass:

* ``_paired_forward_kernel``: ``hidden[i] = act(y[2i]) * y[2i + 1]`` (``+`` for the "sum" composition);
* ``_paired_backward_kernel``: ``dy[2i]`` and ``dy[2i + 1]`` from ``y`` and ``d hidden``, written interleaved.

Each program reads and writes the interleaved tensor as one contiguous block, split into keys and values (and joined
again) in registers, so that its loads and stores are 16-byte vectors wherever Triton specialises the launch on
aligned tensors and a number of pairs divisible by 16 (the presets' shapes).

The activations are KV-FFN's choices: SiLU, GELU (exact, erf), ReLU, and the sigmoid of the GLU baseline. Maths in
float32, outputs rounded once to the input dtype. ``decoder_kernels`` (the config field that also governs the decoder's
norm and rotary kernels) decides the path, by ``decoder_kernels_unavailable``; ``KVFeedForward.path_description`` says
which runs. Under ``torch.compile`` the PyTorch operations run and inductor fuses them: its kernels for the interleaved
layout take about 1.5x (forward) and 2x (backward) these kernels' time, but called as custom operators from a compiled
graph these cost more host time than they save on the GPU at small batches (`kernels/profile_kvffn_layer.py`;
`kernels/flash_mhf_notes.md`, v86).
"""

from __future__ import annotations

import torch

from .decoder_triton import TRITON_AVAILABLE
from .triton_launch import cdiv, launch

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# the activations the kernels compute (`KVFFNConfig.activations` and the GLU baseline's sigmoid), by constexpr id
PAIRED_ACTIVATIONS = {"silu": 0, "gelu": 1, "relu": 2, "sigmoid": 3}
PAIRED_BLOCK = 1024  # pairs per program

if TRITON_AVAILABLE:

    @triton.jit
    def _activation_and_derivative(x, ACTIVATION: tl.constexpr):
        """(act(x), act'(x)) in float32."""
        if ACTIVATION == 0:  # silu
            sig = 1.0 / (1.0 + tl.exp(-x))
            return x * sig, sig * (1.0 + x * (1.0 - sig))
        elif ACTIVATION == 1:  # gelu, exact
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            return x * cdf, cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
        elif ACTIVATION == 2:  # relu
            positive = x > 0.0
            return tl.where(positive, x, 0.0), tl.where(positive, 1.0, 0.0)
        else:  # sigmoid
            sig = 1.0 / (1.0 + tl.exp(-x))
            return sig, sig * (1.0 - sig)

    @triton.jit
    def _load_pairs(Y, first_pair, num_pairs, BLOCK: tl.constexpr):
        """(keys, values) of pairs first_pair .. first_pair + BLOCK - 1 in float32, read as 2 * BLOCK contiguous
        elements (pairs past num_pairs read as zeros)."""
        elements = 2 * first_pair + tl.arange(0, 2 * BLOCK)
        y = tl.load(Y + elements, mask=elements < 2 * num_pairs, other=0.0).to(tl.float32)
        return tl.split(tl.reshape(y, (BLOCK, 2)))

    @triton.jit
    def _paired_forward_kernel(Y, H, num_pairs, ACTIVATION: tl.constexpr, PRODUCT: tl.constexpr,
                               BLOCK: tl.constexpr):
        first_pair = tl.program_id(0).to(tl.int64) * BLOCK
        key, value = _load_pairs(Y, first_pair, num_pairs, BLOCK)
        act, _ = _activation_and_derivative(key, ACTIVATION)
        hidden = act * value if PRODUCT else act + value
        pairs = first_pair + tl.arange(0, BLOCK)
        tl.store(H + pairs, hidden.to(H.dtype.element_ty), mask=pairs < num_pairs)

    @triton.jit
    def _paired_backward_kernel(Y, DH, DY, num_pairs, ACTIVATION: tl.constexpr, PRODUCT: tl.constexpr,
                                BLOCK: tl.constexpr):
        first_pair = tl.program_id(0).to(tl.int64) * BLOCK
        key, value = _load_pairs(Y, first_pair, num_pairs, BLOCK)
        pairs = first_pair + tl.arange(0, BLOCK)
        grad_hidden = tl.load(DH + pairs, mask=pairs < num_pairs, other=0.0).to(tl.float32)
        act, act_derivative = _activation_and_derivative(key, ACTIVATION)
        if PRODUCT:
            grad_key, grad_value = grad_hidden * value * act_derivative, grad_hidden * act
        else:
            grad_key, grad_value = grad_hidden * act_derivative, grad_hidden
        grad_y = tl.reshape(tl.join(grad_key, grad_value), (2 * BLOCK,))  # key i's gradient at 2i, value i's at 2i + 1
        elements = 2 * first_pair + tl.arange(0, 2 * BLOCK)
        tl.store(DY + elements, grad_y.to(DY.dtype.element_ty), mask=elements < 2 * num_pairs)


def _launch(kernel, pairs: int, *tensors, activation: str, product: bool) -> None:
    if pairs:
        launch(kernel, (cdiv(pairs, PAIRED_BLOCK),), *tensors, pairs, ACTIVATION=PAIRED_ACTIVATIONS[activation],
               PRODUCT=product, BLOCK=PAIRED_BLOCK, num_warps=4)


def paired_forward(y: torch.Tensor, activation: str, product: bool) -> torch.Tensor:
    """``act(keys) * values`` (``+`` unless ``product``) of a contiguous ``y [..., 2W]`` holding key i at 2i and value
    i at 2i + 1: a new ``[..., W]`` tensor in y's dtype."""
    hidden = torch.empty(*y.shape[:-1], y.shape[-1] // 2, device=y.device, dtype=y.dtype)
    _launch(_paired_forward_kernel, hidden.numel(), y, hidden, activation=activation, product=product)
    return hidden


def paired_backward(y: torch.Tensor, grad_hidden: torch.Tensor, activation: str, product: bool) -> torch.Tensor:
    """The gradient of :func:`paired_forward` with respect to ``y``, interleaved like ``y``."""
    grad_y = torch.empty_like(y)
    _launch(_paired_backward_kernel, grad_hidden.numel(), y, grad_hidden.contiguous(), grad_y,
            activation=activation, product=product)
    return grad_y


class _PairedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, activation, product):
        ctx.save_for_backward(y)
        ctx.settings = (activation, product)
        return paired_forward(y, activation, product)

    @staticmethod
    def backward(ctx, grad_hidden):
        (y,) = ctx.saved_tensors
        return paired_backward(y, grad_hidden, *ctx.settings), None, None


def paired_activation(y: torch.Tensor, activation: str, product: bool = True) -> torch.Tensor:
    """KV-FFN's hidden activation from its interleaved key/value projection ``y [..., 2W]`` by the Triton kernels:
    ``act(y[..., 0::2]) * y[..., 1::2]`` (``+`` with ``product=False``), ``[..., W]``."""
    if activation not in PAIRED_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {tuple(PAIRED_ACTIVATIONS)}")
    if y.shape[-1] % 2:
        raise ValueError(f"y's last dimension {y.shape[-1]} must be even (key i at 2i, value i at 2i + 1)")
    y = y.contiguous()
    if torch.is_grad_enabled() and y.requires_grad:
        return _PairedActivation.apply(y, activation, product)
    return paired_forward(y, activation, product)  # inference: no autograd node


__all__ = ["PAIRED_ACTIVATIONS", "paired_activation"]
