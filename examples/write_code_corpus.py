"""Write a JSONL corpus of about 8 MB of Python's own standard-library source (without its `test` package; the test
modules inside other packages, such as `idlelib/idle_test`, stay in), one file a document: the offline training text
of the multi-GPU checks (`fsdp2_check.sh`, `ddp_check.sh`).

    python examples/write_code_corpus.py OUT.jsonl
"""

import json
import sys
import sysconfig
from pathlib import Path

from hf_memffn.atomic_write import atomic_output

BUDGET = 8_000_000  # characters


def main(path: str) -> None:
    """Written under a temporary name and renamed when whole: ddp_check.sh reuses a corpus it finds."""
    written, seen = 0, set()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with atomic_output(path) as temporary, open(temporary, "w") as out:
        for source in sorted(stdlib.rglob("*.py")):
            # the `test` package is found below the standard library's folder only: a folder named `test` above it
            # (where Python is installed) would leave every module out; some Pythons link one module under two names
            if "test" in source.relative_to(stdlib).parts or source.resolve() in seen:
                continue
            seen.add(source.resolve())
            text = source.read_text(encoding="utf-8", errors="ignore")  # (PEP 3120: the source encoding)
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text)
            if written > BUDGET:
                break
    print(f"corpus: {written / 1e6:.1f} MB of Python source")


if __name__ == "__main__":
    # (`--help` was taken for the path: an 8 MB corpus named `--help`)
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python examples/write_code_corpus.py OUT.jsonl (one path: the corpus to write)")
    main(sys.argv[1])
