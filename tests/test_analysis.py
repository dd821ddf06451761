"""Memory analysis toolkit (hf_memffn.analysis) on tiny random models, CPU only."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hf_memffn.analysis import (
    TokenMemoryEdit,
    TopKPerCell,
    ValueEdit,
    coefficients_for_ids,
    edit_next_token,
    feed_forward_memory,
    find_trigger_cell,
    layer_contributions,
    memory_banks,
    next_token_probabilities,
    project_values,
    promotion_direction,
    read_texts,
    record_coefficients,
    select_banks,
    summarize_coefficients,
    token_clusters,
    token_memory_map,
    top_triggering_prefixes,
)
from hf_memffn.analysis.memory_banks import decoder_of
from hf_memffn.ffn import LinearReadoutMemory
from hf_memffn.testing import enable_activation_checkpointing, tiny_config

# arch (as in tiny_config) -> config overrides; covers every FFN kind the analysis supports
ARCH_CASES = {
    "llama": {},
    "flash_mhf": {"ffn_kernel": "torch"},
    "mh_ffn": {"ffn_kernel": "torch", "ffn_variant": "mh_ffn", "ffn_num_subnetworks": 1},
    "dense_moe": {"ffn_kernel": "torch", "ffn_variant": "dense_moe", "ffn_num_heads": 1, "ffn_num_kv_heads": 1},
    "pkv": {"ffn_kernel": "torch", "ffn_variant": "pkv"},
    "memoryllm": {},
    "flex_memoryllm": {},
    "kvffn": {},
    "kvffn_sum": {"kvffn_composition": "sum"},
    "kvffn_relu": {"ffn_variant": "relu"},
}


def build(case: str, seed: int = 0):
    torch.manual_seed(seed)
    arch = case if case in ("llama", "memoryllm", "flex_memoryllm", "kvffn", "flash_mhf") else None
    if arch is None:
        arch = "flash_mhf" if case in ("mh_ffn", "dense_moe", "pkv") else "kvffn"
    return AutoModelForCausalLM.from_config(tiny_config(arch, **ARCH_CASES[case])).eval()


def bank_outputs(model, banks, input_ids):
    """What each bank's module really adds to the residual stream (biases removed), captured by hooks."""
    outputs, handles = {}, []
    memory = getattr(decoder_of(model), "memory", None)
    for bank in banks:
        if bank.kind == "readout":
            def hook(module, args, output, name=bank.name):
                outputs[name] = output - (module.bias if module.bias is not None else 0)
            handles.append(bank.memory.memory_readout.register_forward_hook(hook))
        elif bank.kind == "token_memory":
            def hook(module, args, output, name=bank.name, layer=bank.layer):
                outputs[name] = output[:, :, layer]
            handles.append(memory.register_forward_hook(hook))
        else:
            def hook(module, args, output, name=bank.name):
                outputs[name] = output
            handles.append(bank.hook_module.register_forward_hook(hook))
    with torch.no_grad(), record_coefficients(model, banks) as coefficients:
        model(input_ids=input_ids)
    for handle in handles:
        handle.remove()
    return outputs, {name: captured[0] for name, captured in coefficients.items()}


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_coefficients_times_values_rebuild_every_ffn_output(case):
    model = build(case)
    banks = memory_banks(model)
    assert len(banks) == {"flex_memoryllm": 4}.get(case, 2)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7))
    outputs, coefficients = bank_outputs(model, banks, input_ids)
    for bank in banks:
        assert coefficients[bank.name].shape == (2, 7, bank.num_cells)
        rebuilt = bank.output_from_coefficients(coefficients[bank.name])
        torch.testing.assert_close(rebuilt, outputs[bank.name].float(), rtol=1e-4, atol=1e-5)


def test_swiglu_coefficients_match_manual_computation():
    model = build("llama")
    input_ids = torch.randint(0, model.config.vocab_size, (9,))
    mlp = model.model.layers[1].mlp
    captured = []
    handle = mlp.register_forward_pre_hook(lambda module, args: captured.append(args[0][0]))
    coefficients = coefficients_for_ids(model, input_ids)["layers.1.mlp"]
    handle.remove()
    x = captured[0]
    manual = F.silu(x @ mlp.gate_proj.weight.t()) * (x @ mlp.up_proj.weight.t())
    torch.testing.assert_close(coefficients, manual)


def test_flash_mhf_coefficients_match_per_head_loop():
    model = build("flash_mhf")
    mlp = model.model.layers[0].mlp
    bank = memory_banks(model)[0]
    x = torch.randn(1, 5, model.config.hidden_size)
    coefficients = bank.coefficients_from_input(x).reshape(5, *bank.cell_shape)
    queries = mlp.queries(x)[0]  # [H, L, d_h]
    group = mlp.num_heads // mlp.key.shape[0]
    for head in range(mlp.num_heads):
        q = queries[head]
        gates = torch.sigmoid(q @ mlp.router[head])
        gates = gates / (gates.sum(-1, keepdim=True) + mlp.gate_eps)
        for subnetwork in range(mlp.num_subnetworks):
            key, up = mlp.key[head // group, subnetwork], mlp.up[head // group, subnetwork]
            manual = gates[:, subnetwork, None] * F.silu(q @ key.t()) * (q @ up.t())
            torch.testing.assert_close(coefficients[:, head, subnetwork], manual)
    summary = summarize_coefficients(bank.coefficients_from_input(x)[0], bank)
    assert summary.group_mass.shape == (mlp.num_heads, mlp.num_subnetworks)
    torch.testing.assert_close(summary.group_mass.sum(), torch.tensor(1.0))
    last = f"h{mlp.num_heads - 1}.e{mlp.num_subnetworks - 1}.{mlp.key.shape[2] - 1}"
    assert bank.cell_label(bank.num_cells - 1) == last


def test_summaries_count_mass_and_sparsity():
    model = build("llama")
    bank = memory_banks(model)[0]
    coefficients = torch.zeros(2, bank.num_cells)
    coefficients[0, :4] = torch.tensor([4.0, -3.0, 2.0, 1.0])  # mass 10: 90% needs the top 3 cells (9/10)
    coefficients[1, 7] = 5.0
    summary = summarize_coefficients(coefficients, bank, top_k=2)
    assert summary.top_cells[0].tolist() == [0, 1] and summary.top_values[0].tolist() == [4.0, -3.0]
    assert summary.cells_for_mass.tolist() == [3, 1]
    assert summary.sparsity[1] == pytest.approx((bank.num_cells - 1) / bank.num_cells)


def test_top_k_per_cell_streaming_matches_brute_force():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(500, 37, generator=generator)
    keys = torch.randperm(10_000, generator=generator)[:500]
    heap = TopKPerCell(37, k=6)
    start = 0
    for size in (1, 3, 50, 7, 200, 239):  # uneven chunks, some smaller than k
        heap.update(scores[start : start + size], keys[start : start + size])
        start += size
    expected_values, expected_index = scores.topk(6, dim=0)
    torch.testing.assert_close(heap.values, expected_values.t())
    assert torch.equal(heap.keys, keys[expected_index].t())


def test_top_triggering_prefixes_match_brute_force_over_padded_batches():
    model = build("kvffn")
    generator = torch.Generator().manual_seed(1)
    texts = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (5, 11, 3, 8, 13, 6, 9)]
    banks = memory_banks(model)
    index = top_triggering_prefixes(model, iter(texts), banks, k=5, batch_size=3, prefix_length=4,
                                    cells={banks[1].name: [0, 17, 99]})
    for bank in banks:
        per_text = [coefficients_for_ids(model, torch.tensor(ids), [bank])[bank.name] for ids in texts]
        everything = torch.cat(per_text)
        where = [(t, p) for t, ids in enumerate(texts) for p in range(len(ids))]
        for row, cell in enumerate(index.cells[bank.name].tolist()):
            values, positions = everything[:, cell].topk(5)
            triggers = index.triggers[bank.name][row]
            assert [t.coefficient for t in triggers] == pytest.approx(values.tolist(), rel=1e-4, abs=1e-6)
            for trigger, flat in zip(triggers, positions.tolist()):
                text, position = where[flat]
                assert (trigger.text_index, trigger.position) == (text, position)
                ids = texts[text]
                assert trigger.prefix_ids == ids[max(0, position - 3) : position + 1]
                assert trigger.next_id == (ids[position + 1] if position + 1 < len(ids) else None)
    assert index.cells[banks[1].name].tolist() == [0, 17, 99]
    assert index.num_tokens == sum(map(len, texts))


# ---- a planted memory: a cell keyed on the prompt's last token whose value promotes a chosen token ----------------
PROMPT = torch.tensor([11, 42, 7, 99, 23])
PLANTED_TOKEN, EDIT_TOKEN, PLANTED_CELL = 201, 77, 13


def plant_residual_memory(model):
    """Last layer's FFN: cell PLANTED_CELL fires on the prompt's last position and promotes PLANTED_TOKEN."""
    mlp = model.model.layers[-1].mlp
    captured = []
    handle = mlp.register_forward_pre_hook(lambda module, args: captured.append(args[0][0, -1]))
    with torch.no_grad():
        model(input_ids=PROMPT[None])
        handle.remove()
        key = captured[0] / captured[0].norm()
        mlp.gate_proj.weight[PLANTED_CELL] = 3.0 * key
        mlp.up_proj.weight[PLANTED_CELL] = 3.0 * key
        mlp.down_proj.weight[:, PLANTED_CELL] = 0.05 * promotion_direction(model, PLANTED_TOKEN)
    return f"layers.{len(model.model.layers) - 1}.mlp"


