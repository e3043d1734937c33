"""Packed fine-tuning rows: best-fit decreasing bins, whole examples with restarting positions, and attention and loss
kept within each example for our GPT, a Llama and a GPT-NeoX (transformers' padding-free path)."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import datasets
import pytest
import torch
from test_instruct import CHAT, byte_tok

from hf_cgpu.data.bins import best_fit_decreasing, waste
from hf_cgpu.data.instruct import IGNORE, build_rows, encode, to_messages

ATOL = 2e-5  # fp32 logits of one example alone vs inside a packed row: only the summation order differs


def test_best_fit_decreasing_on_a_known_list():
    lengths = [7, 5, 4, 3, 3, 2, 1]  # 25 tokens: three rows of 10 is the least possible
    bins = best_fit_decreasing(lengths, 10)
    # 7 opens a row; 5 opens one; 4 fits the 5 left best; a 3 fills the 7's row; the other 3 opens a row; the 2 goes
    # there (the 1 left elsewhere is too small); the 1 fills the row of 5 + 4
    assert bins == [[0, 3], [1, 2, 6], [4, 5]]
    assert waste(lengths, bins, 10) == pytest.approx(5 / 30)
    assert best_fit_decreasing(lengths[::-1], 10) == [[6, 2], [5, 4, 0], [3, 1]]  # same rows, whatever the order
    # the last 1 goes to the tightest row (room 1), not the first with room (the 7's, room 3), which stays open for
    # a 3: first-fit decreasing would put it there
    assert best_fit_decreasing([9, 7, 5, 4, 1, 1], 10) == [[0, 4], [1], [2, 3, 5]]
    assert best_fit_decreasing([12, 3], 10) == [[0], [1]]  # longer than a row: a row of its own (cut by the caller)


PROMPTS = ["hi", "a longer question here", "x", "what is two plus two", "tell", "yo"]
ANSWERS = ["hello", "sure", "why not", "four", "a story about cats", "z"]


def _rows(packing: bool, seq_len: int = 128):
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "response": ANSWERS})
    return build_rows(ds, byte_tok(CHAT), seq_len, "prompt", packing=packing)


def _segments(rows) -> list[tuple[list[int], list[int]]]:
    """(tokens, targets) of every stretch of a packed row between restarts of its positions."""
    out = []
    for r in range(len(rows)):
        starts = (rows.position_ids[r] == 0).nonzero().flatten().tolist() + [rows.ids.shape[1]]
        out += [(rows.ids[r, a:b].tolist(), rows.targets[r, a:b].tolist()) for a, b in zip(starts, starts[1:])]
    return out


def test_packed_rows_hold_whole_examples_with_restarting_positions():
    tok = byte_tok(CHAT)
    padded, packed = _rows(False), _rows(True)
    assert len(padded) == 6 and len(packed) == 3 and packed.n_examples == 6 and packed.n_truncated == 0
    assert packed.ids.shape == packed.targets.shape == packed.position_ids.shape == (3, 129)
    want = []
    for p, a in zip(PROMPTS, ANSWERS):
        ids, flags, _ = encode(tok, to_messages({"prompt": p, "response": a}, "prompt"))
        want.append((ids, [i if f else IGNORE for i, f in zip(ids, flags)]))
    segments = _segments(packed)
    assert sorted(want) == sorted(s for s in segments if any(t != IGNORE for t in s[1]))  # whole, unchanged
    assert sum(len(s[0]) for s in segments if all(t == IGNORE for t in s[1])) == packed.ids.numel() - packed.n_tokens
    assert packed.n_chars == padded.n_chars == sum(map(len, ANSWERS)) and packed.n_tokens == padded.n_tokens


def test_an_example_longer_than_a_row_is_cut_and_counted():
    ds = datasets.Dataset.from_dict({"prompt": ["q", "p"], "response": ["a" * 90, "b"]})
    rows = build_rows(ds, byte_tok(CHAT), 64, "prompt", packing=True)
    assert rows.n_truncated == 1 and len(rows) == 2 and rows.position_ids.max() == 64


def _models():
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    small = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=257)
    yield "llama", LlamaForCausalLM(LlamaConfig(hidden_size=32, num_key_value_heads=2, **small))
    yield "neox", GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, max_position_embeddings=64, **small))
    for pe in ("learned", "rotary"):
        for attn in ("sdpa", "eager"):
            cfg = CgptConfig(vocab_size=257, n_positions=32, n_embd=32, n_layer=2, n_head=2, position_embedding=pe)
            cfg._attn_implementation = attn
            yield f"cgpt-{pe}-{attn}", CgptForCausalLM(cfg)


@pytest.mark.parametrize("name", [n for n, _ in _models()])
def test_a_packed_row_gives_each_example_the_logits_it_has_alone(name):
    """transformers' padding-free test: restarting position_ids, no mask; and the same row read as one sequence (a
    planted cross-example attention) differs, so the check can fail. The row is longer than cgpt's 32 positions."""
    torch.manual_seed(0)
    model = dict(_models())[name].eval()
    lengths = [9, 14, 17]
    ids = torch.randint(0, 257, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos, use_cache=False).logits[0]  # as in training: no cache
        at = 0
        for n in lengths:
            alone = model(ids[:, at : at + n]).logits[0]
            torch.testing.assert_close(packed[at : at + n], alone, atol=ATOL, rtol=0)
            at += n
        if name.startswith("cgpt"):
            with pytest.raises(ValueError, match="longer than n_positions=32"):
                model(ids)
            crossed = model(ids[:, :32], position_ids=torch.arange(32)[None]).logits[0]
        else:
            crossed = model(ids).logits[0]
    assert not torch.allclose(crossed[lengths[0] : lengths[0] + 5], packed[lengths[0] : lengths[0] + 5], atol=1e-3)


