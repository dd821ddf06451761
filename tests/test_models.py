"""The four architectures as transformers models: registration, configs, maths of each FFN wiring, caching and
generation, attention backends, gradient checkpointing, saving and loading."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import hf_memffn
from hf_memffn.modeling_memffn import CACHE_KWARG
from hf_memffn.testing import (enable_activation_checkpointing, left_padded, logged_records, recording_backend,
                               tiny_config, tiny_tokenizer)

ARCHS = list(hf_memffn.ARCHITECTURES)
ALL_VARIANTS = [
    ("flash_mhf", {}),
    ("flash_mhf", {"ffn_variant": "swiglu"}),
    ("flash_mhf", {"ffn_variant": "mh_ffn", "ffn_num_subnetworks": 1}),
    ("flash_mhf", {"ffn_variant": "dense_moe", "ffn_num_heads": 1, "ffn_num_kv_heads": 1}),
    ("flash_mhf", {"ffn_variant": "pkv"}),
    ("memoryllm", {}),
    ("flex_memoryllm", {}),
    ("kvffn", {}),
    ("kvffn", {"ffn_variant": "relu"}),
    ("kvffn", {"ffn_variant": "glu"}),
    ("kvffn", {"ffn_variant": "densenet"}),
    ("kvffn", {"kvffn_composition": "sum", "kvffn_activation": "gelu", "kvffn_inner_residual": True}),
]


def build(arch, seed=0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    return model.eval()


def variant_id(item):
    arch, overrides = item
    return arch + "".join(f"-{v}" for v in overrides.values() if isinstance(v, str))


# ---------------------------------------------------------------------------------------------------------------------
# registration and configs
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_classes_build_each_architecture(arch):
    config_class = hf_memffn.ARCHITECTURES[arch]
    fields = {k: v for k, v in tiny_config(arch).to_diff_dict().items() if k != "model_type"}
    config = AutoConfig.for_model(config_class.model_type, **fields)
    assert type(config) is config_class
    prefix = config_class.class_prefix
    modeling = {"flash_mhf": "modeling_flash_mhf", "memoryllm": "modeling_memoryllm",
                "flex_memoryllm": "modeling_memoryllm", "kvffn": "modeling_kvffn"}[arch]
    model = AutoModelForCausalLM.from_config(config)
    assert type(AutoModel.from_config(config)).__name__ == f"{prefix}Model"
    assert type(model).__name__ == f"{prefix}ForCausalLM"
    assert type(model).__module__ == f"hf_memffn.{modeling}"
    heads = {f"AutoModel{task}": f"{prefix}{task}"
             for task in ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")}
    for auto_class, name in heads.items():
        head = getattr(transformers, auto_class).from_config(config)
        assert (type(head).__name__, type(head).__module__) == (name, f"hf_memffn.{modeling}")
    assert config.auto_map == {"AutoConfig": f"configuration_memffn.{prefix}Config",
                               "AutoModel": f"{modeling}.{prefix}Model",
                               "AutoModelForCausalLM": f"{modeling}.{prefix}ForCausalLM",
                               **{auto_class: f"{modeling}.{name}" for auto_class, name in heads.items()}}


@pytest.mark.parametrize(
    "config_class, fields, field",
    [
        (hf_memffn.FlashMHFLlamaConfig, dict(hidden_size=64, ffn_num_heads=5), "ffn_num_heads"),
        (hf_memffn.FlashMHFLlamaConfig, dict(hidden_size=64, ffn_num_heads=4, intermediate_size=100,
                                             ffn_num_subnetworks=3), "ffn_num_subnetworks"),
        (hf_memffn.FlashMHFLlamaConfig, dict(hidden_size=64, ffn_num_heads=4, ffn_num_kv_heads=3), "ffn_num_kv_heads"),
        (hf_memffn.FlashMHFLlamaConfig, dict(ffn_variant="moe"), "ffn_variant"),
        (hf_memffn.FlashMHFLlamaConfig, dict(ffn_kernel="cuda"), "ffn_kernel"),
        (hf_memffn.FlashMHFLlamaConfig, dict(ffn_variant="mh_ffn", ffn_num_subnetworks=4), "ffn_num_subnetworks"),
        (hf_memffn.FlashMHFLlamaConfig, dict(ffn_variant="dense_moe", ffn_num_heads=2), "ffn_num_heads"),
        (hf_memffn.MemoryLLMConfig, dict(num_attention_heads=16, num_key_value_heads=3), "num_key_value_heads"),
        (hf_memffn.FlexMemoryLLMConfig, dict(memory_intermediate_size=-4), "memory_intermediate_size"),
        (hf_memffn.KVFFNConfig, dict(ffn_variant="gated"), "ffn_variant"),
        (hf_memffn.KVFFNConfig, dict(kvffn_activation="tanh"), "kvffn_activation"),
        (hf_memffn.KVFFNConfig, dict(kvffn_composition="max"), "kvffn_composition"),
        (hf_memffn.KVFFNConfig, dict(kvffn_init="xavier"), "kvffn_init"),
        (hf_memffn.KVFFNConfig, dict(kvffn_dropout=1.5), "kvffn_dropout"),
    ],
)
def test_invalid_config_names_the_field(config_class, fields, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        config_class(**fields)


@pytest.mark.parametrize("base_class, built_instead", [
    ("MemFFNConfig", "FlashMHFLlamaConfig, MemoryLLMConfig, FlexMemoryLLMConfig, KVFFNConfig"),
    ("MemFFNModel", "FlashMHFLlamaModel, MemoryLLMModel, FlexMemoryLLMModel, KVFFNModel"),
    ("MemFFNForCausalLM", "FlashMHFLlamaForCausalLM, MemoryLLMForCausalLM, FlexMemoryLLMForCausalLM, KVFFNForCausalLM"),
    ("MemFFNForSequenceClassification", "KVFFNForSequenceClassification"),
    ("MemFFNForTokenClassification", "KVFFNForTokenClassification"),
    ("MemFFNForQuestionAnswering", "KVFFNForQuestionAnswering"),
    ("MemFFNPreTrainedModel", "KVFFNForCausalLM"),
])
def test_the_base_classes_refuse_to_build_naming_the_architectures_to_build_instead(base_class, built_instead):
    """The base classes the four architectures share are public (`hf_memffn.MemFFNForCausalLM`), and built a model
    whose checkpoint did not load: its config.json named no code and `memffn` is no registered model type, while its
    model card said `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` loads it."""
    config = tiny_config("flash_mhf", ffn_variant="swiglu")
    with pytest.raises(ValueError, match=f"{base_class} is the base class") as error:
        if base_class == "MemFFNConfig":
            hf_memffn.MemFFNConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
        else:  # (given an architecture's config too)
            getattr(hf_memffn, base_class)(config)
    assert built_instead in str(error.value)
    kind = base_class.removeprefix("MemFFN").replace("PreTrainedModel", "ForCausalLM")
    if kind != "Config":  # (the architecture's class of the same kind builds from that config)
        getattr(hf_memffn, "FlashMHFLlama" + kind)(config)


def test_variant_defaults_follow_the_paper():
    assert hf_memffn.FlashMHFLlamaConfig().ffn_num_heads == 16
    assert hf_memffn.FlashMHFLlamaConfig().ffn_num_subnetworks == 8
    assert hf_memffn.FlashMHFLlamaConfig(ffn_variant="mh_ffn").ffn_num_subnetworks == 1
    assert hf_memffn.FlashMHFLlamaConfig(ffn_variant="dense_moe").ffn_num_heads == 1
    config = hf_memffn.FlashMHFLlamaConfig(hidden_size=2048, intermediate_size=5760, ffn_num_subnetworks=15)
    assert (config.ffn_head_dim, config.subnetwork_size) == (128, 384)
    flex = hf_memffn.FlexMemoryLLMConfig(intermediate_size=96)
    assert flex.memory_intermediate_size == 96


def test_pkv_reads_no_key_value_head_count():
    """PKV gives every head its own slots, so `ffn_num_kv_heads` is not read and not checked against the heads (a
    count left from a FlashMHF config does not stop the PKV baseline). FlashMHF, which shares its weights by groups of
    heads, still refuses a count that does not divide the heads."""
    config = tiny_config("flash_mhf", ffn_variant="pkv", ffn_num_heads=4, ffn_num_kv_heads=3)
    model = AutoModelForCausalLM.from_config(config)
    assert model.model.layers[0].mlp.key.shape[0] == 4
    with pytest.raises(ValueError, match="`ffn_num_kv_heads`=3"):
        tiny_config("flash_mhf", ffn_num_heads=4, ffn_num_kv_heads=3)


def test_triton_ffn_kernel_refuses_shapes_the_kernels_never_take_when_the_config_is_made(tmp_path):
    """`ffn_kernel='triton'` with FFN heads or sub-networks that no Triton kernel takes (tiny_config's heads of 16) was
    accepted and failed at the model's first forward, on any device; it is refused with the config, naming the fields
    and `ffn_kernel='torch'`, also when given to `from_pretrained`. Shapes the kernels take, and the baselines that do
    not run the fused op, are accepted."""
    from hf_memffn.configuration_memffn import TRITON_FFN_HEAD_DIMS
    from hf_memffn.flash_mhf_op import SUPPORTED_HEAD_DIMS

    assert TRITON_FFN_HEAD_DIMS == SUPPORTED_HEAD_DIMS
    with pytest.raises(ValueError, match=r"`ffn_kernel`='triton'.*ffn_head_dim = hidden_size // ffn_num_heads = "
                                         r"64 // 4 = 16.*ffn_kernel='torch'"):
        tiny_config("flash_mhf", ffn_kernel="triton")
    for variant, fields in (("mh_ffn", {"ffn_num_subnetworks": 1}),
                            ("dense_moe", {"hidden_size": 96, "ffn_num_heads": 1, "ffn_num_kv_heads": 1})):
        with pytest.raises(ValueError, match="`ffn_kernel`='triton'.*ffn_head_dim"):
            tiny_config("flash_mhf", ffn_variant=variant, ffn_kernel="triton", **fields)
    wide_heads = dict(hidden_size=128, ffn_num_heads=2, ffn_num_kv_heads=2)
    with pytest.raises(ValueError, match=r"`ffn_kernel`='triton'.*subnetwork_size = intermediate_size // "
                                         r"ffn_num_subnetworks = 40 // 2 = 20"):
        tiny_config("flash_mhf", intermediate_size=40, ffn_kernel="triton", **wide_heads)
    assert tiny_config("flash_mhf", intermediate_size=64, ffn_kernel="triton", **wide_heads).ffn_head_dim == 64
    for variant in ("pkv", "swiglu"):  # (no fused op: `ffn_kernel` is not read)
        assert tiny_config("flash_mhf", ffn_variant=variant, ffn_kernel="triton").ffn_kernel == "triton"
    tiny_config("flash_mhf").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="`ffn_kernel`='triton'.*ffn_head_dim"):
        AutoConfig.from_pretrained(tmp_path, ffn_kernel="triton")


def test_a_config_file_with_a_refused_triton_ffn_kernel_loads_with_the_torch_kernel_given(tmp_path):
    """A config.json written before `ffn_kernel='triton'` was refused for the FFN shapes the kernels never take:
    `from_pretrained(path, ffn_kernel='torch')`, what the refusal names, loads it (transformers builds the config from
    the file's fields and sets keyword arguments afterwards, so the file's "triton" was refused first)."""
    import json

    tiny_config("flash_mhf").save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "ffn_kernel": "triton"}))
    with pytest.raises(ValueError, match="`ffn_kernel`='triton'.*ffn_kernel='torch'"):
        AutoConfig.from_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, ffn_kernel="torch")
    assert config.ffn_kernel == "torch" and config.ffn_head_dim == 16
    with pytest.raises(ValueError, match="`ffn_kernel`='cuda' is not supported; allowed values"):
        AutoConfig.from_pretrained(tmp_path, ffn_kernel="cuda")



@pytest.mark.parametrize("arch, fields, field, requirement", [
    ("kvffn", dict(ffn_variant="glu", kvffn_activation="gelu"), "kvffn_activation",
     r"must be 'silu' here: ffn_variant='glu' does not read it"),
    ("kvffn", dict(ffn_variant="relu", kvffn_composition="sum"), "kvffn_composition",
     r"must be 'product' here: ffn_variant='relu' does not read it"),
    ("kvffn", dict(ffn_variant="densenet", kvffn_inner_residual=True), "kvffn_inner_residual",
     r"must be False here: ffn_variant='densenet' does not read it"),
    ("kvffn", dict(hidden_act="gelu"), "hidden_act", r"must be 'silu' here: .*kvffn_activation"),
    ("flash_mhf", dict(hidden_act="gelu"), "hidden_act", r"must be 'silu' here: ffn_variant='flash_mhf' does not"),
    ("flash_mhf", dict(ffn_variant="pkv", hidden_act="relu"), "hidden_act", r"must be 'silu' here"),
])
def test_a_field_the_chosen_ffn_does_not_read_is_refused_unless_at_its_default(arch, fields, field, requirement,
                                                                                 tmp_path):
    """The ablation fields of KV-FFN (activation, composition, inner residual) apply to its own block, and
    `hidden_act` to the SwiGLU FFNs only: a GLU baseline given GELU keys, a ReLU FFN given the sum, or FlashMHF
    sub-networks given GELU built the paper's block as if the field were not there, and the run measured another
    model than the one asked for. Refused with the config, naming the field and the value it must keep; a
    config.json that holds such a value loads with the default given to `from_pretrained`, as the error says."""
    import json

    with pytest.raises(ValueError, match=rf"`{field}`=.* is invalid: {requirement}.*from_pretrained\(path, {field}="):
        tiny_config(arch, **fields)
    default = getattr(tiny_config(arch), field)
    tiny_config(arch, **{**fields, field: default}).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    (tmp_path / "config.json").write_text(json.dumps({**saved, field: fields[field]}), encoding="utf-8")
    with pytest.raises(ValueError, match=f"`{field}`"):
        AutoConfig.from_pretrained(tmp_path)
    assert getattr(AutoConfig.from_pretrained(tmp_path, **{field: default}), field) == default
    # the block that reads the field still takes it (KVFFN has no block that reads `hidden_act`)
    if field != "hidden_act":
        assert getattr(tiny_config(arch, **{field: fields[field]}), field) == fields[field]
    elif arch == "flash_mhf":
        assert tiny_config(arch, ffn_variant="swiglu", hidden_act=fields[field]).hidden_act == fields[field]


@pytest.mark.parametrize("trust_remote_code", [False, True])
@pytest.mark.parametrize("variant", ["relu", "glu", "densenet", "kvffn"])
def test_a_kvffn_checkpoint_saved_while_the_inner_residual_defaulted_to_true_loads_as_it_ran(variant, tmp_path,
                                                                                           trust_remote_code):
    """Until `kvffn_dropout` was added, `kvffn_inner_residual` defaulted to True and every KVFFN config.json held
    it, the baselines' too, which never read it: such a baseline checkpoint, saved with the defaults, was refused
    for a field its FFN does not read. It loads with the baselines' default and gives the outputs it gave; the
    "kvffn" block, which reads the field, keeps the file's True."""
    import json

    model = build("kvffn", ffn_variant=variant, kvffn_inner_residual=variant == "kvffn").eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    del saved["kvffn_dropout"]  # (the layout of a file written by those versions)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "kvffn_inner_residual": True}), encoding="utf-8")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=trust_remote_code).eval()
    assert loaded.config.kvffn_inner_residual is (variant == "kvffn")
    ids = torch.arange(3, 11).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_derived_fields_are_accepted_where_they_equal_what_the_config_derives(tmp_path):
    """A paper's sizes given with the derived ones (`ffn_head_dim`, `subnetwork_size`), to the config or to
    `from_pretrained`, build the config when they agree (transformers failed to set them, after logging the whole
    config); tests/test_bad_input.py has the refusals where they do not."""
    config = tiny_config("flash_mhf", ffn_head_dim=16, subnetwork_size=48)
    assert (config.ffn_head_dim, config.subnetwork_size) == (16, 48)
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, ffn_head_dim=16).ffn_head_dim == 16
    assert "ffn_head_dim" not in config.to_dict()


