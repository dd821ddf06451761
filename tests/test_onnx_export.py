"""ONNX export of every architecture and baseline (by default the four architectures and MH-FFN): FlashMHF's custom
operator exports through its ONNX translation (the reference decomposition), the graph passes onnx's full checker, and
the ONNX model's logits equal the PyTorch model's at other batch sizes and lengths than the export's, evaluated with
onnx's reference evaluator and, when it is installed, with onnxruntime's CPU provider (the runtime models are deployed
with), also for float16 models there."""

from __future__ import annotations

import copy
import os

import numpy as np
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_memffn.testing import left_padded, tiny_config

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
from onnx.reference import ReferenceEvaluator  # noqa: E402

from hf_memffn.onnx_export import export_onnx  # noqa: E402

# id -> (architecture, config overrides): each architecture and every baseline its `ffn_variant` selects.
CASES = {
    "flash_mhf": ("flash_mhf", {}),
    "flash_mhf-mh_ffn": ("flash_mhf", {"ffn_variant": "mh_ffn", "ffn_num_subnetworks": 1}),
    "flash_mhf-dense_moe": ("flash_mhf", {"ffn_variant": "dense_moe", "ffn_num_heads": 1, "ffn_num_kv_heads": 1}),
    "flash_mhf-pkv": ("flash_mhf", {"ffn_variant": "pkv"}),
    "flash_mhf-swiglu": ("flash_mhf", {"ffn_variant": "swiglu"}),
    "kvffn": ("kvffn", {}),
    "kvffn-relu": ("kvffn", {"ffn_variant": "relu"}),
    "kvffn-glu": ("kvffn", {"ffn_variant": "glu"}),
    "kvffn-densenet": ("kvffn", {"ffn_variant": "densenet"}),
    "memoryllm": ("memoryllm", {}),
    "flex_memoryllm": ("flex_memoryllm", {}),
}
# By default the four architectures and MH-FFN (the fused op's translation without a router); each export takes 5 to
# 15 s on a 2-core CPU. HF_MEMFFN_ONNX_VARIANTS=all checks every entry of CASES.
DEFAULT_CASES = ("flash_mhf", "flash_mhf-mh_ffn", "kvffn", "memoryllm", "flex_memoryllm")
ALL = os.environ.get("HF_MEMFFN_ONNX_VARIANTS") == "all"
SELECTED = list(CASES) if ALL else list(DEFAULT_CASES)
# The attention mask is the shared decoder's: one architecture by default, the four with HF_MEMFFN_ONNX_VARIANTS=all.
MASKED = ["flash_mhf", "kvffn", "memoryllm", "flex_memoryllm"] if ALL else ["kvffn"]
# float16 in onnxruntime: FlashMHF's translation and MemoryLLM's Einsum by default, the four with all.
FLOAT16 = ["flash_mhf", "kvffn", "memoryllm", "flex_memoryllm"] if ALL else ["flash_mhf", "memoryllm"]
# Batch sizes and lengths other than the export's (2, 8), one token and 200 among them.
SHAPES = [(3, 11), (1, 1), (1, 200)]