def plant_token_memory(model):
    """Last layer of the memory on X0: cell PLANTED_CELL is keyed on the prompt's last token, promotes PLANTED_TOKEN."""
    memory, layer = model.model.memory, model.config.num_hidden_layers - 1
    with torch.no_grad():
        x0 = model.model.embed_tokens.weight[PROMPT[-1]]
        key = F.normalize(x0 * memory.norm_weight[layer], dim=0)
        memory.gate_proj[layer, PLANTED_CELL] = 3.0 * key
        memory.up_proj[layer, PLANTED_CELL] = 3.0 * key
        memory.down_proj[layer, :, PLANTED_CELL] = 0.05 * promotion_direction(model, PLANTED_TOKEN)
    return f"layers.{layer}.memory"


@pytest.mark.parametrize("case,method", [("llama", "value"), ("memoryllm", "token_memory"), ("memoryllm", "value")])
def test_planted_memory_is_found_by_projection_and_editing(case, method):
    model = build(case)
    with torch.no_grad():  # a sharper output embedding, as after training (random init predicts near-uniformly)
        model.lm_head.weight.mul_(30)
    bank_name = plant_token_memory(model) if case == "memoryllm" else plant_residual_memory(model)
    bank = select_banks(memory_banks(model), [bank_name])[0]
    assert int(next_token_probabilities(model, PROMPT).argmax()) == PLANTED_TOKEN

    # the value projection reads the planted token off the value vector
    projection = project_values(model, bank, top_n=3)
    assert projection.top_ids[PLANTED_CELL, 0] == PLANTED_TOKEN
    assert (projection.top_ids[:, 0] == PLANTED_TOKEN).sum() == 1

    # the editing tool finds the planted cell as the one the last token triggers most ...
    found_bank, cell, coefficient = find_trigger_cell(model, PROMPT)
    assert (found_bank.name, cell) == (bank_name, PLANTED_CELL) and coefficient > 10
    if bank.context_free:  # ... and so does the token-to-memory map over the whole vocabulary
        memory_map = token_memory_map(model, layers=[bank.layer], top_k=2)[0]
        assert memory_map.top_cells[PROMPT[-1], 0] == PLANTED_CELL
        assert PROMPT[-1] in memory_map.tokens_of_cell(PLANTED_CELL).tolist()

    # ... and rewriting that memory changes the next-token prediction, reversibly
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = edit_next_token(model, PROMPT, EDIT_TOKEN, method=method)
    assert result.method == method
    assert (PLANTED_CELL == result.edit.cell) if method == "value" else isinstance(result.edit, TokenMemoryEdit)
    assert result.top_before[0][0] == PLANTED_TOKEN
    assert result.top_after[0][0] == EDIT_TOKEN
    assert result.target_probability_after > 0.5 > result.target_probability_before
    result.edit.revert()
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert int(next_token_probabilities(model, PROMPT).argmax()) == PLANTED_TOKEN


def test_token_memory_edit_touches_only_the_edited_token():
    model = build("memoryllm")
    other = torch.tensor([11, 42, 7, 99, 24])  # same context, another last token
    before = next_token_probabilities(model, other)
    rows = torch.zeros(model.config.num_hidden_layers, model.config.hidden_size)
    rows[-1] = 50 * promotion_direction(model, EDIT_TOKEN)
    with TokenMemoryEdit(model, int(PROMPT[-1]), rows):
        assert int(next_token_probabilities(model, PROMPT).argmax()) == EDIT_TOKEN
        torch.testing.assert_close(next_token_probabilities(model, other), before)


@pytest.mark.parametrize("head", [3, 1], ids=["last_head", "second_head"])
def test_flash_mhf_value_edit_moves_the_model_space_value(head):
    """The tiny model's 4 heads share 2 value heads (heads 0-1 the first, 2-3 the second): an edit of head 1 must
    change the first value head, which head 3 alone does not tell from a wrong head -> value head mapping."""
    model = build("flash_mhf")
    bank = memory_banks(model)[1]
    num_heads, head_dim = bank.memory.num_heads, bank.memory.head_dim
    cell = (head + 1) * bank.num_cells // num_heads - 3  # a cell of `head`
    out_head = model.model.layers[1].mlp.out_proj.weight.detach()[:, head * head_dim:(head + 1) * head_dim]  # [d, d_h]
    before = bank.value_vectors()[cell].clone()
    reachable = out_head @ torch.randn(head_dim)  # a change the head can write through out_proj
    with ValueEdit(bank, cell, reachable):
        torch.testing.assert_close(bank.value_vectors()[cell] - before, reachable, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(bank.value_vectors()[cell], before)
    anywhere = torch.randn(model.config.hidden_size)  # only its projection on the head's output span is realised
    projection = out_head @ torch.linalg.lstsq(out_head, anywhere[:, None]).solution[:, 0]
    with ValueEdit(bank, cell, anywhere):
        torch.testing.assert_close(bank.value_vectors()[cell] - before, projection, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("case", ["llama", "memoryllm", "flash_mhf"])
def test_the_value_delta_for_an_output_change_moves_the_output_by_it(case):
    """`value_delta_for_output(cell, c, change)` is the value edit that moves the bank's output by `change` where the
    coefficients are `c` (a FlashMHF head reaches a d_h-dim span only: there, the full component along `change`)."""
    model = build(case)
    bank = [bank for bank in memory_banks(model) if bank.layer == 1][-1]
    coefficients = coefficients_for_ids(model, torch.tensor([11, 42, 7, 99, 5]))[bank.name][-1]
    cell = int(coefficients.abs().argmax())
    change = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = bank.output_from_coefficients(coefficients)
    with ValueEdit(bank, cell, bank.value_delta_for_output(cell, coefficients, change)):
        moved = bank.output_from_coefficients(coefficients) - before
    if bank.kind == "flash_mhf":
        assert float(moved @ change) == pytest.approx(float(change @ change), rel=1e-3)
    else:
        torch.testing.assert_close(moved, change, rtol=1e-3, atol=1e-3)


def test_token_clusters_group_tokens_that_share_cells():
    model = build("memoryllm")
    groups = [[30, 31, 32, 33], [60, 61, 62, 63]]
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        for group in groups:
            centre = torch.randn(embed.shape[1])
            for token in group:
                embed[token] = centre + 0.01 * torch.randn(embed.shape[1])
    token_ids = torch.tensor([t for group in groups for t in group] + list(range(100, 140)))
    clusters = token_clusters(model, layer=0, num_clusters=8, token_ids=token_ids)
    membership = {token: i for i, cluster in enumerate(clusters) for token in cluster.tokens}
    assert sum(len(cluster.tokens) for cluster in clusters) == len(token_ids)
    for group in groups:
        assert len({membership[token] for token in group}) == 1
    assert membership[groups[0][0]] != membership[groups[1][0]]


def test_layer_contributions_split_attention_ffn_and_memory():
    texts = [[5, 9, 13, 200], [7, 7, 8]]
    memoryllm = build("memoryllm")
    contributions = layer_contributions(memoryllm, texts)
    assert contributions.ffn == [0.0, 0.0] and all(m > 0 for m in contributions.memory)
    with torch.no_grad():  # the memory norms match the model's own memory outputs
        embeddings = [memoryllm.model.embed_tokens(torch.tensor([ids])) for ids in texts]
        outputs = [memoryllm.model.memory(x0)[0, :, 1] for x0 in embeddings]
    expected = torch.cat(outputs).norm(dim=-1).mean()
    assert contributions.memory[1] == pytest.approx(float(expected), rel=1e-4)
    assert all(0 < share < 1 for share in contributions.memory_share)
    llama = layer_contributions(build("llama"), texts)
    assert llama.memory == [0.0, 0.0] and all(f > 0 for f in llama.ffn)


class GELUFeedForward(LinearReadoutMemory, torch.nn.Module):
    """A new FFN variant: it works in the analysis tools by implementing the memory interface."""

    def __init__(self, hidden_size, width):
        super().__init__()
        self.up_proj = torch.nn.Linear(hidden_size, width)
        self.down_proj = torch.nn.Linear(width, hidden_size)

    @property
    def memory_readout(self):
        return self.down_proj

    def memory_coefficients(self, hidden_states):
        return F.gelu(self.up_proj(hidden_states))

    def forward(self, hidden_states):
        return self.down_proj(self.memory_coefficients(hidden_states))


def test_a_new_ffn_variant_works_through_the_memory_interface():
    model = build("llama")
    for block in model.model.layers:
        block.mlp = GELUFeedForward(model.config.hidden_size, 24)
    banks = memory_banks(model)
    assert [(bank.kind, bank.num_cells) for bank in banks] == [("readout", 24)] * 2
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7))
    outputs, coefficients = bank_outputs(model, banks, input_ids)
    for bank in banks:
        torch.testing.assert_close(bank.output_from_coefficients(coefficients[bank.name]), outputs[bank.name])
    bank, cell, _ = find_trigger_cell(model, PROMPT)
    before, delta = bank.value_vectors()[cell].clone(), torch.randn(model.config.hidden_size)
    with ValueEdit(bank, cell, delta):
        torch.testing.assert_close(bank.value_vectors()[cell], before + delta)
    torch.testing.assert_close(bank.value_vectors()[cell], before)