# Keys a config takes beside this package's fields: transformers' own, those configs saved by transformers 4 or by
# Llama carry, a generation parameter transformers drops, and a note that resembles no field
KEPT_KEYS = dict(torch_dtype="float32", architectures=["MemoryLLMForCausalLM"], transformers_version="5.17.0",
                 _name_or_path="some/checkpoint", _commit_hash="0" * 40, chunk_size_feed_forward=0, return_dict=True,
                 output_attentions=False, is_encoder_decoder=False, pretraining_tp=1, mlp_bias=False,
                 sep_token_id=None, torchscript=False, use_bfloat16=False, tie_encoder_decoder=False, is_decoder=False,
                 tokenizer_class="PreTrainedTokenizerFast", max_length=20, num_beams=1, experiment_note="lr sweep 3",
                 quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True})


@pytest.mark.parametrize("arch", ARCHS)
def test_keys_transformers_and_other_libraries_keep_on_a_config_load_back(arch, tmp_path):
    """The refusal of misspelled fields and fields of another architecture (tests/test_bad_input.py) leaves alone the
    keys transformers keeps on a config, attributes set after the config is built (as PEFT, the Trainer and
    `config.update()` do) and unknown keys that resemble no field of this package: each is taken and loads back."""
    config = tiny_config(arch, **KEPT_KEYS)
    config.use_cache = False  # (as PEFT and gradient checkpointing set it)
    config.update({"experiment_note": "lr sweep 4", "problem_type": "regression"})
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path, experiment_note="lr sweep 5", output_attentions=True)
    assert (loaded.experiment_note, loaded.use_cache, loaded.problem_type) == ("lr sweep 5", False, "regression")
    assert loaded.quantization_config == KEPT_KEYS["quantization_config"] and loaded.pretraining_tp == 1
    assert loaded.to_dict() == {**config.to_dict(), "experiment_note": "lr sweep 5", "output_attentions": True,
                                "_name_or_path": str(tmp_path)}


@pytest.mark.parametrize(
    ("arch", "key", "meant"),
    [("flash_mhf", "ffn_num_head", "`ffn_num_heads`"), ("flash_mhf", "kvffn_bias", "KVFFNConfig"),
     ("memoryllm", "memory_intermediate_size", "FlexMemoryLLMConfig"), ("flex_memoryllm", "ffn_kernel", "FlashMHF"),
     ("kvffn", "kvffn_inner_residuals", "`kvffn_inner_residual`"),
     ("kvffn", "num_hidden_layer", "`num_hidden_layers`")],
)
def test_a_misspelled_field_set_by_hand_is_refused_before_a_model_is_built_or_saved(arch, key, meant, tmp_path):
    """A key set on a built config (`config.ffn_num_head = 8`) went unread by the model and was saved to config.json;
    the model's build and the config's save refuse it as `__init__` does, naming the field meant."""
    config = tiny_config(arch)
    setattr(config, key, 3)
    with pytest.raises(ValueError, match=f"`{key}`.*{meant}"):
        AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=f"would not load back.*`{key}`.*{meant}"):
        config.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("arch", ARCHS)
def test_the_decoder_wiring_is_the_architectures_not_a_field(arch, tmp_path):
    """`residual_ffn` and `parallel_residual_ffn` are set by each architecture's class: given as fields (to the
    config, to `from_pretrained`, or set by hand before a model is built) they rewired the decoder, e.g. a MemoryLLM
    with a SwiGLU FFN on the residual stream or a KVFFN whose FFN read the layer input; now refused naming the field,
    unless equal to the architecture's, which is accepted and not saved. tests/test_bad_input.py has the messages."""
    config_class = hf_memffn.ARCHITECTURES[arch]
    wiring = {"residual_ffn": tiny_config(arch).residual_ffn,
              "parallel_residual_ffn": config_class.parallel_residual_ffn}
    config = tiny_config(arch, **wiring)
    assert not set(wiring) & set(config.to_dict())
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, **wiring).parallel_residual_ffn == wiring["parallel_residual_ffn"]
    flipped = not wiring["parallel_residual_ffn"]
    with pytest.raises(ValueError, match="`parallel_residual_ffn`"):
        tiny_config(arch, parallel_residual_ffn=flipped)
    with pytest.raises(ValueError, match="`parallel_residual_ffn`"):
        AutoConfig.from_pretrained(tmp_path, parallel_residual_ffn=flipped)
    with pytest.raises(ValueError, match="`residual_ffn`"):
        tiny_config(arch, residual_ffn="kvffn" if arch != "kvffn" else "swiglu")
    config.parallel_residual_ffn = flipped
    with pytest.raises(ValueError, match="`parallel_residual_ffn`"):
        AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", ["flash_mhf", "kvffn"])
def test_the_path_logs_follow_transformers_verbosity(arch):
    """Which path runs is logged under transformers' logger, so `transformers.logging.set_verbosity_info()` shows it
    and the default verbosity (warnings) hides it, as for transformers' own messages (the package's loggers sat
    outside transformers' hierarchy, and no transformers setting reached them)."""
    ids = torch.randint(3, 320, (1, 5))
    verbosity = transformers.logging.get_verbosity()
    try:
        with logged_records() as records:
            for level in (transformers.logging.WARNING, transformers.logging.INFO):
                transformers.logging.set_verbosity(level)
                with torch.no_grad():
                    AutoModelForCausalLM.from_config(tiny_config(arch))(ids)
                if level == transformers.logging.WARNING:
                    assert not [record for record in records if "runs" in record.getMessage()]
    finally:
        transformers.logging.set_verbosity(verbosity)
    ffn = {"flash_mhf": "FlashMHF FFN runs the ", "kvffn": "KV-FFN runs "}[arch]
    messages = {record.name: record.getMessage() for record in records}
    assert messages["transformers.memffn.modeling_memffn"].startswith("decoder runs the ")
    assert messages[f"transformers.memffn.{'ffn_multihead' if arch == 'flash_mhf' else 'ffn'}"].startswith(ffn)


def test_a_sequence_past_max_position_embeddings_logs_one_warning():
    """A decoding loop that runs past `max_position_embeddings` logs one warning naming the length, not one per step,
    with a dynamic cache (a new length at every step) as with a static one (which counts its tokens in a tensor)."""
    from transformers import DynamicCache, StaticCache

    with logged_records("transformers.memffn.modeling_memffn") as records:
        for static in (False, True):
            model = build("kvffn", max_position_embeddings=8)
            cache = StaticCache(config=model.config, max_cache_len=16) if static else DynamicCache(config=model.config)
            with torch.no_grad():
                for _ in range(12):
                    model(torch.tensor([[5]]), use_cache=True, **{CACHE_KWARG: cache})
    warnings = [record.getMessage() for record in records if "max_position_embeddings" in record.getMessage()]
    assert [message.split(":")[0] for message in warnings] == [
        "sequence length 9 exceeds max_position_embeddings=8"] * 2

# ---------------------------------------------------------------------------------------------------------------------
# initialization and parameter counts
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kvffn_init, expected_std", [("inv_sqrt_d", 64**-0.5), ("inv_d", 1 / 64),
                                                      ("inv_sqrt_h", 512**-0.5)])
def test_kvffn_initialization_scale(kvffn_init, expected_std):
    model = build("kvffn", hidden_size=64, intermediate_size=512, kvffn_init=kvffn_init)
    mlp = model.model.layers[0].mlp
    for linear in (mlp.key_value_proj, mlp.out_proj):
        assert linear.weight.std().item() == pytest.approx(expected_std, rel=0.1)
        assert torch.count_nonzero(linear.bias) == 0
    assert model.model.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_flash_mhf_initialization():
    model = build("flash_mhf", intermediate_size=512)
    mlp = model.model.layers[0].mlp
    for param in (mlp.key, mlp.up, mlp.value, mlp.router):
        assert param.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(mlp.query_norm.weight, torch.ones_like(mlp.query_norm.weight))


@pytest.mark.parametrize("overrides", [{}, {"ffn_variant": "mh_ffn", "ffn_num_subnetworks": 1}, {"ffn_variant": "pkv"}])
def test_printing_a_multi_head_ffn_names_the_sizes_of_its_own_weights(overrides):
    """`print(model)` lists a module's submodules only: the sub-network weights, the router and PKV's slots are plain
    parameters of the FFN (most of its weights), so its line gives their sizes, as `TokenMemory`'s does."""
    mlp = build("flash_mhf", **overrides).model.layers[0].mlp
    if overrides.get("ffn_variant") == "pkv":
        heads, slots, head_dim = mlp.key.shape
        described = f"heads={heads}, head_dim={head_dim}, slots={slots}"
    else:
        kv_heads, subnetworks, size, head_dim = mlp.key.shape
        described = (f"heads={mlp.num_heads}, kv_heads={kv_heads}, head_dim={head_dim}, subnetworks={subnetworks}, "
                     f"subnetwork_size={size}, router={mlp.router is not None}")
    assert repr(mlp).startswith(f"{type(mlp).__name__}(\n  {described}\n")