def test_the_task_loss_of_packed_rows_is_the_loss_of_the_examples():
    """FinetuneTask.loss over packed rows equals, in summed nats, the loss of every example scored in its own row
    (tolerance 1e-5 relative); dropping the positions (cross-example attention) changes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_cgpu.tasks.finetune_lm import FinetuneSettings, FinetuneTask

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5)).eval()
    task = FinetuneTask(FinetuneSettings(loss_chunk_size=16))
    task.accelerator = SimpleNamespace(autocast=nullcontext)

    def nats(rows, **drop):
        batch = {"input_ids": rows.ids, "targets": rows.targets}
        if rows.position_ids is not None and not drop:
            batch["position_ids"] = rows.position_ids
        with torch.no_grad():
            return task.loss(model, batch, None).item() * int((rows.targets[:, 1:] != IGNORE).sum())

    padded, packed = _rows(False), _rows(True)
    assert nats(packed) == pytest.approx(nats(padded), rel=1e-5)
    assert nats(packed, drop=True) != pytest.approx(nats(padded), rel=1e-2)


def test_a_packed_lora_run_resumes_bit_identical_and_packing_is_fixed(tiny_base, tmp_path, capsys):
    """Packing is deterministic and fingerprinted: resuming at step 3 reproduces the uninterrupted adapter bit for bit;
    resuming with --packing false is refused in one line."""
    import json
    import shutil

    from safetensors.torch import load_file

    from hf_cgpu.cli import main as cli_main

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"instruction": f"count to {i % 7}", "output": " ".join(str(k) for k in range(i % 7 + 1))}
            for i in range(80)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def args(out, *extra):
        return ["train", "lora", "--preset", "lora", "--model", str(tiny_base), "--dataset", str(data), "--seq_len",
                "63", "--micro_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", "6",
                "--warmup_steps", "1", "--eval_steps", "0", "--eval_batches", "1", "--checkpointing_steps", "3",
                "--learning_rate", "1e-2", "--progress", "false", "--compile", "false", "--recompute", "false",
                "--lora_r", "4", "--output_dir", str(out), *extra]

    full = tmp_path / "full"
    assert cli_main(args(full)) == 0
    out = capsys.readouterr().out
    assert "72 instruction examples" in out and "0 longer than 64 tokens cut; packed into" in out, out
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_0000003", cut / "checkpoints" / "step_0000003")
    assert cli_main(args(cut, "--resume_from_checkpoint", "latest")) == 0
    a, b = load_file(full / "adapter_model.safetensors"), load_file(cut / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cli_main(args(cut, "--resume_from_checkpoint", "latest", "--packing", "false", "--max_steps", "7")) == 2
    assert "packing" in capsys.readouterr().err


def test_the_ledger_prices_the_mask_of_packed_rows():
    """Packed rows cost one (B, 1, T, T) mask: bool under SDPA, bf16 under eager; rows of one example cost none."""
    import dataclasses

    from hf_cgpu.budget.memory import ledger
    from hf_cgpu.budget.shape import ModelShape, TrainSetup

    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000})
    setup = TrainSetup(tier="lora", micro_batch_size=3, seq_len=2048)

    def mask(s, **kw):
        return next(r.bytes for r in ledger(s, setup, **kw).rows if r.key == "packed_mask")

    assert mask(shape) == 0
    assert mask(shape, packed=True) == 3 * 2048**2
    assert mask(dataclasses.replace(shape, attention="eager"), packed=True) == 2 * 3 * 2048**2
    plain, packed = ledger(shape, setup), ledger(shape, setup, packed=True)
    assert packed.allocated - plain.allocated == pytest.approx(3 * 2048**2)


def test_the_ledger_fits_16k_tokens_of_the_14b_shape_into_16_gib():
    """hf-cgpu budget --preset lora --seq_len 16384: beyond Pythia's 2048 trained positions (rotary: said, not refused),
    and --autofit finds a plan under 16 GiB with recompute and the loss in chunks (one 1024 x 50304 block of 16 B)."""
    from hf_cgpu.budget.shape import ModelShape
    from hf_cgpu.commands.budget import run
    from hf_cgpu.errors import SettingsError

    plain = run(["--preset", "lora", "--seq_len", "16384", "--packing", "false"])
    assert "note: --seq_len 16384 is beyond the 2048 positions pythia-1.4b was trained on" in plain
    assert "DOES NOT FIT" in plain  # micro-batch 4 without recompute
    fitted = run(["--preset", "lora", "--seq_len", "16384", "--packing", "false", "--autofit", "true"])
    plan = fitted[fitted.index("plan:"):]
    assert "seq 16384" in plan and "; recompute;" in plan and "verdict vs 16.00 GiB cap: FITS" in plan
    logits = next(line for line in plan.splitlines() if line.strip().startswith("logits + loss"))
    assert f"{1024 * 50304 * 16 / 2**30:.2f}" in logits
    gpt = ModelShape.from_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
                                  "n_positions": 128})
    with pytest.raises(SettingsError, match="longer than the model's 128 positions"):
        gpt.positions_note(256)  # a position table cannot go past its rows


def test_a_tiny_long_sequence_lora_run_with_recompute_and_a_chunked_loss(tiny_base, tmp_path, capsys):
    """Sequences four times the tiny base's 64 positions (rotary), recompute on, the loss in chunks: it trains, says
    where the positions go past the trained ones, and its ledger (the task's RunShape) is the long sequence's."""
    from hf_cgpu.cli import main as cli_main

    out = tmp_path / "run"
    assert cli_main(["train", "lora", "--preset", "lora", "--model", str(tiny_base), "--dataset", "builtin",
                     "--seq_len", "256", "--loss_chunk_size", "64", "--recompute", "true", "--micro_batch_size", "1",
                     "--gradient_accumulation_steps", "1", "--max_steps", "2", "--eval_steps", "0", "--eval_batches",
                     "1", "--checkpointing_steps", "0", "--progress", "false", "--compile", "false", "--lora_r", "4",
                     "--output_dir", str(out)]) == 0
    assert "note: --seq_len 256 is beyond the 64 positions" in capsys.readouterr().out
    import json
    import math

    results = json.loads((out / "all_results.json").read_text())
    assert math.isfinite(results["val_loss"]) and results["toks_seen"] == 2 * 256


# ---- bases whose positions do not restart: the check at start-up --------------------------------------------------
def _tiny(kind: str, vocab: int = 257, dtype=torch.float32, **ids):
    """A random 2-layer base of ``kind``, initialised wide (std 0.3) so that what leaks across a packed row shows
    in its outputs at any precision."""
    from transformers import (BloomConfig, BloomForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                              LlamaForCausalLM, OPTConfig, OPTForCausalLM)

    torch.manual_seed(0)
    if kind == "opt":  # learned positions read from the attention mask, offset by 2: restarted positions are ignored
        return OPTForCausalLM(OPTConfig(vocab_size=vocab, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                                        init_std=0.3, **ids)).to(dtype)
    if kind == "bloom":  # ALiBi: distances over the whole row
        return BloomForCausalLM(BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=2, n_head=2,
                                            initializer_range=0.3, **ids)).to(dtype)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2, initializer_range=0.3,
                                            **ids)).to(dtype)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, max_position_embeddings=64, initializer_range=0.3,
                                            **ids)).to(dtype)


LEAKY = {"opt": True, "bloom": True, "llama": False, "neox": False}


def _second_example_losses(model, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Per-token losses of ``second`` packed after ``first`` (positions restarting), as training scores them."""
    ids = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, len(first):-1].float()
    return torch.nn.functional.cross_entropy(logits, second[1:], reduction="none")


