"""`hf-cgpu export DIR --gguf`: a LoRA run over a tiny llama (a byte-level BPE trained here, a ChatML template) written
as GGUF and loaded back by transformers: logits of the merged model within the outtype's rounding, the same token
ids, template and special tokens; other architectures refused in one line. The real SmolLM2-135M round trip (its
`smollm` pre-tokenizer, GQA 9/3) is benchmarks/finetune/bench_gguf_roundtrip.py: transformers takes about a minute
to read its 49k-token vocabulary back from a GGUF on two cores."""

from __future__ import annotations

import pytest
import torch

from hf_cgpu.cli import main as cli_main

pytest.importorskip("gguf", reason="GGUF export needs `pip install gguf`")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "The river runs to the sea, and the sea is never full; 12 rivers, 345 seas!\n  Twice."


def bpe_tokenizer():
    """A byte-level BPE (GPT-2 style) trained on a few lines, with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([TEXT, "Count to five: one two three four five."] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")  # <|im_start|> is special by its token type alone
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(run folder, the adapter model in fp32): a LoRA adapter with non-zero B over a tiny llama whose vocab_size
    exceeds the tokenizer's (unused ids), with GQA (the k rows permuted with the kv heads) and tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_cgpu.finetune import save_adapter
    from hf_cgpu.tiers import apply_lora

    root = tmp_path_factory.mktemp("gguf_export")
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    model = apply_lora(LlamaForCausalLM.from_pretrained(root / "base", dtype=torch.float32), r=4, alpha=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    save_adapter(model, root / "run")
    tok.save_pretrained(root / "run")
    return root / "run", model.eval()


def export(folder, out, *flags) -> str:
    return cli_main(["export", str(folder), "--gguf", "--output", str(out), *flags])


def load_back(path):
    """Model and tokenizer from a folder holding only the file (transformers would read config.json or tokenizer
    files beside it instead of the file's metadata)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))


@pytest.mark.parametrize("outtype,tolerance", [("bf16", 2e-2), ("f16", 2e-3)])
def test_a_lora_run_exports_to_gguf_that_transformers_reads_back(lora_run, tmp_path, capsys, outtype, tolerance):
    """Within the outtype's rounding of the merged model (tolerance relative to the largest logit), the adapter
    visibly applied, and the tokenizer whole: ids, chat template, special tokens."""
    from transformers import AutoTokenizer

    run, adapted = lora_run
    out = tmp_path / "alone" / f"run-{outtype}.gguf"
    assert export(run, out, "--outtype", outtype) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}: 20 tensors, {outtype}, " in said and " MiB" in said
    assert "transformers loads it back in " in said and "tokenizer round-trips, chat template kept" in said
    model, back = load_back(out)
    tok = AutoTokenizer.from_pretrained(run)
    chat = tok.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False, add_generation_prompt=True)
    for text in (TEXT, chat):
        assert back(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
    assert back.chat_template == CHATML and (back.eos_token, back.bos_token) == ("<|im_end|>", "<|endoftext|>")
    ids = tok(chat, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        want, got = adapted(ids).logits, model(ids).logits
        with adapted.disable_adapter():
            plain = adapted(ids).logits
    scale = want.abs().max()
    assert (got - want).abs().max() < tolerance * scale
    assert (plain - want).abs().max() > 10 * tolerance * scale  # the adapter is merged, not dropped


def test_q8_0_is_half_the_size_and_close(lora_run, tmp_path, capsys):
    run, adapted = lora_run
    assert export(run, tmp_path / "bf16" / "m.gguf", "--check", "false") == 0
    assert export(run, tmp_path / "q8" / "m.gguf", "--outtype", "q8_0", "--check", "false") == 0
    assert "check:" not in capsys.readouterr().out
    ratio = (tmp_path / "q8" / "m.gguf").stat().st_size / (tmp_path / "bf16" / "m.gguf").stat().st_size
    assert 0.5 < ratio < 0.6  # 34 bytes per 32 weights against 64
    model, _ = load_back(tmp_path / "q8" / "m.gguf")
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = adapted(ids).logits
        assert (model(ids).logits - want).abs().max() < 0.05 * want.abs().max()


def test_other_architectures_and_tokenizers_are_refused_in_one_line(tiny_base, lora_run, tmp_path, capsys,
                                                                    monkeypatch):
    """A GPTNeoX model names the llama family; a WordPiece tokenizer names byte-level BPE; no --gguf names it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from hf_cgpu.gguf_export import pre_tokenizer_name

    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    assert export(tiny_base, tmp_path / "x.gguf") == 2
    err = capsys.readouterr().err
    assert "is a gpt_neox model; GGUF export writes the llama family only (llama: SmolLM2, Llama 3" in err
    assert not (tmp_path / "x.gguf").exists()
    assert cli_main(["export", str(lora_run[0])]) == 2
    assert "error: hf-cgpu export writes GGUF only: add --gguf" in capsys.readouterr().err
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1})))
    with pytest.raises(ValueError, match="writes byte-level BPE tokenizers .*; this one is WordPiece"):
        pre_tokenizer_name(wordpiece)
    bpe = models.BPE({"a": 0, "<unk>": 1}, [], byte_fallback=True, unk_token="<unk>")
    sentencepiece = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe))
    with pytest.raises(ValueError, match="this one is a SentencePiece-style BPE"):
        pre_tokenizer_name(sentencepiece)


def test_pre_tokenizers_get_llama_cpp_names():
    """GPT-2's byte-level split is `gpt-2`; SmolLM2's (digits one by one, then byte-level) is `smollm`; Llama 3's
    regex split is `llama-bpe`; a split llama.cpp has no name for here is refused."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
    )

    from hf_cgpu.gguf_export import pre_tokenizer_name

    tok = bpe_tokenizer()
    assert pre_tokenizer_name(tok) == "gpt-2"
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert pre_tokenizer_name(tok) == "smollm"
    split = GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(use_regex=False)])
    assert pre_tokenizer_name(tok) == "llama-bpe"
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Digits(individual_digits=False)
    with pytest.raises(ValueError, match="has no llama.cpp name here"):
        pre_tokenizer_name(tok)


