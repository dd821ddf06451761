"""Token lookup tables: export (formats, sharding, index metadata), integrity refusals, resume, CLI, Hub upload."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_memffn  # noqa: F401  (registers the architectures)
from hf_memffn import cli
from hf_memffn.conversion import export as export_module
from hf_memffn.conversion import export_tols
from hf_memffn.testing import tiny_config, tiny_tokenizer
from hf_memffn.token_lookup import INDEX_NAME, REPORT_NAME, TokenLookupError, weights_fingerprint


def build(arch="memoryllm", seed=0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).eval()


def lookup_values(model, tokens):
    """[T, N, d] memory outputs as the loaded table gives them (add_into on zeros)."""
    readout = model.model.token_lookup.readout(tokens.view(1, -1))
    zeros = torch.zeros(1, tokens.numel(), model.config.hidden_size)
    return torch.stack([readout.add_into(zeros, layer)[0] for layer in range(model.config.num_hidden_layers)], 1)


def exact_values(model, tokens):
    with torch.no_grad():
        return model.model.memory(model.model.embed_tokens(tokens.view(1, -1)))[0]


def own_files(directory):
    return sorted(name for name in os.listdir(directory) if name.startswith("token_lookup"))


def file_bytes(directory, suffix=""):
    """name -> bytes of the files in `directory` whose names end with `suffix`."""
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory)) if name.endswith(suffix)}


def shard_bytes(directory):
    return file_bytes(directory, ".safetensors")


@pytest.fixture(scope="module")
def model():
    return build()


# ---------------------------------------------------------------------------------------------------------------------
# layout and metadata
# ---------------------------------------------------------------------------------------------------------------------
def test_index_metadata_and_shards(model, tmp_path):
    report = export_tols(model, tmp_path, format="fp32", batch_size=64, max_shard_size="50KB", progress=False)
    with open(tmp_path / INDEX_NAME) as handle:
        index = json.load(handle)
    meta = index["metadata"]["token_lookup"]
    config = model.config
    assert (meta["vocab_size"], meta["num_hidden_layers"], meta["hidden_size"]) == (
        config.vocab_size, config.num_hidden_layers, config.hidden_size)
    assert meta["dtype"] == "float32" and meta["format"]["name"] == "fp32"
    assert meta["layers"] == list(range(config.num_hidden_layers))
    assert meta["fingerprint"] == weights_fingerprint(model)
    shards = sorted(meta["shards"])
    assert len(shards) == report["num_shards"] > 1
    assert all(name.startswith("token_lookup-") and name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    assert set(index["weight_map"].values()) == set(shards)
    assert report["size_bytes"] == sum(os.path.getsize(tmp_path / name) for name in shards)
    from safetensors import safe_open

    tensor_bytes = 0
    for name in shards:
        with safe_open(tmp_path / name, "pt") as handle:
            tensor_bytes += sum(handle.get_tensor(key).nbytes for key in handle.keys())
    assert index["metadata"]["total_size"] == tensor_bytes  # as transformers and huggingface_hub count it
    assert report["max_relative_error"] == 0.0
    # one contiguous row per token holding all its layers: rows.<start> is [rows, N * d]
    with safe_open(tmp_path / index["weight_map"]["rows.000000064"], "pt") as handle:
        block = handle.get_tensor("rows.000000064")
    assert block.shape == (64, config.num_hidden_layers * config.hidden_size)
    tokens = torch.arange(64, 128)
    torch.testing.assert_close(block.view(64, config.num_hidden_layers, -1), exact_values(model, tokens))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_export_next_to_the_model_keeps_its_files(tmp_path):
    model = build()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    model_files = sorted(n for n in os.listdir(tmp_path) if n.startswith("model"))
    assert model_files
    before = {name: os.path.getsize(tmp_path / name) for name in model_files}
    export_tols(str(tmp_path), tmp_path, format="bf16", max_shard_size="90KB", progress=False)
    export_tols(str(tmp_path), tmp_path, format="int8", group_size=32, max_shard_size="90KB", progress=False)
    assert {name: os.path.getsize(tmp_path / name) for name in model_files} == before
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    reloaded.load_tols(tmp_path, placement="cpu")
    assert reloaded.model.token_lookup.fmt.name == "int8"


def test_export_into_the_checkpoint_folder_of_other_weights_is_refused(tmp_path):
    """An export into a checkpoint folder whose saved embedding and memory FFN are not the model's replaced the table
    the folder holds for its own weights (and its card said the folder holds the new one): refused before anything is
    computed or written. The folder of the model's own weights takes it, saved in bf16 or fp16 and sharded too."""
    model, other = build(), build(seed=1)
    other.save_pretrained(tmp_path / "other")
    export_tols(str(tmp_path / "other"), tmp_path / "other", format="bf16", progress=False)
    before = file_bytes(tmp_path / "other")
    with pytest.raises(ValueError, match=r"out_dir='.*other' is the checkpoint folder of other weights than the "
                                         r"model's .* export into another directory, or save the model there first"):
        export_tols(model, tmp_path / "other", format="int8", progress=False)
    assert file_bytes(tmp_path / "other") == before
    assert export_module.checkpoint_fingerprints(tmp_path / "other")[0] == weights_fingerprint(other)
    for dtype in (torch.bfloat16, torch.float16):
        folder = tmp_path / str(dtype)
        build().to(dtype).save_pretrained(folder, max_shard_size="40KB")
        export_tols(model, folder, format="int8", progress=False)
        AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).load_tols(folder, placement="cpu")
    assert export_module.checkpoint_fingerprints(tmp_path) is None  # (no checkpoint there)


def test_a_checkpoint_saved_with_a_variant_exports_into_its_folder_and_refuses_other_weights(tmp_path, capsys):
    """`save_pretrained(folder, variant="fp16")` writes model.fp16.safetensors, which from_pretrained finds only given
    the variant: the command read the variant from the file names (it stopped with "no file named
    model.safetensors"), and an export of other weights into such a folder is refused as into any checkpoint folder
    (its weights were not read, so the refusal was skipped)."""
    model = build()
    model.save_pretrained(tmp_path / "model", variant="fp16")
    assert cli.main(["export-tols", str(tmp_path / "model"), str(tmp_path / "model"), "--format", "int8",
                     "--device", "cpu", "--no-progress"]) == 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "model", variant="fp16").load_tols(tmp_path / "model",
                                                                                       placement="cpu")
    before = file_bytes(tmp_path / "model")
    with pytest.raises(ValueError, match=r"is the checkpoint folder of other weights than the model's"):
        export_tols(build(seed=1), tmp_path / "model", format="int8", progress=False)
    assert file_bytes(tmp_path / "model") == before


def test_export_into_a_folder_without_plain_weights_is_refused_before_anything_is_written(model, tmp_path, capsys):
    """A checkpoint folder of FFN weights saved with int8 (or weight LoRA) attached, or of a PEFT adapter: no model
    loaded from it reads those as the folder's plain weights, so nothing compared them with the exported model's (the
    int8 one was refused as "other weights", the adapter taken). Both are refused naming what the folder holds, from
    Python and from the command line, before a model is loaded or a file written."""
    from peft import LoraConfig, get_peft_model

    from hf_memffn.adapters import quantize_weights_int8

    quantized = build()
    quantize_weights_int8(quantized)
    quantized.save_pretrained(tmp_path / "int8")
    get_peft_model(build(), LoraConfig(target_modules=["q_proj"], r=4)).save_pretrained(tmp_path / "lora")
    model.save_pretrained(tmp_path / "model")
    refusals = {"int8": r"out_dir='.*int8' is a checkpoint folder whose weights were saved with adapters or int8 "
                        r"attached \(hf_memffn.adapters; model.memory.parametrizations.down_proj.original0, 6 "
                        r"tensors in all\)",
                "lora": r"out_dir='.*lora' holds a PEFT adapter \(adapter_config.json\): a model loaded from it is "
                        r"its base model with the adapter"}
    for folder, message in refusals.items():
        before = file_bytes(tmp_path / folder)
        with pytest.raises(ValueError, match=message):
            export_tols(model, tmp_path / folder, format="bf16", progress=False)
        with pytest.raises(SystemExit) as stop:
            cli.main(["export-tols", str(tmp_path / "model"), str(tmp_path / folder), "--device", "cpu",
                      "--no-progress"])
        assert stop.value.code == 2 and re.search(message, capsys.readouterr().err)
        assert file_bytes(tmp_path / folder) == before


