"""Bad input through the public surface: configs, `from_pretrained`, `forward`/`generate`, `load_tols`, the export and
every `hf-memffn` subcommand. Each must end in a one-line error that names what was wrong and what is allowed (a
`ValueError` from the Python API; `hf-memffn <command>: error: ...` and exit status 2 from the command line), never a
traceback from deep inside, never a silent wrong result, and must leave the files it was given untouched.

`python tests/test_bad_input.py` runs every case and prints the counts (inputs tried, clear errors, tracebacks,
silent results, data lost) and the cases that are not clear errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaForCausalLM

from hf_memffn.cli import main as cli_main
from hf_memffn.serving import SERVER_PACKAGES
from hf_memffn.testing import tiny_config, tiny_tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# The inputs every case works on: tiny saved checkpoints and files, built once
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class World:
    root: Path

    def __getattr__(self, name):  # world.memoryllm -> root/memoryllm
        return self.root / name


def build_world(root: Path) -> World:
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    for arch in ("memoryllm", "kvffn", "flash_mhf"):
        model = AutoModelForCausalLM.from_config(tiny_config(arch))
        model.attach_tokenizer(tokenizer)
        model.save_pretrained(root / arch)
    AutoModelForCausalLM.from_config(tiny_config("memoryllm")).save_pretrained(root / "no_tokenizer")
    llama = LlamaForCausalLM(tiny_config("llama"))
    llama.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    LlamaForCausalLM(tiny_config("llama", vocab_size=260)).save_pretrained(root / "llama_260")  # fewer rows than
    tokenizer.save_pretrained(root / "llama_260")  # the tokenizer has tokens
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320, n_positions=64,
                               bos_token_id=1, eos_token_id=2)).save_pretrained(root / "gpt2")
    from hf_memffn.conversion import export_tols

    export_tols(str(root / "memoryllm"), root / "table", format="fp32", progress=False)
    (root / "texts").write_text("the memory stores a key\nthe value of a token\n")
    (root / "bad.jsonl").write_text('{"text": "the memory"}\n{"text": "a key"\n')
    (root / "latin1.txt").write_bytes("caf\xe9 memory\n".encode("latin-1"))
    (root / "a_file").write_text("not a directory\n")
    damaged = root / "damaged_weights"
    shutil.copytree(root / "memoryllm", damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    broken_code = root / "damaged_code"
    shutil.copytree(root / "memoryllm", broken_code)
    (broken_code / "modeling_memffn.py").write_text("this is not python (\n")
    table_only = root / "table_only"  # a checkpoint folder whose weights were replaced by a lookup table
    shutil.copytree(root / "memoryllm", table_only)
    (table_only / "model.safetensors").unlink()
    for path in (root / "table").iterdir():
        shutil.copy2(path, table_only / path.name)
    return World(root)


def tree_digest(path: Path) -> dict[str, str]:
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------------------
# Cases: a name, what the error must mention, and the call (Python API) or argv (command line)
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    expect: tuple[str, ...]   # substrings of the one-line error (field name, allowed values)
    api: object = None        # callable(world) that must raise ValueError
    cli: object = None        # callable(world) -> argv that must exit 2 with one error line
    keep: tuple[str, ...] = ("memoryllm", "llama", "table")  # world entries that must not change
    no_output: str | None = None  # world entry that must not be created
    needs: tuple[str, ...] = ()  # the modules the case needs (skipped without any of them)

    def missing_modules(self) -> list[str]:
        return [name for name in self.needs if importlib.util.find_spec(name) is None]


CASES: list[Case] = []


def config_case(name, arch, expect, **fields):
    CASES.append(Case(f"config-{name}", expect, api=lambda w: tiny_config(arch, **fields)))


# Configs: wrong types and values of every field kind.
config_case("hidden_size-str", "memoryllm", ("hidden_size", "positive integer"), hidden_size="64")
config_case("hidden_size-bool", "memoryllm", ("hidden_size", "positive integer"), hidden_size=True)
config_case("vocab_size-zero", "kvffn", ("vocab_size", "positive integer"), vocab_size=0)
config_case("num_key_value_heads-str", "memoryllm", ("num_key_value_heads",), num_key_value_heads="2")
config_case("num_key_value_heads-3", "memoryllm", ("num_key_value_heads", "divide"), num_key_value_heads=3)
config_case("head_dim-odd", "memoryllm", ("head_dim", "even"), head_dim=15)
config_case("max_position_embeddings-0", "memoryllm", ("max_position_embeddings", "positive integer"),
            max_position_embeddings=0)
config_case("rms_norm_eps-negative", "memoryllm", ("rms_norm_eps", "> 0"), rms_norm_eps=-1e-5)
config_case("rms_norm_eps-str", "memoryllm", ("rms_norm_eps", "number"), rms_norm_eps="1e-5")
config_case("rope_theta-0", "kvffn", ("rope_theta", "> 0"), rope_theta=0)
config_case("rope-factor-0", "kvffn", ("rope_parameters['factor']", ">= 1"),
            rope_parameters={"rope_type": "linear", "factor": 0.0})
config_case("rope-factor-below-1", "memoryllm", ("rope_parameters['factor']", ">= 1"),
            rope_parameters={"rope_type": "dynamic", "factor": 0.5})
config_case("rope-factor-negative", "flash_mhf", ("rope_parameters['factor']", ">= 1"),
            rope_parameters={"rope_type": "yarn", "factor": -4.0})
config_case("initializer_range-negative", "kvffn", ("initializer_range", ">= 0"), initializer_range=-0.02)
config_case("attention_dropout-str", "kvffn", ("attention_dropout", "number"), attention_dropout="0.1")
config_case("attention_dropout-1", "kvffn", ("attention_dropout", "[0, 1)"), attention_dropout=1.0)
config_case("hidden_act-unknown", "memoryllm", ("hidden_act", "silu"), hidden_act="swish2")
config_case("attention_bias-str", "memoryllm", ("attention_bias", "True or False"), attention_bias="no")
config_case("tie_word_embeddings-str", "memoryllm", ("tie_word_embeddings", "True or False"),
            tie_word_embeddings="yes")
config_case("pad_token_id-out-of-vocab", "memoryllm", ("pad_token_id", "0..319"), pad_token_id=320)
config_case("eos_token_id-negative", "memoryllm", ("eos_token_id", "0..319"), eos_token_id=-3)
config_case("ffn_variant-unknown", "flash_mhf", ("ffn_variant", "flash_mhf"), ffn_variant="moe")
config_case("ffn_kernel-unknown", "flash_mhf", ("ffn_kernel", "triton"), ffn_kernel="cuda")
config_case("ffn_num_heads-str", "flash_mhf", ("ffn_num_heads", "positive integer"), ffn_num_heads="4")
config_case("ffn_num_subnetworks-0", "flash_mhf", ("ffn_num_subnetworks",), ffn_num_subnetworks=0)
config_case("ffn_num_kv_heads-str", "flash_mhf", ("ffn_num_kv_heads", "positive integer"), ffn_num_kv_heads="2")
config_case("ffn_gate_eps-str", "flash_mhf", ("ffn_gate_eps", "number"), ffn_gate_eps="1e-6")
config_case("ffn_query_norm-str", "flash_mhf", ("ffn_query_norm", "True or False"), ffn_query_norm="no")
config_case("ffn_recompute_chunk_tokens-float", "flash_mhf", ("ffn_recompute_chunk_tokens", "integer"),
            ffn_recompute_chunk_tokens=2.5)
config_case("kvffn_activation-unknown", "kvffn", ("kvffn_activation", "silu"), kvffn_activation="tanh")
config_case("kvffn_bias-str", "kvffn", ("kvffn_bias", "True or False"), kvffn_bias="yes")
config_case("kvffn_init-unknown", "kvffn", ("kvffn_init", "inv_sqrt_d"), kvffn_init="xavier")
config_case("memory_intermediate_size-str", "flex_memoryllm", ("memory_intermediate_size", "positive integer"),
            memory_intermediate_size="64")
config_case("ffn_head_dim-derived", "flash_mhf", ("ffn_head_dim", "derived", "here 16"), ffn_head_dim=8)
config_case("kvffn_init_std-derived", "kvffn", ("kvffn_init_std", "derived"), kvffn_init_std=0.5)
# the decoder's wiring is the architecture's: given as a field it rewired the decoder (MemoryLLM with a SwiGLU FFN)
config_case("residual_ffn-wiring", "memoryllm", ("residual_ffn", "wiring", "here None"), residual_ffn="swiglu")
config_case("parallel_residual_ffn-wiring", "kvffn", ("parallel_residual_ffn", "wiring", "here False"),
            parallel_residual_ffn=True)
# a misspelled field, or a field of another architecture, was kept on the config where nothing reads it
config_case("ffn_num_heads-misspelled", "flash_mhf", ("ffn_num_head", "`ffn_num_heads`"), ffn_num_head=8)
config_case("kvffn_activation-misspelled", "kvffn", ("kvffn_activaton", "`kvffn_activation`"), kvffn_activaton="gelu")
config_case("memory_intermediate_size-misspelled", "flex_memoryllm",
            ("memory_intermediate_sizes", "`memory_intermediate_size`"), memory_intermediate_sizes=32)
config_case("decoder_kernels-misspelled", "memoryllm", ("decoder_kernel", "`decoder_kernels`"), decoder_kernel="torch")
config_case("ffn_kernel-of-flash_mhf-on-kvffn", "kvffn", ("ffn_kernel", "FlashMHFLlamaConfig"), ffn_kernel="triton")
config_case("ffn_variant-on-memoryllm", "memoryllm", ("ffn_variant", "FlashMHFLlamaConfig and KVFFNConfig"),
            ffn_variant="pkv")
CASES.append(Case("tiny_config-unknown-arch", ("arch", "memoryllm"), api=lambda w: tiny_config("gpt2")))


def _edit_config(world: World, **fields):
    import json

    target = world.root / "edited_config"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(world.memoryllm, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


# from_pretrained of damaged or wrong checkpoints
CASES.append(Case("from_pretrained-bad-config-value", ("hidden_act", "silu"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(_edit_config(w, hidden_act="nope"))))
CASES.append(Case("from_pretrained-config-str-number", ("num_hidden_layers", "positive integer"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(_edit_config(w, num_hidden_layers="2"))))

CASES.append(Case("from_pretrained-derived-field", ("token_memory_size", "derived"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.memoryllm, token_memory_size=3)))
# (fields given to from_pretrained are set past the config's __init__, which checks this one)
CASES.append(Case("from_pretrained-rope_parameters-str", ("rope_parameters", "dict"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.kvffn, rope_parameters="linear")))
CASES.append(Case("from_pretrained-rope_scaling-str", ("rope_scaling", "dict"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.memoryllm, rope_scaling="linear")))
CASES.append(Case("from_pretrained-wiring-field", ("parallel_residual_ffn", "wiring", "here False"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.kvffn, parallel_residual_ffn=True)))
# (a config.json edited by hand; a keyword that AutoConfig dropped and a model's __init__ refused with a TypeError)
CASES.append(Case("from_pretrained-config-misspelled-field", ("decoder_kernel", "`decoder_kernels`"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(_edit_config(w, decoder_kernel="torch"))))
CASES.append(Case("AutoConfig-field-of-another-architecture", ("memory_intermediate_size", "FlexMemoryLLMConfig"),
                  api=lambda w: AutoConfig.from_pretrained(w.memoryllm, memory_intermediate_size=32)))
CASES.append(Case("from_pretrained-misspelled-field", ("kvffn_activaton", "`kvffn_activation`"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.kvffn, kvffn_activaton="gelu")))


def _model(world: World, name="memoryllm"):
    return AutoModelForCausalLM.from_pretrained(getattr(world, name)).eval()


# forward / generate
CASES.append(Case("forward-token-id-too-large", ("input_ids", "0..319"),
                  api=lambda w: _model(w)(torch.tensor([[5, 320]]))))
CASES.append(Case("forward-negative-token-id", ("input_ids", "0..319"),
                  api=lambda w: _model(w, "kvffn")(torch.tensor([[-1, 3]]))))
CASES.append(Case("forward-float-ids", ("input_ids", "integers"),
                  api=lambda w: _model(w, "flash_mhf")(torch.tensor([[1.0, 2.0]]))))
CASES.append(Case("forward-empty", ("input_ids", "empty"), api=lambda w: _model(w)(torch.zeros(1, 0, dtype=torch.long))))
CASES.append(Case("generate-token-id-too-large", ("input_ids", "0..319"),
                  api=lambda w: _model(w).generate(torch.tensor([[1, 999]]), max_new_tokens=2)))
CASES.append(Case("forward-ids-and-embeds", ("input_ids", "inputs_embeds"),
                  api=lambda w: _model(w)(torch.tensor([[1]]), inputs_embeds=torch.zeros(1, 1, 64))))


def _lookup_then_embeds(world: World):
    model = _model(world)
    model.load_tols(world.table, placement="cpu")
    return model(inputs_embeds=torch.zeros(1, 2, 64))


CASES.append(Case("lookup-mode-inputs_embeds", ("input_ids", "inputs_embeds"), api=_lookup_then_embeds))

# load_tols
CASES.append(Case("load_tols-missing-dir", ("does-not-exist",),
                  api=lambda w: _model(w).load_tols(w.root / "does-not-exist", placement="cpu")))
CASES.append(Case("load_tols-a-file", ("a_file",), api=lambda w: _model(w).load_tols(w.a_file, placement="cpu")))
CASES.append(Case("load_tols-no-table", ("token_lookup",),
                  api=lambda w: _model(w).load_tols(w.kvffn, placement="cpu")))
CASES.append(Case("load_tols-placement", ("placement", "gpu"),
                  api=lambda w: _model(w).load_tols(w.table, placement="tpu")))
def _load_tols_into_other_weights(world: World):
    torch.manual_seed(1)  # (each test starts at seed 0, as the world's models did: the same weights otherwise)
    AutoModelForCausalLM.from_config(tiny_config("memoryllm")).load_tols(world.table, placement="cpu")


CASES.append(Case("load_tols-other-weights", ("weights",), api=_load_tols_into_other_weights))
CASES.append(Case("load_tols-kvffn", ("load_tols", "MemoryLLM"), api=lambda w: _model(w, "kvffn").load_tols(w.table)))


def _save_after_dropping(world: World):
    model = _model(world)
    model.load_tols(world.table, placement="cpu", drop_memory_ffn=True)
    model.save_pretrained(world.root / "saved_dropped")


CASES.append(Case("save_pretrained-memory-dropped", ("save_pretrained", "drop_memory_ffn"), api=_save_after_dropping,
                  no_output="saved_dropped"))

# fields given to from_pretrained are set after the config is built: they are checked too
CASES.append(Case("from_pretrained-override-negative", ("ffn_recompute_chunk_tokens", ">= 0"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.flash_mhf, ffn_recompute_chunk_tokens=-3)))
CASES.append(Case("from_pretrained-override-str-bool", ("ffn_query_norm", "True or False"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.flash_mhf, ffn_query_norm="no")))
CASES.append(Case("from_pretrained-override-variant", ("ffn_variant", "'pkv'"),
                  api=lambda w: AutoModelForCausalLM.from_pretrained(w.flash_mhf, ffn_variant="moe")))


def _model_from_config_edited_by_hand(world: World):
    config = tiny_config("flash_mhf")
    config.ffn_variant = "moe"  # (an attribute set on a built config: no check runs until a model is built from it)
    AutoModelForCausalLM.from_config(config)


CASES.append(Case("from_config-field-set-by-hand", ("ffn_variant", "'pkv'"), api=_model_from_config_edited_by_hand))
config_case("vocab_size-str", "memoryllm", ("vocab_size", "positive integer"), vocab_size="320")
config_case("rope_parameters-str", "memoryllm", ("rope_parameters", "dict"), rope_parameters="linear")
config_case("rms_norm_eps-inf", "memoryllm", ("rms_norm_eps", "finite"), rms_norm_eps=float("inf"))
config_case("rope-factor-inf", "kvffn", ("rope_parameters['factor']", "finite"),
            rope_parameters={"rope_type": "linear", "factor": float("inf")})
# fields transformers' PreTrainedConfig reads as it takes them: a wrong type failed inside it, naming no field
config_case("head_dim-str", "memoryllm", ("head_dim", "positive integer"), head_dim="16")
config_case("head_dim-inf", "kvffn", ("head_dim", "positive integer"), head_dim=float("inf"))
config_case("num_labels-str", "kvffn", ("num_labels", ">= 1"), num_labels="3")
config_case("id2label-list", "flash_mhf", ("id2label", "dict"), id2label=["negative", "positive"])
config_case("dtype-unknown-name", "memoryllm", ("dtype", "'bfloat16'"), dtype="bf16")
config_case("layer_types-int", "kvffn", ("layer_types", "full_attention"), layer_types=2)
config_case("output_hidden_states-str", "flex_memoryllm", ("output_hidden_states", "True or False"),
            output_hidden_states="yes")
CASES.append(Case("from_pretrained-num_labels-str", ("num_labels", ">= 1"),
                  api=lambda w: AutoModelForSequenceClassification.from_pretrained(w.kvffn, num_labels="3")))
CASES.append(Case("from_pretrained-id2label-str", ("id2label", "dict"),
                  api=lambda w: AutoModelForSequenceClassification.from_pretrained(w.kvffn, id2label="negative")))
# one pad (and bos) token id: a list was taken and failed in the embedding's `padding_idx`
CASES.append(Case("from_config-pad_token_id-list", ("pad_token_id", "eos_token_id only"),
                  api=lambda w: AutoModelForCausalLM.from_config(tiny_config("memoryllm", pad_token_id=[0]))))


# adapters (hf_memffn.adapters) and resizing
def _lora_twice(world: World):
    from hf_memffn import adapters

    model = _model(world)
    adapters.add_weight_lora(model, r=2)
    adapters.add_weight_lora(model, r=2)


def _load_saved_with_adapters(world: World):
    from hf_memffn import adapters

    model = _model(world)
    adapters.add_weight_lora(model, r=2)
    model.save_pretrained(world.root / "saved_with_adapters")
    AutoModelForCausalLM.from_pretrained(world.root / "saved_with_adapters")


def _resize_with_table(world: World):
    model = _model(world)
    model.load_tols(world.table, placement="cpu")
    model.resize_token_embeddings(336)


def _base_model_from_causal_lm(world: World):
    from transformers import AutoModel

    target = world.root / "pkv"
    if not target.exists():
        AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_variant="pkv")).save_pretrained(target)
    AutoModel.from_pretrained(target)


CASES.append(Case("add_weight_lora-twice", ("LoRA adapter already", "merge_weight_lora"), api=_lora_twice))
CASES.append(Case("from_pretrained-saved-with-adapters", ("adapters or int8", "merge_weight_lora"),
                  api=_load_saved_with_adapters))
CASES.append(Case("resize-with-table-loaded", ("resize_token_embeddings", "unload_tols"), api=_resize_with_table))
CASES.append(Case("AutoModel-of-a-pkv-causal-lm", ("layers.0.mlp.key", "AutoModelForCausalLM.from_pretrained"),
                  api=_base_model_from_causal_lm))


def cli_case(name, expect, argv, keep=("memoryllm", "llama", "table"), no_output=None, needs=()):
    CASES.append(Case(f"cli-{name}", expect, cli=argv, keep=keep, no_output=no_output, needs=needs))


S = str
# export-tols
cli_case("export-missing-model-dir", ("MODEL_DIR", "does-not-exist"),
         lambda w: ["export-tols", S(w.root / "does-not-exist"), S(w.root / "out1")], no_output="out1")
cli_case("export-model-dir-is-file", ("MODEL_DIR", "a_file"),
         lambda w: ["export-tols", S(w.a_file), S(w.root / "out2")], no_output="out2")
cli_case("export-out-is-file", ("OUT_DIR", "a_file"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.a_file)], keep=("memoryllm", "a_file"))
cli_case("export-llama", ("export-tols", "LlamaForCausalLM", "MemoryLLM"),
         lambda w: ["export-tols", S(w.llama), S(w.root / "out3")], no_output="out3")
cli_case("export-kvffn", ("export-tols", "KVFFNForCausalLM", "MemoryLLM"),
         lambda w: ["export-tols", S(w.kvffn), S(w.root / "out4")], no_output="out4")
cli_case("export-format", ("--format", "int8"), lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o"),
                                                          "--format", "int3"], no_output="o")
cli_case("export-batch-size-0", ("--batch-size", ">= 1"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o5"), "--batch-size", "0"], no_output="o5")
cli_case("export-batch-size-str", ("--batch-size", "integer"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o6"), "--batch-size", "many"], no_output="o6")
cli_case("export-drop-layers-str", ("--drop-layers", "integers"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o7"), "--drop-layers", "a,b"], no_output="o7")
cli_case("export-drop-layers-range", ("drop_layers", "0..1"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o8"), "--drop-layers", "7"], no_output="o8")
cli_case("export-max-shard-size", ("--max-shard-size", "2GB"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o9"), "--max-shard-size", "lots"], no_output="o9")
cli_case("export-max-shard-size-0", ("--max-shard-size", "positive"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o15"), "--max-shard-size", "0MB"], no_output="o15")
cli_case("export-max-shard-size-negative", ("--max-shard-size", "positive"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o16"), "--max-shard-size=-5MB"], no_output="o16")
cli_case("export-gpt2", ("export-tols", "GPT2LMHeadModel", "MemoryLLM"),
         lambda w: ["export-tols", S(w.gpt2), S(w.root / "o17")], no_output="o17")
cli_case("export-eval-text-no-tokenizer", ("--eval-text", "tokenizer", "no_tokenizer"),
         lambda w: ["export-tols", S(w.no_tokenizer), S(w.root / "o18"), "--eval-text", S(w.texts)],
         no_output="o18")
cli_case("export-energy", ("energy", "(0, 1]"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o10"), "--format", "lowrank", "--energy", "2"],
         no_output="o10")
cli_case("export-group-size", ("group_size",),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o11"), "--format", "int8", "--group-size", "7"],
         no_output="o11")
cli_case("export-damaged-weights", ("damaged_weights",),
         lambda w: ["export-tols", S(w.damaged_weights), S(w.root / "o12")], no_output="o12")
cli_case("export-eval-text-missing", ("--eval-text", "nope.txt"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o13"), "--eval-text", S(w.root / "nope.txt")],
         no_output="o13")
cli_case("export-device", ("--device", "cpu"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o14"), "--device", "tpu"], no_output="o14")
cli_case("export-device-meta", ("--device", "'meta'", "cpu, cuda"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o21"), "--device", "meta"], no_output="o21")
cli_case("export-rank-with-int8", ("rank/energy", "lowrank", "'int8'"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o20"), "--format", "int8", "--rank", "4"],
         no_output="o20")
cli_case("export-push-to-hub-repo-id", ("--push-to-hub", "user/my tols", "namespace/name"),
         lambda w: ["export-tols", S(w.memoryllm), S(w.root / "o19"), "--push-to-hub", "user/my tols"],
         no_output="o19")

# analyze
ANALYZE_FAST = ["--device", "cpu", "--top-triggers", "2", "--cells-per-bank", "1", "--clusters", "2"]
cli_case("analyze-missing-model-dir", ("MODEL_DIR", "does-not-exist"),
         lambda w: ["analyze", S(w.root / "does-not-exist"), "--texts", S(w.texts), "--out", S(w.root / "r1")],
         no_output="r1")
cli_case("analyze-no-tokenizer", ("no tokenizer", "--tokenizer"),
         lambda w: ["analyze", S(w.no_tokenizer), "--texts", S(w.texts), "--out", S(w.root / "r2")],
         no_output="r2")
cli_case("analyze-texts-missing", ("--texts", "none.txt"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.root / "none.txt"), "--out", S(w.root / "r3")],
         no_output="r3")
cli_case("analyze-out-is-file", ("--out", "a_file"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.a_file)],
         keep=("memoryllm", "a_file"))
cli_case("analyze-layers-str", ("--layers", "integers"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r4"), "--layers", "x"],
         no_output="r4")
cli_case("analyze-layers-range", ("--layers", "allowed"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r5"), "--layers", "9",
                    *ANALYZE_FAST], no_output="r5")
cli_case("analyze-max-length-0", ("--max-length", ">= 1"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r6"),
                    "--max-length", "0"], no_output="r6")
cli_case("analyze-override-unknown", ("--override", "no_such_field"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r7"),
                    "--override", "no_such_field=1", *ANALYZE_FAST], no_output="r7")
cli_case("analyze-override-bad-value", ("ffn_kernel", "triton"),
         lambda w: ["analyze", S(w.flash_mhf), "--texts", S(w.texts), "--out", S(w.root / "r8"),
                    "--override", "ffn_kernel=cuda", *ANALYZE_FAST], no_output="r8")
cli_case("analyze-device", ("--device", "cpu"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r10"),
                    "--device", "tpu"], no_output="r10")
cli_case("analyze-device-xla", ("--device", "'xla'", "cpu, cuda"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r19"),
                    "--device", "xla"], no_output="r19")

# demo
cli_case("demo-steps-0", ("--steps", "positive"), lambda w: ["demo", "--steps", "0", "--out", S(w.root / "d1")],
         no_output="d1")
cli_case("demo-steps-str", ("--steps", "int"), lambda w: ["demo", "--steps", "ten", "--out", S(w.root / "d2")],
         no_output="d2")
cli_case("demo-arch", ("--archs", "memoryllm"), lambda w: ["demo", "--archs", "gpt", "--out", S(w.root / "d3")],
         no_output="d3")
cli_case("demo-out-is-file", ("--out", "a_file"), lambda w: ["demo", "--quick", "--out", S(w.a_file)],
         keep=("a_file",))
cli_case("demo-text-files-missing", ("--text-files", "none.txt"),
         lambda w: ["demo", "--quick", "--text-files", S(w.root / "none.txt"), "--out", S(w.root / "d4")],
         no_output="d4")
cli_case("demo-hidden-size-0", ("--hidden-size", "positive"),
         lambda w: ["demo", "--hidden-size", "0", "--out", S(w.root / "d5")], no_output="d5")
cli_case("demo-device", ("--device", "cpu"), lambda w: ["demo", "--device", "tpu", "--out", S(w.root / "d6")],
         no_output="d6")
cli_case("demo-seq-len-1", ("--seq-len", "2 or more"),
         lambda w: ["demo", "--quick", "--seq-len", "1", "--out", S(w.root / "d7")], no_output="d7")
cli_case("demo-odd-head-width", ("--hidden-size", "multiple of"),
         lambda w: ["demo", "--quick", "--archs", "llama", "--hidden-size", "30", "--out", S(w.root / "d8")],
         no_output="d8")
cli_case("demo-lr-negative", ("--lr", "positive"),
         lambda w: ["demo", "--quick", "--lr", "-1", "--out", S(w.root / "d9")], no_output="d9")
cli_case("demo-config-invalid-for-one-arch", ("flex_memoryllm", "intermediate_size", "--intermediate-size"),
         lambda w: ["demo", "--quick", "--steps", "1", "--intermediate-size", "1", "--out", S(w.root / "d10")],
         no_output="d10")
cli_case("demo-dataset-split-missing", ("--dataset-split", "validation"),
         lambda w: ["demo", "--quick", "--dataset", S(_dataset_dict(w)), "--out", S(w.root / "d11")],
         no_output="d11", needs=("datasets",))
cli_case("demo-lr-nan", ("--lr", "positive"),
         lambda w: ["demo", "--quick", "--lr", "nan", "--out", S(w.root / "d13")], no_output="d13")
cli_case("demo-lr-inf", ("--lr", "positive"),
         lambda w: ["demo", "--quick", "--lr", "inf", "--out", S(w.root / "d14")], no_output="d14")
cli_case("demo-max-chars-0", ("--max-chars", ">= 1"),
         lambda w: ["demo", "--quick", "--text-files", S(w.texts), "--max-chars", "0", "--out", S(w.root / "d12")],
         no_output="d12")
cli_case("demo-dataset-text-column-not-text", ("--text-column", "label", "strings", "text"),
         lambda w: ["demo", "--quick", "--dataset", S(_dataset_with_labels(w)), "--text-column", "label",
                    "--out", S(w.root / "d15")], no_output="d15", needs=("datasets",))
cli_case("demo-dataset-is-a-file", ("--dataset", "bad.jsonl", "is a file", "folder"),
         lambda w: ["demo", "--quick", "--dataset", S(w.root / "bad.jsonl"), "--out", S(w.root / "d16")],
         keep=("bad.jsonl",), no_output="d16", needs=("datasets",))
cli_case("demo-seed-out-of-range", ("--seed", "2**64 - 1"),
         lambda w: ["demo", "--quick", "--steps", "1", "--archs", "llama", "--seed", S(2**64),
                    "--out", S(w.root / "d17")], no_output="d17")
cli_case("demo-vocab-size-too-small", ("--vocab-size", "259"),
         lambda w: ["demo", "--quick", "--vocab-size", "100", "--out", S(w.root / "d18")], no_output="d18")
cli_case("demo-num-entities-1", ("--num-entities", "2..870"),
         lambda w: ["demo", "--quick", "--num-entities", "1", "--out", S(w.root / "d19")], no_output="d19")
cli_case("analyze-override-derived", ("--override", "token_memory_size", "derives"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r11"),
                    "--override", "token_memory_size=64", *ANALYZE_FAST], no_output="r11")
cli_case("analyze-override-shape", ("--override", "intermediate_size", "shapes"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r12"),
                    "--override", "intermediate_size=64", *ANALYZE_FAST], no_output="r12")
cli_case("analyze-edit-strength-negative", ("--edit-strength", "> 0"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r13"),
                    "--edit-strength", "-1", *ANALYZE_FAST], no_output="r13")
cli_case("analyze-override-unused-weights", ("--override", "ffn_variant", "weights"),
         lambda w: ["analyze", S(w.kvffn), "--texts", S(w.texts), "--out", S(w.root / "r14"),
                    "--override", "ffn_variant=relu", *ANALYZE_FAST], keep=("kvffn",), no_output="r14")
cli_case("analyze-texts-bad-json", ("bad.jsonl:2", "invalid JSON"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.root / "bad.jsonl"), "--out", S(w.root / "r15"),
                    *ANALYZE_FAST], no_output="r15")
cli_case("analyze-texts-not-utf8", ("latin1.txt", "UTF-8"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.root / "latin1.txt"), "--out", S(w.root / "r16"),
                    *ANALYZE_FAST], no_output="r16")
cli_case("analyze-layers-empty", ("--layers", "integers"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r17"), "--layers", "",
                    *ANALYZE_FAST], no_output="r17")
cli_case("analyze-tokenizer-not-the-models", ("token id", "0..259", "tokenizer"),
         lambda w: ["analyze", S(w.llama_260), "--texts", S(w.texts), "--out", S(w.root / "r18"), *ANALYZE_FAST],
         no_output="r18")
cli_case("analyze-out-inside-a-file", ("--out", "a_file", "is a file"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.a_file / "report"), *ANALYZE_FAST],
         keep=("memoryllm", "a_file"))
cli_case("analyze-edit-empty-target", ("--edit", "TARGET is empty"),
         lambda w: ["analyze", S(w.memoryllm), "--texts", S(w.texts), "--out", S(w.root / "r20"),
                    "--edit", "the memory=>", *ANALYZE_FAST], no_output="r20")
# transformers' Llama config checks a field's type when it is set; an unknown activation fails building the model
cli_case("analyze-override-llama-field-type", ("--override", "rms_norm_eps", "float"),
         lambda w: ["analyze", S(w.llama), "--texts", S(w.texts), "--out", S(w.root / "r21"),
                    "--override", 'rms_norm_eps="small"', *ANALYZE_FAST], no_output="r21")
cli_case("analyze-override-llama-activation", ("--override", "hidden_act", "nope"),
         lambda w: ["analyze", S(w.llama), "--texts", S(w.texts), "--out", S(w.root / "r22"),
                    "--override", 'hidden_act="nope"', *ANALYZE_FAST], no_output="r22")
# (without the server's packages `serve` stops first at them, in one line naming its extra: tested in test_serving.py)
cli_case("serve-missing-model", ("MODEL", "does-not-exist"), lambda w: ["serve", S(w.root / "does-not-exist")],
         needs=SERVER_PACKAGES)
cli_case("serve-no-tokenizer", ("no_tokenizer", "no tokenizer"), lambda w: ["serve", S(w.no_tokenizer)],
         needs=SERVER_PACKAGES)
# --token-lookup problems that the server would meet only while loading the model, in a traceback
cli_case("serve-token-lookup-not-memory", ("--token-lookup", "memffn_kvffn", "MemoryLLM"),
         lambda w: ["serve", S(w.kvffn), "--token-lookup", S(w.table)], needs=SERVER_PACKAGES)
cli_case("serve-token-lookup-missing-table", ("no-table", "no such folder"),
         lambda w: ["serve", S(w.memoryllm), "--token-lookup", S(w.root / "no-table")], needs=SERVER_PACKAGES)
if not torch.cuda.is_available():  # (with CUDA the server would start)
    cli_case("serve-token-lookup-gpu-without-cuda", ("--token-lookup-placement gpu", "CUDA", "cpu"),
             lambda w: ["serve", S(w.memoryllm), "--token-lookup", S(w.table), "--token-lookup-placement", "gpu"],
             needs=SERVER_PACKAGES)


def _dataset_dict(world: World) -> Path:
    """A saved DatasetDict with a validation split only (the demo reads `train` unless told otherwise)."""
    import datasets

    target = world.root / "dataset_dict"
    if not target.exists():
        rows = datasets.Dataset.from_dict({"text": ["the memory stores a key and its value"] * 20})
        datasets.DatasetDict({"validation": rows}).save_to_disk(str(target))
    return target


def _dataset_with_labels(world: World) -> Path:
    """A saved dataset with a text column and an integer one."""
    import datasets

    target = world.root / "dataset_with_labels"
    if not target.exists():
        rows = datasets.Dataset.from_dict({"text": ["the memory stores a key and its value"] * 20, "label": [1] * 20})
        rows.save_to_disk(str(target))
    return target


# push (nothing may be sent: these fail before any network access)
cli_case("push-missing-dir", ("does-not-exist",), lambda w: ["push", S(w.root / "does-not-exist"), "user/repo"])
cli_case("push-a-file", ("a_file",), lambda w: ["push", S(w.a_file), "user/repo"], keep=("a_file",))
cli_case("push-table-but-no-weights", ("table_only", "weights"), lambda w: ["push", S(w.table_only), "user/repo"],
         keep=("table_only",))
cli_case("unknown-command", ("invalid choice", "analyze"), lambda w: ["analyse"])


# ---------------------------------------------------------------------------------------------------------------------
# Running a case and judging the outcome
# ---------------------------------------------------------------------------------------------------------------------
CLEAR, TRACEBACK, SILENT, LOST = "clear error", "traceback", "silent", "data lost"


def run_case(case: Case, world: World) -> tuple[str, str]:
    """(outcome, detail): outcome is CLEAR, TRACEBACK (wrong exception type, a multi-line message or one that does
    not name what is expected), SILENT (no error) or LOST (a given file changed, or an output was left behind)."""
    before = {name: tree_digest(getattr(world, name)) for name in case.keep if getattr(world, name).exists()}
    outcome, detail = _run(case, world)
    for name, digest in before.items():
        if tree_digest(getattr(world, name)) != digest:
            return LOST, f"{name} changed ({detail})"
    if case.no_output and getattr(world, case.no_output).exists():
        shutil.rmtree(getattr(world, case.no_output), ignore_errors=True)
        return LOST, f"{case.no_output} was written ({detail})"
    return outcome, detail


def _judge_message(message: str, expect: tuple[str, ...]) -> tuple[str, str]:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if len(lines) != 1:
        return TRACEBACK, f"{len(lines)} lines: {message.strip()[:300]}"
    missing = [e for e in expect if e not in lines[0]]
    if missing:
        return TRACEBACK, f"does not mention {missing}: {lines[0][:300]}"
    return CLEAR, lines[0]


def _run(case: Case, world: World) -> tuple[str, str]:
    if case.api is not None:
        try:
            case.api(world)
        except ValueError as error:
            return _judge_message(str(error), case.expect)
        except Exception as error:  # noqa: BLE001 - what a user would see as a traceback
            return TRACEBACK, f"{type(error).__name__}: {str(error)[:300]}"
        return SILENT, "no error"
    stderr, stdout = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            code = cli_main(case.cli(world))
    except SystemExit as stop:
        code = stop.code
    except Exception as error:  # noqa: BLE001
        return TRACEBACK, f"{type(error).__name__}: {str(error)[:300]}"
    if code in (0, None):
        return SILENT, "exit status 0"
    errors = [line for line in stderr.getvalue().splitlines() if "error:" in line]
    if code != 2 or "Traceback" in stderr.getvalue() or len(errors) != 1:
        return TRACEBACK, f"exit {code}: {stderr.getvalue().strip()[-300:]}"
    return _judge_message(errors[0], case.expect)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("bad_input"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_one_line_error(case, world):
    if case.missing_modules():
        pytest.skip(f"needs {', '.join(case.missing_modules())}")
    outcome, detail = run_case(case, world)
    assert outcome == CLEAR, detail


def test_the_docs_count_every_case():
    """docs/bad-input.md's table ends on the counts `python tests/test_bad_input.py` prints: every case tried, every
    one a clear error (the `+ 3` and `+ 1` are the process-level cases of test_export_robustness.py)."""
    with open(Path(__file__).resolve().parents[1] / "docs" / "bad-input.md", encoding="utf-8") as handle:
        rows = [line for line in handle if line.startswith("| after")]
    cells = [cell.strip() for cell in rows[-1].strip().strip("|").split("|")]
    cases = len(CASES) + torch.cuda.is_available()  # (the survey runs without CUDA: one case more, `serve-token-lookup-gpu-without-cuda`)
    assert cells[1:] == [f"{cases} + 3", f"{cases} + 1", "0", "0", "0"], rows[-1]


def device_refusal(world, command: str, device: str, capsys) -> list[str]:
    """`command ... --device DEVICE`, which must exit 2 before writing its output: the error lines it printed."""
    out = world.root / f"{device.replace(':', '')}-{command}"
    argv = {"export-tols": ["export-tols", S(world.memoryllm), S(out)],
            "analyze": ["analyze", S(world.memoryllm), "--texts", S(world.texts), "--out", S(out)],
            "demo": ["demo", "--quick", "--steps", "1", "--archs", "llama", "--out", S(out)]}[command]
    with pytest.raises(SystemExit) as stop:
        cli_main([*argv, "--device", device])
    assert stop.value.code == 2
    assert not out.exists()
    return [line for line in capsys.readouterr().err.splitlines() if "error:" in line]


@pytest.mark.parametrize("command", ["export-tols", "analyze", "demo"])
def test_a_cuda_device_the_machine_lacks_gets_a_one_line_error(command, world, monkeypatch, capsys):
    """`--device cuda:1` on a machine with one GPU: refused when parsed, not in a traceback once the model moves."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    errors = device_refusal(world, command, "cuda:1", capsys)
    assert len(errors) == 1 and "cuda:1" in errors[0] and "cuda:0..0" in errors[0], errors


