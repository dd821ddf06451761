"""Writing files and folders so that an interruption never leaves one half-written: everything is written under a
temporary name next to the target and renamed into place when complete (a rename within a folder is atomic)."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_name(path: str | os.PathLike) -> Path:
    """A fresh hidden name next to `path`: `.<name>.<pid>.<random>.tmp`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path next to `path` for the caller to write (a file, or a folder it creates); when the block
    ends without error the temporary replaces `path`, otherwise it is removed and `path` is left as it was.

    A folder already at `path` (which `os.replace` does not replace with a folder) is first renamed aside, then removed
    once the new one is in place: removed first, an interruption during its removal or before the rename left no
    folder at `path`, neither the old one nor the new; a failed rename puts the old one back."""
    path = Path(path)
    temporary = temporary_name(path)
    try:
        yield temporary
        if not (temporary.is_dir() and path.is_dir()):
            os.replace(temporary, path)
            return
        previous = temporary_name(path)
        os.replace(path, previous)
        try:
            os.replace(temporary, path)
        except BaseException:
            os.replace(previous, path)
            raise
        _remove(previous)
    except BaseException:
        _remove(temporary)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` through a temporary file."""
    with atomic_output(path) as temporary:
        if isinstance(data, str):
            temporary.write_text(data, encoding="utf-8")
        else:
            temporary.write_bytes(data)
