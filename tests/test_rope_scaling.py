"""RoPE scaling goes through transformers' rotary machinery: a FlashMHFLlama with `ffn_variant="swiglu"` is a Llama
decoder, so with the same weights and the same `rope_parameters` its logits must equal LlamaForCausalLM's."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from hf_memffn.testing import tiny_config

MAX_POSITIONS = 32
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 16 for i in range(8)],
                 "long_factor": [2.0 + i / 8 for i in range(8)], "original_max_position_embeddings": 16},
}


def llama_and_ours(rope: dict | None, **ours):
    fields = dict(max_position_embeddings=MAX_POSITIONS, head_dim=16)
    theta = {"rope_theta": 10000.0}
    llama = LlamaForCausalLM(tiny_config("llama", rope_parameters={**(rope or {"rope_type": "default"}), **theta},
                                         **fields)).eval()
    config = tiny_config("flash_mhf", ffn_variant="swiglu", intermediate_size=128, **fields, **ours,
                         **({"rope_parameters": dict(rope)} if rope is not None else {}))
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)
    return llama, model


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_scaled_rope_matches_llama(rope_type):
    torch.manual_seed(0)
    llama, model = llama_and_ours(ROPE_SCALINGS[rope_type])
    _, unscaled = llama_and_ours(None)
    unscaled.load_state_dict(model.state_dict())
    # Longer than max_position_embeddings, so the dynamic and long-context types change their frequencies.
    ids = torch.randint(3, 320, (2, 2 * MAX_POSITIONS))
    with torch.no_grad():
        expected, got = llama(ids).logits, model(ids).logits
        short_expected, short_got = llama(ids[:, :12]).logits, model(ids[:, :12]).logits
        plain = unscaled(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(short_got, short_expected, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3, "the scaling changed nothing"


def test_rope_scaling_alias_survives_save_and_load(tmp_path):
    torch.manual_seed(0)
    config = tiny_config("kvffn", rope_scaling={"type": "linear", "factor": 4.0})
    assert config.rope_parameters == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters["factor"] == 4.0
    ids = torch.randint(3, 320, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_rope_theta_in_parameters_wins_and_is_mirrored():
    config = tiny_config("memoryllm", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert config.rope_theta == 500000.0


@pytest.mark.parametrize("rope", [{"rope_type": "mrope", "factor": 2.0}, {"rope_type": "linear"}])
def test_unsupported_or_incomplete_rope_is_refused(rope):
    with pytest.raises(ValueError, match="rope"):
        tiny_config("flash_mhf", rope_parameters=rope)


@pytest.mark.parametrize("layer_types", [None, ["full_attention", "full_attention"]])
def test_per_layer_rope_is_refused_rather_than_ignored(layer_types):
    """RoPE nested by layer type (`{"full_attention": {...}}`) was accepted and its scaling silently ignored: the
    rotary embedding reads the top level of `rope_parameters` only, so the model ran unscaled RoPE."""
    per_layer = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=r"`rope_parameters`=.* is invalid: per-layer RoPE \(the nested "
                                         r"'full_attention'\) is not supported"):
        tiny_config("memoryllm", rope_parameters=per_layer,
                    **({"layer_types": layer_types} if layer_types is not None else {}))


@pytest.mark.parametrize("rope_scaling", ["linear", ["linear", 2.0]])
def test_a_rope_scaling_other_than_a_dict_is_refused_naming_the_field(rope_scaling, tmp_path):
    """The older field `rope_scaling`, given to the config or read from a config.json, that is not a dict ended in
    transformers' "AttributeError: 'str' object has no attribute 'setdefault'" (from_pretrained's keyword already
    named the field)."""
    message = r"`rope_scaling`=.* is invalid: must be None or a dict"
    with pytest.raises(ValueError, match=message):
        tiny_config("memoryllm", rope_scaling=rope_scaling)
    tiny_config("memoryllm").save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "rope_scaling": rope_scaling}))
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_compiled_model_computes_the_rotary_tables_once(rope_type):
    """Under torch.compile the cos/sin tables come from one operator call per forward: the rotations only read them
    (left as PyTorch operations, inductor recomputed cos and sin inside every layer's rotary kernel). The compiled
    logits equal the eager ones, with a scaled RoPE too."""
    from torch._inductor.utils import run_and_get_code

    from hf_memffn import flash_mhf_op, modeling_memffn

    assert modeling_memffn.ROTARY_TABLES_OP.split("::")[0] == flash_mhf_op.OP_NAMESPACE
    torch.manual_seed(0)
    _, model = llama_and_ours(None if rope_type == "default" else ROPE_SCALINGS[rope_type],
                              decoder_kernels="torch")
    ids = torch.randint(3, 320, (2, 20))
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids).logits
        got, codes = run_and_get_code(torch.compile(model), ids)
    torch.testing.assert_close(got.logits, expected, rtol=1e-4, atol=1e-4)
    code = "\n".join(codes)
    assert "rotary_tables" in code
    assert not re.search(r"\b(cos|sin)\(", code), "a generated kernel computes cos or sin"


def test_a_new_rope_theta_reaches_the_rotary_tables(tmp_path):
    """`config.rope_theta = ...` and `from_pretrained(path, rope_theta=...)` change what the rotary embedding reads
    (`rope_parameters["rope_theta"]`), and config.json then says one theta; a new `rope_parameters` is standardized."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("kvffn")).save_pretrained(tmp_path)
    config = tiny_config("kvffn")
    config.rope_theta = 500000.0
    models = {"set": AutoModelForCausalLM.from_config(config),
              "loaded": AutoModelForCausalLM.from_pretrained(tmp_path, rope_theta=500000.0)}
    head_dim = config.head_dim
    expected = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    for name, model in models.items():
        assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}, name
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected, msg=name)
    scaled = AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0})
    assert scaled.config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_one_rope_dict_given_to_several_configs_keeps_each_ones_theta(field, tmp_path):
    """transformers standardizes a `rope_scaling` it is given in place, adding the config's `rope_theta` to the
    caller's dict (in `__init__` under 5.17 and 5.25, in `from_pretrained` from 5.25): one dict given to the
    checkpoints of two thetas, as a long-context evaluation does, gave the second one the first one's theta without
    a word. Each config now has its own theta, and the dict is left as it was given."""
    for theta in (10000.0, 500000.0):
        tiny_config("kvffn", rope_theta=theta).save_pretrained(tmp_path / str(theta))
    rope = {"rope_type": "linear", "factor": 2.0}
    for theta in (10000.0, 500000.0):
        assert tiny_config("kvffn", rope_theta=theta, **{field: rope}).rope_parameters["rope_theta"] == theta
        loaded = AutoConfig.from_pretrained(tmp_path / str(theta), **{field: rope})
        assert loaded.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": theta}
    assert rope == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("rope", [{"rope_type": "default", "partial_rotary_factor": 0.5},
                                  {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}])
