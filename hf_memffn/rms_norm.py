"""RMSNorm, as in Llama: normalize in float32, scale by a learned weight, return the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from .decoder_triton import decoder_kernels_unavailable, rms_norm


def rms_normalize(hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, computed in float32 and returned in float32."""
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return hidden_states * torch.rsqrt(variance + eps)


class MemFFNRMSNorm(nn.Module):
    """`kernels` (see `decoder_triton.decoder_kernels_unavailable`): "torch" runs the PyTorch operations, "auto" the
    fused Triton kernels where they can run (CUDA, outside torch.compile), "triton" insists on them."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: str = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.kernels = kernels

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.kernels != "torch" and decoder_kernels_unavailable(hidden_states, self.kernels) is None:
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return self.weight * rms_normalize(hidden_states, self.variance_epsilon).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
