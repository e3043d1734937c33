"""Chat template and end-of-turn checks before instruction fine-tuning: a base without a template gets ChatML (said,
saved with the tokenizer), a template that closes a turn with no special token gets the EOS appended to each
response, and after a tiny fine-tune generation with the saved generation_config stops at the end-of-turn token."""

from __future__ import annotations

import json

import torch

from hf_cgpu.data.chat import CHATML, end_of_turn, prepare_chat
from hf_cgpu.data.instruct import encode
from hf_cgpu.data.tokenizer import train_tokenizer


def chatml_vocab_tokenizer():
    """A byte-level BPE whose vocabulary has ChatML's tokens but whose EOS is <|endoftext|> and which has no
    template: a base model as SmolLM2 and Qwen ship them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["user assistant repeat the word: red green blue gold"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def test_a_base_without_template_gets_chatml_with_its_own_end_token():
    lines: list[str] = []
    tok = chatml_vocab_tokenizer()
    eot, append = prepare_chat(tok, "base", lines.append)
    assert tok.chat_template == CHATML and eot == tok.convert_tokens_to_ids("<|im_end|>") and not append
    assert lines == [("base has no chat template: using ChatML (<|im_start|>role ... <|im_end|>), saved with the "
                      "tokenizer")]
    plain = train_tokenizer(["abc"], vocab_size=257, show_progress=False)  # no ChatML tokens: the ### layout
    lines.clear()
    eot, append = prepare_chat(plain, "byte", lines.append)
    assert eot == plain.eos_token_id and not append
    assert lines == [(f"byte has no chat template nor ChatML tokens: using ### Instruction / ### Response with each "
                      f"answer closed by its EOS {plain.eos_token}, saved with the tokenizer")]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    ids, flags, _ = encode(plain, chat)
    untemplated = train_tokenizer(["abc"], vocab_size=257, show_progress=False)
    assert (ids, flags) == encode(untemplated, chat)[:2]  # what a run without a template trained on before
    assert plain.decode([i for i, f in zip(ids, flags) if f]) == "ok" + plain.eos_token


def test_a_template_without_end_of_turn_token_gets_the_eos_appended_to_every_response():
    tok = train_tokenizer(["abc"], vocab_size=257, show_progress=False)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn(tok) is None
    lines: list[str] = []
    eot, append = prepare_chat(tok, "base", lines.append)
    assert (eot, append) == (tok.eos_token_id, True) and len(lines) == 1 and "is appended to every response" in lines[0]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "ok"}]
    ids, flags, chars = encode(tok, chat, append_eos=True)
    eos = tok.eos_token
    assert tok.decode(ids) == f"user: hi\nassistant: yo\n{eos}user: and?\nassistant: ok\n{eos}"
    # a template without a generation prompt: the scored span starts at the role name, as render defines it
    assert tok.decode([i for i, f in zip(ids, flags) if f]) == f"assistant: yo\n{eos}assistant: ok\n{eos}"
    assert chars == 4


def test_generation_after_a_tiny_fine_tune_stops_at_the_end_of_turn_token(tmp_path):
    """A base whose EOS is <|endoftext|> gets ChatML closed by <|im_end|>; the run saves a generation_config whose
    EOS ids include <|im_end|>, and greedy generation with it ends the answer there (not at max_new_tokens)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from hf_cgpu.cli import main as cli_main

    tok = chatml_vocab_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    words = ["red", "green", "blue", "gold"]
    rows = [{"instruction": f"repeat the word: {w}", "output": w} for w in words * 16]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert cli_main(["train", "lora", "--model", str(tmp_path / "base"), "--dataset", str(tmp_path / "data"),
                     "--tier", "full", "--seq_len", "32", "--micro_batch_size", "8", "--gradient_accumulation_steps",
                     "1", "--max_steps", "40", "--warmup_steps", "2", "--learning_rate", "3e-3", "--eval_steps", "40",
                     "--checkpointing_steps", "0", "--progress", "false", "--recompute", "false",
                     "--mixed_precision", "no", "--output_dir", str(out)]) == 0
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.chat_template == CHATML
    im_end = saved.convert_tokens_to_ids("<|im_end|>")
    config = GenerationConfig.from_pretrained(out)
    assert set(config.eos_token_id) == {im_end, saved.eos_token_id}
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = saved.apply_chat_template([{"role": "user", "content": "repeat the word: blue"}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        new = model.generate(ids, generation_config=config, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
    assert new[-1].item() == im_end and len(new) < 20, saved.decode(new)
    assert saved.decode(new, skip_special_tokens=True) == "blue"
