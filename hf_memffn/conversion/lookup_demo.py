"""The demo's token-lookup step: export a checkpoint's table, then generate in compute and in lookup mode."""

from __future__ import annotations

import os

import torch

from .export import _load_model, export_tols, refuse_without_lm_head


def demo_step(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, prompt_ids: torch.Tensor | None = None,
              max_new_tokens: int = 16, formats=("fp32", "int8"), device=None) -> dict:
    """Export the table of the MemoryLLM / FlexMemoryLLM in `model_dir` (one sub-directory of `out_dir` per format)
    and compare lookup mode with compute mode (model loaded in fp32): logits on the prompt, greedy `generate()`.

    Returns {format: {"size_bytes", "max_relative_error", "mean_relative_error", "logits_max_relative_diff",
    "tokens_match", "generated_compute", "generated_lookup"}}.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _load_model(os.fspath(model_dir), device, "fp32")
    refuse_without_lm_head(model, "demo_step", "comparing the logits and generate()")
    base = model.model
    if prompt_ids is None:
        generator = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=generator)
    prompt_ids = prompt_ids.to(device)
    # (one prompt, so the pad id only keeps generate() from warning; a config may name several end-of-sequence ids)
    pad_token_id = model.config.pad_token_id
    if pad_token_id is None:
        eos = model.config.eos_token_id
        pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    generate_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    with torch.no_grad():
        logits_compute = model(input_ids=prompt_ids).logits.float()
        tokens_compute = model.generate(prompt_ids, **generate_kwargs)
    results = {}
    placement = "gpu" if device.type == "cuda" else "cpu"
    for name in formats:
        table_dir = os.path.join(os.fspath(out_dir), name)
        report = export_tols(model, table_dir, format=name, progress=False)
        model.load_tols(table_dir, placement=placement)
        with torch.no_grad():
            logits_lookup = model(input_ids=prompt_ids).logits.float()
            tokens_lookup = model.generate(prompt_ids, **generate_kwargs)
        base.token_lookup = None  # back to compute mode for the next format
        diff = (logits_lookup - logits_compute).abs().max() / logits_compute.abs().max()
        results[name] = {
            "size_bytes": report["size_bytes"], "max_relative_error": report["max_relative_error"],
            "mean_relative_error": report["mean_relative_error"], "logits_max_relative_diff": float(diff),
            "tokens_match": bool(torch.equal(tokens_lookup, tokens_compute)),
            "generated_compute": tokens_compute[0, prompt_ids.shape[1]:].tolist(),
            "generated_lookup": tokens_lookup[0, prompt_ids.shape[1]:].tolist(),
        }
    return results
