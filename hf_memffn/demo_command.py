"""`hf-memffn demo`'s command line: its settings and arguments, which import neither torch nor the models (its
`--help` and argument errors answer at once); `run` imports the demo itself (hf_memffn/demo.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .cli_args import local_path, output_dir, positive_int

# `architectures.ARCHITECTURE_NAMES`, which imports the models (tests/test_packaging.py checks that they agree)
DEMO_ARCHITECTURES = ("llama", "flash_mhf", "memoryllm", "flex_memoryllm", "kvffn")


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the run. `DEFAULT` takes about two minutes on a 2-core CPU, `QUICK` a few seconds."""

    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    num_entities: int
    vocab_size: int  # upper bound for the fact world (BPE stops early), the vocabulary for real text
    warmup_fraction: float = 0.1


DEFAULT = DemoSettings(steps=600, batch_size=16, seq_len=64, learning_rate=5e-3, hidden_size=64, num_layers=2,
                       num_heads=2, intermediate_size=192, num_entities=16, vocab_size=2048)
QUICK = DemoSettings(steps=24, batch_size=8, seq_len=64, learning_rate=3e-3, hidden_size=64, num_layers=2,
                     num_heads=2, intermediate_size=128, num_entities=8, vocab_size=2048)
REAL_TEXT_VOCAB_SIZE = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", nargs="+", default=list(DEMO_ARCHITECTURES), metavar="ARCH",
                        help="architectures to train (space or comma separated); "
                             f"default: all of {', '.join(DEMO_ARCHITECTURES)}")
    parser.add_argument("--steps", type=int, help=f"optimizer steps per model (default {DEFAULT.steps})")
    parser.add_argument("--batch-size", type=int, help=f"sequences per step (default {DEFAULT.batch_size})")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {DEFAULT.seq_len})")
    parser.add_argument("--lr", type=float, help=f"peak learning rate (default {DEFAULT.learning_rate})")
    parser.add_argument("--hidden-size", type=int, help=f"model width (default {DEFAULT.hidden_size})")
    parser.add_argument("--num-layers", type=int, help=f"decoder layers (default {DEFAULT.num_layers})")
    parser.add_argument("--intermediate-size", type=int,
                        help=f"FFN width of the baseline; the other architectures are sized from it "
                             f"(default {DEFAULT.intermediate_size})")
    parser.add_argument("--num-entities", type=int,
                        help=f"people in the fact world (default {DEFAULT.num_entities})")
    parser.add_argument("--vocab-size", type=int,
                        help=f"tokenizer vocabulary (default: up to {DEFAULT.vocab_size} on the fact world, "
                             f"{REAL_TEXT_VOCAB_SIZE} on real text)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the initial weights and the batches")
    parser.add_argument("--out", default="./memffn-demo", type=output_dir,
                        help="output directory (default ./memffn-demo)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run with tiny models")
    data = parser.add_argument_group("real text instead of the fact world (no fact recall then)")
    data.add_argument("--text-files", nargs="+", metavar="FILE", type=local_path, help="local UTF-8 text files")
    data.add_argument("--dataset", type=local_path,
                      help="a `datasets` Hub name or a local folder (needs `pip install datasets`, or the train extra)")
    data.add_argument("--dataset-config", help="configuration name of --dataset")
    data.add_argument("--dataset-split", default="train", help="split of --dataset (default train)")
    data.add_argument("--text-column", default="text", help="text column of --dataset (default text)")
    data.add_argument("--max-chars", type=positive_int, default=5_000_000,
                      help="read at most this many characters of real text (default 5,000,000)")


def run(args: argparse.Namespace) -> int:
    from .demo import run as run_demo

    return run_demo(args)
