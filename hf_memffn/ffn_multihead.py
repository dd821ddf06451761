"""The multi-head FFNs of FlashMHFLlama, which read per-head queries of the hidden state:

- `FlashMHFFeedForward`: multi-head FFN with E gated SwiGLU sub-networks per head (flash-mhf.md eq. 10-14), and the
  paper's MH-FFN (E=1, no gates) and Dense-MoE (one head) baselines, which are the same module with other sizes;
  it runs the fused op of `flash_mhf_op.py`.
- `ParametricKVFeedForward`: the PKV baseline, per-head softmax attention over learned key/value slots.

They live apart from `ffn.py` so that only FlashMHFLlama checkpoints carry the fused op and its kernels (transformers
copies a modeling file's sibling imports next to the weights).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from transformers import initialization as init

from .ffn import FeedForwardMemory, linear_weight_in_use, load_checkpoint_parts, package_logger
from .flash_mhf_op import flash_mhf_layer, flash_mhf_layer_path, router_gates
from .rms_norm import MemFFNRMSNorm
from .triton_launch import autocast_available, autocast_enabled, autocast_off

logger = package_logger(__name__)


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU random state and that of `device` (None for a CPU device, and for the meta device, which draws no
    numbers)."""
    if device.type in ("cpu", "meta"):
        return torch.get_rng_state(), None
    return torch.get_rng_state(), torch.get_device_module(device).get_rng_state(device)


class _TokenChunkedRecompute(torch.autograd.Function):
    """Runs a position-wise module over [1, n, d] tokens chunk by chunk without keeping any activation: the backward
    pass recomputes each chunk and writes its input gradient straight into one preallocated tensor. The recompute
    starts from the random state of the forward pass, so dropout inside the module (an adapter's) draws the same
    masks as in the forward pass. The backward is not differentiable again: a second derivative through it (a gradient
    penalty, `create_graph=True`) raises instead of leaving the module's share out."""

    @staticmethod
    def forward(ctx, module, chunk_tokens, tokens, *params):
        ctx.module, ctx.chunk_tokens, ctx.params = module, chunk_tokens, params
        device_type = tokens.device.type
        # the recompute runs under the same autocast as this forward (none on the meta device, which has no autocast)
        ctx.autocast = None
        if autocast_available(device_type):
            ctx.autocast = dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                                dtype=torch.get_autocast_dtype(device_type))
        ctx.rng_states = _rng_states(tokens.device)
        ctx.save_for_backward(tokens)
        output = None
        # (chunks of the detached input: a slice of `tokens` here would be a view that requires grad without a grad_fn,
        # on which a forward pre-hook of the module's submodules that hooks its inputs' gradients fails, as
        # FlopCounterMode's does)
        detached = tokens.detach()
        for start in range(0, tokens.shape[1], chunk_tokens):
            chunk_output = module._forward(detached[:, start : start + chunk_tokens])
            if output is None:
                output = chunk_output.new_empty(1, tokens.shape[1], chunk_output.shape[-1])
            output[:, start : start + chunk_tokens] = chunk_output
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (tokens,) = ctx.saved_tensors
        needs_tokens = ctx.needs_input_grad[2]
        params = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[3:]) if needed]
        grad_tokens = torch.empty_like(tokens) if needs_tokens else None
        grad_params = [None] * len(params)
        cpu_state, device_state = ctx.rng_states
        devices = [tokens.device] if device_state is not None else []
        with torch.random.fork_rng(devices=devices, device_type=tokens.device.type if devices else "cpu"):
            torch.set_rng_state(cpu_state)
            if device_state is not None:
                torch.get_device_module(tokens.device).set_rng_state(device_state, tokens.device)
            for start in range(0, tokens.shape[1], ctx.chunk_tokens):
                stop = start + ctx.chunk_tokens
                grads = _TokenChunkedRecompute._chunk_gradients(
                    ctx, tokens[:, start:stop], grad_output[:, start:stop], params, needs_tokens
                )
                if needs_tokens:
                    grad_tokens[:, start:stop] = grads.pop(0)
                for i, grad in enumerate(grads):
                    if grad is not None:  # (None: a parameter the forward left unused, as the plain module's gets none)
                        # (summed in float32: bf16 sums of many chunks' gradients lose precision with each chunk)
                        total = grad_params[i]
                        grad_params[i] = (grad.to(torch.promote_types(grad.dtype, torch.float32)) if total is None
                                          else total.add_(grad))
                del grads
        grad_params = [grad if grad is None else grad.to(param.dtype) for grad, param in zip(grad_params, params)]
        grads_by_param = iter(grad_params)
        all_param_grads = [next(grads_by_param) if needed else None for needed in ctx.needs_input_grad[3:]]
        return None, None, grad_tokens, *all_param_grads

    @staticmethod
    def _chunk_gradients(ctx, chunk, grad_chunk, params, needs_tokens) -> list[torch.Tensor]:
        # a function of its own, so the chunk's activations are freed before the next chunk runs
        chunk = chunk.detach().requires_grad_(needs_tokens)
        autocast = torch.autocast(**ctx.autocast) if ctx.autocast is not None else contextlib.nullcontext()
        with torch.enable_grad(), autocast:
            # (the module reads a view of the leaf `chunk`: a hook on the gradient of a submodule's input, as
            # FlopCounterMode registers, cannot be on a leaf inside `autograd.grad`)
            chunk_output = ctx.module._forward(chunk.view_as(chunk))
        inputs = ([chunk] if needs_tokens else []) + params
        # (a parameter may require a gradient that the forward does not use: a PEFT adapter loaded trainable but not
        # active; its gradient stays None, not an error)
        return list(torch.autograd.grad(chunk_output, inputs, grad_chunk, allow_unused=True))


