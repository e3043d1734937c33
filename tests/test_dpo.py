"""`hf-cgpu train dpo`: preference pairs in TRL's formats, the SFT adapter continued and left untouched, its reference
log-probabilities computed once and never drifting, the loss against its closed form, packed pairs scoring as padded
ones, exact resume, GGUF export of the result, and bad input refused in one line naming file, row and field."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from contextlib import nullcontext
from types import SimpleNamespace

import datasets
import pytest
import torch
from test_data_errors import error_line, write_jsonl
from test_instruct import CHAT, byte_tok

from hf_cgpu.cli import main as cli_main
from hf_cgpu.data.instruct import IGNORE
from hf_cgpu.data.preference import build_pair_rows, encode_pair, to_pair
from hf_cgpu.tasks.dpo import DPOTask, dpo_loss
from hf_cgpu.tasks.settings import DPOSettings

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------- the loss
def test_the_loss_is_its_closed_form_and_log_2_where_policy_is_reference():
    policy = torch.tensor([[-10.0, -12.0], [-7.5, -3.0], [-20.0, -20.5]])
    reference = torch.tensor([[-11.0, -11.0], [-7.0, -4.0], [-20.0, -20.0]])
    beta = 0.5
    loss, rewards = dpo_loss(policy, reference, beta)
    margins = [beta * ((pc - rc) - (pr - rr)) for (pc, pr), (rc, rr) in zip(policy.tolist(), reference.tolist())]
    assert margins == pytest.approx([1.0, -0.75, 0.25])
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / 3, rel=1e-6)
    torch.testing.assert_close(rewards, torch.tensor([[0.5, -0.5], [-0.25, 0.5], [0.0, -0.25]]))
    same, zero = dpo_loss(policy, policy.clone(), beta)
    assert same.item() == pytest.approx(math.log(2), abs=1e-7) and not zero.any()


# ---------------------------------------------------------------------------------------------------- rows
PAIRS = [{"prompt": "hi", "chosen": "hello", "rejected": "go away"},
         {"prompt": "what is two plus two", "chosen": "four", "rejected": "five"},
         {"prompt": "x", "chosen": "a story about cats", "rejected": "no"},
         {"prompt": [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "red"},
                     {"role": "user", "content": "another"}],
          "chosen": [{"role": "assistant", "content": "blue"}], "rejected": [{"role": "assistant", "content": "7"}]}]


def _plain(row):
    return {k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()}


def test_only_each_answer_is_scored_not_the_prompt_nor_its_assistant_turns():
    tok = byte_tok(CHAT)
    for row in PAIRS:
        enc = encode_pair(to_pair(row), tok)
        for (ids, flags), side in ((enc.chosen, "chosen"), (enc.rejected, "rejected")):
            answer = row[side] if isinstance(row[side], str) else row[side][0]["content"]
            assert tok.decode([i for i, f in zip(ids, flags) if f]) == f"{answer}<|end|>"


def _tiny_llama(vocab: int = 257):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=256)).eval()


def _task(beta: float = 0.1) -> DPOTask:
    task = DPOTask(DPOSettings(dataset="x", beta=beta, loss_chunk_size=7))  # chunks that cut rows and answers
    task.accelerator = SimpleNamespace(autocast=nullcontext)
    return task


def test_packed_pairs_score_each_answer_as_the_model_scores_it_alone():
    """Each pair's summed answer log-probabilities, packed several pairs a row or padded two rows a pair, equal the
    model's own log-softmax over the answer tokens of prompt + answer alone."""
    tok, model, task = byte_tok(CHAT), _tiny_llama(), _task()
    pairs = [*PAIRS[:3], {"prompt": "a", "chosen": "b", "rejected": "c"},
             {"prompt": "yo", "chosen": "ok", "rejected": "no"}]
    ds = datasets.Dataset.from_list([_plain(r) for r in pairs])
    padded, packed = build_pair_rows(ds, tok, 80), build_pair_rows(ds, tok, 80, packing=True)
    assert padded.rows_per_unit == 2 and len(padded) == 5 and padded.ids.shape == (10, 81) and not padded.n_truncated
    assert packed.rows_per_unit == 1 and len(packed) < 5 and packed.n_pairs == 5 and packed.ids.shape[1] == 162
    alone = []
    for row in pairs:
        enc = encode_pair(to_pair(row), tok)
        sums = []
        for ids, flags in (enc.chosen, enc.rejected):
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
            picked = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            sums.append(float(picked[torch.tensor(flags[1:])].sum()))
        alone.append(sums)
    got_padded = task.pair_logprobs_of(model, padded, 2)
    torch.testing.assert_close(got_padded, torch.tensor(alone), atol=1e-4, rtol=0)
    got_packed = task.pair_logprobs_of(model, packed, 2)
    order = torch.cat([torch.tensor(m) for m in _bins(packed, tok, ds)])  # the pairs in their packed order
    torch.testing.assert_close(got_packed, torch.tensor(alone)[order], atol=1e-4, rtol=0)
    # without the restarting positions, the second pair of a row reads the first: its figures move
    no_positions = dict(packed.batch(torch.arange(len(packed))))
    no_positions.pop("position_ids")
    with torch.no_grad():
        moved = task.pair_logprobs(model, no_positions)
    assert not torch.allclose(moved, got_packed, atol=1e-2)


