"""RMSNorm, as in Llama: normalize in float32, scale by a learned weight, return the input dtype."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, computed in float32 and returned in float32."""
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return hidden_states * torch.rsqrt(variance + eps)


class MemFFNRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(hidden_states, self.variance_epsilon).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
