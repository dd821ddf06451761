"""The model card (README.md) written next to a saved checkpoint.

`render_model_card(model)` describes the architecture, the config fields that define it, the parameter counts and
how to load the folder with `trust_remote_code`, as the class it was saved from (base model, causal LM or task head,
whose task gives the card's pipeline tag); for MemoryLLM / FlexMemoryLLM it says whether token lookup tables
are attached and how to export and load them. `save_pretrained` writes it through `write_model_card` when the
package is installed; checkpoints do not carry this file. The sections generated from the model lie between
two markers (HTML comments, hidden on the Hub); saving again into the folder rewrites them and the metadata, and
keeps what the user wrote outside them (and the "Training" section). A README.md without the markers is not this
package's and is left alone.

The card's metadata (license, base_model, datasets, tags) is built with `huggingface_hub.ModelCardData`; set it
with `model.attach_card_metadata(...)` or pass it here; the metadata of this package's card in the folder written
to (else in the local folder the model was loaded from) is kept under those fields, and tags are merged.
`render_model_card(training_summary=...)` appends the training summary that transformers'
`Trainer.create_model_card` writes (see `hub.keep_model_card`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .atomic_write import write_atomic

CARD_PLACEHOLDER_PATH = "path/to/this/folder"  # shown in the usage snippet when no Hub repo id is known
TABLE_INDEX_NAME = "token_lookup.safetensors.index.json"  # written by `hf-memffn export-tols`
LOOKUP_HEADING = "## Token lookup tables"
GENERATED_START = "<!-- hf-memffn: generated on every save, up to the end marker; write your own text outside -->"
GENERATED_END = "<!-- hf-memffn: end of the generated sections -->"

ARCHITECTURE_SUMMARIES = {
    "memffn_flash_mhf": (
        "FlashMHFLlama",
        "A Llama-style decoder whose feed-forward block is a Flash Multi-Head FFN (FlashMHF). The hidden state is "
        "projected to `ffn_num_heads` heads; in each head, `ffn_num_subnetworks` SwiGLU sub-networks read the head's "
        "query and their outputs are mixed by sigmoid gates normalised over the sub-networks.",
    ),
    "memffn_memoryllm": (
        "MemoryLLM",
        "A Llama-style decoder without a feed-forward block on the residual stream: layer l adds "
        "`FFN_l(X0)`, a SwiGLU FFN of the token embeddings X0, next to attention. Because those FFNs see only the "
        "token id, they can be precomputed once per vocabulary token into token lookup tables (ToLs) and read "
        "instead of computed.",
    ),
    "memffn_flex_memoryllm": (
        "FlexMemoryLLM",
        "A Llama-style decoder with two FFNs per layer: FFN-C on the layer input (parallel to attention) and "
        "FFN-M on the token embeddings X0. FFN-M depends only on the token id, so it can be precomputed into "
        "token lookup tables (ToLs); FFN-C keeps computing on the residual stream.",
    ),
    "memffn_kvffn": (
        "KVFFN",
        "A Llama-style decoder whose feed-forward block is the KV-FFN block "
        "`y = W_o({activation}(W_k x + b_k) {composition} (W_v x + b_v)) + b_o`: keys select, values carry; the `+ x` "
        "of the paper's equation is the decoder's residual connection.{inner_residual}",
    ),
}

# The baselines and ablations a config option selects, described in place of the architecture's own block.
VARIANT_SUMMARIES = {
    ("memffn_flash_mhf", "swiglu"): (
        "A Llama decoder with Llama's SwiGLU MLP as its feed-forward block: the FlashMHF paper's SwiGLU baseline "
        "(`ffn_variant=\"swiglu\"`)."),
    ("memffn_flash_mhf", "mh_ffn"): (
        "A Llama-style decoder whose feed-forward block is the FlashMHF paper's naive multi-head FFN baseline "
        "(`ffn_variant=\"mh_ffn\"`): the hidden state is projected to `ffn_num_heads` heads and each head's query "
        "goes through one SwiGLU sub-network, with no gates."),
    ("memffn_flash_mhf", "dense_moe"): (
        "A Llama-style decoder whose feed-forward block is the FlashMHF paper's Dense-MoE baseline "
        "(`ffn_variant=\"dense_moe\"`): a single head, in which `ffn_num_subnetworks` SwiGLU sub-networks read the "
        "whole projected hidden state and are mixed by sigmoid gates normalised over the sub-networks."),
    ("memffn_flash_mhf", "pkv"): (
        "A Llama-style decoder whose feed-forward block is the FlashMHF paper's parametric key-value baseline "
        "(`ffn_variant=\"pkv\"`): the hidden state is projected to `ffn_num_heads` heads and each head attends, "
        "with a softmax, over `intermediate_size` learned key/value slots of its own."),
    ("memffn_kvffn", "relu"): (
        "A Llama-style decoder whose feed-forward block is the KV-FFN paper's ReLU FFN baseline "
        "(`ffn_variant=\"relu\"`): `y = W_o relu(W_k x + b_k) + b_o`, keys without values."),
    ("memffn_kvffn", "glu"): (
        "A Llama-style decoder whose feed-forward block is the KV-FFN paper's GLU baseline (`ffn_variant=\"glu\"`): "
        "`y = W_o(sigmoid(W_k x + b_k) * (W_v x + b_v)) + b_o`."),
    ("memffn_kvffn", "densenet"): (
        "A Llama-style decoder whose feed-forward block is the KV-FFN paper's DenseNet baseline "
        "(`ffn_variant=\"densenet\"`): the output layer reads the hidden features and the block input "
        "concatenated, `y = W_o [relu(W_k x + b_k); x] + b_o`."),
}
# What runs the FFN of FlashMHF and of the baselines that run its op, by the config's `ffn_kernel`: "torch" runs the
# PyTorch op also on CUDA (the demo saves so a model on CUDA whose FFN heads the Triton kernels do not take).
FLASH_MHF_OP_VARIANTS = ("flash_mhf", "mh_ffn", "dense_moe")
FUSED_KERNEL_NOTE = ("On CUDA the FFN runs as FlashMHF's fused Triton kernel, which never writes the intermediate "
                     "activations to GPU memory.")
PYTORCH_OP_NOTE = 'With `ffn_kernel="torch"` the FFN runs as its PyTorch op on every device, CUDA included.'
# The fields of each variant's card (those a variant ignores are left out); the architecture's list otherwise.
VARIANT_FIELDS = {
    ("memffn_flash_mhf", "swiglu"): ("ffn_variant", "hidden_act"),
    ("memffn_flash_mhf", "pkv"): ("ffn_variant", "ffn_num_heads", "ffn_head_dim", "ffn_query_norm",
                                  "ffn_io_projections"),
    ("memffn_kvffn", "relu"): ("ffn_variant", "kvffn_bias", "kvffn_init", "kvffn_dropout"),
    ("memffn_kvffn", "glu"): ("ffn_variant", "kvffn_bias", "kvffn_init", "kvffn_dropout"),
    ("memffn_kvffn", "densenet"): ("ffn_variant", "kvffn_bias", "kvffn_init", "kvffn_dropout"),
}

SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
)
ARCHITECTURE_FIELDS = {
    "memffn_flash_mhf": (
        "ffn_variant",
        "ffn_num_heads",
        "ffn_head_dim",
        "ffn_num_subnetworks",
        "subnetwork_size",
        "ffn_num_kv_heads",
        "ffn_query_norm",
        "ffn_io_projections",
        "ffn_kernel",
    ),
    "memffn_memoryllm": ("token_memory_size",),
    "memffn_flex_memoryllm": ("memory_intermediate_size",),
    "memffn_kvffn": (
        "ffn_variant",
        "kvffn_activation",
        "kvffn_composition",
        "kvffn_bias",
        "kvffn_inner_residual",
        "kvffn_init",
        "kvffn_dropout",
    ),
}
MEMORY_MODEL_TYPES = ("memffn_memoryllm", "memffn_flex_memoryllm")
CARD_METADATA_FIELDS = ("license", "base_model", "datasets", "tags", "language")
GENERATED_CARD_FIELDS = ("library_name", "pipeline_tag")  # the front matter's fields that every save writes anew
# The Auto class that loads a checkpoint as the class it was saved from (the base model, the causal LM or a task head;
# a class's `auto_class_name`), with the Hub's pipeline tag of that task and the usage snippet's line that reads the
# model's outputs (`{inputs}`: `**inputs` from the tokenizer, or `input_ids`).
AUTO_CLASS_USES = {
    "AutoModel": ("feature-extraction", "hidden_states = model({inputs}).last_hidden_state  # [batch, length, hidden]"),
    "AutoModelForCausalLM": ("text-generation", "logits = model({inputs}).logits"),
    "AutoModelForSequenceClassification": (
        "text-classification", "logits = model({inputs}).logits  # [batch, num_labels]; names: model.config.id2label"),
    "AutoModelForTokenClassification": (
        "token-classification",
        "logits = model({inputs}).logits  # [batch, length, num_labels]; names: model.config.id2label"),
    "AutoModelForQuestionAnswering": (
        "question-answering",
        "outputs = model({inputs})  # start_logits and end_logits of the answer span, [batch, length]"),
}
BASE_TAGS = ("hf-memffn", "custom_code")


def write_model_card(model, save_directory: str | os.PathLike) -> None:
    """Write the model card as README.md into `save_directory`. A card this package wrote there before is written
    again for `model`: its metadata fields are kept (under the model's own) and so is the text outside its generated
    sections; a README.md without the markers of those sections is left alone."""
    path = Path(save_directory) / "README.md"
    card = render_model_card(model, save_directory=save_directory)
    if path.exists():
        old_card = path.read_text(encoding="utf-8")
        if not is_package_card(old_card):
            return
        card = _with_text_outside_generated_sections(card, old_card)
    write_atomic(path, card)


def is_package_card(card: str) -> bool:
    """Whether `card` (a README.md's text) is one this package wrote: it marks its generated sections."""
    start = card.find(GENERATED_START)
    return 0 <= start < card.find(GENERATED_END, start)


def is_earlier_package_card(card: str) -> bool:
    """Whether `card` is one that an earlier version of this package wrote, before it marked its generated sections
    (the same card without the markers): its front matter has the package's tag, and its "Token lookup tables"
    section starts with the status line the package writes. Only that section of such a card is rewritten
    (`refresh_lookup_section`, `card_for_repository`); the rest may hold the user's edits."""
    if is_package_card(card):
        return False
    front_matter = re.match(r"\A---\n(.*?\n)---\n", card, re.DOTALL)
    tagged = front_matter is not None and re.search(
        rf"^- {re.escape(BASE_TAGS[0])}$", front_matter.group(1), re.MULTILINE) is not None
    return tagged and f"\n{LOOKUP_HEADING}\n\n**Token lookup tables: " in card


def _with_text_outside_generated_sections(card: str, old_card: str) -> str:
    """`card`'s front matter and generated sections, with the text `old_card` holds outside them."""
    front_matter = re.compile(r"\A---\n.*?\n---\n", re.DOTALL)
    new_front = front_matter.match(card)
    old_front = front_matter.match(old_card)
    start, end = card.index(GENERATED_START), card.index(GENERATED_END) + len(GENERATED_END)
    old_start, old_end = old_card.index(GENERATED_START), old_card.index(GENERATED_END) + len(GENERATED_END)
    return ((new_front.group(0) if new_front else "") + old_card[old_front.end() if old_front else 0:old_start]
            + card[start:end] + old_card[old_end:])


def refresh_lookup_section(folder: str | os.PathLike) -> bool:
    """Rewrite the "Token lookup tables" section of the card in `folder` (README.md, as `save_pretrained` wrote it)
    for what the folder holds now: after `hf-memffn export-tols MODEL_DIR MODEL_DIR` it says that the table is
    included and how to load it from the folder. The rest of the card (metadata, a training section, edits) is kept;
    a README.md without that section, or without the markers of this package's card (the user's own), is left alone,
    but for a card of an earlier version of the package (`is_earlier_package_card`). Returns whether the card
    changed."""
    path = Path(folder) / "README.md"
    if not path.is_file():
        return False
    card = path.read_text(encoding="utf-8")
    if not (is_package_card(card) or is_earlier_package_card(card)):
        return False
    refreshed = with_current_lookup_section(card, folder)
    if refreshed == card:
        return False
    write_atomic(path, refreshed)
    return True


def with_current_lookup_section(card: str, folder: str | os.PathLike) -> str:
    """`card` (a model card's text) with its "Token lookup tables" section rewritten for the tables `folder` holds
    now; a card without that section is returned unchanged."""
    start = card.find(f"\n{LOOKUP_HEADING}\n")
    if start < 0:
        return card
    start += 1
    # (up to the next section, or the end of the generated ones, where a head's card has no evaluation section)
    end = min((index for index in (card.find("\n## ", start), card.find(f"\n{GENERATED_END}", start)) if index >= 0),
              default=len(card))
    old_section = card[start:end].rstrip("\n")
    location = re.search(r'^checkpoint = "(.*)"$', card, re.MULTILINE)
    loaded_as = re.search(r"^model = (\w+)\.from_pretrained\(checkpoint", card, re.MULTILINE)
    attached = re.search(r"read its FFNs on X0 from a `([^`]*)` table", old_section)
    section = _lookup_section(attached.group(1) if attached else None,
                              location.group(1) if location else CARD_PLACEHOLDER_PATH, folder,
                              loaded_as.group(1) if loaded_as else "AutoModelForCausalLM")
    return card[:start] + section + card[start + len(old_section):]


def card_for_repository(card: str, repo_id: str, folder: str | os.PathLike) -> str:
    """The card of the checkpoint `folder` as the Hub repository `repo_id` should show it: the usage snippets name
    `repo_id` where they named another location (the placeholder path of `save_pretrained`, which knows no
    repository, or another repository), and the "Token lookup tables" section lists the tables the folder holds.
    Only the generated sections change (the snippets of a card without markers anywhere in it; its "Token lookup
    tables" section, the user's own text, is left as it is, as `refresh_lookup_section` leaves it, but in a card of an
    earlier version of the package, `is_earlier_package_card`)."""
    package_card = is_package_card(card)
    start, end = (card.find(GENERATED_START), card.find(GENERATED_END)) if package_card else (0, len(card))
    location = re.search(r'^checkpoint = "(.+)"$', card[start:end], re.MULTILINE)
    named = re.escape(location.group(1) if location else CARD_PLACEHOLDER_PATH)
    # only where the snippets name the location: `"LOC"`, `pretrained=LOC,`, `token_lookup=LOC `, `export-tols LOC `
    in_snippets = re.compile(f'(?<="){named}(?=")|(?<==){named}(?=[, ])|(?<=export-tols ){named}(?= )')
    card = card[:start] + in_snippets.sub(lambda _: repo_id, card[start:end]) + card[end:]
    return with_current_lookup_section(card, folder) if package_card or is_earlier_package_card(card) else card


def check_card_metadata(fields: dict) -> dict:
    """The card metadata fields, checked: a clear error for a field the card does not carry, or for a value of a type
    its front matter does not take (an int's tags failed `save_pretrained` after the weights were written, a number's
    license went into the card as it was)."""
    unknown = sorted(set(fields) - set(CARD_METADATA_FIELDS))
    if unknown:
        raise ValueError(f"model card metadata: {unknown} not supported; allowed fields: {list(CARD_METADATA_FIELDS)}")
    for key, value in fields.items():
        if key == "license":
            valid, allowed = value is None or isinstance(value, str), "None or a string such as 'apache-2.0'"
        else:
            valid = value is None or isinstance(value, str) or (
                isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value))
            allowed = "None, a string or a list of strings"
        if not valid:
            raise ValueError(f"model card metadata: `{key}`={value!r} is invalid; allowed values: {allowed}")
    return {key: value for key, value in fields.items() if value is not None}


def card_metadata(model, save_directory: str | os.PathLike | None = None, **overrides) -> dict:
    """The card's metadata: the fields of this package's card in `save_directory` (else in the local folder the
    model was loaded from; any field, see `_package_card_metadata`), the model's attached fields on top, `overrides`
    on top of those; `base_model` defaults to the Hub repository the weights were loaded from; tags are merged from
    all of them and always include this package's."""
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    kept = _package_card_metadata(save_directory) or _package_card_metadata(source if os.path.isdir(source) else None)
    attached = dict(getattr(model, "card_metadata", None) or {})
    overrides = check_card_metadata(overrides)
    fields = {**kept, **attached, **overrides}
    if "base_model" not in fields and source.count("/") == 1 and not os.path.exists(source):
        fields["base_model"] = source
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    remote_code_tags = BASE_TAGS[1:] if loads_with_remote_code(model) else ()
    tags = [*BASE_TAGS[:1], model_type, *remote_code_tags, *_as_list(getattr(model, "model_tags", None)),
            *(tag for source_fields in (kept, attached, overrides) for tag in _as_list(source_fields.get("tags")))]
    fields["tags"] = list(dict.fromkeys(tag for tag in tags if tag))
    for key in ("datasets", "language"):
        if key in fields:
            fields[key] = _as_list(fields[key])
    return fields


def _package_card_metadata(folder: str | os.PathLike | None) -> dict:
    """The metadata fields of the card this package wrote in `folder`, or {} (also when its front matter was edited
    into invalid YAML: the card written next replaces it): every field but `GENERATED_CARD_FIELDS`, those the user
    added by editing it (`model-index`, `widget`, `inference`, ...) among them; its tags without the package's own."""
    path = Path(folder) / "README.md" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    card = path.read_text(encoding="utf-8")
    if not is_package_card(card):
        return {}
    import yaml
    from huggingface_hub import ModelCard

    try:
        data = ModelCard(card, ignore_metadata_errors=True).data.to_dict()
    except (yaml.YAMLError, ValueError):
        return {}
    fields = {key: value for key, value in data.items() if value is not None and key not in GENERATED_CARD_FIELDS}
    own_tags = {*BASE_TAGS, *ARCHITECTURE_SUMMARIES}
    fields["tags"] = [tag for tag in _as_list(fields.get("tags")) if tag not in own_tags]
    return fields


def _as_list(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def render_model_card(
    model,
    repo_id: str | None = None,
    save_directory: str | os.PathLike | None = None,
    training_summary: str | None = None,
    **metadata,
) -> str:
    """README.md for `model`; `repo_id` goes into the usage snippet, `save_directory` is checked for a lookup table
    (and its card's metadata is kept, see `card_metadata`), `training_summary` (markdown) becomes a "Training"
    section after the generated ones, `metadata` overrides the card metadata fields. A model that `torch.compile`
    wrapped (torch's `OptimizedModule`, whose `save_pretrained` saves the model it wraps) gets that model's card."""
    model = getattr(model, "_orig_mod", model)
    config = model.config
    model_type = getattr(config, "model_type", "")
    name, summary = ARCHITECTURE_SUMMARIES.get(model_type, (type(model).__name__, ""))
    summary = _summary(config, model_type, summary)
    location = repo_id or CARD_PLACEHOLDER_PATH
    auto_class = auto_class_of(model)
    loader = auto_class if loads_with_remote_code(model) else _class_saved_as(type(model)).__name__
    variant = _saved_variant(save_directory)
    sections = [
        _front_matter(card_metadata(model, save_directory, **metadata), AUTO_CLASS_USES[auto_class][0]),
        GENERATED_START,
        f"# {name} ({model_type})",
        summary,
        _parameters_section(model, model_type),
        _config_section(config, model_type),
        _usage_section(model, location, variant),
    ]
    if model_type in MEMORY_MODEL_TYPES:
        sections.append(_lookup_section(_attached_table_format(model), location, save_directory, loader))
    if loader == "AutoModelForCausalLM":  # (lm-eval scores language models, loaded with the checkpoint's code)
        sections.append(_evaluation_section(location, variant))
    sections.append(GENERATED_END)
    if training_summary:
        sections.append("## Training\n\n" + training_summary.strip())
    return "\n\n".join(section for section in sections if section) + "\n"


def _class_saved_as(model_class: type) -> type:
    """`modeling_memffn.class_saved_as`, imported when a card is made (the module imports torch, which `hf-memffn push
    --help` answers without)."""
    from .modeling_memffn import class_saved_as

    return class_saved_as(model_class)


def loads_with_remote_code(model) -> bool:
    """Whether the checkpoint of `model` loads as `model`'s class with `trust_remote_code`: its config's `auto_map`
    names the config's class and the model's class in this package's modeling files (which `save_pretrained` copies
    next to the weights). A user's own classes are saved without such code: a `MemFFNConfig` subclass without
    `class_prefix` gets no `auto_map`, and transformers names a subclass of the package's classes in the module that
    defines it, which imports the package; their cards load them with those classes instead."""
    config = getattr(model, "config", None)
    auto_map = getattr(config, "auto_map", None) or {}
    modeling_module = getattr(type(config), "modeling_module", "")
    return (auto_map.get("AutoConfig") == f"configuration_memffn.{type(config).__name__}"
            and auto_map.get(auto_class_of(model)) == f"{modeling_module}.{_class_saved_as(type(model)).__name__}")


def auto_class_of(model) -> str:
    """The Auto class (a key of `AUTO_CLASS_USES`) that loads `model`'s checkpoint as `model`'s class: a causal LM's
    or a task head's own (`auto_class_name`), `AutoModel` for a base model, else that of a causal LM."""
    name = getattr(model, "auto_class_name", None)
    if name in AUTO_CLASS_USES:
        return name
    return "AutoModel" if getattr(model, "base_model", None) is model else "AutoModelForCausalLM"


def _front_matter(fields: dict, pipeline_tag: str) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(library_name="transformers", pipeline_tag=pipeline_tag, **fields)
    return f"---\n{data.to_yaml()}\n---"


def _full_size(param) -> int:
    """A parameter's number of elements: DeepSpeed ZeRO-3 leaves each rank an empty placeholder and keeps the full size
    in `ds_numel` (the Trainer's final save writes the card from such a model), as `parameter_counts` reads it."""
    return getattr(param, "ds_numel", None) or param.numel()


def _parameters_section(model, model_type: str) -> str:
    if hasattr(model, "parameter_counts"):
        counts = model.parameter_counts()
    else:
        total = sum(_full_size(p) for p in model.parameters())
        counts = {"total": total, "active": total}
    embedding = _full_size(model.get_input_embeddings().weight) if hasattr(model, "get_input_embeddings") else 0
    rows = [("total", counts["total"]), ("embedding (input)", embedding)]
    if model_type in MEMORY_MODEL_TYPES:
        rows.append(("active (on the device once the FFNs on X0 are lookup tables)", counts["active"]))
    table = ["| parameters | count |", "| --- | ---: |"] + [f"| {label} | {value:,} ({_short(value)}) |" for label, value in rows]
    return "## Parameters\n\n" + "\n".join(table)


def _short(count: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(count)


def _summary(config, model_type: str, summary: str) -> str:
    """The architecture's summary, or its baseline's (`ffn_variant`), with KV-FFN's composition and inner residual,
    and what runs FlashMHF's op (`ffn_kernel`)."""
    variant = getattr(config, "ffn_variant", None)
    if (model_type, variant) in VARIANT_SUMMARIES:
        summary = VARIANT_SUMMARIES[model_type, variant]
    elif model_type == "memffn_kvffn":  # the block itself: its formula from its fields
        summary = summary.format(
            activation=config.kvffn_activation,
            composition="+" if config.kvffn_composition == "sum" else "*",
            inner_residual=(" The block also adds its own (normalised) input again, an inner residual connection "
                            "(`kvffn_inner_residual`, an ablation).") if config.kvffn_inner_residual else "",
        )
    if model_type == "memffn_flash_mhf" and variant in FLASH_MHF_OP_VARIANTS:
        summary += " " + (PYTORCH_OP_NOTE if getattr(config, "ffn_kernel", "auto") == "torch" else FUSED_KERNEL_NOTE)
    return summary


def _config_section(config, model_type: str) -> str:
    rows = ["| field | value |", "| --- | --- |"]
    variant = getattr(config, "ffn_variant", None)
    fields = VARIANT_FIELDS.get((model_type, variant), ARCHITECTURE_FIELDS.get(model_type, ()))
    for field in SHARED_FIELDS + fields:
        value = getattr(config, field, None)
        if value is not None:
            rows.append(f"| `{field}` | `{value}` |")
    return "## Configuration highlights\n\n" + "\n".join(rows) + "\n\nThe full configuration is in `config.json`."


def _has_tokenizer(model) -> bool:
    return getattr(model, "attached_tokenizer", None) is not None


def _saved_variant(save_directory) -> str | None:
    """The variant the weights in `save_directory` were saved with (`save_pretrained(..., variant="fp16")`), which
    the snippets pass to `from_pretrained` (`variant="fp16"`) and to lm-eval (`variant=fp16` in `--model_args`):
    neither finds the weights without it."""
    from .hub import weights_variant

    return weights_variant(save_directory)


def _variant_keyword(variant: str | None) -> str:
    return f', variant="{variant}"' if variant else ""


def _variant_model_arg(variant: str | None) -> str:
    return f",variant={variant}" if variant else ""


def _usage_section(model, location: str, variant: str | None = None) -> str:
    auto_class = auto_class_of(model)
    remote_code = loads_with_remote_code(model)
    model_class = _class_saved_as(type(model))
    loader = auto_class if remote_code else model_class.__name__
    load = (f"model = {loader}.from_pretrained(checkpoint{', trust_remote_code=True' if remote_code else ''}, "
            f"dtype=torch.bfloat16{_variant_keyword(variant)})\n")
    if remote_code:
        model_import = f"from transformers import {auto_class}"
        preamble = ("The modeling code ships in this folder (the modeling file named in `config.json` and its "
                    "siblings), so only `transformers` and `torch` are needed (`triton` for the fused GPU kernels):")
    else:
        model_import = (f"# {model_class.__name__}: the class defined in the script that saved this checkpoint"
                        if model_class.__module__ == "__main__" else
                        f"from {model_class.__module__} import {model_class.__name__}")
        preamble = (f"`config.json` names no modeling code in this folder that loads it as {model_class.__name__}, a "
                    "class defined outside the `hf-memffn` package, so `trust_remote_code` does not load it: load it "
                    "with that class (its module imports the package):")
    if _has_tokenizer(model):
        if auto_class == "AutoModelForCausalLM":
            outputs = ("output = model.generate(**inputs, max_new_tokens=20)\n"
                       "print(tokenizer.decode(output[0], skip_special_tokens=True))")
        else:
            outputs = AUTO_CLASS_USES[auto_class][1].format(inputs="**inputs")
        body = (
            f"tokenizer = AutoTokenizer.from_pretrained(checkpoint{', trust_remote_code=True' if remote_code else ''})"
            "  # reads config.json too\n"
            f"{load}"
            'inputs = tokenizer("The capital of France is", return_tensors="pt")\n'
            f"{outputs}"
        )
        imports = f"import torch\n{model_import}\nfrom transformers import AutoTokenizer"
        note = ""
    else:
        outputs = AUTO_CLASS_USES[auto_class][1].format(inputs="input_ids")
        body = f"{load}input_ids = torch.tensor([[1, 2, 3]])\n{outputs}"
        imports = f"import torch\n{model_import}"
        note = "\n\nNo tokenizer was saved with this model: pair it with the tokenizer it was trained with."
    return (
        f"## Usage\n\n{preamble}\n\n"
        f"```python\n{imports}\n\ncheckpoint = \"{location}\"\n{body}\n```{note}"
    )


def _attached_table_format(model) -> str | None:
    """The format's name of the token lookup table `model` reads (`load_tols`), or None when it computes its FFNs."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    table = getattr(base, "token_lookup", None)
    if table is None:
        return None
    return getattr(getattr(getattr(table, "index", None), "fmt", None), "name", "unknown")


def tables_in_subfolders(folder: str | os.PathLike | None) -> list[str]:
    """The subfolders of `folder` (POSIX paths relative to it, sorted) that hold a token lookup table, such as the
    demo's `token_lookup/fp32` and `token_lookup/int8`; a table at the top of `folder` is not listed."""
    if folder is None or not os.path.isdir(folder):
        return []
    root = Path(folder)
    return sorted(index.parent.relative_to(root).as_posix() for index in root.rglob(TABLE_INDEX_NAME)
                  if index.parent != root)


def _dtype_taking_table(table_dir: str) -> str:
    """The dtype, as the snippet writes it, in which a model loaded from the checkpoint takes the table in
    `table_dir`: `torch.float16` for a table exported from fp16 weights (`--model-dtype fp16`, or a checkpoint
    stored in fp16), which the model in bf16 refuses; `torch.bfloat16` for any other (exported from fp32 or bf16
    weights), and where the shards do not say (read from the export record of the first shard)."""
    from .conversion.export import SHARD_RECORD_KEY
    from .token_lookup import read_safetensors_header

    try:
        with open(os.path.join(table_dir, TABLE_INDEX_NAME), encoding="utf-8") as handle:
            shards = json.load(handle)["metadata"]["token_lookup"]["shards"]
        _, header = read_safetensors_header(os.path.join(table_dir, sorted(shards)[0]))
        record = json.loads(header["__metadata__"][SHARD_RECORD_KEY])
        model_dtypes = record["plan_inputs"]["model_dtypes"]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return "torch.bfloat16"
    return "torch.float16" if model_dtypes == ["float16"] else "torch.bfloat16"


def _tables_of_other_weights(folder, tables: list[str]) -> list[str]:
    """Those of `tables` (paths relative to `folder`, "." for its top) that the weights saved in `folder` refuse:
    exported from other weights, as when new weights were saved into the folder after the export (compared by the
    weights' fingerprints, `conversion.export.checkpoint_fingerprints`); none where the folder's weights cannot be
    read."""
    if not tables:
        return []
    from .conversion.export import checkpoint_fingerprints, index_metadata
    from .token_lookup import table_takes

    saved = checkpoint_fingerprints(folder)
    if saved is None:
        return []
    indexes = {table: index_metadata(os.path.join(os.fspath(folder), table, TABLE_INDEX_NAME)) for table in tables}
    # (an index that records no fingerprint, damaged or of another kind, says nothing of the weights: left listed)
    return [table for table, index in indexes.items() if index.get("fingerprint") and not table_takes(index, *saved)]


def _lookup_section(attached_format: str | None, location: str, save_directory,
                    loader: str = "AutoModelForCausalLM") -> str:
    """The "Token lookup tables" section; its snippets load the checkpoint with `loader`, the Auto class of the card
    (with `trust_remote_code`) or the user's own class of a checkpoint without remote code
    (`loads_with_remote_code`)."""
    in_folder = save_directory is not None and os.path.isfile(os.path.join(os.fspath(save_directory), TABLE_INDEX_NAME))
    variant = _saved_variant(save_directory)
    subfolders = tables_in_subfolders(save_directory)
    other_weights = _tables_of_other_weights(save_directory, (["."] if in_folder else []) + subfolders)
    in_folder = in_folder and "." not in other_weights
    subfolders = [] if in_folder else [name for name in subfolders if name not in other_weights]
    if attached_format is not None:
        fmt = attached_format
        status = (
            f"**Token lookup tables: attached.** When this checkpoint was saved the model read its FFNs on X0 from a "
            f"`{fmt}` table instead of computing them."
        )
    else:
        status = "**Token lookup tables: not attached.** The model computes its FFNs on X0 (exact, no table needed)."
    if in_folder or subfolders:
        if in_folder:
            status += f" A table (`{TABLE_INDEX_NAME}` and its shards) is included in this folder."
            table_dir, lm_eval_table = "checkpoint_dir", location
        else:
            status += (" Tables exported from these weights are included in this folder, one subfolder each: "
                       + ", ".join(f"`{name}`" for name in subfolders) + ".")
            table_dir, lm_eval_table = f'f"{{checkpoint_dir}}/{subfolders[0]}"', f"CHECKPOINT_DIR/{subfolders[0]}"
        dtype = _dtype_taking_table(os.path.join(os.fspath(save_directory), *([] if in_folder else [subfolders[0]])))
        how = (
            "Load it from a local copy of this folder:\n\n"
            "```python\n"
            "from huggingface_hub import snapshot_download\n\n"
            f'checkpoint_dir = snapshot_download("{location}")  # or the local folder itself\n'
            f"model = {loader}.from_pretrained(checkpoint_dir"
            f"{', trust_remote_code=True' if loader in AUTO_CLASS_USES else ''}, dtype={dtype}"
            f"{_variant_keyword(variant)})\n"
        )
    else:
        table_dir, lm_eval_table = '"TABLE_DIR"', "TABLE_DIR"
        how = (
            "Export a table from these weights with the `hf-memffn` package (formats: fp32, fp16, bf16, int8, int4, "
            "lowrank), then load it:\n\n"
            f"```bash\nhf-memffn export-tols {location} TABLE_DIR --format bf16\n```\n\n"
            "```python\n"
        )
    if other_weights:
        named = ", ".join(f"`{TABLE_INDEX_NAME}` at its top" if name == "." else f"`{name}`" for name in other_weights)
        status += (f" The folder also holds tables exported from other weights than these, which a model loaded "
                   f"from it refuses (export them again): {named}.")
    section = (
        f"{LOOKUP_HEADING}\n\n"
        f"{status}\n\n{how}"
        f'model.load_tols({table_dir}, placement="gpu")  # or "cpu" / "disk" (host or mapped table, GPU row cache)\n'
        "model.drop_memory_ffn()  # optional: free the FFN weights on X0\n"
        "```\n\n"
        "A table is tied to the weights it was computed from; loading one from other weights raises an error."
    )
    if loader != "AutoModelForCausalLM":  # (lm-eval scores language models, loaded with the checkpoint's code)
        return section
    return (
        f"{section} Evaluate in lookup mode with lm-eval (needs the `hf-memffn` package):\n\n"
        "```bash\n"
        f"python -m hf_memffn.lm_eval_model --model memffn --model_args pretrained={location},"
        f"token_lookup={lm_eval_table}{_variant_model_arg(variant)} --tasks hellaswag,piqa\n"
        "```"
    )


def _evaluation_section(location: str, variant: str | None = None) -> str:
    return (
        "## Evaluation\n\n"
        "```bash\n"
        f"lm_eval --model hf --model_args pretrained={location},trust_remote_code=True"
        f"{_variant_model_arg(variant)} --tasks hellaswag,piqa\n"
        "```"
    )
