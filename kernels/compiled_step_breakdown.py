"""Where a compiled training step's time goes, a model against Llama: the FFN layers against everything else.

Reads a `kernels/bench_models.py` result that holds, for one size, the profiles of both models' compiled training
steps (`profile_train:<size>:<arch>:compiled`) and the FFN layers timed alone (`layer:<size>:compiled`, or
`layer:<size>` where no compiled rows exist), and writes a table of

- the FFN layers' time per step: the model's decoder layers times its FFN layer's forward + backward timed alone;
- everything else: the profiled step's kernel time less that (attention, its projections, the norms, the rotary
  embeddings, the embedding and the LM head);
- the kernel time per step, and Llama's over the model's;
- the model's kernel time if its FFN layer took the SwiGLU MLP of equal parameters' time, or `--layer-ratios` times it
  (issue 15 asks for 1.1x), everything else unchanged.

    PYTHONPATH=. python kernels/compiled_step_breakdown.py RESULT.json --out DIR [--sizes 370M 1.3B]
        [--baseline llama_causal_flag] [--model flash_mhf] [--layer-ratios 1.0 1.1]

A layer's time alone and its share of a whole step differ by what the step runs beside it (caches, clocks), so the
split is an estimate; its kernel totals are the profile's own. Writes DIR/compiled_step_breakdown.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, markdown_table, output_folder, read_json, write_json, write_text  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "examples"))
from presets import get_preset  # noqa: E402

# the FFN layer row of `bench_models.layer_rows` that each model's decoder layers run: its name, or the start of its
# name where that ends in "d_ff=" (the width follows)
FFN_LAYER = {"llama": "Llama MLP d_ff=", "llama_causal_flag": "Llama MLP d_ff=", "flash_mhf": "FlashMHF",
             "kvffn": "KV-FFN"}
# the SwiGLU MLP of the model's FFN parameters (`bench_models.ffn_layers`): FlashMHF's own, KV-FFN's is Llama's MLP
EQUAL_PARAMETERS_SWIGLU = {"flash_mhf": "SwiGLU d_ff=", "kvffn": "Llama MLP d_ff="}
NAMES = {"llama": "Llama (transformers)", "llama_causal_flag": "Llama (transformers) given sdpa's causal flag",
         "flash_mhf": "FlashMHFLlama", "kvffn": "KVFFN"}
SHORT_NAMES = {"llama": "Llama", "llama_causal_flag": "Llama", "flash_mhf": "FlashMHFLlama", "kvffn": "KVFFN"}


def decoder_layers(architecture: str, size: str) -> int:
    base = "llama" if architecture.startswith("llama") else architecture
    return get_preset(size).config_fields(base)["num_hidden_layers"]


def layer_row(results: dict, size: str, name: str) -> dict:
    """The layer row of `size` named `name` (see FFN_LAYER): its compiled timing where there is one, else its eager
    one (the row says which)."""
    rows = [r for r in results.get("layer", []) if r["size"] == size
            and (r["layer"] == name or (name.endswith("d_ff=") and r["layer"].startswith(name)))]
    for mode in ("compiled", "eager"):
        for row in rows:
            if row.get("mode", "eager") == mode:
                return row
    raise ValueError(f"no layer row of size {size} named {name!r}: run the task layer:{size}:compiled")


def step_profile(results: dict, size: str, architecture: str) -> dict:
    name = f"train_step_{size}_{architecture}_compiled"
    if name not in results.get("profile", {}):
        raise ValueError(f"no profile {name}: run the task profile_train:{size}:{architecture}:compiled")
    return results["profile"][name]


def breakdown(results: dict, size: str, baseline: str, model: str, layer_ratios=(1.0, 1.1)) -> dict:
    """The split of both models' compiled steps at `size` (ms per step), and `model`'s kernel time with its FFN layer
    at each of `layer_ratios` times the SwiGLU MLP of equal parameters."""
    for architecture in (baseline, model):
        if architecture not in FFN_LAYER:
            raise ValueError(f"model {architecture!r}: one of {', '.join(FFN_LAYER)} (those with an FFN layer row)")
    columns = {}
    for architecture in (baseline, model):
        layer = layer_row(results, size, FFN_LAYER[architecture])
        layers = decoder_layers(architecture, size)
        kernel_ms = step_profile(results, size, architecture)["kernel_us_per_step"] / 1e3
        ffn_ms = layers * layer["train_ms"]
        columns[architecture] = {"decoder_layers": layers, "ffn_layer": layer["layer"],
                                 "ffn_layer_mode": layer.get("mode", "eager"), "ffn_layer_ms": layer["train_ms"],
                                 "ffn_layers_ms": ffn_ms, "rest_ms": kernel_ms - ffn_ms, "kernel_ms": kernel_ms}
    base_ms = columns[baseline]["kernel_ms"]
    for column in columns.values():
        column["baseline_over_model"] = base_ms / column["kernel_ms"]
    swiglu = layer_row(results, size, EQUAL_PARAMETERS_SWIGLU[model])
    target = columns[model]
    projections = []
    for ratio in layer_ratios:
        kernel_ms = target["rest_ms"] + target["decoder_layers"] * ratio * swiglu["train_ms"]
        projections.append({"layer_over_swiglu": ratio, "kernel_ms": kernel_ms,
                            "baseline_over_model": base_ms / kernel_ms})
    return {"size": size, "baseline": baseline, "model": model, "columns": columns,
            "swiglu_equal_parameters": {"layer": swiglu["layer"], "mode": swiglu.get("mode", "eager"),
                                        "train_ms": swiglu["train_ms"]},
            "layer_over_swiglu_now": target["ffn_layer_ms"] / swiglu["train_ms"], "projections": projections}


def report(parts: list[dict], source: str, environment: dict) -> str:
    lines = ["# Where a compiled training step's time goes", "",
             f"From `{source}` ({environment.get('device', '?')}; torch {environment.get('torch', '?')}, triton "
             f"{environment.get('triton', '?')}, transformers {environment.get('transformers', '?')}). Kernel time "
             "per step from the profiled compiled step; the FFN layers are the decoder's layer count times the layer's "
             "forward + backward timed alone in the same call; everything else is the difference.", ""]
    for part in parts:
        base, model = part["columns"][part["baseline"]], part["columns"][part["model"]]
        name = {key: NAMES.get(key, key) for key in (part["baseline"], part["model"])}
        lines += [f"## {part['size']}", ""]
        lines += markdown_table(
            ["ms per step", name[part["baseline"]], name[part["model"]], "difference"],
            [["decoder layers", base["decoder_layers"], model["decoder_layers"],
              model["decoder_layers"] - base["decoder_layers"]],
             ["one FFN layer alone, forward + backward", f"{base['ffn_layer_ms']:.3f} ({base['ffn_layer']}, "
              f"{base['ffn_layer_mode']})", f"{model['ffn_layer_ms']:.3f} ({model['ffn_layer']}, "
              f"{model['ffn_layer_mode']})", f"{model['ffn_layer_ms'] - base['ffn_layer_ms']:+.3f}"],
             ["the FFN layers", f"{base['ffn_layers_ms']:.1f}", f"{model['ffn_layers_ms']:.1f}",
              f"{model['ffn_layers_ms'] - base['ffn_layers_ms']:+.1f}"],
             ["everything else", f"{base['rest_ms']:.1f}", f"{model['rest_ms']:.1f}",
              f"{model['rest_ms'] - base['rest_ms']:+.1f}"],
             ["all kernels", f"{base['kernel_ms']:.1f}", f"{model['kernel_ms']:.1f}",
              f"{model['kernel_ms'] - base['kernel_ms']:+.1f}"],
             [f"{SHORT_NAMES[part['baseline']]}'s kernel time over the model's", "1.00",
              f"{model['baseline_over_model']:.2f}", ""]])
        swiglu = part["swiglu_equal_parameters"]
        lines += ["", f"{name[part['model']]}'s FFN layer takes {part['layer_over_swiglu_now']:.2f}x the time of the "
                  f"SwiGLU MLP of equal parameters ({swiglu['layer']}, {swiglu['train_ms']:.3f} ms, {swiglu['mode']}). "
                  "With everything else as it is:", ""]
        lines += markdown_table(["its layer at", "kernel ms per step", f"{SHORT_NAMES[part['baseline']]}'s over it"],
                                [[f"{p['layer_over_swiglu']:.2f}x that MLP", f"{p['kernel_ms']:.1f}",
                                  f"{p['baseline_over_model']:.2f}"] for p in part["projections"]])
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", help="a models_bench.json of kernels/bench_models.py")
    parser.add_argument("--out", type=output_folder, required=True, help="folder for compiled_step_breakdown.{json,md}")
    parser.add_argument("--sizes", nargs="+", default=["370M", "1.3B"])
    parser.add_argument("--baseline", default="llama_causal_flag", choices=["llama", "llama_causal_flag"])
    parser.add_argument("--model", default="flash_mhf", choices=["flash_mhf", "kvffn"])
    parser.add_argument("--layer-ratios", nargs="+", type=float, default=[1.0, 1.1])
    args = parser.parse_args(argv)
    for size in args.sizes:  # (a size no preset has: not a task to run, as a missing row's message would say)
        try:
            get_preset(size)
        except ValueError as error:
            parser.error(f"--sizes: {error}")
    try:
        results = read_json(args.result)
    except (OSError, ValueError) as error:
        parser.error(f"result {args.result!r}: {error}; allowed: a models_bench.json of kernels/bench_models.py")
    if not isinstance(results, dict):
        parser.error(f"result {args.result!r} holds no results object; allowed: a models_bench.json of "
                     "kernels/bench_models.py")
    try:
        parts = [breakdown(results, size, args.baseline, args.model, args.layer_ratios) for size in args.sizes]
    except ValueError as error:
        parser.error(str(error))
    source = os.path.relpath(os.path.abspath(args.result), ROOT)
    out = {"source": source, "environment": results.get("environment", {}), "breakdown": parts}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "compiled_step_breakdown.json"), out)
    text = report(parts, source, out["environment"])
    write_text(os.path.join(args.out, "compiled_step_breakdown.md"), text)
    print(text)
    return out


if __name__ == "__main__":
    main()
