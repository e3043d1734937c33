"""recipes/finetune_lora.py end to end on a tiny GPTNeoX saved locally (no downloads): adapter written, reloadable."""

import json
import runpy
import sys

import pytest
from transformers import AutoModelForCausalLM


def run_recipe(args):
    old = sys.argv
    sys.argv = ["finetune_lora.py", *args]
    try:
        runpy.run_path("recipes/finetune_lora.py", run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    finally:
        sys.argv = old


@pytest.mark.parametrize("tier", ["lora", "qlora"])
def test_finetune_writes_reloadable_adapter(tiny_base, tmp_path, tier):
    from peft import PeftModel

    out = tmp_path / tier
    run_recipe(["--preset", tier, "--model", str(tiny_base), "--dataset", "builtin", "--seq_len", "32",
                "--micro_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "6",
                "--warmup_steps", "1", "--eval_steps", "0", "--eval_batches", "2", "--checkpointing_steps", "3",
                "--learning_rate", "1e-2", "--progress", "false", "--output_dir", str(out),
                "--lora_r", "4", "--recompute", "false"])
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    results = json.loads((out / "all_results.json").read_text())
    assert results["steps"] == 6 and results["val_loss"] > 0
    history = json.loads((out / "history.json").read_text())
    first = next(h for h in history if "eval/val_loss" in h)  # the base, evaluated before the first step
    assert first["step"] == 0 and results["base_val_loss"] == first["eval/val_loss"]
    assert results["val_loss"] < results["base_val_loss"], "fine-tuning must lower the held-out loss"
    card = (out / "README.md").read_text()
    assert "base_val_loss" in card and "before fine-tuning" in card
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    model = PeftModel.from_pretrained(base, out).eval()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "training must have moved the adapters off zero"


@pytest.mark.parametrize("tier", ["lora", pytest.param("qlora", marks=pytest.mark.skip(
    reason="bitsandbytes' CPU 4-bit matmul does not trace under dynamo (absmax_offset must be float32); the CUDA "
           "path is what benchmarks/throughput/bench_lora_speed.py measures compiled"))])
def test_compiled_preset_trains_saves_merges_without_recompiles(tiny_base, tmp_path, monkeypatch, capsys, tier):
    """The lora and qlora presets compile each block (on CUDA; here dynamo's aot_eager backend stands in): training with a
    checkpoint, the evaluations, the adapter and the merge work through the compiled blocks with no recompile,
    and the merged weights give the adapter's logits."""
    import torch
    from peft import PeftModel

    torch._dynamo.reset()  # dynamo's cache is per code object: a block compiled by an earlier test would guard-fail
    monkeypatch.setenv("HF_CGPU_COMPILE_ON_CPU", "aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    out = tmp_path / tier
    run_recipe(["--preset", tier, "--model", str(tiny_base), "--dataset", "builtin", "--seq_len", "32",
                "--micro_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "4",
                "--warmup_steps", "1", "--eval_steps", "2", "--eval_batches", "2", "--checkpointing_steps", "2",
                "--learning_rate", "1e-2", "--progress", "false", "--output_dir", str(out), "--lora_r", "4",
                "--merge", "true", "--merge_dtype", "float32"])
    log = capsys.readouterr().out
    results = json.loads((out / "all_results.json").read_text())
    assert results["settings"]["compile"] is True and results["recompiles"] == 0, log
    assert "recompiled" not in log and "compile: skipped" not in log
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    adapted = PeftModel.from_pretrained(base, out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    ids = torch.randint(0, base.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_with_compiled_blocks_takes_the_policy_without_recompiles(tiny_base, tmp_path, monkeypatch, capsys,
                                                                           policy):
    """--recompute_policy reaches the checkpointed blocks (and the ledger's description); compiled blocks with their
    checkpoint traced inside run without a recompile."""
    import torch

    import hf_cgpu.tiers as tiers

    torch._dynamo.reset()
    monkeypatch.setenv("HF_CGPU_COMPILE_ON_CPU", "aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    asked = []
    original = tiers.apply_recompute
    monkeypatch.setattr(tiers, "apply_recompute", lambda model, policy="full": asked.append(policy) or original(
        model, policy))
    run_recipe(["--preset", "lora", "--model", str(tiny_base), "--dataset", "builtin", "--seq_len", "32",
                "--micro_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "2",
                "--warmup_steps", "1", "--eval_steps", "0", "--eval_batches", "1", "--checkpointing_steps", "0",
                "--progress", "false", "--output_dir", str(tmp_path / "run"), "--lora_r", "4", "--recompute", "true",
                "--recompute_policy", policy])
    log = capsys.readouterr().out
    assert asked == [policy]
    assert json.loads((tmp_path / "run" / "all_results.json").read_text())["recompiles"] == 0, log


@pytest.mark.parametrize("tier", ["lora", "qlora"])
def test_adapter_checkpoints_hold_the_adapter_only_resume_exactly_and_check_the_base(tiny_base, tmp_path, capsys,
                                                                                     monkeypatch, tier):
    """A LoRA run's checkpoints store its trainable tensors only (the frozen base comes from --model again); resuming
    from one reproduces the uninterrupted run's adapter bit for bit, and a base with the same config but other weights
    is refused in one line (exit 2) instead of being trained on. (QLoRA resume failed before: the full state dict's
    4-bit quant-state keys did not load back.)"""
    import shutil

    if tier == "qlora":  # on AVX512-BF16 CPUs bitsandbytes repacks 4-bit weights at the first no-grad eval forward (the
        # base's evaluation at step 0, which a resumed run does not repeat) and computes through another kernel from
        # then on: 4e-4 apart after 6 steps here. CUDA has no such repacking.
        monkeypatch.setattr("bitsandbytes.nn.modules.has_avx512bf16", lambda: False)

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    def args(out, base=tiny_base, *extra):
        return ["--preset", tier, "--model", str(base), "--dataset", "builtin", "--seq_len", "32",
                "--micro_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "6",
                "--warmup_steps", "1", "--eval_steps", "0", "--eval_batches", "1", "--checkpointing_steps", "3",
                "--learning_rate", "1e-2", "--progress", "false", "--output_dir", str(out), "--lora_r", "4",
                "--recompute", "false", *extra]

    full = tmp_path / "full"
    run_recipe(args(full))
    ckpt = full / "checkpoints" / "step_0000003"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert stored and all("lora_" in k for k in stored)  # no frozen base tensor
    base_bytes = sum(p.stat().st_size for p in tiny_base.glob("*.safetensors"))
    assert (ckpt / "model.safetensors").stat().st_size < base_bytes / 4
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["model_weights"] == "trainable" and len(state["frozen_digest"]) == 64

    def resume_from_step_3(out, base=tiny_base):
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt, out / "checkpoints" / ckpt.name)
        run_recipe(args(out, base, "--resume_from_checkpoint", "latest"))

    cut = tmp_path / "cut"
    resume_from_step_3(cut)
    a, b = load_file(full / "adapter_model.safetensors"), load_file(cut / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    other = tmp_path / "other_base"  # the same config and tokenizer, one weight moved
    shutil.copytree(tiny_base, other)
    model = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.gpt_neox.layers[0].mlp.dense_h_to_4h.weight[0, 0] += 0.5
    model.save_pretrained(other)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        old = sys.argv
        sys.argv = ["finetune_lora.py", *args(tmp_path / "wrong", other, "--resume_from_checkpoint", "latest")]
        try:
            (tmp_path / "wrong" / "checkpoints").mkdir(parents=True)
            shutil.copytree(ckpt, tmp_path / "wrong" / "checkpoints" / ckpt.name)
            runpy.run_path("recipes/finetune_lora.py", run_name="__main__")
        finally:
            sys.argv = old
    assert exit_info.value.code == 2
    assert "weights differ from this run's --model" in capsys.readouterr().err