@pytest.fixture(scope="module", params=SELECTED)
def exported(request, tmp_path_factory):
    """(PyTorch model, path of its ONNX export), exported once for the tests of this module."""
    arch, overrides = CASES[request.param]
    torch.manual_seed(0)
    # (weights 5x the default initialisation's: at std 0.02 the FFN moves these logits so little that a 1% error in
    # its translation would stay within the tolerance; one layer keeps the export short)
    config = tiny_config(arch, num_hidden_layers=1, initializer_range=0.1, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp(request.param) / "model.onnx"
    export_onnx(model, torch.randint(3, 320, (2, 8)), path)  # torch.export specializes a size of 1
    return model, path


def _check_logits(model, run):
    """`run(input_ids)` (numpy in, logits out) gives the PyTorch model's logits at every shape of `SHAPES`."""
    generator = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        ids = torch.randint(3, 320, shape, generator=generator)
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits.numpy()
        np.testing.assert_allclose(run(ids.numpy()), expected, rtol=1e-4, atol=1e-4, err_msg=f"shape {shape}")


def test_export_matches_pytorch_in_reference_evaluator(exported):
    model, path = exported
    graph = onnx.load(path)
    onnx.checker.check_model(graph, full_check=True)  # strict type and shape inference, as runtimes apply it
    assert not any(node.domain.startswith("memffn") for node in graph.graph.node)
    assert [value.name for value in graph.graph.input] == ["input_ids"]
    session = ReferenceEvaluator(graph)
    _check_logits(model, lambda ids: session.run(None, {"input_ids": ids})[0])


def test_export_matches_pytorch_in_onnxruntime(exported):
    ort = pytest.importorskip("onnxruntime")
    model, path = exported
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    _check_logits(model, lambda ids: session.run(None, {"input_ids": ids})[0])


@pytest.mark.parametrize("arch", MASKED)
def test_export_with_attention_mask_gives_each_left_padded_row_its_own_logits(arch, tmp_path):
    """`with_attention_mask=True`: a left-padded batch of sequences of different lengths (one token among them) gets,
    at each row's tokens, the logits of that sequence alone; in both evaluators where they are installed."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_hidden_layers=1, initializer_range=0.1)).eval()
    path = tmp_path / "model.onnx"
    export_onnx(model, torch.randint(3, 320, (2, 8)), path, with_attention_mask=True)
    graph = onnx.load(path)
    onnx.checker.check_model(graph, full_check=True)
    assert [value.name for value in graph.graph.input] == ["input_ids", "attention_mask"]
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 320, (n,), generator=generator) for n in (5, 11, 1)]
    ids, mask = left_padded(sequences)
    length = ids.shape[1]
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    runs = {"reference evaluator": ReferenceEvaluator(graph).run(None, feeds)[0]}
    try:
        import onnxruntime as ort
    except ImportError:
        pass
    else:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        runs["onnxruntime"] = session.run(None, feeds)[0]
    for name, logits in runs.items():
        for row, sequence in enumerate(sequences):
            with torch.no_grad():
                expected = model(sequence[None], use_cache=False).logits[0].numpy()
            np.testing.assert_allclose(logits[row, length - len(sequence):], expected, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name}, row {row}")


@pytest.mark.parametrize("arch", FLOAT16)
def test_float16_export_runs_in_onnxruntime(arch, tmp_path):
    """A float16 model exports and runs in onnxruntime's CPU provider (where onnxruntime is installed) at other shapes
    than the export's, and its logits are no further from the same weights computed in float32 than PyTorch's own
    float16 logits are (allowing 1.5x: the two round differently)."""
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    config = tiny_config(arch, num_hidden_layers=1, initializer_range=0.1)
    model = AutoModelForCausalLM.from_config(config).to(torch.float16).eval()
    in_float32 = copy.deepcopy(model).float()
    path = tmp_path / "model.onnx"
    export_onnx(model, torch.randint(3, 320, (2, 8)), path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        ids = torch.randint(3, 320, shape, generator=generator)
        with torch.no_grad():
            exact = in_float32(ids, use_cache=False).logits.numpy()
            pytorch_error = np.abs(model(ids, use_cache=False).logits.float().numpy() - exact).max()
        logits = session.run(None, {"input_ids": ids.numpy()})[0]
        assert logits.dtype == np.float16
        onnx_error = np.abs(logits.astype(np.float32) - exact).max()
        assert 0 < pytorch_error < 1e-2 and onnx_error <= 1.5 * pytorch_error, (shape, onnx_error, pytorch_error)


def test_a_dynamic_export_refuses_an_example_of_one_sequence(tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", num_hidden_layers=1)).eval()
    with pytest.raises(ValueError, match="batch and length of at least 2"):
        export_onnx(model, torch.randint(3, 320, (1, 8)), tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arch", ["kvffn", "flash_mhf"])
def test_a_program_captured_by_dynamo_exports_with_the_translation_table(arch):
    """A graph captured by Dynamo (strict `torch.export`, which torch's ONNX exporter falls back to where the
    non-strict capture fails) computes the rotary tables with the operator `memffn_v2::rotary_tables`: its ONNX
    conversion stopped in a DispatchError naming it, for every architecture. The table translates it too."""
    from hf_memffn.onnx_export import _Logits, onnx_translation_table

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_hidden_layers=1, initializer_range=0.1)).eval()
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    program = torch.export.export(_Logits(model), (torch.randint(3, 320, (2, 8)),), dynamic_shapes=(dims,),
                                  strict=True)
    graph = torch.onnx.export(program, dynamo=True, custom_translation_table=onnx_translation_table()).model_proto
    assert not any(node.domain.startswith("memffn") for node in graph.graph.node)
    session = ReferenceEvaluator(graph)
    name = graph.graph.input[0].name
    _check_logits(model, lambda ids: session.run(None, {name: ids})[0])


def test_a_model_saved_with_external_data_names_the_data_file_beside_it(tmp_path, monkeypatch):
    """Over 1.5 GB of weights torch saves them in `<name>.data`, which the graph names: `model.onnx.data`, not the
    temporary name the export wrote the graph under."""
    from torch.onnx._internal.exporter import _onnx_program

    monkeypatch.setattr(_onnx_program, "_LARGE_MODEL_THRESHOLD", 0)  # (as for a model over the threshold)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", num_hidden_layers=1)).eval()
    path = tmp_path / "model.onnx"
    export_onnx(model, torch.randint(3, 320, (2, 8)), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    graph = onnx.load(str(path), load_external_data=False).graph
    assert {entry.value for tensor in graph.initializer for entry in tensor.external_data
            if entry.key == "location"} == {"model.onnx.data"}
    ids = torch.randint(3, 320, (1, 5))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.numpy()
    logits = ReferenceEvaluator(onnx.load(str(path))).run(None, {"input_ids": ids.numpy()})[0]
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_model_reading_its_token_lookup_table_exports_from_the_host_and_refuses_the_disk(tmp_path):
    """A MemoryLLM reading its table exports with the table's rows as the graph's weights in cpu placement (memory FFN
    dropped); disk placement, whose rows the graph cannot hold, is refused with a line naming it, writing nothing."""
    from hf_memffn.conversion.export import export_tols

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm", num_hidden_layers=1, initializer_range=0.1))
    export_tols(model.eval(), tmp_path / "table", format="int8", progress=False)
    model.load_tols(tmp_path / "table", placement="disk")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="placement='disk'.*placement='cpu'"):
        export_onnx(model, torch.randint(3, 320, (2, 8)), out / "model.onnx")
    # (also through PEFT's wrapper, which hid the table: the export failed inside torch.export)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="placement='disk'.*placement='cpu'"):
        export_onnx(adapted, torch.randint(3, 320, (2, 8)), out / "model.onnx")
    model = adapted.unload()
    assert list(out.iterdir()) == []
    model.unload_tols()
    model.load_tols(tmp_path / "table", placement="cpu", drop_memory_ffn=True)
    export_onnx(model, torch.randint(3, 320, (2, 8)), out / "model.onnx")
    ids = torch.randint(3, 320, (3, 5))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.numpy()
    logits = ReferenceEvaluator(onnx.load(str(out / "model.onnx"))).run(None, {"input_ids": ids.numpy()})[0]
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_cuda_exports_its_device_table_and_refuses_one_in_host_memory(tmp_path):
    """On CUDA, gpu placement exports (the table's add traced as PyTorch operations, its rows the graph's weights);
    cpu placement, whose rows a Triton kernel gathers from host memory, is refused with a line naming it."""
    from hf_memffn.conversion.export import export_tols

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm", num_hidden_layers=1, initializer_range=0.1))
    export_tols(model.eval(), tmp_path / "table", format="int8", progress=False)
    model = model.cuda()
    out = tmp_path / "out"
    out.mkdir()
    model.load_tols(tmp_path / "table", placement="cpu")
    with pytest.raises(ValueError, match="placement='cpu'.*placement='gpu'"):
        export_onnx(model, torch.randint(3, 320, (2, 8), device="cuda"), out / "model.onnx")
    assert list(out.iterdir()) == []
    model.unload_tols()
    model.load_tols(tmp_path / "table", placement="gpu", drop_memory_ffn=True)
    export_onnx(model, torch.randint(3, 320, (2, 8), device="cuda"), out / "model.onnx")
    ids = torch.randint(3, 320, (3, 5), device="cuda")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.cpu().numpy()
    logits = ReferenceEvaluator(onnx.load(str(out / "model.onnx"))).run(None, {"input_ids": ids.cpu().numpy()})[0]
    np.testing.assert_allclose(logits, expected, rtol=1e-3, atol=1e-3)


def test_export_leaves_a_training_model_in_training_mode(tmp_path):
    """Exporting in the middle of training (a checkpoint callback) keeps dropout on afterwards, and a module the user
    had put in eval mode stays there."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", num_hidden_layers=1, kvffn_dropout=0.1)).train()
    model.model.embed_tokens.eval()
    export_onnx(model, torch.randint(3, 320, (2, 8)), tmp_path / "model.onnx")
    assert model.training and not model.model.embed_tokens.training
    dropouts = [module for module in model.modules() if isinstance(module, torch.nn.Dropout)]
    assert dropouts and all(module.training for module in dropouts)