def test_parameter_counts_active_excludes_memory_on_x0():
    for arch in ("memoryllm", "flex_memoryllm"):
        model = build(arch)
        counts = model.parameter_counts()
        memory = sum(p.numel() for p in model.model.memory.parameters())
        assert counts["total"] == sum(p.numel() for p in model.parameters())
        assert counts["active"] == counts["total"] - memory
    counts = build("flash_mhf").parameter_counts()
    assert counts["active"] == counts["total"]


# ---------------------------------------------------------------------------------------------------------------------
# the maths of each FFN and wiring, against direct formulas
# ---------------------------------------------------------------------------------------------------------------------
def rms(x, weight, eps=1e-5):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_flash_mhf_module_matches_the_equations():
    config = tiny_config("flash_mhf", ffn_num_heads=4, ffn_num_kv_heads=2, ffn_num_subnetworks=3, intermediate_size=48)
    model = AutoModelForCausalLM.from_config(config).double()
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    q = rms((x @ mlp.in_proj.weight.T).view(2, 5, 4, 16), mlp.query_norm.weight)  # [B, L, H, d_h]
    scores = torch.sigmoid(torch.einsum("blhd,hde->blhe", q, mlp.router))
    gates = scores / (scores.sum(-1, keepdim=True) + config.ffn_gate_eps)
    heads = []
    for h in range(4):
        g = h // 2  # two heads share one key/up/value group
        out = 0
        for e in range(3):
            act = F.silu(q[:, :, h] @ mlp.key[g, e].T) * (q[:, :, h] @ mlp.up[g, e].T)
            out = out + gates[:, :, h, e, None] * (act @ mlp.value[g, e])
        heads.append(out)
    expected = torch.cat(heads, dim=-1) @ mlp.out_proj.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_gates_stay_finite_where_every_router_score_underflows_and_a_gate_eps_of_zero_is_refused():
    """The gates divide by sum_E sigmoid(score) + ffn_gate_eps, and float32 sigmoids of scores below about -88 are 0:
    with ffn_gate_eps=0 such a token's gates were 0 / 0 = NaN (and its output), so the config refuses 0, naming the
    field; with the default eps the token's gates are 0 and its output finite."""
    with pytest.raises(ValueError, match=r"`ffn_gate_eps`=0.0 is invalid: must be a finite number > 0"):
        tiny_config("flash_mhf", ffn_gate_eps=0.0)
    mlp = build("flash_mhf").model.layers[0].mlp
    with torch.no_grad():
        mlp.router.fill_(-30.0)  # scores -30 * sum(q): far below -88 for most tokens
    x = torch.randn(1, 6, 64)
    queries = mlp.queries(x)
    assert (mlp.gates(queries) == 0).all(-1).any(), "no token's scores underflow: the case is not exercised"
    assert mlp(x).isfinite().all()


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_a_saved_config_with_a_gate_eps_of_zero_loads_with_the_eps_given(tmp_path, trust_remote_code):
    """A checkpoint whose config.json holds `ffn_gate_eps` 0 (a value configs took before 0 was refused) could not be
    loaded at all: `from_pretrained(path, ffn_gate_eps=...)` set the field only after `__init__` had refused the file's
    0. The error names the way to load it, and that way loads the weights with the eps given."""
    import json

    model = build("flash_mhf")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "ffn_gate_eps": 0.0}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"`ffn_gate_eps`=0.0 is invalid: must be a finite number > 0 \(a saved "
                                         r"config.json of 0 loads with `from_pretrained\(path, ffn_gate_eps=1e-6\)`\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=trust_remote_code)
    assert AutoConfig.from_pretrained(tmp_path, ffn_gate_eps=1e-6, trust_remote_code=trust_remote_code
                                      ).ffn_gate_eps == 1e-6
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, ffn_gate_eps=1e-6, trust_remote_code=trust_remote_code)
    assert loaded.config.ffn_gate_eps == 1e-6 and loaded.model.layers[0].mlp.gate_eps == 1e-6
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())


def test_pkv_is_softmax_attention_over_parameters():
    model = build("flash_mhf", ffn_variant="pkv", ffn_query_norm=False, ffn_io_projections=False).double()
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 3, 64, dtype=torch.float64)
    q = x.view(1, 3, 4, 16)
    weights = torch.softmax(torch.einsum("blhd,hnd->blhn", q, mlp.key) / 4.0, dim=-1)
    expected = torch.einsum("blhn,hnd->blhd", weights, mlp.value).reshape(1, 3, 64)
    torch.testing.assert_close(mlp(x), expected)


def kvffn_key_and_value(mlp):
    """(W_k, b_k, W_v, b_v) of a KV-FFN block: the even and odd rows of `key_value_proj`, or `key_proj` and no
    values."""
    if mlp.key_value_proj is None:
        return mlp.key_proj.weight, mlp.key_proj.bias, None, None
    weight, bias = mlp.key_value_proj.weight, mlp.key_value_proj.bias
    return weight[0::2], bias[0::2], weight[1::2], bias[1::2]


@pytest.mark.parametrize("variant", ["kvffn", "kvffn+x", "kvffn+sum", "relu", "glu", "densenet"])
def test_kvffn_block_matches_its_formula(variant):
    """Each variant against its formula; "kvffn+sum" is the ablation `kvffn_composition="sum"` with
    `kvffn_activation="gelu"`, act(keys) + values (on CPU nothing else computes it from the weights)."""
    inner_residual = variant == "kvffn+x"
    ablation = dict(kvffn_composition="sum", kvffn_activation="gelu") if variant == "kvffn+sum" else {}
    model = build("kvffn", ffn_variant=variant.split("+")[0], kvffn_inner_residual=inner_residual,
                  **ablation).double()
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 3, 64, dtype=torch.float64)
    key_weight, key_bias, value_weight, value_bias = kvffn_key_and_value(mlp)
    key = x @ key_weight.T + key_bias
    if variant == "kvffn+sum":
        hidden = F.gelu(key) + (x @ value_weight.T + value_bias)
        expected = hidden @ mlp.out_proj.weight.T + mlp.out_proj.bias
    elif variant.startswith("kvffn"):
        hidden = F.silu(key) * (x @ value_weight.T + value_bias)
        expected = hidden @ mlp.out_proj.weight.T + mlp.out_proj.bias + (x if inner_residual else 0)
    elif variant == "relu":
        expected = F.relu(key) @ mlp.out_proj.weight.T + mlp.out_proj.bias
    elif variant == "glu":
        hidden = torch.sigmoid(key) * (x @ value_weight.T + value_bias)
        expected = hidden @ mlp.out_proj.weight.T + mlp.out_proj.bias
    else:
        expected = torch.cat([F.relu(key), x], dim=-1) @ mlp.out_proj.weight.T + mlp.out_proj.bias
    torch.testing.assert_close(mlp(x), expected)


def test_kvffn_layer_adds_eq_3_once_to_the_residual_stream_by_default():
    """kv-ffn.md eq. 3's `+ x` is the residual connection: by default the layer is h + W_o(k * v) + b_o with the
    block reading RMSNorm(h); the inner residual (an ablation) adds RMSNorm(h) a second time."""
    assert hf_memffn.KVFFNConfig().kvffn_inner_residual is False
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    outputs = {}
    for inner_residual in (False, True):
        model = build("kvffn", kvffn_inner_residual=inner_residual).double()
        layer = model.model.layers[0]
        position_ids = torch.arange(5).unsqueeze(0)
        position_embeddings = model.model.rotary_emb(x, position_ids)
        attn_output, _ = layer.self_attn(layer.input_layernorm(x), position_embeddings=position_embeddings,
                                         attention_mask=None)
        h = x + attn_output
        outputs[inner_residual] = (layer(x, position_embeddings=position_embeddings), h, layer)
    output, h, layer = outputs[False]
    normalized = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    key_weight, key_bias, value_weight, value_bias = kvffn_key_and_value(mlp)
    keys, values = normalized @ key_weight.T + key_bias, normalized @ value_weight.T + value_bias
    block = (F.silu(keys) * values) @ mlp.out_proj.weight.T + mlp.out_proj.bias
    torch.testing.assert_close(output, h + block)
    torch.testing.assert_close(outputs[True][0], h + block + normalized)


def test_kvffn_inner_residual_grows_the_residual_stream_as_the_readme_says():
    """The figure of README and of `KVFFNConfig`'s docstring for the ablation: at initialisation the residual stream
    of a 12-layer, 768-wide KVFFN (two sequences of 64 random tokens, seeds 0 and 1) enters its last layer at an RMS
    of about 12.8 with the inner residual and 4.0 without (a second copy of RMSNorm(h) per layer)."""
    from pathlib import Path

    final_rms = {}
    for inner_residual in (False, True):
        torch.manual_seed(0)
        config = tiny_config("kvffn", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                             num_key_value_heads=12, intermediate_size=3072, vocab_size=1000,
                             kvffn_inner_residual=inner_residual)
        model = AutoModelForCausalLM.from_config(config).eval()
        ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
        entering = []
        handle = model.model.layers[-1].register_forward_pre_hook(lambda module, args: entering.append(args[0]))
        with torch.no_grad():
            hidden_states = model(ids, output_hidden_states=True).hidden_states
        handle.remove()
        torch.testing.assert_close(hidden_states[-2], entering[0])  # (the last: after the final norm)
        final_rms[inner_residual] = float(entering[0].pow(2).mean().sqrt())
    assert final_rms[False] == pytest.approx(4.0, abs=0.2), final_rms
    assert final_rms[True] == pytest.approx(12.8, abs=0.4), final_rms
    figure = "enter{} its last layer at an RMS of 12.8 instead of 4.0"
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert figure.format("s") in readme
    assert figure.format("") in " ".join(hf_memffn.KVFFNConfig.__doc__.split())


def test_kvffn_dropout_acts_on_the_block_output_in_training_only():
    model = build("kvffn", kvffn_dropout=0.5)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(mlp(x), mlp(x))  # eval mode: deterministic
    mlp.train()
    torch.manual_seed(0)
    dropped = mlp(x)
    mlp.eval()
    zeroed = (dropped == 0).float().mean().item()
    assert 0.3 < zeroed < 0.7, zeroed


def test_token_memory_is_each_layers_swiglu_on_x0():
    model = build("memoryllm").double()
    memory = model.model.memory
    with torch.no_grad():
        memory.norm_weight.uniform_(0.5, 1.5)
    x0 = torch.randn(2, 4, 64, dtype=torch.float64)
    outputs = memory(x0)
    assert outputs.shape == (2, 4, 2, 64)
    for layer in range(2):
        h = rms(x0, memory.norm_weight[layer])
        expected = (F.silu(h @ memory.gate_proj[layer].T) * (h @ memory.up_proj[layer].T)) @ memory.down_proj[layer].T
        torch.testing.assert_close(outputs[:, :, layer], expected)
    torch.testing.assert_close(memory.forward_layers(x0, [1]), outputs[:, :, [1]])


def test_memory_readout_gives_each_layer_a_contiguous_part_and_joins_gradients_once():
    """The FFNs on X0 are computed layers first, so each layer reads a contiguous [B, L, d] part, and the backward
    pass joins the layers' gradients in one step (indexing one layer at a time would add a zero-filled [B, L, N, d]
    tensor per layer)."""
    from hf_memffn.modeling_memffn import ComputedMemoryReadout

    model = build("memoryllm")
    x0 = torch.randn(2, 4, 64, requires_grad=True)
    readout = ComputedMemoryReadout(model.model.memory(x0))
    assert len(readout.layer_outputs) == 2 and all(part.is_contiguous() for part in readout.layer_outputs)
    assert readout.layer_outputs[0].grad_fn.name().startswith("Unbind")
    hidden = torch.zeros(2, 4, 64)
    for layer in range(2):
        hidden = readout.add_into(hidden, layer)
    (grad,) = torch.autograd.grad(hidden.sum(), x0)
    (expected,) = torch.autograd.grad(model.model.memory(x0).sum(), x0)
    torch.testing.assert_close(grad, expected)


def _layer_contributions(model, input_ids):
    """Inputs and outputs of every decoder layer, and what its attention and FFN produced."""
    records = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda mod, args, kwargs, out, i=i: records.__setitem__(("layer", i), (args[0], out)),
            with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda mod, args, out, i=i: records.__setitem__(("attn", i), out[0])))
        if layer.mlp is not None:
            hooks.append(layer.mlp.register_forward_hook(
                lambda mod, args, out, i=i: records.__setitem__(("mlp", i), (args[0], out))))
    with torch.no_grad():
        model(input_ids)
    for hook in hooks:
        hook.remove()
    return records