def test_every_ffn_block_implements_the_memory_interface():
    for case in ARCH_CASES:
        model = build(case)
        for block in model.model.layers:
            memory = feed_forward_memory("mlp", block.mlp) if block.mlp is not None else None
            if memory is None:
                continue
            assert (memory is block.mlp) == (case != "llama")  # transformers' LlamaMLP goes through an adapter
            assert memory.memory_values().shape == (memory.memory_num_cells, model.config.hidden_size)
            assert len(memory.memory_cell_axes) == len(memory.memory_cell_shape)
    with pytest.raises(ValueError, match="layers.0.mlp: FFN of class Identity"):
        feed_forward_memory("layers.0.mlp", torch.nn.Identity())


def test_bad_input_is_refused_with_the_field_named(tmp_path):
    model = build("llama")
    with pytest.raises(ValueError, match="banks="):
        select_banks(memory_banks(model), ["layers.9.mlp"])
    with pytest.raises(ValueError, match="method="):
        edit_next_token(model, PROMPT, 3, method="surgery")
    with pytest.raises(ValueError, match="token_memory"):
        edit_next_token(model, PROMPT, 3, method="token_memory")
    with pytest.raises(ValueError, match="target_id=999"):
        promotion_direction(model, 999)
    with pytest.raises(ValueError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match="'text'"):
        read_texts(bad)


def test_texts_end_at_line_feeds_only(tmp_path):
    """A Unicode line separator (which `json.dumps(..., ensure_ascii=False)` leaves in a string) or a form feed is
    part of a text, not the end of one; CR LF line ends are read as line feeds."""
    import json

    records = tmp_path / "texts.jsonl"
    records.write_text(json.dumps({"text": "first\u2028part"}, ensure_ascii=False) + "\n" + '{"text": "second"}\n',
                       encoding="utf-8")
    assert read_texts(records) == ["first\u2028part", "second"]
    lines = tmp_path / "texts.txt"
    lines.write_bytes("one\x0cpage\r\n\r\ntwo\n".encode())
    assert read_texts(lines) == ["one\x0cpage", "two"]


def test_a_jsonl_file_named_in_capitals_is_read_as_records(tmp_path):
    """`texts.JSONL` (as Windows tools name files) was read as plain lines: each JSON record became a text."""
    records = tmp_path / "texts.JSONL"
    records.write_text('{"text": "the memory"}\n{"text": "a key"}\n')
    assert read_texts(records) == ["the memory", "a key"]


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_texts_saved_with_a_byte_order_mark_read_without_it(tmp_path, suffix):
    """UTF-8 with a byte order mark, as some Windows editors save it: the mark is not text (a .jsonl file's first
    line was refused as invalid JSON), and a bad byte after it is named at its offset in the file."""
    import codecs

    path = tmp_path / f"texts{suffix}"
    first, second = ('{"text": "one"}', '{"text": "two"}') if suffix == ".jsonl" else ("one", "two")
    path.write_bytes(codecs.BOM_UTF8 + f"{first}\n{second}\n".encode())
    assert read_texts(path) == ["one", "two"]
    first = '{"text": "ab"}' if suffix == ".jsonl" else "ab"  # (read before the bad line: lines are read in turn)
    path.write_bytes(codecs.BOM_UTF8 + f"{first}\n".encode() + b"\xff\n")
    with pytest.raises(ValueError, match=rf":2: not UTF-8 text .* at byte {len(codecs.BOM_UTF8) + len(first) + 1}\)"):
        read_texts(path)


def test_report_json_has_every_section(tmp_path, monkeypatch):
    from hf_memffn.analysis import analyze, write_report
    from hf_memffn.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = build("flash_mhf")
    texts = ["the memory stores a key", "a value of the token is the layer", "head reads the memory"]
    report = analyze(model, tokenizer, texts, top_triggers=3, cells_per_bank=2, agreement_cells=32,
                     edits=[("the memory stores", " value")])
    html_path = write_report(report, tmp_path / "report")
    assert set(report) == {"model", "texts", "cells", "banks", "contributions", "edits"}
    assert [bank["kind"] for bank in report["model"]["banks"]] == ["flash_mhf", "flash_mhf"]
    assert "head_subnetwork_mass" in report["banks"]["layers.0.mlp"]
    assert len(report["cells"]["layers.1.mlp"]) == 2 and report["cells"]["layers.1.mlp"][0]["triggers"]
    assert report["edits"][0]["target"] == " value"
    html = html_path.read_text()
    assert html.count("data:image/png;base64,") == 4 and "<mark>" in html and "http" not in html.split("<body>")[1]
    assert json.loads((tmp_path / "report" / "report.json").read_text())["model"]["num_layers"] == 2
    assert {p.name for p in (tmp_path / "report").iterdir()} == {
        "report.json", "index.html", "memory_statistics.png", "contributions.png", "text0_coefficients.png",
        "flash_mhf_heads.png",
    }

    # the folder again, for a model without heads: the FlashMHF plot goes; a write cut short leaves no index.html
    from hf_memffn.analysis import report as report_module

    other = analyze(build("kvffn"), tokenizer, texts[:1], top_triggers=1, cells_per_bank=1, agreement_cells=8,
                    edits=[])
    write_report(other, tmp_path / "report")
    assert "flash_mhf_heads.png" not in {p.name for p in (tmp_path / "report").iterdir()}
    real_write = report_module.write_atomic

    def interrupted(path, data):
        if str(path).endswith(".png"):
            raise KeyboardInterrupt
        real_write(path, data)

    monkeypatch.setattr(report_module, "write_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report(report, tmp_path / "report")
    assert not (tmp_path / "report" / "index.html").exists()


def test_report_json_writes_numbers_that_are_not_finite_as_null(tmp_path):
    """A statistic that overflowed (fp16) was written as `Infinity` / `NaN`, which Python's json writes and strict
    JSON readers (JavaScript's JSON.parse, jq) refuse: written as null, as the demo's results.json writes them."""
    from hf_memffn.analysis import analyze, write_report
    from hf_memffn.testing import tiny_tokenizer

    report = analyze(build("kvffn"), tiny_tokenizer(), ["the memory stores a key"], top_triggers=1, cells_per_bank=1,
                     agreement_cells=8, edits=[])
    cell = report["cells"]["layers.0.mlp"][0]
    cell["triggers"][0]["coefficient"], cell["promotes_logits"][1] = float("inf"), float("nan")

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    write_report(report, tmp_path / "report")
    written = json.loads((tmp_path / "report" / "report.json").read_text(), parse_constant=refuse)
    written_cell = written["cells"]["layers.0.mlp"][0]
    assert written_cell["triggers"][0]["coefficient"] is None and written_cell["promotes_logits"][1] is None
    assert written_cell["promotes_logits"][0] == cell["promotes_logits"][0]


def test_a_pad_token_past_the_embedding_does_not_stop_the_analysis():
    """A tokenizer whose pad token was added past the embedding's rows (tokens added, the model not resized) stopped
    `analyze` after the texts had been analysed, at the top triggers ("pad_token_id has token id 330"), though the
    id only fills masked positions: the report is the one of a tokenizer padding with 0."""
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    texts = ["the memory stores a key", "a key"]  # (of two lengths: the shorter one is padded in its batch)
    arguments = dict(top_triggers=2, cells_per_bank=1, agreement_cells=8, edits=[], batch_size=2)
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    expected = analyze(build("kvffn"), tokenizer, texts, **arguments)
    tokenizer.add_tokens([f"<added_{i}>" for i in range(30)])
    tokenizer.pad_token = "<added_29>"
    assert tokenizer.pad_token_id >= build("kvffn").get_input_embeddings().num_embeddings
    cells = analyze(build("kvffn"), tokenizer, texts, **arguments)["cells"]
    # (the triggers: what the padded batches give; the tokens a value promotes now rank the added ones too)
    assert {bank: [cell["triggers"] for cell in bank_cells] for bank, bank_cells in cells.items()} == {
        bank: [cell["triggers"] for cell in bank_cells] for bank, bank_cells in expected["cells"].items()}


@pytest.mark.parametrize("case", ["memoryllm", "flash_mhf"])
def test_plots_of_statistics_that_are_not_finite_leave_them_out(tmp_path, case):
    """A statistic that overflowed (inf, nan) in a plotted series stopped `write_report` in matplotlib ("Axis limits
    cannot be NaN or Inf") before anything was written: each plot leaves such a value out (a gap, outside the axis
    limits and colour scales), and report.json writes it as null."""
    from hf_memffn.analysis import analyze, write_report
    from hf_memffn.testing import tiny_tokenizer

    report = analyze(build(case), tiny_tokenizer(), ["the memory stores a key"], top_triggers=1, cells_per_bank=1,
                     agreement_cells=8, edits=[])
    for stats in report["banks"].values():
        stats["mean_sparsity"], stats["mean_cells_for_90pct_mass"] = float("nan"), float("inf")
        stats["key_value_agreement"] = float("inf")
        if "head_subnetwork_mass" in stats:
            stats["head_subnetwork_mass"][0][0] = float("inf")
    for key in ("attention", "ffn", "memory", "ffn_share", "memory_share"):
        report["contributions"][key][0] = float("inf")
    report["contributions"]["ffn"][-1] = float("nan")
    first_bank = report["model"]["banks"][0]["name"]
    report["texts"][0]["banks"][first_bank]["top_cells"][0][0][1] = float("inf")
    html = write_report(report, tmp_path / "report")
    assert html.is_file() and (tmp_path / "report" / "contributions.png").is_file()
    written = json.loads((tmp_path / "report" / "report.json").read_text())
    assert written["contributions"]["attention"][0] is None


def test_token_memory_tools_work_with_a_loaded_lookup_table(tmp_path):
    from hf_memffn.conversion import export
    model = build("memoryllm")
    input_ids = torch.tensor([11, 42, 7, 99, 23])
    expected = coefficients_for_ids(model, input_ids)
    export.export_tols(model, tmp_path / "tols", format="fp32", progress=False)
    model.load_tols(tmp_path / "tols", placement="cpu")
    try:
        assert model.model.token_lookup is not None
        captured = coefficients_for_ids(model, input_ids)  # read off X0, whatever serves the memory outputs
        for name, coefficients in expected.items():
            torch.testing.assert_close(captured[name], coefficients)
        rows = torch.zeros(model.config.num_hidden_layers, model.config.hidden_size)
        rows[-1] = 50 * promotion_direction(model, EDIT_TOKEN)
        with TokenMemoryEdit(model, int(input_ids[-1]), rows):
            assert int(next_token_probabilities(model, input_ids).argmax()) == EDIT_TOKEN
    finally:
        model.unload_tols()


def test_a_value_edit_of_the_memory_on_x0_is_refused_while_a_lookup_table_is_loaded(tmp_path):
    """The model reads that memory from the table, so editing its values would change nothing."""
    from hf_memffn.conversion import export
    model = build("memoryllm")
    export.export_tols(model, tmp_path / "tols", format="fp32", progress=False)
    model.load_tols(tmp_path / "tols", placement="cpu")
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"method='value' cannot edit layers\.1\.memory: .*method='token_memory'"):
        edit_next_token(model, PROMPT, EDIT_TOKEN, method="value")
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    model.unload_tols()  # computed again: the value edit acts
    result = edit_next_token(model, PROMPT, EDIT_TOKEN, method="value")
    assert result.target_probability_after > result.target_probability_before
    result.edit.revert()


