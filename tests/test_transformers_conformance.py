"""The properties transformers' own model tests check (`ModelTesterMixin`, `GenerationTesterMixin`), as fast tests
that run on a clean clone without transformers' test files: each runs on the four architectures and on transformers'
`LlamaForCausalLM` (the control, which must pass the same assertion). `scripts/transformers_suite.py` runs
transformers' real suite; `docs/transformers-test-suite.md` has its table.

Properties already covered elsewhere: greedy generation with and without cache, static cache, left-padded batches,
sdpa vs eager attention, gradient checkpointing (non-reentrant) and inputs_embeds (tests/test_models.py).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaForCausalLM, StaticCache

from hf_memffn.modeling_memffn import CACHE_KWARG
from hf_memffn.testing import enable_activation_checkpointing, tiny_config

ARCHS = ["flash_mhf", "memoryllm", "flex_memoryllm", "kvffn", "llama"]


def build(arch: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(arch, pad_token_id=0, **overrides)
    model = LlamaForCausalLM(config) if arch == "llama" else AutoModelForCausalLM.from_config(config)
    return model.eval()


def ids(batch=3, length=7, seed=1, vocab=320):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_round_trip_gives_the_same_logits(arch, tmp_path):
    model = build(arch)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, model(ids()).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_batching_equivalence(arch):
    """A row's logits do not depend on the other rows of its batch."""
    model = build(arch)
    batch = ids(batch=4)
    with torch.no_grad():
        together = model(batch).logits
        alone = torch.cat([model(row[None]).logits for row in batch])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_continuation_equals_one_forward(arch):
    """Prefill, then feed the rest with the cache: the same logits as one forward over everything."""
    model = build(arch)
    sequence = ids(batch=2, length=9)
    with torch.no_grad():
        full = model(sequence).logits
        cache = DynamicCache(config=model.config)
        first = model(sequence[:, :5], use_cache=True, **{CACHE_KWARG: cache})
        rest = model(sequence[:, 5:], use_cache=True, **{CACHE_KWARG: getattr(first, CACHE_KWARG)}).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_token_at_a_time_into_a_static_cache_equals_one_forward(arch):
    """A hand-written decoding loop: the first token goes into an empty static cache with no attention mask. sdpa
    ignores the causal flag for a single query, so that step needs a mask over the cache's unwritten positions."""
    model = build(arch)
    sequence = ids(batch=2, length=6)
    with torch.no_grad():
        full = model(sequence).logits
        cache = StaticCache(config=model.config, max_cache_len=16)
        steps = [model(sequence[:, i:i + 1], use_cache=True, **{CACHE_KWARG: cache}).logits for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_decoding_steps_into_a_filled_static_cache_without_positions(arch):
    """A hand-written decoding loop compiled with `fullgraph=True`: the prompt fills a static cache eagerly, then each
    compiled step passes one token and no `position_ids`. The static cache counts its tokens in a tensor, which the
    step must not branch on (the check of the length against `max_position_embeddings` did)."""
    model = build(arch)
    sequence = ids(batch=2, length=8)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            full = model(sequence).logits
            cache = StaticCache(config=model.config, max_cache_len=16)
            model(sequence[:, :4], use_cache=True, **{CACHE_KWARG: cache})
            step = torch.compile(model, backend="eager", fullgraph=True)
            steps = [step(sequence[:, i:i + 1], use_cache=True, **{CACHE_KWARG: cache}).logits for i in range(4, 8)]
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_to_keep_as_positions_or_a_mask(arch):
    """`logits_to_keep`: an int, a 1-D tensor of positions, a [batch, k] tensor of each row's positions, or a boolean
    [batch, length] mask (flattened), as transformers' models take it (the Llama control from the transformers that
    has `slice_logits_to_keep`; older ones take ints and 1-D tensors only)."""
    import transformers.modeling_utils

    if arch == "llama" and not hasattr(transformers.modeling_utils, "slice_logits_to_keep"):
        pytest.skip(f"transformers {transformers.__version__}'s Llama takes no 2-D logits_to_keep")
    model = build(arch)
    sequence = ids(batch=2, length=7)
    positions = torch.tensor([[1, 4], [6, 0]])
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 2], mask[1, 3], mask[1, 5] = True, True, True
    with torch.no_grad():
        full = model(sequence).logits
        last_two = model(sequence, logits_to_keep=2).logits
        shared = model(sequence, logits_to_keep=torch.tensor([0, 3])).logits
        per_row = model(sequence, logits_to_keep=positions).logits
        masked = model(sequence, logits_to_keep=mask).logits
    torch.testing.assert_close(last_two, full[:, -2:])
    torch.testing.assert_close(shared, full[:, [0, 3]])
    torch.testing.assert_close(per_row, torch.stack([full[0, [1, 4]], full[1, [6, 0]]]))
    torch.testing.assert_close(masked, full[mask])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_padding_embedding_row_starts_at_zero(arch):
    """The padding row gets no gradient (`padding_idx`), so it keeps its initial value: zero, as in Llama."""
    model = build(arch)
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx == 0
    assert embedding.weight[0].abs().max().item() == 0.0
    assert embedding.weight[1:].abs().max().item() > 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_does_not_change_the_logits(arch):
    model = build(arch)
    sequence = ids(batch=1, length=6)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), sequence], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        plain = model(sequence).logits
        left = model(padded, attention_mask=mask, position_ids=position_ids).logits[:, 3:]
    torch.testing.assert_close(left, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_inputs_embeds_equal_input_ids(arch):
    model = build(arch)
    sequence = ids()
    with torch.no_grad():
        from_ids = model(sequence).logits
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(sequence)).logits
    torch.testing.assert_close(from_embeds, from_ids, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_resize_token_embeddings(arch):
    model = build(arch)
    sequence = ids()
    with torch.no_grad():
        before = model(sequence).logits
    model.resize_token_embeddings(336)
    assert model.config.vocab_size == 336 and model.get_output_embeddings().weight.shape[0] == 336
    with torch.no_grad():
        after = model(torch.cat([sequence, torch.full((3, 1), 335)], dim=1)).logits
    assert after.shape[-1] == 336
    torch.testing.assert_close(after[:, :-1, :320], before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS[:4])
@pytest.mark.parametrize("arguments, named", [
    ({"new_num_tokens": 330, "pad_to_multiple_of": -8}, "pad_to_multiple_of=-8"),
    ({"new_num_tokens": 330, "pad_to_multiple_of": 0}, "pad_to_multiple_of=0"),
    ({"new_num_tokens": 330, "pad_to_multiple_of": 8.0}, "pad_to_multiple_of=8.0"),
    ({"new_num_tokens": 0}, "new_num_tokens=0"),
    ({"new_num_tokens": 330.0}, "new_num_tokens=330.0"),
    ({"new_num_tokens": 330, "mean_resizing": "no"}, "mean_resizing='no'"),
])
def test_resize_token_embeddings_refuses_bad_arguments_before_changing_anything(arch, arguments, named):
    """A `pad_to_multiple_of` of -8 shrank the vocabulary to 328 tokens where 330 were asked for (Llama's too), 0
    failed in a division, `new_num_tokens=0` left a model without a vocabulary and 330.0 failed inside torch: each is
    refused naming the argument and what it takes, with the model as it was (a `pad_to_multiple_of` of 8.0 too, which
    transformers refuses in its own words)."""
    model = build(arch)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"resize_token_embeddings: {re.escape(named)} is invalid; allowed values"):
        model.resize_token_embeddings(**arguments)
    assert model.config.vocab_size == 320 and model.get_output_embeddings().weight.shape[0] == 320
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    model.resize_token_embeddings(330, pad_to_multiple_of=8)
    assert model.config.vocab_size == 336 and model.get_input_embeddings().weight.shape[0] == 336