@pytest.mark.parametrize("arch", ["memoryllm", "flex_memoryllm", "flash_mhf"])
def test_decoder_wiring(arch):
    """MemoryLLM: X+Attn+FFN(X0); Flex: X+Attn(X)+FFN-C(X)+FFN-M(X0); others: Llama's sequential block."""
    model = build(arch).double()
    input_ids = torch.randint(0, 320, (1, 6))
    records = _layer_contributions(model, input_ids)
    x0 = model.model.embed_tokens(input_ids)
    memory = model.model.memory(x0) if model.model.memory is not None else None
    for i, layer in enumerate(model.model.layers):
        layer_in, layer_out = records[("layer", i)]
        expected = layer_in + records[("attn", i)]
        if layer.mlp is not None:
            ffn_in, ffn_out = records[("mlp", i)]
            reads = layer_in if arch == "flex_memoryllm" else layer_in + records[("attn", i)]
            torch.testing.assert_close(ffn_in, layer.post_attention_layernorm(reads))
            expected = expected + ffn_out
        if memory is not None:
            expected = expected + memory[:, :, i]
        torch.testing.assert_close(layer_out, expected)


def test_flex_memoryllm_gives_ffn_c_and_ffn_m_their_own_widths():
    """FFN-C (on the layer input) is `intermediate_size` wide and FFN-M (on X0) `memory_intermediate_size` wide, as
    `flex_memoryllm_split` sizes them; the tiny models give both the same width, which hid a swap or a lost field."""
    model = build("flex_memoryllm", intermediate_size=48, memory_intermediate_size=80)
    assert model.model.layers[0].mlp.gate_proj.out_features == 48
    assert tuple(model.model.memory.gate_proj.shape) == (2, 80, 64)
    assert tuple(model.model.memory.down_proj.shape) == (2, 64, 80)


def test_memory_on_x0_is_context_free():
    model = build("memoryllm")
    a = torch.tensor([[5, 6, 7, 8]])
    b = torch.tensor([[9, 9, 7, 1]])
    with torch.no_grad():
        out_a = model.model.memory(model.model.embed_tokens(a))
        out_b = model.model.memory(model.model.embed_tokens(b))
    torch.testing.assert_close(out_a[:, 2], out_b[:, 2])


# ---------------------------------------------------------------------------------------------------------------------
# caching, generation, attention backends, checkpointing, dtypes
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, overrides", ALL_VARIANTS, ids=[variant_id(v) for v in ALL_VARIANTS])
def test_greedy_with_cache_equals_without(arch, overrides):
    model = build(arch, **overrides)
    prompt = torch.randint(3, 320, (2, 7))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without_cache = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without_cache)
    # the cached logits also equal a full forward over the generated sequence
    with torch.no_grad():
        full = model(with_cache).logits
        step = model(with_cache[:, :-1], use_cache=True)
        last = model(with_cache[:, -1:], **{CACHE_KWARG: getattr(step, CACHE_KWARG)}).logits
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-4, atol=1e-5)


def test_the_cache_under_either_name_and_dropped_under_checkpointing():
    """transformers 5.24 renamed the key/value cache `past_key_values` -> `cache` (argument and output field). The
    forwards take both (`past_key_values` with transformers' deprecation warning since 5.24); the output carries the
    cache under the installed version's name (the one `generate()` reads back); an activation-checkpointed layer is
    given the cache under the name that `GradientCheckpointingLayer` drops, so a training step's recompute never
    writes it twice."""
    import contextlib
    import inspect

    from transformers import DynamicCache

    model = build("kvffn")
    for forward in (model.forward, model.model.forward):
        assert {"past_key_values", "cache"} <= set(inspect.signature(forward).parameters)
    ids = torch.randint(3, 320, (2, 9))
    old_name_warns = (pytest.warns(FutureWarning, match="`past_key_values` is deprecated") if CACHE_KWARG == "cache"
                      else contextlib.nullcontext())
    with torch.no_grad():
        expected = model(ids).logits[:, 5:]
        with old_name_warns:
            old_name = model(ids[:, :5], past_key_values=DynamicCache(config=model.config), use_cache=True)
        assert getattr(old_name, CACHE_KWARG).get_seq_length() == 5
        given = {CACHE_KWARG: getattr(old_name, CACHE_KWARG)}
        torch.testing.assert_close(model(ids[:, 5:], use_cache=True, **given).logits, expected, rtol=1e-4, atol=1e-5)
        if CACHE_KWARG == "cache":
            with pytest.raises(ValueError, match="`cache`"):
                model(ids, past_key_values=DynamicCache(config=model.config), cache=DynamicCache(config=model.config))

    model.train()
    enable_activation_checkpointing(model)
    cache = DynamicCache(config=model.config)
    model(ids, labels=ids, use_cache=True, **{CACHE_KWARG: cache}).loss.backward()
    assert cache.get_seq_length() == 0


@pytest.mark.skipif(CACHE_KWARG == "past_key_values", reason="`past_key_values` is deprecated from transformers 5.24")
@pytest.mark.parametrize("head", ["causal_lm", "base_model", "sequence_classifier"])
def test_the_deprecation_warning_of_past_key_values_names_the_line_that_passed_it(head):
    """The FutureWarning points at the caller's line (here, this file), as a deprecation warning should, so that the
    user finds the call to change and a warnings filter by module takes it: not at the forward wrappers of transformers
    or `nn.Module.__call__` between that line and the forward."""
    import linecache

    from transformers import AutoModelForSequenceClassification, DynamicCache

    model = build("kvffn")
    model = {"causal_lm": model, "base_model": model.model,
             "sequence_classifier": AutoModelForSequenceClassification.from_config(model.config)}[head]
    ids = torch.randint(3, 320, (1, 4))
    with torch.no_grad(), pytest.warns(FutureWarning, match="`past_key_values` is deprecated") as caught:
        model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    assert [warning.filename for warning in caught] == [__file__]
    assert "past_key_values=DynamicCache" in linecache.getline(__file__, caught[0].lineno)


@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm"])
def test_static_cache_generation_equals_dynamic(arch):
    model = build(arch)
    prompt = torch.randint(3, 320, (2, 6))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    dynamic = model.generate(prompt, **kwargs)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(dynamic, static)


def test_generation_steps_read_the_forward_signature_computed_once(monkeypatch):
    """transformers' generate() asks for the forward's signature of a model with its own code at every decoding step;
    `inspect` returns the one stored on the forward instead of rebuilding it through the decorators."""
    import inspect

    model = build("kvffn")
    assert model.is_remote_code()  # (registered for the Auto classes: generate() takes the custom-code branch)
    built = []
    original = inspect._signature_from_function
    monkeypatch.setattr(inspect, "_signature_from_function", lambda *a, **k: built.append(a[1]) or original(*a, **k))
    signature = inspect.signature(model.forward)
    assert built == []
    unwrapped = inspect.signature(inspect.unwrap(type(model).forward))
    assert list(signature.parameters) == list(unwrapped.parameters)[1:]  # (without `self`)
    assert "labels" in signature.parameters and "logits_to_keep" in signature.parameters
    built.clear()
    model.generate(torch.randint(3, 320, (1, 4)), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert "MemFFNForCausalLM.forward" not in [function.__qualname__ for function in built]
    # a forward that accelerate's hooks wrap (device_map dispatch) keeps the same signature, without `self`
    from accelerate.hooks import ModelHook, add_hook_to_module

    add_hook_to_module(model, ModelHook())
    assert inspect.signature(model.forward) == signature


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_generation_equals_per_row(arch):
    model = build(arch)
    rows = [torch.randint(3, 320, (n,)) for n in (9, 5, 2)]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    input_ids, attention_mask = left_padded(rows)
    width = input_ids.shape[1]
    batched = model.generate(input_ids, attention_mask=attention_mask, **kwargs)[:, width:]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, len(row):]), f"row {i}"


def test_logits_to_keep():
    model = build("flash_mhf")
    ids = torch.randint(0, 320, (2, 8))
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, logits_to_keep=1).logits
        chosen = model(ids, logits_to_keep=torch.tensor([1, 4])).logits
        # (any other index of the position axis, as transformers' Llama takes it: a list, a slice)
        listed = model(ids, logits_to_keep=[1, 4]).logits
        sliced = model(ids, logits_to_keep=slice(2, None)).logits
    assert last.shape == (2, 1, 320)
    torch.testing.assert_close(last, full[:, -1:])
    torch.testing.assert_close(chosen, full[:, [1, 4]])
    torch.testing.assert_close(listed, full[:, [1, 4]])
    torch.testing.assert_close(sliced, full[:, 2:])


@pytest.mark.parametrize("arch", ARCHS)
def test_sdpa_and_eager_attention_agree(arch):
    model = build(arch)
    ids = torch.randint(0, 320, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = eager(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[:, 3:], b[:, 3:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_flex_attention_at_load_and_after_it_agrees_with_eager(arch):
    """`flex_attention` (README: selectable with sdpa, eager and flash_attention_2), chosen when the model is built
    or with `set_attn_implementation` after, gives eager attention's logits on a left-padded batch and on sequences
    packed into one row (`position_ids` restarting at 0, no mask), which stay apart as in each implementation."""
    torch.manual_seed(0)
    flex = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="flex_attention").eval()
    assert flex.config._attn_implementation == "flex_attention"
    eager = copy.deepcopy(flex)
    eager.set_attn_implementation("eager")
    switched = copy.deepcopy(eager)
    switched.set_attn_implementation("flex_attention")
    ids = torch.randint(3, 320, (2, 9))
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    packed = torch.cat([torch.arange(4), torch.arange(5)])[None]
    with torch.no_grad():  # (flex attention has no backward on a CPU)
        expected = eager(ids, attention_mask=padding).logits
        apart = torch.cat([eager(ids[1:, :4]).logits, eager(ids[1:, 4:]).logits], dim=1)
        for model in (flex, switched):
            torch.testing.assert_close(model(ids, attention_mask=padding).logits[:, 3:], expected[:, 3:],
                                       rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(model(ids[1:], position_ids=packed).logits, apart, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_4d_boolean_mask_gives_the_logits_of_the_padding_mask_in_every_attention(arch):
    """A 4-D mask passed by the caller reaches the attention function as it is: boolean (True where a query may
    attend, as sdpa and transformers' own sdpa masks take it) or floating point (added to the scores). Eager attention
    added a boolean mask too, as 0 and 1, so it masked nothing there (Llama's does the same); a model switched to eager
    for `output_attentions` then gave other logits than sdpa for the same call."""
    model = build(arch)
    ids = torch.randint(3, 320, (2, 9))
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    keep = torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & padding[:, None, None, :].bool()
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = model(ids, attention_mask=padding).logits
        for implementation in ("sdpa", "eager"):
            model.set_attn_implementation(implementation)
            for mask in (keep, additive):
                logits = model(ids, attention_mask=mask).logits
                torch.testing.assert_close(logits[:, 3:], expected[:, 3:], rtol=1e-4, atol=1e-5,
                                           msg=f"{implementation}, {mask.dtype} mask")
        attentions = model(ids, attention_mask=keep, output_attentions=True).attentions
    assert attentions[0][0, :, 3:, :3].abs().max().item() == 0  # (the tokens put no weight on the padding)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mask, named", [
    (torch.ones(2, 9, 9, dtype=torch.long), r"attention_mask has 3 dimensions"),
    (torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1]), r"attention_mask has 1 dimension"),
    (torch.ones(2, 1, 9, 9, dtype=torch.long), r"a 4-D attention_mask has dtype torch.int64"),
])
def test_an_attention_mask_of_another_rank_or_dtype_is_refused_naming_it(arch, mask, named):
    """transformers' masks are 2-D (one 1 or 0 per token) or 4-D (boolean or floating point). A 1-D or 3-D mask
    failed inside the mask helpers (or ran unmasked where it kept every token), and a 4-D integer mask was added to the
    scores by eager attention (masking nothing) and refused by sdpa with torch's message: each is refused naming the
    mask and what it may be, whatever the attention implementation."""
    model = build(arch)
    ids = torch.randint(3, 320, (2, 9))
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        with pytest.raises(ValueError, match=named + r".*allowed"):
            model(ids, attention_mask=mask)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("positions", [torch.zeros(2, 1, dtype=torch.long), torch.arange(9), torch.arange(5)[None],
                                       torch.arange(9).expand(3, 9)], ids=["2x1", "1-D", "1x5", "3x9"])
