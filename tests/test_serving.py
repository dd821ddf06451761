"""transformers' own OpenAI-compatible server serves the four architectures with continuous batching.

Two real servers run as subprocesses on loopback ports, started at once:
* `serving.py` copied next to the checkpoints and run as a plain script in a Python where `hf_memffn` cannot be
  imported, `--trust-remote-code`, no model pinned: every request names one of the four saved checkpoints, whose own
  modeling code is loaded;
* `hf-memffn serve MEMORYLLM_DIR --token-lookup MEMORYLLM_DIR --drop-memory-ffn`: the MemoryLLM reads its fp32 token
  lookup table (disk placement) with the memory FFN weights freed, so every answer comes from the table.
Concurrent requests through the `openai` client (completions and chat completions, streamed and not) must return
exactly the text of greedy `generate()` on the same models. The tiny random models only ever choose printable ASCII
tokens (the other rows of their output layer are zero), so texts compare exactly, streamed or not.

The servers and the reference `generate()` run on the CPU; `HF_MEMFFN_SERVE_DEVICE=cuda` runs the same checks on a
GPU (the table then on the GPU too, its default placement there).
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cli.serve import Serve

import hf_memffn
from hf_memffn import serving
from hf_memffn.conversion import export_tols
from hf_memffn.testing import BLOCK_PACKAGE_IMPORT, blocked_imports, run_python, tiny_config, tiny_tokenizer

openai = pytest.importorskip("openai")

STARTUP_SECONDS = 120  # both servers up (imports, model and table loading) on a loaded 2-core machine
REQUEST_SECONDS = 60
MAX_TOKENS = 8
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                "{% if add_generation_prompt %}assistant:{% endif %}"
DEVICE = os.environ.get("HF_MEMFFN_SERVE_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"HF_MEMFFN_SERVE_DEVICE={DEVICE!r}: allowed values are cpu and cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("HF_MEMFFN_SERVE_DEVICE=cuda needs a CUDA device", allow_module_level=True)
TABLE_PLACEMENT = "disk" if DEVICE == "cpu" else "gpu"  # disk reads token ids on the host: no CUDA graph holds it
# On a GPU the FlashMHF checkpoint has one FFN head of 64, the narrowest its fused kernels take (the tiny config's
# heads of 16 stop it there, loudly), so that serving runs them.
SHAPES = {"flash_mhf": dict(intermediate_size=128, ffn_num_heads=1, ffn_num_kv_heads=1, ffn_num_subnetworks=2)} \
    if DEVICE == "cuda" else {}
# How the server says that a request went through continuous batching: a warning per request up to transformers 5.24;
# from 5.25 a request line at info, which `--enable-log-requests` turns on
LOGS_REQUESTS = "enable_log_requests" in inspect.signature(Serve.__init__).parameters
CB_OPTIONS = ["--continuous-batching", "--device", DEVICE, "--cb-num-blocks", "32", "--cb-block-size", "32",
              "--cb-max-batch-tokens", "256", "--host", "127.0.0.1"] + (
    ["--log-level", "info", "--enable-log-requests"] if LOGS_REQUESTS else ["--log-level", "warning"])
PROMPTS = ["the memory reads", "a key of the value head"]
CHATS = [[{"role": "system", "content": "the value"}, {"role": "user", "content": "what does the memory store"}]]


def continuous_batching_requests(log: str) -> int:
    """The requests the server's log says went through continuous batching."""
    if LOGS_REQUESTS:
        return len(re.findall(r"Request \S+: model .*, continuous batching, stream ", log))
    return log.count("CB: True")