# ---------------------------------------------------------------------------------------------------------------------
# formats: each reports its size and error, and lookup stays within that error
# ---------------------------------------------------------------------------------------------------------------------
FORMATS = [
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {"group_size": 32}),
    ("int4", {"group_size": 16}),
    ("lowrank", {"energy": 0.9}),
    ("lowrank", {"rank": 64, "factor_dtype": "fp32"}),
    ("fp32", {"drop_layers": [1]}),
]


@pytest.mark.parametrize("fmt, options", FORMATS, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.values())))
def test_format_reports_its_error_and_lookup_stays_within_it(model, tmp_path, fmt, options):
    eval_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    report = export_tols(model, tmp_path, format=fmt, progress=False, eval_input_ids=eval_ids, **options)
    fp32_bytes = model.config.vocab_size * model.config.num_hidden_layers * model.config.hidden_size * 4
    full_rank = fmt == "lowrank" and "rank" in options  # coefficients as wide as the rows, plus the bases
    assert 0 < report["size_bytes"] < fp32_bytes * (1.5 if full_rank else 0.8)
    assert 0.0 <= report["mean_relative_error"] <= report["max_relative_error"]
    assert {"loss_compute", "loss_lookup", "loss_delta"} <= set(report)
    with open(tmp_path / REPORT_NAME) as handle:
        assert json.load(handle)["size_bytes"] == report["size_bytes"]
    model.load_tols(tmp_path, placement="cpu")
    try:
        tokens = torch.arange(model.config.vocab_size)
        got, exact = lookup_values(model, tokens), exact_values(model, tokens)
        kept = report["layers"]
        errors = (got[:, kept] - exact[:, kept]).norm(dim=-1) / exact[:, kept].norm(dim=-1)
        assert float(errors.max()) <= report["max_relative_error_kept_layers"] * (1 + 1e-4) + 1e-7
        assert abs(float(errors.mean()) * len(kept) / model.config.num_hidden_layers
                   + (model.config.num_hidden_layers - len(kept)) / model.config.num_hidden_layers
                   - report["mean_relative_error"]) < 1e-4
        for layer in options.get("drop_layers", []):
            assert float(got[:, layer].abs().max()) == 0.0
    finally:
        model.unload_tols()
    if fmt == "lowrank" and "energy" in options:
        assert all(1 <= r < model.config.hidden_size for r in report["ranks"])
        # each layer's rank is the smallest that keeps `energy` of the squared singular values of its outputs, and
        # the table keeps those directions: what it loses is at most the rest (plus the bf16 rounding of its factors)
        exact = exact.double()
        for layer, rank in zip(report["layers"], report["ranks"]):
            kept = torch.linalg.svdvals(exact[:, layer]).pow(2).cumsum(0)
            kept = kept / kept[-1]
            assert float(kept[rank - 1]) >= options["energy"] > (float(kept[rank - 2]) if rank > 1 else 0.0)
        lost = (got.double() - exact).pow(2).sum() / exact.pow(2).sum()
        assert float(lost) <= 1 - options["energy"] + 1e-2, float(lost)
    if fmt == "lowrank" and "rank" in options:
        assert report["max_relative_error"] < 1e-5  # full rank in fp32 is exact up to rounding


@pytest.mark.parametrize("options, field", [
    ({"format": "int3"}, "format"),
    ({"format": "int8", "group_size": 48}, "group_size"),
    ({"format": "lowrank"}, "rank or energy"),
    ({"format": "lowrank", "rank": 4, "energy": 0.5}, "rank or energy"),
    ({"format": "lowrank", "energy": 1.5}, "energy"),
    ({"format": "bf16", "rank": 4}, "rank"),
    ({"format": "int8", "rank": 4}, "rank/energy apply only to format 'lowrank', not 'int8'"),
    ({"format": "int4", "energy": 0.5}, "rank/energy apply only to format 'lowrank', not 'int4'"),
    ({"format": "bf16", "drop_layers": [0, 1]}, "drop_layers"),
    ({"format": "bf16", "drop_layers": [7]}, "drop_layers"),
    # (the CLI's "1,0" written in Python: a string was read character by character, "10" dropping layers 1 and 0)
    ({"format": "bf16", "drop_layers": "10"}, r"drop_layers='10' must be a list of layer indices"),
    ({"format": "bf16", "drop_layers": [0.5]}, r"drop_layers takes integers; got 0.5"),
    ({"format": "lowrank", "rank": 2.5}, r"rank takes integers; got 2.5"),
    ({"format": "lowrank", "energy": "0.9"}, r"energy takes a number; got '0.9'"),
    ({"format": "int8", "group_size": 16.5}, r"group_size takes integers; got 16.5"),
    ({"format": "bf16", "batch_size": 2.5}, r"batch_size takes integers; got 2.5"),
    # (recorded in the index and ignored: the format alone decides the stored dtype)
    ({"format": "int8", "factor_dtype": "fp32"}, r"factor_dtype='fp32' applies only to format 'lowrank', not 'int8'"),
    ({"format": "bf16", "factor_dtype": "bf16"}, r"factor_dtype='bf16' applies only to format 'lowrank', not 'bf16'"),
    ({"format": "fp16", "factor_dtype": "float16"}, r"factor_dtype='float16' applies only to format 'lowrank'"),
    ({"format": "lowrank", "rank": 4, "factor_dtype": "float16"}, r"`factor_dtype`='float16' is not supported"),
    # (a basis is never split across shards: its shard would be larger than the limit)
    ({"format": "lowrank", "rank": 64, "factor_dtype": "fp32", "batch_size": 8, "max_shard_size": "10KB"},
     r"max_shard_size=10000 bytes cannot hold the low-rank basis of layer 0 \(16384 bytes"),
    ({"format": "bf16", "model_dtype": "float16"}, r"`model_dtype`='float16' is not supported; allowed values: 'fp32'"),
    ({"format": "bf16", "model_dtype": "bf16"}, r"model_dtype='bf16' is the dtype a checkpoint directory is loaded in"),
    # (a loaded model is used where it is: a device it is not on failed inside the export, on the CPU "Torch not
    # compiled with CUDA enabled", on a GPU "Expected all tensors to be on the same device")
    ({"format": "bf16", "device": "cuda"}, r"device='cuda' is not where the model computes \(cpu\): a loaded "
                                           r"MemoryLLMForCausalLM is used where it is; pass device=None \(or 'cpu'\)"),
    ({"format": "bf16", "device": torch.device("meta")}, r"device='meta' is not where the model computes \(cpu\)"),
    # the held-out loss runs after the export: its ids are checked before the table is written
    ({"format": "bf16", "eval_input_ids": torch.tensor([[1, 2, 320]])},
     r"eval_input_ids contains token id 320: allowed ids are 0..319"),
    ({"format": "bf16", "eval_input_ids": torch.tensor([1, 2, 3])}, r"eval_input_ids has shape \(3,\); allowed"),
    ({"format": "bf16", "eval_input_ids": torch.tensor([[1], [2]])}, r"eval_input_ids has shape \(2, 1\); allowed"),
    ({"format": "bf16", "eval_input_ids": torch.tensor([[1.0, 2.0]])}, r"eval_input_ids has dtype torch.float32"),
    ({"format": "bf16", "eval_input_ids": [[1, 2, 3]]}, r"eval_input_ids takes a tensor of token ids"),
    ({"format": "bf16", "eval_input_ids": torch.tensor([[1, 2]]), "eval_text": "a text"},
     r"eval_text and eval_input_ids both give the held-out tokens"),
])
def test_bad_export_options_name_the_field(model, tmp_path, options, field):
    with pytest.raises(ValueError, match=field):
        export_tols(model, tmp_path, progress=False, **options)
    assert not own_files(tmp_path)


def test_a_loaded_model_exports_with_device_naming_where_it_is(model, tmp_path):
    """device= names where a checkpoint directory is loaded; for a loaded model, its own device is accepted."""
    expected = export_tols(model, tmp_path / "default", format="fp32", progress=False)
    report = export_tols(model, tmp_path / "cpu", format="fp32", device="cpu", progress=False)
    assert report["max_relative_error"] == expected["max_relative_error"]
    assert shard_bytes(tmp_path / "cpu") == shard_bytes(tmp_path / "default")