def test_position_ids_of_another_shape_than_the_tokens_are_refused_naming_them(arch, positions):
    """`position_ids` are [batch or 1, tokens]. One position per row ([batch, 1]) for nine tokens gave all of them
    that position, silently (Llama's too); a 1-D tensor, another length or another batch failed on the shapes inside
    the rotary embedding. Positions of the right shape, shared by the rows or not, are taken as they are."""
    model = build(arch)
    ids = torch.randint(3, 320, (2, 9))
    with pytest.raises(ValueError, match=rf"position_ids has shape {re.escape(str(tuple(positions.shape)))}: "
                                         r"allowed are \(2 or 1, 9\)"):
        model(ids, position_ids=positions)
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(model(ids, position_ids=torch.arange(9)[None] + 4).logits, expected,
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(ids, position_ids=torch.arange(9).expand(2, 9)).logits, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_padding_mask_of_another_width_than_the_tokens_is_refused_naming_it(arch):
    """A 2-D `attention_mask` has one column per token, the cached ones included. One column short or long failed
    inside the attention on the shapes, and a decoding step given the mask of the cached tokens alone (the mask not
    extended in a hand-written loop) or of the new token alone attended to the wrong positions, silently."""
    model = build(arch)
    ids = torch.randint(3, 320, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        for width in (5, 7):
            with pytest.raises(ValueError, match=rf"attention_mask has shape \(2, {width}\).*\(2, 6\) for 0 cached"):
                model(ids, attention_mask=torch.ones(2, width, dtype=torch.long))
        cache = getattr(model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True), CACHE_KWARG)
        for stale in (mask[:, :5], mask[:, 5:]):
            with pytest.raises(ValueError, match=r"\(2, 6\) for 5 cached and 1 new tokens"):
                model(ids[:, 5:], attention_mask=stale, **{CACHE_KWARG: cache})
        assert cache.get_seq_length() == 5  # (refused before anything was cached)
        step = model(ids[:, 5:], attention_mask=mask, **{CACHE_KWARG: cache}).logits
    torch.testing.assert_close(step, expected[:, 5:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["flash_mhf", "kvffn"])
def test_unpadded_sequences_attend_with_the_causal_flag_and_match_the_explicit_mask(arch, monkeypatch):
    """No attention mask, no positions and an empty cache (a training step, a prompt's first forward into a dynamic or
    static cache): the decoder builds no mask (sdpa's causal flag), also while torch.compile traces, and the logits are
    those of an explicit causal mask (eager attention). A padding mask, given positions (which may mark packed
    sequences) or a filled cache go through transformers' `create_causal_mask`."""
    from transformers import StaticCache

    from hf_memffn import modeling_memffn

    built = []  # one entry per forward that asked transformers for a mask

    def create_causal_mask(config, inputs_embeds, attention_mask, cache, **kwargs):
        built.append(attention_mask)
        return real_create_causal_mask(config, inputs_embeds, attention_mask, cache, **kwargs)

    real_create_causal_mask = modeling_memffn.create_causal_mask
    monkeypatch.setattr(modeling_memffn, "create_causal_mask", create_causal_mask)
    model = build(arch)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids = torch.randint(3, 320, (2, 9))
    with torch.no_grad():
        expected = eager(ids).logits
        assert len(built) == 1  # (eager attention always takes transformers' mask)
        built.clear()
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-5)
        static = StaticCache(config=model.config, max_cache_len=16)
        torch.testing.assert_close(model(ids, use_cache=True, **{CACHE_KWARG: static}).logits, expected,
                                   rtol=1e-4, atol=1e-5)
        cached = getattr(model(ids[:, :5], use_cache=True), CACHE_KWARG)
        assert built == []
        positions = torch.arange(9)[None].expand(2, 9)
        torch.testing.assert_close(model(ids, position_ids=positions).logits, expected, rtol=1e-4, atol=1e-5)
        padding = torch.ones_like(ids)
        torch.testing.assert_close(model(ids, attention_mask=padding).logits, expected, rtol=1e-4, atol=1e-5)
        model(ids[:, 5:], use_cache=True, **{CACHE_KWARG: cached})
        assert len(built) == 3
    built.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-4, atol=1e-5)
    assert built == []


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_gives_the_same_gradients(arch):
    model = build(arch).train()
    ids = torch.randint(0, 320, (2, 8))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    enable_activation_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and len(plain) == len(list(model.parameters()))
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_step_runs_in_fp32_and_bf16(arch, dtype):
    model = build(arch).to(dtype).train()
    ids = torch.randint(0, 320, (2, 8))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.lm_head.weight.grad.dtype == dtype


def test_hidden_states_and_attentions_outputs():
    model = build("memoryllm")
    model.set_attn_implementation("eager")
    out = model(torch.randint(0, 320, (1, 5)), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (1, 4, 5, 5)


def test_inputs_embeds_and_tied_embeddings():
    model = build("kvffn", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 320, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model(inputs_embeds=model.model.embed_tokens(ids)).logits)
    with pytest.raises(ValueError, match="exactly one"):
        model()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", [(2, 0, 64), (0, 5, 64)])
def test_empty_inputs_embeds_get_a_one_line_error(arch, shape):
    """No token, or no sequence, as `inputs_embeds`: refused as empty `input_ids` are (it had failed with an
    IndexError inside transformers' mask helpers, or a reshape error in the attention)."""
    with pytest.raises(ValueError, match=r"inputs_embeds is empty \(shape \(\d, \d, 64\)\)"):
        build(arch)(inputs_embeds=torch.zeros(shape))


def test_no_split_modules_name_classes_each_model_has():
    for arch in ARCHS:
        model = build(arch)
        present = {type(module).__name__ for module in model.modules()}
        assert "MemFFNDecoderLayer" in model._no_split_modules
        assert set(model._no_split_modules) <= present, (arch, model._no_split_modules)
    assert "TokenMemory" in build("memoryllm")._no_split_modules


def test_flash_mhf_op_runs_in_the_autocast_dtype(monkeypatch):
    """Under autocast (e.g. Trainer(bf16=True), fp32 weights) the fused op gets bf16 queries and float32 gates."""
    import hf_memffn.flash_mhf_op as ffn_module

    seen = {}
    real_op = ffn_module.flash_mhf

    def spy(q, k, u, v, r, **kwargs):
        seen.update(q=q.dtype, r=r.dtype)
        return real_op(q, k, u, v, r, **kwargs)

    monkeypatch.setattr(ffn_module, "flash_mhf", spy)
    mlp = build("flash_mhf").model.layers[0].mlp
    x = torch.randn(2, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        queries = mlp.queries(x)
        assert mlp.gates(queries).dtype == torch.float32
        out = mlp(x)
    assert seen == {"q": torch.bfloat16, "r": torch.float32}
    torch.testing.assert_close(out.float(), mlp(x), rtol=0.05, atol=0.02)


def test_device_map_auto(tmp_path):
    model = build("memoryllm")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto")
    ids = torch.randint(0, 320, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids.to(loaded.device)).logits.cpu(), model(ids).logits)


@pytest.mark.parametrize("arch", ["llama", *ARCHS])
def test_accelerates_load_checkpoint_and_dispatch_loads_llama_and_names_from_pretrained_for_these(arch, tmp_path):
    """accelerate's `load_checkpoint_and_dispatch` on a model built under `init_empty_weights()` loads a checkpoint
    by its tensor names: Llama's load whole. These architectures' checkpoints keep some weights under other names
    (joined or renamed by `from_pretrained`), which stay empty: dispatching to one device stops at an error that
    names them and `from_pretrained(path, device_map=...)`, which loads the same map whole (torch's error, of the
    same type, named nothing)."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    model = build(arch)
    model.save_pretrained(tmp_path)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(model.config)
    expected = {"llama": None, "flash_mhf": "mlp.key_up_value", "memoryllm": "memory.rmsnorm_weight",
                "flex_memoryllm": "memory.rmsnorm_weight", "kvffn": "mlp.key_value_proj.weight"}[arch]
    if expected is None:
        loaded = load_checkpoint_and_dispatch(empty, str(tmp_path), device_map={"": "cpu"})
    else:
        with pytest.raises(NotImplementedError,
                           match=rf"on the meta device: [^)]*{expected}.*from_pretrained\(path, device_map=\.\.\.\)"):
            load_checkpoint_and_dispatch(empty, str(tmp_path), device_map={"": "cpu"})
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"})
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", *ARCHS])
def test_from_pretrained_with_fewer_layers_keeps_the_first_layers(arch, tmp_path):
    """`from_pretrained(path, num_hidden_layers=k)` loads the first k layers of a deeper checkpoint, as for
    transformers' Llama, and reports the later decoder layers' weights unexpected. MemoryLLM's and FlexMemoryLLM's
    FFNs on X0, one tensor stacking every layer, keep their first k layers too (their load was a size mismatch), in
    parameters of their own size."""
    model = build(arch, num_hidden_layers=3)
    model.save_pretrained(tmp_path)
    shallow, info = AutoModelForCausalLM.from_pretrained(tmp_path, num_hidden_layers=2, output_loading_info=True)
    assert shallow.config.num_hidden_layers == 2 and len(shallow.model.layers) == 2
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(key.startswith("model.layers.2.") for key in info["unexpected_keys"])
    deep = model.state_dict()
    for name, tensor in shallow.state_dict().items():
        expected = deep[name][:2] if name.startswith("model.memory.") else deep[name]
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)
    if getattr(shallow.model, "memory", None) is not None:
        assert shallow.model.memory.num_layers == 2 and shallow.model.memory.gate_proj.shape[0] == 2
        for param in shallow.model.memory.parameters():  # (the dropped layers' memory is not kept alive)
            assert param.untyped_storage().nbytes() == param.numel() * param.element_size()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_split_over_two_gpus_equals_it_on_one(arch, tmp_path):
    """`device_map` with the second layer, the final norm and the head on cuda:1 while cuda:0 is current: every
    kernel launches on the device of its tensors (`triton_launch.launch`), so logits and greedy tokens equal the
    model's on cuda:0 alone."""
    build(arch).save_pretrained(tmp_path)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": 0})
    split_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                 "model.norm": 1, "lm_head": 1}
    if hasattr(whole.model, "memory"):
        split_map["model.memory"] = 0
    split = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=split_map)
    assert next(split.model.layers[1].parameters()).device == torch.device("cuda", 1)
    torch.cuda.set_device(0)
    ids = torch.randint(3, 320, (2, 7), device="cuda:0")
    with torch.no_grad():
        torch.testing.assert_close(split(ids).logits.to("cuda:0"), whole(ids).logits)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(split.generate(ids, **kwargs).to("cuda:0"), whole.generate(ids, **kwargs))


def test_save_writes_safetensors_config_code_tokenizer_and_card(tmp_path):
    model = build("flash_mhf")
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    for expected in ("model.safetensors", "config.json", "configuration_memffn.py", "modeling_memffn.py",
                     "ffn.py", "flash_mhf_op.py", "tokenizer.json", "README.md"):
        assert expected in names, expected
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 320, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_from_pretrained_takes_every_dtype_form_transformers_takes(tmp_path):
    """The config's dtype check names a misspelt dtype; the forms transformers itself takes still load: a dtype,
    its name, "auto", and the (deprecated) dict of per-module dtypes."""
    AutoModelForCausalLM.from_config(tiny_config("kvffn")).save_pretrained(tmp_path)
    for dtype, expected in ((torch.bfloat16, torch.bfloat16), ("float16", torch.float16), ("auto", torch.float32),
                            ({"": torch.float16}, torch.float16)):
        assert AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).dtype == expected, dtype
    with pytest.raises(ValueError, match="dtype"):
        tiny_config("kvffn", dtype="bf16")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_floating_point_dtype_no_model_is_built_in_is_refused_naming_the_allowed_ones(dtype, tmp_path):
    """float8 is a floating-point torch.dtype, but torch makes no default dtype of it, in which transformers builds
    the model: given to the config it had been accepted and written to config.json, which the config's own check
    then refused on reload, and `from_pretrained(dtype=...)` failed inside torch ("couldn't find storage object")."""
    allowed = "torch.float32, torch.float16, torch.bfloat16, torch.float64"
    with pytest.raises(ValueError, match=rf"`dtype`={dtype}.*{allowed}"):
        tiny_config("kvffn", dtype=dtype)
    AutoModelForCausalLM.from_config(tiny_config("kvffn")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"`dtype`={dtype}.*{allowed}"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    for name in ("float32", "half", "double"):  # (the names, torch's aliases among them, still load back)
        config = tiny_config("kvffn", dtype=name)
        config.save_pretrained(tmp_path / name)
        assert AutoConfig.from_pretrained(tmp_path / name).dtype == getattr(torch, name)


@pytest.mark.parametrize("dtype", ["bf16", torch.float8_e4m3fn, torch.int8])
def test_a_dtype_set_by_hand_that_would_not_load_back_is_refused_before_the_config_is_saved(dtype, tmp_path):
    """`config.dtype` set after the config was built: `config.save_pretrained` wrote it to config.json, which
    `AutoConfig.from_pretrained` then refused (its check of the field); refused now before anything is written, as
    other fields set by hand are. (A model's save writes the dtype of its weights in place of it.)"""
    config = tiny_config("kvffn")
    config.dtype = dtype
    with pytest.raises(ValueError, match=r"save_pretrained: the config would not load back .*`dtype`="):
        config.save_pretrained(tmp_path / "config")
    assert not (tmp_path / "config").exists()
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path / "config")
    assert AutoConfig.from_pretrained(tmp_path / "config").dtype == torch.bfloat16


