"""Token lookup runtime: lookup mode equals compute mode (fp32), every placement, dropping the memory FFN; the Triton
kernels against a float64 ground truth (on CUDA in this process, on CPU in a child pytest under TRITON_INTERPRET=1:
`test_lookup_kernels_under_interpreter_in_subprocess`); GPU placements and the device cache (skipped without CUDA)."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import threading
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401 (registers how ForkingPickler shares tensors)
from transformers import AutoModelForCausalLM

import hf_memffn  # noqa: F401
from hf_memffn import token_lookup_triton
from hf_memffn.conversion import export_tols
from hf_memffn.testing import (disable_activation_checkpointing, enable_activation_checkpointing, recording_backend,
                               tiny_config)
from hf_memffn.token_lookup import TokenLookupError, TokenLookupFormat, dequantize_rows, quantize_rows
from triton_interpreter import DEVICE, needs_kernels, run_under_interpreter

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def build(arch, seed=0, device="cpu", **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).to(device).eval()


def relative(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(scope="module", params=["memoryllm", "flex_memoryllm"])
def exported(request, tmp_path_factory):
    model = build(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    export_tols(model, directory, format="fp32", batch_size=96, max_shard_size="50KB", progress=False)
    return model, directory


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_fp32_lookup_equals_compute(exported, placement):
    model, directory = exported
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (3, 29), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    prompt = ids[:2, :7]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
        model.load_tols(directory, placement=placement)
        try:
            assert model.model.token_lookup.kernel == "torch"
            lookup_logits = model(input_ids=ids, attention_mask=mask).logits
            lookup_tokens = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
        finally:
            model.unload_tols()
    assert relative(lookup_logits, logits) < 1e-5
    assert torch.equal(lookup_tokens, tokens)


def lookup_graphs(model, ids) -> tuple[torch.Tensor, list]:
    """The logits of `model` on `ids` under torch.compile, and the graphs that Dynamo traced (run as traced)."""
    record, graphs = recording_backend()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            logits = torch.compile(model, backend=record, fullgraph=True)(input_ids=ids).logits
    finally:
        torch._dynamo.reset()
    return logits, graphs


def calls_the_triton_add(graphs) -> bool:
    return any("token_lookup_add" in str(node.target) for graph in graphs for node in graph.graph.nodes)


def test_compiled_lookup_is_traced_as_pytorch_operations(exported):
    """Under torch.compile the table's add is PyTorch operations that inductor can fuse (`compiled_kernel`), with
    the same logits as the eager lookup."""
    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    table = model.load_tols(directory, placement="cpu")
    try:
        assert (table.kernel, table.compiled_kernel) == ("torch", "torch")
        assert "compiled_kernel=torch" in repr(table)
        with torch.no_grad():
            eager = model(input_ids=ids).logits
        compiled, graphs = lookup_graphs(model, ids)
    finally:
        model.unload_tols()
    assert graphs and not calls_the_triton_add(graphs)
    assert relative(compiled, eager) < 1e-6


def test_float64_hidden_states_keep_their_precision_and_an_explicit_triton_kernel_refuses_them(exported,
                                                                                               monkeypatch):
    """The Triton add computes in float32: it (and the PyTorch add, through float32) rounded float64 hidden states to
    float32. "auto" (its choice on CUDA set by hand here) takes the PyTorch add for them, in float64; an explicit
    kernel="triton" refuses them, naming the dtype, as the decoder kernels do."""
    from hf_memffn import token_lookup

    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    table = model.load_tols(directory, placement="cpu")
    launched = []
    monkeypatch.setattr(token_lookup, "lookup_add_triton",
                        lambda hidden, *args, **kwargs: launched.append(hidden.dtype) or hidden)
    try:
        readout = table.readout(ids)
        hidden = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64) + 1e-9
        exact = hidden + readout.layer_values(0).double().view_as(hidden)
        torch.testing.assert_close(readout.add_into(hidden, 0), exact, rtol=0, atol=1e-15)  # kernel "torch"
        table.kernel = "triton"  # what "auto" chooses on CUDA
        torch.testing.assert_close(readout.add_into(hidden, 0), exact, rtol=0, atol=1e-15)
        readout.add_into(hidden.float(), 0)
        assert launched == [torch.float32]
        table.requested_kernel = "triton"
        with pytest.raises(RuntimeError, match=r"kernel='triton' cannot add the table into hidden states of dtype "
                                               r"torch.float64: the kernel computes in float32; allowed: float16"):
            readout.add_into(hidden, 0)
    finally:
        model.unload_tols()


def test_an_explicit_triton_kernel_refuses_hidden_states_on_another_device(exported):
    """A layer that a device map puts on another device than the table's adds its values by PyTorch operations (the
    Triton add reads both on one device): "auto" does, where kernel="triton" did too while `table.kernel` said
    "triton"; it refuses, naming both devices and the settings that run. (The meta device stands for another GPU.)"""
    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    table = model.load_tols(directory, placement="cpu")
    try:
        readout = table.readout(ids)
        hidden = torch.empty(2, 5, model.config.hidden_size, device="meta")
        table.kernel = "triton"  # what "auto" chooses on CUDA
        assert readout.add_into(hidden, 0).device.type == "meta"
        table.requested_kernel = "triton"
        with pytest.raises(RuntimeError, match=r"kernel='triton' cannot add the table into hidden states on meta: the "
                                               r"table's rows are on cpu.*kernel='auto'.*or 'torch'"):
            readout.add_into(hidden, 0)
    finally:
        model.unload_tols()


def test_triton_add_runs_and_passes_the_gradient_when_the_layers_around_the_table_train(exported, monkeypatch):
    """Training the layers around a loaded table (its embedding and FFNs on X0 frozen) records gradients of the
    hidden states: under kernel="triton" (set by hand, as on CUDA) the Triton add ran anyway, passing the hidden
    state's gradient through unchanged, where it ran PyTorch operations while `table.kernel` said "triton". The
    kernel's launch is replaced by the same sum in PyTorch here; its real launch is checked against float64 in the
    kernel tests."""
    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))
    launched = []

    def launch_stand_in(hidden, row_ids, rows, scales, layer_position, hidden_size, fmt, group_size):
        launched.append(layer_position)
        values = rows.index_select(0, row_ids)[:, layer_position * hidden_size:(layer_position + 1) * hidden_size]
        return (hidden.float() + values.float().reshape(hidden.shape)).to(hidden.dtype)

    monkeypatch.setattr(token_lookup_triton, "_launch_lookup_add", launch_stand_in)
    model.model.embed_tokens.requires_grad_(False)
    model.model.memory.requires_grad_(False)
    table = model.load_tols(directory, placement="cpu")
    try:
        readout = table.readout(ids)
        hidden = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
        expected = readout.add_into(hidden, 0)  # kernel "torch"
        table.kernel = table.requested_kernel = "triton"
        out = readout.add_into(hidden, 0)
        assert launched == [0] and out.requires_grad and out.shape == hidden.shape and out._base is None
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        grad_out = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, hidden, grad_out)
        assert torch.equal(grad, grad_out)
        launched.clear()
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        assert launched and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    finally:
        model.unload_tols()
        model.eval().zero_grad(set_to_none=True)
        model.requires_grad_(True)


def test_triton_kernel_functions_refuse_float64_naming_the_argument():
    """The element-wise kernels compute in float32: called directly with float64 tensors they returned float64
    results of float32 precision. They refuse them, naming the function, the argument and the dtypes they take."""
    from hf_memffn.token_lookup_triton import HAS_TRITON, lookup_add_triton

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    hidden = torch.zeros(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"lookup_add_triton: hidden has dtype torch.float64, which the Triton "
                                         r"kernels do not take .*allowed: float16, bfloat16, float32"):
        lookup_add_triton(hidden, torch.tensor([0, 1, 0]), torch.zeros(2, 8), None, 0, 8, "fp32", 1)


def test_compiled_lookup_from_disk_breaks_the_graph_and_fullgraph_names_the_placement(exported):
    """placement="disk" reads its rows on the host at every forward: torch.compile runs that read between two graphs
    (the logits of eager mode), and fullgraph=True fails naming the placement and what works instead (not with
    dynamo's data-dependent guard error)."""
    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model.load_tols(directory, placement="disk")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model(input_ids=ids).logits
            compiled = torch.compile(model, backend="eager")(input_ids=ids).logits
            torch._dynamo.reset()
            with pytest.raises(RuntimeError, match="placement='disk' reads its rows") as refused:
                torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids)
    finally:
        model.unload_tols()
        torch._dynamo.reset()
    assert relative(compiled, eager) < 1e-6
    assert all(name in str(refused.value) for name in ("without fullgraph", "placement='gpu'", "placement='cpu'"))


def test_torch_export_exports_a_table_in_host_memory_and_refuses_one_on_disk_naming_the_placement(exported):
    """torch.export (non-strict, its default) of a model reading its table: `cpu` placement exports, the table's rows
    the program's weights, and the program computes the eager logits at another shape; `disk` placement, whose rows
    are read on the host at every forward, ended in a `GuardOnDataDependentSymNode` from inside those reads naming
    neither the table nor a way out: it is refused naming the placement and the ones that export."""
    model, directory = exported
    example = torch.randint(0, model.config.vocab_size, (2, 9))
    other = torch.randint(0, model.config.vocab_size, (3, 5))
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}, None)
    try:
        model.load_tols(directory, placement="cpu")
        with torch.no_grad():
            program = torch.export.export(model, (example,), {"use_cache": False}, dynamic_shapes=dims)
            torch.testing.assert_close(program.module()(other, use_cache=False).logits,
                                       model(other, use_cache=False).logits)
        model.unload_tols()
        model.load_tols(directory, placement="disk")
        with pytest.raises(ValueError, match=r"placement='disk' .* torch\.export cannot trace .* placement='cpu'"):
            torch.export.export(model, (example,), {"use_cache": False}, dynamic_shapes=dims)
    finally:
        model.unload_tols()


def test_drop_memory_ffn_frees_weights_and_keeps_outputs(exported):
    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 11))
    with torch.no_grad():
        reference = fresh(input_ids=ids).logits
    counts = fresh.parameter_counts()
    with pytest.raises(ValueError, match="load_tols"):
        fresh.drop_memory_ffn()
    fresh.load_tols(directory, placement="cpu", drop_memory_ffn=True)
    assert fresh.model.memory is None
    assert sum(p.numel() for p in fresh.parameters()) == counts["active"]
    assert not any("memory." in k or "token_lookup" in k for k in fresh.state_dict())
    with torch.no_grad():
        assert relative(fresh(input_ids=ids).logits, reference) < 1e-5
    with pytest.raises(ValueError, match="dropped"):
        fresh.unload_tols()
    fresh.load_tols(directory, placement="disk")  # the fingerprint kept at drop time still checks tables
    fresh.model.token_lookup = None
    with pytest.raises(RuntimeError, match="drop_memory_ffn"):
        fresh(input_ids=ids)