@pytest.mark.parametrize("case, attach", [("flash_mhf", "lora"), ("memoryllm", "int8")])
def test_a_value_edit_of_weights_under_an_adapter_or_int8_is_refused_and_acts_after_merging(case, attach):
    """The module computes such a weight from its parametrization on each read: the edit changed that copy and the
    model's next-token probabilities not at all."""
    from hf_memffn import adapters
    model = build(case)
    adapters.add_weight_lora(model, r=2) if attach == "lora" else adapters.quantize_weights_int8(model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"computed by a parametrization .*merge_weight_lora"):
        edit_next_token(model, PROMPT, EDIT_TOKEN, method="value")
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    adapters.merge_weight_lora(model)
    result = edit_next_token(model, PROMPT, EDIT_TOKEN, method="value")
    assert result.target_probability_after > result.target_probability_before
    result.edit.revert()


@pytest.mark.parametrize("case", ["memoryllm", "flex_memoryllm"])
def test_layer_contributions_measure_a_lookup_table_after_the_memory_ffn_is_dropped(case, tmp_path):
    from hf_memffn.conversion import export
    texts = [[5, 9, 13, 200], [7, 7, 8]]
    model = build(case)
    computed = layer_contributions(model, texts)
    export.export_tols(model, tmp_path / "tols", format="fp32", progress=False)
    model.load_tols(tmp_path / "tols", placement="cpu", drop_memory_ffn=True)
    assert model.model.memory is None
    from_table = layer_contributions(model, texts)
    assert all(m > 0 for m in from_table.memory)
    assert from_table.memory == pytest.approx(computed.memory, rel=1e-4)


def test_a_memoryllm_without_its_memory_ffn_is_refused_with_the_reason(tmp_path):
    """Once `load_tols(..., drop_memory_ffn=True)` has freed a MemoryLLM's only FFNs, the analysis said the model
    'has no FFN memory to analyse', with no word of why or what to do."""
    from hf_memffn.conversion import export
    model = build("memoryllm")
    export.export_tols(model, tmp_path / "tols", format="fp32", progress=False)
    model.load_tols(tmp_path / "tols", placement="cpu", drop_memory_ffn=True)
    with pytest.raises(ValueError, match=r"has no FFN memory to analyse: its FFNs on the token embeddings were dropped "
                                         r"for a lookup table \(`drop_memory_ffn`\).*load the model again"):
        memory_banks(model)


@pytest.mark.parametrize("case,method", [("llama", "value"), ("memoryllm", "token_memory")])
def test_an_edit_leaves_no_gradient_on_the_model_parameters(case, method):
    model = build(case)
    result = edit_next_token(model, PROMPT, EDIT_TOKEN, method=method)
    result.edit.revert()
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize("case,method", [("llama", "value"), ("memoryllm", "token_memory")])
def test_an_edit_works_under_inference_mode(case, method):
    model = build(case)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.inference_mode():
        result = edit_next_token(model, PROMPT, EDIT_TOKEN, method=method)
    assert result.target_probability_after > result.target_probability_before
    result.edit.revert()  # outside inference mode
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("case,method", [("llama", "value"), ("memoryllm", "token_memory")])
def test_an_edit_stopped_while_its_effect_is_measured_leaves_the_model_unedited(case, method, monkeypatch):
    """`edit_next_token` applies the edit, then measures the probabilities after it: stopped there (Ctrl-C, an
    out-of-memory error), its caller has no result whose edit it could revert, so the model is left as it was."""
    import hf_memffn.analysis.editing as editing_module

    model = build(case)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    measure = editing_module.next_token_probabilities

    def stopped_once_edited(edited_model, input_ids):
        if "memory_readout" in vars(decoder_of(edited_model)) or any(
                not torch.equal(p, weights[name]) for name, p in edited_model.named_parameters()):
            raise KeyboardInterrupt
        return measure(edited_model, input_ids)

    monkeypatch.setattr(editing_module, "next_token_probabilities", stopped_once_edited)
    with pytest.raises(KeyboardInterrupt):
        edit_next_token(model, PROMPT, EDIT_TOKEN, method=method)
    assert "memory_readout" not in vars(decoder_of(model))
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())


def test_value_edits_of_banks_sharing_one_parameter_revert_in_any_order():
    model = build("memoryllm")  # the memory on X0: every layer's bank is a slice of one stacked parameter
    first, second = memory_banks(model)[:2]
    assert first.value_parameter() is second.value_parameter()
    original = first.value_parameter().detach().clone()
    delta = torch.ones(model.config.hidden_size)
    first_edit, second_edit = ValueEdit(first, 3, delta).apply(), ValueEdit(second, 5, delta).apply()
    first_edit.revert()  # not the last one applied
    torch.testing.assert_close(first.value_vectors()[3], original[0, :, 3])
    torch.testing.assert_close(second.value_vectors()[5], original[1, :, 5] + delta)
    second_edit.revert()
    assert torch.equal(first.value_parameter(), original)
    # edits of the same cell: reverted last applied first, or refused
    first_edit, second_edit = ValueEdit(first, 3, delta).apply(), ValueEdit(first, 3, delta).apply()
    with pytest.raises(RuntimeError, match="last applied, first reverted"):
        first_edit.revert()
    second_edit.revert()
    first_edit.revert()
    assert torch.equal(first.value_parameter(), original)


def test_token_memory_edits_applied_together_revert_in_any_order():
    model = build("memoryllm")
    prompts = [PROMPT, torch.tensor([11, 42, 7, 99, 24])]
    before = [next_token_probabilities(model, prompt) for prompt in prompts]
    rows = torch.zeros(model.config.num_hidden_layers, model.config.hidden_size)
    rows[-1] = 50 * promotion_direction(model, EDIT_TOKEN)
    edits = [TokenMemoryEdit(model, int(prompt[-1]), rows).apply() for prompt in prompts]
    assert [int(next_token_probabilities(model, prompt).argmax()) for prompt in prompts] == [EDIT_TOKEN] * 2
    edits[0].revert()  # the first one applied: the second stays
    torch.testing.assert_close(next_token_probabilities(model, prompts[0]), before[0])
    assert int(next_token_probabilities(model, prompts[1]).argmax()) == EDIT_TOKEN
    edits[1].revert()
    torch.testing.assert_close(next_token_probabilities(model, prompts[1]), before[1])
    assert "memory_readout" not in vars(model.model)  # the decoder's own method again