def test_save_refuses_an_attached_tokenizer_larger_than_the_vocabulary_before_writing(tmp_path):
    """A tokenizer with more tokens than `vocab_size` was saved with the weights: the checkpoint's own tokenizer then
    gave ids that every forward refused. Refused before anything is written; resized embeddings take it."""
    model = build("kvffn", vocab_size=200)
    tokenizer = tiny_tokenizer()
    assert len(tokenizer) > 200
    model.attach_tokenizer(tokenizer)
    with pytest.raises(ValueError, match=rf"save_pretrained: the attached tokenizer has {len(tokenizer)} tokens, "
                                         r"more than the model's vocab_size=200.*resize_token_embeddings"):
        model.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "resized")
    assert (tmp_path / "resized" / "tokenizer.json").exists()


def saved_first_layer_ffn(model, directory):
    """Saves `model` to `directory`; returns token ids, the model's logits for them, the tensors stored for its first
    layer's FFN (by name under it) and that FFN module."""
    from safetensors.torch import load_file

    ids = torch.randint(0, 320, (1, 6))
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(directory)
    stored = load_file(directory / "model.safetensors")
    layer = {name.removeprefix("model.layers.0.mlp."): tensor for name, tensor in stored.items()
             if name.startswith("model.layers.0.mlp.")}
    return ids, logits, layer, model.model.layers[0].mlp


def assert_loads_exactly(directory, ids, expected_logits) -> None:
    reloaded, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected_logits)


@pytest.mark.parametrize("variant", ["flash_mhf", "pkv", "swiglu"])
def test_flash_mhf_checkpoints_keep_key_up_and_value_as_three_tensors(tmp_path, variant):
    """The module holds each layer's key, up and value as views of one parameter `key_up_value` (one input of a
    compiled step, not three); checkpoints store the three tensors they always had, and a file with the merged
    tensor loads too. The PKV and SwiGLU baselines, whose `mlp.key` / `mlp.up_proj` the conversion must leave
    alone, round-trip unchanged."""
    from safetensors.torch import save_file

    model = build("flash_mhf", ffn_variant=variant)
    ids, expected, layer, mlp = saved_first_layer_ffn(model, tmp_path)
    if variant == "flash_mhf":
        assert {"key", "up", "value"} <= set(layer) and "key_up_value" not in layer
        assert [name for name, _ in mlp.named_parameters() if name in ("key", "up", "value", "key_up_value")] == [
            "key_up_value"]
        for name in ("key", "up", "value"):
            torch.testing.assert_close(layer[name], getattr(mlp, name))
            assert getattr(mlp, name).untyped_storage().data_ptr() == mlp.key_up_value.untyped_storage().data_ptr()
    else:
        assert set(layer) == {name for name, _ in mlp.named_parameters()}
    assert_loads_exactly(tmp_path, ids, expected)
    if variant == "flash_mhf":  # a file holding the merged tensor, as the module names it
        save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
                  tmp_path / "model.safetensors", metadata={"format": "pt"})
        assert_loads_exactly(tmp_path, ids, expected)


@pytest.mark.parametrize("variant", ["kvffn", "glu", "relu"])
def test_kvffn_checkpoints_keep_key_and_value_projections_apart(tmp_path, variant):
    """The KV-FFN block computes keys and values with one linear layer `key_value_proj` (one GEMM, one weight and
    one bias tensor, rows interleaved); checkpoints store `key_proj` and `value_proj` as they always had, and load
    back exactly. The ReLU baseline, keys only, keeps its `key_proj`."""
    model = build("kvffn", ffn_variant=variant)
    ids, expected, layer, mlp = saved_first_layer_ffn(model, tmp_path)
    if variant == "relu":
        assert set(layer) == {"key_proj.weight", "key_proj.bias", "out_proj.weight", "out_proj.bias"}
    else:
        assert set(layer) == {f"{name}.{kind}" for name in ("key_proj", "value_proj", "out_proj")
                              for kind in ("weight", "bias")}
        assert [name for name, _ in mlp.named_parameters()] == ["key_value_proj.weight", "key_value_proj.bias",
                                                                "out_proj.weight", "out_proj.bias"]
        key_weight, key_bias, value_weight, value_bias = kvffn_key_and_value(mlp)
        for name, tensor in (("key_proj.weight", key_weight), ("key_proj.bias", key_bias),
                             ("value_proj.weight", value_weight), ("value_proj.bias", value_bias)):
            torch.testing.assert_close(layer[name], tensor)
    assert_loads_exactly(tmp_path, ids, expected)


@pytest.mark.parametrize("arch, variant", [("flash_mhf", "pkv"), ("kvffn", "relu"), ("kvffn", "densenet")])
def test_a_baseline_starts_the_ffn_a_checkpoint_lacks_at_random(arch, variant, tmp_path):
    """A checkpoint without the baseline's FFN weights (transformers' Llama here) gives it the attention and the
    embeddings, and the FFN starts at random, as for the other variants; only a checkpoint whose FFN tensors the
    conversions joined and then dropped (saved from the other class) is refused, in tests/test_bad_input.py."""
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(tiny_config("llama"))
    llama.save_pretrained(tmp_path)
    causal_lm_class = hf_memffn.REGISTRY[arch].causal_lm_class
    heads = {"ffn_num_heads": 4} if arch == "flash_mhf" else {}
    model, info = causal_lm_class.from_pretrained(tmp_path, ffn_variant=variant, output_loading_info=True, **heads)
    assert model.config.ffn_variant == variant
    query = model.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(query, llama.model.layers[0].self_attn.q_proj.weight)
    ffn_weight = "mlp.key" if variant == "pkv" else "mlp.key_proj.weight"
    assert f"model.layers.0.{ffn_weight}" in info["missing_keys"]
    assert model.get_parameter(f"model.layers.0.{ffn_weight}").std() > 0


@pytest.mark.parametrize("arch, removed", [("flash_mhf", "mlp.up"), ("flash_mhf", "mlp.key"),
                                           ("kvffn", "mlp.value_proj.weight"), ("kvffn", "mlp.key_proj.bias")])
def test_a_checkpoint_lacking_one_part_of_a_joined_parameter_loads_the_others(arch, removed, tmp_path):
    """A checkpoint without one of the tensors that loading joins into one parameter (FlashMHF's key, up and value;
    KV-FFN's key and value projections) loads the others; the missing one starts as in a new model and is reported
    under its checkpoint name, as a missing weight of transformers' Llama is (it was a size mismatch of the joined
    parameter, or a failed conversion)."""
    from safetensors.torch import load_file, save_file

    model = build(arch)
    with torch.no_grad():  # (trained weights: every loaded value is 1 above a new model's)
        for param in model.parameters():
            param.add_(1.0)
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    name = f"model.layers.0.{removed}"
    del stored[name]
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {name} and not info["unexpected_keys"] and not info["mismatched_keys"], info

    def parts(mlp):
        if arch == "flash_mhf":
            return dict(zip(("mlp.key", "mlp.up", "mlp.value"), mlp.subnetwork_weights()))
        key_weight, key_bias, value_weight, value_bias = kvffn_key_and_value(mlp)
        return {"mlp.key_proj.weight": key_weight, "mlp.key_proj.bias": key_bias,
                "mlp.value_proj.weight": value_weight, "mlp.value_proj.bias": value_bias}

    saved = parts(model.model.layers[0].mlp)
    for part_name, part in parts(reloaded.model.layers[0].mlp).items():
        if part_name != removed:
            torch.testing.assert_close(part, saved[part_name], rtol=0, atol=0)
        elif part_name.endswith("bias"):
            assert torch.count_nonzero(part) == 0
        else:
            expected_std = model.config.initializer_range if arch == "flash_mhf" else model.config.kvffn_init_std
            assert abs(part.mean().item()) < 0.1 * expected_std
            assert part.std().item() == pytest.approx(expected_std, rel=0.1)
    torch.testing.assert_close(reloaded.model.layers[1].state_dict(), model.model.layers[1].state_dict())


def _saved_bytes(fn):
    """Bytes of the distinct storages that autograd keeps for the backward pass of `fn()`."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = fn()
    return output, sum(storages.values())


def test_flash_mhf_token_chunked_recompute_keeps_only_the_input(monkeypatch):
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_config("flash_mhf")).model.layers[0].mlp
    chunked = copy.deepcopy(plain)
    chunked.recompute_chunk_tokens = 16
    x = torch.randn(3, 40, 64, requires_grad=True)
    out_plain, saved_plain = _saved_bytes(lambda: plain(x))
    out_chunked, saved_chunked = _saved_bytes(lambda: chunked(x))
    torch.testing.assert_close(out_chunked, out_plain)
    input_bytes = x.numel() * x.element_size()
    assert saved_chunked <= input_bytes < saved_plain / 4
    grad = torch.randn_like(out_plain)
    expected = torch.autograd.grad(out_plain, [x, *plain.parameters()], grad)
    actual = torch.autograd.grad(out_chunked, [x, *chunked.parameters()], grad)
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # under autocast, the backward pass recomputes in the same autocast as the forward pass
    import hf_memffn.flash_mhf_op as ffn_module

    dtypes = []
    real_op = ffn_module.flash_mhf
    monkeypatch.setattr(ffn_module, "flash_mhf", lambda q, *args, **kw: dtypes.append(q.dtype) or real_op(q, *args, **kw))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_chunked = chunked(x)
    torch.autograd.grad(out_chunked, [x, *chunked.parameters()], grad.bfloat16())
    assert len(dtypes) == 2 * 8 and set(dtypes) == {torch.bfloat16}  # 8 chunks of 16 tokens, forward + recompute
    with pytest.raises(ValueError, match="ffn_recompute_chunk_tokens"):
        hf_memffn.FlashMHFLlamaConfig(ffn_recompute_chunk_tokens=-1)
    empty = x[:0].detach().requires_grad_(True)  # no tokens: no chunk runs, the output is empty all the same
    out_empty = chunked(empty)
    out_empty.sum().backward()
    assert out_empty.shape == (0, 40, 64) and empty.grad.shape == empty.shape


def test_flash_mhf_token_chunked_recompute_sums_bf16_weight_gradients_in_float32():
    """A bf16 module's weight gradients, summed over many chunks, stay as close to the float64 ones as the unchunked
    backward's (each chunk's gradient added in bf16 lost precision with every chunk: 256 chunks gave about three
    times the unchunked error)."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config("flash_mhf")).model.layers[0].mlp.double()
    plain = copy.deepcopy(reference).bfloat16()
    chunked = copy.deepcopy(plain)
    chunked.recompute_chunk_tokens = 1
    x = torch.randn(1, 256, 64, dtype=torch.float64)
    grad = torch.randn(1, 256, 64, dtype=torch.float64)

    def weight_gradients(module):
        inputs = x.to(next(module.parameters()).dtype)
        return torch.autograd.grad(module(inputs), list(module.parameters()), grad.to(inputs.dtype))

    exact = weight_gradients(reference)
    for unchunked, summed, truth in zip(weight_gradients(plain), weight_gradients(chunked), exact):
        assert summed.dtype == torch.bfloat16
        error = lambda g: ((g.double() - truth).norm() / truth.norm()).item()  # noqa: E731
        assert error(summed) <= 1.5 * error(unchunked) + 1e-3


def test_flash_mhf_token_chunked_recompute_refuses_a_second_derivative():
    """The recompute's gradients carry no graph: a gradient of them (a gradient penalty added to the loss) raises
    instead of leaving the FFN's share out of it."""
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(tiny_config("flash_mhf")).model.layers[0].mlp
    module.recompute_chunk_tokens = 16
    x = torch.randn(2, 20, 64, requires_grad=True)
    out = module(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    penalty = grad.square().sum()
    assert penalty.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.sum() + penalty).backward()


