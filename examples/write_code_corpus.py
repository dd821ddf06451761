"""Write a JSONL corpus of about 8 MB of Python's own standard-library source (no tests), one file a document: the
offline training text of the multi-GPU checks (`fsdp2_check.sh`, `ddp_check.sh`).

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
    with atomic_output(path) as temporary, open(temporary, "w") as out:
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if "test" in source.parts or source.resolve() in seen:  # (some Pythons link one module under two names)
                continue
            seen.add(source.resolve())
            text = source.read_text(encoding="utf-8", errors="ignore")  # (PEP 3120: the source encoding)
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text)
            if written > BUDGET:
                break
    print(f"corpus: {written / 1e6:.1f} MB of Python source")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/write_code_corpus.py OUT.jsonl (one path: the corpus to write)")
    main(sys.argv[1])