def printable_only(model, tokenizer) -> None:
    """Zero the output rows of every token that does not decode to printable ASCII (special tokens included): a
    random model then picks printable tokens (their logits are mostly above 0), and never EOS."""
    keep = torch.tensor([tokenizer.decode([i]).isascii() and tokenizer.decode([i]).isprintable()
                         and i not in tokenizer.all_special_ids for i in range(model.config.vocab_size)])
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def greedy_text(model, tokenizer, input_ids: list[int]) -> str:
    with torch.no_grad():
        output = model.generate(torch.tensor([input_ids], device=model.device), max_new_tokens=MAX_TOKENS,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new_tokens = output[0, len(input_ids):].tolist()
    assert len(new_tokens) == MAX_TOKENS
    return tokenizer.decode(new_tokens, skip_special_tokens=True)


class Server:
    def __init__(self, command: list[str], env: dict, log_path: Path, cwd: Path):
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.process = subprocess.Popen([*command, *CB_OPTIONS, "--port", str(self.port)], env=env, cwd=cwd,
                                        stdout=self.log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                                    timeout=REQUEST_SECONDS, max_retries=0)

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait_until_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"server not up after {STARTUP_SECONDS} s:\n{self.log_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        self.log.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The four tiny checkpoints (with a chat template) and, per checkpoint, the greedy texts `generate()` gives."""
    root = tmp_path_factory.mktemp("serve")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    directories, expected = {}, {}
    for arch in hf_memffn.ARCHITECTURES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **SHAPES.get(arch, {}))).eval()
        printable_only(model, tokenizer)
        model.to(DEVICE).attach_tokenizer(tokenizer)
        directory = root / arch
        model.save_pretrained(directory)
        directories[arch] = str(directory)
        chats = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
                 for chat in CHATS]
        expected[arch] = {
            "completion": [greedy_text(model, tokenizer, tokenizer(prompt)["input_ids"]) for prompt in PROMPTS],
            "chat": [greedy_text(model, tokenizer, chat["input_ids"]) for chat in chats],
        }
        if arch == "memoryllm":
            export_tols(model, directory, format="fp32", progress=False)
    return root, directories, expected


@pytest.fixture(scope="module")
def servers(checkpoints):
    """Start both servers at once; stop them at the end, whatever happened."""
    root, directories, _ = checkpoints
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(root / "modules"), TOKENIZERS_PARALLELISM="false")
    # The bridge alone, beside the checkpoints, in a Python where the package cannot be imported.
    shutil.copy(serving.__file__, root / "serving.py")
    runner = BLOCK_PACKAGE_IMPORT + (
        "\nimport runpy, sys\n"
        "try:\n    import hf_memffn\nexcept ModuleNotFoundError:\n    pass\n"
        "else:\n    raise SystemExit('hf_memffn is importable: the test would prove nothing')\n"
        "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    started = []
    try:
        started.append(Server([sys.executable, "-c", runner, str(root / "serving.py"), "--trust-remote-code"],
                              env, root / "remote_code_server.log", cwd=root))
        memoryllm = directories["memoryllm"]
        started.append(Server([sys.executable, "-m", "hf_memffn.cli", "serve", memoryllm, "--token-lookup", memoryllm,
                               "--token-lookup-placement", TABLE_PLACEMENT, "--drop-memory-ffn"],
                              {**env, "HF_MODULES_CACHE": str(root / "modules_table")}, root / "table_server.log",
                              cwd=Path(__file__).resolve().parents[1]))
        deadline = time.monotonic() + STARTUP_SECONDS
        for server in started:
            server.wait_until_healthy(deadline)
        yield started
    finally:
        for server in started:
            server.stop()


def ask(client, model: str, kind: str, stream: bool, payload) -> tuple[str, dict]:
    """One request; returns the generated text and what the server said about it (usage, finish reason)."""
    common = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
    if kind == "completion":
        response = client.completions.create(prompt=payload, **common)
        pieces = (lambda item: item.choices[0].text)
    else:
        response = client.chat.completions.create(messages=payload, **common)
        pieces = (lambda item: item.choices[0].delta.content or "") if stream else (
            lambda item: item.choices[0].message.content)
    if not stream:
        return pieces(response), {"usage": response.usage.completion_tokens,
                                  "finish": response.choices[0].finish_reason}
    chunks = list(response)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    return "".join(pieces(chunk) for chunk in chunks if chunk.choices), {"usage": None, "finish": finish[-1]}


def run_concurrently(client, jobs: list[tuple]) -> list[tuple[str, dict]]:
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(ask, client, *job) for job in jobs]
        return [future.result(timeout=REQUEST_SECONDS * 2) for future in futures]


