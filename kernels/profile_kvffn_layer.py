"""Where KV-FFN's FFN layer spends its time against Llama's MLP, eager and under torch.compile, and what the layout of
its key/value projection costs.

    PYTHONPATH=. python kernels/profile_kvffn_layer.py --out DIR                 # 370M and 1.3B shapes, on the GPU
    PYTHONPATH=. python kernels/profile_kvffn_layer.py --out DIR --device cpu --sizes tiny --seq-len 16   # smoke run

KV-FFN's block (`hf_memffn.ffn.KVFeedForward`) computes its keys and values with one projection whose outputs interleave
them (key i at 2i, value i at 2i + 1) and `act(keys) * values` with a Triton kernel per direction, in eager mode and,
under torch.compile, as Triton operators that inductor launches. Llama's MLP projects gate and up separately, and
inductor fuses its SiLU and product. This script times each layer's forward + backward (the model benchmark's training
shapes: 8 x 2048 tokens at 370M, 4 x 2048 at 1.3B; bf16, as `bench_models.py` builds them), eager and compiled, and
lists the kernels of one forward + backward. Beside the block as the model builds it, the same weights in other
arrangements:

* ``biases, PyTorch activation``: the same block with its ``kernels`` set to ``"torch"`` (as ``decoder_kernels="torch"``
  builds it): the activation as PyTorch operations, which inductor fuses under torch.compile;
* ``no biases``: the block built with ``kvffn_bias=False`` (Llama's MLP in KV-FFN's layout);
* ``no biases, keys then values``: its weights in one projection whose outputs are all keys, then all values;
* ``no biases, two projections``: its weights as two projections, keys and values, as Llama's gate and up.

Writes kvffn_layer_profile.{json,md} into --out.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402
from harness import (  # noqa: E402
    bench_ms, environment, log, markdown_table, measure_on, output_folder, refuse_counts_below, write_json,
    write_report,
)

STEM = "kvffn_layer_profile"
KERNELS_LISTED = 12  # kernels kept per profile, by their time


class KeysThenValues(nn.Module):
    """KV-FFN's maths with one projection whose first half of outputs are the keys and second half the values."""

    def __init__(self, block):
        super().__init__()
        width = block.width
        weight = block.key_value_proj.weight.detach()
        self.key_value_proj = nn.Linear(weight.shape[1], 2 * width, bias=False)
        self.out_proj = copy.deepcopy(block.out_proj)
        self.act_fn = block.act_fn
        with torch.no_grad():
            self.key_value_proj.weight.copy_(torch.cat([weight[0::2], weight[1::2]]))

    def forward(self, hidden_states):
        keys, values = self.key_value_proj(hidden_states).chunk(2, dim=-1)
        return self.out_proj(self.act_fn(keys) * values)


class TwoProjections(nn.Module):
    """KV-FFN's maths with the keys and the values from two projections (Llama's MLP has this form)."""

    def __init__(self, block):
        super().__init__()
        width = block.width
        weight = block.key_value_proj.weight.detach()
        self.key_proj = nn.Linear(weight.shape[1], width, bias=False)
        self.value_proj = nn.Linear(weight.shape[1], width, bias=False)
        self.out_proj = copy.deepcopy(block.out_proj)
        self.act_fn = block.act_fn
        with torch.no_grad():
            self.key_proj.weight.copy_(weight[0::2])
            self.value_proj.weight.copy_(weight[1::2])

    def forward(self, hidden_states):
        return self.out_proj(self.act_fn(self.key_proj(hidden_states)) * self.value_proj(hidden_states))