def test_parameter_counts_keep_the_model_size_as_trained_after_drop_memory_ffn(exported):
    """Dropping the FFNs on X0 for a table changes neither count: "total" is the model's size as trained (the dropped
    FFNs included), "active" what is left on the device; for the causal LM and its base model alike."""
    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    counts, base_counts = fresh.parameter_counts(), fresh.model.parameter_counts()
    assert counts["total"] > counts["active"]
    fresh.load_tols(directory, placement="cpu", drop_memory_ffn=True)
    assert fresh.parameter_counts() == counts
    assert fresh.model.parameter_counts() == base_counts
    assert sum(p.numel() for p in fresh.parameters()) == counts["active"]


def test_a_model_offloaded_to_disk_by_a_device_map_takes_and_exports_tables(exported, tmp_path):
    """With the token embedding and the FFNs on X0 offloaded to the disk (`device_map`, their weights on the meta
    device between forwards), `load_tols` checks the table against the stored weights and places it where the
    embedding computes; a table exported from that model, some layers dropped, equals the whole model's."""
    model, directory = exported
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "disk", "model.memory": "disk", "model.rotary_emb": "cpu",
                  "model.layers": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                     offload_folder=tmp_path / "offload").eval()
    assert offloaded.model.memory.down_proj.device.type == "meta"
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        table = offloaded.load_tols(directory, placement="cpu")
        assert table.device == torch.device("cpu")
        assert relative(offloaded(input_ids=ids).logits, reference) < 1e-5
    offloaded.unload_tols()
    export_tols(offloaded, tmp_path / "offloaded", format="fp32", drop_layers=(0,), progress=False)
    export_tols(model, tmp_path / "whole", format="fp32", drop_layers=(0,), progress=False)
    logits = {}
    for name in ("offloaded", "whole"):
        model.load_tols(tmp_path / name, placement="cpu")
        try:
            with torch.no_grad():
                logits[name] = model(input_ids=ids).logits
        finally:
            model.unload_tols()
    torch.testing.assert_close(logits["offloaded"], logits["whole"], rtol=0, atol=0)


def test_training_the_weights_a_table_replaces_is_refused(exported):
    """In training, a loaded table would leave the FFNs on X0 (and X0 through them) without gradients: refused while
    the embedding or the memory FFN requires gradients; with both frozen the rest trains (LoRA, heads)."""
    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    fresh.load_tols(directory, placement="cpu")
    fresh.train()
    try:
        with pytest.raises(ValueError, match=r"embed_tokens and memory require gradients.*unload_tols\(\)"):
            fresh(input_ids=ids, labels=ids)
        fresh.model.memory.requires_grad_(False)
        with pytest.raises(ValueError, match=r"parameters of embed_tokens require gradients"):
            fresh(input_ids=ids, labels=ids)
        fresh.model.embed_tokens.requires_grad_(False)
        fresh(input_ids=ids, labels=ids).loss.backward()
        assert fresh.lm_head.weight.grad is not None
        fresh.model.embed_tokens.requires_grad_(True)
        fresh.eval()  # inference with gradients enabled (attributions) reads the table as before
        fresh(input_ids=ids).logits.sum().backward()
    finally:
        fresh.unload_tols()
    fresh.train()
    fresh(input_ids=ids, labels=ids).loss.backward()  # computing the memory FFN again, it trains


def test_loading_other_weights_for_what_a_loaded_table_replaces_is_refused(exported):
    """A table holds the FFNs on X0 of the weights it was exported from: `load_state_dict` of another embedding or
    memory FFN (under the model's names or the checkpoint's `norm_weight`, into the causal LM or its base model) would
    leave the model reading an out-of-date table, so it is refused before any weight changes. The same weights (a
    Trainer resuming) and other weights (attention, head) load; without a table, anything loads."""
    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    saved = {name: tensor.clone() for name, tensor in fresh.state_dict().items()}
    other = {name: tensor + 0.01 for name, tensor in saved.items()}
    fresh.load_tols(directory, placement="cpu")
    try:
        with pytest.raises(TokenLookupError, match=r"load_state_dict.*model\.embed_tokens\.weight.*unload_tols\(\)"):
            fresh.load_state_dict(other)
        assert all(torch.equal(tensor, saved[name]) for name, tensor in fresh.state_dict().items())
        with pytest.raises(TokenLookupError, match=r"model\.memory\.norm_weight"):
            fresh.load_state_dict({"model.memory.norm_weight": other["model.memory.rmsnorm_weight"]}, strict=False)
        with pytest.raises(TokenLookupError, match=r"memory\.down_proj"):
            fresh.model.load_state_dict({"memory.down_proj": other["model.memory.down_proj"]}, strict=False)
        fresh.load_state_dict(saved)
        fresh.load_state_dict({name: tensor for name, tensor in other.items()
                               if "embed_tokens" not in name and ".memory." not in name}, strict=False)
        with torch.no_grad():
            lookup = fresh(input_ids=ids).logits
    finally:
        fresh.unload_tols()
    with torch.no_grad():
        assert relative(lookup, fresh(input_ids=ids).logits) < 1e-5
    fresh.load_state_dict(other)


def test_loading_a_tied_output_head_while_a_table_is_loaded_is_refused(tmp_path):
    """With tied embeddings `lm_head.weight` is the token embedding's weight: loading another one (as Llama does, it
    changes the embedding too) left a loaded table holding the FFNs on X0 of the old embedding without a word. It is
    refused as the embedding is, before any weight changes; the same values load."""
    model = build("memoryllm", tie_word_embeddings=True)
    export_tols(model, tmp_path, format="fp32", progress=False)
    model.load_tols(tmp_path, placement="cpu")
    saved = model.lm_head.weight.detach().clone()
    try:
        with pytest.raises(TokenLookupError, match=r"load_state_dict.*lm_head\.weight.*unload_tols\(\)"):
            model.load_state_dict({"lm_head.weight": saved + 0.5}, strict=False)
        assert torch.equal(model.model.embed_tokens.weight, saved)
        model.load_state_dict({"lm_head.weight": saved.clone()}, strict=False)
    finally:
        model.unload_tols()
    model.load_state_dict({"lm_head.weight": saved + 0.5}, strict=False)
    assert torch.equal(model.model.embed_tokens.weight, saved + 0.5)


@pytest.mark.parametrize("arch", ["memoryllm", "flex_memoryllm"])
def test_a_table_exported_after_resize_token_embeddings_covers_the_new_tokens(arch, tmp_path):
    """Added tokens (`resize_token_embeddings`, padded to a multiple of 8) get rows in a table exported afterwards,
    read as the model computes them; the table of the vocabulary before is refused naming both sizes."""
    model = build(arch)
    export_tols(model, tmp_path / "before", format="fp32", progress=False)
    model.resize_token_embeddings(330, pad_to_multiple_of=8)
    with pytest.raises(TokenLookupError, match=r"has vocab_size=320 but the model has vocab_size=336"):
        model.load_tols(tmp_path / "before", placement="cpu")
    export_tols(model, tmp_path / "after", format="fp32", progress=False)
    ids = torch.tensor([[5, 320, 331, 335, 7]])
    with torch.no_grad():
        computed = model(ids).logits
        model.load_tols(tmp_path / "after", placement="cpu")
        assert relative(model(ids).logits, computed) < 1e-5


@pytest.mark.parametrize("rows", [400, 300])
def test_an_embedding_set_to_another_size_than_the_vocabulary_is_refused_by_export_and_load_tols(rows, tmp_path):
    """`set_input_embeddings` with an embedding of another size leaves `config.vocab_size` as it was (as in Llama),
    and a table has `config.vocab_size` rows: with 400 rows the export wrote 320, load_tols took them and the forward
    failed with an IndexError inside the lookup on ids the embedding takes; with 300 the export failed with one.
    Both refuse, naming both sizes and `resize_token_embeddings`, which keeps them in step; after it both work."""
    model = build("memoryllm")
    export_tols(model, tmp_path / "before", format="fp32", progress=False)
    model.set_input_embeddings(torch.nn.Embedding(rows, model.config.hidden_size))
    sizes = rf"the token embedding has {rows} rows but config\.vocab_size=320.*resize_token_embeddings\({rows}\)"
    with pytest.raises(ValueError, match=rf"export-tols: {sizes}"):
        export_tols(model, tmp_path / "table", format="fp32", progress=False)
    assert not list((tmp_path / "table").glob("token_lookup*"))
    with pytest.raises(TokenLookupError, match=sizes):
        model.load_tols(tmp_path / "before", placement="cpu")
    assert model.model.token_lookup is None
    model.resize_token_embeddings(rows)
    export_tols(model, tmp_path / "table", format="fp32", progress=False)
    ids = torch.tensor([[5, rows - 1, 7]])
    with torch.no_grad():
        computed = model(ids).logits
        model.load_tols(tmp_path / "table", placement="cpu")
        assert relative(model(ids).logits, computed) < 1e-5


