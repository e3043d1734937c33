"""transformers' own ModelTesterMixin (vendored from the 5.25.0 release, tests/upstream/) on a tiny CgptForCausalLM.

GenerationTesterMixin is hf_cgpu's stand-in (tests/gpt_generation_checks.py): the release's tests/generation/ is not
in the sdist. With another transformers (the GPU machine's 5.17) the vendored module may not import: then only the
generation checks run and test_upstream_model_tester_mixin_runs says why.
"""

import unittest
from unittest import mock

import pytest
import torch

from gpt_generation_checks import GenerationChecks

try:
    import parameterized  # noqa: F401  (transformers' test mixins need it: pip install -e .[test])
    from upstream.transformers.test_modeling_common import ModelTesterMixin
    from upstream.transformers.generation.test_utils import GenerationTesterMixin

    UPSTREAM_MISSING = None
except ImportError as err:  # the vendored sources follow the installed transformers' internals
    import transformers

    if not (err.name or "").startswith(("transformers", "parameterized")):
        raise
    # Without them the generation checks still run (they are ours); the ModelTesterMixin checks are skipped.
    class ModelTesterMixin:  # nothing to run
        pass

    GenerationTesterMixin = GenerationChecks
    UPSTREAM_MISSING = (f"tests/upstream holds transformers 5.25.0's test sources, which do not import with "
                        f"transformers {transformers.__version__} ({err}): refresh them (tests/upstream/README.md)")

from transformers.models.auto import modeling_auto

from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM, CgptModel


class CgptModelTester:
    """Tiny shapes, as transformers' CausalLMModelTester: batch 3 x 7 tokens, 2 layers of width 32, 4 heads."""

    def __init__(self, parent, batch_size=3, seq_length=7, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, is_training=True, loss_chunk_size=5):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.is_training = is_training
        self.loss_chunk_size = loss_chunk_size  # < batch * seq: the chunked loss really chunks

    def get_config(self) -> CgptConfig:
        return CgptConfig(vocab_size=self.vocab_size, n_positions=64, n_embd=self.hidden_size,
                          n_layer=self.num_hidden_layers, n_head=self.num_attention_heads,
                          loss_chunk_size=self.loss_chunk_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)

    def prepare_config_and_inputs_for_common(self):
        """Random ids and a random padding mask whose last column is 1, as transformers' ids_tensor and
        random_attention_mask make them."""
        shape = (self.batch_size, self.seq_length)
        input_ids = torch.randint(0, self.vocab_size, shape)
        attention_mask = torch.randint(0, 2, shape)
        attention_mask[:, -1] = 1
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class CgptModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (CgptModel, CgptForCausalLM)
    test_can_init_all_missing_weights_before_2023 = True  # our _init_weights covers every weight: check it

    @classmethod
    def setUpClass(cls):
        cls._threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny model: intra-op threads cost more than they save
        # The mixin tells a base model from a causal LM (which gets labels in the training tests) by these name tables
        # of transformers' own models; list ours there for this class, as if it lived in the library.
        cls._name_tables = [
            mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {"cgpt": "CgptModel"}),
            mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {"cgpt": "CgptForCausalLM"}),
        ]
        for patch in cls._name_tables:
            patch.start()

    @classmethod
    def tearDownClass(cls):
        for patch in cls._name_tables:
            patch.stop()
        torch.set_num_threads(cls._threads)

    def setUp(self):
        self.model_tester = CgptModelTester(self)

    def test_upstream_model_tester_mixin_runs(self):
        if UPSTREAM_MISSING:
            self.skipTest(UPSTREAM_MISSING)
        self.assertTrue(hasattr(self, "test_attention_outputs"))  # a ModelTesterMixin check


class CgptModernModelTester(CgptModelTester):
    """The same tiny shapes with the modern options on: rotary positions, q/k RMSNorm, ReLU squared, RMSNorm."""

    def get_config(self) -> CgptConfig:
        config = super().get_config()
        config.position_embedding, config.qk_norm, config.activation, config.norm = "rotary", True, "relu2", "rmsnorm"
        return config


