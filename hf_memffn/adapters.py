"""LoRA and weight-only int8 for the FFN weights that are plain parameters, not `nn.Linear` layers.

Half of a FlashMHF or MemoryLLM model is such weights: FlashMHF's sub-network banks key/up/value, one parameter
`key_up_value` [3 * H_kv, E, d_e, d_h], and router [H, d_h, E] (`FlashMHFFeedForward`), PKV's key/value slots
[H, slots, d_h] (`ParametricKVFeedForward`), and the stacked FFNs on X0 gate/up [N, I, d], down [N, d, I] (`TokenMemory`).
LoRA `target_modules` and Linear-based quantizers do not see them, and PEFT's `target_parameters` takes 2-D and 3-D
parameters only (it adapts `TokenMemory` and the router, not FlashMHF's 4-D banks). Both adapters here are
`torch.nn.utils.parametrize` parametrizations of the parameter in place, so neither the stored shapes nor the
modules' forward (FlashMHF's fused kernel call included) change: the module reads the effective weight.

- `add_weight_lora(model, r, alpha)`: W + (alpha / r) B A on the last two dims of every such weight, one (A, B)
  pair per leading index (per weight group and sub-network, per head, per layer), B = 0 at the start. Only the
  adapter weights are trainable afterwards unless `freeze_base=False`. Combine it with PEFT's LoRA on the Linear
  layers (`hf_memffn.LORA_TARGET_MODULES`) to adapt every FFN weight; PEFT's adapters stay trainable.
- A checkpoint saved while adapters (or int8) are attached holds the parametrized tensors, as the Trainer's
  checkpoints need to resume; `from_pretrained` refuses it. Merge first for a checkpoint in the original format.
  On a PEFT model, PEFT's `save_pretrained` (the Trainer's checkpoints of it too) holds PEFT's adapters only: save
  these with `weight_lora_state_dict`.
- `merge_weight_lora(model)`: folds the adapters into the weights (every int8 weight is float again, with an
  adapter or not); the model saves in the original format again.
- `weight_lora_state_dict(model)` / `load_weight_lora(model, state_dict)`: the adapter weights alone.
- `quantize_weights_int8(model)`: keeps each such weight as int8 with a float scale per row of its last dim
  (about a quarter of float32's memory, half of bfloat16's) and dequantizes it when the module reads it. Compute
  stays in the model's dtype. LoRA can be added on top (QLoRA-style: the int8 base stays frozen).
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from .ffn import TokenMemory
from .ffn_multihead import FlashMHFFeedForward, ParametricKVFeedForward
from .token_lookup import keep_tables_through, pruned_weight_names
from .triton_launch import autocast_off

# module class -> its weights that are plain parameters (norm weights are left alone)
PARAMETER_WEIGHTS = {
    FlashMHFFeedForward: ("key_up_value", "router"),
    ParametricKVFeedForward: ("key", "value"),
    TokenMemory: ("gate_proj", "up_proj", "down_proj"),
}
# (class name, file without .py) -> the same weights. A model loaded with `trust_remote_code` runs the copy of these
# files saved with its checkpoint (transformers_modules.<...>.ffn.TokenMemory), whose classes are not the package's.
_PARAMETER_WEIGHTS_BY_NAME = {
    (module_class.__name__, module_class.__module__.rpartition(".")[2]): names
    for module_class, names in PARAMETER_WEIGHTS.items()
}


def _parameter_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The weight names of `PARAMETER_WEIGHTS` for `module`'s class (the package's, a checkpoint's copy of it, or the
    subclass a parametrization makes of either), else ()."""
    for module_class in type(module).__mro__:
        names = _PARAMETER_WEIGHTS_BY_NAME.get((module_class.__name__, module_class.__module__.rpartition(".")[2]))
        if names is not None:
            return names
    return ()


