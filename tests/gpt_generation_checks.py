"""hf_cgpu's equivalents of the key checks of transformers' ``GenerationTesterMixin`` (tests/generation/test_utils.py).

The transformers 5.25.0 sdist ships only ``tests/*.py``: ``test_modeling_common.py`` is vendored under tests/upstream/,
its ``tests/generation/`` is not in the release files, so this mixin stands in for it (written for this repository,
not copied). It needs what the upstream mixin needs: ``self.model_tester.prepare_config_and_inputs_for_common()`` and
``self.all_generative_model_classes``. Every check compares generate() against an independent reference (a loop of
full forwards, another decoding method that must agree, or the same call without the feature under test).
"""

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

# transformers 5.24 renamed generate's cache argument / output field from past_key_values to cache.
CACHE_NAME = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


class GenerationChecks:
    max_new_tokens = 4

    @property
    def all_generative_model_classes(self):  # as ModelTesterMixin's, for use without it
        return tuple(model_class for model_class in self.all_model_classes if model_class.can_generate())

    def _inputs(self, batch_size: int = 2):
        """config, left-padded input_ids (B, T) and attention_mask: the first row has two pad tokens in front."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        input_ids = inputs["input_ids"][:batch_size].clone()
        mask = torch.ones_like(input_ids)
        mask[0, :2] = 0
        input_ids[mask == 0] = config.pad_token_id
        input_ids[mask == 1] = input_ids[mask == 1].clamp(min=3)  # no pad / bos / eos inside the prompt
        return config, input_ids, mask

    def _models(self, **config_updates):
        for model_class in self.all_generative_model_classes:
            config, input_ids, mask = self._inputs()
            for key, value in config_updates.items():
                setattr(config, key, value)
            torch.manual_seed(0)
            yield model_class(config).eval(), input_ids, mask

    def _generate(self, model, input_ids, mask, **kwargs):
        args = dict(max_new_tokens=self.max_new_tokens, min_new_tokens=self.max_new_tokens, do_sample=False,
                    pad_token_id=model.config.pad_token_id, eos_token_id=None)
        args.update(kwargs)
        with torch.no_grad():
            return model.generate(input_ids, attention_mask=mask, **args)

    @staticmethod
    def _greedy_by_hand(model, input_ids, mask, steps):
        """Argmax of full forwards (no cache, no generate), extending the mask by one real token per step.
        Returns the sequences and each step's last-position logits."""
        all_logits = []
        with torch.no_grad():
            for _ in range(steps):
                logits = model(input_ids, attention_mask=mask, use_cache=False).logits[:, -1]
                all_logits.append(logits)
                input_ids = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], 1)
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        return input_ids, all_logits

    def _check_dict_outputs(self, model, out, prompt_len, use_cache):
        B, N = out.sequences.shape[0], self.max_new_tokens
        cfg = model.config
        self.assertEqual(out.sequences.shape, (B, prompt_len + N))
        self.assertEqual(len(out.scores), N)
        self.assertEqual(len(out.logits), N)
        self.assertTrue(all(s.shape == (B, cfg.vocab_size) for s in out.scores + out.logits))
        self.assertEqual(len(out.attentions), N)
        self.assertEqual(len(out.hidden_states), N)
        for step in range(N):
            kv = prompt_len + step
            q = kv if (step == 0 or not use_cache) else 1
            self.assertEqual(len(out.attentions[step]), cfg.num_hidden_layers)
            self.assertEqual(len(out.hidden_states[step]), cfg.num_hidden_layers + 1)
            for attn in out.attentions[step]:
                self.assertEqual(attn.shape, (B, cfg.num_attention_heads, q, kv))
                torch.testing.assert_close(attn.sum(-1), torch.ones_like(attn.sum(-1)))  # softmax rows
            for hidden in out.hidden_states[step]:
                self.assertEqual(hidden.shape, (B, q, cfg.hidden_size))

    def test_greedy_generate_equals_forward_loop(self):
        for model, input_ids, mask in self._models():
            out = self._generate(model, input_ids, mask, return_dict_in_generate=True, output_logits=True)
            sequences, logits = self._greedy_by_hand(model, input_ids, mask, self.max_new_tokens)
            self.assertTrue(torch.equal(out.sequences, sequences))
            for got, want in zip(out.logits, logits):  # the values too: argmax alone hides small shifts
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_greedy_generate_cached_equals_uncached(self):
        for model, input_ids, mask in self._models():
            cached = self._generate(model, input_ids, mask, use_cache=True)
            uncached = self._generate(model, input_ids, mask, use_cache=False)
            self.assertTrue(torch.equal(cached, uncached))

    def test_greedy_generate_dict_outputs(self):
        for use_cache in (True, False):
            for model, input_ids, mask in self._models():
                out = self._generate(model, input_ids, mask, use_cache=use_cache, return_dict_in_generate=True,
                                     output_scores=True, output_logits=True, output_attentions=True,
                                     output_hidden_states=True)
                self._check_dict_outputs(model, out, input_ids.shape[1], use_cache)
                self.assertTrue(torch.equal(out.sequences, self._generate(model, input_ids, mask)))

    def test_sample_generate_is_seeded_and_expands(self):
        for model, input_ids, mask in self._models():
            runs = []
            for _ in range(2):
                torch.manual_seed(7)
                runs.append(self._generate(model, input_ids, mask, do_sample=True, top_k=10,
                                           num_return_sequences=3))
            self.assertEqual(runs[0].shape, (3 * input_ids.shape[0], input_ids.shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(runs[0], runs[1]))
            self.assertTrue(torch.equal(runs[0][:, : input_ids.shape[1]], input_ids.repeat_interleave(3, 0)))

    def test_beam_search_generate(self):
        for model, input_ids, mask in self._models():
            kw = dict(num_beams=3, num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
            cached = self._generate(model, input_ids, mask, use_cache=True, **kw)
            uncached = self._generate(model, input_ids, mask, use_cache=False, **kw)
            self.assertEqual(cached.sequences.shape, (2 * input_ids.shape[0], input_ids.shape[1] + self.max_new_tokens))
            self.assertEqual(cached.sequences_scores.shape, (2 * input_ids.shape[0],))
            self.assertTrue(torch.equal(cached.sequences, uncached.sequences))
            # one beam is greedy search
            self.assertTrue(torch.equal(self._generate(model, input_ids, mask, num_beams=1),
                                        self._generate(model, input_ids, mask)))

    def test_assisted_decoding_matches_greedy(self):
        for model, input_ids, mask in self._models():
            torch.manual_seed(1)  # another random model: it proposes wrong tokens, so rejection is exercised
            assistant = type(model)(model.config).eval()
            greedy = self._generate(model, input_ids[1:], mask[1:])  # assisted decoding needs batch size 1
            for assistant_model in (assistant, model):
                assisted = self._generate(model, input_ids[1:], mask[1:], assistant_model=assistant_model)
                self.assertTrue(torch.equal(assisted, greedy))
            out = self._generate(model, input_ids[1:], mask[1:], assistant_model=assistant,
                                 return_dict_in_generate=True, output_scores=True, output_logits=True,
                                 output_attentions=True, output_hidden_states=True)
            self.assertTrue(torch.equal(out.sequences, greedy))
            self._check_dict_outputs(model, out, input_ids.shape[1], use_cache=True)

    def test_prompt_lookup_decoding_matches_greedy(self):
        for model, input_ids, mask in self._models():
            prompt = input_ids[1:].repeat(1, 2)  # repeated n-grams, so the lookup proposes candidates
            prompt_mask = torch.ones_like(prompt)
            greedy = self._generate(model, prompt, prompt_mask)
            looked_up = self._generate(model, prompt, prompt_mask, prompt_lookup_num_tokens=2)
            self.assertTrue(torch.equal(looked_up, greedy))

    def test_static_cache_matches_dynamic_cache(self):
        for model, input_ids, mask in self._models():
            dynamic = self._generate(model, input_ids, mask)
            static = self._generate(model, input_ids, mask, cache_implementation="static")
            self.assertTrue(torch.equal(static, dynamic))

    def test_generate_continue_from_cache(self):
        for model, input_ids, mask in self._models():
            full = self._generate(model, input_ids, mask, max_new_tokens=2 * self.max_new_tokens,
                                  min_new_tokens=2 * self.max_new_tokens)
            first = self._generate(model, input_ids, mask, return_dict_in_generate=True)
            cache = getattr(first, CACHE_NAME)
            self.assertEqual(cache.get_seq_length(), first.sequences.shape[1] - 1)  # last token not yet fed
            mask2 = torch.cat([mask, mask.new_ones(mask.shape[0], self.max_new_tokens)], 1)
            second = self._generate(model, first.sequences, mask2, **{CACHE_NAME: cache})
            self.assertTrue(torch.equal(second, full))

    def test_generate_from_inputs_embeds(self):
        for model, input_ids, mask in self._models():
            from_ids = self._generate(model, input_ids, mask)
            embeds = model.get_input_embeddings()(input_ids)
            with torch.no_grad():
                from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, do_sample=False,
                                             max_new_tokens=self.max_new_tokens, min_new_tokens=self.max_new_tokens,
                                             pad_token_id=model.config.pad_token_id, eos_token_id=None)
            self.assertTrue(torch.equal(from_embeds, from_ids[:, input_ids.shape[1]:]))  # only the new tokens

    def test_left_padding_compatibility(self):
        for model, input_ids, _ in self._models():
            plain = input_ids[1:]
            padded = torch.cat([torch.full((1, 3), model.config.pad_token_id), plain], 1)
            padded_mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(plain)], 1)
            with torch.no_grad():
                a = model(plain).logits[:, -1]
                b = model(padded, attention_mask=padded_mask).logits[:, -1]
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