@pytest.mark.parametrize("opset_version", [17, 26, "18", True])
def test_an_opset_the_exporter_would_not_write_is_refused_naming_the_allowed_ones(opset_version, tmp_path):
    """Below 18 torch's exporter wrote opset 18 anyway; above the version converter's newest (25 with onnxscript
    0.7) it wrote a graph declaring opset 18 with ops of opset 23, which no runtime loads. Refused before exporting."""
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", num_hidden_layers=1)).eval()
    with pytest.raises(ValueError, match=r"opset_version=.* allowed: an integer 18\.\.\d+"):
        export_onnx(model, torch.randint(3, 320, (2, 8)), tmp_path / "model.onnx", opset_version=opset_version)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["a directory", "a missing folder"])
def test_an_output_path_that_cannot_be_written_is_refused_before_exporting(where, tmp_path):
    """A path naming a directory, or a file in a folder that does not exist, failed only once the graph was exported
    (minutes for a large model), naming the temporary name; it is refused first, naming the path."""
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" if where == "a directory" else tmp_path / "missing" / "model.onnx"
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", num_hidden_layers=1)).eval()
    with pytest.raises(ValueError, match="directory" if where == "a directory" else "missing.*does not exist"):
        export_onnx(model, torch.randint(3, 320, (2, 8)), path)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and list((tmp_path / "out").iterdir()) == []