@pytest.mark.parametrize("case", ["memoryllm", "flex_memoryllm"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_token_memory_edit_trains_under_activation_checkpointing(case, use_reentrant):
    """The edited readout handed the layers its computed memory outputs by keyword: reentrant activation checkpointing
    then backpropagated through their graph inside each layer's backward and again after it ("backward through the
    graph a second time"). Both kinds give the gradients of a run without checkpointing."""
    model = build(case).train()
    input_ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    rows = torch.randn(model.config.num_hidden_layers, model.config.hidden_size,
                       generator=torch.Generator().manual_seed(1))
    runs = []
    with TokenMemoryEdit(model, int(input_ids[0, 2]), rows):
        for checkpointing in (False, True):
            if checkpointing:
                enable_activation_checkpointing(model, {"use_reentrant": use_reentrant})
            model.zero_grad(set_to_none=True)
            loss = model(input_ids, labels=input_ids).loss
            loss.backward()
            runs.append((loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain), (loss, checkpointed) = runs
    torch.testing.assert_close(loss, plain_loss)
    assert checkpointed.keys() == plain.keys() and len(plain) == len(list(model.parameters()))
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


@pytest.mark.parametrize("case", ["memoryllm", "flex_memoryllm"])
def test_save_pretrained_refuses_while_a_token_memory_edit_is_applied(case, tmp_path):
    """No weight holds a token memory edit: a checkpoint saved with one applied would silently lack it."""
    model = build(case)
    result = edit_next_token(model, PROMPT, EDIT_TOKEN)
    assert result.method == "token_memory"
    with pytest.raises(ValueError, match="token memory edit is applied.*revert it first"):
        model.save_pretrained(tmp_path / "edited")
    assert not (tmp_path / "edited").exists()
    result.edit.revert()
    model.save_pretrained(tmp_path / "reverted")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "reverted").eval()
    torch.testing.assert_close(next_token_probabilities(reloaded, PROMPT), next_token_probabilities(model, PROMPT))


def test_absolute_triggers_are_ranked_by_magnitude_and_keep_their_sign():
    model = build("llama")
    bank = memory_banks(model)[1]
    texts = [[5, 9, 13, 200, 17, 40], [7, 7, 8, 90, 91]]
    index = top_triggering_prefixes(model, texts, [bank], k=3, absolute=True)
    everything = torch.cat([coefficients_for_ids(model, torch.tensor(ids), [bank])[bank.name] for ids in texts])
    for cell, triggers in enumerate(index.triggers[bank.name]):
        expected = everything[everything[:, cell].abs().topk(3).indices, cell]
        assert [t.coefficient for t in triggers] == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-6)
    assert any(t.coefficient < 0 for cell in index.triggers[bank.name] for t in cell)


def test_token_clusters_of_no_tokens_are_none():
    assert token_clusters(build("memoryllm"), layer=0, token_ids=torch.tensor([], dtype=torch.long)) == []


def test_analyze_leaves_the_model_in_the_mode_it_found_it_in():
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    model = build("kvffn").train()
    model.model.layers[0].eval()  # a mixed state is kept too
    analyze(model, tiny_tokenizer(), ["the memory stores a key"], top_triggers=1, cells_per_bank=1, agreement_cells=8,
            edits=[])
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training


def test_analyze_reports_no_clusters_when_every_token_is_special():
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    report = analyze(build("memoryllm"), tiny_tokenizer(), ["the memory stores a key"], max_length=1, top_triggers=1,
                     cells_per_bank=1, agreement_cells=8, num_clusters=2, edits=[])
    assert report["token_memory_clustered"] == "none: every token is a special one"
    assert all(section["clusters"] == [] for section in report["token_memory"].values())


def test_texts_files_name_the_file_and_line_of_bad_json_or_bytes(tmp_path):
    records = tmp_path / "texts.jsonl"
    records.write_text('{"text": "the memory"}\n{"text": "oops"\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(records))}:2: invalid JSON: Expecting ',' delimiter"):
        read_texts(records)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("a key\ncaf\xe9 memory\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(latin1))}:2: not UTF-8 text .*allowed: a UTF-8 encoded"):
        read_texts(latin1)


def test_scale_check_takes_any_multiple_of_64_and_names_the_flag_below(tmp_path, capsys):
    from hf_memffn.analysis import scale_check

    with pytest.raises(SystemExit) as stop:
        scale_check.main(["--device", "cpu", "--hidden-size", "32"])
    assert stop.value.code == 2 and "--hidden-size 32 is invalid; allowed: a multiple of 64" in capsys.readouterr().err
    out = tmp_path / "scale.json"
    argv = ["--device", "cpu", "--hidden-size", "192", "--intermediate-size", "64", "--num-layers", "1",
            "--vocab-size", "320", "--num-texts", "1", "--dataset-texts", "2", "--text-words", "5", "--out", str(out)]
    assert scale_check.main(argv) == 0  # 3 heads: 1 key-value head
    assert json.loads(out.read_text())["layers"] == 1


@pytest.mark.parametrize("flag, value, message", [
    ("--num-layers", "0", "argument --num-layers: 0 is invalid; allowed: an integer >= 1"),
    ("--intermediate-size", "0", "argument --intermediate-size: 0 is invalid; allowed: an integer >= 1"),
    ("--text-words", "0", "argument --text-words: 0 is invalid; allowed: an integer >= 1"),
    ("--num-texts", "-1", "argument --num-texts: -1 is invalid; allowed: an integer >= 1"),
    ("--vocab-size", "100", "--vocab-size 100 is invalid; allowed: an integer >= "),
    ("--device", "meta", "argument --device: 'meta' is not supported; allowed: auto, cpu, cuda, cuda:N, mps"),
    ("--out", ".", "--out . is a directory; allowed: a file path in an existing folder"),
])
def test_scale_check_refuses_bad_arguments_before_building_the_model(flag, value, message, capsys, monkeypatch):
    """A zero count, a vocabulary smaller than the texts' tokenizer's, an unknown device or an `--out` that cannot be
    written failed with a traceback from inside the analysis (`max_length=0`, "is the tokenizer the model's own?",
    an empty reduction) or at the very end, after the model was built and analysed; now argparse names the flag."""
    from hf_memffn.analysis import scale_check

    monkeypatch.setattr(scale_check, "LlamaForCausalLM", lambda *args, **kwargs: pytest.fail("the model was built"))
    argv = ["--device", "cpu", "--hidden-size", "64", "--num-layers", "1", "--vocab-size", "320", flag, value]
    with pytest.raises(SystemExit) as stop:
        scale_check.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_batch_of_several_sequences_is_refused_not_read_as_one():
    """`[2, length]` ids were flattened into one sequence: the second row's coefficients read the first as context."""
    model = build("llama")
    batch = torch.stack([PROMPT, PROMPT.flip(0)])
    for call in (lambda: coefficients_for_ids(model, batch), lambda: next_token_probabilities(model, batch),
                 lambda: edit_next_token(model, batch, EDIT_TOKEN), lambda: find_trigger_cell(model, batch)):
        with pytest.raises(ValueError, match=r"input_ids has shape \(2, 5\): expected one sequence"):
            call()
    with pytest.raises(ValueError, match="input_ids is empty"):
        edit_next_token(model, torch.tensor([], dtype=torch.long), EDIT_TOKEN)
    one = coefficients_for_ids(model, PROMPT[None])  # [1, length] is one sequence
    assert all(torch.equal(one[name], rows) for name, rows in coefficients_for_ids(model, PROMPT).items())


def test_edit_strength_must_be_a_positive_number():
    model = build("llama")
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    for strength in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"strength={strength} must be a positive number"):
            edit_next_token(model, PROMPT, EDIT_TOKEN, strength=strength)
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())


def test_top_triggers_refuse_cells_of_unknown_banks_and_cells_outside_the_bank():
    """A misspelt bank name in `cells` tracked every cell of every bank; a cell outside the bank failed inside a
    forward hook (or, negative, was read from the end)."""
    model = build("llama")
    banks = memory_banks(model)
    with pytest.raises(ValueError, match=r"cells names banks \['layers.9.mlp'\] that are not among `banks`"):
        top_triggering_prefixes(model, [[5, 9]], banks, cells={"layers.9.mlp": [0]})
    for cell in (-1, banks[0].num_cells):
        with pytest.raises(ValueError, match=rf"cells\['layers.0.mlp'\] has cell {cell}: allowed cells are 0..127"):
            top_triggering_prefixes(model, [[5, 9]], banks, cells={"layers.0.mlp": [3, cell]})
    index = top_triggering_prefixes(model, [[5, 9]], banks, k=1, cells={"layers.0.mlp": []})
    assert index.triggers["layers.0.mlp"] == [] and len(index.triggers["layers.1.mlp"]) == banks[1].num_cells


def test_token_memory_map_refuses_layers_without_token_memory():
    """`layers=[5]` of a 2-layer MemoryLLM returned no map at all."""
    with pytest.raises(ValueError, match=r"layers=\[5\] have no token memory; allowed: \[0, 1\]"):
        token_memory_map(build("memoryllm"), layers=[1, 5])


def test_token_memory_edit_refuses_a_token_outside_the_vocabulary():
    """An edit of token id 5000 (vocabulary of 320) was applied and changed nothing."""
    model = build("memoryllm")
    rows = torch.zeros(model.config.num_hidden_layers, model.config.hidden_size)
    for token_id in (-1, model.config.vocab_size):
        with pytest.raises(ValueError, match=rf"token_id={token_id} is outside the vocabulary \[0, 320\)"):
            TokenMemoryEdit(model, token_id, rows).apply()
    assert "memory_readout" not in vars(model.model)


