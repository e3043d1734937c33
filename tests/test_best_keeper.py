"""The best weights are kept in host memory at an improvement and written to best/ only before each checkpoint and
at the end: the files are those an immediate ``save_pretrained`` would have written, a checkpoint's keeper state
always names what best/ holds, and a run killed between an improvement and the next checkpoint resumes to the
uninterrupted run's best/ and model."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_faults import (
    KILLED,
    FaultToy,
    assert_same,
    cfg,
    die_when,
    in_child,
    nth_call,
    outcome,
)
from test_text_quality import ScriptedValTask

from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.train import BestKeeper, fit
from hf_cgpu.train.checkpoint import Checkpointer, read_trainer_state

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt() -> CgptForCausalLM:
    torch.manual_seed(0)
    return CgptForCausalLM(CgptConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))


def lora_gpt():
    return get_peft_model(tiny_gpt(), LoraConfig(r=2, target_modules=["qkv", "fc"], init_lora_weights=False))


def files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("make", [tiny_gpt, lora_gpt], ids=["gpt", "lora"])
def test_flushed_files_are_those_the_eager_write_makes_and_the_live_weights_stay(make, tmp_path):
    model = make()
    eager = tmp_path / "eager"
    model.save_pretrained(str(eager))  # what best/ held at the improvement before the copy in memory
    keeper = BestKeeper("loss", tmp_path / "best", write=lambda m, folder: m.save_pretrained(str(folder)))
    assert keeper.observe({"loss": 1.0}, 5, model)
    with torch.no_grad():  # training goes on after the improvement
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    keeper.flush()
    kept = files(tmp_path / "best")
    assert {k: v for k, v in kept.items() if k not in ("best.json", "manifest.json")} == files(eager)
    assert json.loads(kept["best.json"])["step"] == 5 and keeper.check_folder() is None
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    if make is lora_gpt:  # only the adapter is held: the frozen base never changes
        assert keeper.held.tensors and all("lora_" in n for n in keeper.held.tensors)


def test_best_is_written_at_each_checkpoint_and_the_end_not_at_each_improvement(tmp_path, monkeypatch):
    out = tmp_path / "run"
    task = ScriptedValTask([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])  # an improvement at every evaluation: steps 2, 4, ..., 12
    writes, checkpoints = [], []
    save_best, save = task.save_best, Checkpointer.save

    def spy_best(model, folder):
        writes.append(folder)
        save_best(model, folder)

    def spy_save(self, step, state, prune_old=True):
        saved = save(self, step, state, prune_old)
        held = json.loads((out / "best" / "best.json").read_text())["step"]
        checkpoints.append((step, held, self.keeper.step))
        return saved

    task.save_best = spy_best
    monkeypatch.setattr(Checkpointer, "save", spy_save)
    r = fit(task, cfg(out, eval_steps=2, ema_decay=0.0, checkpoints_total_limit=5))
    assert r["best_step"] == 12 and task.evals == 6
    # best/ holds at every checkpoint what the checkpoint's keeper state names
    assert checkpoints == [(4, 4, 4), (8, 8, 8), (12, 10, 10)]
    assert all(read_trainer_state(c)["best"]["step"] == s for c, (_, s, _) in
               zip(sorted((out / "checkpoints").glob("step_*")), checkpoints))
    assert len(writes) == len(checkpoints) + 1  # the final evaluation's improvement: written at the end
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 12


def test_a_kill_between_an_improvement_and_the_next_checkpoint_resumes_to_the_same_best(tmp_path):
    ref_out = tmp_path / "reference"
    fit(FaultToy(), cfg(ref_out, eval_steps=2))
    ref = outcome(ref_out)
    assert 6 in [s for s, _, v in ref["history"] if v is not None]
    out = tmp_path / "run"

    def child():
        die_when(FaultToy, "loss", nth_call(2 * 7))  # in step 7: evaluated at 6, last checkpoint at 4
        fit(FaultToy(), cfg(out, eval_steps=2))

    assert in_child(child) == KILLED
    held = json.loads((out / "best" / "best.json").read_text())["step"]
    step_4 = next((out / "checkpoints").glob("*step_0000004"))  # its sealing may have been cut off by the kill
    assert held == json.loads((step_4 / "trainer_state.json").read_text())["best"]["step"] <= 4
    fit(FaultToy(), cfg(out, eval_steps=2, resume_from_checkpoint="latest"))
    assert_same(out, ref)