def _bins(rows, tok, ds):
    from hf_cgpu.data.bins import best_fit_decreasing

    lengths = [sum(len(ids) for ids, _ in (e.chosen, e.rejected)) for e in (encode_pair(to_pair(r), tok) for r in ds)]
    return best_fit_decreasing(lengths, 162)


def test_a_batch_numbers_its_answers_and_finds_their_reference():
    tok = byte_tok(CHAT)
    ds = datasets.Dataset.from_list([_plain(r) for r in PAIRS[:3]])
    rows = build_pair_rows(ds, tok, 80)
    batch = rows.batch(torch.tensor([2, 0]))
    assert batch["pair_index"].tolist() == [2, 0]
    assert batch["input_ids"].shape == (4, 81)
    for r, seg in enumerate((0, 1, 2, 3)):  # pair 2 chosen, rejected; pair 0 chosen, rejected
        scored = batch["segments"][r][batch["targets"][r] != IGNORE]
        assert scored.numel() > 0 and (scored == seg).all()
        assert (batch["segments"][r][batch["targets"][r] == IGNORE] == -1).all()


# ---------------------------------------------------------------------------------------------------- whole runs
@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """(base folder, SFT adapter folder, preference file): a tiny Llama with a ChatML byte-level BPE, an SFT adapter
    of `hf-cgpu train lora` on counting instructions, and preference rows (the right count chosen)."""
    from test_gguf_export import bpe_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("dpo")
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 bos_token_id=0, eos_token_id=2)).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    write_jsonl(root / "sft.jsonl", [{"instruction": f"count to {i % 5}",
                                      "output": " ".join(map(str, range(i % 5 + 1)))} for i in range(40)])
    assert cli_main(["train", "lora", "--model", str(root / "base"), "--dataset", str(root / "sft.jsonl"),
                     "--seq_len", "48", "--micro_batch_size", "4", "--gradient_accumulation_steps", "1",
                     "--max_steps", "3", "--warmup_steps", "1", "--eval_steps", "0", "--checkpointing_steps", "0",
                     "--learning_rate", "1e-2", "--progress", "false", "--compile", "false", "--lora_r", "4",
                     "--output_dir", str(root / "sft")]) == 0
    write_jsonl(root / "prefs.jsonl", preference_rows())
    return root / "base", root / "sft", root / "prefs.jsonl"