def test_flash_mhf_token_chunked_recompute_runs_under_the_flop_counter():
    """FlopCounterMode hooks the gradients of every submodule's input: the chunks that the FFN's projections read must
    be tensors autograd can hook, in the forward pass and in the backward pass's recompute, which counts one more
    forward of the FFN. The gradients are those of the plain module."""
    from torch.utils.flop_counter import FlopCounterMode

    flops, grads = [], []
    for chunk_tokens in (0, 4):
        model = build("flash_mhf", ffn_recompute_chunk_tokens=chunk_tokens)
        ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            model(ids, labels=ids).loss.backward()
        flops.append(counter.get_total_flops())
        grads.append([p.grad for p in model.parameters()])
    assert flops[1] > flops[0]
    for recomputed, plain in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=1e-4, atol=1e-6)


def test_flash_mhf_token_chunked_recompute_compiles_once_for_every_batch_shape():
    """Under torch.compile the token-chunked recompute runs between the graphs (one break per layer): traced, its loop
    over the batch's tokens made Dynamo compile it again for every number of tokens, until its recompile limit sent
    it to eager. Shapes after the first two (Dynamo's static graph, then its dynamic one) compile nothing more; the
    losses and gradients are the eager model's; `fullgraph=True` fails naming the setting."""
    model = build("flash_mhf", ffn_recompute_chunk_tokens=4).train()
    generator = torch.Generator().manual_seed(0)
    (record, graphs), counts = recording_backend(), []

    def loss_and_grads(forward, ids):
        loss = forward(ids, labels=ids).loss
        loss.backward()
        grads = [param.grad.clone() for param in model.parameters()]
        model.zero_grad()
        return loss.detach(), grads

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=record)
        for batch, length in ((1, 7), (2, 9), (3, 5), (2, 11)):
            ids = torch.randint(3, 320, (batch, length), generator=generator)
            loss, grads = loss_and_grads(compiled, ids)
            expected_loss, expected_grads = loss_and_grads(model, ids)
            torch.testing.assert_close(loss, expected_loss)
            for grad, expected in zip(grads, expected_grads):
                torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
            counts.append(len(graphs))
        assert counts[1] == counts[-1], counts
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match="ffn_recompute_chunk_tokens") as refused:
            torch.compile(model, backend="eager", fullgraph=True)(ids, labels=ids)
    finally:
        torch._dynamo.reset()
    assert "without fullgraph" in str(refused.value)


def test_a_model_configured_to_recompute_in_token_chunks_exports_for_any_number_of_tokens():
    """`ffn_recompute_chunk_tokens` stays in a checkpoint's config. torch.export (non-strict, its default, with
    gradients on as they are by default) traced the chunks of the example's 16 tokens: the program, exported with a
    dynamic batch and length, failed on any other number of tokens ("Guard failed: ... == 16"). The export leaves
    the recompute out (the same values) and keeps the setting."""
    model = build("flash_mhf", ffn_recompute_chunk_tokens=4, num_hidden_layers=1).eval()
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}, None)
    program = torch.export.export(model, (torch.randint(3, 320, (2, 8)),), {"use_cache": False}, dynamic_shapes=dims)
    assert model.model.layers[0].mlp.recompute_chunk_tokens == 4
    for shape in ((3, 11), (1, 3), (2, 33)):
        ids = torch.randint(3, 320, shape, generator=torch.Generator().manual_seed(shape[1]))
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits
        torch.testing.assert_close(program.module()(ids, use_cache=False).logits, expected, msg=str(shape))


@pytest.mark.parametrize("overrides", [{}, {"ffn_recompute_chunk_tokens": 4}], ids=["plain", "recompute"])
def test_flash_mhf_model_runs_on_the_meta_device(overrides):
    """A model built on the meta device runs for its shapes (as Llama does, e.g. under FlopCounterMode), forward and
    backward, also under autocast: the FFN asks for autocast only where the device has it, and the recompute draws
    nothing from the CPU's random state."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", **overrides))
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    cpu_state = torch.get_rng_state()
    out = model(ids, labels=ids)
    out.loss.backward()
    assert out.logits.shape == (2, 5, 320) and out.logits.is_meta
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), cpu_state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(ids).logits.shape == (2, 5, 320)


def test_flash_mhf_model_compiles_without_asking_whether_the_device_has_autocast(monkeypatch):
    """torch 2.11's dynamo cannot trace `torch.amp.is_autocast_available` (a C function it skips), so asking it in the
    FFN's forward broke the graph and failed fullgraph compiles on CUDA. Here the question raises while compiling, as
    an untraceable call does there, and the model still compiles whole, forward and backward, also under autocast."""
    asked = torch.amp.is_autocast_available

    def untraceable(device_type):
        if torch.compiler.is_compiling():
            raise AssertionError("torch.amp.is_autocast_available called while compiling")
        return asked(device_type)

    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    torch.manual_seed(0)
    model = build("flash_mhf")
    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(ids, labels=ids).loss
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(ids).logits.shape == (2, 7, 320)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_eager_forward_beside_a_compiled_model_compiles_nothing_again(arch):
    """The decoder and the FFNs log the path they run once, at the first eager forward (`decoder_path`, the FFN's
    `path_description`): a graph compiled before it must not guard on the flag that records this, or an eager forward
    of the same model (an evaluation, a `generate()` beside a compiled training loop) made every compiled graph
    compile again, which transformers' Llama does not."""
    model = build(arch)
    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    record, graphs = recording_backend()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=record)
        with torch.no_grad():
            expected = compiled(ids).logits
            torch.testing.assert_close(model(ids).logits, expected)
            torch.testing.assert_close(compiled(ids).logits, expected)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_flash_mhf_token_chunked_recompute_redraws_the_forward_dropout_masks(device, monkeypatch):
    """A LoRA adapter with dropout on `in_proj`: the recompute of the backward pass draws the masks of the forward
    pass (from the CPU's random state, or the CUDA device's), so the gradients are those of the same chunks run with
    plain autograd, keeping their activations, from the same random state. (Chunks, not the whole module: a CUDA
    generator draws other numbers for a chunk than for its part of the whole tensor. The Triton kernels on CUDA take
    head sizes from 64.)"""
    peft = pytest.importorskip("peft")
    import hf_memffn.ffn_multihead as ffn_multihead

    def chunks_with_plain_autograd(module, hidden_states, chunk_tokens):
        tokens = hidden_states.reshape(1, -1, hidden_states.shape[-1])
        outputs = [module._forward(tokens[:, start:start + chunk_tokens])
                   for start in range(0, tokens.shape[1], chunk_tokens)]
        return torch.cat(outputs, dim=1).view(*hidden_states.shape[:2], -1)

    shapes = {} if device == "cpu" else dict(hidden_size=256, num_attention_heads=4, ffn_num_heads=4,
                                             ffn_num_kv_heads=2, intermediate_size=128, ffn_num_subnetworks=2)
    grads = []
    for recompute in (True, False):
        if not recompute:
            monkeypatch.setattr(ffn_multihead, "recompute_in_token_chunks", chunks_with_plain_autograd)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=4, **shapes))
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["in_proj"], lora_dropout=0.5,
                                                           init_lora_weights=False)).to(device).train()
        ids = torch.randint(0, 64, (2, 9), device=device)
        torch.manual_seed(1)
        model(ids, labels=ids).loss.backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for recomputed, plain in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_flash_mhf_token_chunked_recompute_under_activation_checkpointing_keeps_the_dropout_masks(use_reentrant):
    """Reentrant activation checkpointing runs each layer's forward without gradients, then again with them in the
    backward pass. The FFN ran whole in the first and chunk by chunk in the second, which draw other dropout masks (a
    LoRA adapter's on `in_proj`): the loss came from one forward and the gradients from another, neither those of
    the run without checkpointing. In training the FFN runs in chunks with or without gradients."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=5))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=hf_memffn.LORA_TARGET_MODULES["flash_mhf"],
                                                       lora_dropout=0.2, init_lora_weights=False)).train()
    ids = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    runs = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_activation_checkpointing(model.base_model.model, {"use_reentrant": use_reentrant})
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = model(ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain), (loss, checkpointed) = runs
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    assert checkpointed.keys() == plain.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_mhf_model_trains_on_cuda_under_autocast_with_the_triton_kernels():
    """fp32 weights + bf16 autocast (as Trainer(bf16=True)): the fused op runs its bf16 Triton path, and the
    token-chunked recompute gives the gradients of the plain module."""
    from hf_memffn.flash_mhf_op import flash_mhf_path

    config = tiny_config("flash_mhf", hidden_size=256, num_attention_heads=4, ffn_num_heads=4, ffn_num_kv_heads=2,
                         intermediate_size=128, ffn_num_subnetworks=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).cuda().train()
    chunked = copy.deepcopy(model)
    for layer in chunked.model.layers:
        layer.mlp.recompute_chunk_tokens = 64
    ids = torch.randint(0, 320, (4, 96), device="cuda")
    grads = []
    for candidate in (model, chunked):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = candidate(ids, labels=ids).loss
        loss.backward()
        grads.append([p.grad.float() for p in candidate.parameters()])
    queries = torch.empty(1, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    assert flash_mhf_path(queries).startswith("triton")
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0.05, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------------
# each model class with its own architecture's config
# ---------------------------------------------------------------------------------------------------------------------
MODEL_CLASS_KINDS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification",
                     "ForQuestionAnswering")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_class_refuses_the_config_of_another_architecture(arch):
    """Every model class (base model and each head) given the config of another architecture, or a Llama config,
    is refused naming the config class it takes and the Auto class that builds the config's own model: built, it
    would hold the other architecture's FFNs under this class's name, and its checkpoint would name this class with
    the other architecture's model type (a MemoryLLMForCausalLM of a FlexMemoryLLMConfig reloaded as FlexMemoryLLM)."""
    config_class = hf_memffn.ARCHITECTURES[arch]
    for other in [name for name in ARCHS if name != arch] + ["llama"]:
        config = tiny_config(other)
        for kind in MODEL_CLASS_KINDS:
            model_class = getattr(hf_memffn, config_class.class_prefix + kind)
            auto_class = "AutoModel" + ("" if kind == "Model" else kind)
            with pytest.raises(ValueError, match=rf"^{model_class.__name__} takes a {config_class.__name__}, not a "
                                                 rf"{type(config).__name__} .*{auto_class}\.from_config\(config\)"):
                model_class(config)


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_refuses_a_checkpoint_of_another_architecture(arch, tmp_path):
    """A checkpoint of one architecture loaded with another architecture's class or config class is refused, naming
    the config class of its `model_type`: transformers only warns, and MemoryLLM's config read as FlexMemoryLLM's
    (or FlashMHFLlama's, KVFFN's) built a model whose FFNs started at random; the other pairs failed naming a field of
    the file as if removing it would load the checkpoint."""
    AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(tmp_path)
    saved_with = hf_memffn.ARCHITECTURES[arch]
    for other in ARCHS:
        if other == arch:
            continue
        config_class = hf_memffn.ARCHITECTURES[other]
        model_class = getattr(hf_memffn, config_class.class_prefix + "ForCausalLM")
        expected = (rf"^{config_class.__name__}: `model_type`='{saved_with.model_type}' is invalid: it is "
                    rf"{saved_with.__name__}'s")
        for loader in (config_class, model_class):
            with pytest.raises(ValueError, match=expected):
                loader.from_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == saved_with.class_prefix + "ForCausalLM"


def test_a_config_read_from_a_llama_config_is_of_its_own_model_type(tmp_path):
    """A Llama checkpoint loaded as FlashMHFLlama (the decoder's weights, the FFN new) has FlashMHFLlama's model type
    on the config: it was left at "llama", so the model card saved with it described a Llama ("# ... (llama)", tagged
    llama, without FlashMHF's summary and fields)."""
    transformers.LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path / "llama")
    ffn = {key: getattr(tiny_config("flash_mhf"), key)
           for key in ("ffn_num_heads", "ffn_num_subnetworks", "ffn_num_kv_heads")}
    assert hf_memffn.FlashMHFLlamaConfig.from_dict(tiny_config("llama").to_dict()).model_type == "memffn_flash_mhf"
    model = hf_memffn.FlashMHFLlamaForCausalLM.from_pretrained(tmp_path / "llama", **ffn)
    assert model.config.model_type == "memffn_flash_mhf"
    model.save_pretrained(tmp_path / "flash_mhf")
    card = (tmp_path / "flash_mhf" / "README.md").read_text()
    assert "# FlashMHFLlama (memffn_flash_mhf)" in card and "\n- llama\n" not in card


