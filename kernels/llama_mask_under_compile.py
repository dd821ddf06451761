"""Whether transformers' own `LlamaForCausalLM` hands sdpa a mask or its causal flag in a compiled training step.

    PYTHONPATH=. python kernels/llama_mask_under_compile.py [--out DIR]    # DIR/llama_mask_under_compile.json

The whole-model benchmark's compiled ratios to transformers' Llama depend on it: our decoder passes sdpa no mask
and `is_causal=True` for a batch without padding, which runs the faster attention kernel, where a Llama that builds
an explicit causal mask does not (`docs/speed.md`, "Compiled training: the causal flag"). The benchmark's
`llama_causal_flag` row gives Llama the flag by hand. Which one a user's Llama does is a matter of the installed
transformers and torch, not of the device, so this runs anywhere: a tiny Llama's step (input ids and labels, no
attention mask) is traced by dynamo, and the captured graph's sdpa call says what it was given.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import environment, log, output_folder, write_json  # noqa: E402


def sdpa_calls_of_a_compiled_step() -> list[str]:
    """The lines of the dynamo graph(s) of a tiny Llama's training step that call sdpa."""
    import torch._dynamo
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    try:
        torch.compile(lambda batch: model(input_ids=batch, labels=batch).loss, backend=capture)(ids)
    finally:
        torch._dynamo.reset()
    return [line.strip() for graph in graphs for line in graph.code.splitlines()
            if "scaled_dot_product_attention(" in line]


def llama_gets_the_causal_flag() -> bool:
    """True if the compiled step calls sdpa with `attn_mask = None, ..., is_causal = True`; False if with a mask."""
    calls = sdpa_calls_of_a_compiled_step()
    if not calls:
        raise RuntimeError("the compiled Llama step called no scaled_dot_product_attention: nothing to read")
    flags = {("attn_mask = None" in call) and ("is_causal = True" in call) for call in calls}
    if len(flags) != 1:
        raise RuntimeError(f"the compiled Llama step's sdpa calls disagree: {calls}")
    return flags.pop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, help="directory for llama_mask_under_compile.json")
    args = parser.parse_args(argv)
    import transformers

    flag = llama_gets_the_causal_flag()
    log(f"transformers {transformers.__version__}, torch {torch.__version__}: compiled Llama gives sdpa "
        + ("its causal flag (no mask)" if flag else "an explicit causal mask"))
    if args.out:
        write_json(os.path.join(args.out, "llama_mask_under_compile.json"),
                   {"environment": environment(), "transformers": transformers.__version__,
                    "llama_gets_the_causal_flag": flag})
    return 0


if __name__ == "__main__":
    sys.exit(main())