def test_a_partial_rotary_factor_is_refused_rather_than_ignored(rope):
    """The decoder rotates every dimension of each head: with "default" a partial factor went unused, with the scaled
    types the frequency tables were narrower than the heads (a shape error in the first forward)."""
    with pytest.raises(ValueError, match=r"`rope_parameters\['partial_rotary_factor'\]`=0.5 is invalid: must be 1.0"):
        tiny_config("flash_mhf", rope_parameters=rope)
    assert tiny_config("flash_mhf", partial_rotary_factor=1.0).rope_parameters["partial_rotary_factor"] == 1.0


def test_longrope_factors_must_have_one_number_per_frequency():
    """transformers only warns about factor lists of the wrong length; the model then failed while it was built."""
    wrong_length = r"`rope_parameters\['{}'\]`=.* is invalid: must be a list of head_dim // 2 = 12 numbers"
    with pytest.raises(ValueError, match=wrong_length.format("short_factor")):
        tiny_config("flash_mhf", ffn_variant="swiglu", head_dim=24, rope_parameters=ROPE_SCALINGS["longrope"])
    long_only = {**ROPE_SCALINGS["longrope"], "short_factor": [1.0] * 12}
    with pytest.raises(ValueError, match=wrong_length.format("long_factor")):
        tiny_config("flash_mhf", ffn_variant="swiglu", head_dim=24, rope_parameters=long_only)