@pytest.mark.parametrize("arch", ARCHS[:4])
def test_a_vocabulary_shrunk_below_a_special_token_id_is_refused_before_saving(arch, tmp_path):
    """`resize_token_embeddings` to fewer tokens keeps the config's special token ids, which `from_pretrained` checks
    against the new `vocab_size`: the checkpoint would not load, so `save_pretrained` refuses it, writing nothing.
    (Llama's config only logs a warning there.) With the id set inside the vocabulary it saves and loads."""
    model = build(arch, bos_token_id=1, eos_token_id=319)
    model.resize_token_embeddings(310)
    with pytest.raises(ValueError, match=r"save_pretrained: .*`eos_token_id`=319 is invalid: token ids must be None "
                                         r"or in 0\.\.309"):
        model.save_pretrained(tmp_path / "shrunk")
    assert not (tmp_path / "shrunk").exists()
    model.config.eos_token_id = 2
    model.save_pretrained(tmp_path / "shrunk")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "shrunk").eval()
    assert loaded.config.vocab_size == 310 and loaded.get_input_embeddings().weight.shape[0] == 310
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids(vocab=310)).logits, model(ids(vocab=310)).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS[:4])
def test_a_config_saved_alone_that_would_not_load_back_is_refused_before_writing(arch, tmp_path):
    """`config.save_pretrained(folder)` (a folder of the config alone, README "Hub-ready checkpoints") wrote a field
    set by hand that `AutoConfig.from_pretrained` then refused: refused now as the model's save refuses it, with
    nothing written; set back inside the vocabulary it saves and loads."""
    from transformers import AutoConfig

    config = build(arch).config
    config.eos_token_id = config.vocab_size + 5
    with pytest.raises(ValueError, match=r"save_pretrained: the config would not load back .*`eos_token_id`=325 is "
                                         r"invalid: token ids must be None or in 0\.\.319"):
        config.save_pretrained(tmp_path / "config")
    assert not (tmp_path / "config").exists()
    config.eos_token_id = 2
    config.save_pretrained(tmp_path / "config")
    assert AutoConfig.from_pretrained(tmp_path / "config", trust_remote_code=True).eos_token_id == 2