@pytest.mark.parametrize("kind", list(LEAKY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packing_check_finds_the_bases_whose_packed_examples_leak(kind, dtype):
    """OPT and BLOOM read a packed row as one sequence: the second example's losses depend on the first example's
    tokens (measured here without the check) and on where it sits; the check says so beyond its tolerance. A Llama
    and a GPT-NeoX keep the examples apart to the last bit."""
    from hf_cgpu.finetune import packing_leak, packing_tolerance

    model = _tiny(kind, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    first, other, second = (torch.randint(0, 257, (n,), generator=g) for n in (6, 6, 10))
    packed = _second_example_losses(model, first, second)
    with torch.no_grad():
        alone = torch.nn.functional.cross_entropy(model(second[None]).logits[0, :-1].float(), second[1:],
                                                  reduction="none")
    crossed = (packed - _second_example_losses(model, other, second)).abs().max().item()
    moved = (packed - alone).abs().max().item()
    leak, tolerance = packing_leak(model), packing_tolerance(model)
    assert tolerance == (1e-4 if dtype == torch.float32 else 0.05)
    if LEAKY[kind]:
        assert crossed > 0.05 and moved > 0.05, (crossed, moved)  # the leak is real
        assert leak > 2 * tolerance, leak
    else:
        assert crossed == 0 and leak == 0, (crossed, leak)
        assert moved < 1e-5 if dtype == torch.float32 else moved < 0.1
    assert model.training is False


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A tiny saved base of each kind with a tokenizer trained on the built-in corpus (a run's --model)."""
    from hf_cgpu.data.corpus import builtin_corpus
    from hf_cgpu.data.tokenizer import train_tokenizer

    tok = train_tokenizer(builtin_corpus()[:20], vocab_size=400, show_progress=False)
    out = {}
    for kind in ("opt", "bloom"):
        d = tmp_path_factory.mktemp(kind)
        _tiny(kind, len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id or tok.eos_token_id).save_pretrained(d)
        tok.save_pretrained(d)
        out[kind] = d
    return out


def _instruction_data(folder):
    import json

    folder.mkdir()
    rows = [{"instruction": f"count to {i % 7}", "output": " ".join(str(k) for k in range(i % 7 + 1))}
            for i in range(40)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _lora_args(base, data, out, *extra):
    return ["train", "lora", "--preset", "lora", "--model", str(base), "--dataset", str(data), "--seq_len", "63",
            "--micro_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "2", "--warmup_steps",
            "1", "--eval_steps", "0", "--eval_batches", "1", "--checkpointing_steps", "0", "--progress", "false",
            "--compile", "false", "--recompute", "false", "--lora_r", "4", "--output_dir", str(out), *extra]


@pytest.mark.parametrize("kind", ["opt", "bloom"])
def test_a_base_that_leaks_trains_one_example_per_row_and_says_why(kind, bases, tmp_path, capsys, monkeypatch):
    """Packing is on by default; on an OPT or BLOOM base the start-up check turns it off in one line naming the
    model type, the run trains one example per row and records packing false; --packing true given on the command
    line is refused instead."""
    import json

    from hf_cgpu.cli import main as cli_main
    from test_data_errors import error_line

    data = _instruction_data(tmp_path / "data")
    out = tmp_path / "run"
    assert cli_main(_lora_args(bases[kind], data, out)) == 0
    printed = capsys.readouterr().out
    note = next(line for line in printed.splitlines() if line.startswith("note: packing off"))
    assert f"this {kind} base does not keep packed examples apart" in note and "one example per row" in note, note
    assert "; one example per row; loss on the responses only" in printed, printed
    results = json.loads((out / "all_results.json").read_text())
    assert results["settings"]["packing"] is False
    line = error_line(_lora_args(bases[kind], data, tmp_path / "forced", "--packing", "true"), capsys, monkeypatch)
    assert line.startswith(f"error: --packing true: in a packed row") and f"this {kind} base" in line, line
    assert line.endswith("pass --packing false (one example per row)"), line


def test_a_base_that_keeps_examples_apart_stays_packed(tiny_base, tmp_path, capsys):
    """The GPT-NeoX base passes the check: packed rows, no note, packing true recorded."""
    import json

    from hf_cgpu.cli import main as cli_main

    data = _instruction_data(tmp_path / "data")
    assert cli_main(_lora_args(tiny_base, data, tmp_path / "run", "--packing", "true")) == 0
    printed = capsys.readouterr().out
    assert "packing off" not in printed and "; packed into " in printed, printed
    assert json.loads((tmp_path / "run" / "all_results.json").read_text())["settings"]["packing"] is True