def test_out_of_range_arguments_are_refused_with_the_argument_and_its_range_named():
    """A layer, cell, token id or count out of range failed inside torch (IndexError, `selected index k out of
    range`, argmax of an empty dimension) or, a negative cell, was read from the end; now a ValueError names it."""
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    model = build("memoryllm")
    banks = memory_banks(model)
    bank = banks[0]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    refused = [
        (lambda: project_values(model, bank, [3, bank.num_cells]), r"cells has cell 128: allowed cells are 0\.\.127"),
        (lambda: project_values(model, bank, [-1]), r"cells has cell -1: allowed cells are 0\.\.127"),
        (lambda: project_values(model, bank, top_n=0), r"top_n=0 must be >= 1"),
        (lambda: project_values(model, bank, chunk_size=0), r"chunk_size=0 must be >= 1"),
        (lambda: project_values(model, bank, vocab_size=0), r"vocab_size=0 must be >= 1"),
        (lambda: token_clusters(model, layer=5), r"layer=5 has no token memory; allowed: \[0, 1\]"),
        (lambda: token_clusters(model, layer=0, num_clusters=0), r"num_clusters=0 must be >= 1"),
        (lambda: token_clusters(model, layer=0, max_tokens=-1), r"max_tokens=-1 must be >= 1"),
        (lambda: token_clusters(model, layer=0, iterations=-1), r"iterations=-1 must be >= 0"),
        (lambda: token_clusters(model, layer=0, num_shared_cells=-1), r"num_shared_cells=-1 must be >= 1"),
        (lambda: token_clusters(model, layer=0, token_ids=torch.tensor([5, 320])),
         r"token_ids has token id 320: allowed ids are 0\.\.319"),
        (lambda: token_memory_map(model, top_k=-1), r"top_k=-1 must be >= 1"),
        (lambda: token_memory_map(model, chunk_size=0), r"chunk_size=0 must be >= 1"),
        (lambda: token_memory_map(model, vocab_size=-1), r"vocab_size=-1 must be >= 1"),
        (lambda: summarize_coefficients(torch.zeros(2, bank.num_cells), bank, top_k=-1), r"top_k=-1 must be >= 1"),
        (lambda: coefficients_for_ids(build("llama"), torch.tensor([5, 320])),
         r"input_ids has token id 320: allowed ids are 0\.\.319"),
        (lambda: layer_contributions(build("llama"), [[5], [9, 320]]),
         r"token_lists\[1\] has token id 320: allowed ids are 0\.\.319"),
        (lambda: top_triggering_prefixes(model, [[5, 9]], banks, batch_size=0), r"batch_size=0 must be >= 1"),
        (lambda: top_triggering_prefixes(model, [[5, 9]], banks, prefix_length=0), r"prefix_length=0 must be >= 1"),
        (lambda: ValueEdit(bank, bank.num_cells, torch.zeros(model.config.hidden_size)).apply(),
         r"cell=128 is outside layers\.0\.memory: allowed cells are 0\.\.127"),
        (lambda: edit_next_token(model, PROMPT, EDIT_TOKEN, top_n=-1), r"top_n=-1 must be >= 1"),
        (lambda: edit_next_token(model, PROMPT, 320), r"target_id=320 is outside the vocabulary \[0, 320\)"),
        (lambda: analyze(model, tiny_tokenizer(), ["the memory"], num_clusters=0), r"num_clusters=0 must be >= 1"),
        (lambda: analyze(model, tiny_tokenizer(), ["the memory"], edit_strength=0.0),
         r"edit_strength=0.0 must be a positive number"),
        (lambda: analyze(model, tiny_tokenizer(), ["the memory"], memory_layers=[2]),
         r"memory_layers=\[2\] have no token memory; allowed: \[0, 1\]"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=f"^{message}"):
            call()
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert "memory_readout" not in vars(model.model)


def test_one_text_or_one_texts_ids_given_for_the_list_is_refused():
    """`analyze(model, tokenizer, "a text")` analysed each character as a text of its own (and a string `dataset`
    streamed characters); one text's token ids given for `token_lists` failed on `len` of an int. Now refused."""
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    model = build("memoryllm")
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    refused = [
        (lambda: analyze(model, tiny_tokenizer(), "the memory stores a key"),
         r"texts is one string: expected a list of texts \(for one text, \[text\]\)"),
        (lambda: analyze(model, tiny_tokenizer(), ["the memory"], dataset="the key"),
         r"dataset is one string: expected a list of texts"),
        (lambda: top_triggering_prefixes(model, [5, 9, 11], memory_banks(model)),
         r"token_lists\[0\]=5 is a token id: expected a list of token-id lists, one per text"),
        (lambda: layer_contributions(model, torch.tensor([5, 9, 11])),
         r"token_lists\[0\]=5 is a token id: expected a list of token-id lists, one per text"),
    ]
    try:
        for call, message in refused:
            with pytest.raises(ValueError, match=f"^{message}"):
                call()
    finally:
        handle.remove()
    assert forwards == []


def test_analyze_checks_the_edits_before_the_analysis():
    """An edit whose target has no token was refused only once every other instrument had run (minutes on a large
    model); now no forward pass runs before the refusal."""
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    model = build("memoryllm")
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        for edits, message in (([("the memory", "")], r"edit \('the memory', ''\): prompt and target must both"),
                               ([("the memory",)], r"edits\[0\]=\('the memory',\): expected a \(prompt, target\)")):
            with pytest.raises(ValueError, match=message):
                analyze(model, tiny_tokenizer(), ["the memory stores a key"], top_triggers=1, cells_per_bank=1,
                        agreement_cells=8, edits=edits)
    finally:
        handle.remove()
    assert forwards == []


def test_report_shows_control_characters_of_tokens_as_escapes(tmp_path):
    """A byte-level token such as `\\x01` went into index.html as it is: a character an HTML page may not hold, which
    a browser drops or shows as nothing (an empty-looking token). Now written as its Python escape."""
    from hf_memffn.analysis import analyze, write_report
    from hf_memffn.testing import tiny_tokenizer

    report = analyze(build("kvffn"), tiny_tokenizer(), ["head\x01reads the\x0b memory\x7f"], top_triggers=1,
                     cells_per_bank=1, agreement_cells=8, edits=[("head\x01reads the", " memory")])
    assert {"\x01", "\x0b", "\x7f"} <= set(report["texts"][0]["tokens"])
    html = write_report(report, tmp_path / "report").read_text(encoding="utf-8")
    assert re.findall("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufdd0-\ufdef\ufffe\uffff]", html) == []
    for escape in ("\\x01", "\\x0b", "\\x7f"):
        assert f'<span class="tok">{escape}</span>' in html
    assert "<code>head\\x01reads<mark> the</mark></code>" in html  # the edit's prompt too


def test_report_plots_tokens_holding_dollar_signs_as_text():
    """A token such as `$$` or `$_` in the first text made matplotlib read its tick label as mathtext and fail (no
    report was written); `$x$` showed as an italic x. Tokens are now plotted as they are."""
    from hf_memffn.analysis.analyze import analyze
    from hf_memffn.analysis.report import plot_text_coefficients
    from hf_memffn.tokenization import train_tokenizer

    text = "the price is $$ and $_ or $x$ of the key"
    tokenizer = train_tokenizer([text] * 20, vocab_size=300)
    report = analyze(build("kvffn"), tokenizer, [text], top_triggers=1, cells_per_bank=1, agreement_cells=8,
                     edits=[])
    assert {" $$", " $_"} <= set(report["texts"][0]["tokens"])
    assert plot_text_coefficients(report).startswith(b"\x89PNG")


def test_the_demonstration_edit_works_in_a_vocabulary_of_fewer_than_ten_tokens():
    """The default edit's target is the token ranked 10th after the prompt; with fewer tokens `analyze` failed with
    'no token of the vocabulary can serve'. Now the last-ranked token is taken."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_memffn.analysis import analyze

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=3)).eval()
    report = analyze(model, tokenizer, ["a b c a", "b b c"], top_triggers=1, cells_per_bank=1, agreement_cells=8)
    edit = report["edits"][0]
    assert edit["prompt"] == "a b c a"
    last_ranked = int(next_token_probabilities(model, torch.tensor([0, 1, 2, 0])).argmin())
    assert edit["target"] == tokenizer.decode([last_ranked])


def test_the_demonstration_edit_never_targets_a_special_token():
    """The default edit took the token ranked 10th whatever it was: a tiny MemoryLLM's report demonstrated an edit
    towards `<pad>`. A special token is passed over like a token that does not tokenize back to itself."""
    from hf_memffn.analysis.analyze import default_edit
    from hf_memffn.testing import tiny_tokenizer

    tokenizer, model = tiny_tokenizer(), build("memoryllm")
    text = "the memory stores a key"
    prompt_ids = torch.tensor(tokenizer(text)["input_ids"])
    ranked = next_token_probabilities(model, prompt_ids)[: len(tokenizer)].argsort(descending=True).tolist()
    for special in tokenizer.all_special_ids:
        rank = ranked.index(special) + 1
        prompt, target = default_edit(model, tokenizer, text, target_rank=rank)
        (target_id,) = tokenizer(target, add_special_tokens=False)["input_ids"]
        assert prompt.strip() == text and target_id not in tokenizer.all_special_ids
        round_trips = (token for token in ranked[rank:] if token not in tokenizer.all_special_ids
                       and tokenizer(tokenizer.decode([token]), add_special_tokens=False)["input_ids"] == [token])
        assert target_id == next(round_trips)  # (the next rank's token that can serve)


def test_tokens_holding_part_of_a_character_are_named_by_their_bytes():
    """Each byte token of a character outside the merges (a byte-level BPE splits `中` into three) decodes alone to
    U+FFFD: the report showed `���` for any non-ASCII text, and the promoted tokens could not be told apart. Now such
    a token is named by its bytes."""
    from hf_memffn.analysis import analyze
    from hf_memffn.analysis.analyze import TokenNames
    from hf_memffn.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    report = analyze(build("llama"), tokenizer, ["中 value"], top_triggers=1, cells_per_bank=1, agreement_cells=8,
                     edits=[])
    assert report["texts"][0]["tokens"] == ["<s>", " ", "\\xe4", "\\xb8", "\\xad", " value"]
    names = TokenNames(tokenizer)
    assert len({names(token) for token in range(len(tokenizer))}) == len(tokenizer)  # no two tokens share a name
    from hf_memffn.analysis.analyze import token_bytes

    assert token_bytes("<0xE4>") == b"\xe4" and token_bytes("Ġä¸") == b" \xe4\xb8" and token_bytes("▁the") is None


def test_sentencepiece_tokens_are_named_with_the_space_that_starts_their_word():
    """A SentencePiece tokenizer (transformers' `LlamaTokenizer`, Mistral's) marks a word's start with `▁`, and its
    decoder strips the space that starts a text: decoded one by one, `▁home` and `home` both read `home`, and the
    report's texts and trigger prefixes ran their words together ("ThehomecityofKirbesTelis"). A token is now named
    with that space."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    from hf_memffn.analysis import analyze

    texts = ["The home city of Kirbes Tel is Vakport", "a homely  city"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    bpe.train_from_iterator(texts * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = LlamaTokenizer(vocab=trained["vocab"], merges=[tuple(merge) for merge in trained["merges"]])
    assert tokenizer.convert_ids_to_tokens(tokenizer(texts[0])["input_ids"])[1] == "\u2581home"
    report = analyze(build("llama"), tokenizer, texts, top_triggers=1, cells_per_bank=1, agreement_cells=8, edits=[])
    for text, analysed in zip(texts, report["texts"]):
        assert "".join(analysed["tokens"]) == " " + text  # (the first word's piece starts with `▁` too)
    assert report["texts"][0]["tokens"][1] == " home"


def lora_on_every_linear(case: str):
    """`build(case)` with PEFT's LoRA on every Linear layer (nonzero from the start), and a merged copy of it."""
    peft = pytest.importorskip("peft")
    model = build(case)
    targets = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear) and name != "lm_head"})
    torch.manual_seed(1)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)).eval()
    merged = build(case)
    merged.load_state_dict(copy.deepcopy(adapted).merge_and_unload().state_dict())
    return adapted, merged