@pytest.mark.parametrize("rope", [None, {"rope_type": "default"}, {"rope_type": "default", "rope_theta": 500000.0},
                                  {"type": "linear", "factor": 2.0}, ROPE_SCALINGS["yarn"],
                                  {"rope_type": "yarn", "factor": 2.0}])
def test_a_rope_dict_set_on_the_config_is_standardized_as_one_given_to_it(rope):
    """`config.rope_parameters = {...}` after the config was built reads as the same dict given to the config: the
    rotary embedding read it raw, so a dict without `rope_theta` ("default"), with the older key `type`, or a yarn
    one without `original_max_position_embeddings` failed while the model was built (KeyError: 'rope_theta',
    KeyError: 'rope_type', "Missing required keys"), None failed with "'NoneType' object is not subscriptable", and
    a theta set there left `config.rope_theta` saying another one."""
    given = tiny_config("kvffn", **({"rope_parameters": dict(rope)} if rope is not None else {}))
    config = tiny_config("kvffn")
    config.rope_parameters = dict(rope) if rope is not None else None
    for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings"):
        assert config.rope_parameters.get(key) == given.rope_parameters.get(key), key
    assert config.rope_theta == given.rope_theta == given.rope_parameters["rope_theta"]
    rotary, given_rotary = (AutoModelForCausalLM.from_config(c).model.rotary_emb for c in (config, given))
    torch.testing.assert_close(rotary.inv_freq, given_rotary.inv_freq)
    assert rotary.attention_scaling == given_rotary.attention_scaling


def test_a_rope_parameters_other_than_a_dict_set_on_the_config_is_refused_naming_the_field():
    """A string set as `config.rope_parameters` failed in the model's build with "'str' object has no attribute
    'items'"; it is refused as one given to the config is."""
    config = tiny_config("memoryllm")
    config.rope_parameters = "linear"
    with pytest.raises(ValueError, match=r"`rope_parameters`='linear' is invalid: must be None or a dict"):
        AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("key", "value"), [("rope_type", "linear"), ("factor", 4.0), ("low_freq_factor", 1.0),
                                            ("beta_fast", 16.0), ("long_factor", [2.0] * 8)])
def test_a_rope_key_given_beside_the_fields_is_refused_naming_rope_parameters(key, value, tmp_path):
    """The keys of a RoPE dict given as fields of their own (`rope_type="linear", factor=4.0`, as LlamaConfig also
    takes them without a word) were kept on the config and never read: the model ran unscaled RoPE. They are refused
    naming `rope_parameters`, given to the config, to `from_pretrained`, in a config.json or set on the config by
    hand."""
    message = rf"`{key}`=.* is invalid: a key of `rope_parameters`, read there only"
    with pytest.raises(ValueError, match=message):
        tiny_config("kvffn", **{key: value})
    tiny_config("kvffn").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path, **{key: value})
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), key: value}))
    with pytest.raises(ValueError, match=message + ".*loads once the key is removed from the file"):
        AutoConfig.from_pretrained(tmp_path)
    config = tiny_config("kvffn")
    setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_config(config)


def test_a_rope_dict_with_both_type_keys_runs_rope_type_as_llama_does():
    """A RoPE dict holding both the older key `type` and `rope_type` (a config.json edited by hand, or converted
    twice) runs the type `rope_type` names, as transformers' Llama reads it; the older key took precedence."""
    from transformers import LlamaConfig

    both = {"rope_type": "linear", "type": "dynamic", "factor": 2.0}
    config = tiny_config("flash_mhf", rope_parameters=dict(both))
    assert config.rope_parameters["rope_type"] == "linear" and "type" not in config.rope_parameters
    assert LlamaConfig(rope_parameters=dict(both)).rope_parameters["rope_type"] == "linear"
