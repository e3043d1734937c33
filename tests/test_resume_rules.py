"""The resume fingerprint is the run's meaning, not its paths (issue 10): another tokenizer of the same size and
other data under the same file name are refused; the same data through another path is resumed. In-process runs of
a tiny GPT on a small parquet corpus and of the tiny flow UNet on the synthetic images."""

from __future__ import annotations

import dataclasses
import shutil

import datasets
import pytest
from safetensors.torch import load_file

from hf_cgpu.data.corpus import builtin_corpus
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.errors import CheckpointError
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.tasks.flow_images import FlowMatchingTask, FlowSettings
from hf_cgpu.train import fit

DOCS = builtin_corpus()


def corpus(folder, docs):
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", docs[: len(docs) // 2]), ("validation", docs[len(docs) // 2 :])):
        datasets.Dataset.from_dict({"text": part}).to_parquet(folder / f"{split}.parquet")
    return folder


@pytest.fixture(scope="module")
def gpt_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rules")
    tokenizers = []
    for name, docs in (("tok_a", DOCS[:40]), ("tok_b", DOCS[40:])):  # same vocabulary size, other merges
        tok = train_tokenizer(docs, vocab_size=300, show_progress=False)
        tok.save_pretrained(root / name)
        tokenizers.append(root / name)
    return root, tokenizers, corpus(root / "data", DOCS[:30])


def gpt_fit(out, data, tokenizer, resume=""):
    gpt = GPTSettings(n_layer=1, n_embd=32, n_head=2, seq_len=32, dataset=str(data), tokenizer=str(tokenizer),
                      loss_chunk_size=0)
    train = TrainSettings(output_dir=str(out), max_steps=2, micro_batch_size=2, warmup_steps=1, eval_steps=0,
                          eval_batches=1, checkpointing_steps=1, progress=False, mixed_precision="no",
                          resume_from_checkpoint=resume)
    return fit(CausalLMTask(gpt), train)


def test_another_tokenizer_of_the_same_size_is_refused(gpt_inputs, tmp_path):
    _, (tok_a, tok_b), data = gpt_inputs
    gpt_fit(tmp_path / "run", data, tok_a)
    with pytest.raises(CheckpointError, match=r"different model/data \({'tokenizer': \("):
        gpt_fit(tmp_path / "run", data, tok_b, resume="latest")


def test_other_data_under_the_same_path_is_refused_the_same_data_elsewhere_resumes(gpt_inputs, tmp_path, capsys):
    root, (tok_a, _), data = gpt_inputs
    mine = tmp_path / "data"
    shutil.copytree(data, mine)
    gpt_fit(tmp_path / "run", mine, tok_a)
    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(mine, moved)
    gpt_fit(tmp_path / "run", moved, tok_a, resume="latest")  # same content, another path: resumed
    assert "resumed from" in capsys.readouterr().out
    corpus(mine, DOCS[30:60])  # train.parquet replaced by other text
    with pytest.raises(CheckpointError, match=r"'train_data': \("):
        gpt_fit(tmp_path / "run", mine, tok_a, resume="latest")


def flow_settings(data, out, **kw):
    flow, train = parse_settings((FlowSettings, TrainSettings), ["--preset", "tiny"], family="flow")
    flow = dataclasses.replace(flow, dataset=str(data), limit=64)
    train = dataclasses.replace(train, output_dir=str(out), max_steps=2, checkpointing_steps=1, progress=False,
                                log_steps=1, **kw)
    return flow, train


@pytest.mark.slow
def test_flow_data_by_content_relative_path_resumes_replaced_images_refused(synthetic_data, tmp_path, monkeypatch,
                                                                            capsys):
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature

    from conftest import synthetic_images

    data = tmp_path / "images"
    shutil.copytree(synthetic_data, data)
    full, cut = tmp_path / "full", tmp_path / "cut"
    fit(FlowMatchingTask(flow_settings(data, full)[0]), flow_settings(data, full)[1])
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_0000002")  # as if killed after step 1
    monkeypatch.chdir(tmp_path)  # the same images through a relative path: resumed
    flow, train = flow_settings("images", cut, resume_from_checkpoint="latest")
    fit(FlowMatchingTask(flow), train)
    log = capsys.readouterr().out
    assert "cut/checkpoints/step_0000001 at step 1" in log, log
    a = load_file(str(full / "unet" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(cut / "unet" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    images, labels = synthetic_images(300, seed=7)  # train.parquet replaced by other images of the same shape
    features = Features({"img": ImageFeature(), "label": ClassLabel(names=[f"c{k}" for k in range(10)])})
    Dataset.from_dict({"img": images, "label": labels}, features=features).to_parquet(data / "train.parquet")
    with pytest.raises(CheckpointError, match=r"'train_data': \("):
        fit(FlowMatchingTask(flow), train)


def tiny_fit(out, resume=""):
    """The tiny preset for four steps, a checkpoint every two."""
    gpt, train = parse_settings((GPTSettings, TrainSettings), [
        "--preset", "tiny", "--max_steps", "4", "--checkpointing_steps", "2", "--eval_steps", "0", "--progress",
        "false", "--max_new_tokens", "1", "--output_dir", str(out), "--resume_from_checkpoint", resume], family="gpt")
    return fit(CausalLMTask(gpt), train)


@pytest.mark.slow
def test_a_cpu_run_resumed_with_other_threads_takes_its_own_back(tmp_path, capsys):
    """Resumed by a launcher that picks another thread count (accelerate launch --cpu, --cpu, a plain start), the run
    still repeats the uninterrupted one bit for bit, and says that it set the count."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tiny_fit(tmp_path / "full")
        cut = tmp_path / "cut"
        shutil.copytree(tmp_path / "full", cut)
        shutil.rmtree(cut / "checkpoints" / "step_0000004")
        torch.set_num_threads(1)
        tiny_fit(cut, resume=str(cut / "checkpoints" / "step_0000002"))
        assert "CPU threads: 2, as before the resume (this process started with 1)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)
    full, resumed = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)
