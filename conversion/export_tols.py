"""Export a MemoryLLM / FlexMemoryLLM's memory FFN as a token lookup table, as a script:

    python conversion/export_tols.py MODEL_DIR OUT_DIR [--format int8 ...]

The same as `hf-memffn export-tols`; the code lives in `hf_memffn/conversion/`. Works with the package installed
(any mode) and from a checkout without installing it.
"""

import sys
from pathlib import Path

try:
    import hf_memffn  # noqa: F401
except ImportError:  # run from a checkout without installing: the package sits one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_memffn.cli import main

if __name__ == "__main__":
    sys.exit(main(["export-tols", *sys.argv[1:]]))
