"""`hf-memffn analyze MODEL_DIR --texts FILE --out REPORT_DIR`: what do the FFN memories of a model store?

Loads any causal LM the Auto classes know (the four memffn architectures, any HF Llama-family model) with its
tokenizer, runs every instrument of `hf_memffn.analysis` and writes `report.json`, PNG plots and a self-contained
`index.html`.
"""

from __future__ import annotations

import argparse
import os
import time

from ..analyze_command import DTYPES, add_arguments  # noqa: F401
from ..cli_args import TOKENIZER_FILES, UsageError, first_line, has_tokenizer, load_causal_lm


def _load_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    source = args.tokenizer or args.model_dir
    if args.tokenizer is None and os.path.isdir(source) and not has_tokenizer(source):
        raise UsageError(f"no tokenizer found in {source} (none of {', '.join(TOKENIZER_FILES)}); "
                         "pass --tokenizer PATH_OR_HUB_ID")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise UsageError(f"--tokenizer {source}: cannot load a tokenizer: {first_line(error)}") from error


def _last_line(error: BaseException) -> str:
    """The last non-blank line of an error's message (where transformers' field checks name the field and type)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _config_with_overrides(model_dir: str, overrides: dict):
    """The checkpoint's config with `--override` fields set, checked like a config built with them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise UsageError(f"--override {key}: {type(config).__name__} has no field {key!r} (see config.json)")
        if isinstance(getattr(type(config), key, None), property):
            raise UsageError(f"--override {key}: a field {type(config).__name__} derives from others; allowed: the "
                             f"fields of config.json that keep the weights' shapes, e.g. ffn_kernel=torch")
        try:
            setattr(config, key, value)
        except Exception as error:  # transformers' own configs check a field's type when it is set
            raise UsageError(f"--override {key}={value!r}: {type(config).__name__} refuses it: "
                             f"{_last_line(error)}") from error
    if hasattr(config, "validate_fields"):
        config.validate_fields()
    return config


def run(args: argparse.Namespace) -> int:
    import torch

    import hf_memffn  # noqa: F401  (registers the memffn architectures with the Auto classes)

    from .analyze import analyze, read_texts, stream_texts
    from .memory_banks import memory_banks
    from .report import write_report

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    layers = args.layers
    texts = read_texts(args.texts)
    dataset = stream_texts(args.dataset) if args.dataset else None
    start = time.perf_counter()
    tokenizer = _load_tokenizer(args)
    dtype = getattr(torch, dtype_name)
    config = _config_with_overrides(args.model_dir, dict(args.override))
    keys = ", ".join(key for key, _ in args.override)
    try:
        model, loading = load_causal_lm(args.model_dir, config=config, trust_remote_code=True, dtype=dtype,
                                        output_loading_info=True)
    except RuntimeError as error:
        if not args.override or "mismatched" not in str(error):
            raise
        raise UsageError(f"--override {keys}: the checkpoint's weights do not fit the config it gives (their shapes "
                         f"change); allowed: fields that keep the shapes, e.g. ffn_kernel=torch") from error
    except (KeyError, TypeError) as error:  # a value the model's modules refuse when built (e.g. an activation name)
        if not args.override:
            raise
        raise UsageError(f"--override {keys}: the model cannot be built with the config it gives "
                         f"({type(error).__name__}: {first_line(error)})") from error
    unused, missing = sorted(loading["unexpected_keys"]), sorted(loading["missing_keys"])
    if args.override and (unused or missing):
        example = f"{unused[0]} unused" if unused else f"{missing[0]} missing"
        raise UsageError(f"--override {keys}: the config it gives does not use the checkpoint's weights "
                         f"({len(unused)} unused, {len(missing)} missing, e.g. {example}); allowed: fields that keep "
                         f"the weights, e.g. ffn_kernel=torch")
    model.to(device).eval()
    banks = memory_banks(model)
    if layers is not None:
        available = sorted({bank.layer for bank in banks})
        unknown = [layer for layer in layers if layer not in available]
        if unknown:
            raise UsageError(f"--layers: layers {unknown} do not exist; allowed: {available}")
        banks = [bank for bank in banks if bank.layer in layers]
    print(f"analyzing {type(model).__name__} from {args.model_dir} on {device} ({dtype_name}), {len(texts)} texts")
    report = analyze(
        model, tokenizer, texts, dataset=dataset, max_length=args.max_length, batch_size=args.batch_size,
        top_triggers=args.top_triggers, cells_per_bank=args.cells_per_bank, top_tokens=args.top_tokens,
        num_clusters=args.clusters, edits=args.edit, banks=banks,
        cluster_vocabulary=args.cluster_vocabulary, edit_strength=args.edit_strength,
    )
    report["run"] = {"model_dir": str(args.model_dir), "device": device, "dtype": dtype_name,
                     "seconds": round(time.perf_counter() - start, 2)}
    html_path = write_report(report, args.out, title=f"FFN memory analysis: {args.model_dir}")
    print(f"wrote {html_path} and report.json ({report['run']['seconds']} s)")
    return 0