def test_resizing_to_the_size_the_vocabulary_has_is_taken_while_a_table_is_loaded(exported):
    """`resize_token_embeddings(len(tokenizer))` with a tokenizer of the model's size, or without arguments (which
    returns the embedding), changes nothing, as in Llama: it was refused while a table is loaded, as was
    `set_input_embeddings` with the embedding the model has. A resize to another size is still refused, before
    anything changes."""
    model, directory = exported
    model.load_tols(directory, placement="cpu")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ids = torch.tensor([[5, 319, 7]])
    try:
        with torch.no_grad():
            before = model(ids).logits
        assert model.resize_token_embeddings() is embedding
        assert model.resize_token_embeddings(320) is embedding
        assert model.resize_token_embeddings(319, pad_to_multiple_of=64) is embedding
        model.set_input_embeddings(embedding)
        with pytest.raises(ValueError, match=r"resize_token_embeddings: a token lookup table is loaded.*unload_tols"):
            model.resize_token_embeddings(321)
        with pytest.raises(ValueError, match=r"resize_token_embeddings: a token lookup table is loaded.*unload_tols"):
            model.resize_token_embeddings(320, pad_to_multiple_of=128)
        assert model.get_input_embeddings() is embedding and model.get_output_embeddings() is head
        assert model.config.vocab_size == 320 and model.model.token_lookup is not None
        torch.testing.assert_close(model.state_dict(), weights, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    finally:
        model.unload_tols()


def test_an_adapter_on_the_token_embedding_is_refused_with_a_table(exported):
    """PEFT's LoRA on `embed_tokens` changes X0, which a table computed from the embedding's weight does not see: a
    table is refused while the adapter is on the embedding (it was taken, and its logits differed from the computed
    model's without a word), and training that adapter with a table loaded is refused like training the weight."""
    from peft import LoraConfig, get_peft_model

    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    adapted = get_peft_model(build(model.config.model_type.replace("memffn_", "")),
                             LoraConfig(target_modules=["embed_tokens"], r=4, init_lora_weights=False))
    with pytest.raises(TokenLookupError, match=r"lora_embedding_A.*merge_and_unload"):
        adapted.load_tols(directory, placement="cpu")
    assert adapted.base_model.model.model.token_lookup is None
    frozen_embedding = build(model.config.model_type.replace("memffn_", ""))
    frozen_embedding.load_tols(directory, placement="cpu")
    frozen_embedding.requires_grad_(False)
    adapted = get_peft_model(frozen_embedding, LoraConfig(target_modules=["embed_tokens"], r=4))
    adapted.train()
    with pytest.raises(ValueError, match=r"parameters of embed_tokens require gradients"):
        adapted(input_ids=ids, labels=ids)
    merged = get_peft_model(build(model.config.model_type.replace("memffn_", "")),
                            LoraConfig(target_modules=["embed_tokens"], r=4)).merge_and_unload()
    merged.load_tols(directory, placement="cpu")  # the adapter starts at zero: the merged weight is the exported one


@pytest.mark.parametrize("adapter", [
    {"target_modules": ["embed_tokens"], "init_lora_weights": False},
    {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]},
], ids=["lora", "modules_to_save"])
def test_an_adapter_put_on_the_token_embedding_after_load_tols_is_refused_at_inference(exported, adapter):
    """An adapter on `embed_tokens` added once the table is loaded (`get_peft_model`, `load_adapter`) changes X0, which
    the table does not see: in inference too (eval mode, no gradients) the forward is refused, naming the adapter,
    where it read the table and gave logits other than the computed model's without a word."""
    from peft import LoraConfig, get_peft_model

    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    loaded = build(model.config.model_type.replace("memffn_", ""))
    loaded.load_tols(directory, placement="cpu")
    adapted = get_peft_model(loaded, LoraConfig(r=4, **adapter)).eval()
    with torch.no_grad(), pytest.raises(TokenLookupError, match=r"(lora_embedding_A|original_module).*unload_tols"):
        adapted(input_ids=ids)
    adapted.unload_tols()
    with torch.no_grad():
        adapted(input_ids=ids)  # computing the FFNs on X0 from the adapted embedding


def test_bad_runtime_options_name_the_field(exported):
    model, directory = exported
    with pytest.raises(ValueError, match="placement"):
        model.load_tols(directory, placement="tpu")
    with pytest.raises(ValueError, match="verify"):
        model.load_tols(directory, placement="cpu", verify="quick")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="placement='gpu'"):
            model.load_tols(directory, placement="gpu")
        with pytest.raises(ValueError, match="kernel='triton'"):
            model.load_tols(directory, placement="cpu", kernel="triton")
    assert model.model.token_lookup is None


def test_a_lowrank_table_refuses_the_triton_kernel_it_does_not_run(tmp_path):
    """A low-rank table's values are PyTorch operations (coefficients times a basis): kernel="triton" is refused where
    no Triton kernel runs (placements gpu and disk, on any device, before the table is read), and `table.kernel`
    says "torch" there under "auto" (it said "triton" on a GPU while PyTorch ran)."""
    model = build("memoryllm")
    export_tols(model, tmp_path, format="lowrank", rank=8, batch_size=64, progress=False)
    for placement in ("gpu", "disk"):
        with pytest.raises(ValueError, match=rf"kernel='triton' does not apply to a lowrank table with "
                                             rf"placement='{placement}'.*use kernel='auto' or 'torch'"):
            model.load_tols(tmp_path, placement=placement, kernel="triton")
        assert model.model.token_lookup is None
    table = model.load_tols(tmp_path, placement="disk")
    assert (table.kernel, table.compiled_kernel) == ("torch", "torch")
    model.unload_tols()


@pytest.mark.parametrize("placement", ["cpu", "disk"])
@pytest.mark.parametrize("options, message", [
    ({"frequent_tokens": [3, 7, 320]}, r"frequent_tokens contains token id 320: allowed ids are 0\.\.319"),
    ({"frequent_tokens": torch.tensor([-1, 5])}, r"frequent_tokens contains token id -1: allowed ids are 0\.\.319"),
    ({"frequent_tokens": [1.5, 2.0]}, r"frequent_tokens takes integer token ids; got dtype torch.float32"),
    ({"cache_rows": -8}, r"cache_rows=-8 must be >= 0"),
    ({"cache_rows": 64.5}, r"cache_rows takes integers; got 64.5"),
], ids=["past_the_vocabulary", "negative", "not_integers", "negative_cache", "fractional_cache"])
def test_cache_options_are_checked_on_every_device(exported, placement, options, message):
    """Bad device cache options of the cpu and disk placements are refused on a machine without a GPU too, where no
    cache is built (they were taken there without a word), naming the option, the id and the allowed range."""
    model, directory = exported
    with pytest.raises(ValueError, match=message):
        model.load_tols(directory, placement=placement, **options)
    assert model.model.token_lookup is None


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_no_device_cache_is_taken_by_both_placements_on_every_device(exported, placement, monkeypatch):
    """cache_rows=0 (no device cache) was taken by placement="disk" on a CPU but refused on a GPU, where "cpu" took
    it: one rule now (`device_cache_rows`, asked here for a CUDA device too), and the table reads every row without a
    cache, equal to compute mode. `cache_rows` is checked once (`checked_cache_rows`, before the table is read):
    `device_cache_rows` checked it a second time."""
    from hf_memffn import token_lookup
    from hf_memffn.token_lookup import device_cache_rows

    model, directory = exported
    vocab_size = model.config.vocab_size
    assert device_cache_rows(0, torch.device("cuda", 0), vocab_size) == 0
    assert device_cache_rows(vocab_size + 5, torch.device("cuda", 0), vocab_size) == vocab_size
    assert device_cache_rows(64, torch.device("cpu"), vocab_size) == 0
    with pytest.raises(ValueError, match=r"cache_rows=-1 must be >= 0"):
        token_lookup.checked_cache_rows(-1)
    checks = []
    checked_cache_rows = token_lookup.checked_cache_rows
    monkeypatch.setattr(token_lookup, "checked_cache_rows",
                        lambda rows: checks.append(rows) or checked_cache_rows(rows))
    ids = torch.randint(0, vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        table = model.load_tols(directory, placement=placement, cache_rows=0)
        assert checks == [0]
        try:
            assert not table.use_cache
            lookup_logits = model(input_ids=ids).logits
        finally:
            model.unload_tols()
    assert relative(lookup_logits, logits) < 1e-5


@pytest.mark.parametrize("placement", ["cpu", "disk"])
@pytest.mark.parametrize("frequent_tokens", [[], (), torch.tensor([], dtype=torch.long)],
                         ids=["list", "tuple", "tensor"])
def test_an_empty_frequent_tokens_is_taken_as_no_frequent_tokens(exported, placement, frequent_tokens):
    """No frequent tokens, however given: an empty list or tuple (which `torch.as_tensor` makes float32) was refused
    as "takes integer token ids; got dtype torch.float32", where an empty tensor was taken."""
    model, directory = exported
    table = model.load_tols(directory, placement=placement, frequent_tokens=frequent_tokens)
    model.unload_tols()
    assert table.placement == placement


@pytest.mark.skipif(not token_lookup_triton.HAS_TRITON, reason="needs triton")
def test_triton_lookup_launchers_refuse_tensors_that_are_not_contiguous_or_on_another_device():
    ids, hidden, table = torch.tensor([1, 2]), torch.randn(2, 8), torch.randn(4, 24)
    with pytest.raises(ValueError, match=r"hidden must be contiguous \[\.\.\., hidden_size\]; got strides \(1, 2\)"):
        token_lookup_triton.lookup_add_triton(hidden.t().contiguous().t(), ids, table, None, 0, 8, "fp32", 1)
    with pytest.raises(ValueError, match=r"table must be a contiguous 2-D tensor; got shape \(4, 8\)"):
        token_lookup_triton.gather_rows_triton(ids, None, None, table[:, :8])
    with pytest.raises(ValueError, match="hidden is on meta but the table's rows are on cpu"):
        token_lookup_triton.lookup_add_triton(hidden.to("meta"), ids, table, None, 0, 8, "fp32", 1)


@pytest.mark.skipif(not token_lookup_triton.HAS_TRITON, reason="needs triton")
def test_triton_lookup_add_refuses_rows_and_scales_whose_columns_are_not_adjacent():
    """The lookup-add kernel takes the table's row stride but reads each row's columns one after another: rows or
    scales whose columns are strided (every other column of a wider buffer, a transposed table) are refused by name
    before anything is launched, not read as the wrong values."""
    ids, hidden = torch.tensor([1, 3, 0]), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"rows must be a 2-D tensor whose columns are adjacent in memory \(stride "
                                         r"1\); got shape \(4, 24\), strides \(48, 2\)"):
        token_lookup_triton.lookup_add_triton(hidden, ids, torch.randn(4, 48)[:, ::2], None, 1, 8, "fp32", 1)
    with pytest.raises(ValueError, match=r"rows must be .* strides \(1, 4\)"):
        token_lookup_triton.lookup_add_triton(hidden, ids, torch.randn(24, 4).t(), None, 1, 8, "fp32", 1)
    rows = torch.randint(-8, 8, (4, 24), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"scales must be .* got shape \(4, 6\), strides \(12, 2\)"):
        token_lookup_triton.lookup_add_triton(hidden, ids, rows, torch.rand(4, 12)[:, ::2], 1, 8, "int8", 4)