def preference_rows(n: int = 48, bad: dict | None = None) -> list[dict]:
    rows = [{"prompt": f"count to {i % 5}", "chosen": " ".join(map(str, range(i % 5 + 1))),
             "rejected": " ".join(map(str, range(i % 5 + 1)))[::-1] + " twelve"} for i in range(n)]
    for i, row in (bad or {}).items():
        rows[i] = row
    return rows


def dpo_args(base, adapter, data, out, *extra) -> list[str]:
    return ["train", "dpo", "--model", str(base), *(["--adapter", str(adapter)] if adapter else []),
            "--dataset", str(data), "--seq_len", "40", "--micro_batch_size", "4", "--gradient_accumulation_steps", "1",
            "--max_steps", "6", "--warmup_steps", "1", "--eval_steps", "3", "--checkpointing_steps", "3",
            "--learning_rate", "2e-2", "--log_steps", "1", "--progress", "false", "--compile", "false",
            "--output_dir", str(out), *extra]


def file_hashes(folder) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_dpo_continues_the_sft_adapter_leaves_it_untouched_and_keeps_its_reference(sft, tmp_path):
    """The reference is the SFT adapter as it was (not the adapter being trained): step 0 scores log 2 and zero
    rewards, training moves the held-out rewards apart, the reference equals a fresh pass of the SFT adapter and not
    the trained one; the SFT folder's files keep their hashes; the result is an adapter folder with the same LoRA
    shape, a card with the reward figures, and exports to GGUF."""
    from hf_cgpu.finetune import load_adapter
    from hf_cgpu.recipes import RECIPES, parse
    from hf_cgpu.tiers import load_base_model
    from hf_cgpu.train import fit

    base, adapter, data = sft
    before = file_hashes(adapter)
    out = tmp_path / "dpo"
    cfg, train = parse(RECIPES["dpo"], dpo_args(base, adapter, data, out)[2:])
    task = DPOTask(cfg)
    results = fit(task, train)
    assert file_hashes(adapter) == before
    assert results["base_val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert results["base_val_reward_margin"] == 0 and results["base_val_reward_accuracy"] == 0
    assert results["val_reward_margin"] > 0.05 and results["val_reward_accuracy"] >= 0.75
    history = [h["train/loss"] for h in json.loads((out / "history.json").read_text()) if "train/loss" in h]
    # the first step's loss is log 2 (policy = reference); later ones move off it, against the fixed reference
    assert len(history) == 6 and history[0] == pytest.approx(math.log(2), abs=1e-6), history
    assert all(abs(loss - math.log(2)) > 1e-3 for loss in history[1:]) and history[-1] < math.log(2) - 0.02, history

    def fresh(folder):
        model = load_adapter(load_base_model(str(base), "lora", device=torch.device("cpu")), folder)
        return task.pair_logprobs_of(model, task.val_rows, train.micro_batch_size)

    assert torch.equal(task.reference["validation"], fresh(adapter))
    assert not torch.allclose(task.reference["validation"], fresh(out), atol=1e-3)
    sft_config, dpo_config = (json.loads((f / "adapter_config.json").read_text()) for f in (adapter, out))
    # peft writes target_modules from a set: their order follows the process's string hashing, not the adapter
    assert (dpo_config["r"], set(dpo_config["target_modules"])) == (sft_config["r"], set(sft_config["target_modules"]))
    card = (out / "README.md").read_text()
    assert "val_reward_accuracy" in card and "val_reward_margin" in card
    saved = json.loads((out / "all_results.json").read_text())
    assert saved["val_reward_accuracy"] == results["val_reward_accuracy"]
    pytest.importorskip("gguf")
    assert cli_main(["export", str(out), "--gguf", "--outtype", "f16", "--output", str(tmp_path / "dpo.gguf")]) == 0
    assert (tmp_path / "dpo.gguf").stat().st_size > 0


def test_a_resumed_dpo_run_is_bit_identical_and_refuses_another_reference(sft, tmp_path, capsys):
    """Resumed at step 3 it reproduces the uninterrupted adapter bit for bit (the reference is recomputed from the
    SFT adapter, not from the checkpoint's); an SFT adapter whose weights changed since is another reference, and the
    resume is refused in one line."""
    from safetensors.torch import load_file, save_file

    base, sft_adapter, data = sft
    adapter = tmp_path / "sft"
    shutil.copytree(sft_adapter, adapter)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert cli_main(dpo_args(base, adapter, data, full)) == 0
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_0000003", cut / "checkpoints" / "step_0000003")
    assert cli_main(dpo_args(base, adapter, data, cut, "--resume_from_checkpoint", "latest")) == 0
    a, b = load_file(full / "adapter_model.safetensors"), load_file(cut / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v * 1.5 for k, v in weights.items()}, adapter / "adapter_model.safetensors")
    capsys.readouterr()
    assert cli_main(dpo_args(base, adapter, data, cut, "--resume_from_checkpoint", "latest", "--max_steps", "7")) == 2
    assert "reference_adapter" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad,expected", [
    ({"prompt": "count to 3", "chosen": "0 1 2 3"}, "line 4: 'rejected' is null (or missing)"),
    ({"prompt": "count to 3", "rejected": "3 2 1 0"}, "line 4: 'chosen' is null (or missing)"),
    ({"prompt": "count to 3", "chosen": "0 1 2 3", "rejected": "0 1 2 3"},
     "line 4: 'rejected' is the same as 'chosen'"),
    ({"prompt": "count " * 60, "chosen": "0", "rejected": "1"}, "line 4: 'prompt' fills the 41 tokens of a row"),
])
def test_bad_pairs_are_refused_naming_file_row_and_field(sft, tmp_path, capsys, monkeypatch, bad, expected):
    base, adapter, _ = sft
    data = tmp_path / "prefs.jsonl"
    write_jsonl(data, preference_rows(bad={3: bad}))
    out = tmp_path / "out"
    line = error_line(dpo_args(base, adapter, data, out), capsys, monkeypatch)
    assert f"row 3 of {data}, {expected}" in line, line
    assert not out.exists()