def test_the_tokens_of_an_eval_text_outside_the_vocabulary_are_refused_before_anything_is_written(tmp_path):
    """A tokenizer with a larger vocabulary than the model's: its ids are named before the export, not after it."""
    with pytest.raises(ValueError, match=r"eval_text \(tokenized\) contains token id \d+: allowed ids are 0..99"):
        export_tols(build(vocab_size=100), tmp_path / "tol", format="bf16", progress=False,
                    eval_text="the memory stores a value of the key " * 4, tokenizer=tiny_tokenizer())
    assert not (tmp_path / "tol").exists()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16])
def test_eval_ids_of_any_integer_dtype_give_the_heldout_loss_of_int64_ids(model, tmp_path, dtype):
    """The ids of token shards are uint16, numpy's often int32: int32 and int16 ids passed the check and failed in the
    held-out loss after the table was written (the embedding and the loss take int64), 8-bit ids below vocab_size were
    refused as outside it (vocab_size compared in their dtype), and uint16 ones ended in "not implemented"."""
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = export_tols(model, tmp_path / "int64", format="bf16", eval_input_ids=ids, progress=False)
    report = export_tols(model, tmp_path / "other", format="bf16", eval_input_ids=ids.to(dtype), progress=False)
    assert (report["loss_compute"], report["loss_lookup"], report["eval_tokens"]) == (
        expected["loss_compute"], expected["loss_lookup"], expected["eval_tokens"])
    if dtype in (torch.int16, torch.int32):
        with pytest.raises(ValueError, match=r"eval_input_ids contains token id 320: allowed ids are 0..319"):
            export_tols(model, tmp_path / "outside", format="bf16",
                        eval_input_ids=torch.tensor([[1, 320]], dtype=dtype), progress=False)
        assert not (tmp_path / "outside").exists()


FOLDER_CLASSES = ["AutoModel", "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                  "AutoModelForQuestionAnswering"]


def save_as(model, auto_class, folder):
    """`model`'s weights saved from the class `auto_class` builds (a base model or a task head, with its new head)."""
    import transformers

    model.save_pretrained(folder.parent / "causal_lm")
    getattr(transformers, auto_class).from_pretrained(folder.parent / "causal_lm").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("auto_class", FOLDER_CLASSES)
def test_a_folder_saved_from_a_base_model_or_a_task_head_exports_the_causal_lms_table_without_a_new_lm_head(
        model, tmp_path, auto_class):
    """The table needs the embedding and the memory FFNs only: such a folder was loaded as a causal LM, which drew a
    random LM head (reported "lm_head.weight MISSING, newly initialized") that the held-out loss then used."""
    folder = save_as(model, auto_class, tmp_path / "saved")
    loaded = export_module._load_model(str(folder), "cpu", None)
    assert type(loaded).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert loaded.get_output_embeddings() is None
    export_tols(str(folder), tmp_path / "table", format="fp32", progress=False)
    export_tols(str(tmp_path / "causal_lm"), tmp_path / "causal_lm_table", format="fp32", progress=False)
    assert shard_bytes(tmp_path / "table") == shard_bytes(tmp_path / "causal_lm_table")


@pytest.mark.parametrize("loaded", [False, True], ids=["folder", "loaded"])
@pytest.mark.parametrize("auto_class", FOLDER_CLASSES)
def test_the_heldout_loss_of_a_model_without_an_lm_head_is_refused_naming_its_class_before_anything_is_written(
        model, tmp_path, auto_class, loaded):
    """A folder's random LM head gave a held-out loss of its own; a loaded head model failed after the table was
    written (no `logits`, logits of its labels, targets out of bounds)."""
    import transformers

    folder = save_as(model, auto_class, tmp_path / "saved")
    source = getattr(transformers, auto_class).from_pretrained(folder) if loaded else str(folder)
    name = json.loads((folder / "config.json").read_text())["architectures"][0]
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=rf"eval_input_ids: the held-out loss needs a causal LM's next-token logits, "
                                         rf"and the model is a {name} \(no LM head"):
        export_tols(source, tmp_path / "table", format="int8", eval_input_ids=ids, progress=False)
    assert not (tmp_path / "table").exists()


def test_the_demo_step_refuses_a_folder_without_an_lm_head_naming_its_class(model, tmp_path):
    """Its logits and generate() need the causal LM's head: a task head's folder gave them from a random one."""
    from hf_memffn.conversion import demo_step

    folder = save_as(model, "AutoModelForSequenceClassification", tmp_path / "saved")
    with pytest.raises(ValueError, match=r"demo_step: .* MemoryLLMForSequenceClassification \(no LM head"):
        demo_step(folder, tmp_path / "tables", formats=("fp32",), max_new_tokens=2, device="cpu")
    assert not (tmp_path / "tables").exists()


def test_a_max_shard_size_below_one_row_block_is_refused_naming_a_batch_size_that_fits(model, tmp_path):
    """A row block is never split across shards: a limit that one block exceeds is refused before anything is
    written (it gave shards larger than the limit), and the batch size the error names gives shards within it."""
    table = tmp_path / "table"
    with pytest.raises(ValueError, match=r"max_shard_size=10000 bytes cannot hold one row block of batch_size=256 "
                                         r"tokens \(131072 bytes.*allowed: max_shard_size >= 131072, or "
                                         r"batch_size <= 19 \(tokens per block\)"):
        export_tols(model, table, format="fp32", batch_size=256, max_shard_size="10KB", progress=False)
    assert not table.exists()
    with pytest.raises(ValueError, match=r"one token's row is 512 bytes"):
        export_tols(model, table, format="fp32", batch_size=4, max_shard_size=500, progress=False)
    assert not table.exists()
    from hf_memffn.token_lookup import read_safetensors_header

    for fmt, options in [("fp32", {}), ("int8", {"group_size": 32}), ("lowrank", {"rank": 16})]:
        report = export_tols(model, table, format=fmt, batch_size=19, max_shard_size="10KB", progress=False, **options)
        assert report["num_shards"] > 1
        for name in own_files(table):
            if name.endswith(".safetensors"):
                _, header = read_safetensors_header(str(table / name))
                assert sum(end - begin for key, info in header.items() if key != "__metadata__"
                           for begin, end in [info["data_offsets"]]) <= 10_000