def expected_jobs(directories, expected, archs):
    jobs, texts = [], []
    for arch in archs:
        for stream in (False, True):
            for kind, payloads in (("completion", PROMPTS), ("chat", CHATS)):
                for payload, text in zip(payloads, expected[arch][kind]):
                    jobs.append((directories[arch], kind, stream, payload))
                    texts.append(text)
    return jobs, texts


def test_four_architectures_served_from_remote_code_with_continuous_batching(checkpoints, servers):
    _, directories, expected = checkpoints
    server = servers[0]
    jobs, texts = expected_jobs(directories, expected, hf_memffn.ARCHITECTURES)
    results = run_concurrently(server.client, jobs)
    for job, text, (answer, info) in zip(jobs, texts, results):
        assert answer == text, (job, answer, text)
        assert info["finish"] == "length", (job, info)
        assert info["usage"] in (None, MAX_TOKENS), (job, info)
    log = server.log_text()
    assert continuous_batching_requests(log) == len(jobs), log[-3000:]  # every request went through it
    assert "hf_memffn" not in log.replace("hf_memffn is importable", ""), log[-3000:]


def test_memoryllm_served_from_its_token_lookup_table(checkpoints, servers):
    _, directories, expected = checkpoints
    server = servers[1]
    jobs, texts = expected_jobs(directories, expected, ["memoryllm"])
    results = run_concurrently(server.client, jobs)
    for job, text, (answer, _) in zip(jobs, texts, results):
        assert answer == text, (job, answer, text)
    log = server.log_text()
    assert "reads the token lookup table" in log and f"placement={TABLE_PLACEMENT}" in log, log[-3000:]
    assert "weights dropped" in log, log[-3000:]
    assert continuous_batching_requests(log) == len(jobs), log[-3000:]


def test_bridge_names_every_architecture_of_the_package():
    assert set(serving.ARCHITECTURE_NAMES) == {entry.causal_lm_class.__name__ for name, entry in hf_memffn.REGISTRY.items()
                                             if name != hf_memffn.BASELINE}
    from hf_memffn.token_lookup import INDEX_NAME, PLACEMENTS

    assert serving.PLACEMENTS == PLACEMENTS
    assert serving.TABLE_INDEX_NAME == INDEX_NAME


