"""ONNX export: FlashMHF's custom operator exports through its ONNX translation (the reference decomposition), and
the ONNX model's logits equal the PyTorch model's (evaluated with onnx's reference evaluator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_memffn.testing import tiny_config

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
from onnx.reference import ReferenceEvaluator  # noqa: E402

from hf_memffn.onnx_export import export_onnx  # noqa: E402


@pytest.mark.parametrize("overrides", [{}, {"ffn_variant": "mh_ffn", "ffn_num_subnetworks": 1}])
def test_flash_mhf_exports_to_onnx_and_matches(overrides, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", **overrides)).eval()
    path = tmp_path / "model.onnx"
    export_onnx(model, torch.randint(3, 320, (2, 8)), path)  # torch.export specializes a size of 1
    graph = onnx.load(path)
    assert not any(node.domain.startswith("memffn") for node in graph.graph.node)
    session = ReferenceEvaluator(graph)
    ids = torch.randint(3, 320, (3, 11))  # another batch size and length than at export time
    (logits,) = session.run(None, {"input_ids": ids.numpy()})
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
