"""Generation and loading features a user reaches for beyond plain `generate()`: prompts as `inputs_embeds`, prompt
lookup decoding, assisted decoding by a smaller model, scores and logits of `generate()`, cache implementations and
continuing from a returned cache, a batch of prompts padded by the trained tokenizer, the text-generation pipeline, a
streamer and a chat template from a saved folder, sampling several sequences, dtype round trips, sharded and tied
checkpoints, device maps that offload weights to the disk. Each runs on the four architectures and on transformers'
`LlamaForCausalLM` (the control, which must pass the same assertion).

Beam search, assisted decoding by a copy of the model, static caches, left-padded batches and `device_map="auto"`
without offloading are in tests/test_models.py and tests/test_transformers_conformance.py."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from hf_memffn.modeling_memffn import CACHE_KWARG
from hf_memffn.testing import tiny_config, tiny_tokenizer

ARCHS = ["flash_mhf", "memoryllm", "flex_memoryllm", "kvffn", "llama"]
GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)


def build(arch: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(arch, pad_token_id=0, **overrides)
    model = LlamaForCausalLM(config) if arch == "llama" else AutoModelForCausalLM.from_config(config)
    return model.eval()


def loader(arch: str):
    return LlamaForCausalLM if arch == "llama" else AutoModelForCausalLM


def prompt(batch=2, length=6, seed=1):
    return torch.randint(3, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same_weights(loaded, expected):
    got, want = loaded.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# ---------------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_from_inputs_embeds_with_and_without_input_ids(arch):
    """A prompt given as embeddings decodes as the same prompt given as ids (the new tokens only without ids), and
    the FFNs on the token embeddings read the embeddings given, also when they are no rows of the embedding table."""
    model = build(arch)
    ids = prompt()
    embeds = model.get_input_embeddings()(ids).detach()
    expected = model.generate(ids, **GREEDY)
    assert torch.equal(model.generate(inputs_embeds=embeds, **GREEDY), expected[:, ids.shape[1]:])
    assert torch.equal(model.generate(ids, inputs_embeds=embeds, **GREEDY), expected)
    assert torch.equal(model.generate(inputs_embeds=embeds, cache_implementation="static", **GREEDY),
                       expected[:, ids.shape[1]:])

    soft = embeds + 0.05 * torch.randn(embeds.shape, generator=torch.Generator().manual_seed(2))
    seen = []
    memory = getattr(getattr(model, "model", None), "memory", None)
    if memory is not None:
        memory.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    with torch.no_grad():
        last = model(inputs_embeds=soft).logits[:, -1]
    assert torch.equal(model.generate(inputs_embeds=soft, **{**GREEDY, "max_new_tokens": 1})[:, 0], last.argmax(-1))
    if memory is not None:
        assert torch.equal(seen[0], soft)


def test_generate_from_inputs_embeds_with_a_token_lookup_table_says_to_pass_input_ids(tmp_path):
    """A token lookup table is read by token id: embeddings alone, or ids with embeddings (which `generate()` feeds as
    embeddings), are refused with what to pass instead."""
    from hf_memffn.conversion import export_tols

    model = build("memoryllm")
    export_tols(model, tmp_path, format="fp32", batch_size=96, max_shard_size="50KB", progress=False)
    ids = prompt()
    embeds = model.get_input_embeddings()(ids).detach()
    expected = model.generate(ids, **GREEDY)
    model.load_tols(tmp_path, placement="cpu")
    assert torch.equal(model.generate(ids, **GREEDY), expected)
    for kwargs in ({"inputs_embeds": embeds}, {"input_ids": ids, "inputs_embeds": embeds}):
        with pytest.raises(ValueError, match=r"pass `input_ids`.*generate\(\)` given both.*unload_tols\(\)"):
            model.generate(**kwargs, **GREEDY)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_lookup_decoding_equals_greedy(arch):
    model = build(arch)
    ids = torch.cat([prompt(batch=1), prompt(batch=1)], dim=1)  # a repeated prompt, for the lookup to find n-grams
    expected = model.generate(ids, **GREEDY)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=2, **GREEDY), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_assisted_decoding_by_a_smaller_model_rolls_both_caches_back(arch, tmp_path):
    """A one-layer assistant, of the same architecture or of another, proposes tokens the model rejects: both caches
    are cropped back to the accepted tokens (`Cache.crop`) and the output stays the model's greedy one, also with a
    token lookup table loaded. (An assistant with the model's own weights, as in tests/test_transformers_conformance.py,
    has every proposal accepted: no cache loses a token.)"""
    model = build(arch)
    ids = prompt(batch=1)
    greedy = {**GREEDY, "max_new_tokens": 8}  # (steps enough for proposals to be rejected and accepted)
    expected = model.generate(ids, **greedy)
    other = "kvffn" if arch == "llama" else "llama"
    for assistant in (build(arch, num_hidden_layers=1), build(other, num_hidden_layers=1, hidden_size=32)):
        assert not torch.equal(assistant.generate(ids, **greedy), expected)  # (it proposes tokens the model rejects)
        assert torch.equal(model.generate(ids, assistant_model=assistant, **greedy), expected)
    if getattr(getattr(model, "model", None), "memory", None) is not None:  # (MemoryLLM, FlexMemoryLLM)
        from hf_memffn.conversion import export_tols

        export_tols(model, tmp_path, format="fp32", progress=False)
        model.load_tols(tmp_path, placement="cpu")
        assert torch.equal(model.generate(ids, assistant_model=assistant, **greedy), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_returns_scores_and_logits_of_each_step(arch):
    model = build(arch)
    ids = prompt()
    out = model.generate(ids, output_scores=True, output_logits=True, return_dict_in_generate=True, **GREEDY)
    assert len(out.scores) == len(out.logits) == 4
    assert out.scores[0].shape == out.logits[0].shape == (2, 320)
    with torch.no_grad():
        full = model(out.sequences).logits[:, ids.shape[1] - 1:-1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.stack(out.scores, dim=1).argmax(-1), out.sequences[:, ids.shape[1]:])


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_implementations_and_continuing_from_a_returned_cache(arch):
    model = build(arch)
    ids = prompt()
    expected = model.generate(ids, **GREEDY)
    for implementation in ("dynamic", "static"):
        assert torch.equal(model.generate(ids, cache_implementation=implementation, **GREEDY), expected)
        first = model.generate(ids, cache_implementation=implementation, return_dict_in_generate=True,
                               **{**GREEDY, "max_new_tokens": 2})
        cache = {CACHE_KWARG: getattr(first, CACHE_KWARG)}  # (`cache` since transformers 5.24)
        rest = model.generate(first.sequences, **cache, **{**GREEDY, "max_new_tokens": 2})
        assert torch.equal(rest, expected), implementation


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_padded_by_the_trained_tokenizer_generates_as_each_prompt_alone(arch, tmp_path):
    """The package's trained tokenizer, saved beside the model and reloaded with AutoTokenizer, pads a batch of prompts
    on the left, as transformers' Llama tokenizer does: `generate(**tokenizer(prompts, padding=True))` then continues
    each prompt as it continues alone. (It padded on the right: the shorter prompts were continued after their
    padding, with transformers' warning about right-padding.)"""
    model = build(arch)
    if hasattr(model, "attach_tokenizer"):
        model.attach_tokenizer(tiny_tokenizer())
    else:
        tiny_tokenizer().save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tokenizer.padding_side == "left"
    prompts = ["the key", "the memory reads a value of the layer"]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    generated = model.generate(**batch, **GREEDY)[:, batch["input_ids"].shape[1]:]
    for row, text in enumerate(prompts):
        alone = tokenizer(text, return_tensors="pt")
        assert torch.equal(generated[row], model.generate(**alone, **GREEDY)[0, alone["input_ids"].shape[1]:]), text


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize("arch", ARCHS)
def test_text_generation_pipeline_streamer_and_chat_template_from_a_saved_folder(arch, tmp_path):
    """What a user reaches through transformers' high-level API, from a folder saved with its tokenizer (and a chat
    template): the text-generation pipeline continues each prompt of a padded batch as it continues alone, its
    `return_full_text=False` is the continuation alone, `TextIteratorStreamer` yields the text `generate()` decodes,
    and a chat goes through the pipeline as its templated tokens go through `generate()`."""
    import threading

    from transformers import TextIteratorStreamer, pipeline

    model = build(arch)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    # (on the CPU also where a GPU is: a pipeline loading a folder takes the GPU, where the tiny FlashMHF model's head
    # size has no Triton kernel)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    assert type(generator.model).__name__ == type(model).__name__
    prompts = ["the key", "the memory reads a value of the layer"]
    options = dict(max_new_tokens=4, do_sample=False)
    batched = generator(prompts, batch_size=2, **options)
    assert batched == [generator(text, **options) for text in prompts]
    continuation = generator(prompts[1], return_full_text=False, **options)[0]["generated_text"]
    assert batched[1][0]["generated_text"] == prompts[1] + continuation

    chat = [{"role": "user", "content": "the memory"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**inputs, **options)[0, inputs["input_ids"].shape[1]:]
    expected = tokenizer.decode(generated, skip_special_tokens=True)
    assert generator(chat, **options)[0]["generated_text"][-1] == {"role": "assistant", "content": expected}
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    thread = threading.Thread(target=model.generate, kwargs=dict(**inputs, **options, streamer=streamer))
    thread.start()
    streamed = "".join(streamer)
    thread.join()
    assert streamed == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_several_sequences_per_prompt(arch):
    model = build(arch)
    ids = prompt()
    torch.manual_seed(0)
    out = model.generate(ids, do_sample=True, num_return_sequences=3, max_new_tokens=4, pad_token_id=0)
    assert out.shape == (6, 10)
    assert torch.equal(out[:, :6], ids.repeat_interleave(3, dim=0))


# ---------------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_checkpoint_keeps_its_dtype(arch, tmp_path):
    """Saved in bf16, every stored tensor is bf16; `dtype="auto"` and `dtype=torch.bfloat16` load it bit for bit, and
    only the rotary frequencies (non-persistent buffers, as in Llama) stay float32."""
    model = build(arch).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        assert {stored.get_tensor(key).dtype for key in stored.keys()} == {torch.bfloat16}
    for dtype in ("auto", torch.bfloat16):
        loaded = loader(arch).from_pretrained(tmp_path, dtype=dtype)
        assert loaded.dtype == torch.bfloat16
        assert_same_weights(loaded, model)
        assert {name for name, buffer in loaded.named_buffers() if buffer.dtype == torch.float32} == {
            "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_and_tied_checkpoints_reload_bit_identical(arch, tmp_path):
    model = build(arch)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    loaded = loader(arch).from_pretrained(tmp_path / "sharded")
    assert_same_weights(loaded, model)

    tied = build(arch, tie_word_embeddings=True)
    tied.save_pretrained(tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as stored:
        assert "lm_head.weight" not in stored.keys()
    loaded = loader(arch).from_pretrained(tmp_path / "tied")
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(loaded(prompt()).logits, tied(prompt()).logits)


@pytest.mark.parametrize("arch", ARCHS[:-1])
def test_generation_config_saves_with_the_checkpoint_or_is_refused_before_writing(arch, tmp_path):
    """`model.generation_config` is saved and loaded with the checkpoint. One that transformers refuses to save (a
    sampling flag without `do_sample=True`) is refused before anything is written: transformers refuses it after
    config.json and the remote code (transformers' Llama leaves config.json alone in the folder), so saved over a
    checkpoint it left that checkpoint's weights under the new config."""
    model = build(arch)
    model.generation_config.update(do_sample=True, top_k=7, max_new_tokens=3)
    model.save_pretrained(tmp_path / "model")
    loaded = loader(arch).from_pretrained(tmp_path / "model")
    assert (loaded.generation_config.do_sample, loaded.generation_config.top_k) == (True, 7)
    assert loaded.generation_config.max_new_tokens == 3

    saved = {path.name: path.read_bytes() for path in (tmp_path / "model").iterdir()}
    deeper = build(arch, num_hidden_layers=3)
    deeper.generation_config.top_k = 7  # (do_sample unset)
    for folder in (tmp_path / "model", tmp_path / "new"):
        with pytest.raises(ValueError, match=r"(?s)save_pretrained: model.generation_config would not save.*top_k"):
            deeper.save_pretrained(folder)
    # a generation parameter set on the model's config (transformers 4's habit), which transformers refuses when it
    # writes config.json: after the remote code, which it left in the folder (Llama's folder stays empty)
    on_config = build(arch, num_hidden_layers=3)
    on_config.config.max_length = 40
    for folder in (tmp_path / "model", tmp_path / "new"):
        with pytest.raises(ValueError, match=r"save_pretrained: .*model.config.*\{'max_length': 40\}.*"
                                             r"model.generation_config.max_length = 40"):
            on_config.save_pretrained(folder)
    assert {path.name: path.read_bytes() for path in (tmp_path / "model").iterdir()} == saved
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_device_map_offloading_to_the_disk(arch, tmp_path):
    """accelerate loads an offloaded module's weights only around that module's own forward: a module must not read a
    submodule's weights itself (FlashMHF's query norm)."""
    model = build(arch)
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
                  "model.layers.1": "cpu", "model.norm": "disk", "lm_head": "disk"}
    if arch in ("memoryllm", "flex_memoryllm"):
        device_map["model.memory"] = "disk"
    loaded = loader(arch).from_pretrained(tmp_path / "model", device_map=device_map,
                                          offload_folder=tmp_path / "offload")
    assert "disk" in loaded.hf_device_map.values()
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(loaded.generate(ids, **GREEDY), model.generate(ids, **GREEDY))
    for device_map in ("cpu", {"": "cpu"}):
        loaded = loader(arch).from_pretrained(tmp_path / "model", device_map=device_map)
        assert_same_weights(loaded, model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_mhf_offloaded_query_norm_on_cuda_runs_the_fused_layer(tmp_path):
    """On a GPU with layer 0 offloaded to the CPU and layer 1 to the disk, FlashMHF's fused Triton layer gets the
    queries normalised by the norm module and gives the logits and tokens of the model on the GPU alone."""
    from hf_memffn.flash_mhf_op import flash_mhf_path

    config = tiny_config("flash_mhf", hidden_size=256, num_attention_heads=4, ffn_num_heads=4, ffn_num_kv_heads=2,
                         intermediate_size=128, ffn_num_subnetworks=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "model")
    model = model.cuda()
    assert flash_mhf_path(torch.empty(1, 4, 1, 64, device="cuda")).startswith("triton")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": 0, "lm_head": 0}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                  offload_folder=tmp_path / "offload")
    ids = prompt().cuda()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(loaded.generate(ids, **GREEDY), model.generate(ids, **GREEDY))


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_counts_and_half_precision_forward(arch):
    model = build(arch)
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == total
    assert model.num_parameters(exclude_embeddings=True) == total - embedding
    assert model.get_memory_footprint(return_buffers=False) == total * 4
    ids = prompt()
    with torch.no_grad():
        expected = model(ids).logits
        half = model.to(torch.float16)(ids).logits
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), expected, rtol=0, atol=0.01)


@pytest.mark.parametrize("arch", ARCHS[:-1])
def test_a_static_cache_too_small_is_refused_naming_its_length(arch):
    """generate() given a StaticCache shorter than the prompt and the new tokens (all but the last, which is never fed
    back) is refused before the first step, naming the cache's max_cache_len and the length needed, where the cache's
    update failed inside with an index_copy_ IndexError (a device-side assert on CUDA); a cache of exactly that length
    generates as the dynamic cache does. A forward of more new tokens than the static cache holds is refused too."""
    from transformers import StaticCache

    model = build(arch)
    ids = prompt(batch=1)
    expected = model.generate(ids, **GREEDY)
    with pytest.raises(ValueError, match=r"max_cache_len=8 .* needs 9:"):
        model.generate(ids, **GREEDY, **{CACHE_KWARG: StaticCache(config=model.config, max_cache_len=8)})
    exact = StaticCache(config=model.config, max_cache_len=ids.shape[1] + GREEDY["max_new_tokens"] - 1)
    assert torch.equal(model.generate(ids, **GREEDY, **{CACHE_KWARG: exact}), expected)
    with torch.no_grad(), pytest.raises(ValueError, match=r"max_cache_len=4 .* 6 new tokens"):
        model(ids, use_cache=True, **{CACHE_KWARG: StaticCache(config=model.config, max_cache_len=4)})


@pytest.mark.parametrize("arch", ARCHS[:-1])
def test_a_cache_of_another_batch_size_is_refused_naming_both_sizes(arch):
    """A cache reused for a forward or a generate() of another number of sequences than it holds is refused naming
    both, where a dynamic cache failed inside with torch.cat's "Sizes of tensors must match" and a static one with an
    index_copy_ error; the same cache still continues its own batch."""
    from transformers import DynamicCache, StaticCache

    model = build(arch)
    ids = prompt(batch=2)
    for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=16)):
        with torch.no_grad():
            model(ids, use_cache=True, **{CACHE_KWARG: cache})
            with pytest.raises(ValueError, match=r"holds 2 sequences.* 1 sequence"):
                model(ids[:1, :2], use_cache=True, **{CACHE_KWARG: cache})
            with pytest.raises(ValueError, match=r"holds 2 sequences.* 1 sequence"):
                model.generate(ids[:1], **GREEDY, **{CACHE_KWARG: cache})
            assert model(ids[:, :1], use_cache=True, **{CACHE_KWARG: cache}).logits.shape[:2] == (2, 1)


@pytest.mark.parametrize("arch", ARCHS[:-1])
def test_generate_from_a_cache_given_only_the_new_tokens_says_to_pass_the_whole_sequence(arch):
    """generate() continuing a returned cache takes the whole sequence, the cached tokens included: given only new
    tokens, no longer than what the cache holds, it fed the model nothing, which said "input_ids is empty" of a prompt
    of two tokens (transformers' Llama fails in a reshape). The error now says what generate() takes."""
    model = build(arch)
    ids = prompt(batch=1)
    out = model.generate(ids, **GREEDY, return_dict_in_generate=True)
    cache = getattr(out, CACHE_KWARG)
    with pytest.raises(ValueError, match=r"no new token .* the whole sequence, the cached tokens included"):
        model.generate(ids[:, :2], **GREEDY, **{CACHE_KWARG: cache})
    continued = model.generate(out.sequences, **GREEDY, **{CACHE_KWARG: cache})
    assert torch.equal(continued, model.generate(out.sequences, **GREEDY))