def test_the_bridge_loads_a_folder_of_variant_weights(tmp_path):
    """`hf-memffn serve DIR` of a folder saved with `save_pretrained(DIR, variant="ema")` (model.ema.safetensors
    only): the bridge's load of the model failed ("no file named model.safetensors"), and `transformers serve` has
    no option to name the variant; the bridge loads the variant's weights, as the package's commands do. It reads
    the file names as `hub.weights_variant` does (serving.py imports nothing of the package)."""
    from hf_memffn.hub import weights_variant

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm"))
    model.save_pretrained(tmp_path / "ema", variant="ema")
    loaded = serving.auto_map_loader("MemoryLLMForCausalLM").from_pretrained(str(tmp_path / "ema"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    model.save_pretrained(tmp_path / "sharded", variant="fp16", max_shard_size="100KB")
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "plain", variant="ema")  # (weights without a variant beside: those load)
    model.save_pretrained(tmp_path / "two", variant="b")
    model.save_pretrained(tmp_path / "two", variant="a")
    (tmp_path / "empty").mkdir()
    for folder, variant in (("ema", "ema"), ("sharded", "fp16"), ("plain", None), ("two", "a"), ("empty", None),
                            ("missing", None)):
        assert serving.weights_variant(str(tmp_path / folder)) == weights_variant(tmp_path / folder) == variant, folder


@pytest.fixture
def model_loader_pickling_restored():
    """transformers' server model loader (5.25 and later; else None), which pickles as before once the test ends,
    whatever the bridge installed on it."""
    try:
        from transformers.cli.serving.model_manager import ModelLoader
    except ImportError:
        yield None
        return
    own = vars(ModelLoader).get("__getstate__")
    yield ModelLoader
    if own is not None:
        ModelLoader.__getstate__ = own
    elif "__getstate__" in vars(ModelLoader):
        del ModelLoader.__getstate__


def test_bridge_follows_the_server_into_the_processes_it_spawns(tmp_path, model_loader_pickling_restored):
    """From transformers 5.25 the server loads each model in a process it spawns, into which it pickles its model
    loader: unpickled in a fresh Python where the package cannot be imported, the loader brings the bridge along, and
    the names resolve there through `auto_map`. (The bridge alone, on every transformers.)"""
    from functools import partial

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("kvffn")).save_pretrained(tmp_path / "kvffn")
    bridge = serving.SpawnedProcessBridge(["KVFFNForCausalLM", "LlamaForCausalLM"])
    bridge.import_package = False  # (as where the server runs serving.py as a plain script)
    payloads = [pickle.dumps(bridge)]
    ModelLoader = model_loader_pickling_restored
    assert bridge.install() == (ModelLoader is not None)
    if ModelLoader is not None:
        payloads.append(pickle.dumps(partial(ModelLoader(device="cpu").load_model_and_processor, "model")))
    code = BLOCK_PACKAGE_IMPORT + (
        "\nimport pickle, sys, transformers\n"
        "pickle.loads(sys.stdin.buffer.read())\n"
        "model = transformers.KVFFNForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(type(model).__module__, transformers.LlamaForCausalLM.__module__)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    for payload in payloads:
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "kvffn")], input=payload, env=env,
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        loaded_from, llama_from = done.stdout.decode().split()
        assert loaded_from.startswith("transformers_modules.") and llama_from.startswith("transformers.models.llama")


def test_bridge_resolves_names_through_auto_map_and_keeps_transformers_classes(tmp_path, monkeypatch,
                                                                               model_loader_pickling_restored):
    import transformers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn"))
    model.save_pretrained(tmp_path / "kvffn")
    assert serving.remote_code_architectures(str(tmp_path / "kvffn")) == ["KVFFNForCausalLM"]
    monkeypatch.delattr(transformers, "KVFFNForCausalLM", raising=False)
    added = serving.make_architectures_resolvable(["KVFFNForCausalLM", "LlamaForCausalLM"])
    try:
        assert added == ["KVFFNForCausalLM"]
        assert transformers.LlamaForCausalLM.__module__.startswith("transformers.models.llama")
        loaded = transformers.KVFFNForCausalLM.from_pretrained(str(tmp_path / "kvffn"), trust_remote_code=True)
        assert isinstance(loaded, hf_memffn.KVFFNForCausalLM)  # the package is imported here: its class serves
    finally:
        delattr(transformers, "KVFFNForCausalLM")


def test_bridge_options_name_what_is_wrong(capsys):
    with pytest.raises(SystemExit):
        serving.main(["--token-lookup", "table", "--continuous-batching"])
    assert "needs the model to serve as the first argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving.main(["model", "--drop-memory-ffn"])
    assert "need --token-lookup TABLE_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving.main(["model", "--token-lookup", "t", "--token-lookup-placement", "ram"])
    assert "invalid choice: 'ram'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="KVFFNForCausalLM has no token lookup tables"):
        serving.TokenLookupSettings("m", "t").apply(AutoModelForCausalLM.from_config(tiny_config("kvffn")))


def test_serve_without_the_servers_packages_names_the_extra_to_install_in_one_line():
    """Without transformers[serving] (fastapi, uvicorn, openai), `hf-memffn serve` ended in the server's ImportError
    and its traceback, after the command line had been read."""
    script = blocked_imports("fastapi", "uvicorn") + (
        "from hf_memffn.cli import main; raise SystemExit(main(['serve', '--continuous-batching']))")
    completed = run_python(script)
    assert completed.returncode == 2 and "Traceback" not in completed.stderr, completed.stderr[-2000:]
    assert completed.stderr.strip().splitlines()[-1] == (
        "hf-memffn serve: error: the server needs fastapi, uvicorn, which transformers' serving extra installs and "
        "which are not installed: pip install 'hf-memffn[serve]' (or pip install 'transformers[serving]')")