def llama_folder(root, **layout):
    """A tiny llama model folder (the byte-level BPE above) with ``layout`` in its config and visible biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, **layout)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)  # as large as the weights' effect: a misplaced bias moves every logit
    model.save_pretrained(root)
    bpe_tokenizer().save_pretrained(root)
    return root, model.eval()


def test_biases_and_a_head_width_apart_from_hidden_over_heads_export_as_llama_cpp_reads_them(tmp_path, capsys):
    """q/k biases permuted with their rows, MLP and output biases kept, heads of width 24 (not 64/4) recorded as
    attention.key_length/value_length: the file loaded back (biases read where present, as llama.cpp reads them)
    gives the model's logits."""
    import gguf

    folder, model = llama_folder(tmp_path / "biased", attention_bias=True, mlp_bias=True, head_dim=24)
    out = tmp_path / "alone" / "biased.gguf"
    assert export(folder, out, "--outtype", "f16") == 0
    assert "tokenizer round-trips" in capsys.readouterr().out
    fields = gguf.GGUFReader(out).fields
    for key in ("llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count"):
        assert fields[key].contents() == 24, key
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=torch.float32,
                                                attention_bias=True, mlp_bias=True).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = model(ids).logits
        assert (back(ids).logits - want).abs().max() < 2e-3 * want.abs().max()


def test_a_read_back_that_differs_exits_2_and_leaves_the_earlier_file(tmp_path, capsys, monkeypatch):
    """An exporter that gets the rotary layout wrong (q/k rows left in transformers' order) is caught by its own
    check: one line, exit 2, no temporary left, and the file an earlier export wrote at that path untouched."""
    from hf_cgpu import gguf_export

    folder, _ = llama_folder(tmp_path / "plain")
    out = tmp_path / "alone" / "plain.gguf"
    assert export(folder, out, "--outtype", "f16") == 0
    before = out.read_bytes()
    capsys.readouterr()
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    monkeypatch.setattr(gguf_export, "_rotary_rows", lambda weight, heads: weight)
    assert export(folder, out, "--outtype", "f16") == 2
    said = capsys.readouterr()
    err = said.err.splitlines(keepends=True)[-1]  # after transformers' progress bars
    assert err.startswith("error: GGUF export: the file read back differs from the model (4 tensors are not "
                          "the model's in f16, e.g. model.layers.0.self_attn.q_proj.weight, ") 
    assert f"{out} not written" in err and "wrote " not in said.out
    assert out.read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == ["plain.gguf"]
    out.unlink()
    assert export(folder, out, "--outtype", "f16") == 2 and not out.parent.joinpath("plain.gguf").exists()
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("layout,said", [
    ({"hidden_act": "gelu"}, "uses the gelu activation; llama.cpp's llama architecture gates its MLP with silu"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "uses linear rope scaling"),
])
def test_llama_layouts_the_file_cannot_hold_are_refused_before_writing(tmp_path, capsys, monkeypatch, layout, said):
    folder, _ = llama_folder(tmp_path / "odd", **layout)
    capsys.readouterr()
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    assert export(folder, tmp_path / "alone" / "odd.gguf") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and err.count("\n") == 1
    assert not (tmp_path / "alone").exists()