def layers(size: str, device: str) -> dict[str, nn.Module]:
    """Llama's MLP and KV-FFN's block at `size` (random weights, bf16), the block without its biases, and those
    weights in the other layouts."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hf_memffn import KVFFNModel

    torch.manual_seed(0)
    llama_config = bench_models.build_config("llama", size)
    llama = LlamaMLP(llama_config)
    block = KVFFNModel.build_residual_ffn(bench_models.build_config("kvffn", size))
    plain = KVFFNModel.build_residual_ffn(bench_models.build_config("kvffn", size, kvffn_bias=False))
    with torch.no_grad():
        for param in [*llama.parameters(), *block.parameters(), *plain.parameters()]:
            param.copy_(torch.randn_like(param) * 0.02)
    torch_activation = copy.deepcopy(block)
    torch_activation.kernels = "torch"
    found = {f"Llama MLP d_ff={llama_config.intermediate_size}": llama,
             f"KV-FFN d_ff={block.width}, biases (as the model builds it)": block,
             "KV-FFN, biases, PyTorch activation": torch_activation,
             "KV-FFN, no biases": plain,
             "KV-FFN, no biases, keys then values": KeysThenValues(plain),
             "KV-FFN, no biases, two projections": TwoProjections(plain)}
    return {name: module.to(device, torch.bfloat16) for name, module in found.items()}


def measure(size: str, device: str, compiled: bool) -> list[dict]:
    rows = []
    found = layers(size, device)
    tokens = bench_models.TRAIN_BATCH[size] * bench_models.SEQ_LEN
    hidden = bench_models.build_config("llama", size).hidden_size
    x = torch.randn(bench_models.TRAIN_BATCH[size], bench_models.SEQ_LEN, hidden, device=device,
                    dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    for name, module in found.items():
        params = list(module.parameters())
        call = torch.compile(module) if compiled else module

        def train():
            call(x).backward(grad)

        with torch.no_grad():
            forward_ms = bench_ms(lambda: call(x))
        train_ms = bench_ms(train, grad_to_none=[x, *params])
        table = bench_models.kernel_table(train, steps=3, top=KERNELS_LISTED)
        rows.append({"layer": name, "size": size, "mode": "compiled" if compiled else "eager", "tokens": tokens,
                     "params": sum(p.numel() for p in params), "forward_ms": forward_ms, "train_ms": train_ms,
                     "kernel_us": table["kernel_us_per_step"], "kernels": table["kernels_per_step"],
                     "top": table["top"]})
        log(f"{size} {rows[-1]['mode']} {name}: fwd {forward_ms:.3f} ms, fwd+bwd {train_ms:.3f} ms, "
            f"{table['kernels_per_step']:.0f} kernels")
        call = None  # (a compiled module holds its graphs)
        bench_models.release()
    return rows


def report(results: dict) -> str:
    env = results["environment"]
    lines = [f"# KV-FFN's layer against Llama's MLP, {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; bf16; "
             f"`{results['command']}`", "",
             "Forward + backward of one FFN layer; x Llama: the ratio of times to Llama's MLP in the same mode "
             "(lower is faster).", ""]
    rows = []
    for row in results["rows"]:
        llama = next(r for r in results["rows"] if r["size"] == row["size"] and r["mode"] == row["mode"]
                     and r["layer"].startswith("Llama MLP"))
        rows.append([row["size"], row["mode"], row["layer"], f"{row['params'] / 1e6:.2f}M", f"{row['forward_ms']:.3f}",
                     f"{row['train_ms']:.3f}", f"{row['train_ms'] / llama['train_ms']:.2f}",
                     f"{row['kernels']:.0f}"])
    lines += markdown_table(["size", "mode", "layer", "params", "fwd ms", "fwd+bwd ms", "x Llama", "kernels"], rows)
    lines += ["", "## Kernels of one forward + backward (us)", ""]
    for row in results["rows"]:
        lines += [f"**{row['size']}, {row['mode']}, {row['layer']}** ({row['kernel_us']:.0f} us in all)", ""]
        lines += markdown_table(["kernel", "calls", "us"],
                                [[f"`{name[:100]}`", f"{calls:.0f}", f"{us:.1f}"] for name, calls, us in row["top"]])
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True, help=f"folder for {STEM}.{{json,md}}")
    parser.add_argument("--sizes", nargs="+", default=["370M", "1.3B"], choices=sorted(bench_models.TRAIN_BATCH))
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--seq-len", type=int, default=bench_models.SEQ_LEN)
    args = parser.parse_args()
    refuse_counts_below(parser, args, seq_len=1)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("profile_kvffn_layer.py needs a CUDA GPU (or --device cpu for a smoke run)")
    measure_on(args.device)
    bench_models.SEQ_LEN = args.seq_len
    results = {"environment": environment(), "command": " ".join(["python", *sys.argv]), "rows": []}
    for size in args.sizes:
        for mode in args.modes:
            results["rows"] += measure(size, args.device, mode == "compiled")
            write_json(os.path.join(args.out, f"{STEM}.json"), results)  # (kept if a later measurement stops)
    write_report(args.out, STEM, results, report(results))


if __name__ == "__main__":
    main()