def test_an_export_puts_the_modules_back_in_the_mode_they_were_in(model, tmp_path):
    """Exporting mid-training (with its held-out loss) runs in eval mode and leaves the model training, as it was
    (it was left in eval mode: the rest of the training ran without dropout, without a word)."""
    trained = build()
    trained.train()
    trained.lm_head.eval()  # (each module's own mode is put back)
    modes = [module.training for module in trained.modules()]
    eval_ids = torch.randint(0, trained.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    export_tols(trained, tmp_path, format="fp32", progress=False, eval_input_ids=eval_ids)
    assert [module.training for module in trained.modules()] == modes
    assert trained.model.token_lookup is None
    trained.eval()
    export_tols(trained, tmp_path, format="int8", progress=False)
    assert not any(module.training for module in trained.modules())


def test_the_heldout_loss_delta_refuses_a_model_without_its_memory_ffn_and_keeps_its_table(model, tmp_path):
    """`lookup_loss_delta` computes the loss in compute mode first: a model that dropped its memory FFN is refused
    before anything changes (it failed half-way, leaving the model without its table and so without any memory)."""
    from hf_memffn.conversion import lookup_loss_delta

    export_tols(model, tmp_path / "fp32", format="fp32", progress=False)
    export_tols(model, tmp_path / "int8", format="int8", progress=False)
    serving = build()
    table = serving.load_tols(tmp_path / "fp32", placement="cpu", drop_memory_ffn=True)
    ids = torch.randint(0, serving.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"lookup_loss_delta: .*dropped.*load the checkpoint again"):
        lookup_loss_delta(serving, tmp_path / "int8", ids)
    assert serving.model.token_lookup is table
    serving(input_ids=ids)
    delta = lookup_loss_delta(model, tmp_path / "int8", ids)  # (with its weights: both losses, compute mode after)
    assert abs(delta["loss_delta"]) < 0.05 and model.model.token_lookup is None


def test_a_peft_model_exports_its_table(model, tmp_path):
    """A MemoryLLM under a PEFT adapter that leaves X0 and the memory FFN alone (LoRA on the attention) exports the
    table of its weights (it was refused as if it were not a MemoryLLM), which the model without the adapter takes."""
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(build(), LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    export_tols(adapted, tmp_path, format="fp32", progress=False)
    tokens = torch.arange(model.config.vocab_size)
    model.load_tols(tmp_path, placement="cpu")
    try:
        torch.testing.assert_close(lookup_values(model, tokens), exact_values(model, tokens), rtol=0, atol=0)
    finally:
        model.unload_tols()


@pytest.mark.parametrize("fmt, options", [("fp16", {}), ("lowrank", {"rank": 8, "factor_dtype": "fp16"})],
                         ids=["fp16", "lowrank-fp16-factors"])
def test_outputs_beyond_the_formats_range_are_refused(tmp_path, fmt, options):
    """Memory outputs above fp16's largest value (65504): an fp16 table, or a low-rank one of fp16 coefficients, would
    hold inf (NaN logits once loaded). The export stops with an error naming the formats that hold them (int8's scales
    are bf16); bf16 does. Non-finite outputs (damaged weights) are refused in any format."""
    model = build()
    with torch.no_grad():
        model.model.memory.down_proj.mul_(2e7)
    with pytest.raises(ValueError, match=f"format '{fmt}' cannot hold.*'bf16' or 'fp32'"):
        export_tols(model, tmp_path / fmt, format=fmt, progress=False, **options)
    assert not (tmp_path / fmt / INDEX_NAME).exists()
    report = export_tols(model, tmp_path / "bf16", format="bf16", progress=False)
    assert report["max_relative_error"] < 1e-2
    with torch.no_grad():
        model.model.memory.down_proj.fill_(float("nan"))
    with pytest.raises(ValueError, match="not finite.*diverged"):
        export_tols(model, tmp_path / "nan", format="fp32", progress=False)


def test_a_refused_export_leaves_the_table_in_the_folder_as_it_was(tmp_path):
    """An export refused for its values (here outputs past fp16's range) over a valid table of another format: every
    value is checked before the old index or a shard is removed or rewritten, so the table still loads."""
    model = build()
    with torch.no_grad():
        model.model.memory.down_proj.mul_(2e7)
    export_tols(model, tmp_path, format="bf16", batch_size=100, max_shard_size="30KB", progress=False)
    before = file_bytes(tmp_path)
    assert len(before) > 3
    with pytest.raises(ValueError, match="format 'fp16' cannot hold"):
        export_tols(model, tmp_path, format="fp16", batch_size=100, max_shard_size="30KB", progress=False)
    assert file_bytes(tmp_path) == before
    model.load_tols(tmp_path, placement="cpu")
    model.unload_tols()


def test_a_refused_export_into_an_empty_folder_leaves_it_empty(tmp_path):
    """Refused at a later block (tokens 250.. give NaN): the shards of the blocks before it are removed too, so no
    half-export is left that `load_tols` would call interrupted."""
    model = build()
    with torch.no_grad():
        model.model.embed_tokens.weight[250:] = float("nan")
    for fmt in ("bf16", "lowrank"):
        with pytest.raises(ValueError, match="not finite for tokens 200..299"):
            export_tols(model, tmp_path, format=fmt, rank=4 if fmt == "lowrank" else None, batch_size=100,
                        max_shard_size="30KB", progress=False)
        assert os.listdir(tmp_path) == []


def test_non_memory_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="KVFFNForCausalLM has no FFNs on the token embeddings"):
        export_tols(build("kvffn"), tmp_path, progress=False)


def test_an_adapter_on_the_token_embedding_is_refused_before_anything_is_written(tmp_path):
    """PEFT's LoRA on `embed_tokens` changes X0: a table exported through it would hold the adapter's values under
    the fingerprint of the embedding's weight, which the model without the adapter takes (other logits, no word)."""
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(build(), LoraConfig(target_modules=["embed_tokens"], r=4, init_lora_weights=False))
    with pytest.raises(ValueError, match=r"lora_embedding_A.*merge_and_unload"):
        export_tols(adapted.get_base_model(), tmp_path / "tol", format="fp32", progress=False)
    assert not (tmp_path / "tol").exists()
    merged = adapted.merge_and_unload()
    export_tols(merged, tmp_path / "tol", format="fp32", progress=False)
    merged.load_tols(tmp_path / "tol", placement="cpu")
    with pytest.raises(TokenLookupError, match="other weights"):
        build().load_tols(tmp_path / "tol", placement="cpu")


def test_an_out_dir_that_is_a_file_is_refused_naming_it(model, tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(ValueError, match=r"out_dir=.*a_file'? is a file; allowed: a directory"):
        export_tols(model, tmp_path / "a_file", format="bf16", progress=False)
    assert (tmp_path / "a_file").read_text() == "not a directory"


def test_an_empty_out_dir_is_refused_naming_it(model, tmp_path, monkeypatch, capsys):
    """An empty OUT_DIR (an unset shell variable) is refused before the model is loaded, not read as the current
    directory or failed on once the model is loaded."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"out_dir='' is an empty path; allowed: a directory"):
        export_tols(model, "", format="bf16", progress=False)
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as stop:
        cli.main(["export-tols", str(tmp_path / "model"), "", "--device", "cpu", "--no-progress"])
    assert stop.value.code == 2
    assert "argument OUT_DIR: '' is an empty path; allowed: a directory" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["model"] and INDEX_NAME not in os.listdir(tmp_path / "model")


# ---------------------------------------------------------------------------------------------------------------------
# integrity
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def exported(model, tmp_path):
    export_tols(model, tmp_path, format="bf16", batch_size=100, max_shard_size="30KB", progress=False)
    return tmp_path


def test_table_from_other_weights_is_refused(exported):
    other = build(seed=0)
    with torch.no_grad():
        other.model.embed_tokens.weight[5, 0] += 0.5  # one changed embedding value
    with pytest.raises(TokenLookupError, match="other weights"):
        other.load_tols(exported, placement="cpu")
    other = build(seed=0)
    with torch.no_grad():
        other.model.memory.down_proj[1, 2, 3] *= 2
    with pytest.raises(TokenLookupError, match="other weights"):
        other.load_tols(exported, placement="cpu")
    assert other.model.token_lookup is None


@pytest.mark.parametrize("field, value", [("rms_norm_eps", 1e-3), ("hidden_act", "gelu")])
def test_a_table_is_refused_by_the_same_weights_under_a_config_that_computes_other_rows(exported, field, value):
    """The rows depend on the memory FFN's norm eps and activation as much as on its weights: a model built with another
    of them (same weights) would add rows it does not compute."""
    other = build(seed=0, **{field: value})
    with pytest.raises(TokenLookupError, match="other weights"):
        other.load_tols(exported, placement="cpu")
    assert other.model.token_lookup is None


def test_same_weights_in_another_dtype_are_accepted(model, exported):
    bf16_copy = build(seed=0).to(torch.bfloat16)
    bf16_copy.load_tols(exported, placement="cpu")
    fp16_copy = build(seed=0).to(torch.float16)  # (rounding to fp16, then to bf16, differs from rounding to bf16)
    assert weights_fingerprint(fp16_copy) != weights_fingerprint(model)
    fp16_copy.load_tols(exported, placement="cpu", drop_memory_ffn=True)
    fp16_copy.load_tols(exported, placement="cpu")  # (the fingerprint kept at drop time)


@pytest.mark.parametrize("export_dtype,refused_by", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_a_table_exported_from_16_bit_weights_is_taken_by_them_and_by_fp32(tmp_path, export_dtype, refused_by):
    """`export-tols --model-dtype fp16` (or bf16): both fingerprints of the table are of 16-bit weights. The
    checkpoint loaded in fp32 rounds to those weights, so it takes the table; loaded in the other 16-bit dtype it does
    not (rounded twice), and the error says which table every dtype takes."""
    export_model = build(seed=0).to(export_dtype)
    export_tols(export_model, tmp_path, format="bf16", batch_size=100, progress=False)
    export_model.load_tols(tmp_path, placement="cpu")
    build(seed=0).load_tols(tmp_path, placement="cpu")
    with pytest.raises(TokenLookupError, match="other weights.*exported from the weights in fp32 is taken"):
        build(seed=0).to(refused_by).load_tols(tmp_path, placement="cpu")


def test_a_table_taken_through_fp16_rounding_is_still_taken_once_the_memory_ffn_is_dropped(tmp_path):
    """The fp32 checkpoint takes a table exported from its weights in fp16 by their fp16 fingerprint; with the memory
    FFN dropped, the fingerprints kept then still take it (e.g. loaded again in another placement)."""
    export_tols(build(seed=0).to(torch.float16), tmp_path, format="fp16", batch_size=100, progress=False)
    fp32_model = build(seed=0)
    fp32_model.load_tols(tmp_path, placement="cpu", drop_memory_ffn=True)
    fp32_model.load_tols(tmp_path, placement="disk")
    assert fp32_model.model.token_lookup.placement == "disk"
    with pytest.raises(TokenLookupError, match="other weights"):
        build(seed=1).load_tols(tmp_path, placement="cpu")


def _edit_index(directory, edit):
    with open(directory / INDEX_NAME) as handle:
        index = json.load(handle)
    edit(index, index["metadata"]["token_lookup"])
    with open(directory / INDEX_NAME, "w") as handle:
        json.dump(index, handle)


@pytest.mark.parametrize("edit,message", [
    (lambda index, meta: index.pop("weight_map"), "`weight_map`=None must map tensor names"),
    (lambda index, meta: meta.pop("rows_per_block"), "`token_lookup.rows_per_block`=None must be a positive integer"),
    (lambda index, meta: meta.update(rows_per_block=0), "`token_lookup.rows_per_block`=0 must be a positive"),
    (lambda index, meta: meta.update(vocab_size="320"), "`token_lookup.vocab_size`='320' must be a positive"),
    (lambda index, meta: meta.update(format="int8"), "`token_lookup.format`='int8' must be an object"),
    (lambda index, meta: meta["format"].update(bits=4), r"`token_lookup.format`=.* is not a valid format"),
    (lambda index, meta: meta.update(layers=[0]), r"`token_lookup.layers`=\[0\] must be the layers its format keeps"),
    (lambda index, meta: meta.update(shards=list(meta["shards"])), "`token_lookup.shards`=.* must map each shard"),
    (lambda index, meta: meta.update(fingerprint=None), "`token_lookup.fingerprint`=None must be a string"),
    (lambda index, meta: meta.update(shards={f"../{name}": info for name, info in meta["shards"].items()}),
     r"`token_lookup.shards`=.* must name files token_lookup\*\.safetensors in the table's folder, not "
     r"'\.\./token_lookup"),
    (lambda index, meta: meta["format"].update(group_size=8), r"scales.000000000 .* has shape \(100, 8\) but its "
                                                              r"index describes \(100, 16\)"),
], ids=["no-weight_map", "no-rows_per_block", "rows_per_block-0", "vocab_size-str", "format-str", "format-unknown-key",
        "layers-wrong", "shards-list", "fingerprint-null", "shard-outside-the-folder", "group_size-wrong"])
def test_an_index_with_fields_of_the_wrong_type_or_value_is_named(model, tmp_path, edit, message):
    """The index (valid JSON, not covered by the shards' sha256) is checked field by field, and the stored tensors'
    shapes against it: the error names the field, where a KeyError, a TypeError or a shape mismatch in the first
    forward came before."""
    export_tols(model, tmp_path, format="int8", group_size=16, batch_size=100, progress=False)
    _edit_index(tmp_path, edit)
    with pytest.raises(TokenLookupError, match=message):
        model.load_tols(tmp_path, placement="cpu")
    assert model.model.token_lookup is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_shard_is_named(model, exported, damage):
    shard = sorted(n for n in os.listdir(exported) if n.startswith("token_lookup-"))[1]
    path = exported / shard
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "flip":
        data[-10] ^= 0xFF
        path.write_bytes(data)
    else:
        path.unlink()
    with pytest.raises(TokenLookupError, match=shard):
        model.load_tols(exported, placement="cpu")
    if damage == "flip":  # a size-only check cannot see a flipped byte; the default full check does
        model.load_tols(exported, placement="cpu", verify="size")
        model.unload_tols()


def _edit_shard_header(path, edit):
    """Rewrite the safetensors header of `path` by `edit(header, key)` (`key`: its second row block), padded with
    spaces to its old length (the file keeps its size, as a shard altered in place does)."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edited = edit(header, "rows.000000100")
    text = json.dumps(header if edited is None else edited, separators=(",", ":")).encode()
    assert len(text) <= length
    path.write_bytes(data[:8] + text.ljust(length) + data[8 + length:])


def _rename_field(entry, old, new):
    entry[new] = entry.pop(old)


@pytest.mark.parametrize("edit, size_message", [
    (lambda header, key: _rename_field(header[key], "data_offsets", "data_offset"), "damaged safetensors header"),
    (lambda header, key: _rename_field(header[key], "shape", "shap"), "damaged safetensors header"),
    (lambda header, key: header[key].update(dtype="I16"), "damaged safetensors header"),
    (lambda header, key: list(header), "damaged safetensors header: not a JSON object"),
    (lambda header, key: header[key].update(dtype="F16"),
     r"rows.000000100 .* has dtype torch.float16 but its format 'bf16' stores torch.bfloat16"),
], ids=["no-data_offsets", "no-shape", "unknown-dtype", "not-an-object", "other-dtype-of-the-same-size"])
def test_a_shard_whose_header_was_altered_in_place_is_named(model, exported, edit, size_message):
    """A shard whose header was edited without changing its size: the full check names the shard, and the size check
    (which reads the headers) names the shard or the tensor, where a KeyError or an AttributeError without a file name
    came before, or (a dtype of the same size) the rows were read as another dtype."""
    shard = json.loads((exported / INDEX_NAME).read_text())["weight_map"]["rows.000000100"]
    _edit_shard_header(exported / shard, edit)
    with pytest.raises(TokenLookupError, match=shard):
        model.load_tols(exported, placement="disk")
    if size_message.startswith("damaged"):
        size_message = f"shard {shard} has a {size_message}"
    with pytest.raises(TokenLookupError, match=size_message):
        model.load_tols(exported, placement="disk", verify="size")
    assert model.model.token_lookup is None


def test_interrupted_export_never_loads_and_resumes(model, tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    export_tols(model, reference, format="int4", group_size=16, batch_size=32, max_shard_size="6KB", progress=False)
    target = tmp_path / "target"
    real_save = export_module.save_file
    calls = {"n": 0}

    def failing_save(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:
            with open(filename, "wb") as handle:  # a half-written temporary file, then the crash
                handle.write(b"partial")
            raise KeyboardInterrupt
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(export_module, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        export_tols(model, target, format="int4", group_size=16, batch_size=32, max_shard_size="6KB", progress=False)
    monkeypatch.setattr(export_module, "save_file", real_save)
    assert not (target / INDEX_NAME).exists()
    with pytest.raises(TokenLookupError, match="interrupted"):
        model.load_tols(target, placement="cpu")
    report = export_tols(model, target, format="int4", group_size=16, batch_size=32, max_shard_size="6KB",
                         progress=False)
    assert report["resumed"]
    assert own_files(target) == own_files(reference)
    from safetensors.torch import load_file

    for name in own_files(reference):
        if name.endswith(".safetensors"):  # same tensors (the bytes differ: safetensors orders metadata freely)
            expected, got = load_file(reference / name), load_file(target / name)
            assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    with open(reference / INDEX_NAME) as a, open(target / INDEX_NAME) as b:
        assert json.load(a)["metadata"]["token_lookup"]["error"] == json.load(b)["metadata"]["token_lookup"]["error"]
    again = export_tols(model, target, format="int4", group_size=16, batch_size=32, max_shard_size="6KB",
                        progress=False)
    assert again["already_complete"]


def test_an_export_killed_while_writing_its_first_shard_is_named_interrupted(model, tmp_path):
    """Killed (no exception handler runs) while the first shard was written: the folder holds only that shard's
    hidden temporary (`atomic_write`'s `.<name>.<pid>.<random>.tmp`), and `load_tols` says the export was
    interrupted; running it again writes the table and removes the temporary."""
    (tmp_path / ".token_lookup.safetensors.4242.0a1b2c3d.tmp").write_bytes(b"partial")
    with pytest.raises(TokenLookupError, match="an export was interrupted; run it again"):
        model.load_tols(tmp_path, placement="cpu")
    export_tols(model, tmp_path, format="bf16", progress=False)
    assert own_files(tmp_path) == sorted([INDEX_NAME, REPORT_NAME, "token_lookup.safetensors"])
    assert sorted(os.listdir(tmp_path)) == own_files(tmp_path)


def test_running_the_export_again_repairs_a_shard_cut_short(model, tmp_path):
    """A shard cut short after a complete export (the exporter does not fsync: a power cut) is written again by the
    same export, and the shards that are whole are kept."""
    options = dict(format="bf16", batch_size=64, max_shard_size="30KB", progress=False)
    export_tols(model, tmp_path, **options)
    shards = sorted(n for n in os.listdir(tmp_path) if n.startswith("token_lookup-"))
    whole = {name: (tmp_path / name).read_bytes() for name in shards}
    (tmp_path / shards[1]).write_bytes(whole[shards[1]][: len(whole[shards[1]]) // 2])
    report = export_tols(model, tmp_path, **options)
    assert not report["already_complete"] and report["resumed"]
    assert {name: (tmp_path / name).read_bytes() for name in shards} == whole
    model.load_tols(tmp_path, placement="cpu")
    model.unload_tols()


def test_running_the_export_again_repairs_a_shard_altered_in_place(model, tmp_path):
    """A byte of a shard changed after the export (bit rot, a bad copy; the size is the same): `load_tols` names the
    shard, and the same export compares every shard's sha256 with the index and writes that shard again."""
    options = dict(format="bf16", batch_size=64, max_shard_size="30KB", progress=False)
    export_tols(model, tmp_path, **options)
    whole = shard_bytes(tmp_path)
    altered = sorted(whole)[1]
    data = bytearray(whole[altered])
    data[-10] ^= 0xFF
    (tmp_path / altered).write_bytes(bytes(data))
    with pytest.raises(TokenLookupError, match=altered):
        model.load_tols(tmp_path, placement="cpu")
    report = export_tols(model, tmp_path, **options)
    assert not report["already_complete"] and report["resumed"]
    assert shard_bytes(tmp_path) == whole
    model.load_tols(tmp_path, placement="cpu")
    model.unload_tols()


def test_the_model_in_another_dtype_gets_its_own_table_and_never_shares_shards(tmp_path):
    """The same weights loaded in bf16 give other values than in fp32 (the fingerprint is the same): exporting the
    bf16 model over the fp32 model's table writes it anew, and an interrupted export resumed in the other dtype keeps
    none of its shards; each ends byte-identical to an uninterrupted export of the model it was run with."""
    fp32_model, bf16_model = build(), build().to(torch.bfloat16)
    options = dict(format="fp32", batch_size=100, max_shard_size="52KB", progress=False)
    export_tols(fp32_model, tmp_path / "fp32", **options)
    export_tols(bf16_model, tmp_path / "bf16", **options)
    assert shard_bytes(tmp_path / "fp32") != shard_bytes(tmp_path / "bf16")
    table = tmp_path / "table"
    export_tols(fp32_model, table, **options)
    report = export_tols(bf16_model, table, **options)
    assert not report["already_complete"] and not report["resumed"]
    assert shard_bytes(table) == shard_bytes(tmp_path / "bf16")
    os.remove(table / INDEX_NAME)  # interrupted before its last shard
    os.remove(table / sorted(shard_bytes(table))[-1])
    report = export_tols(fp32_model, table, **options)
    assert not report["resumed"]
    assert shard_bytes(table) == shard_bytes(tmp_path / "fp32")


def test_a_lowrank_rerun_that_fits_other_bases_writes_every_shard_again(model, tmp_path, monkeypatch):
    """The first shard (holding the bases) cut short, and the bases fitted again come out otherwise (eigenvectors'
    signs depend on the eigensolver's threads): the coefficients in the other shards fit the old bases only, so they
    are written again, and the table's error is the one the index reports."""
    options = dict(format="lowrank", rank=64, factor_dtype="fp32", batch_size=64, max_shard_size="33KB",
                   progress=False)
    export_tols(model, tmp_path, **options)
    first = sorted(shard_bytes(tmp_path))[0]
    os.truncate(tmp_path / first, os.path.getsize(tmp_path / first) - 100)
    real_eigh = torch.linalg.eigh

    def eigh_other_signs(matrix):
        eigenvalues, eigenvectors = real_eigh(matrix)
        return eigenvalues, -eigenvectors

    monkeypatch.setattr(torch.linalg, "eigh", eigh_other_signs)
    report = export_tols(model, tmp_path, **options)
    assert not report["resumed"] and report["max_relative_error"] < 1e-5
    model.load_tols(tmp_path, placement="cpu")
    try:
        tokens = torch.arange(model.config.vocab_size)
        got, exact = lookup_values(model, tokens), exact_values(model, tokens)
        errors = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
        assert float(errors.max()) <= report["max_relative_error"] * (1 + 1e-4) + 1e-7
    finally:
        model.unload_tols()


def test_a_lowrank_rerun_over_a_damaged_basis_fits_the_bases_again(model, tmp_path):
    """A basis damaged in place in the first shard is not reused (the shards record the bases' sha256): the bases
    are fitted again, and the table is byte-identical to the one exported before the damage."""
    from hf_memffn.token_lookup import basis_key, read_safetensors_header

    options = dict(format="lowrank", rank=8, batch_size=64, max_shard_size="4KB", progress=False)
    export_tols(model, tmp_path, **options)
    whole = shard_bytes(tmp_path)
    assert len(whole) > 2
    first = tmp_path / sorted(whole)[0]
    data_start, header = read_safetensors_header(str(first))
    begin, _ = header[basis_key(0)]["data_offsets"]
    data = bytearray(whole[first.name])
    data[data_start + begin + 1] ^= 0x01  # the lowest exponent bit of the first value of layer 0's basis
    first.write_bytes(bytes(data))
    report = export_tols(model, tmp_path, **options)
    assert not report["already_complete"] and report["resumed"]
    assert shard_bytes(tmp_path) == whole


def test_the_base_model_loads_a_table(model, exported):
    """`load_tols` on the base model (`AutoModel`), as on the causal LM: the same hidden states."""
    base = model.model
    tokens = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        computed = base(tokens).last_hidden_state
        base.load_tols(exported, placement="cpu")
        looked_up = base(tokens).last_hidden_state
    base.unload_tols()
    torch.testing.assert_close(looked_up, computed, rtol=2e-2, atol=2e-2)  # (a bf16 table)


def test_reexport_with_other_settings_replaces_the_table(model, tmp_path):
    export_tols(model, tmp_path, format="fp32", batch_size=64, max_shard_size="33KB", progress=False)
    many = own_files(tmp_path)
    export_tols(model, tmp_path, format="int8", group_size=32, progress=False)
    assert own_files(tmp_path) == sorted([INDEX_NAME, REPORT_NAME, "token_lookup.safetensors"])
    assert len(many) > 3
    model.load_tols(tmp_path, placement="disk")
    assert model.model.token_lookup.fmt.name == "int8"
    model.unload_tols()


def test_a_reexport_stopped_during_its_heldout_loss_leaves_no_report_of_the_old_table(model, tmp_path, monkeypatch):
    """The new index is written before the held-out loss, the report after it: stopped in between, the folder held
    the old table's report (its format, errors and loss) beside the new table, which a push uploaded with it."""
    eval_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    export_tols(model, tmp_path, format="int8", eval_input_ids=eval_ids, progress=False)
    assert (tmp_path / REPORT_NAME).exists()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "heldout_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_tols(model, tmp_path, format="fp32", eval_input_ids=eval_ids, progress=False)
    assert json.loads((tmp_path / INDEX_NAME).read_text())["metadata"]["token_lookup"]["format"]["name"] == "fp32"
    assert not (tmp_path / REPORT_NAME).exists()
    assert REPORT_NAME not in export_module.table_files(str(tmp_path))
    monkeypatch.undo()
    report = export_tols(model, tmp_path, format="fp32", eval_input_ids=eval_ids, progress=False)
    assert report["already_complete"] and json.loads((tmp_path / REPORT_NAME).read_text())["format"]["name"] == "fp32"


def test_lowrank_resume_reuses_the_stored_bases(model, tmp_path, monkeypatch):
    options = dict(format="lowrank", energy=0.8, batch_size=64, max_shard_size="20KB", progress=False)
    export_tols(model, tmp_path, **options)
    os.remove(tmp_path / INDEX_NAME)
    last = sorted(n for n in os.listdir(tmp_path) if n.startswith("token_lookup-"))[-1]
    os.remove(tmp_path / last)
    monkeypatch.setattr(export_module._Exporter, "_fit_lowrank", lambda *a: pytest.fail("bases refitted"))
    report = export_tols(model, tmp_path, **options)
    assert report["resumed"]
    model.load_tols(tmp_path, placement="cpu")
    model.unload_tols()


# ---------------------------------------------------------------------------------------------------------------------
# command line and Hub
# ---------------------------------------------------------------------------------------------------------------------
def test_cli_exports_with_heldout_loss(tmp_path, capsys):
    model = build()
    model.attach_tokenizer(tiny_tokenizer())
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    text = tmp_path / "heldout.txt"
    text.write_text("the memory stores a value of the key. " * 40)
    assert cli.main(["export-tols", str(model_dir), str(tmp_path / "tol"), "--format", "int8", "--group-size", "32",
                     "--eval-text", str(text), "--device", "cpu", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "held-out loss" in printed and "relative error" in printed
    with open(tmp_path / "tol" / REPORT_NAME) as handle:
        report = json.load(handle)
    assert abs(report["loss_delta"]) < 0.05 and report["eval_tokens"] > 100


def test_cli_factor_dtype_is_refused_for_formats_other_than_lowrank(model, tmp_path, capsys):
    """`--factor-dtype` was ignored (its default was always set) for other formats; lowrank without it stores bf16."""
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    with pytest.raises(SystemExit) as stop:
        cli.main(["export-tols", str(model_dir), str(tmp_path / "tol"), "--format", "int8", "--factor-dtype", "fp32",
                  "--device", "cpu", "--no-progress"])
    assert stop.value.code == 2
    assert "factor_dtype='fp32' applies only to format 'lowrank', not 'int8'" in capsys.readouterr().err
    assert not (tmp_path / "tol").exists()
    assert cli.main(["export-tols", str(model_dir), str(tmp_path / "tol"), "--format", "lowrank", "--rank", "4",
                     "--device", "cpu", "--no-progress"]) == 0
    with open(tmp_path / "tol" / INDEX_NAME) as handle:
        meta = json.load(handle)["metadata"]["token_lookup"]
    assert meta["format"]["factor_dtype"] == "bf16" and meta["dtype"] == "bfloat16"


@pytest.mark.parametrize("size", ["50000", "50KB", "0.05MB"])
def test_cli_shard_size_in_bytes_or_with_a_unit(model, tmp_path, size):
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    assert cli.main(["export-tols", str(model_dir), str(tmp_path / "tol"), "--format", "fp32", "--batch-size", "64",
                     "--max-shard-size", size, "--device", "cpu", "--no-progress"]) == 0
    api = export_tols(model, tmp_path / "api", format="fp32", batch_size=64, max_shard_size=50_000, progress=False)
    assert own_files(tmp_path / "tol") == own_files(tmp_path / "api") and api["num_shards"] > 1


class FakeHubApi:
    """huggingface_hub's `HfApi` for a repository holding `remote` (file names): `upload_folder` sends the files its
    `allow_patterns` / `ignore_patterns` let through and removes the remote files its `delete_patterns` match (those
    not sent again), as huggingface_hub does; `fail` is raised instead of uploading."""

    def __init__(self, remote=(), fail=None):
        self.calls = []
        self.remote = set(remote)
        self.fail = fail

    def __call__(self, *args, **kwargs):  # stands for the class: `HfApi()` gives this client
        return self

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"user/{repo_id}"})()

    def upload_folder(self, *, folder_path, repo_id, allow_patterns=None, ignore_patterns=None, delete_patterns=None,
                      **kwargs):
        from pathlib import Path

        from huggingface_hub.utils import filter_repo_objects

        if self.fail is not None:
            raise self.fail
        self.calls.append(("upload_folder", {"folder_path": folder_path, "repo_id": repo_id, **kwargs}))
        root = Path(folder_path)
        names = [path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file()]
        sent = set(filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        deleted = set(filter_repo_objects(sorted(self.remote), allow_patterns=delete_patterns or []))
        self.remote = (self.remote - deleted) | sent
        self.sent = sent
        return type("Commit", (), {"commit_url": "https://hub.example/commit/1"})()


def test_push_to_hub_uploads_the_table(model, tmp_path, monkeypatch):
    import huggingface_hub

    api = FakeHubApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", api)
    report = export_tols(model, tmp_path, format="bf16", progress=False, push_to_hub="user/tols")
    assert report["hub_commit"] == "https://hub.example/commit/1"
    assert api.calls[0][:2] == ("create_repo", "user/tols")
    upload = api.calls[1][1]
    assert upload["repo_id"] == "user/tols" and upload["folder_path"] == str(tmp_path)
    assert api.sent == set(own_files(tmp_path))
    export_tols(model, tmp_path, format="bf16", progress=False, push_to_hub="tols")  # the user's namespace
    assert api.calls[-1][1]["repo_id"] == "user/tols"


def test_push_to_hub_sends_the_tables_files_only_and_replaces_a_table_pushed_before(model, tmp_path, monkeypatch):
    """Exported next to the weights of a checkpoint that holds the demo's tables in subfolders: neither those tables
    nor the remote code `token_lookup.py` go up, and the shards of a table pushed before (other names) are removed
    in the same commit, where the repository's other files (weights, the subfolders' tables) stay."""
    import huggingface_hub

    model.save_pretrained(tmp_path)
    export_tols(model, tmp_path / "token_lookup" / "fp32", format="fp32", progress=False)
    old_table = {f"token_lookup-0000{i}-of-00003.safetensors" for i in (1, 2, 3)} | {INDEX_NAME, REPORT_NAME}
    others = {"model.safetensors", "config.json", "token_lookup.py", "token_lookup/fp32/token_lookup.safetensors",
              f"token_lookup/fp32/{INDEX_NAME}"}
    api = FakeHubApi(remote=old_table | others)
    monkeypatch.setattr(huggingface_hub, "HfApi", api)
    export_tols(model, tmp_path, format="int8", progress=False, push_to_hub="user/model")
    table = {name for name in own_files(tmp_path) if name.endswith((".safetensors", ".json"))}
    assert api.sent == table == {"token_lookup.safetensors", INDEX_NAME, REPORT_NAME}
    assert api.remote == table | others


def test_push_to_hub_leaves_a_table_in_a_subfolder_whose_name_starts_like_a_shard(model, tmp_path, monkeypatch):
    """The Hub's patterns are fnmatch's, whose `*` crosses "/": the pattern that removes the shards of a table pushed
    before must not match those of a table in a subfolder such as `token_lookup-int8/`."""
    import huggingface_hub

    in_subfolders = {"token_lookup-int8/token_lookup-00001-of-00002.safetensors",
                     "token_lookup-int8/token_lookup-00002-of-00002.safetensors",
                     f"token_lookup-int8/{INDEX_NAME}", "token_lookup-v2/token_lookup.safetensors"}
    old_table = {"token_lookup-00001-of-00002.safetensors", "token_lookup-00002-of-00002.safetensors", INDEX_NAME}
    api = FakeHubApi(remote=in_subfolders | old_table)
    monkeypatch.setattr(huggingface_hub, "HfApi", api)
    export_tols(model, tmp_path, format="int8", progress=False, push_to_hub="user/model")
    assert api.remote == in_subfolders | {"token_lookup.safetensors", INDEX_NAME, REPORT_NAME}


def test_push_table_to_hub_refuses_a_table_missing_a_shard_and_sends_nothing(model, tmp_path, monkeypatch):
    """A shard the index names is gone (deleted, a copy cut short): pushing would replace the table on the Hub by an
    index over shards that are not there; the push is refused, naming the shard, and the repository is left alone."""
    import huggingface_hub

    from hf_memffn.conversion import push_table_to_hub

    export_tols(model, tmp_path, format="bf16", batch_size=100, max_shard_size="30KB", progress=False)
    shard = sorted(n for n in os.listdir(tmp_path) if n.startswith("token_lookup-"))[1]
    os.remove(tmp_path / shard)
    old_table = {"token_lookup.safetensors", INDEX_NAME}
    api = FakeHubApi(remote=old_table)
    monkeypatch.setattr(huggingface_hub, "HfApi", api)
    with pytest.raises(TokenLookupError, match=f"incomplete.*{shard}"):
        push_table_to_hub(str(tmp_path), "user/tols")
    assert api.calls == [] and api.remote == old_table


def test_a_malformed_push_to_hub_repo_id_is_refused_before_anything_is_written(model, tmp_path, capsys):
    with pytest.raises(ValueError, match="push_to_hub='user/my tols' is not a Hub repository id.*namespace/name"):
        export_tols(model, tmp_path / "api", format="bf16", progress=False, push_to_hub="user/my tols")
    assert not (tmp_path / "api").exists()
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as stop:
        cli.main(["export-tols", str(tmp_path / "model"), str(tmp_path / "tol"), "--device", "cpu", "--no-progress",
                  "--push-to-hub", "user/my tols"])
    assert stop.value.code == 2 and "argument --push-to-hub: 'user/my tols' is not" in capsys.readouterr().err
    assert not (tmp_path / "tol").exists()


def test_export_push_ends_a_network_failure_in_one_line(model, tmp_path, monkeypatch, capsys):
    """The HTTP client's transport errors (httpx2 under huggingface_hub 2, httpx under 1) are not OSErrors:
    `export-tols --push-to-hub` ends in one line that says where the table is."""
    import importlib
    import importlib.util

    import huggingface_hub

    name = next((name for name in ("httpx2", "httpx") if importlib.util.find_spec(name)), None)
    if name is None:
        pytest.skip("huggingface_hub's HTTP client (httpx2 or httpx) is not installed")
    offline = importlib.import_module(name).ConnectError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHubApi(fail=offline))
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as stop:
        cli.main(["export-tols", str(tmp_path / "model"), str(tmp_path / "tol"), "--device", "cpu", "--no-progress",
                  "--push-to-hub", "user/tols"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1
    assert f"push to user/tols failed (the table is in {tmp_path / 'tol'}): ConnectError: [Errno -3]" in errors[0]
    model.load_tols(tmp_path / "tol", placement="cpu")
    model.unload_tols()


def test_eval_text_without_a_tokenizer_is_refused_before_anything_is_written(model, tmp_path):
    with pytest.raises(ValueError, match="eval_text needs a tokenizer"):
        export_tols(model, tmp_path / "tol", format="bf16", progress=False, eval_text="the memory stores a value")
    assert not (tmp_path / "tol").exists()
    with pytest.raises(ValueError, match="eval text gives 0 tokens"):
        export_tols(model, tmp_path / "tol", format="bf16", progress=False, eval_text="", tokenizer=tiny_tokenizer())
    assert not (tmp_path / "tol").exists()


def test_cli_eval_text_is_read_as_utf8_and_a_file_in_another_encoding_is_named(tmp_path, capsys):
    """`--eval-text` is UTF-8 whatever the locale's encoding (a byte order mark is not part of the text); a file in
    another encoding is refused in one line naming the option, before anything is written."""
    model = build()
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path / "model")
    text = "the memory stores a value of the key, café crème. " * 8  # (under one 256-token row: every token counts)
    (tmp_path / "plain.txt").write_bytes(text.encode("utf-8"))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    (tmp_path / "latin1.txt").write_bytes(text.encode("latin-1"))
    options = ["--format", "fp32", "--device", "cpu", "--no-progress", "--eval-text"]
    with pytest.raises(SystemExit) as stop:
        cli.main(["export-tols", str(tmp_path / "model"), str(tmp_path / "tol"), *options,
                  str(tmp_path / "latin1.txt")])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--eval-text" in errors[0] and "not UTF-8 text" in errors[0], errors
    assert not (tmp_path / "tol").exists()
    eval_tokens = {}
    for name in ("plain", "bom"):
        assert cli.main(["export-tols", str(tmp_path / "model"), str(tmp_path / name), *options,
                         str(tmp_path / f"{name}.txt")]) == 0
        with open(tmp_path / name / REPORT_NAME) as handle:
            eval_tokens[name] = json.load(handle)["eval_tokens"]
    assert eval_tokens["bom"] == eval_tokens["plain"] == len(tiny_tokenizer()(text, add_special_tokens=False).input_ids)


def test_cli_eval_text_rows_stay_within_the_positions_the_model_has(tmp_path):
    """`--eval-text` is cut into rows of 256 tokens; a model of fewer positions (the demo's have 128) was scored past
    them, where it was never trained ("sequence length 256 exceeds max_position_embeddings=128: ... expect degraded
    outputs"), and the report's held-out losses were not the model's. Rows are now as long as the model's
    positions."""
    model = build(max_position_embeddings=64)
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path / "model")
    text = "the memory stores a value of the key " * 60
    (tmp_path / "heldout.txt").write_text(text, encoding="utf-8")
    ids = tiny_tokenizer()(text, add_special_tokens=False).input_ids
    rows = len(ids) // 64
    assert len(ids) > 256 and rows > 4  # (more than one row of 256, more than four of 64)
    assert cli.main(["export-tols", str(tmp_path / "model"), str(tmp_path / "tol"), "--format", "fp32", "--device",
                     "cpu", "--no-progress", "--eval-text", str(tmp_path / "heldout.txt")]) == 0
    with open(tmp_path / "tol" / REPORT_NAME) as handle:
        report = json.load(handle)
    assert report["eval_tokens"] == rows * 64
    expected = export_module.heldout_loss(model, torch.tensor(ids[:rows * 64]).view(rows, 64))
    assert report["loss_compute"] == pytest.approx(expected, abs=1e-6)


def test_demo_step_matches_compute_mode(tmp_path):
    from hf_memffn.conversion import demo_step

    build("flex_memoryllm").save_pretrained(tmp_path / "model")
    results = demo_step(tmp_path / "model", tmp_path / "tables", max_new_tokens=6, device="cpu")
    assert set(results) == {"fp32", "int8"}
    assert results["fp32"]["tokens_match"] and results["fp32"]["logits_max_relative_diff"] < 1e-5
    assert results["int8"]["size_bytes"] < results["fp32"]["size_bytes"] / 3
    # a checkpoint with several end-of-sequence ids (as Llama 3's): generate() was given the list as its pad id
    build("memoryllm", eos_token_id=[2, 3]).save_pretrained(tmp_path / "several_eos")
    results = demo_step(tmp_path / "several_eos", tmp_path / "several_eos_tables", formats=("fp32",),
                        max_new_tokens=4, device="cpu")
    assert results["fp32"]["tokens_match"]


def test_the_export_report_names_a_heldout_loss_that_is_not_finite(model, tmp_path, monkeypatch):
    """A held-out loss that is not finite (a model that diverged, or overflowed in fp16) was written into
    token_lookup_report.json as the bare word `NaN`, which strict JSON readers refuse: it is null and named under
    `not_finite` (`hf_memffn.run_records`), and `read_run_record` gives it back."""
    import math

    from hf_memffn.run_records import read_run_record

    monkeypatch.setattr(export_module, "lookup_loss_delta", lambda *args, **kwargs: {
        "loss_compute": math.nan, "loss_lookup": math.inf, "loss_delta": math.nan, "eval_tokens": 8})
    returned = export_tols(model, tmp_path, format="fp32", eval_input_ids=torch.zeros(1, 8, dtype=torch.long),
                           progress=False)
    text = (tmp_path / REPORT_NAME).read_text()
    written = json.loads(text, parse_constant=lambda constant: pytest.fail(f"{constant} is not JSON"))
    assert written["loss_compute"] is None and written["loss_lookup"] is None
    assert written["not_finite"] == {"loss_compute": "NaN", "loss_lookup": "Infinity", "loss_delta": "NaN"}
    read = read_run_record(text)
    assert math.isnan(read["loss_compute"]) and read["loss_lookup"] == math.inf
    assert read["max_relative_error"] == returned["max_relative_error"]


def test_a_table_exported_under_autocast_holds_the_values_of_the_weights_dtype(model, tmp_path):
    """`export_tols` called inside a `torch.autocast` context (a training script's, bf16) computed the memory FFN in
    bfloat16: an fp32 table, documented exact, gave lookup logits off by about 1e-3 from compute mode outside the
    context, and its shards' bytes depended on the caller's autocast, which the export plan does not record (a
    resumed export would keep shards computed otherwise). The table holds the FFNs' outputs in the weights' dtype."""
    export_tols(model, tmp_path / "plain", format="fp32", progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        export_tols(model, tmp_path / "autocast", format="fp32", progress=False)
    assert shard_bytes(tmp_path / "autocast") == shard_bytes(tmp_path / "plain")


def test_a_lowrank_table_exported_under_autocast_holds_the_coefficients_of_the_weights_dtype(model, tmp_path):
    """A low-rank table's coefficients are the FFNs' outputs projected on the bases; inside a caller's
    `torch.autocast("cpu", dtype=torch.bfloat16)` that projection ran in bfloat16, so the stored coefficients (and the
    report's errors) depended on the caller's autocast, which the export plan does not record."""
    export_tols(model, tmp_path / "plain", format="lowrank", rank=8, factor_dtype="fp32", progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        export_tols(model, tmp_path / "autocast", format="lowrank", rank=8, factor_dtype="fp32", progress=False)
    assert shard_bytes(tmp_path / "autocast") == shard_bytes(tmp_path / "plain")