class CgptModernModelTest(CgptModelTest):
    def setUp(self):
        self.model_tester = CgptModernModelTester(self)


class CgptSpeedrunModelTester(CgptModelTester):
    """The same tiny shapes with modded-nanogpt's options on: a value embedding (feeding both layers), soft-capped
    logits, the U-net skip from the first block to the second, an untied head (started at random: a zero head gives
    every token the same logit, which would make the generation checks trivial), two blocks run twice: the mixin's
    num_hidden_layers is the depth as run (the config's too), 4."""

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **{"num_hidden_layers": 4, **kwargs})

    def get_config(self) -> CgptConfig:
        config = super().get_config()
        config.value_embeddings, config.logit_softcap, config.unet_skips = 1, 0.05, True
        config.tie_word_embeddings, config.layer_loops, config.n_layer = False, 2, self.num_hidden_layers // 2
        return config


class CgptSpeedrunModelTest(CgptModelTest):
    def setUp(self):
        self.model_tester = CgptSpeedrunModelTester(self)

    def _refuses_inputs_embeds_alone(self):
        """Value embeddings are looked up by token id: embeddings alone are refused in one line (the mixin's
        inputs_embeds checks replaced by this)."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            with self.assertRaisesRegex(ValueError, "^value_embeddings .*pass input_ids, not inputs_embeds$"):
                model(inputs_embeds=model.get_input_embeddings()(inputs["input_ids"]))

    def test_num_layers_is_small(self):
        """Two blocks (the mixin's limit) run twice: a depth of 4, as transformers allows its own looped models."""
        config = self.model_tester.get_config()
        self.assertEqual((config.n_layer, config.layer_loops, config.num_hidden_layers), (2, 2, 4))

    test_inputs_embeds = test_inputs_embeds_matches_input_ids = _refuses_inputs_embeds_alone
    test_generate_from_inputs_embeds = _refuses_inputs_embeds_alone


class CgptDocumentModelTester(CgptModelTester):
    """The same tiny shapes with ``document_masking`` on and an EOS inside every row, so that each check also runs
    across a document boundary (positions restart there, attention stays within each document)."""

    def get_config(self) -> CgptConfig:
        config = super().get_config()
        config.document_masking = True
        return config

    eos_inside = True

    def prepare_config_and_inputs_for_common(self):
        config, inputs = super().prepare_config_and_inputs_for_common()
        ids = inputs["input_ids"]
        if self.eos_inside:
            ids[:, self.seq_length // 2] = config.eos_token_id
        else:
            ids[ids == config.eos_token_id] += 1
        return config, inputs


class CgptDocumentModelTest(CgptModelTest):
    eos_in_prompts = True

    def setUp(self):
        self.model_tester = CgptDocumentModelTester(self)

    def _inputs(self, batch_size: int = 2):
        """The generation checks' left-padded prompts, each with an EOS inside (after the padding)."""
        config, input_ids, mask = super()._inputs(batch_size)
        if self.eos_in_prompts:
            input_ids[:, -3] = config.eos_token_id
        return config, input_ids, mask

    def _one_document_from_embeddings(self, check):
        """Embeddings do not show which token is an EOS: inputs_embeds are one document, and on inputs without an
        EOS the model gives what it gives from their ids (the mixin's check)."""
        self.eos_in_prompts = self.model_tester.eos_inside = False
        check(self)

    def test_inputs_embeds_matches_input_ids(self):
        if UPSTREAM_MISSING:
            self.skipTest(UPSTREAM_MISSING)
        self._one_document_from_embeddings(CgptModelTest.test_inputs_embeds_matches_input_ids)

    def test_generate_from_inputs_embeds(self):
        self._one_document_from_embeddings(CgptModelTest.test_generate_from_inputs_embeds)