def test_a_config_subclass_without_an_init_of_its_own_keeps_the_fields_and_checks():
    """A user's subclass of a config that only sets class attributes (its `model_type`) builds the config of its base
    class, checks included: transformers turns a config class without an `__init__` of its own into a dataclass
    whose generated `__init__` replaced the inherited one, so `FlexMemoryLLMConfig`'s fields were never set (the
    model failed with "'...' object has no attribute 'head_dim'") and nothing was checked."""

    class FlexWithAType(hf_memffn.FlexMemoryLLMConfig):
        model_type = "test_models_flex_with_a_type"

    class SwiGLUDecoderConfig(hf_memffn.MemFFNConfig):
        model_type = "test_models_swiglu_decoder"

    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = FlexWithAType(**fields)
    expected = {**hf_memffn.FlexMemoryLLMConfig(**fields).to_dict(), "model_type": "test_models_flex_with_a_type"}
    assert config.to_dict() == expected
    assert FlexWithAType.from_dict(config.to_dict()).to_dict() == expected
    hf_memffn.FlexMemoryLLMForCausalLM(config)
    with pytest.raises(ValueError, match="memory_intermediate_size"):
        FlexWithAType(**{**fields, "memory_intermediate_size": 0})
    assert SwiGLUDecoderConfig(hidden_size=64, num_attention_heads=4).head_dim == 16


@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_loaded_from_a_llama_checkpoint_saves_the_architectures_checkpoint_names(arch, tmp_path):
    """A model loaded from a Llama checkpoint (the decoder's weights; the FFNs new) saves the tensor names of its
    architecture's checkpoints, as a new model does, and loads back with the same logits. transformers reverses on
    save only the checkpoint conversions that matched while loading, none here: the model saved its own names
    (FlashMHF's joined `mlp.key_up_value`, KV-FFN's interleaved `mlp.key_value_proj`, MemoryLLM's
    `memory.rmsnorm_weight`), which the token lookup tables' fingerprints and other readers of the checkpoint's
    names do not know."""
    from safetensors import safe_open

    def saved_names(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as weights:
            return set(weights.keys())

    transformers.LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path / "llama")
    # (FlexMemoryLLM's FFN-C at the Llama MLP's width, which it loads)
    ffn = {**hf_memffn.architectures.REGISTRY[arch].tiny_ffn,
           "intermediate_size": tiny_config("llama").intermediate_size}
    causal_lm = getattr(hf_memffn, hf_memffn.ARCHITECTURES[arch].class_prefix + "ForCausalLM")
    model = causal_lm.from_pretrained(tmp_path / "llama", **ffn).eval()
    model.save_pretrained(tmp_path / "loaded")
    AutoModelForCausalLM.from_config(model.config).save_pretrained(tmp_path / "new")
    assert saved_names(tmp_path / "loaded") == saved_names(tmp_path / "new")
    ids = torch.tensor([[1, 5, 9, 2]])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "loaded").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("arch, overrides", ALL_VARIANTS, ids=[variant_id(v) for v in ALL_VARIANTS])
def test_every_ffn_variant_keeps_sequences_packed_into_one_row_apart(arch, overrides):
    """Sequences packed into one row (`position_ids` restarting at 0, no mask, as `DataCollatorWithFlattening` gives
    them) have the logits of each sequence run alone, with sdpa and eager attention, for every FFN variant: each FFN,
    the FFNs on X0 included, reads its own token alone, so nothing crosses from one sequence to the next."""
    model = build(arch, **overrides)
    lengths = [4, 7, 1, 5]
    sequences = [torch.randint(3, 320, (n,)) for n in lengths]
    packed = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = torch.cat([model(sequence[None]).logits[0] for sequence in sequences])
        for implementation in ("sdpa", "eager"):
            model.set_attn_implementation(implementation)
            torch.testing.assert_close(model(packed, position_ids=positions).logits[0], alone, rtol=1e-5, atol=1e-5,
                                       msg=implementation)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_continues_the_position_ids_it_is_given(arch):
    """generate() given `position_ids` (here with a gap, which changes the rotary distances, and an `attention_mask`,
    which keeps the gap from reading as a new packed sequence) feeds the prompt those positions and each new token the
    next one, into a dynamic or a static cache: the tokens and logits of greedy forwards over the whole sequence with
    the same positions, which differ from those of the prompt's own positions."""
    model = build(arch)
    prompt = torch.randint(3, 320, (2, 6))
    positions = torch.tensor([0, 1, 2, 20, 21, 22]).expand(2, 6)
    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    expected, expected_logits = prompt, []
    with torch.no_grad():
        for _ in range(4):
            given = torch.cat([positions, positions[:, -1:] + torch.arange(1, expected.shape[1] - 5)], dim=1)
            expected_logits.append(model(expected, attention_mask=torch.ones_like(expected),
                                         position_ids=given).logits[:, -1])
            expected = torch.cat([expected, expected_logits[-1].argmax(-1, keepdim=True)], dim=1)
    for cache_implementation in (None, "static"):
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), position_ids=positions,
                                   cache_implementation=cache_implementation, **greedy)
        assert torch.equal(generated.sequences, expected), cache_implementation
        torch.testing.assert_close(torch.stack(generated.logits), torch.stack(expected_logits), rtol=1e-4, atol=1e-5)
    own_positions = model.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy).logits[0]
    assert not torch.allclose(own_positions, expected_logits[0], atol=1e-3)


@pytest.mark.parametrize("item", [("llama", {}), *ALL_VARIANTS, ("flash_mhf", {"ffn_recompute_chunk_tokens": 5})],
                         ids=lambda item: variant_id(item) + ("-chunked" if "ffn_recompute_chunk_tokens" in item[1]
                                                              else ""))
def test_a_bf16_autocast_training_step_stays_as_close_to_float32_as_llamas(item):
    """Forward and backward under `torch.autocast("cpu", dtype=torch.bfloat16)` with float32 weights (what
    `Trainer(bf16=True)` runs), against the same step in float32: the loss is float32, every parameter gets a
    float32 gradient, the logits are within 0.05 and each parameter's gradient within 5% (relative, in norm) of the
    float32 ones. transformers' Llama, run here too, stays within 0.01 and 2%."""
    arch, overrides = item
    model = build(arch, **overrides).train()
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    runs = []
    for enabled in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            output = model(ids, labels=ids)
        output.loss.backward()
        runs.append((output.loss, output.logits, {name: p.grad for name, p in model.named_parameters()}))
    (_, logits, grads), (loss, autocast_logits, autocast_grads) = runs
    assert loss.dtype == torch.float32 and autocast_logits.dtype == torch.bfloat16
    torch.testing.assert_close(autocast_logits.float(), logits, rtol=0, atol=0.05)
    for name, grad in autocast_grads.items():
        assert grad is not None and grad.dtype == torch.float32, name
        assert (grad - grads[name]).norm() <= 0.05 * grads[name].norm(), name


def test_a_config_save_cut_short_while_copying_the_modeling_code_leaves_no_partial_file(tmp_path, monkeypatch):
    """`config.save_pretrained` copies the modeling code beside config.json through a temporary name: a copy cut
    short (a full disk, an interrupt) leaves the earlier copy whole and no `<file>.<pid>.partial` beside it, which
    stayed half written in the checkpoint folder (and went to the Hub with the folder's next upload)."""
    import os
    import shutil

    config = tiny_config("memoryllm")
    config.save_pretrained(tmp_path)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert "modeling_memffn.py" in before

    copyfile = shutil.copyfile

    def copy_half_then_fail(source, target, *args, **kwargs):
        if os.path.basename(source) == "configuration_memffn.py":  # (transformers' own copy of the config's code)
            return copyfile(source, target, *args, **kwargs)
        with open(source, "rb") as handle, open(target, "wb") as out:
            out.write(handle.read()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", copy_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        config.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(before)
    assert {name: (tmp_path / name).read_bytes() for name in before if name.endswith(".py")} == {
        name: content for name, content in before.items() if name.endswith(".py")}


def test_two_processes_saving_a_config_into_one_folder_copy_the_modeling_code_each_under_a_name_of_its_own(
        tmp_path, monkeypatch):
    """Two processes saving into one folder at once (the main processes of two nodes with `save_on_each_node` on a
    shared file system): each copies the modeling code under a name of its own. Under the one name
    `<file>.partial`, the second truncated and renamed the first one's copy while it was being written, and the
    first then failed to rename it (FileNotFoundError)."""
    import os
    import shutil
    import subprocess
    import sys

    config = tiny_config("memoryllm")
    config.save_pretrained(tmp_path / "first")
    copyfile, others = shutil.copyfile, []
    script = ("import sys; from transformers import AutoConfig; import hf_memffn; "
              "AutoConfig.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])")

    def another_process_saves_meanwhile(source, target, *args, **kwargs):
        if os.path.basename(source) != "modeling_memffn.py" or others:
            return copyfile(source, target, *args, **kwargs)
        with open(source, "rb") as handle, open(target, "wb") as out:
            content = handle.read()
            out.write(content[:100])
            others.append(subprocess.run([sys.executable, "-c", script, str(tmp_path / "first"), str(tmp_path)],
                                         capture_output=True, text=True))
            out.write(content[100:])
        return target

    monkeypatch.setattr(shutil, "copyfile", another_process_saves_meanwhile)
    config.save_pretrained(tmp_path)
    assert others and others[0].returncode == 0, others[0].stderr[-2000:]
    monkeypatch.undo()
    assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".partial")]
    assert (tmp_path / "modeling_memffn.py").read_bytes() == (tmp_path / "first" / "modeling_memffn.py").read_bytes()


@pytest.mark.parametrize("arch", ["llama", *ARCHS])
def test_from_pretrained_with_more_layers_keeps_the_saved_layers_and_starts_the_new_ones(arch, tmp_path):
    """`from_pretrained(path, num_hidden_layers=k)` of a shallower checkpoint loads every saved layer and starts the
    new ones as a new model does, reporting them missing, as for transformers' Llama. MemoryLLM's and FlexMemoryLLM's
    FFNs on X0, one tensor stacking every layer, were a size mismatch: an error, or with `ignore_mismatched_sizes` all
    their layers started at random. They keep the saved layers, and the new layers start as `_init_weights` starts
    them (norm weights 1, projections N(0, initializer_range)), reported missing under the stacked name and layers."""
    model = build(arch, num_hidden_layers=2, initializer_range=0.05)
    model.save_pretrained(tmp_path)
    torch.manual_seed(1)
    deep, info = AutoModelForCausalLM.from_pretrained(tmp_path, num_hidden_layers=3, output_loading_info=True)
    assert deep.config.num_hidden_layers == 3 and len(deep.model.layers) == 3
    assert not info["mismatched_keys"] and not info["unexpected_keys"], info
    memory = getattr(deep.model, "memory", None)
    stacked = {f"model.memory.{name}[2:3]" for name, _ in memory.named_parameters()} if memory is not None else set()
    assert {key for key in info["missing_keys"] if not key.startswith("model.layers.2.")} == stacked, info
    shallow = model.state_dict()
    for name, tensor in deep.state_dict().items():
        if name in shallow:
            expected = tensor[:2] if name.startswith("model.memory.") else tensor
            torch.testing.assert_close(expected, shallow[name], rtol=0, atol=0, msg=name)
    if memory is not None:
        assert memory.num_layers == 3
        assert torch.equal(memory.rmsnorm_weight[2], torch.ones_like(memory.rmsnorm_weight[2]))
        for param in (memory.gate_proj, memory.up_proj, memory.down_proj):
            assert param.shape[0] == 3 and param[2].std().item() == pytest.approx(0.05, rel=0.1)


@pytest.mark.parametrize("arch, overrides", ALL_VARIANTS, ids=map(variant_id, ALL_VARIANTS))
def test_init_weights_sets_every_weight_of_a_model_built_on_the_meta_device(arch, overrides):
    """A model built on the meta device, moved with `to_empty` (memory holding anything) and given `init_weights()`,
    as sharded builds do, has every parameter and buffer set by `_init_weights`, as transformers' Llama has: none keeps
    what `to_empty` left, the constant ones (norm weights, biases, the rotary frequencies) equal a model built the
    usual way, the drawn ones have its std (initializer_range, KV-FFN's `kvffn_init`); the same seed draws the same
    weights twice."""
    config = tiny_config(arch, initializer_range=0.05, **overrides)
    built = build(arch, initializer_range=0.05, **overrides)
    again = build(arch, initializer_range=0.05, **overrides).state_dict()
    assert all(torch.equal(tensor, again[name]) for name, tensor in built.state_dict().items())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))
    model.init_weights()
    expected = {**dict(built.named_parameters()), **dict(built.named_buffers())}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.isnan().any(), name
        if expected[name].std() == 0 or name in dict(built.named_buffers()):
            assert torch.equal(tensor, expected[name]), name
        else:
            # (within the spread of two draws' std: the router of one head has 128 entries)
            assert tensor.std().item() == pytest.approx(expected[name].std().item(), rel=4 / tensor.numel()**0.5), name
