"""What vLLM's Transformers modeling backend (`model_impl="transformers"`) asks of a custom model, checked one by one
for the four architectures (vLLM's documentation, "Writing custom models"; vLLM itself is not run here):

1. the checkpoint is a Transformers custom model: `config.json` with `auto_map.AutoModel`;
2. customisation lives in the base model: `*ForCausalLM` is only the base model plus `lm_head`;
3. `kwargs` reach the attention layers from the base model's forward;
4. attention goes through `ALL_ATTENTION_FUNCTIONS` (an attention function registered under a new name is used);
5. the base model sets `_supports_attention_backend = True`;
and what the backend then does with it: one flattened row of several sequences, `use_cache=False`, the attention
backend owning the KV cache (no cache object is built by the model), positions restarting per sequence.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F
from transformers import AttentionInterface, AutoModelForCausalLM

import hf_memffn
from hf_memffn.modeling_memffn import CACHE_KWARG
from hf_memffn.testing import tiny_config

ARCHS = list(hf_memffn.ARCHITECTURES)
PROBE = "memffn_varlen_probe"
CALLS: list[dict] = []


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each sequence of a flattened batch (`[1, heads, tokens, d]`), as a serving engine's
    varlen kernel computes it from its own sequence boundaries (`cu_seqlens`, passed as a keyword argument)."""
    CALLS.append({"layer": module.layer_idx, "kwargs": sorted(kwargs), "mask": attention_mask})
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = kwargs["cu_seqlens"].tolist()
    pieces = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                             scale=scaling) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(PROBE, varlen_attention)


def build(arch, **kwargs):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch), **kwargs).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_is_a_transformers_custom_model_with_auto_map_automodel(arch, tmp_path):
    build(arch).save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    base_class = hf_memffn.REGISTRY[arch].model_class
    module = base_class.__module__.rsplit(".", 1)[-1]  # the architecture's own modeling file
    assert auto_map["AutoModel"] == f"{module}.{base_class.__name__}"
    assert (tmp_path / f"{module}.py").is_file() and (tmp_path / "modeling_memffn.py").is_file()


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_lm_is_the_base_model_plus_lm_head(arch):
    model = build(arch)
    assert [name for name, _ in model.named_children()] == ["model", "lm_head"]
    assert type(model.model).__name__ == type(model).__name__.replace("ForCausalLM", "Model")
    ids = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model.lm_head(model.model(ids).last_hidden_state))


@pytest.mark.parametrize("arch", ARCHS)
def test_base_model_supports_the_attention_backend(arch):
    model = build(arch)
    assert type(model.model)._supports_attention_backend is True
    assert type(model)._supports_attention_backend is True


@pytest.mark.parametrize("arch", ARCHS)
def test_flattened_sequences_through_a_registered_attention_with_kwargs(arch):
    """Requirements 3 and 4, in the layout a serving engine feeds: three sequences in one row."""
    reference = build(arch)
    model = build(arch, attn_implementation=PROBE)
    assert model.config._attn_implementation == PROBE
    lengths = [5, 11, 3]
    sequences = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    input_ids = torch.cat(sequences)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    CALLS.clear()
    with torch.no_grad():
        output = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, cu_seqlens=cu_seqlens)
        alone = [reference(input_ids=s[None]).logits[0] for s in sequences]
    assert getattr(output, CACHE_KWARG) is None  # the model built no cache: the attention backend owns the KV cache
    assert [call["layer"] for call in CALLS] == list(range(model.config.num_hidden_layers))
    assert all("cu_seqlens" in call["kwargs"] and "position_ids" in call["kwargs"] for call in CALLS)
    assert all(call["mask"] is None for call in CALLS)  # no mask built for an attention the masks do not know
    flat = torch.cat(alone)
    assert torch.allclose(output.logits[0], flat, atol=1e-5, rtol=1e-4), (output.logits[0] - flat).abs().max()
