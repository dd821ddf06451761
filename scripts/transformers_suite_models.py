"""Testers that hold this package's models (and transformers' Llama, the control) to transformers' model tests.

`scripts/transformers_suite.py` copies this file next to transformers' test modules (as
`tests/test_memffn_models.py` in its cache) and runs it there; it is not collected by this repository's own tests.
One `unittest.TestCase` per architecture (`Test_<arch>`), built from `ModelTesterMixin` and `GenerationTesterMixin`
with the tiny configs of `hf_memffn.testing`, shaped like transformers' causal-LM testers (batch 13, length 7,
pad/bos/eos ids 0/1/2, a lower-triangular attention mask).
"""

from __future__ import annotations

import os
import unittest

import torch
from transformers.models.auto import modeling_auto

import hf_memffn
from hf_memffn.testing import tiny_config

from .generation.test_utils import GenerationTesterMixin
from .test_configuration_common import ConfigTester
from .test_modeling_common import ModelTesterMixin, ids_tensor

# Each architecture's base model, causal LM and task heads (sequence and token classification, question answering),
# as transformers' Llama tests list theirs.
MODEL_CLASSES = {
    name: (entry.model_class, entry.causal_lm_class, *entry.task_heads.values())
    for name, entry in hf_memffn.REGISTRY.items()
}
# A model that ships inside transformers is listed in the auto-class name tables, and several tests read them (which
# class is a base model, which takes which labels). Ours are registered at run time (`AutoModel.register`), which
# does not touch the base models' table (importing the modeling files lists the heads in theirs): list them there as
# an in-library model would be.
for _name, (_base, _causal_lm, *_heads) in MODEL_CLASSES.items():
    if _name != hf_memffn.BASELINE:
        modeling_auto.MODEL_MAPPING_NAMES.setdefault(_base.config_class.model_type, _base.__name__)
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(_base.config_class.model_type, _causal_lm.__name__)

SELECTED = [a for a in os.environ.get("MEMFFN_SUITE_ARCHS", ",".join(MODEL_CLASSES)).split(",") if a]


class TinyModelTester:
    """The attributes and inputs transformers' mixins read from `self.model_tester`."""

    batch_size = 13
    seq_length = 7
    is_training = True
    vocab_size = 99
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, parent, arch: str):
        self.parent = parent
        self.arch = arch
        self.base_model_class, self.causal_lm_class = MODEL_CLASSES[arch][:2]
        config = self.get_config()
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = config.num_hidden_layers
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.max_position_embeddings = config.max_position_embeddings

    def get_config(self):
        return tiny_config(
            self.arch,
            vocab_size=self.vocab_size,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            # FlashMHF through the PyTorch op on every device: these tests are about the model, not the kernels
            **({"ffn_num_heads": 2, "ffn_num_kv_heads": 1, "ffn_kernel": "torch"} if self.arch == "flash_mhf" else {}),
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}

    def prepare_config_and_inputs(self):
        return self.prepare_config_and_inputs_for_common()


class _SuiteBase(ModelTesterMixin, GenerationTesterMixin):
    arch: str = ""
    pipeline_model_mapping = {}

    def setUp(self):
        self.model_tester = TinyModelTester(self, self.arch)
        self.config_tester = ConfigTester(self, config_class=type(self.model_tester.get_config()))

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = self.all_model_classes[0](config).eval()
        output = model(**inputs)
        tester = self.model_tester
        self.assertEqual(output.last_hidden_state.shape, (tester.batch_size, tester.seq_length, config.hidden_size))


for _arch in SELECTED:
    _name = f"Test_{_arch}"
    globals()[_name] = type(
        _name, (_SuiteBase, unittest.TestCase), {"arch": _arch, "all_model_classes": MODEL_CLASSES[_arch]}
    )