@pytest.mark.skipif(not token_lookup_triton.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("change, message", [
    (dict(row_ids=torch.tensor([1, 4, 0])), r"row_ids contains id 4: allowed ids are 0\.\.3"),
    (dict(row_ids=torch.tensor([1, -1, 0])), r"row_ids contains id -1: allowed ids are 0\.\.3"),
    (dict(row_ids=torch.tensor([1.0, 3.0, 0.0])), r"row_ids must be a 1-D tensor .* dtype int32 or int64; got shape "
                                                   r"\(3,\), dtype torch.float32"),
    (dict(row_ids=torch.tensor([1, 3])), r"row_ids must be a 1-D tensor of one id per token of hidden \(3\)"),
    (dict(row_ids=torch.tensor([[1, 3, 0]])), r"got shape \(1, 3\)"),
    (dict(hidden=torch.randn(3, 6)), r"hidden must be \[\.\.\., hidden_size=8\] .*; got shape \(3, 6\)"),
    (dict(hidden=torch.randn(24)), r"hidden must be \[\.\.\., hidden_size=8\] with at least one leading dimension; "
                                   r"got shape \(24,\)"),
    (dict(hidden=torch.randn(2, 3, 8)), r"row_ids must be a 1-D tensor of one id per token of hidden \(6\)"),
    (dict(layer_position=3), r"layer_position=3 is outside the layers of rows of shape \(4, 24\) .*allowed 0\.\.2"),
    (dict(layer_position=-1), r"layer_position=-1 is outside .* allowed 0\.\.2"),
    (dict(format_name="int2"), r"format_name='int2' is not one of \('fp32', 'fp16', 'bf16', 'int8', 'int4'\)"),
    (dict(scales=torch.ones(4, 6)), r"scales must be None for format 'fp32'"),
    (dict(format_name="int8", group_size=4), r"rows of format 'int8' must have dtype torch.int8; got torch.float32"),
    (dict(format_name="int8", rows=torch.zeros(4, 24, dtype=torch.int8)), r"format 'int8' needs scales.*got None"),
    (dict(format_name="int8", rows=torch.zeros(4, 24, dtype=torch.int8), scales=torch.ones(4, 8), group_size=3),
     r"group_size=3 must be a positive divisor of hidden_size=8"),
    (dict(format_name="int8", rows=torch.zeros(4, 24, dtype=torch.int8), scales=torch.ones(4, 4), group_size=4,
          layer_position=2), r"scales of shape \(4, 4\) on cpu do not fit rows of shape \(4, 24\)"),
    (dict(format_name="int4", rows=torch.zeros(4, 12, dtype=torch.int8), scales=torch.ones(4, 6), group_size=4),
     r"rows of format 'int4' must have dtype torch.uint8"),
], ids=["id_too_large", "id_negative", "float_ids", "too_few_ids", "ids_2d", "narrower_hidden", "hidden_1d",
        "hidden_3d_too_few_ids",
        "layer_too_large", "layer_negative", "unknown_format", "scales_with_float_rows", "int8_float_rows",
        "int8_no_scales", "group_not_dividing", "scales_too_narrow", "int4_signed_rows"])
def test_triton_lookup_add_refuses_arguments_that_do_not_fit_naming_the_argument(change, message):
    """Called directly, the add refuses by name what its kernel would read or write outside its tensors or misread
    (an id past the table or negative, a hidden state of another width, a layer past the rows, scales missing or
    left over, a group size that does not divide the width) before anything is launched: it read another token's row
    or another process's memory, wrote past its output, or added a float table's values as int8 ones. Ids in host
    memory are checked on the host (no device synchronisation)."""
    arguments = dict(hidden=torch.randn(3, 8), row_ids=torch.tensor([1, 3, 0]), rows=torch.randn(4, 24), scales=None,
                     layer_position=1, hidden_size=8, format_name="fp32", group_size=1)
    with pytest.raises(ValueError, match=message):
        token_lookup_triton.lookup_add_triton(**{**arguments, **change})


@pytest.mark.skipif(not token_lookup_triton.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("change, message", [
    (dict(token_ids=torch.tensor([1, 4])), r"token_ids contains id 4: allowed ids are 0\.\.3"),
    (dict(token_ids=torch.tensor([-1, 2])), r"token_ids contains id -1: allowed ids are 0\.\.3"),
    (dict(token_ids=torch.tensor([[1, 2]])), r"token_ids must be a 1-D tensor of dtype int32 or int64 .*got shape "
                                             r"\(1, 2\)"),
    (dict(token_ids=torch.tensor([1.0, 2.0])), r"token_ids must be .* dtype torch.float32 on cpu"),
    (dict(cache=None), r"slot_of_token and cache must be given together"),
    (dict(cache=torch.randn(2, 8)), r"cache \(2, 8\) torch.float32 on cpu do not fit table \(4, 16\)"),
    (dict(cache=torch.randn(2, 16).half()), r"cache \(2, 16\) torch.float16 on cpu do not fit table"),
    (dict(slot_of_token=torch.tensor([-1, 0], dtype=torch.int32)), r"slot_of_token \(2,\) torch.int32 on cpu .*do not "
                                                                     r"fit table \(4, 16\)"),
    (dict(slot_of_token=torch.tensor([-1, 2, -1, 0], dtype=torch.int32)),
     r"slot_of_token holds slot 2 for a token asked for: allowed slots are negative \(not cached\) and 0\.\.1"),
], ids=["id_too_large", "id_negative", "ids_2d", "float_ids", "slots_without_cache", "narrower_cache",
        "cache_of_another_dtype", "slots_not_per_table_row", "slot_past_the_cache"])
def test_triton_lookup_gather_refuses_arguments_that_do_not_fit_naming_the_argument(change, message):
    """The gather, called directly, refuses by name an id past the table, a slot past the cache, a cache of another
    width or dtype and slots without a cache (read as rows of another token, of memory past the cache, or a crash
    inside the launch) before anything is launched."""
    arguments = dict(token_ids=torch.tensor([1, 2]), slot_of_token=torch.tensor([-1, 1, -1, 0], dtype=torch.int32),
                     cache=torch.randn(2, 16), table=torch.randn(4, 16))
    with pytest.raises(ValueError, match=message):
        token_lookup_triton.gather_rows_triton(**{**arguments, **change})


def test_a_table_stays_as_placed_when_the_model_is_cast_or_moved(exported, tmp_path):
    """`.to(torch.bfloat16)` after `load_tols` leaves the table's dtypes as stored (the same model as casting first,
    then loading); a move to another device is refused before any parameter moves."""
    model, directory = exported
    cast_after = build(model.config.model_type.replace("memffn_", ""))
    table = cast_after.load_tols(directory, placement="cpu")
    dtypes = {name: buffer.dtype for name, buffer in table.named_buffers()}
    cast_after.to(torch.bfloat16)
    assert {name: buffer.dtype for name, buffer in table.named_buffers()} == dtypes == {"rows": torch.float32}
    cast_first = build(model.config.model_type.replace("memffn_", "")).to(torch.bfloat16)
    cast_first.load_tols(directory, placement="cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(cast_after(input_ids=ids).logits, cast_first(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="placed for cpu by load_tols.*moved to meta.*unload_tols"):
        cast_after.to("meta")
    assert all(param.device.type == "cpu" for param in cast_after.parameters())
    cast_after.unload_tols()
    assert cast_after.to("meta").lm_head.weight.device.type == "meta"


def test_to_empty_while_a_table_is_loaded_is_refused_before_any_weight_changes(exported):
    """`to_empty` on the table's device (which the move check lets through) left the token embedding and the FFNs on
    X0 uninitialised while the table kept the FFNs on X0 of their old values. Refused as a move is, before anything
    changes, naming the way out, also through a module around the model (PEFT's wrapper, FSDP's root) and once the
    FFNs on X0 are dropped; `share_memory()` keeps the values and runs; without a table `to_empty` runs."""
    model, directory = exported
    arch = model.config.model_type.replace("memffn_", "")
    fresh = build(arch)
    saved = {name: tensor.clone() for name, tensor in fresh.state_dict().items()}
    fresh.load_tols(directory, placement="cpu")
    for target in (fresh, fresh.model, torch.nn.Sequential(fresh)):
        with pytest.raises(ValueError, match=r"token lookup table.*to_empty.*unload_tols\(\)"):
            target.to_empty(device="cpu")
    assert all(torch.equal(tensor, saved[name]) for name, tensor in fresh.state_dict().items())
    fresh.share_memory()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in fresh.state_dict().items())
    fresh.unload_tols()
    assert fresh.to_empty(device="meta").lm_head.weight.device.type == "meta"
    dropped = build(arch)
    dropped.load_tols(directory, placement="cpu", drop_memory_ffn=True)
    with pytest.raises(ValueError, match=r"to_empty.*load the model again"):
        dropped.to_empty(device="cpu")


def change_in_place(model, how):
    """Change a weight a loaded table was computed from the ways users do, none of which goes through load_tols."""
    memory, embedding = model.model.memory, model.model.embed_tokens
    if how == "no_grad":
        with torch.no_grad():
            embedding.weight.mul_(2)
    elif how == "apply":
        model.apply(lambda module: torch.nn.init.normal_(module.down_proj) if module is memory else None)
    elif how == "copy_":
        with torch.no_grad():
            memory.gate_proj.copy_(memory.gate_proj + 0.01)
    elif how == "assigned":
        memory.up_proj = torch.nn.Parameter(memory.up_proj.detach() * 2)
    elif how == "module_load_state_dict":  # (into the module itself: the model's check of the values is not run)
        embedding.load_state_dict({"weight": embedding.weight.detach() + 0.01})
    elif how == "optimizer":  # (a step in eval mode: a train-mode forward refuses gradients on these weights)
        optimizer = torch.optim.AdamW([embedding.weight], lr=0.1)
        ids = torch.randint(0, model.config.vocab_size, (2, 7))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()


@pytest.mark.parametrize("how", ["no_grad", "apply", "copy_", "assigned", "module_load_state_dict", "optimizer"])
def test_weights_changed_in_place_under_a_loaded_table_are_refused_at_the_next_forward(exported, how):
    """Changes of the token embedding or the FFNs on X0 after `load_tols` (an edit under no_grad, `model.apply`,
    `copy_`, a new tensor put in place of one, a `load_state_dict` into the module, an optimizer step) left the model
    reading the table of the old weights: lookup logits differed from compute logits without a word. The next eager
    forward (and `drop_memory_ffn`) now refuses, naming the table's folder, the weight and the ways out; after
    `unload_tols` the model computes from the new weights."""
    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    fresh.load_tols(directory, placement="cpu")
    change_in_place(fresh, how)
    changed = {"apply": "memory.down_proj", "copy_": "memory.gate_proj", "assigned": "memory.up_proj"}.get(
        how, "embed_tokens.weight")
    refused = (rf"{changed} changed since the token lookup table in {directory} was loaded.*"
               r"unload_tols\(\).*export")
    with torch.no_grad(), pytest.raises(TokenLookupError, match=refused):
        fresh(input_ids=ids)
    with pytest.raises(TokenLookupError, match=refused):
        fresh.drop_memory_ffn()
    fresh.unload_tols()
    with torch.no_grad():
        fresh(input_ids=ids)


def test_a_weight_changed_in_place_and_restored_reads_the_table_again(exported):
    """A changed counter alone is not a refusal: the weights are checked against the table's fingerprint, as
    `load_tols` checks them, and the table is read again when they are the exported ones."""
    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    with torch.no_grad():
        expected = fresh(input_ids=ids).logits
    fresh.load_tols(directory, placement="cpu")
    with torch.no_grad():
        fresh.model.embed_tokens.weight.mul_(2).div_(2)  # (exact: powers of two)
        assert relative(fresh(input_ids=ids).logits, expected) < 1e-5


def test_loaded_table_takes_casts_copies_generate_and_same_weights_without_a_false_alarm(exported, monkeypatch):
    """What keeps the weights' values runs as before, without hashing them against the table's fingerprint: forwards
    under no_grad / inference_mode, generate, gradient checkpointing with the embedding and the FFNs on X0 frozen,
    casts (with tensor swapping too), loading the same weights, copies; a copy of a model whose weights changed is
    refused like the model. Once the FFNs on X0 are dropped the weights cannot be checked against the table: a change
    of the embedding is refused, naming the way out, and loading its same values still runs."""
    from hf_memffn import token_lookup

    model, directory = exported
    arch = model.config.model_type.replace("memffn_", "")
    fresh = build(arch)
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    saved = {name: tensor.clone() for name, tensor in fresh.state_dict().items()}
    fresh.load_tols(directory, placement="cpu")
    checks = []
    monkeypatch.setattr(token_lookup, "check_table_matches", lambda *args: checks.append(args))
    with torch.inference_mode():
        fresh(input_ids=ids)
    fresh.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    fresh.requires_grad_(False)
    fresh.lm_head.requires_grad_(True)
    enable_activation_checkpointing(fresh)
    fresh.train()
    fresh(input_ids=ids, labels=ids).loss.backward()
    fresh.eval()
    disable_activation_checkpointing(fresh)
    fresh.disable_input_require_grads()  # (its hook, a local function, would not pickle for the copies below)
    fresh.load_state_dict(saved)
    fresh.to(torch.bfloat16)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        fresh.float()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    for copied in copies_of(fresh).values():
        with torch.no_grad():
            copied(input_ids=ids)
    with torch.no_grad():
        fresh(input_ids=ids)
    assert not checks
    monkeypatch.undo()
    with torch.no_grad():
        fresh.model.memory.up_proj.add_(1.0)
    for copied in copies_of(fresh).values():
        with torch.no_grad(), pytest.raises(TokenLookupError, match=r"memory\.up_proj changed since"):
            copied(input_ids=ids)
    dropped = build(arch)
    dropped.load_tols(directory, placement="cpu", drop_memory_ffn=True)
    embedding = {name: tensor.clone() for name, tensor in dropped.state_dict().items()}
    dropped.load_state_dict(embedding)
    with torch.no_grad():
        dropped(input_ids=ids)
        dropped.model.embed_tokens.weight.add_(1.0)
        with pytest.raises(TokenLookupError, match=r"embed_tokens\.weight changed since.*load the model again"):
            dropped(input_ids=ids)


@pytest.mark.parametrize("replaced", ["memory.up_proj", "embed_tokens"])
def test_a_copy_of_a_model_whose_weight_or_module_was_replaced_is_refused_like_the_model(exported, replaced):
    """A tensor or a module put in place of one the table was computed from, then the model copied (`copy.deepcopy`,
    `torch.save`, torch.multiprocessing): the copy read the table of the old weights without a word, where the model
    itself is refused. Only changes in place were carried over to the copy."""
    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    fresh.load_tols(directory, placement="cpu")
    if replaced == "embed_tokens":
        fresh.model.embed_tokens = torch.nn.Embedding(fresh.config.vocab_size, fresh.config.hidden_size)
    else:
        change_in_place(fresh, "assigned")
    refused = rf"{replaced.replace('.', '[.]')} changed since the token lookup table"
    with torch.no_grad(), pytest.raises(TokenLookupError, match=refused):
        fresh(input_ids=ids)
    for how, copied in copies_of(fresh).items():
        with torch.no_grad(), pytest.raises(TokenLookupError, match=refused):
            copied(input_ids=ids)


def cpu_process_group():
    """A one-process gloo group and its CPU device mesh. (`fully_shard` without a mesh takes a CUDA one where CUDA is
    there: it moved the model to the GPU, away from the token ids and the logits these tests compare on the CPU.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # (a port the system picks)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return init_device_mesh("cpu", (1,))


@pytest.mark.parametrize("wrap", ["root", "units"])
def test_a_table_read_under_fsdp2_equals_compute_and_refuses_a_changed_weight(exported, wrap):
    """`fully_shard` (on the model alone, or on its layers and FFNs on X0 first, as accelerate's FSDP2 plugin wraps
    them) puts its own tensors in place of the weights the table was computed from, so the first forward checks them
    against the fingerprint. Reading them through `state_dict` ran FSDP2's hook, which reshards the weights gathered
    for the forward: with the model alone wrapped, the forward failed ("setStorage: ... out of bounds for storage of
    size 0"). One process, gloo, on the CPU."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    with torch.no_grad():
        expected = fresh(input_ids=ids).logits
    fresh.load_tols(directory, placement="cpu")
    mesh = cpu_process_group()
    try:
        if wrap == "units":
            for module in (*fresh.model.layers, fresh.model.memory):
                fully_shard(module, mesh=mesh)
        fully_shard(fresh, mesh=mesh)
        with torch.no_grad():
            for _ in range(2):
                assert relative(fresh(input_ids=ids).logits, expected) < 1e-5
            fresh.model.embed_tokens.weight.mul_(2)
            with pytest.raises(TokenLookupError, match=r"embed_tokens\.weight changed since"):
                fresh(input_ids=ids)
    finally:
        dist.destroy_process_group()


def test_a_table_under_fsdp2_mixed_precision_trains_the_rest(exported):
    """Under FSDP2 with bf16 parameters (fsdp2.yaml's mixed_precision), the first forward checks the gathered bf16
    weights against the table's fingerprint. Hashing them through `numpy()` marked their storage as not resizable, so
    FSDP2 could not free them after the backward ("Trying to resize storage that is not resizable"). The decoder layers
    return a new tensor, not a view of one, as FSDP2 asks of a wrapped module's output (a view made it warn that an
    in-place op on it would skip its all-gather). One process, gloo, on the CPU."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", "")).train()
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    fresh.load_tols(directory, placement="cpu")
    fresh.model.embed_tokens.requires_grad_(False)
    fresh.model.memory.requires_grad_(False)
    mesh = cpu_process_group()
    try:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in fresh.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(fresh, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.SGD([param for param in fresh.parameters() if param.requires_grad], lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                fresh(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        assert not [str(warning.message) for warning in caught if "returned a view" in str(warning.message)]
        fresh.eval()
        with torch.no_grad():
            table_logits = fresh(input_ids=ids).logits.float()
            fresh.unload_tols()
            torch.testing.assert_close(table_logits, fresh(input_ids=ids).logits.float(), rtol=0, atol=2e-2)
    finally:
        dist.destroy_process_group()


def test_ddp_leaves_the_table_out_of_its_buffer_broadcasts(exported):
    """Each rank loads its own table; DDP broadcast rank 0's whole table over every rank's when it wrapped the model
    and at each forward (`broadcast_buffers`), as it does the model's buffers. Names a user asks DDP to leave out are
    kept beside the table's. One process, gloo, on the CPU."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    ids = torch.randint(0, fresh.config.vocab_size, (2, 7))
    with torch.no_grad():
        expected = fresh(input_ids=ids).logits
    table = fresh.load_tols(directory, placement="cpu")
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(fresh, ["lm_head.weight"])
    cpu_process_group()
    try:
        wrapped = DistributedDataParallel(fresh)
        assert {"lm_head.weight", "model.token_lookup.rows"} <= wrapped.parameters_to_ignore
        assert not any(buffer is table.rows for buffer in wrapped.modules_buffers)
        with torch.no_grad():
            assert relative(wrapped(input_ids=ids).logits, expected) < 1e-5
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrapper", ["lora", "prompt_tuning", "torch.compile", "torch.compile of lora"])
def test_ddp_of_a_wrapped_model_leaves_the_table_out_of_its_buffer_broadcasts(exported, wrapper):
    """DDP given a PEFT model or a compiled model reads the ignore list of the model inside (the wrappers hand attribute
    lookups down) but names the buffers under the wrapper (`base_model.model.model.token_lookup.rows`): the table's
    names did not match, and DDP broadcast the whole table again at each forward. One process, gloo, on the CPU."""
    import torch.distributed as dist
    from peft import LoraConfig, PromptTuningConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    model, directory = exported
    fresh = build(model.config.model_type.replace("memffn_", ""))
    table = fresh.load_tols(directory, placement="cpu")
    if wrapper == "prompt_tuning":
        wrapped_model = get_peft_model(fresh, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    elif wrapper.endswith("lora"):
        wrapped_model = get_peft_model(fresh, LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    else:
        wrapped_model = fresh
    if wrapper.startswith("torch.compile"):
        wrapped_model = torch.compile(wrapped_model)
    table_names = {name for name, buffer in wrapped_model.named_buffers() if buffer is table.rows}
    assert len(table_names) == 1
    cpu_process_group()
    try:
        ddp = DistributedDataParallel(wrapped_model)
        assert table_names <= ddp.parameters_to_ignore
        assert not any(buffer is table.rows for buffer in ddp.modules_buffers)
    finally:
        dist.destroy_process_group()


def copies_of(model) -> dict:
    """`model` copied the ways a user copies a model: `copy.deepcopy`, `torch.save` then `torch.load`, and (a model on
    the CPU) the pickle of torch.multiprocessing (a spawned process's arguments, a Queue), loaded back here. A CUDA
    tensor sent so cannot be rebuilt in the process that sent it ("invalid device context"): a model on a GPU goes to
    another process, `logits_in_another_process`."""
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    copies = {"deepcopy": copy.deepcopy(model), "torch.save": torch.load(saved, weights_only=False)}
    if model.device.type == "cpu":
        copies["torch.multiprocessing"] = pickle.loads(bytes(ForkingPickler.dumps(model)))
    return copies


def _logits_of_the_received_model(inbox, results) -> None:
    """In the spawned process: the logits (on the CPU) of each batch and the table's device bytes, or the error."""
    try:
        model, batches = inbox.get()
        with torch.no_grad():  # (as arrays, sent whole: a tensor's shared memory would go with this process)
            logits = [model(input_ids=ids).logits.cpu().numpy() for ids in batches]
        results.put((logits, model.model.token_lookup.device_bytes()))
    except BaseException as error:  # (reported to the test, which would otherwise wait for nothing)
        import traceback

        results.put(("".join(traceback.format_exception(error)), None))


def logits_in_another_process(model, batches: list) -> tuple[list, int]:
    """`model` sent to a spawned process through a torch.multiprocessing queue (CUDA tensors shared by IPC, CPU
    tensors moved into shared memory), and read there: each batch's logits and the table's device bytes. (Sent as the
    process's arguments instead, the file descriptors of the shared CPU tensors failed its start.)"""
    context = torch.multiprocessing.get_context("spawn")
    inbox, results = context.Queue(), context.Queue()
    child = context.Process(target=_logits_of_the_received_model, args=(inbox, results))
    child.start()
    try:
        inbox.put((model, batches))
        logits, device_bytes = results.get(timeout=300)
    finally:
        child.join(timeout=60)
    assert device_bytes is not None, logits
    return [torch.from_numpy(array) for array in logits], device_bytes


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_a_model_reading_a_table_is_copied_pickled_and_saved_whole(exported, placement):
    """A model reading a table gives the same logits once copied, pickled or saved whole (a disk table's mapped shards
    made torch.save and torch.multiprocessing fail); a disk table's copy maps the shards again instead of carrying
    the table in memory."""
    model, directory = exported
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    table = model.load_tols(directory, placement=placement)
    try:
        with torch.no_grad():
            expected = model(input_ids=ids).logits
            copies = copies_of(model)
            for how, copied in copies.items():
                assert type(copied.model.token_lookup) is type(table), how
                torch.testing.assert_close(copied(input_ids=ids).logits, expected, rtol=0, atol=0, msg=how)
        if placement == "disk":
            table_bytes = sum(os.path.getsize(directory / name) for name in table.index.shards)
            assert len(pickle.dumps(table)) < table_bytes / 4
    finally:
        model.unload_tols()


def test_a_disk_table_copied_after_its_folder_was_exported_again_is_refused(exported, tmp_path):
    """The copy of a disk table maps its shards again: a table exported into the folder since is refused, naming it."""
    model, _ = exported
    export_tols(model, tmp_path, format="fp32", batch_size=96, progress=False)
    table = model.load_tols(tmp_path, placement="disk")
    try:
        export_tols(model, tmp_path, format="bf16", batch_size=96, progress=False)
        with pytest.raises(TokenLookupError, match=r"no longer the one in .*exported there again.*load_tols"):
            copy.deepcopy(table)
    finally:
        model.unload_tols()


def test_a_disk_table_cache_is_copied_with_a_stream_and_lock_of_its_own_and_no_readers(exported, monkeypatch):
    """A table with a device cache holds its side stream, a lock and the count of live forwards reading each slot:
    neither a CUDA stream nor a lock can be copied or pickled (on a GPU, `copy.deepcopy`, `torch.save` and
    torch.multiprocessing of the model failed on "cannot pickle 'torch.Stream' object"), so a copy makes its own,
    and no forward reads its slots yet. A CPU table has no cache: its state is built here by hand, with a stream
    that cannot be pickled either and `torch.cuda.Stream` standing in for the copy's."""
    model, directory = exported
    table = model.load_tols(directory, placement="disk")
    try:
        vocab, slots = table.index.vocab_size, 16
        table.register_buffer("cache_rows", torch.zeros(slots, table.index.row_width), persistent=False)
        table.register_buffer("cache_scales", None, persistent=False)
        table.register_buffer("slot_of_token", torch.full((vocab,), -1, dtype=torch.int32), persistent=False)
        table.host_slot_of_token = torch.full((vocab,), -1, dtype=torch.int64)
        table.token_in_slot = torch.full((slots,), -1, dtype=torch.int64)
        table.slot_last_used = torch.zeros(slots, dtype=torch.int64)
        table.copy_stream = torch.Stream(device="cpu")
        table._init_slot_readers()
        table.slot_readers[10] = 2  # two forwards read slot 10, one of them finished
        table._finished_readers.append((torch.tensor([10]), table.copy_stream))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: ("new stream on", device))
        copies = {"deepcopy": copy.deepcopy(table), "pickle": pickle.loads(pickle.dumps(table)),
                  "torch.multiprocessing": pickle.loads(bytes(ForkingPickler.dumps(table)))}
        cache = ["cache_rows", "slot_of_token", "host_slot_of_token", "token_in_slot", "slot_last_used"]
        for how, copied in copies.items():
            assert copied.copy_stream == ("new stream on", table.device), how
            assert copied._cache_lock is not table._cache_lock and not copied._cache_lock.locked(), how
            assert len(copied._finished_readers) == 0 and not copied.slot_readers.any(), how
            # (torch.multiprocessing shares what it sends: a cache shared by two tables, each under its own lock)
            for name in cache:
                assert getattr(copied, name).data_ptr() != getattr(table, name).data_ptr(), (how, name)
        assert table.slot_readers[10] == 2 and len(table._finished_readers) == 1  # (the original's own unchanged)
        assert not any(getattr(table, name).is_shared() for name in cache)
    finally:
        model.unload_tols()


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_a_model_reading_a_lowrank_table_is_copied_pickled_and_saved_whole(tmp_path, placement):
    """A low-rank table's bases are its own tensors, not views of the mapped shard (which made torch.multiprocessing
    fail for every placement on the CPU)."""
    model = build("memoryllm")
    export_tols(model, tmp_path, format="lowrank", rank=8, batch_size=64, progress=False)
    model.load_tols(tmp_path, placement=placement)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for how, copied in copies_of(model).items():
            torch.testing.assert_close(copied(input_ids=ids).logits, expected, rtol=0, atol=0, msg=how)


def test_a_checkpoint_folder_without_a_table_is_not_called_an_interrupted_export(tmp_path):
    """The folder holds the remote code `token_lookup*.py`, not a table's shards."""
    from hf_memffn.token_lookup import TokenLookupError

    model = build("memoryllm")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "token_lookup.py").is_file()
    with pytest.raises(TokenLookupError, match=r"token_lookup.safetensors.index.json is missing$"):
        model.load_tols(tmp_path, placement="cpu")
    (tmp_path / "token_lookup-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(TokenLookupError, match="an export was interrupted"):
        model.load_tols(tmp_path, placement="cpu")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_rows_round_trip(name):
    # (rows down to 1e-9: the scales are bf16, of fp32's range, where fp16 ones would read rows below ~4e-6 as zeros)
    values = torch.randn(7, 4 * 64) * torch.logspace(-9, 2, 7).unsqueeze(1)
    fmt = TokenLookupFormat(name=name, group_size=16)
    encoded = quantize_rows(values, fmt)
    decoded = dequantize_rows(encoded["rows"], encoded["scales"], fmt)
    step = encoded["scales"].float().repeat_interleave(16, dim=1)
    assert bool(((decoded - values).abs() <= step * 0.5 + 1e-12).all())  # within half a quantization step
    if name == "int4":
        assert encoded["rows"].dtype == torch.uint8 and encoded["rows"].shape == (7, 128)


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels (CUDA, or the interpreter)
# ---------------------------------------------------------------------------------------------------------------------
LOOKUP_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@needs_kernels
@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "int8", "int4"])
@pytest.mark.parametrize("d, tokens", [(384, 53), (1056, 1)], ids=["ragged_block", "two_blocks-one_token"])
def test_triton_lookup_add_matches_float64(name, d, tokens):
    """Every stored format into every hidden dtype, each layer's slice of the rows: a hidden size that is not a power of
    two (the last block masked), one over a block's 1024 columns, and a single token."""
    from hf_memffn.token_lookup_triton import lookup_add_triton

    generator = torch.Generator().manual_seed(d + tokens)
    layers, vocab = 3, 97
    fmt = TokenLookupFormat(name=name, group_size=32 if name in ("int8", "int4") else None)
    encoded = quantize_rows(torch.randn(vocab, layers * d, generator=generator).to(DEVICE), fmt)
    rows, scales = encoded["rows"], encoded.get("scales")
    ids = torch.randint(0, vocab, (tokens,), generator=generator).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(tokens, d, generator=generator).to(DEVICE, dtype)
        for k in range(layers):
            out = lookup_add_triton(hidden, ids, rows, scales, k, d, name, fmt.group_size or 1)
            assert out.dtype == dtype and out.shape == hidden.shape
            width = d // 2 if name == "int4" else d
            sl = rows[ids][:, k * width:(k + 1) * width]
            sc = scales[ids][:, k * d // 32:(k + 1) * d // 32] if scales is not None else None
            reference = hidden.double() + dequantize_rows(sl, sc, fmt).double()
            error = float((out.double() - reference).norm() / reference.norm())
            assert error < LOOKUP_TOLERANCE[dtype], (name, dtype, k, error)
    empty = hidden[:0]
    assert lookup_add_triton(empty, ids[:0], rows, scales, 0, d, name, fmt.group_size or 1).shape == empty.shape


@needs_kernels
@pytest.mark.parametrize("cached", [False, True], ids=["table_only", "cache_and_table"])
def test_triton_lookup_gather_matches_indexing(cached):
    """Whole rows of repeated token ids, each from the device cache where its slot is set, otherwise from the table:
    the stored bytes unchanged, for every stored dtype, a row width that is not a power of two and one over 1024."""
    from hf_memffn.token_lookup_triton import gather_rows_triton

    generator = torch.Generator().manual_seed(int(cached))
    vocab, slots = 41, 6
    ids = torch.randint(0, vocab, (37,), generator=generator).to(DEVICE)
    slot_of_token = None
    if cached:
        slot_of_token = torch.full((vocab,), -1, dtype=torch.int32)
        slot_of_token[ids[:slots * 2:2].cpu()] = torch.arange(slots, dtype=torch.int32)
        slot_of_token = slot_of_token.to(DEVICE)

    def stored(count, width, dtype):
        values = torch.randn(count, width, generator=generator) * 40
        return (values.to(torch.int16) & 255).to(torch.uint8) if dtype == torch.uint8 else values.to(dtype)

    for dtype, width in ((torch.float32, 200), (torch.bfloat16, 1100), (torch.float16, 96), (torch.uint8, 150)):
        table = stored(vocab, width, dtype).to(DEVICE)
        cache = stored(slots, width, dtype).to(DEVICE) if cached else None
        out = gather_rows_triton(ids, slot_of_token, cache, table)
        expected = table[ids]
        if cached:
            hit = slot_of_token[ids] >= 0
            assert hit.any() and not hit.all()
            expected[hit] = cache[slot_of_token[ids][hit].long()]
        assert out.dtype == dtype and torch.equal(out, expected), dtype
    assert gather_rows_triton(ids[:0], slot_of_token, cache, table).shape == (0, width)


@needs_kernels
def test_triton_lookup_kernels_read_token_ids_of_a_strided_view():
    """The ids of a decoding step taken as `input_ids[:, -1:]` from a batch are a strided view once flattened (the
    runtime's `input_ids.reshape(-1)`): both kernels read each token's own id, not the storage in order."""
    from hf_memffn.token_lookup_triton import gather_rows_triton, lookup_add_triton

    generator = torch.Generator().manual_seed(7)
    vocab, d = 23, 96
    table = torch.randn(vocab, 2 * d, generator=generator).to(DEVICE)
    input_ids = torch.randint(0, vocab, (3, 5), generator=generator).to(DEVICE)
    ids = input_ids[:, -1:].reshape(-1)
    assert ids.stride() == (5,)
    hidden = torch.randn(3, d, generator=generator).to(DEVICE)
    out = lookup_add_triton(hidden, ids, table, None, 1, d, "fp32", 1)
    torch.testing.assert_close(out, hidden + table[ids, d:], rtol=0, atol=0)
    assert torch.equal(gather_rows_triton(ids, None, None, table), table[ids])


@needs_kernels
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_triton_lookup_add_keeps_the_shape_of_batched_hidden_states_and_returns_no_view(compiled, monkeypatch):
    """A decoder layer's hidden states [batch, length, d] go into the add whole: the sum comes back in their shape as
    a tensor of its own, not a view of a flat one (FSDP2 warns of a wrapped layer's output that is a view), each token
    t of the batch, in order, adding the row of row_ids[t]. Compiled, the custom operator is still given hidden
    states [T, d]: whichever copy of the code registered it first (an earlier version's remote code perhaps) takes
    those."""
    from hf_memffn import token_lookup_triton
    from hf_memffn.token_lookup_triton import lookup_add_triton

    launched_shapes = []
    launch = token_lookup_triton._launch_lookup_add

    def recording_launch(hidden, *arguments):
        launched_shapes.append(tuple(hidden.shape))
        return launch(hidden, *arguments)

    monkeypatch.setattr(token_lookup_triton, "_launch_lookup_add", recording_launch)
    generator = torch.Generator().manual_seed(10)
    vocab, d = 13, 48
    table = torch.randn(vocab, 2 * d, generator=generator).to(DEVICE)
    ids = torch.randint(0, vocab, (2, 3), generator=generator).to(DEVICE)
    hidden = torch.randn(2, 3, d, generator=generator).to(DEVICE)
    add = lookup_add_triton
    if compiled:
        torch._dynamo.reset()
        add = torch.compile(lookup_add_triton, backend="aot_eager", fullgraph=True)
    out = add(hidden, ids.reshape(-1), table, None, 1, d, "fp32", 1)
    assert out.shape == hidden.shape and (compiled or out._base is None)
    assert set(launched_shapes) == {(6, d) if compiled else (2, 3, d)}, launched_shapes
    torch.testing.assert_close(out, hidden + table[ids, d:], rtol=0, atol=0)
    torch._dynamo.reset()


@needs_kernels
def test_triton_lookup_kernels_read_int32_ids_and_views_with_offsets():
    """Valid inputs a caller passes without copying: int32 ids (continuous batching's), rows that are a column slice
    of a wider buffer from an offset (row stride past the row's width), a hidden state that is a view past the start
    of its storage, and a table of whole rows from an offset."""
    from hf_memffn.token_lookup_triton import gather_rows_triton, lookup_add_triton

    generator = torch.Generator().manual_seed(9)
    vocab, d = 11, 40
    buffer = torch.randn(vocab + 1, 4 * d, generator=generator).to(DEVICE)
    rows = buffer[1:, d:3 * d]
    assert rows.stride() == (4 * d, 1) and rows.storage_offset() == 5 * d
    ids = torch.tensor([3, 0, 10, 3], dtype=torch.int32, device=DEVICE)
    hidden = torch.randn(5, d, generator=generator).to(DEVICE)[1:]
    out = lookup_add_triton(hidden, ids, rows, None, 1, d, "fp32", 1)
    torch.testing.assert_close(out, hidden + rows[ids.long(), d:], rtol=0, atol=0)
    table = buffer[1:]
    assert torch.equal(gather_rows_triton(ids, None, None, table), table[ids.long()])


@needs_kernels
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_triton_lookup_add_records_the_gradient_of_the_hidden_state(compiled):
    """Hidden states that need gradients (training around a loaded table): the kernel's sum, and the output's gradient
    passed to the hidden state unchanged (the table's rows get none); compiled, through the custom operator."""
    from hf_memffn.token_lookup_triton import lookup_add_triton

    generator = torch.Generator().manual_seed(8)
    vocab, d = 19, 96
    table = torch.randn(vocab, 2 * d, generator=generator).to(DEVICE)
    ids = torch.randint(0, vocab, (5,), generator=generator).to(DEVICE)
    hidden = torch.randn(5, d, generator=generator).to(DEVICE).requires_grad_()
    add = lookup_add_triton
    if compiled:
        torch._dynamo.reset()
        add = torch.compile(lookup_add_triton, backend="aot_eager", fullgraph=True)
    out = add(hidden, ids, table, None, 1, d, "fp32", 1)
    torch.testing.assert_close(out, hidden + table[ids, d:], rtol=0, atol=1e-6)
    grad_out = torch.randn(5, d, generator=generator).to(DEVICE)
    out.backward(grad_out)
    assert torch.equal(hidden.grad, grad_out)
    torch._dynamo.reset()


def test_lookup_kernels_under_interpreter_in_subprocess():
    run_under_interpreter(__file__, "triton_lookup")


# ---------------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("placement, cache_rows", [("gpu", 0), ("cpu", 64), ("cpu", 0), ("disk", 80), ("disk", 0)])
def test_gpu_placements_equal_compute(exported, placement, cache_rows):
    cpu_model, directory = exported
    model = build(cpu_model.config.model_type.replace("memffn_", ""), device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (4, 17), device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids[:, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
        table = model.load_tols(directory, placement=placement, cache_rows=cache_rows,
                                frequent_tokens=torch.arange(model.config.vocab_size).flip(0))
        assert table.kernel == "triton"
        for dtype in (torch.int32, torch.long):  # int32 first (continuous batching's), the disk cache cold; then warm
            assert relative(model(input_ids=ids.to(dtype)).logits, logits) < 1e-5
        assert torch.equal(model.generate(ids[:, :5], max_new_tokens=8, do_sample=False, pad_token_id=0), tokens)
    if placement == "disk" and cache_rows:
        assert 0 < table.cache_hits < table.cache_lookups


@pytest.mark.gpu
@needs_cuda
def test_disk_cache_refills_no_slot_a_live_forward_reads(tmp_path):
    """A disk table's forward reads its slots after the lookup returns: a second lookup while the first's row ids are
    alive (its later layers, its recompute under activation checkpointing, another thread's forward) must not refill
    them. Here the second lookup finds every least-recently-used slot taken and reads its rows into a buffer of its
    own; once the first's row ids are freed, a third lookup refills those slots. Every lookup reads its own rows."""
    model = build("memoryllm", device="cuda")
    export_tols(model, tmp_path, format="fp32", progress=False)
    table = model.load_tols(tmp_path, placement="disk", cache_rows=16)  # 8 static slots (tokens 0-7), 8 refilled

    def rows_read(readout):
        return readout.tokens_rows()[0].cpu()

    first_ids, second_ids, third_ids = (torch.arange(start, start + 8, device="cuda") for start in (100, 200, 300))
    first = table.readout(first_ids[None])
    assert first.rows is table.cache_rows  # (new tokens into the refilled half)
    second = table.readout(second_ids[None])
    assert second.rows is not table.cache_rows  # (no free slot: a buffer of its own)
    assert torch.equal(rows_read(first), table._host_rows(first_ids.cpu())[0])
    assert torch.equal(rows_read(second), table._host_rows(second_ids.cpu())[0])
    del first
    gc.collect()
    third = table.readout(third_ids[None])
    assert third.rows is table.cache_rows
    assert torch.equal(rows_read(third), table._host_rows(third_ids.cpu())[0])


@pytest.mark.gpu
@needs_cuda
def test_disk_cache_model_on_gpu_is_copied_pickled_and_saved_whole(exported):
    """A model on a GPU reading a disk table with a device cache (its side stream made `copy.deepcopy`, `torch.save`
    and torch.multiprocessing fail: "cannot pickle 'torch.Stream' object"): each copy gives the logits of compute
    mode, for the tokens cached before the copy and for new ones, which it copies into its cache on its own stream."""
    cpu_model, directory = exported
    model = build(cpu_model.config.model_type.replace("memffn_", ""), device="cuda")
    # (6 tokens above the 16 static ones: the new ones fit the 16 refilled slots)
    first, later = (torch.randint(16, model.config.vocab_size, (1, 6), device="cuda") for _ in range(2))
    with torch.no_grad():
        expected = [model(input_ids=ids).logits for ids in (first, later)]
        table = model.load_tols(directory, placement="disk", cache_rows=32)
        model(input_ids=first)
        for how, copied in copies_of(model).items():
            copied_table = copied.model.token_lookup
            assert copied_table.use_cache and copied_table.copy_stream is not table.copy_stream, how
            for ids, logits in zip((first, later), expected):
                assert relative(copied(input_ids=ids).logits, logits) < 1e-5, how
            # (first's tokens: copied with the cache)
            assert copied_table.cache_hits >= torch.unique(first).numel(), how
        # torch.multiprocessing: the other process fills a cache of its own (one shared with this table would change
        # under it, each table under its own lock)
        cached_tokens = table.token_in_slot.clone()
        logits, _ = logits_in_another_process(model, [first, later])
        for received, wanted in zip(logits, expected):
            assert relative(received, wanted.cpu()) < 1e-5
        assert torch.equal(table.token_in_slot, cached_tokens) and not table.token_in_slot.is_shared()
        assert relative(model(input_ids=later).logits, expected[1]) < 1e-5


@pytest.mark.gpu
@needs_cuda
def test_host_table_dropped_while_a_forward_reading_it_is_queued_is_read_whole(exported):
    """A `cpu` table unloaded while the forward that gathers its pinned rows is still queued on the GPU: the forward
    reads the table's rows. (Its pinned memory went back to PyTorch's host allocator at once, and the next pinned
    allocation of its size took it and was written before the queued gather read it.)"""
    cpu_model, directory = exported
    model = build(cpu_model.config.model_type.replace("memffn_", ""), device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device="cuda")
    with torch.no_grad():
        table = model.load_tols(directory, placement="cpu", cache_rows=0)  # (every row read from the host)
        expected = model(input_ids=ids).logits
        shape, dtype = table._host_tables[0].shape, table._host_tables[0].dtype
        gather = table._gather

        def gather_after_a_wait(*args):
            torch.cuda._sleep(2_000_000_000)  # (about a second of the GPU's time, queued before the gather)
            return gather(*args)

        table._gather = gather_after_a_wait
        logits = model(input_ids=ids).logits
        del table.__dict__["_gather"], table, gather, gather_after_a_wait
        model.unload_tols()
        gc.collect()
        torch.empty(shape, dtype=dtype, pin_memory=True).fill_(float("nan"))
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_host_table_model_on_gpu_is_copied_pickled_and_saved_whole(exported):
    """A model on a GPU reading a `cpu` table (pinned host rows the GPU reads in place through aliases that own no
    memory): each copy gives the logits of compute mode and keeps its table on the host, read through its own
    aliases. (Copied as tensors, the aliases put the whole table in device memory; torch.multiprocessing could not
    send them, and moved the host table into shared memory under the original's aliases.)"""
    cpu_model, directory = exported
    model = build(cpu_model.config.model_type.replace("memffn_", ""), device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device="cuda")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        table = model.load_tols(directory, placement="cpu", cache_rows=16)
        for how, copied in copies_of(model).items():
            copied_table = copied.model.token_lookup
            host_rows = copied_table._host_tables[0]
            assert host_rows.is_pinned() and copied_table.rows.data_ptr() == host_rows.data_ptr(), how
            assert copied_table.device_bytes() == table.device_bytes(), how
            assert relative(copied(input_ids=ids).logits, expected) < 1e-5, how
        logits, device_bytes = logits_in_another_process(model, [ids])
        assert relative(logits[0], expected.cpu()) < 1e-5 and device_bytes == table.device_bytes()
        host_rows = table._host_tables[0]
        assert host_rows.is_pinned() and not host_rows.is_shared() and table.rows.data_ptr() == host_rows.data_ptr()
        assert relative(model(input_ids=ids).logits, expected) < 1e-5


@pytest.mark.gpu
@needs_cuda
def test_disk_cache_under_activation_checkpointing_and_threads_equals_compute(tmp_path):
    """Two forwards before their backwards under activation checkpointing (each recompute reads its slots again),
    and forwards from two threads through one table at once, with a cache refilled at every forward: the gradients
    and logits of compute mode."""
    model = build("memoryllm", device="cuda", vocab_size=4096)
    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(8, 4096, (1, 24), generator=generator).cuda() for _ in range(2)]

    def gradients(with_table: bool):
        trained = build("memoryllm", device="cuda", vocab_size=4096).train()
        if with_table:
            trained.load_tols(tmp_path, placement="disk", cache_rows=64)
        trained.model.embed_tokens.requires_grad_(False)
        trained.model.memory.requires_grad_(False)
        enable_activation_checkpointing(trained)
        losses = [trained(input_ids=ids, labels=ids).loss for ids in batches]
        sum(losses).backward()
        return {name: param.grad for name, param in trained.named_parameters() if param.requires_grad}

    export_tols(model, tmp_path, format="fp32", progress=False)
    computed, looked_up = gradients(False), gradients(True)
    assert all(relative(looked_up[name], computed[name]) < 1e-5 for name in computed)

    prompts = [[torch.randint(8, 4096, (1, 24), generator=generator).cuda() for _ in range(40)] for _ in range(2)]
    with torch.no_grad():
        expected = [[model(input_ids=ids).logits for ids in thread] for thread in prompts]
        model.load_tols(tmp_path, placement="disk", cache_rows=128)
        errors = [[], []]

        def run(k, start):
            start.wait()
            for ids, logits in zip(prompts[k], expected[k]):
                errors[k].append(relative(model(input_ids=ids).logits, logits))
            torch.cuda.synchronize()

        start = threading.Barrier(2)
        threads = [threading.Thread(target=run, args=(k, start)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(errors[0]) == len(errors[1]) == 40 and max(errors[0] + errors[1]) < 1e-5
    assert 0 < model.model.token_lookup.cache_hits < model.model.token_lookup.cache_lookups


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("format", ["fp32", "bf16", "int8", "int4", "lowrank"])
def test_readout_adds_into_hidden_states_on_another_device(tmp_path, format):
    """A model split over devices (`device_map`) runs a layer where the table is not: each layer's values are read
    where the rows are and added on the hidden states' device, equal to the sum taken beside the table."""
    model = build("memoryllm", device="cuda")
    options = {"rank": 8} if format == "lowrank" else {"group_size": 32} if format in ("int8", "int4") else {}
    export_tols(model, tmp_path, format=format, progress=False, **options)
    table = model.load_tols(tmp_path, placement="gpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device="cuda")
    # (hidden states of the values' size, below 0.01 in the tiny model: beside hidden states of size 1 they would be
    # under the tolerance, and a readout that added nothing would pass)
    hidden = (torch.randn(2, 9, model.config.hidden_size, device="cuda") * 1e-3).to(torch.bfloat16)
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            readout = table.readout(ids)
            beside = readout.add_into(hidden, layer)
            elsewhere = table.readout(ids).add_into(hidden.cpu(), layer)
            assert elsewhere.device.type == "cpu" and elsewhere.dtype == hidden.dtype
            torch.testing.assert_close(elsewhere, beside.cpu(), rtol=1e-2, atol=1e-4)
            assert not torch.allclose(elsewhere, hidden.cpu(), rtol=1e-2, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_compiled_lookup_runs_the_triton_add_only_when_asked(tmp_path, kernel):
    """kernel="auto": the Triton add in eager steps, PyTorch operations for inductor under torch.compile;
    kernel="triton": the Triton add (its custom operator) under torch.compile too. Both equal the eager lookup."""
    model = build("flex_memoryllm", device="cuda")
    export_tols(model, tmp_path, format="int8", group_size=32, progress=False)
    table = model.load_tols(tmp_path, placement="gpu", kernel=kernel, drop_memory_ffn=True)
    assert (table.kernel, table.compiled_kernel) == ("triton", "triton" if kernel == "triton" else "torch")
    ids = torch.randint(0, model.config.vocab_size, (3, 11), device="cuda")
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    compiled, graphs = lookup_graphs(model, ids)
    assert graphs and calls_the_triton_add(graphs) == (kernel == "triton")
    assert relative(compiled, eager) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("placement, backend", [("gpu", "inductor"), ("cpu", "inductor"), ("cpu", "cudagraphs")])
def test_compiled_generate_with_static_cache_matches_eager(tmp_path, placement, backend):
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = build("memoryllm", device="cuda")
    export_tols(model, tmp_path, format="int8", group_size=32, progress=False)
    model.load_tols(tmp_path, placement=placement, cache_rows=64, drop_memory_ffn=True)
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), device="cuda")
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    eager = model.generate(prompt, **options)
    mode = "reduce-overhead" if backend == "inductor" else None
    compiled = model.generate(prompt, cache_implementation="static",
                              compile_config=CompileConfig(backend=backend, mode=mode, fullgraph=True), **options)
    assert torch.equal(compiled, eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("written_version", [2, 0])
def test_a_table_of_another_format_version_is_refused_naming_both_versions_and_what_to_do(tmp_path, written_version):
    """A table whose index records another `format_version` than the one this version reads (written by a later
    version of the package, or an earlier one) is refused naming the version it holds, the version read here and what
    to do (export it again from the weights with this version, or load it with the version that wrote it), where the
    message said only that the file was not an index of this version."""
    import json

    from hf_memffn.token_lookup import INDEX_NAME, TABLE_FORMAT_VERSION

    model = build("memoryllm")
    export_tols(model, tmp_path, format="fp32", progress=False)
    index_path = tmp_path / INDEX_NAME
    index = json.loads(index_path.read_text())
    index["metadata"]["token_lookup"]["format_version"] = written_version
    index_path.write_text(json.dumps(index))
    with pytest.raises(TokenLookupError) as error:
        model.load_tols(tmp_path, placement="cpu")
    message = str(error.value)
    assert f"format version {written_version}" in message and f"format version {TABLE_FORMAT_VERSION}" in message
    assert ("later" if written_version > TABLE_FORMAT_VERSION else "earlier") in message
    assert "export-tols" in message


def test_a_table_of_an_earlier_version_without_an_fp16_fingerprint_names_why_an_fp16_model_cannot_take_it(tmp_path):
    """Earlier versions of the package recorded one fingerprint in a table's index, of the weights rounded to bf16,
    which the checkpoint loaded in fp16 (its weights rounded to fp16 first) does not give. Loading such a table exported
    from the fp32 weights into the checkpoint in fp16 was refused as "computed from other weights", followed by the
    promise that fp16 takes it: it is refused naming the earlier version's index and what to do (load the model in
    fp32 or bf16, which take the table, or export the table again). The fixture is this version's table with the fp16
    fingerprint taken out of its index."""
    import json

    from hf_memffn.token_lookup import INDEX_NAME

    build("memoryllm").save_pretrained(tmp_path / "model")
    export_tols(tmp_path / "model", tmp_path / "table", format="fp32", progress=False)
    index_path = tmp_path / "table" / INDEX_NAME
    index = json.loads(index_path.read_text())
    del index["metadata"]["token_lookup"]["fingerprint_fp16"]
    index_path.write_text(json.dumps(index))
    for dtype in (torch.float32, torch.bfloat16):
        AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=dtype).load_tols(tmp_path / "table",
                                                                                       placement="cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float16)
    with pytest.raises(TokenLookupError, match=r"exported by an earlier version of hf-memffn.*no fingerprint of the "
                                               r"weights in fp16.*fp32 or bf16.*export the table again"):
        model.load_tols(tmp_path / "table", placement="cpu")


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_a_lowrank_tables_readout_is_float32_also_under_autocast(tmp_path, placement):
    """A low-rank table's values are its coefficients times its basis, decoded in float32 as the export computed
    them; under a caller's `torch.autocast("cpu", dtype=torch.bfloat16)` that product ran in bfloat16, so the values
    added into the hidden states were rounded and differed from those of the same forward without autocast."""
    model = build("memoryllm")
    export_tols(model, tmp_path, format="lowrank", rank=8, factor_dtype="fp32", batch_size=64, progress=False)
    table = model.load_tols(tmp_path, placement=placement)
    try:
        ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
        hidden = torch.zeros(2, 9, model.config.hidden_size)
        with torch.no_grad():
            exact = table.readout(ids).add_into(hidden, 0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                under_autocast = table.readout(ids).add_into(hidden, 0)
        assert under_autocast.dtype == exact.dtype == torch.float32
        torch.testing.assert_close(under_autocast, exact, rtol=0, atol=0)
    finally:
        model.unload_tols()