def test_input_ids_that_are_not_token_ids_are_refused_naming_the_dtypes(tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", num_hidden_layers=1)).eval()
    with pytest.raises(ValueError, match=r"input_ids.*torch\.float32.*torch\.long, torch\.int32"):
        export_onnx(model, torch.rand(2, 8), tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("input_ids", [[[5, 6], [7, 8]], torch.zeros(2, 0, dtype=torch.long)], ids=["list", "empty"])
def test_input_ids_that_are_no_tensor_or_hold_no_token_are_refused_naming_them(input_ids, tmp_path):
    """A list of ids ended in an AttributeError (`'list' object has no attribute 'dim'`); an example of no tokens with
    `dynamic=False` in torch.export's failure, after both of its captures, asking for a PyTorch issue."""
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", num_hidden_layers=1)).eval()
    with pytest.raises(ValueError, match=r"export_onnx: input_ids (must be a tensor|has no tokens).*allowed"):
        export_onnx(model, input_ids, tmp_path / "model.onnx", dynamic=False)
    assert list(tmp_path.iterdir()) == []


def test_flashmhf_exports_where_its_fused_layer_runs(tmp_path, monkeypatch):
    """Where the fused layer runs (CUDA with Triton), its operators have no ONNX translation and the export stopped in
    a ConversionError naming `flash_mhf_layer_keeping_queries`; the layer's reference is exported instead, and the
    model keeps its fused layer afterwards. (On the CPU the decision is patched to the CUDA one.)"""
    import hf_memffn.flash_mhf_op as flash_mhf_op

    torch.manual_seed(0)
    config = tiny_config("flash_mhf", num_hidden_layers=1, initializer_range=0.1)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 320, (3, 11))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.numpy()
    monkeypatch.setattr(flash_mhf_op, "_fused_layer_unsupported_reason", lambda p, k, impl: None)
    export_onnx(model, torch.randint(3, 320, (2, 8)), tmp_path / "model.onnx")
    assert model.model.layers[0].mlp.fused_layer
    logits = ReferenceEvaluator(onnx.load(str(tmp_path / "model.onnx"))).run(None, {"input_ids": ids.numpy()})[0]
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_flashmhf_recomputing_in_token_chunks_exports_for_any_number_of_tokens(tmp_path):
    """`ffn_recompute_chunk_tokens` (a training setting, on while gradients are) was traced into the graph with the
    chunks of the example's 16 tokens: its logits were wrong for 33 tokens and it failed for fewer than 16. The
    export leaves it out and puts it back afterwards."""
    torch.manual_seed(0)
    config = tiny_config("flash_mhf", num_hidden_layers=1, initializer_range=0.1, ffn_recompute_chunk_tokens=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / "model.onnx"
    export_onnx(model, torch.randint(3, 320, (2, 8)), path)
    assert model.model.layers[0].mlp.recompute_chunk_tokens == 4
    session = ReferenceEvaluator(onnx.load(str(path)))
    _check_logits(model, lambda ids: session.run(None, {"input_ids": ids})[0])


def test_a_longrope_model_exports_for_both_frequency_sets_and_keeps_its_own_logits(tmp_path):
    """LongRoPE picks its long-context frequencies past the original length and keeps them as an attribute, which a
    first forward during the export left as a tensor of the tracer's: a dynamic export failed in the graph's constant
    folding, and the PyTorch model's own logits past the original length were wrong afterwards. Both frequency sets
    now export, and the model computes what it computed before. A transformers that picks the set on the host (5.17)
    cannot be traced past that choice: the export is refused, naming the rope type, and writes nothing."""
    torch.manual_seed(0)
    rope = {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 16}
    config = tiny_config("kvffn", num_hidden_layers=1, initializer_range=0.1, max_position_embeddings=64,
                         rope_parameters=rope)
    model = AutoModelForCausalLM.from_config(config).eval()
    untouched = copy.deepcopy(model)
    # whether this transformers swaps the frequency buffer on the host past the original length (only there may the
    # export refuse: an export that refused every LongRoPE model would otherwise pass)
    probe = copy.deepcopy(model).model.rotary_emb
    short_frequencies = probe.inv_freq
    with torch.no_grad():
        probe(short_frequencies.new_zeros(1, 1, 1), torch.tensor([[16]]))
    picked_on_the_host = probe.inv_freq is not short_frequencies
    path = tmp_path / "model.onnx"
    try:
        export_onnx(model, torch.randint(3, 320, (2, 8)), path)
        session = ReferenceEvaluator(onnx.load(str(path)))
    except ValueError as refused:
        assert picked_on_the_host, f"refused where transformers picks the frequencies in the graph: {refused}"
        assert "rope_type='longrope'" in str(refused) and "picks the rotary frequencies on the host" in str(refused)
        assert list(tmp_path.iterdir()) == []
        session = None
    generator = torch.Generator().manual_seed(1)
    for length in (5, 30):  # within and past the original length
        ids = torch.randint(3, 320, (1, length), generator=generator)
        with torch.no_grad():
            expected = untouched(ids, use_cache=False).logits
            torch.testing.assert_close(model(ids, use_cache=False).logits, expected)
        if session is not None:
            np.testing.assert_allclose(session.run(None, {"input_ids": ids.numpy()})[0], expected.numpy(),
                                       rtol=1e-4, atol=1e-4, err_msg=f"length {length}")


def test_a_dynamic_rope_model_is_refused_naming_the_rope_types_that_export(tmp_path):
    config = tiny_config("kvffn", num_hidden_layers=1, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="rope_type='dynamic'.*allowed rope types: 'default', 'linear'"):
        export_onnx(model, torch.randint(3, 320, (2, 8)), tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_base_model_or_offloaded_weights_are_refused_before_exporting(tmp_path):
    """A base model (AutoModel, no logits) and a model whose weights `device_map` offloaded to the disk (on the meta
    device) stopped inside torch.export with an error about its internals; each is refused first, naming the way
    out, writing nothing."""
    from transformers import AutoModel

    config = tiny_config("kvffn", num_hidden_layers=1)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="KVFFNModel is a base model.*AutoModelForCausalLM"):
        export_onnx(AutoModel.from_config(config).eval(), torch.randint(3, 320, (2, 8)), out / "model.onnx")
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "checkpoint")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk", "model.norm": "cpu",
                  "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", device_map=device_map,
                                                     offload_folder=tmp_path / "offload")
    with pytest.raises(ValueError, match=r"weights of the model are not in memory \(model\.layers\.0\..*"
                                         r"device_map='cpu'"):
        export_onnx(offloaded, torch.randint(3, 320, (2, 8)), out / "model.onnx")
    assert list(out.iterdir()) == []