@pytest.mark.parametrize("arch", ["memoryllm", "flex_memoryllm"])
def test_set_input_embeddings_is_refused_while_a_token_lookup_table_is_loaded(arch, tmp_path):
    """A token lookup table holds the FFNs on X0 of the embedding it was exported from: a new embedding would be read
    through the old table (silently other logits than the model computes), as a resized one would."""
    from hf_memffn.conversion import export_tols

    model = build(arch)
    export_tols(model, tmp_path, format="fp32", progress=False)
    model.load_tols(tmp_path, placement="cpu")
    embedding = model.get_input_embeddings()
    replacement = torch.nn.Embedding(320, model.config.hidden_size, padding_idx=0)
    for target in (model, model.model):
        with pytest.raises(ValueError, match=r"set_input_embeddings: a token lookup table is loaded.*unload_tols"):
            target.set_input_embeddings(replacement)
        assert model.get_input_embeddings() is embedding
    model.unload_tols()
    model.set_input_embeddings(replacement)
    assert model.get_input_embeddings() is replacement


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_kinds_give_the_same_gradients(arch, use_reentrant):
    model = build(arch).train()
    sequence = ids(batch=2)
    model(sequence, labels=sequence).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    enable_activation_checkpointing(model, {"use_reentrant": use_reentrant})
    model(sequence, labels=sequence).loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_tuple_outputs_and_selected_hidden_states(arch):
    """`return_dict=False` gives tuples (also from the base model); `output_hidden_states` and `output_attentions`
    return one entry per layer (+ embeddings) recorded the way transformers' own models record them."""
    model = build(arch)
    sequence = ids()
    with torch.no_grad():
        as_dict = model.model(sequence, output_hidden_states=True, output_attentions=True)
        as_tuple = model.model(sequence, return_dict=False, use_cache=False)
        model.set_attn_implementation("eager")
        eager = model.model(sequence, output_attentions=True)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.last_hidden_state)
    assert len(as_dict.hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(as_dict.hidden_states[-1], as_dict.last_hidden_state)
    assert len(eager.attentions) == model.config.num_hidden_layers
    assert eager.attentions[0].shape == (3, model.config.num_attention_heads, 7, 7)


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_sampling_and_assisted_decoding(arch):
    model = build(arch)
    prompt = ids(batch=2, length=5)
    mask = torch.ones_like(prompt)
    settings = dict(max_new_tokens=4, pad_token_id=0, attention_mask=mask)
    greedy = model.generate(prompt, do_sample=False, **settings)
    beams = model.generate(prompt, do_sample=False, num_beams=3, num_return_sequences=2, **settings)
    assert beams.shape == (4, 9)
    torch.manual_seed(0)
    sampled = model.generate(prompt, do_sample=True, top_k=5, **settings)
    assert sampled.shape == (2, 9)
    assistant = copy.deepcopy(model)  # the same weights: assisted greedy decoding must equal greedy decoding
    assisted = model.generate(prompt[:1], do_sample=False, assistant_model=assistant, max_new_tokens=4, pad_token_id=0)
    torch.testing.assert_close(assisted, greedy[:1])


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_lm_lists_generation_mixin_among_its_own_bases(arch):
    """GenerationTesterMixin's `test_inherits_generation_mixin`: transformers no longer lets a model generate through
    `PreTrainedModel` alone, and its suite checks that the class itself names GenerationMixin as a base."""
    model = build(arch)
    assert "GenerationMixin" in str(type(model).__bases__)
    assert model.can_generate()


def test_transformers_suite_reads_the_sources_version_and_keeps_a_cache_per_version(tmp_path, monkeypatch, capsys):
    """`scripts/transformers_suite.py`: the test files of a transformers source whose version is not the installed one
    go to a cache named after the source's version, with a warning naming both versions and the source to use."""
    import importlib.util
    import io
    import sys
    import tarfile
    import types
    from pathlib import Path

    import transformers

    spec = importlib.util.spec_from_file_location(
        "transformers_suite", Path(__file__).resolve().parent.parent / "scripts" / "transformers_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    other = "0.0.1"
    sdist = tmp_path / f"transformers-{other}.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name, text in ((suite.VERSION_FILE, f'import os\n__version__ = "{other}"\n'),
                           ("tests/test_modeling_common.py", "class ModelTesterMixin:\n    pass\n"),
                           ("tests/test_configuration_common.py", "class ConfigTester:\n    pass\n")):
            data = text.encode()
            member = tarfile.TarInfo(f"transformers-{other}/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    assert suite.source_version(sdist, None) == other
    monkeypatch.setattr(suite, "DEFAULT_CACHE", tmp_path / "cache")
    # (main() checks that transformers' test modules could import `parameterized`)
    monkeypatch.setitem(sys.modules, "parameterized", types.ModuleType("parameterized"))
    ran = []

    def run_pytest(cache, out, *args):
        ran.append(cache)
        (out / "pytest.log").write_text("ImportError: cannot import name 'a_helper' from 'transformers.testing_utils'")
        return 2  # as pytest does when collection stops, writing no junit.xml

    monkeypatch.setattr(suite, "run_pytest", run_pytest)
    assert suite.main(["--source", str(sdist), "--out", str(tmp_path / "out"), "--archs", "llama"]) == 2
    assert ran == [tmp_path / "cache" / other]
    provenance = (tmp_path / "cache" / other / "provenance.json").read_text()
    assert f'"source_version": "{other}"' in provenance
    err = capsys.readouterr().err
    assert f"holds transformers {other}'s tests, but transformers {transformers.__version__} is installed" in err
    assert f"transformers=={transformers.__version__}" in err and "cannot import name 'a_helper'" in err
    # a later run from that cache alone warns again
    suite.fill_cache(tmp_path / "cache" / other, None, None)
    assert f"holds transformers {other}'s tests" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHS[:4])
def test_llamas_mlp_bias_is_refused_rather_than_dropped(arch):
    """Llama's `mlp_bias=True` adds biases to its MLP; these FFNs have none (or KV-FFN's own, `kvffn_bias`), so a
    config asking for them is refused instead of loading a checkpoint's MLP biases as unexpected keys."""
    with pytest.raises(ValueError, match=r"`mlp_bias`=True is invalid: must be False"):
        tiny_config(arch, mlp_bias=True)
    assert not tiny_config(arch, mlp_bias=False).mlp_bias


@pytest.mark.parametrize("arch", ARCHS[:4])
@pytest.mark.parametrize("fields", [{"sliding_window": 4}, {"attention_chunk_size": 4},
                                    {"layer_types": ["sliding_attention", "full_attention"]}])
def test_a_sliding_window_or_chunked_cache_is_refused(arch, fields):
    """transformers' caches read these fields and keep only the last tokens' keys, while the decoder's attention (like
    Llama's) is full causal: decoding with such a cache would drift from a forward over the whole sequence."""
    (field, value), = fields.items()
    with pytest.raises(ValueError, match=re.escape(f"`{field}`={value!r} is invalid: must be None")):
        tiny_config(arch, **fields)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_initializer_range_of_zero_initializes_with_the_default_std(arch):
    """transformers' models read `initializer_range=0` as unset and draw their weights with std 0.02 (an all-zero
    decoder would pass no gradient)."""
    model = build(arch, initializer_range=0.0)
    layer = model.model.layers[0]
    for weight in (model.model.embed_tokens.weight, layer.self_attn.q_proj.weight, model.lm_head.weight):
        assert weight.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("arch", ARCHS[:4])
def test_attention_heads_that_do_not_divide_hidden_size_are_refused_unless_head_dim_is_given(arch):
    """Llama's config refuses a `hidden_size` that `num_attention_heads` does not divide. Here, without `head_dim`,
    the heads took hidden_size // num_attention_heads dimensions, rounded down: 6 heads of a 64-wide model made an
    attention 60 wide without a word (and 3 heads, 64 // 3 = 21, were refused as an odd `head_dim` the config was
    never given). A `head_dim` given with them still builds heads of that width."""
    for heads in (6, 3):
        with pytest.raises(ValueError, match=rf"`num_attention_heads`={heads} is invalid: must divide hidden_size=64"):
            tiny_config(arch, num_attention_heads=heads, num_key_value_heads=1)
    config = tiny_config(arch, num_attention_heads=3, num_key_value_heads=1, head_dim=22)
    assert config.head_dim == 22
    assert AutoModelForCausalLM.from_config(config).model.layers[0].self_attn.q_proj.out_features == 66


@pytest.mark.parametrize("arch", ARCHS[:4])
def test_layer_types_of_another_number_of_layers_are_refused_where_the_layers_change(arch, tmp_path):
    """`from_pretrained(path, num_hidden_layers=3)` of a checkpoint whose config lists two `layer_types` (and
    `config.num_hidden_layers = 3` set by hand) built the model, and its `save_pretrained` then failed inside
    transformers (StrictDataclassClassValidationError), leaving a folder of modeling code without weights. It is
    refused where the layers change, naming `layer_types` and how to load it; `layer_types=None` with it loads."""
    tiny_config(arch, layer_types=["full_attention"] * 2).save_pretrained(tmp_path)
    message = r"`layer_types`=\[.*\] is invalid: must be None or have one entry per layer"
    with pytest.raises(ValueError, match=message + r" \(num_hidden_layers=3\)"):
        AutoConfig.from_pretrained(tmp_path, num_hidden_layers=3)
    assert AutoConfig.from_pretrained(tmp_path, num_hidden_layers=3, layer_types=None).num_hidden_layers == 3
    config = AutoConfig.from_pretrained(tmp_path)
    config.num_hidden_layers = 3
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_config(config)
