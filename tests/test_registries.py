"""What every entry of a registry must do, run for each entry, built-in or added (docs/extending.md): every recipe
(task) writes the model card of its kind and resumes bit for bit; every instruction format and every text file format
round-trips rows through the loader. Samplers: tests/test_flow_schedulers.py; optimizers: tests/test_loop.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hf_cgpu.cli import main as cli_main
from hf_cgpu.data.corpus import TEXT_FILE_FORMATS, load_text_dataset
from hf_cgpu.data.instruct import INSTRUCTION_FORMATS, instruction_splits, to_messages
from hf_cgpu.hub.cards import CARDS
from hf_cgpu.recipes import RECIPES
from hf_cgpu.train.checkpoint import list_checkpoints

TINY = {
    "gpt": ["--preset", "tiny", "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--seq_len", "32",
            "--vocab_size", "300", "--micro_batch_size", "2", "--eval_batches", "1", "--prompts", "a",
            "--max_new_tokens", "2"],
    "flow": ["--preset", "tiny", "--dataset", "{images}", "--limit", "32", "--base_channels", "8",
             "--micro_batch_size", "4", "--sample_steps", "1"],
    "flow-distill": ["--preset", "tiny", "--teacher", "{teacher}", "--dataset", "{images}", "--limit", "32",
                     "--micro_batch_size", "4"],
    "lora": ["--model", "{base}", "--dataset", "{instructions}", "--seq_len", "64", "--micro_batch_size", "2",
             "--gradient_accumulation_steps", "1", "--eval_batches", "1", "--mixed_precision", "no",
             "--compile", "false", "--recompute", "false"],
    "dpo": ["--model", "{base}", "--require_adapter", "false", "--dataset", "{preferences}", "--seq_len", "63",
            "--micro_batch_size", "2", "--gradient_accumulation_steps", "1", "--mixed_precision", "no",
            "--compile", "false", "--recompute", "false"],
    "classifier": ["--preset", "tiny", "--dataset", "{images}", "--limit", "32", "--test_limit", "16",
                   "--widths", "4,8,8,8", "--micro_batch_size", "4"],
    "flow2d": ["--preset", "toy", "--micro_batch_size", "64", "--num_samples", "64", "--nfe_budgets", "2"],
}
"""A run of a few seconds of each recipe, on the inputs of ``inputs``: a recipe added to RECIPES needs a row here."""
STEPS = ["--max_steps", "4", "--checkpointing_steps", "2", "--eval_steps", "0", "--warmup_steps", "1",
         "--log_steps", "1", "--progress", "false"]


@pytest.fixture(scope="module")
def inputs(synthetic_data, tiny_base, tmp_path_factory):
    """What the tiny runs read: images, a teacher pipeline, a base model, instruction rows, preference pairs."""
    root = tmp_path_factory.mktemp("inputs")
    rows = [{"instruction": f"repeat the word: {w}", "output": w} for w in ["red", "green", "blue", "gold"] * 4]
    (root / "instructions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [{"prompt": f"repeat the word: {w}", "chosen": w, "rejected": w[::-1]}
             for w in ["red", "green", "gold"] * 5]
    (root / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    assert cli_main(["train", "flow", *[a.format(images=synthetic_data) for a in TINY["flow"]], "--max_steps", "1",
                     "--checkpointing_steps", "0", "--progress", "false", "--output_dir", str(root / "teacher")]) == 0
    return {"images": synthetic_data, "teacher": root / "teacher", "base": tiny_base,
            "instructions": root / "instructions.jsonl", "preferences": root / "preferences.jsonl"}


def weights(folder) -> dict[str, dict[str, torch.Tensor]]:
    """Every safetensors file the run saved for users (not its checkpoints), by path."""
    return {p.relative_to(folder).as_posix(): load_file(str(p)) for p in sorted(folder.rglob("*.safetensors"))
            if "checkpoints" not in p.relative_to(folder).parts}


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_writes_its_card_and_resumes_bit_for_bit(name, inputs, tmp_path, capsys):
    assert name in TINY, f"recipe {name!r} has no tiny run: add its arguments to TINY"
    argv = ["train", name, *[a.format(**inputs) for a in TINY[name]], *STEPS]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert cli_main([*argv, "--output_dir", str(full)]) == 0
    saved = weights(full)
    assert saved, f"{name} saved no weights"

    kind = json.loads((full / "all_results.json").read_text()).get("card")  # what the task names for this run
    declared = RECIPES[name].task_class().card
    assert kind == declared or not isinstance(declared, (str, type(None))), (kind, declared)  # or a property
    assert (full / "README.md").is_file() == (kind is not None)
    if kind is not None:
        spec, card = CARDS[kind], (full / "README.md").read_text()
        assert f"library_name: {spec.library_name}" in card and f"pipeline_tag: {spec.pipeline_tag}" in card, card

    shutil.copytree(full, cut)  # as if the run had died after its step-2 checkpoint
    for later in list_checkpoints(cut)[1:]:
        shutil.rmtree(later)
    for made in ("all_results.json", "history.json", "README.md", *saved):
        (cut / made).unlink(missing_ok=True)
    capsys.readouterr()
    assert cli_main([*argv, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"]) == 0
    assert "resumed from" in capsys.readouterr().out
    losses = [{h["step"]: h["train/loss"] for h in json.loads((d / "history.json").read_text()) if "train/loss" in h}
              for d in (full, cut)]
    assert losses[0] == losses[1] and sorted(losses[1]) == [1, 2, 3, 4]
    again = weights(cut)
    assert again.keys() == saved.keys()
    for path, tensors in saved.items():
        assert all(torch.equal(tensors[k], again[path][k]) for k in tensors), path
    assert (cut / "README.md").is_file() == (kind is not None)


@pytest.mark.parametrize("name", list(INSTRUCTION_FORMATS))
def test_every_instruction_format_round_trips_its_rows(name, tmp_path):
    """Rows with the format's columns, each a distinct text, written as JSON lines, load as that format and every
    text reaches the chat made of each row, the assistant's answer last."""
    columns = sorted(INSTRUCTION_FORMATS[name].columns)

    def row(i):
        if columns == ["messages"]:
            return {"messages": [{"role": "user", "content": f"question {i}"},
                                 {"role": "assistant", "content": f"answer {i}"}]}
        return {c: f"{c} {i}" for c in columns}

    for split, ids in (("train", range(3)), ("validation", range(3, 5))):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row(i)) + "\n" for i in ids))
    splits, fmt = instruction_splits(str(tmp_path))
    assert fmt == name
    for split, ids in (("train", range(3)), ("validation", range(3, 5))):
        assert len(splits[split]) == len(ids)
        for i, loaded in zip(ids, splits[split]):
            chat = to_messages(loaded, fmt)
            assert chat == to_messages(row(i), fmt)  # what the file and the loader gave back is the row written
            said = [m["content"] for m in chat]
            texts = [m["content"] for m in row(i)["messages"]] if columns == ["messages"] else row(i).values()
            assert all(any(t in s for s in said) for t in texts) and chat[-1]["role"] == "assistant", (row(i), chat)


WRITERS = {
    "text": lambda texts, path: path.write_text("\n\n".join(texts), encoding="utf-8"),  # a final newline would stay
    # in the last paragraph (datasets' paragraph sampling)
    "json": lambda texts, path: path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts)),
    "parquet": lambda texts, path: __import__("datasets").Dataset.from_dict({"text": texts}).to_parquet(path),
}
"""How a test writes texts in the file type each ``datasets`` builder reads; a new builder needs a writer here."""


@pytest.mark.parametrize("extension", list(TEXT_FILE_FORMATS))
def test_every_text_file_format_round_trips_its_texts(extension, tmp_path):
    builder = TEXT_FILE_FORMATS[extension]
    assert builder in WRITERS, f"{extension}: no writer for the {builder!r} builder in WRITERS: add one"
    texts = [f"paragraph {i}: the quick brown fox,\nits second line, café {i}" for i in range(6)]
    WRITERS[builder](texts, tmp_path / f"train{extension}")
    WRITERS[builder](texts[:2], tmp_path / f"validation{extension}")
    data = load_text_dataset(str(tmp_path), carve=False)
    assert data["train"]["text"] == texts and data["validation"]["text"] == texts[:2]