def test_an_adapter_of_another_base_and_a_missing_adapter_are_refused(sft, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    base, adapter, data = sft
    other = tmp_path / "other_base"
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(base).config)
    model.save_pretrained(other)
    shutil.copy(base / "tokenizer.json", other)
    shutil.copy(base / "tokenizer_config.json", other)
    out = tmp_path / "out"
    line = error_line(dpo_args(other, adapter, data, out), capsys, monkeypatch)
    assert f"{adapter / 'base_model.json'}: field base_digest records another base" in line, line
    assert not out.exists()
    line = error_line(dpo_args(base, None, data, out), capsys, monkeypatch)
    assert "--adapter is empty" in line and "--require_adapter false" in line
    assert not out.exists()
    line = error_line(dpo_args(base, adapter, data, adapter / "dpo"), capsys, monkeypatch)
    assert "the SFT adapter is the reference and is only read" in line


# ---------------------------------------------------------------------------------------------------- the ledger
def test_the_ledger_prices_a_pair_as_two_answers_and_names_the_reference_pass():
    from hf_cgpu.budget.memory import ledger
    from hf_cgpu.commands.budget import describe_run, run

    flags = ["--model", "pythia-1.4b", "--micro_batch_size", "2", "--gradient_accumulation_steps", "4"]
    dpo_shape, dpo_train, _ = describe_run([*flags, "--seq_len", "512"], task="dpo")
    lora_shape, lora_train, _ = describe_run([*flags, "--seq_len", "1024"])
    assert dpo_shape.seq_len == 1024 and dpo_shape.packed
    assert (ledger(dpo_shape.model, dpo_shape.setup(dpo_train)).allocated
            == ledger(lora_shape.model, lora_shape.setup(lora_train)).allocated)
    text = run(["--task", "dpo", *flags, "--seq_len", "512"])
    assert "preset lora: DPO continuing an SFT LoRA adapter" in text and "reference pass: about" in text