@pytest.mark.parametrize("command", ["export-tols", "analyze"])
def test_an_mps_device_the_machine_lacks_gets_a_one_line_error(command, world, monkeypatch, capsys):
    """`--device mps` on a machine without MPS: refused when parsed, not in a traceback once the model was loaded."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    errors = device_refusal(world, command, "mps", capsys)
    assert len(errors) == 1 and "--device" in errors[0] and "no MPS device" in errors[0], errors


def test_a_path_that_starts_with_a_tilde_after_an_equals_sign_is_in_the_home_folder(world, tmp_path, monkeypatch,
                                                                                     capsys):
    """The shell makes `~` the home folder in a word of its own, not after `=`: `--out=~/tables` made a folder
    named `~` in the current directory, and `--eval-text=~/heldout.txt` did not exist. Paths are taken from the home
    folder, as typed in a word of their own."""
    monkeypatch.setenv("HOME", str(world.root))
    monkeypatch.chdir(tmp_path)
    assert cli_main(["export-tols", "~/memoryllm", "--eval-text=~/texts", "--format", "fp32", "--device", "cpu",
                     "--no-progress", "~/tilde_table"]) == 0
    assert (world.root / "tilde_table" / "token_lookup.safetensors.index.json").is_file()
    assert os.listdir(tmp_path) == []  # (no folder named `~`)
    shutil.rmtree(world.root / "tilde_table")
    capsys.readouterr()
    # each refused for a reason found past reading the path: the path was read from the home folder
    for argv, reason in ((["analyze", "~/memoryllm", "--texts=~/no-such-texts", "--out=~/tilde_report"],
                          "argument --texts: '~/no-such-texts' does not exist"),
                         (["analyze", "~/no_tokenizer", "--tokenizer=~/memoryllm", "--texts=~/texts",
                           "--out=~/tilde_report", "--layers", "9", *ANALYZE_FAST],
                          "--layers: layers [9] do not exist"),
                         (["push", "~/table_only", "user/repo"], "is missing ['model.safetensors or"),
                         (["demo", "--quick", "--text-files=~/texts", "--out=~/tilde_demo"],
                          "the training text has 13 tokens, fewer than --seq-len=64")):
        with pytest.raises(SystemExit) as stop:
            cli_main(argv)
        assert stop.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and reason in errors[0], (argv, errors)
    assert not (world.root / "tilde_report").exists() and not (world.root / "tilde_demo").exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["export-tols", "analyze", "demo"])
def test_an_output_folder_that_cannot_be_written_is_refused_when_parsed(command, world, tmp_path, monkeypatch,
                                                                        capsys, read_only_folder):
    """An output folder this user cannot write into (it exists read-only, or it is missing and the nearest folder
    above it is read-only): refused when the arguments are parsed, naming the option and the read-only folder;
    before, the command loaded the model and exported, analysed or trained, and failed only when it wrote, naming a
    hidden temporary path. (Run as root, which writes anywhere, the folder's mode is read by `os.access` as for
    another user.)"""
    read_only = read_only_folder
    for out in (read_only, read_only / "missing" / "out"):
        argv = {"export-tols": ["export-tols", S(world.memoryllm), S(out)],
                "analyze": ["analyze", S(world.memoryllm), "--texts", S(world.texts), "--out", S(out)],
                "demo": ["demo", "--quick", "--steps", "1", "--archs", "llama", "--out", S(out)]}[command]
        with pytest.raises(SystemExit) as stop:
            cli_main(argv)
        assert stop.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "not writable" in errors[0] and repr(str(read_only)) in errors[0], errors
        assert ("argument --out:" if command != "export-tols" else "argument OUT_DIR:") in errors[0], errors
    assert os.listdir(read_only) == []


def survey() -> int:
    with tempfile.TemporaryDirectory() as root:
        world = build_world(Path(root))
        results = [(case, *run_case(case, world)) for case in CASES
                   if not case.missing_modules()]
    counts = {kind: sum(1 for _, outcome, _ in results if outcome == kind) for kind in (CLEAR, TRACEBACK, SILENT, LOST)}
    print(f"inputs tried: {len(results)}; " + "; ".join(f"{kind}: {n}" for kind, n in counts.items()))
    for case, outcome, detail in results:
        if outcome != CLEAR:
            print(f"  {outcome:11s} {case.name}: {detail[:200]}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(survey())