def test_classification_heads_export_and_a_question_answering_head_is_refused(tmp_path):
    """Sequence and token classification heads give `logits` as a causal LM does: their exports equal the PyTorch
    heads at other shapes (a sequence's logits read at its last token before padding). A question-answering head
    gives start and end logits: it stopped inside torch.export, and is refused first, writing nothing."""
    from transformers import (AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)

    config = tiny_config("kvffn", num_hidden_layers=1, initializer_range=0.1, pad_token_id=0)
    for head in (AutoModelForSequenceClassification, AutoModelForTokenClassification):
        torch.manual_seed(0)
        model = head.from_config(config).eval()
        path = tmp_path / f"{head.__name__}.onnx"
        export_onnx(model, torch.randint(3, 320, (2, 8)), path)
        session = ReferenceEvaluator(onnx.load(path))
        ids = torch.randint(3, 320, (3, 11), generator=torch.Generator().manual_seed(1))
        ids[1, 7:] = 0  # padding after the second sequence
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits.numpy()
        np.testing.assert_allclose(session.run(None, {"input_ids": ids.numpy()})[0], expected, rtol=1e-4, atol=1e-4,
                                   err_msg=head.__name__)
    out = tmp_path / "question_answering"
    out.mkdir()
    with pytest.raises(ValueError, match="KVFFNForQuestionAnswering gives start and end logits.*allowed: a model "):
        export_onnx(AutoModelForQuestionAnswering.from_config(config).eval(), torch.randint(3, 320, (2, 8)),
                    out / "model.onnx")
    assert list(out.iterdir()) == []


def test_a_sequence_classifier_without_pad_token_needs_the_attention_mask(tmp_path):
    """A sequence classifier finds each row's last token from the mask or `config.pad_token_id`: with neither, an
    export of `input_ids` alone stopped inside torch.export (the classifier's refusal wrapped in a report asking for a
    PyTorch issue); it is refused first, naming `with_attention_mask`, and exports with the mask."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("kvffn", num_hidden_layers=1, num_labels=3,
                                                                       initializer_range=0.1)).eval()
    assert model.config.pad_token_id is None
    with pytest.raises(ValueError, match=r"pad_token_id is None.*allowed: with_attention_mask=True"):
        export_onnx(model, torch.randint(3, 320, (2, 8)), tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []
    export_onnx(model, torch.randint(3, 320, (2, 8)), tmp_path / "model.onnx", with_attention_mask=True)
    ids, mask = left_padded([torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11)])
    with torch.no_grad():
        expected = torch.cat([model(ids[row:row + 1, -n:], use_cache=False).logits
                              for row, n in enumerate((5, 11))]).numpy()
    got = ReferenceEvaluator(onnx.load(tmp_path / "model.onnx")).run(None, {"input_ids": ids.numpy(),
                                                                         "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
