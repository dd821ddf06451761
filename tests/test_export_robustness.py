"""What happens to files when processes die, disks fill up, or several processes load one checkpoint at once.

- `hf-memffn export-tols` killed (SIGKILL) at random moments, then run again: the table is byte-identical to an
  uninterrupted export, and no interrupted state ever loads.
- A full disk during the export (a file-size limit on the process): a one-line error, the checkpoint untouched,
  no index and no temporary file left behind; run again with room, the table is byte-identical.
- Several processes load the same checkpoint with `trust_remote_code=True` at the same moment, in Pythons where
  `hf_memffn` cannot be imported: all get the same logits.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_memffn.testing import BLOCK_PACKAGE_IMPORT, tiny_config, tiny_tokenizer
from hf_memffn.token_lookup import INDEX_NAME, TokenLookupError

# Small blocks and shards, so that an export writes many files and a kill lands between or inside them.
EXPORT_ARGS = ["--format", "int8", "--group-size", "16", "--batch-size", "16", "--max-shard-size", "8KB",
               "--device", "cpu", "--no-progress"]


def _env() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return env


def _export_command(model_dir: Path, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "hf_memffn.cli", "export-tols", str(model_dir), str(out_dir), *EXPORT_ARGS]


def _table_bytes(directory: Path) -> dict[str, str]:
    """sha256 of the table's files (the index and the shards; not the timing report)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name.startswith("token_lookup") and not p.name.endswith("report.json")}


def _tree_bytes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("robustness") / "memoryllm"
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm", vocab_size=1024))
    model.save_pretrained(directory)
    reference = directory.parent / "reference"
    subprocess.run(_export_command(directory, reference), check=True, env=_env(), capture_output=True)
    return directory, _table_bytes(reference)


@pytest.mark.slow  # subprocesses (seconds each on a 2-core CPU); CI runs it
def test_export_killed_at_random_moments_resumes_byte_identical(checkpoint, tmp_path):
    model_dir, reference = checkpoint
    assert len(reference) > 10  # many shards: kills land inside the export
    before = _tree_bytes(model_dir)
    out = tmp_path / "table"
    rng = random.Random(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    kills = 0
    for _ in range(2):
        process = subprocess.Popen(_export_command(model_dir, out), env=_env(), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE)
        # wait until the export has started writing, then kill it at a random moment
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline and not (
                out.exists() and any(p.name.startswith("token_lookup-") for p in out.iterdir())):
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
        if not (out / INDEX_NAME).exists():  # an interrupted table never loads
            with pytest.raises(TokenLookupError):
                model.load_tols(out, placement="cpu")
    assert kills >= 1
    subprocess.run(_export_command(model_dir, out), check=True, env=_env(), capture_output=True)
    assert _table_bytes(out) == reference
    assert _tree_bytes(model_dir) == before
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow  # subprocesses (seconds each on a 2-core CPU); CI runs it
def test_full_disk_during_export_is_one_line_and_leaves_nothing_half_written(checkpoint, tmp_path):
    model_dir, reference = checkpoint
    out = tmp_path / "table"
    limited = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))
        from hf_memffn.cli import main
        sys.exit(main({_export_command(model_dir, out)[3:]!r}))
    """)
    before = _tree_bytes(model_dir)
    result = subprocess.run([sys.executable, "-c", limited], env=_env(), capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "File too large" in errors[0] and "Traceback" not in result.stderr
    assert _tree_bytes(model_dir) == before
    names = [p.name for p in out.iterdir()]
    assert INDEX_NAME not in names and not [n for n in names if n.endswith(".tmp")]
    subprocess.run(_export_command(model_dir, out), check=True, env=_env(), capture_output=True)
    assert _table_bytes(out) == reference


def test_a_write_cut_short_leaves_the_file_or_folder_as_it_was(tmp_path):
    """`atomic_output`, which every file of the export, the demo and the reports goes through: a write that stops
    half-way (here an interrupt after the first half of the bytes) leaves the old file or folder as it was and no
    temporary beside it; a write that ends replaces the whole file or folder. (Safetensors removes a file it failed to
    write itself, so the full-disk test above does not see a writer that writes in place.)"""
    from hf_memffn.atomic_write import atomic_output, write_atomic

    target, folder = tmp_path / "table.bin", tmp_path / "folder"
    write_atomic(target, b"old")
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(target) as temporary, open(temporary, "wb") as file:
            file.write(b"new, first half")
            file.flush()
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(folder) as temporary:
            temporary.mkdir()
            (temporary / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert target.read_bytes() == b"old" and [p.name for p in folder.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "table.bin"]
    write_atomic(target, b"new")
    with atomic_output(folder) as temporary:
        temporary.mkdir()
        (temporary / "new.txt").write_text("new")
    assert target.read_bytes() == b"new" and [p.name for p in folder.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "table.bin"]


def test_a_folder_replaced_is_never_missing_while_the_old_one_is_removed(tmp_path, monkeypatch):
    """The folder already at the target is renamed aside and removed after the new one is in place: it is never
    removed first (an interruption during that removal left no folder at the target); a failed rename of the new
    one puts the old one back, and nothing stays beside it."""
    import hf_memffn.atomic_write as atomic_write

    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    removed_while = []
    remove = atomic_write._remove
    monkeypatch.setattr(atomic_write, "_remove",
                        lambda path: (removed_while.append(sorted(p.name for p in folder.iterdir())), remove(path)))
    with atomic_write.atomic_output(folder) as temporary:
        temporary.mkdir()
        (temporary / "new.txt").write_text("new")
    assert removed_while == [["new.txt"]], "the old folder was removed before the new one took its place"
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and (folder / "new.txt").read_text() == "new"

    replace = os.replace

    def replace_failing_into_place(source, destination):
        if Path(source).name.startswith(".final.") and Path(destination) == folder and (Path(source) / "x").exists():
            raise OSError("rename failed")
        return replace(source, destination)

    monkeypatch.setattr(atomic_write.os, "replace", replace_failing_into_place)
    with pytest.raises(OSError, match="rename failed"):
        with atomic_write.atomic_output(folder) as temporary:
            temporary.mkdir()
            (temporary / "x").write_text("x")
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and (folder / "new.txt").read_text() == "new"


@pytest.mark.slow  # subprocesses (seconds each on a 2-core CPU); CI runs it
def test_processes_loading_one_remote_code_checkpoint_at_once(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf"))
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path / "ckpt")
    expected = model.eval()(torch.arange(8)[None]).logits
    script = BLOCK_PACKAGE_IMPORT + textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True).eval()
        torch.save(model(torch.arange(8)[None]).logits, sys.argv[1])
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("PYTHONPATH", None)
    processes = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"logits{i}.pt")], env=env,
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()[-2000:]
    for i in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"logits{i}.pt"), expected)