def _refuse_weights_from_outside(module: nn.Module, chunk_tokens: int) -> None:
    """A ValueError where a weight of `module` is parametrized by tensors that the module does not hold (PEFT's
    `target_parameters` LoRA: its wrapper computes the delta from its own adapter weights and attaches it for the
    wrapper's forward only). The backward pass recomputes from the module's own weights, without that delta, so the
    adapter would get no gradient and the other gradients would be those of the weight without it."""
    parametrizations = getattr(module, "parametrizations", None)
    if not isinstance(parametrizations, nn.ModuleDict):
        return
    outside = [name for name, chain in parametrizations.items()
               if any(isinstance(value, torch.Tensor) for item in chain for value in vars(item).values())]
    if outside:
        raise ValueError(
            f"ffn_recompute_chunk_tokens={chunk_tokens}: the FFN weights {outside} carry an adapter that the module "
            "does not hold (PEFT's target_parameters LoRA), which the backward pass's recompute leaves out: it would "
            "get no gradient. Adapt these weights with hf_memffn.adapters.add_weight_lora, which the recompute sees, "
            "or set ffn_recompute_chunk_tokens=0")


TOKEN_CHUNKED_RECOMPUTE_UNDER_COMPILE = (
    "ffn_recompute_chunk_tokens > 0 recomputes the FlashMHF FFN chunk by chunk in an autograd function of its own "
    "(a loop over the batch's tokens, the random state of the forward, a backward that differentiates each chunk "
    "again), which no torch.compile graph holds: torch.compile(..., fullgraph=True) cannot trace a model training "
    "with it. Compile without fullgraph (the FFN's recompute runs between the graphs, once per layer), or set "
    "ffn_recompute_chunk_tokens=0")