def test_a_device_the_machine_lacks_is_refused_before_the_server_starts(monkeypatch, capsys):
    """`hf-memffn serve MODEL --device cuda` on a machine without CUDA: the server started, and its model process
    failed loading the model, in a traceback ("RuntimeError: AssertionError: Torch not compiled with CUDA enabled").
    The device is checked first, in one line naming it and what is allowed; `auto`, `cpu` and the GPUs the machine
    has go to the server as they are."""
    import transformers.cli.transformers

    started = []
    monkeypatch.setattr(transformers.cli.transformers, "app", lambda args, prog_name: started.append(args))
    monkeypatch.setattr(serving, "make_architectures_resolvable", lambda names, token_lookup=None: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for arguments, reason in ((["--device", "cuda"], "--device cuda: no CUDA device on this machine"),
                              (["--device=cuda:0"], "--device cuda:0: no CUDA device on this machine"),
                              (["--device", "0"], "--device 0: no CUDA device on this machine"),
                              (["--device", "mps"], "--device mps: no MPS device on this machine")):
        with pytest.raises(SystemExit) as stop:
            serving.main([*arguments, "--continuous-batching"])
        assert stop.value.code == 2
        error = capsys.readouterr().err
        assert f"hf-memffn serve: error: {reason}; allowed here: auto, cpu" in error and "Traceback" not in error, error
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as stop:
        serving.main(["--device", "cuda:1"])
    assert stop.value.code == 2
    assert "this machine has 1 CUDA device(s); allowed here: auto, cpu, cuda, cuda:0..0" in capsys.readouterr().err
    assert started == []
    for device in ("auto", "cpu", "cuda", "cuda:0", "0"):
        assert serving.main(["--device", device, "--continuous-batching"]) == 0
    assert [args[1:] for args in started] == [["--device", device, "--continuous-batching"]
                                             for device in ("auto", "cpu", "cuda", "cuda:0", "0")]


def test_the_served_model_and_its_revision_decide_which_load_reads_the_table(tmp_path):
    """`transformers serve` names a Hub model `id@revision` (`main` when none was given) and keeps a local path whole,
    an `@` in it included: the table goes to the served model's loads only, at the served revision."""
    from hf_memffn import serving

    folder = tmp_path / "ckpt@1000"
    folder.mkdir()
    assert serving.split_revision(str(folder)) == (str(folder), None)
    assert serving.split_revision("org/memllm@dev") == ("org/memllm", "dev")
    assert serving.split_revision("org/memllm") == ("org/memllm", None)
    local = serving.TokenLookupSettings(str(folder), "table")
    assert local.applies_to(str(folder)) and local.applies_to(str(tmp_path / "." / "ckpt@1000"))
    assert not local.applies_to(str(tmp_path))
    pinned = serving.TokenLookupSettings("org/memllm@dev", "table")
    assert pinned.applies_to("org/memllm", "dev")
    assert not pinned.applies_to("org/memllm", "main") and not pinned.applies_to("org/memllm")
    unpinned = serving.TokenLookupSettings("org/memllm", "table")
    assert unpinned.applies_to("org/memllm", "main") and unpinned.applies_to("org/memllm")
    assert not unpinned.applies_to("org/memllm", "dev") and not unpinned.applies_to("org/other", "main")


@pytest.fixture
def memoryllm_and_table(tmp_path):
    """A saved MemoryLLM with its tokenizer and its fp32 table exported to another folder."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm"))
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path / "memoryllm")
    export_tols(str(tmp_path / "memoryllm"), tmp_path / "table", format="fp32", progress=False)
    return tmp_path / "memoryllm", tmp_path / "table"


def test_a_token_lookup_folder_without_a_table_is_refused_before_the_server_starts(memoryllm_and_table, monkeypatch,
                                                                                   capsys):
    """`--token-lookup MODEL_DIR` before the table was exported there: one line, not the server's traceback."""
    import transformers.cli.transformers

    folder, _ = memoryllm_and_table

    def server_started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(transformers.cli.transformers, "app", server_started)
    with pytest.raises(SystemExit) as stop:
        serving.main([str(folder), "--token-lookup", str(folder)])
    assert stop.value.code == 2
    assert "no token lookup table" in capsys.readouterr().err



def test_a_table_exported_from_a_model_of_another_shape_is_refused_before_the_server_starts(memoryllm_and_table,
                                                                                           monkeypatch, capsys):
    """`--token-lookup` of another model's table (another hidden size, vocabulary or depth): the server started, and
    its model process failed loading it, in a traceback ("RuntimeError: TokenLookupError: ..."). The table's index and
    the model's config.json are compared first: one line naming the fields."""
    import transformers.cli.transformers

    folder, table = memoryllm_and_table
    torch.manual_seed(0)
    narrow = AutoModelForCausalLM.from_config(tiny_config("memoryllm", hidden_size=32, num_attention_heads=2,
                                                          num_key_value_heads=1))
    export_tols(narrow, folder.parent / "narrow_table", format="fp32", progress=False)

    def server_started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(transformers.cli.transformers, "app", server_started)
    with pytest.raises(SystemExit) as stop:
        serving.main([str(folder), "--token-lookup", str(folder.parent / "narrow_table"), "--continuous-batching"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "the table was exported from another model: hidden_size=32 (the model has 64)" in error, error
    assert f"export this model's table: hf-memffn export-tols {folder} TABLE_DIR" in error, error
    assert serving.TokenLookupSettings(str(folder), str(table)).problem(serving.read_config(str(folder))) is None

def test_a_table_path_after_an_equals_sign_is_read_from_the_home_folder(memoryllm_and_table, monkeypatch, capsys):
    """`--token-lookup=~/table`: the shell leaves a `~` after `=` as it is, and the table was refused as "no such
    folder, and not a Hub repo id". It is the home folder's, as in a word of its own."""
    import transformers.cli.transformers

    folder, table = memoryllm_and_table
    started, bridged = [], []
    monkeypatch.setattr(transformers.cli.transformers, "app", lambda args, prog_name: started.append(args))
    monkeypatch.setattr(serving, "make_architectures_resolvable",
                        lambda names, token_lookup=None: bridged.append(token_lookup))
    monkeypatch.setenv("HOME", str(table.parent))
    assert serving.main([str(folder), "--token-lookup=~/table", "--continuous-batching"]) == 0, \
        capsys.readouterr().err
    assert started == [["serve", str(folder), "--continuous-batching"]]
    assert [settings.table for settings in bridged] == [str(table)]


def test_the_default_table_placement_follows_the_models_device(memoryllm_and_table, monkeypatch):
    """`--device cpu` on a machine with CUDA: without `--token-lookup-placement` the table stays on the host."""
    folder, table = memoryllm_and_table
    model = AutoModelForCausalLM.from_pretrained(folder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    serving.TokenLookupSettings(str(folder), str(table)).apply(model)
    assert model.model.token_lookup.placement == "cpu"


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_the_default_table_placement_is_where_an_offloaded_embedding_computes(memoryllm_and_table, monkeypatch,
                                                                              trust_remote_code):
    """A device map that offloaded the token embedding leaves its weight on the meta device, and the model computes
    where the offload hook puts it: the table went to the host ("cpu") for a model computing on CUDA. Without a GPU:
    a meta weight with a stand-in for accelerate's hook (its `execution_device`), the package's classes and the
    checkpoint's own code alike."""
    from types import SimpleNamespace

    folder, table = memoryllm_and_table
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code)
    embedding = model.get_input_embeddings()
    embedding.weight = torch.nn.Parameter(torch.empty(embedding.weight.shape, device="meta"))
    embedding._hf_hook = SimpleNamespace(execution_device="cuda:0")
    placements = []
    monkeypatch.setattr(model, "load_tols", lambda path, placement, **kwargs: placements.append(placement) or
                        SimpleNamespace(extra_repr=lambda: f"placement={placement}"))
    serving.TokenLookupSettings(str(folder), str(table)).apply(model)
    assert placements == ["gpu"]
    embedding._hf_hook = SimpleNamespace(execution_device="cpu")
    assert serving.default_placement(model) == "cpu"


def test_a_table_path_that_does_not_exist_says_so_and_what_is_allowed(tmp_path, monkeypatch):
    """A local table path that does not exist (or a file) was taken for a Hub repo id: huggingface_hub's "Repo id must
    be in the form ..." came out of the server's model process (and lm-eval's loader). Now the path is named, with what
    `--token-lookup` takes; a repo id that is neither a local folder nor on the Hub says both."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    (tmp_path / "index.json").write_text("{}")
    for path, reason in ((tmp_path / "no" / "table", "no such folder, and not a Hub repo id"),
                         (tmp_path / "index.json", "is a file, not a folder")):
        with pytest.raises(FileNotFoundError, match=re.escape(reason)) as refused:
            serving.local_table_dir(str(path))
        assert str(path) in str(refused.value) and "allowed: a local folder holding an exported table" in str(
            refused.value) and "Hub repo id" in str(refused.value)
        problem = serving.TokenLookupSettings("model", str(path)).problem({"model_type": "memffn_memoryllm"})
        assert problem.startswith("--token-lookup: ") and reason in problem

    def not_on_the_hub(repo_id, **kwargs):
        raise LocalEntryNotFoundError(f"no cached snapshot of {repo_id}")

    monkeypatch.setattr("huggingface_hub.snapshot_download", not_on_the_hub)
    with pytest.raises(FileNotFoundError, match=r"'tables-typo': no such local folder, and no Hub repo of that id "
                                                r"could be read \(no cached snapshot of tables-typo\)"):
        serving.local_table_dir("tables-typo")


def test_a_table_name_neither_a_folder_nor_on_the_hub_is_refused_before_the_server_starts(memoryllm_and_table,
                                                                                          monkeypatch, capsys):
    """`--token-lookup tables-typo` (a folder name mistyped, so read as a Hub repo id): the server started, and its
    model process failed fetching the table, in a traceback, exit status 1. The repo is fetched first: one line."""
    import transformers.cli.transformers
    from huggingface_hub.errors import LocalEntryNotFoundError

    folder, table = memoryllm_and_table

    def server_started(*args, **kwargs):
        raise AssertionError("the server started")

    def not_on_the_hub(repo_id, **kwargs):
        raise LocalEntryNotFoundError(f"no cached snapshot of {repo_id}")

    monkeypatch.setattr(transformers.cli.transformers, "app", server_started)
    monkeypatch.setattr("huggingface_hub.snapshot_download", not_on_the_hub)
    monkeypatch.chdir(folder.parent)
    with pytest.raises(SystemExit) as stop:
        serving.main([str(folder), "--token-lookup", "tables-typo", "--continuous-batching"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "--token-lookup: token lookup table 'tables-typo': no such local folder, and no Hub repo of that id" in error

    fetched = []
    monkeypatch.setattr("huggingface_hub.snapshot_download",
                        lambda repo_id, **kwargs: fetched.append((repo_id, kwargs)) or str(table))
    settings = serving.TokenLookupSettings(str(folder), "user/tables")
    assert settings.problem(serving.read_config(str(folder))) is None
    assert fetched == [("user/tables", {"revision": None, "allow_patterns": ["token_lookup*"]})]
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo_id, **kwargs: str(folder))
    assert "no token lookup table in this folder" in settings.problem(serving.read_config(str(folder)))


def test_a_model_path_that_does_not_exist_says_so_and_what_is_allowed(tmp_path, monkeypatch, capsys):
    """`hf-memffn serve ./typo`: the path was read as a Hub repo id, and huggingface_hub's "Repo id must use
    alphanumeric chars ..." was the whole answer. Now the path is named, with what MODEL takes, before the server
    starts."""
    import transformers.cli.transformers

    def server_started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(transformers.cli.transformers, "app", server_started)
    for model in (str(tmp_path / "no" / "model"), str(tmp_path / "no" / "model@dev")):
        with pytest.raises(SystemExit) as stop:
            serving.main([model, "--continuous-batching"])
        assert stop.value.code == 2
        error = capsys.readouterr().err
        assert f"MODEL {model}: no such folder, and not a Hub repo id; allowed: a local checkpoint folder" in error
        assert "Repo id must" not in error


def test_the_bridge_alone_names_a_model_it_cannot_find_where_the_package_is_absent(tmp_path):
    """`python serving.py MODEL` beside the checkpoints, on a machine without the package (README: it imports only
    transformers and huggingface_hub): a Hub repo id, or a path that does not exist, is checked as a repo id before
    the server starts. That check imported a sibling of the package, so the script ended in "attempted relative import
    with no known parent package" instead of saying what was wrong with MODEL."""
    shutil.copy(serving.__file__, tmp_path / "serving.py")
    runner = BLOCK_PACKAGE_IMPORT + "\nimport runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], " \
                                    "run_name='__main__')\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    for model, reason in ((str(tmp_path / "no" / "model"), "no such folder, and not a Hub repo id"),
                          ("someone/tiny-kvffn", "cannot read its config.json")):
        done = subprocess.run([sys.executable, "-c", runner, str(tmp_path / "serving.py"), model,
                               "--trust-remote-code", "--continuous-batching"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"MODEL {model}: {reason}" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_model_folder_without_a_config_or_a_file_is_refused_before_the_server_starts(memoryllm_and_table,
                                                                                       monkeypatch, capsys):
    """`hf-memffn serve FOLDER` of a folder holding a tokenizer but no config.json (a tokenizer saved alone, a table
    folder), or of a file: transformers 5.25 reads such a folder's config as empty, so the server started and failed
    in a traceback ("Unrecognized model in ..." / "Unrecognized processing class in ..."). Both are named first."""
    import transformers.cli.transformers

    folder, table = memoryllm_and_table
    tokenizer_only = folder.parent / "tokenizer_only"
    tiny_tokenizer().save_pretrained(tokenizer_only)

    def server_started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(transformers.cli.transformers, "app", server_started)
    for model, reason in ((tokenizer_only, "no config.json in this folder, so no model to serve"),
                          (table, "no config.json in this folder, so no model to serve"),
                          (folder / "config.json", "is a file, not a folder")):
        with pytest.raises(SystemExit) as stop:
            serving.main([str(model), "--continuous-batching"])
        assert stop.value.code == 2
        error = capsys.readouterr().err
        assert f"MODEL {model}" in error and reason in error and "allowed: a local checkpoint folder" in error, error


def test_a_checkpoint_of_another_head_is_refused_not_served_with_a_random_language_modeling_head(tmp_path,
                                                                                              monkeypatch, capsys):
    """`hf-memffn serve` of a `KVFFNForSequenceClassification` checkpoint: its config's `auto_map` names
    `AutoModelForCausalLM` too, so the bridge loaded it as a causal LM, whose `lm_head` the checkpoint lacks
    (initialised at random): the server answered every request with noise. (transformers' Llama of that head fails
    in the server instead.) Such a checkpoint is named before the server starts, and never loaded as a causal LM."""
    import transformers.cli.transformers
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    folder = tmp_path / "kvffn_classifier"
    AutoModelForSequenceClassification.from_config(tiny_config("kvffn", num_labels=2, pad_token_id=0)) \
        .save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert serving.remote_code_architectures(str(folder)) == []

    def server_started(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(transformers.cli.transformers, "app", server_started)
    with pytest.raises(SystemExit) as stop:
        serving.main([str(folder), "--continuous-batching"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert f"MODEL {folder} is a KVFFNForSequenceClassification checkpoint" in error, error
    assert "the server takes a causal LM checkpoint (KVFFNForCausalLM)" in error, error
