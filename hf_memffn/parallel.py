"""Tensor and pipeline parallelism through transformers' own machinery (`from_pretrained(distributed_config=
DistributedConfig(tp_size=..., pp_size=...))`, or `DistributedConfig(tp_plan="auto")`).

Tensor parallelism. Attention, SwiGLU and KV-FFN are Linear layers and use transformers' "colwise" / "rowwise"
styles, as Llama does. The blocks with plain parameters split their hidden units instead, with one style of this file,
`memffn_partial_sum`, on the block: FlashMHF's `key_up_value` [3 * H_kv, E, d_e, d_h] splits the columns d_e of every
sub-network ("colwise" on a parameter shards its second-to-last dim), `TokenMemory`'s gate/up [N, I, d] split I
("colwise") and its down [N, d, I] splits I too ("rowwise" shards the last dim). Each rank then computes a partial sum
of the block's output from the replicated input; the style runs the block on its local shards and sums the partial
outputs over the ranks, and in the backward pass it sums the gradients that are partial for the same reason: the
block input's (Megatron's f and g) and those of the block's replicated parameters (FlashMHF's in_proj, query norm
and router, TokenMemory's norm).

Pipeline parallelism. transformers' pipeline splits `layers` evenly over the stages and passes only the hidden
states from stage to stage. MemoryLLM and FlexMemoryLLM also need the token embeddings X0 in every layer:
`TokenEmbeddingRelay` sends X0 from stage to stage right behind the hidden states (same peers, same order, so
point-to-point matching holds on gloo and NCCL), and every stage computes its layers' FFNs on X0 itself.

This file is copied next to saved checkpoints for `trust_remote_code`: it imports only torch and transformers.
"""

from __future__ import annotations

import torch

from .configuration_memffn import PARTIAL_SUM_STYLE

try:  # transformers' TP styles (transformers >= 5.17 with torch.distributed)
    import torch.distributed as dist
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
except ImportError:  # pragma: no cover - torch built without distributed support
    dist = ALL_PARALLEL_STYLES = TensorParallelLayer = None


def _tp_group(mesh):
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group; backward: identity (the output is replicated)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradientsOverRanks(torch.autograd.Function):
    """Forward: identity; backward: all-reduce (sum) of the gradient (each rank saw a part of the block)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


if TensorParallelLayer is not None:

    class PartialSumParallel(TensorParallelLayer):
        """A block whose hidden units are split over the ranks by its parameters' own plan entries: it runs on its
        local shards and its partial outputs are summed over the ranks. In the backward pass the gradients that are
        partial for the same reason are summed too: the block input's, and its replicated parameters' (FlashMHF's
        in_proj, query norm and router, TokenMemory's norm), before they accumulate."""

        def should_use_local_tensors(self, module):
            return True

        # (transformers 5.25 passes `config` and `mesh_manager` by keyword to install_forward and `config` to
        # transform_output_post_forward; earlier versions pass neither: whatever comes goes on to the base class)
        def install_forward(self, module, mesh, **options):
            if getattr(module, "recompute_chunk_tokens", 0):
                raise ValueError(
                    f"ffn_recompute_chunk_tokens={module.recompute_chunk_tokens} does not work under tensor "
                    "parallelism (its backward pass recomputes the block outside the sharded forward); set it to 0: "
                    "each rank keeps a 1/tp_size share of the FFN's activations anyway")
            group = _tp_group(mesh)
            hooked: dict[str, torch.nn.Parameter] = {}

            def sum_gradient(grad):
                grad = grad.contiguous().clone()
                dist.all_reduce(grad, group=group)
                return grad

            def hook_replicated_parameters():
                # at the first forward: loading the weights replaces the parameters after TP is applied
                for name, param in module.named_parameters():
                    if param.requires_grad and not hasattr(param, "placements") and hooked.get(name) is not param:
                        param.register_hook(sum_gradient)
                        hooked[name] = param

            super().install_forward(module, mesh, **options)
            sharded_forward = module.forward  # swaps in the local shards: hook the parameters before that

            def forward(*args, **kwargs):
                if torch.is_grad_enabled():
                    hook_replicated_parameters()
                return sharded_forward(*args, **kwargs)

            module.forward = forward
            return module

        def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
            hidden_states = args[0]
            if torch.is_grad_enabled() and hidden_states.requires_grad:
                hidden_states = _SumGradientsOverRanks.apply(hidden_states, _tp_group(mesh))
            return (hidden_states, *args[1:]), kwargs

        def transform_output_post_forward(self, module, output, mesh, **options):
            return _SumOverRanks.apply(output, _tp_group(mesh))

    if PARTIAL_SUM_STYLE not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES.register(PARTIAL_SUM_STYLE, PartialSumParallel())


class TokenEmbeddingRelay:
    """Carries the token embeddings X0 through transformers' pipeline stages (see the module docstring).

    Installed on `model._pp_stage` (the stage object transformers' pipeline sets): after each "send_forward" of the
    hidden states it sends the X0 of the current batch to the next stage; a later stage receives it in its forward.
    """

    def __init__(self, stage):
        self.stage = stage
        self.token_embeddings: torch.Tensor | None = None
        self._communicate = stage.communicate

        def communicate(operation, **kwargs):
            result = self._communicate(operation, **kwargs)
            if operation == "send_forward" and not stage.pp_is_last_stage and self.token_embeddings is not None:
                self._communicate(operation, device=kwargs["device"], dtype=kwargs["dtype"],
                                  tensor=self.token_embeddings)
                self.token_embeddings = None
            return result

        stage.communicate = communicate

    def exchange(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """X0 of this batch: the stage's own embeddings on the first stage, else the previous stage's X0."""
        if self.stage.pp_is_first_stage:
            token_embeddings = inputs_embeds
        else:
            token_embeddings = self._communicate("recv_forward", device=inputs_embeds.device,
                                                 dtype=inputs_embeds.dtype, shape=tuple(inputs_embeds.shape))
        self.token_embeddings = token_embeddings.detach()
        return token_embeddings