def parameter_weights(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, owning module, attribute) of every FFN weight that is a plain parameter."""
    found = []
    for module_name, module in model.named_modules():
        for name in _parameter_weight_names(module):
            if getattr(module, name, None) is not None:
                found.append((f"{module_name}.{name}" if module_name else name, module, name))
    return found


class LowRankDelta(nn.Module):
    """Parametrization W -> W + scaling * B @ A over W's last two dims, batched over its leading dims."""

    def __init__(self, weight: torch.Tensor, r: int, alpha: float):
        super().__init__()
        *lead, rows, cols = weight.shape
        self.alpha = alpha
        self.scaling = alpha / r
        self.lora_A = nn.Parameter(torch.empty(*lead, r, cols, device=weight.device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(*lead, rows, r, device=weight.device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A.view(-1, cols), a=math.sqrt(5))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        # (in float32 also under autocast: the weight read, and merged, is then the same inside a caller's autocast
        # as outside it; the modules that read it cast it to the autocast dtype themselves)
        with autocast_off(weight.device.type):
            delta = torch.matmul(self.lora_B, self.lora_A) * self.scaling
        return weight + delta.to(weight.dtype)


def _check_rank(r, alpha) -> None:
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r <= 0:
        raise ValueError(f"r={r!r} is invalid: must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha={alpha!r} is invalid: must be a finite number > 0")


def _parametrized_with(module: nn.Module, name: str, kind: type) -> bool:
    """Whether the weight `module.name` carries a parametrization of class `kind` (LowRankDelta or Int8Weight)."""
    return parametrize.is_parametrized(module, name) and any(
        isinstance(item, kind) for item in module.parametrizations[name])


def _pefts_parameter_adapters(model: nn.Module, found) -> list[str]:
    """The qualified names among `found` of the weights that PEFT's `target_parameters` LoRA adapts: its wrapper
    (`ParamWrapper`) names the weight in `parameter_name` and holds the weight's module as its base layer. Each forward
    of the wrapper registers its delta as a parametrization of that weight and removes it afterwards; on top of
    another parametrization of the weight, PEFT can leave it registered, so that every forward adds the delta once
    more."""
    wrapped = set()
    for module in model.modules():
        name, get_base_layer = getattr(module, "parameter_name", None), getattr(module, "get_base_layer", None)
        if isinstance(name, str) and callable(get_base_layer):
            wrapped.add((id(get_base_layer()), name))
    return sorted(qualified for qualified, module, name in found if (id(module), name) in wrapped)


def _adapter_parameters(model: nn.Module) -> set[int]:
    """ids of the adapters' parameters: ours (`LowRankDelta`) and PEFT's (each PEFT layer names the attributes that
    hold its adapters in `adapter_layer_names`: LoRA's lora_A / lora_B, `modules_to_save` copies, ...)."""
    ids = set()
    for module in model.modules():
        if isinstance(module, LowRankDelta):
            ids.update(id(param) for param in module.parameters())
        for attribute in getattr(module, "adapter_layer_names", ()):
            part = getattr(module, attribute, None)
            if isinstance(part, nn.Module):
                ids.update(id(param) for param in part.parameters())
            elif isinstance(part, nn.Parameter):
                ids.add(id(part))
    return ids


def add_weight_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, targets=None, freeze_base: bool = True) -> list[str]:
    """Add a LoRA adapter to every FFN weight that is a plain parameter (or to those named in `targets`, qualified
    names as `parameter_weights` gives them). Returns the adapted names.

    `freeze_base` freezes every parameter that is not an adapter's: adapters added before (these, or PEFT's on a
    `get_peft_model` model) stay as they were. A weight that has an adapter already (ours, or PEFT's
    `target_parameters` LoRA) is refused (merge it first)."""
    _check_rank(r, alpha)
    r, alpha = int(r), float(alpha)  # (NumPy's integers and floats too)
    found = parameter_weights(model)
    if isinstance(targets, str):
        raise ValueError(f"targets={targets!r} is invalid: must be a list of qualified weight names "
                         f"(adapters.parameter_weights), e.g. targets=[{targets!r}]")
    if targets is not None:
        targets = set(targets)  # (any iterable of names: a generator is read once)
        known = {name for name, _, _ in found}
        unknown = sorted(targets - known)
        if unknown:
            raise ValueError(f"targets={unknown} are not FFN parameter weights of this model; allowed: {sorted(known)}")
        found = [entry for entry in found if entry[0] in targets]
    if not found and freeze_base:
        raise ValueError("add_weight_lora: no FFN weight of this model is a plain parameter to adapt"
                         f"{' among targets=[]' if targets is not None else ''} (the FFNs of Linear layers take PEFT's "
                         "LoRA: hf_memffn.LORA_TARGET_MODULES), and freeze_base=True would freeze the whole model")
    _refuse_sharded_weights("add_weight_lora", found)
    _refuse_offloaded_weights("add_weight_lora", found)
    _refuse_pruned_weights("add_weight_lora", found)
    adapted = sorted(qualified for qualified, module, name in found if _parametrized_with(module, name, LowRankDelta))
    if adapted:
        raise ValueError(f"add_weight_lora: {adapted} have a LoRA adapter already; merge it first "
                         f"(adapters.merge_weight_lora), or pass targets= without them")
    pefts = _pefts_parameter_adapters(model, found)
    if pefts:
        raise ValueError(f"add_weight_lora: {pefts} have PEFT's target_parameters LoRA already; pass targets= "
                         "without them, or leave them out of target_parameters")
    if freeze_base:
        adapter_ids = _adapter_parameters(model)
        for param in model.parameters():
            if id(param) not in adapter_ids:
                param.requires_grad_(False)
    for _, module, name in found:
        parametrize.register_parametrization(module, name, LowRankDelta(getattr(module, name), r, alpha))
    if found and getattr(model, "peft_config", None):
        warnings.warn("add_weight_lora on a PEFT model: PEFT's save_pretrained, and so the Trainer's checkpoints, "
                      "hold PEFT's adapters only, not these; save them with adapters.weight_lora_state_dict(model) "
                      "(adapters.load_weight_lora loads them back), or merge both before saving", stacklevel=2)
    return [name for name, _, _ in found]


def _refuse_sharded_weights(function: str, found) -> None:
    """The parametrizations act on whole tensors: a weight sharded by tensor parallelism (a DTensor) would be mixed
    with its local shard."""
    sharded = [qualified for qualified, module, name in found if hasattr(getattr(module, name), "placements")]
    if sharded:
        raise ValueError(f"{function}: {sharded[:3]}{' ...' if len(sharded) > 3 else ''} are sharded by tensor "
                         "parallelism (DTensors); add adapters or int8 before sharding the model, or load it without "
                         "tp_plan")


def _refuse_offloaded_weights(function: str, found) -> None:
    """A device map with "cpu" or "disk" entries keeps the weights it offloads on the meta device between forwards
    and loads them by name around each forward: a parametrization would be built from the empty meta tensor, and
    would replace it."""
    offloaded = [qualified for qualified, module, name in found if getattr(module, name).is_meta]
    if offloaded:
        raise ValueError(f"{function}: {offloaded[:3]}{' ...' if len(offloaded) > 3 else ''} are on the meta device "
                         "(offloaded by a device map with \"cpu\" or \"disk\" entries, or not loaded yet); load the "
                         "model with these weights on a device (a device_map that offloads none of them) first")


def _refuse_pruned_weights(function: str, found) -> None:
    """`torch.nn.utils.prune` keeps a pruned weight as `<name>_orig` and a mask until `prune.remove`, and its forward
    pre-hook writes `<name>` as a plain tensor (masked original) before each forward: no parameter to parametrize, and
    the hook would overwrite the parametrized weight."""
    pruned = [qualified for qualified, module, name in found if name in pruned_weight_names(module)]
    if pruned:
        raise ValueError(f"{function}: {pruned[:3]}{' ...' if len(pruned) > 3 else ''} are pruned by "
                         "torch.nn.utils.prune and still carry its mask; make the pruning permanent first with "
                         "prune.remove(module, name), then call it again")


def _lora_parametrizations(model: nn.Module):
    for _, module, name in parameter_weights(model):
        if parametrize.is_parametrized(module, name):
            for index, item in enumerate(module.parametrizations[name]):
                if isinstance(item, LowRankDelta):
                    yield module, name, index, item


def merge_weight_lora(model: nn.Module) -> int:
    """Fold the LoRA adapters into their weights; every int8 weight, with an adapter or not, becomes a float one
    again. Returns how many adapters were merged. Afterwards the weights are plain parameters with their original
    names and shapes, and the model saves in the original format. Called under `torch.inference_mode()` too, the
    merged weights are ordinary tensors, which a later training step records. A token lookup table loaded from an
    export through the adapters stays loaded: it holds the merged weights' values."""
    return keep_tables_through(lambda: _merge_weight_lora(model), model)


def _merge_weight_lora(model: nn.Module) -> int:
    merged = 0
    # (outside inference mode: a weight made inside it would be an inference tensor, which no later forward can save
    # for its backward and `requires_grad_(True)` cannot unfreeze)
    with torch.inference_mode(False):
        for _, module, name in parameter_weights(model):
            if not parametrize.is_parametrized(module, name):
                continue
            with torch.no_grad():
                effective = getattr(module, name).detach().clone()
            chain = module.parametrizations[name]
            requires_grad = (chain.original if chain.is_tensor else chain.original0).requires_grad
            merged += sum(isinstance(item, LowRankDelta) for item in chain)
            parametrize.remove_parametrizations(module, name, leave_parametrized=True)
            setattr(module, name, nn.Parameter(effective, requires_grad=requires_grad))
    return merged


def weight_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights alone, keyed by the adapted weight's qualified name, with each adapter's alpha as a
    float64 scalar (`<name>.lora_alpha`), which `load_weight_lora` checks against the adapters it loads into."""
    names = {id(module): module_name for module_name, module in model.named_modules()}
    state = {}
    for module, name, _, item in _lora_parametrizations(model):
        prefix = f"{names[id(module)]}.{name}".lstrip(".")
        state[f"{prefix}.lora_A"] = item.lora_A.detach().clone()
        state[f"{prefix}.lora_B"] = item.lora_B.detach().clone()
        state[f"{prefix}.lora_alpha"] = torch.tensor(item.alpha, dtype=torch.float64)
    return state


# FlashMHF's banks were three parameters, `key`, `up` and `value` [H_kv, E, d_e, d_h], before they became the thirds
# of `key_up_value` [3 * H_kv, E, d_e, d_h]. Their adapters (one (A, B) pair per leading index) are the thirds of the
# merged bank's adapter, so files saved then load exactly.
_SUBNETWORK_BANK_PARTS = ("key", "up", "value")


def _with_merged_bank_adapters(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with the adapters of FlashMHF's former `key`/`up`/`value` parameters joined into those of
    `key_up_value` (where all three are present); other entries as they are."""
    state = dict(state_dict)
    for key in list(state_dict):
        prefix, _, part = key.rpartition(".")
        if not prefix.endswith(".key") or part not in ("lora_A", "lora_B"):
            continue
        module = prefix[: -len(".key")]
        old = [f"{module}.{bank}.{part}" for bank in _SUBNETWORK_BANK_PARTS]
        if all(name in state for name in old):
            state[f"{module}.key_up_value.{part}"] = torch.cat([state.pop(name) for name in old])
    return state


# where a PEFT model (`get_peft_model`) holds the model it wraps
_PEFT_MODEL_PREFIX = "base_model.model."


def load_weight_lora(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load adapter weights saved by `weight_lora_state_dict` into a model with the same adapters added (also files
    saved when FlashMHF's banks were three parameters `key`, `up`, `value`). The names are compared without PEFT's
    prefix `base_model.model.`: adapters saved from a PEFT model load into the model it wraps (merged, for example,
    by `merge_and_unload`), and the reverse. Where the state holds an adapter's alpha (`weight_lora_state_dict` saves
    it), an adapter added with another alpha is refused: its delta would be scaled differently. States without one
    (saved by earlier versions) load as they are."""
    state_dict = {key.removeprefix(_PEFT_MODEL_PREFIX): value
                  for key, value in _with_merged_bank_adapters(state_dict).items()}
    names = {id(module): module_name for module_name, module in model.named_modules()}
    adapter_params, alphas = {}, set()
    for module, name, _, item in _lora_parametrizations(model):
        prefix = f"{names[id(module)]}.{name}".lstrip(".").removeprefix(_PEFT_MODEL_PREFIX)
        for part in ("lora_A", "lora_B"):
            key = f"{prefix}.{part}"
            adapter_params[key] = getattr(item, part)
            if key not in state_dict:
                raise ValueError(f"state_dict is missing {key!r}; add the same adapters with add_weight_lora first")
            if tuple(state_dict[key].shape) != tuple(adapter_params[key].shape):
                raise ValueError(f"state_dict[{key!r}] has shape {tuple(state_dict[key].shape)}, this model's "
                                 f"adapter {tuple(adapter_params[key].shape)}: add the adapters with the r they were "
                                 "saved with")
        alpha_key = f"{prefix}.lora_alpha"
        alphas.add(alpha_key)
        if alpha_key in state_dict:
            saved = state_dict[alpha_key]
            saved = float(saved.item()) if isinstance(saved, torch.Tensor) and saved.numel() == 1 else saved
            if not isinstance(saved, float) or saved != item.alpha:
                raise ValueError(f"state_dict[{alpha_key!r}] is {saved!r}, this model's adapter has alpha="
                                 f"{item.alpha!r}: add the adapters with the alpha they were saved with")
    unexpected = sorted(set(state_dict) - set(adapter_params) - alphas)
    if unexpected:
        raise ValueError(f"state_dict has adapter weights this model has no adapter for: {unexpected}")
    for key, param in adapter_params.items():
        param.data.copy_(state_dict[key])


class Int8Weight(nn.Module):
    """Parametrization storing a weight as int8 values (`original0`) and a float scale per row of its last dim
    (`original1`); reading the weight dequantizes it to the scale's dtype."""

    def forward(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return values.to(scale.dtype) * scale

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (in float32: a 16-bit quotient would round before its rounding to an integer)
        weight32 = weight.detach().float()
        exact_scale = weight32.abs().amax(dim=-1, keepdim=True) / 127.0
        # The scale is stored in the weight's dtype and the values are quantized against that stored scale: in fp16 a
        # row whose largest magnitude is below about 4e-6 has a scale below fp16's smallest value, which read back
        # as 0 (and a subnormal one lost most of its bits). Rounded up to a value fp16 holds, at least its smallest
        # one, the row keeps its values (no quotient past 127 either). At the other end the scale is at most the
        # largest one whose 127 multiple the dtype holds: rounded up past it (fp16 rows above about 65470), the row's
        # largest value read back as inf.
        scale = exact_scale.to(weight.dtype)
        smallest = torch.nextafter(torch.zeros((), dtype=weight.dtype), torch.ones((), dtype=weight.dtype))
        largest = torch.tensor(torch.finfo(weight.dtype).max / 127.0, dtype=torch.float64).to(weight.dtype)
        if float(largest) * 127.0 > torch.finfo(weight.dtype).max:
            largest = torch.nextafter(largest, torch.zeros_like(largest))
        scale = torch.where(scale.float() < exact_scale, torch.nextafter(scale, torch.full_like(scale, math.inf)),
                            scale).clamp(float(smallest), float(largest))  # (numbers: the scale may be on a GPU)
        values = torch.round(weight32 / scale.float()).clamp_(-127, 127).to(torch.int8)
        return values, scale


def quantize_weights_int8(model: nn.Module) -> list[str]:
    """Store every FFN weight that is a plain parameter as int8 (see `Int8Weight`); the weights are frozen.
    Returns the quantized names."""
    found = parameter_weights(model)
    _refuse_sharded_weights("quantize_weights_int8", found)
    _refuse_offloaded_weights("quantize_weights_int8", found)
    _refuse_pruned_weights("quantize_weights_int8", found)
    quantized = [qualified for qualified, module, name in found if _parametrized_with(module, name, Int8Weight)]
    if quantized:
        raise ValueError(f"quantize_weights_int8: {quantized} are int8 already")
    adapted = [qualified for qualified, module, name in found if parametrize.is_parametrized(module, name)]
    if adapted:
        raise ValueError(f"quantize_weights_int8: {adapted} have adapters; quantize before adding adapters "
                         "(add_weight_lora), not after, or merge them first (adapters.merge_weight_lora)")
    pefts = _pefts_parameter_adapters(model, found)
    if pefts:
        raise ValueError(f"quantize_weights_int8: {pefts} have PEFT's target_parameters LoRA, which int8 weights do "
                         "not take; quantize first and adapt them with add_weight_lora (LoRA on top of int8), or "
                         "merge PEFT's adapters first (merge_and_unload)")
    for _, module, name in found:
        getattr(module, name).requires_grad_(False)  # an int8 parameter cannot require gradients
        parametrize.register_parametrization(module, name, Int8Weight())
    return [name for name, _, _ in found]