@torch.compiler.disable(reason=TOKEN_CHUNKED_RECOMPUTE_UNDER_COMPILE)
def recompute_in_token_chunks(module: nn.Module, hidden_states: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Apply a position-wise `module._forward` ([1, n, d] -> [1, n, d']) to [B, L, d] keeping only the input for the
    backward pass: the B*L tokens run as chunks of `chunk_tokens`, each recomputed in the backward pass, so the
    activation memory of the backward pass is one chunk's, whatever B and L. Costs one extra forward of the module.
    Under torch.compile this runs outside the graph, one graph break per call (traced, its loop over the tokens would
    compile it again for every batch shape until Dynamo's recompile limit sends it to eager, and the random state it
    reads would break the graphs of the layers around it); with `fullgraph=True` the error that refuses the break
    carries `TOKEN_CHUNKED_RECOMPUTE_UNDER_COMPILE`."""
    batch, length, width = hidden_states.shape
    if batch * length == 0:
        return module._forward(hidden_states)
    if torch.is_grad_enabled():  # (without gradients nothing is recomputed)
        _refuse_weights_from_outside(module, chunk_tokens)
    tokens = hidden_states.reshape(1, batch * length, width)
    output = _TokenChunkedRecompute.apply(module, chunk_tokens, tokens, *module.parameters())
    return output.view(batch, length, -1)


class _MultiHeadQueries(FeedForwardMemory, nn.Module):
    """Shared front and back of the multi-head FFNs: project to per-head queries, and heads back to the model.

    As memory (`FeedForwardMemory`), each head's cells store their values in head space, `value[h_kv, ..., j]`
    `[d_h]`, shared by the heads of a group of `num_heads / value.shape[0]` like grouped-query attention; the head's
    slice of `out_proj` maps them to the model. Subclasses define `value` and the coefficients.
    """

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.ffn_num_heads
        self.head_dim = config.hidden_size // config.ffn_num_heads
        hidden_size = config.hidden_size
        self.in_proj = nn.Linear(hidden_size, hidden_size, bias=False) if config.ffn_io_projections else None
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=False) if config.ffn_io_projections else None
        self.query_norm = MemFFNRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.ffn_query_norm else None

    def queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, L, d] -> [B, H, L, d_h]"""
        batch, length, _ = hidden_states.shape
        if self.in_proj is not None:
            hidden_states = self.in_proj(hidden_states)
        queries = hidden_states.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        return self.query_norm(queries) if self.query_norm is not None else queries

    def merge_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """[B, H, L, d_h] -> [B, L, d]"""
        batch, _, length, _ = heads.shape
        merged = heads.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.out_proj(merged) if self.out_proj is not None else merged

    # -- memory interface (`FeedForwardMemory`): values in head space -------------------------------------------------
    @property
    def memory_cell_shape(self) -> tuple[int, ...]:
        return (self.num_heads, *self.value.shape[1:-1])

    @property
    def _heads_per_value_head(self) -> int:
        return self.num_heads // self.value.shape[0]

    def _out_proj_heads(self) -> torch.Tensor:
        """`out_proj`'s weight in use (an adapter's included) split by head, [d, H, d_h] in float32 (the identity
        without `out_proj`)."""
        width = self.num_heads * self.head_dim
        weight = (linear_weight_in_use(self.out_proj) if self.out_proj is not None
                  else torch.eye(width, device=self.value.device))
        return weight.float().reshape(weight.shape[0], self.num_heads, self.head_dim)

    def memory_values(self) -> torch.Tensor:
        """The value vectors in model space [num_cells, d], in float32 (also under autocast)."""
        values = self.value.detach().float().repeat_interleave(self._heads_per_value_head, dim=0)  # [H, ..., d_h]
        with autocast_off(values.device.type):
            model_space = torch.einsum("h...d,mhd->h...m", values, self._out_proj_heads())
        return model_space.reshape(self.memory_num_cells, -1)

    def memory_value_parameter(self) -> nn.Parameter:
        return self.value

    def _cell_index(self, cell: int) -> list[int]:
        return [int(i) for i in torch.unravel_index(torch.tensor(int(cell)), self.memory_cell_shape)]

    @torch.no_grad()
    def add_to_memory_value(self, cell: int, delta: torch.Tensor) -> None:
        """Only the part of `delta` in the span of the head's slice of `out_proj` is realised (least squares); the
        change reaches every head of the cell's group, which share the value. Solved in float32, also under
        autocast."""
        head, *rest = self._cell_index(cell)
        out_head = self._out_proj_heads()[:, head]  # [d, d_h]
        with autocast_off(out_head.device.type):
            head_delta = torch.linalg.lstsq(out_head, delta.float().to(out_head.device).unsqueeze(-1)).solution[:, 0]
        self.value[(head // self._heads_per_value_head, *rest)] += head_delta.to(self.value.device, self.value.dtype)

    def memory_value_delta_for_output(
        self, cell: int, coefficients: torch.Tensor, output_change: torch.Tensor
    ) -> torch.Tensor:
        """Heads of a group share value rows, so changing cell (h, ..., j) moves the output of every head h' of the
        group by `c[h', ..., j] * W_o[h'] @ dv`. Solves for `dv` in least squares, scaled so that the realised output
        change has `output_change`'s full component along `output_change` (only a d_h-dim span is reachable). Solved
        in float32, also under autocast."""
        head, *rest = self._cell_index(cell)
        group = self._heads_per_value_head
        first = head - head % group
        out_heads = self._out_proj_heads()
        coefficients = coefficients.reshape(self.memory_cell_shape)
        reach = sum(  # [d, d_h]: output change per unit of head-space value change
            float(coefficients[(h, *rest)]) * out_heads[:, h] for h in range(first, first + group)
        )
        target = output_change.float().to(out_heads.device)
        with autocast_off(out_heads.device.type):
            head_delta = torch.linalg.lstsq(reach, target.unsqueeze(-1)).solution[:, 0]
            along = float((reach @ head_delta) @ target)
            if along > 0:
                head_delta = head_delta * float(target @ target) / along
            return out_heads[:, head] @ head_delta


class FlashMHFFeedForward(_MultiHeadQueries):
    """Flash Multi-Head FFN. Per head h with query q (after `in_proj` and `query_norm`, in float32):

        R = sigmoid(q W_router) / (sum_E sigmoid(q W_router) + eps)
        S_h = sum_e R_e * (SiLU(q K_e^T) * (q U_e^T)) V_e

    then heads are concatenated and projected by `out_proj`. Everything between the projections is one call of
    `flash_mhf_layer`: on the Triton path its kernels compute the norm, the gates and the sub-networks, forward and
    backward (`path_description()` says which path runs). The sub-network weights `key`, `up`, `value`,
    [ffn_num_kv_heads, E, subnetwork_size, d_h] each, are the thirds of one parameter `key_up_value`
    [3 * ffn_num_kv_heads, E, subnetwork_size, d_h] (contiguous views): a compiled decoding step pays host time per
    parameter tensor it reads, and the layer's backward writes the three gradients into one tensor. Checkpoints
    store them as three tensors `key`, `up`, `value` (see `SUBNETWORK_WEIGHTS_CONVERSION`). Groups of heads share
    them like grouped-query attention.
    With `ffn_variant="mh_ffn"` there is a single sub-network and no router (the naive multi-head FFN).
    With `ffn_recompute_chunk_tokens` > 0 the module keeps only its input for the backward pass and recomputes its
    activations chunk by chunk (see `recompute_in_token_chunks`).
    """

    def __init__(self, config):
        super().__init__(config)
        self.num_kv_heads = config.ffn_num_kv_heads
        self.num_subnetworks = config.ffn_num_subnetworks
        self.subnetwork_size = config.intermediate_size // config.ffn_num_subnetworks
        self.gate_eps = config.ffn_gate_eps
        self.kernel = config.ffn_kernel
        self.key_up_value = nn.Parameter(
            torch.empty(3 * config.ffn_num_kv_heads, self.num_subnetworks, self.subnetwork_size, self.head_dim))
        if config.ffn_variant == "mh_ffn":
            self.router = None
        else:
            self.router = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.num_subnetworks))
        self.recompute_chunk_tokens = config.ffn_recompute_chunk_tokens
        # True: on the Triton path the query norm and the gates run in the layer's kernels; False: as PyTorch
        # operations around the op (the reference; benchmarks switch it to compare)
        self.fused_layer = True
        self._path_logged = False

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A state dict in the checkpoint's names (`key`, `up`, `value`, as the HF Trainer reads a saved checkpoint
        back to resume or to load the best one) fills `key_up_value`, concatenated as loading does; some of the three
        (a shard of a sharded checkpoint) fill their own thirds."""
        load_checkpoint_parts(state_dict, [f"{prefix}{name}" for name in ("key", "up", "value")],
                              f"{prefix}key_up_value", self.key_up_value, join=torch.cat,
                              rows_of_part=lambda index: self.key_up_value.chunk(3)[index], error_msgs=error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def check_distributed_loading(self, distributed_config, model_name: str, device_type: str) -> None:
        """Refuses transformers' own FSDP (`fsdp_size` > 1), which shards dim 0 of every parameter before loading and
        reads each checkpoint tensor's share of that dim: `key_up_value` is joined from three checkpoint tensors along
        dim 0, so each rank would get its share of each, not its block of rows of the joined tensor, and train wrong
        without an error. (Tensor parallelism splits `subnetwork_size`, which commutes with the join.)

        Under tensor parallelism each rank runs `subnetwork_size / tp_size` columns of every sub-network: where the
        Triton kernels run them (`ffn_kernel="triton"`, or "auto" on CUDA devices), that share must be a multiple of
        16 as `subnetwork_size` must be, or every forward would stop at the kernels' check."""
        tp_size = getattr(distributed_config, "tp_size", None) or 1
        size = self.subnetwork_size
        kernels = self.kernel == "triton" or (self.kernel == "auto" and device_type == "cuda")
        if tp_size > 1 and kernels and size % 16 == 0 and (size % tp_size or size // tp_size % 16):
            allowed = [count for count in range(1, size // 16 + 1) if size // 16 % count == 0]
            raise ValueError(
                f"{model_name}: subnetwork_size={size} (intermediate_size // ffn_num_subnetworks) split over "
                f"tp_size={tp_size} leaves each rank {size / tp_size:g} columns of every sub-network, and the Triton "
                f"kernels (ffn_kernel={self.kernel!r} on {device_type} devices) take multiples of 16; allowed tp_size: "
                f"{', '.join(map(str, allowed))}, or ffn_kernel='torch' (the PyTorch reference)")
        fsdp_size = getattr(distributed_config, "fsdp_size", None) or 1
        if fsdp_size > 1:
            raise ValueError(
                f"{model_name} does not load under transformers' FSDP (distributed_config with fsdp_size={fsdp_size}): "
                "loading joins key_up_value from several checkpoint tensors, which that FSDP would shard in another "
                "order. Load the model whole and shard it after loading (accelerate's FSDP2, "
                "examples/accelerate/fsdp2.yaml, or torch's fully_shard), or use tensor parallelism (tp_size)")

    def subnetwork_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key, up, value), contiguous views of `key_up_value` (the layer itself takes `key_up_value` whole, and its
        backward writes the three gradients into one tensor)."""
        return self.key_up_value.chunk(3)

    @property
    def key(self) -> torch.Tensor:
        return self.subnetwork_weights()[0]

    @property
    def up(self) -> torch.Tensor:
        return self.subnetwork_weights()[1]

    @property
    def value(self) -> torch.Tensor:
        return self.subnetwork_weights()[2]

    def gates(self, queries: torch.Tensor) -> torch.Tensor:
        """Normalized sub-network weights R [B, H, L, E] in float32 (also under autocast; float64 for float64
        queries), for `queries()`."""
        return router_gates(queries, self.router, self.gate_eps)

    def path_description(self, hidden_states: torch.Tensor | None = None) -> str:
        """Which implementation this module's forward runs for `hidden_states` ([B, L, d]; by default one token on
        the parameters' device and dtype), with gradients recorded or not as they are now."""
        records_input = hidden_states is not None and hidden_states.requires_grad
        # (the parameters the layer reads, or that make its input record gradients: not `out_proj`'s, which train
        # after the layer, whose inference path (the decode kernel for few tokens) runs then)
        layer_parameters = (param for name, param in self.named_parameters() if not name.startswith("out_proj."))
        needs_grad = torch.is_grad_enabled() and (records_input or any(p.requires_grad for p in layer_parameters))
        # (no autograd record: a weight parametrization (LoRA on the weights) computes `key` here, and a forward under
        # activation checkpointing must save the same tensors when it is recomputed, where nothing is logged)
        with torch.no_grad():
            key = self.key
            if hidden_states is None:
                hidden_states = key.new_empty(1, 1, self.num_heads * self.head_dim)
            return flash_mhf_layer_path(hidden_states, key, impl=self.kernel, fused=self.fused_layer,
                                        needs_grad=needs_grad)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # In training also without gradients: reentrant activation checkpointing runs the layer's forward without
        # them and recomputes it with them, and both must draw the same random numbers (an adapter's dropout) in the
        # same chunks, or the loss and the gradients come from different forwards. Not while non-strict torch.export
        # traces (Dynamo's capture meets the disable instead): it would trace the chunks of the example's tokens into a
        # program that refuses any other number of tokens, whatever dynamic shapes it was given.
        if self.recompute_chunk_tokens and (torch.is_grad_enabled() or self.training) and not (
                torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling()):
            return recompute_in_token_chunks(self, hidden_states, self.recompute_chunk_tokens)
        return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        projected = self.in_proj(hidden_states) if self.in_proj is not None else hidden_states
        if autocast_enabled(projected.device.type):
            # The layer is a custom op that autocast does not see: run it in the autocast dtype, as autocast would run
            # a matmul (without input projection the input is the float32 normalized residual stream).
            projected = projected.to(torch.get_autocast_dtype(projected.device.type))
        # (the compile check first: read while tracing, the flag would become a guard, and the eager forward that
        # sets it would make every compiled graph of the model recompile)
        if not torch.compiler.is_compiling() and not self._path_logged:
            logger.info("FlashMHF FFN runs the %s", self.path_description(projected))
            self._path_logged = True
        norm, norm_weight, eps = self.query_norm, None, 0.0
        if isinstance(norm, MemFFNRMSNorm):
            norm_weight, eps = norm.weight, norm.variance_epsilon
        # The query norm runs as its module, in float32 as the layer's, where the fused layer cannot read its weight:
        # offloaded by accelerate (a device_map with "cpu" or "disk" entries), the weight is loaded only while the
        # norm's own forward runs; replaced by a PEFT layer (LN tuning's), the weight in use is that of its copy.
        if norm is not None and (norm_weight is None or norm_weight.is_meta and not projected.is_meta):
            queries = norm(projected.float().unflatten(-1, (self.num_heads, self.head_dim)))
            projected, norm_weight, eps = queries.flatten(-2).to(projected.dtype), None, 0.0
        heads = flash_mhf_layer(projected, norm_weight, self.router, self.key_up_value, eps=eps,
                                gate_eps=self.gate_eps, impl=self.kernel, fused=self.fused_layer)
        return self.out_proj(heads) if self.out_proj is not None else heads

    def extra_repr(self) -> str:
        # (`print(model)` lists submodules only: these sizes stand for the sub-network weights and the router, plain
        # parameters; from the constructor, as DeepSpeed ZeRO-3 leaves the parameters empty)
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"subnetworks={self.num_subnetworks}, subnetwork_size={self.subnetwork_size}, "
                f"router={self.router is not None}")

    def init_own_parameters(self, std: float) -> None:
        for param in (self.key_up_value, self.router):
            if param is not None:
                init.normal_(param, mean=0.0, std=std)

    # -- memory interface (`FeedForwardMemory`), computed from the parameters with plain torch ------------------------
    memory_kind = "flash_mhf"
    memory_cell_axes = ("head", "subnetwork", "cell")

    def memory_value_parameter(self) -> nn.Parameter:
        return self.key_up_value  # the values are its last third

    def memory_coefficients(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`R_e * SiLU(q K_e^T)_j * (q U_e^T)_j` for head h, sub-network e, cell j: [B, L, H * E * d_e] in float32,
        flattened in (head, subnetwork, cell) order (R = 1 without a router); also under autocast, which is off here
        (the queries, `in_proj` included, as without it)."""
        with autocast_off(hidden_states.device.type):
            queries = self.queries(hidden_states).transpose(1, 2).float()  # [B, L, H, d_h]
            key = self.key.float().repeat_interleave(self._heads_per_value_head, dim=0)  # [H, E, d_e, d_h]
            up = self.up.float().repeat_interleave(self._heads_per_value_head, dim=0)
            hidden = (F.silu(torch.einsum("blhd,hejd->blhej", queries, key))
                      * torch.einsum("blhd,hejd->blhej", queries, up))
            if self.router is not None:
                gates = router_gates(queries.transpose(1, 2), self.router, self.gate_eps)  # [B, H, L, E]
                hidden = hidden * gates.transpose(1, 2).unsqueeze(-1)
        return hidden.flatten(-3)


class ParametricKVFeedForward(_MultiHeadQueries):
    """PKV baseline: per head, softmax(q K^T / sqrt(d_h)) V over `intermediate_size` learned key/value slots."""

    def __init__(self, config):
        super().__init__(config)
        slots = self.num_slots = config.intermediate_size
        self.key = nn.Parameter(torch.empty(self.num_heads, slots, self.head_dim))
        self.value = nn.Parameter(torch.empty(self.num_heads, slots, self.head_dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        queries = self.queries(hidden_states)
        batch = queries.shape[0]
        keys = self.key.to(queries.dtype).unsqueeze(0).expand(batch, -1, -1, -1)
        values = self.value.to(queries.dtype).unsqueeze(0).expand(batch, -1, -1, -1)
        heads = F.scaled_dot_product_attention(queries, keys, values)
        return self.merge_heads(heads)

    def extra_repr(self) -> str:
        # (the slots' keys and values are plain parameters, which `print(model)` does not list)
        return f"heads={self.num_heads}, head_dim={self.head_dim}, slots={self.num_slots}"

    def init_own_parameters(self, std: float) -> None:
        init.normal_(self.key, mean=0.0, std=std)
        init.normal_(self.value, mean=0.0, std=std)

    memory_kind = "pkv"
    memory_cell_axes = ("head", "cell")

    def memory_coefficients(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`softmax(q K^T / sqrt(d_h))` over each head's slots: [B, L, H * slots] in float32; also under autocast,
        which is off here (the queries, `in_proj` included, as without it)."""
        with autocast_off(hidden_states.device.type):
            queries = self.queries(hidden_states).transpose(1, 2).float()  # [B, L, H, d_h]
            scores = torch.einsum("blhd,hjd->blhj", queries, self.key.float()) / self.head_dim**0.5
        return scores.softmax(-1).flatten(-2)