@pytest.mark.parametrize("case", ["llama", "flash_mhf", "pkv", "flex_memoryllm", "kvffn", "kvffn_sum"])
def test_the_values_of_ffns_under_pefts_lora_are_those_of_the_merged_model(case):
    """The values of a readout (`down_proj`, `out_proj`) and FlashMHF's head projection were read off the wrapped
    layer's base weight: a LoRA on them was left out, and the analysis gave the base model's values."""
    adapted, merged = lora_on_every_linear(case)
    banks, merged_banks = memory_banks(adapted), memory_banks(merged)
    assert [bank.name for bank in banks] == [bank.name for bank in merged_banks]
    coefficients, merged_coefficients = coefficients_for_ids(adapted, PROMPT), coefficients_for_ids(merged, PROMPT)
    for bank, merged_bank in zip(banks, merged_banks):
        torch.testing.assert_close(coefficients[bank.name], merged_coefficients[bank.name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(bank.value_vectors(), merged_bank.value_vectors(), rtol=1e-5, atol=1e-6)
        projection = project_values(adapted, bank, top_n=3)
        merged_projection = project_values(merged, merged_bank, top_n=3)
        torch.testing.assert_close(projection.top_logits, merged_projection.top_logits, rtol=1e-4, atol=1e-5)
    outputs, captured = bank_outputs(adapted.get_base_model(), banks, PROMPT.reshape(1, -1))
    for bank in banks:  # the values in use rebuild what the adapted FFN adds
        if bank.kind != "token_memory":
            rebuilt = bank.output_from_coefficients(captured[bank.name])
            torch.testing.assert_close(rebuilt, outputs[bank.name].float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case, weights", [("memoryllm", ["memory.down_proj", "memory.gate_proj"]),
                                           ("flash_mhf", ["router"])])
def test_weights_under_pefts_target_parameters_lora_are_refused_with_merge_named(case, weights):
    """PEFT applies a `target_parameters` delta only inside its wrapper's forward: read outside it, as the analysis
    reads coefficients and values, the weights are the base model's. The analysis failed with an AttributeError (the
    memory on X0) or called the FFN unsupported (FlashMHF's router)."""
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(build(case), peft.LoraConfig(r=2, target_modules=[], target_parameters=weights,
                                                               init_lora_weights=False)).eval()
    with pytest.raises(ValueError, match=r"FFN weights \[.*(down_proj|router).*\] carry PEFT's target_parameters LoRA"
                                         r".*merge_and_unload"):
        memory_banks(adapted)
    with pytest.raises(ValueError, match=r"target_parameters LoRA.*merge_and_unload"):
        edit_next_token(adapted, PROMPT, EDIT_TOKEN, method="value")
    merged = adapted.merge_and_unload()
    assert memory_banks(merged)


@pytest.mark.parametrize("case", ["llama", "flash_mhf", "kvffn"])
def test_a_value_edit_under_pefts_lora_acts_as_on_the_merged_model(case):
    """A value edit changes the base weight under PEFT's LoRA (whose delta adds to it: the edit acts in full, and
    stays in the weights `merge_and_unload` gives). FlashMHF's edit solved for the head's value through the base
    weight of `out_proj`, so the adapted model moved otherwise than asked; a Llama MLP under LoRA was refused as
    unsupported."""
    adapted, merged = lora_on_every_linear(case)
    result = edit_next_token(adapted, PROMPT, EDIT_TOKEN, method="value")
    expected = edit_next_token(merged, PROMPT, EDIT_TOKEN, method="value")
    assert result.location == expected.location
    assert result.target_probability_after == pytest.approx(expected.target_probability_after, rel=1e-4)
    assert result.target_probability_after > result.target_probability_before
    edited = next_token_probabilities(adapted.merge_and_unload(), PROMPT)
    assert float(edited[EDIT_TOKEN]) == pytest.approx(expected.target_probability_after, rel=1e-4)


def test_analyze_reports_a_peft_model_as_its_merged_model():
    """`analyze` took no PEFT model: its decoder was not found through PEFT's wrapper."""
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    adapted, merged = lora_on_every_linear("flex_memoryllm")
    texts, edits = ["the memory stores a key", "a value of the token is the layer"], [("the memory stores", " value")]
    options = dict(top_triggers=2, cells_per_bank=2, agreement_cells=16, edits=edits)
    report, expected = (analyze(model, tiny_tokenizer(), texts, **options) for model in (adapted, merged))
    for bank, cells in expected["cells"].items():
        shown = [(cell["cell"], cell["promotes"]) for cell in report["cells"][bank]]
        assert shown == [(cell["cell"], cell["promotes"]) for cell in cells]
    assert report["token_memory"] == expected["token_memory"]
    assert report["edits"][0]["target_probability_after"] == pytest.approx(
        expected["edits"][0]["target_probability_after"], rel=1e-4)


def test_the_report_ranks_only_the_tokens_the_tokenizer_has():
    """The tiny tokenizer has 301 tokens and the models' embeddings 320 rows, as a vocabulary padded to a round size
    has. The report's value projections (promoted and demoted tokens, so the key-value agreement too) and the token
    memory's map ranked the rows no token uses too, which showed as empty names; they now rank the tokenizer's ids."""
    from hf_memffn.analysis import analyze, vocabulary_logits
    from hf_memffn.analysis.analyze import TokenNames
    from hf_memffn.testing import tiny_tokenizer

    tokenizer, model = tiny_tokenizer(), build("memoryllm")
    vocabulary = len(tokenizer)
    assert vocabulary < model.config.vocab_size
    report = analyze(model, tokenizer, ["the memory stores a key", "head reads the memory"], top_triggers=2,
                     cells_per_bank=4, agreement_cells=8, edits=[])
    names = TokenNames(tokenizer)
    for bank in memory_banks(model):
        for cell in report["cells"][bank.name]:
            logits = vocabulary_logits(model, bank.value_vectors()[cell["index"]][None])[0, :vocabulary]
            assert cell["promotes"] == names.many(logits.topk(10).indices.tolist())
            assert cell["demotes"] == names.many(logits.topk(10, largest=False).indices.tolist())
    for section in report["token_memory"].values():
        assert len(section["top_cell_per_token"]) == vocabulary
        for busiest in section["busiest_cells"]:
            assert section["top_cell_per_token"].count(busiest["cell"]) == busiest["num_tokens"]
    projection = project_values(model, memory_banks(model)[0], top_n=5, vocab_size=vocabulary)
    assert int(projection.top_ids.max()) < vocabulary and int(projection.bottom_ids.max()) < vocabulary
    assert token_memory_map(model, top_k=1, vocab_size=vocabulary)[0].top_cells.shape == (vocabulary, 1)


def test_a_model_with_offloaded_weights_is_refused_with_the_reason():
    """accelerate's offloading (`cpu_offload`, or a `device_map` with "cpu" or "disk" entries next to a GPU) leaves the
    weights on the meta device and brings them in only inside each module's forward, while the analysis reads the FFN
    weights outside it and sent its inputs to the device of the first weight: every tool failed with "Cannot copy out
    of meta tensor; no data!". The reason and what to do are now named before any work."""
    accelerate = pytest.importorskip("accelerate")
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    model = build("memoryllm")
    accelerate.cpu_offload(model, execution_device="cpu")
    input_ids = torch.tensor([11, 42, 7])
    calls = [
        lambda: memory_banks(model),
        lambda: coefficients_for_ids(model, input_ids),
        lambda: layer_contributions(model, [[11, 42]]),
        lambda: next_token_probabilities(model, input_ids),
        lambda: analyze(model, tiny_tokenizer(), ["the memory stores a key"], edits=[]),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"weights .* are on the meta device \(offloaded by accelerate"):
            call()


@pytest.mark.parametrize("arch", ["llama", "memoryllm"])
def test_a_model_without_an_output_embedding_is_refused_with_the_class_to_load(arch):
    """A decoder loaded with `AutoModel` has no `lm_head`: `analyze` ran the coefficients and the triggers, then
    failed with "'NoneType' object has no attribute 'weight'" (its default edit, with "no attribute 'logits'"), as did
    `project_values` and the edits. They now name the reason and the class to load, before any work."""
    from transformers import AutoModel

    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    torch.manual_seed(0)
    decoder = AutoModel.from_config(tiny_config(arch)).eval()
    forwards = []
    handle = decoder.register_forward_hook(lambda *args: forwards.append(1))
    message = rf"{type(decoder).__name__} has no output embedding .* load it with AutoModelForCausalLM"
    try:
        for edits in (None, []):
            with pytest.raises(ValueError, match=message):
                analyze(decoder, tiny_tokenizer(), ["the memory stores a key"], edits=edits)
        assert forwards == []
        with pytest.raises(ValueError, match=message):
            project_values(decoder, memory_banks(decoder)[0], cells=[0])
        with pytest.raises(ValueError, match=message):
            edit_next_token(decoder, torch.tensor([11, 42]), target_id=7)
    finally:
        handle.remove()


def test_a_very_long_token_is_plotted_as_a_cut_label():
    """A token's tick label was drawn whole, and the picture grows with it: a token of 2000 characters made the
    coefficients plot 13379 pixels tall (6 s), one of 20000 ran the process out of memory. The label is now cut
    (the HTML tables show the token whole)."""
    import struct

    from hf_memffn.analysis.report import plot_text_coefficients

    report = {"model": {"banks": [{"name": "layers.0.mlp"}]},
              "texts": [{"tokens": ["a", "x" * 2000, "b"],
                         "banks": {"layers.0.mlp": {"top_cells": [[["1", 0.5]], [["2", 0.3]], [["3", -0.2]]]}}}]}
    png = plot_text_coefficients(report)
    width, height = struct.unpack(">II", png[16:24])  # (the PNG header's size of the picture)
    assert width < 1500 and height < 800


def test_analyze_takes_texts_as_any_iterable_as_a_list(tmp_path):
    """`texts` given as an open file or a generator were read once, for the per-token section: the dataset, which
    defaults to them, was then empty, and the report had no trigger prefixes and no key-value agreement, silently
    (with the default edit, `texts[0]` failed on a generator)."""
    from hf_memffn.analysis import analyze
    from hf_memffn.testing import tiny_tokenizer

    texts = ["the memory stores a key", "head reads the memory"]
    (tmp_path / "texts.txt").write_text("".join(f"{text}\n" for text in texts))
    model, options = build("kvffn"), dict(top_triggers=2, cells_per_bank=2, agreement_cells=8)
    expected = analyze(model, tiny_tokenizer(), texts, **options)
    assert expected["cells"]["layers.0.mlp"][0]["triggers"]
    with open(tmp_path / "texts.txt") as lines:
        from_file = analyze(model, tiny_tokenizer(), (line.rstrip("\n") for line in lines), **options)
    assert from_file == expected


def test_report_json_names_numbers_that_are_not_finite_and_reads_them_back(tmp_path):
    """report.json wrote a statistic that overflowed as a bare null, the same as a value never measured: it is null
    and named under `not_finite` (`hf_memffn.run_records`), and `read_run_record` gives the inf and NaN back."""
    import math

    from hf_memffn.analysis import analyze, write_report
    from hf_memffn.run_records import NOT_FINITE, read_run_record
    from hf_memffn.testing import tiny_tokenizer

    report = analyze(build("kvffn"), tiny_tokenizer(), ["the memory stores a key"], top_triggers=1, cells_per_bank=1,
                     agreement_cells=8, edits=[])
    cell = report["cells"]["layers.0.mlp"][0]
    cell["triggers"][0]["coefficient"], cell["promotes_logits"][1] = float("inf"), float("nan")
    write_report(report, tmp_path / "report")
    text = (tmp_path / "report" / "report.json").read_text()
    written_cell = json.loads(text)["cells"]["layers.0.mlp"][0]
    assert written_cell["triggers"][0][NOT_FINITE] == {"coefficient": "Infinity"}
    assert written_cell[NOT_FINITE] == {"promotes_logits": {"1": "NaN"}}
    read_cell = read_run_record(text)["cells"]["layers.0.mlp"][0]
    assert read_cell["triggers"][0]["coefficient"] == math.inf and math.isnan(read_cell["promotes_logits"][1])


def test_scale_check_refuses_an_out_in_a_folder_it_cannot_write(tmp_path, capsys, monkeypatch, read_only_folder):
    """`--out` in a folder this user cannot write was written only at the very end, after the model was built and
    analysed (a PermissionError); refused now as the arguments are read, naming the flag and the folder. (Run as
    root, which writes anywhere, the folder's mode is read by `os.access` as for another user.)"""
    import os

    from hf_memffn.analysis import scale_check

    read_only = read_only_folder
    monkeypatch.setattr(scale_check, "LlamaForCausalLM", lambda *args, **kwargs: pytest.fail("the model was built"))
    argv = ["--device", "cpu", "--hidden-size", "64", "--num-layers", "1", "--vocab-size", "320",
            "--out", str(read_only / "scale.json")]
    with pytest.raises(SystemExit) as stop:
        scale_check.main(argv)
    error = capsys.readouterr().err
    assert stop.value.code == 2 and f"--out {read_only / 'scale.json'} is in a folder that is not writable" in error
    assert os.listdir(read_only) == []


@pytest.mark.parametrize("case", ["llama", "flash_mhf", "kvffn"])
def test_the_values_of_ffns_under_pefts_lora_are_exact_also_under_autocast(case):
    """The values of a PEFT-wrapped readout are read off the layer's forward; under a caller's
    `torch.autocast("cpu", dtype=torch.bfloat16)` that forward ran in bfloat16, so the values (and the edits solved
    from them) were rounded to bfloat16 where a plain `nn.Linear`'s were exact. They are the same as without
    autocast."""
    adapted, merged = lora_on_every_linear(case)
    for bank, merged_bank in zip(memory_banks(adapted), memory_banks(merged)):
        exact = bank.value_vectors()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = bank.value_vectors()
            merged_under_autocast = merged_bank.value_vectors()
        assert under_autocast.dtype == exact.dtype == torch.float32
        torch.testing.assert_close(under_autocast, exact, rtol=0, atol=0)
        torch.testing.assert_close(under_autocast, merged_under_autocast, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["flash_mhf", "mh_ffn", "pkv"])
def test_multihead_coefficients_are_float32_also_under_autocast(case):
    """FlashMHF's and PKV's `memory_coefficients` say they compute in float32; under a caller's
    `torch.autocast("cpu", dtype=torch.bfloat16)` their einsums ran in bfloat16 (coefficients rounded to 8 bits of
    mantissa, and the router's gates with them). They are the same as without autocast."""
    model = build(case)
    hidden = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for bank in memory_banks(model):
        exact = bank.coefficients_from_input(hidden)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = bank.coefficients_from_input(hidden)
        assert under_autocast.dtype == exact.dtype == torch.float32
        torch.testing.assert_close(under_autocast, exact, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["flash_mhf", "pkv"])
def test_a_multihead_value_edit_is_solved_in_float32_also_under_autocast(case):
    """A multi-head FFN's value edit solves for the head-space change through the head's slice of `out_proj`; under a
    caller's `torch.autocast("cpu", dtype=torch.bfloat16)` its products ran in bfloat16, so the change asked of a
    cell and the value written differed from those of the same edit without autocast (by about 1e-2; `lstsq` itself
    differs from call to call by about 1e-6)."""
    model = build(case)
    bank = memory_banks(model)[0]
    coefficients = torch.rand(bank.num_cells, generator=torch.Generator().manual_seed(4)) + 0.5
    output_change = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    cell = bank.num_cells // 2 + 1
    before = bank.value_parameter().detach().clone()
    exact = bank.value_delta_for_output(cell, coefficients, output_change)
    bank.add_to_value(cell, exact)
    edited = bank.value_parameter().detach().clone()
    with torch.no_grad():
        bank.value_parameter().copy_(before)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = bank.value_delta_for_output(cell, coefficients, output_change)
        bank.add_to_value(cell, under_autocast)
    assert under_autocast.dtype == exact.dtype == torch.float32
    torch.testing.assert_close(under_autocast, exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bank.value_parameter().detach(), edited, rtol=1e-4, atol=1e-4)
