"""Fault injection on tiny runs (issue 10): kills at many points, a flipped byte in every checkpoint file and in the
final model, NaN in the weights and the EMA, a fresh run in an old folder, two writers, a full or read-only disk
(a fake, and a real tmpfs where a mount namespace is allowed), bad data files.

Every case ends either bit-identical to the uninterrupted reference run (weights, best weights, the whole history,
the results) with ``hf-cgpu verify`` passing on the output folder, or in a one-line refusal that changed nothing.

A kill is ``os._exit`` in a forked child at the planted point: no ``finally``, no ``atexit``, no flush, like SIGKILL.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from contextlib import redirect_stderr
from pathlib import Path

import accelerate
import pytest
import torch

import hf_cgpu.integrity as integrity
import hf_cgpu.train.artifacts as artifacts
import hf_cgpu.train.outdir as outdir
from hf_cgpu.errors import CheckpointError, DataError, IntegrityError, OutputDirError, TrainingStopped, run_main
from hf_cgpu.train import checkpoint as ckpt_io
from hf_cgpu.train import fit
from hf_cgpu.train.ema import EMA
from hf_cgpu.verify import check as verify_check
from hf_cgpu.verify import main as verify_main
from test_loop import ToyTask, settings

KILLED = 86
TESTS = Path(__file__).resolve().parent


class FaultToy(ToyTask):
    """The toy regression with best weights kept (``best/``) by validation loss."""

    best_metric = "val_loss"


def cfg(out, **kw):
    """12 steps, checkpoints every 4 (two kept), evaluation every 4, EMA, a logging window of 3 steps (it straddles
    the checkpoints: its partial sums must travel in them)."""
    base = dict(max_steps=12, checkpointing_steps=4, eval_steps=4, log_steps=3, ema_decay=0.9,
                checkpoints_total_limit=2)
    base.update(kw)
    return settings(out, **base)


# ---------------------------------------------------------------------------------------------------- helpers


pytestmark = pytest.mark.usefixtures("one_thread")


def in_child(fn) -> int:
    """``fn()`` in a forked child (one intra-op thread, inherited: ``one_thread``); its exit code (KILLED when a
    planted kill fired)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def die_when(owner, name, pred=lambda *a, **k: True, after=False, before_dying=None):
    """Patch ``owner.name`` (in a child) so the first call where ``pred(*args)`` holds kills the process, before
    or ``after`` the real call, optionally doing ``before_dying(*args)`` first (a half-written file)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        hit = pred(*args, **kwargs)
        if hit and not after:
            if before_dying:
                before_dying(*args, **kwargs)
            os._exit(KILLED)
        out = original(*args, **kwargs)
        if hit:
            if before_dying:
                before_dying(*args, **kwargs)
            os._exit(KILLED)
        return out

    setattr(owner, name, wrapper)


def nth_call(n):
    count = [0]

    def pred(*args, **kwargs):
        count[0] += 1
        return count[0] == n

    return pred


def half(path) -> None:
    """Cut a file to half its size (a write that was killed)."""
    p = Path(path)
    if p.is_file():
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones too) with its SHA-256."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def outcome(out: Path) -> dict:
    hist = json.loads((out / "history.json").read_text())
    results = json.loads((out / "all_results.json").read_text())
    return {
        "weights": torch.load(out / "toy.pt", weights_only=True),
        "best": torch.load(out / "best" / "toy.pt", weights_only=True),
        "history": [(h["step"], h.get("train/loss"), h.get("eval/val_loss")) for h in hist],
        "results": {k: results.get(k) for k in ("steps", "samples_seen", "train_loss", "val_loss", "best_val_loss",
                                                  "best_step", "skipped_steps", "model_step")},
    }


def assert_same(out: Path, ref: dict) -> None:
    got = outcome(out)
    for part in ("weights", "best"):
        assert got[part].keys() == ref[part].keys()
        for k in ref[part]:
            assert torch.equal(got[part][k], ref[part][k]), (part, k)
    assert got["history"] == ref["history"]
    assert got["results"] == ref["results"]
    assert verify_main([str(out)]) == 0


def resume(out: Path, task=None, **kw):
    return fit(task or FaultToy(), cfg(out, resume_from_checkpoint="latest", **kw))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "reference"
    fit(FaultToy(), cfg(out))
    ref = outcome(out)
    assert ref["results"]["best_step"] in (8, 12) and len(ref["history"]) >= 7
    return out, ref


# ---------------------------------------------------------------------------------------------------- kills


def _in_ckpt(step):
    return lambda *a, **k: f"step_{step:07d}" in str(a[1] if len(a) > 1 else k.get("output_dir", a))


def _ckpt_path_arg(step):
    return lambda *a, **k: any(f"step_{step:07d}" in str(x) for x in a)


KILLS = {
    # during accelerate's save_state of step 8: optimizer.bin half written, nothing sealed
    "save_state": lambda: die_when(accelerate.Accelerator, "save_state", _in_ckpt(8), after=True,
                                   before_dying=lambda self, d, **k: half(Path(d) / "optimizer.bin")),
    "ema_save": lambda: die_when(EMA, "save", _ckpt_path_arg(8), before_dying=lambda self, p: Path(p).write_bytes(b"x")),
    # the background thread hashing step 8's optimizer.bin (os._exit from a thread ends the process, as a kill does)
    "hashing": lambda: die_when(integrity, "sha256_file",
                                lambda p: "step_0000008" in str(p) and str(p).endswith("optimizer.bin")),
    # step 8's manifest written, the folder not yet renamed
    "before_rename": lambda: die_when(ckpt_io, "write_manifest", _ckpt_path_arg(8), after=True),
    # pruning after step 12: step 4 renamed for deletion and half deleted
    "pruning": lambda: die_when(ckpt_io.shutil, "rmtree", lambda p, *a, **k: ".tmp-delete-" in str(p),
                                before_dying=lambda p, *a, **k: next(Path(p).glob("*.bin")).unlink()),
    "evaluation": lambda: die_when(FaultToy, "evaluate", nth_call(2)),
    "best_weights": lambda: die_when(FaultToy, "save_best", nth_call(2), after=True,
                                     before_dying=lambda self, m, folder: half(Path(folder) / "toy.pt")),
    "final_checkpoint": lambda: die_when(accelerate.Accelerator, "save_state", _in_ckpt(12)),
    "final_model": lambda: die_when(FaultToy, "save_pretrained", lambda self, m, d: ".tmp-model" in str(d),
                                    after=True, before_dying=lambda self, m, d: half(Path(d) / "toy.pt")),
    "moving_model_files": lambda: die_when(os, "replace", lambda src, dst: ".tmp-model" in str(src), after=True),
    "before_model_manifest": lambda: die_when(artifacts, "write_manifest", after=False),
    "curves": lambda: die_when(artifacts, "plot_history"),
    "after_everything": lambda: die_when(accelerate.Accelerator, "end_training"),
    "mid_step": lambda: die_when(FaultToy, "loss", nth_call(2 * 10)),
}


@pytest.mark.parametrize("point", list(KILLS))
def test_kill_then_resume_is_bit_identical(point, reference, tmp_path):
    out = tmp_path / "run"

    def child():
        KILLS[point]()
        fit(FaultToy(), cfg(out))

    assert in_child(child) == KILLED, f"the planted kill at {point!r} never fired"
    resume(out)
    assert_same(out, reference[1])


def test_two_kills_in_a_row_then_resume(reference, tmp_path):
    out = tmp_path / "run"

    def first():
        die_when(FaultToy, "loss", nth_call(2 * 6))
        fit(FaultToy(), cfg(out))

    def second():
        die_when(integrity, "sha256_file", lambda p: "step_0000012" in str(p))
        resume(out)

    assert in_child(first) == KILLED and in_child(second) == KILLED
    resume(out)
    assert_same(out, reference[1])


@pytest.mark.parametrize("moved", [1, 3])
def test_a_final_save_cut_off_while_its_files_move_is_finished_by_the_next_run(moved, reference, tmp_path):
    """The new model is sealed in its staging folder before a file moves: a kill after ``moved`` renames leaves the
    folder unsealed (verify says so and how to finish it); the next run there finishes the move and seals exactly the
    uninterrupted run's model, and a moved file that changed since keeps the folder unsealed."""
    out = tmp_path / "run"

    def child():
        count = nth_call(moved)
        die_when(os, "replace", lambda src, dst: ".tmp-model" in str(src) and ".tmp-model" not in str(dst) and count(),
                 after=True)
        fit(FaultToy(), cfg(out))

    assert in_child(child) == KILLED
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    with pytest.raises(IntegrityError, match="cut off while its files moved.*resume it"):
        verify_check(out)
    said = []
    outdir.claim(out, resume="latest", overwrite=False, log=said.append).release()  # how a resume starts
    assert said and said[0].startswith("finished the final save a kill interrupted")
    assert verify_main([str(out)]) == 0 and not (out / artifacts.STAGING).exists()
    assert snapshot(out)["toy.pt"] == snapshot(reference[0])["toy.pt"]
    flip_byte(next(p for p in broken.iterdir() if p.name in ("toy.pt", "all_results.json", "history.json")))
    assert not artifacts.finish_interrupted_save(broken, log=lambda m: None)
    with pytest.raises(IntegrityError, match="unsealed"):
        verify_check(broken)


# ---------------------------------------------------------------------------------------------------- byte flips


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """A run killed as it started its step-12 checkpoint: step_4 and step_8 sealed, nothing final."""
    out = tmp_path_factory.mktemp("cut") / "run"

    def child():
        die_when(ckpt_io, "nonfinite_tensors", nth_call(3))  # the third save, after step 8's seal was waited for
        fit(FaultToy(), cfg(out))

    assert in_child(child) == KILLED
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000004", "step_0000008"]
    return out


CHECKPOINT_FILES = ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "ema.safetensors",
                    "trainer_state.json", "history.json", "manifest.json"]


def test_checkpoint_holds_the_files_the_flips_cover(cut_run):
    names = sorted(p.name for p in (ckpt_io.list_checkpoints(cut_run)[-1]).iterdir())
    assert names == sorted(CHECKPOINT_FILES)


@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_byte_flip_in_a_checkpoint_falls_back_and_ends_identical(name, cut_run, reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(cut_run, out)
    flip_byte(out / "checkpoints" / "step_0000008" / name)
    resume(out)
    log = capsys.readouterr().out
    assert "skipping bad checkpoint: step_0000008:" in log
    assert (f"{name} does not match its checksum" in log) if name != "manifest.json" else ("manifest.json" in log)
    assert "resumed from" in log and "step_0000004 at step 4" in log
    assert (out / "checkpoints" / ".bad-step_0000008").is_dir()  # set aside: pruning cannot prefer it
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000008", "step_0000012"]
    assert_same(out, reference[1])


def test_every_checkpoint_corrupted_refuses_in_one_line_and_changes_nothing(cut_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(cut_run, out)
    for ckpt in ckpt_io.list_checkpoints(out):
        flip_byte(ckpt / "model.safetensors")
    before = snapshot(out)
    with pytest.raises(IntegrityError) as err:
        resume(out)
    assert "no checkpoint in" in str(err.value) and "\n" not in str(err.value)
    assert snapshot(out) == before


@pytest.mark.parametrize("name", ["toy.pt", "all_results.json", "history.json", "training_curves.png"])
def test_byte_flip_in_the_final_model_is_found_by_verify(name, reference, tmp_path, capsys):
    from hf_cgpu.cli import main as cli

    out = tmp_path / "model"
    shutil.copytree(reference[0], out)
    assert cli(["verify", str(out)]) == 0
    flip_byte(out / name)
    capsys.readouterr()
    assert cli(["verify", str(out)]) == 2
    cap = capsys.readouterr()
    assert f"BAD  {out}: {out}: {name} does not match its checksum" in cap.out
    assert cap.err.startswith("error: 1 of 4 folders failed verification") and cap.err.count("\n") == 1


def test_verify_reports_best_and_checkpoints_and_sizes_only(reference, tmp_path, capsys):
    out = tmp_path / "model"
    shutil.copytree(reference[0], out)
    flip_byte(out / "best" / "toy.pt")
    assert verify_main([str(out), "--sizes_only"]) == 0  # same size: only the checksum can tell
    with pytest.raises(IntegrityError, match="best: toy.pt does not match"):
        verify_main([str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[-4:]] == ["ok", "BAD", "ok", "ok"]  # model, best, step_8, step_12
    with pytest.raises(IntegrityError, match="nothing to verify"):
        verify_main([str(tmp_path)])


# ---------------------------------------------------------------------------------------------------- NaN


class NaNWeightAt(FaultToy):
    """Writes a NaN into a weight during step 6 (a silent overflow); every later loss is NaN."""

    def loss(self, model, batch, generator):
        if self.calls == 2 * 6:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        return super().loss(model, batch, generator)


def test_nan_weights_are_never_sealed_and_the_finite_checkpoint_survives(reference, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="nothing was checkpointed; the newest finite checkpoint is step_0000004"):
        fit(NaNWeightAt(), cfg(out, nan_patience=3, checkpoints_total_limit=1))
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000004"]  # kept despite checkpoints_total_limit 1
    ckpt_io.verify(ckpt_io.list_checkpoints(out)[0])
    resume(out)  # the fault was transient: the resumed run is the reference run
    assert_same(out, reference[1])


def test_nan_in_the_ema_stops_at_the_checkpoint_without_sealing_it(tmp_path, monkeypatch):
    real = EMA.update

    def update(self, step):
        real(self, step)
        if step == 5:  # an overflow in the average only: losses stay finite, the step-8 checkpoint must not seal
            next(iter(self.shadow.values())).view(-1)[0] = float("inf")

    monkeypatch.setattr(EMA, "update", update)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match=r"weights or optimizer state are no longer finite.*newest finite "
                                              r"checkpoint is step_0000004"):
        fit(FaultToy(), cfg(out, checkpoints_total_limit=1))
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000004"]


def test_divergence_stop_keeps_the_checkpoints_from_before_it(tmp_path, skip_on):
    """--learning_rate 1e6: the stop checkpoints its (finite) last state but prunes nothing, however often the
    run is resumed, so the checkpoints from before the divergence stay."""
    out = tmp_path / "run"
    for resume_from in ("", "latest", "latest"):
        with pytest.raises(TrainingStopped, match="Earlier checkpoints, kept"):
            fit(FaultToy(), cfg(out, learning_rate=1e6, checkpointing_steps=2, checkpoints_total_limit=1,
                                nan_patience=3, resume_from_checkpoint=resume_from))
    names = [p.name for p in ckpt_io.list_checkpoints(out)]
    assert names[0] == "step_0000002" and len(names) == 4
    for ckpt in ckpt_io.list_checkpoints(out):
        ckpt_io.verify(ckpt)
        assert all(torch.isfinite(t).all() for t in torch.load(ckpt / "optimizer.bin")["state"][0].values()
                   if torch.is_tensor(t))


# ---------------------------------------------------------------------------------------------------- ownership


def test_fresh_run_in_an_old_folder_refuses_in_one_line_and_changes_nothing(reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    before = snapshot(out)
    task = FaultToy()
    assert run_main(lambda argv: fit(task, cfg(out, seed=1)), []) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 2 checkpoint(s) of an earlier run (newest step_0000012)" in err
    assert "--resume_from_checkpoint latest" in err and "--overwrite_output_dir true" in err
    assert snapshot(out) == before and task.calls == 0


def test_overwrite_output_dir_starts_clean(reference, tmp_path):
    out = tmp_path / "run"
    fit(FaultToy(), cfg(out, checkpointing_steps=3, seed=1))  # an older run, other checkpoint steps
    (out / "notes.txt").write_text("mine")
    fit(FaultToy(), cfg(out, overwrite_output_dir=True))
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000008", "step_0000012"]
    assert (out / "notes.txt").read_text() == "mine"  # what hf_cgpu did not write is left alone
    assert_same(out, reference[1])


def test_resume_latest_into_a_finished_folder_without_checkpoints_refuses(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(OutputDirError, match="no checkpoint to resume"):
        resume(out)


def test_second_writer_is_refused_while_the_first_runs_on_untouched(reference, tmp_path):
    out = tmp_path / "run"
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()

    class Paused(FaultToy):
        def loss(self, model, batch, generator):
            if self.calls == 2 * 5:  # step 5: tell the parent, wait for it
                os.write(ready_w, b"1")
                os.read(go_r, 1)
            return super().loss(model, batch, generator)

    pid = os.fork()
    if pid == 0:
        try:
            fit(Paused(), cfg(out))
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    try:
        assert os.read(ready_r, 1) == b"1"
        while not (out / "checkpoints" / "step_0000004").is_dir():  # its step-4 seal finishes in the background
            time.sleep(0.01)
        before = snapshot(out)
        for second in (cfg(out, overwrite_output_dir=True), cfg(out, resume_from_checkpoint="latest")):
            with pytest.raises(OutputDirError, match="another run is writing to") as err:
                fit(FaultToy(), second)
            assert "\n" not in str(err.value)
        assert snapshot(out) == before
    finally:
        os.write(go_w, b"1")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert_same(out, reference[1])


def test_the_lock_is_an_flock_the_kernel_drops_with_its_process(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from filelock import FileLock
        lock = FileLock({str(out / outdir.LOCK_NAME)!r}, timeout=0)
        lock.acquire()
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirError, match="another run is writing"):
            fit(FaultToy(), cfg(out))
    finally:
        holder.kill()  # SIGKILL: no release ran
        holder.wait()
    fit(FaultToy(), cfg(out, max_steps=2, eval_steps=0))


# ---------------------------------------------------------------------------------------------------- disks


def test_no_room_for_two_checkpoints_refuses_before_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    task = FaultToy()
    with pytest.raises(OutputDirError, match=r"has 0.00 MB free, but this run needs about .* \(2 checkpoints"):
        fit(task, cfg(tmp_path / "run"))
    assert task.calls == 0


def test_checkpoint_write_failing_on_a_full_disk_is_one_line_and_resumable(reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = accelerate.Accelerator.save_state

    def full_at_step_8(self, output_dir=None, **kw):
        if "step_0000008" in str(output_dir):
            real(self, output_dir, **kw)  # most of it written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, output_dir, **kw)

    monkeypatch.setattr(accelerate.Accelerator, "save_state", full_at_step_8)
    with pytest.raises(CheckpointError) as err:
        fit(FaultToy(), cfg(out))
    msg = str(err.value)
    assert msg.startswith("writing checkpoint step_0000008 failed (No space left on device)") and "\n" not in msg
    assert "checkpoint step_0000004 is intact" in msg
    assert not list((out / "checkpoints").glob(".tmp-*"))
    monkeypatch.undo()
    resume(out)
    assert_same(out, reference[1])


def test_best_weights_failing_on_a_full_disk_is_one_line_and_resumable(reference, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def full(self, model, folder):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "toy.pt"))

    monkeypatch.setattr(FaultToy, "save_best", full)
    with pytest.raises(OutputDirError, match=r"failed \(No space left on device: .*toy.pt\); no checkpoint was sealed"):
        fit(FaultToy(), cfg(out))
    monkeypatch.undo()
    resume(out)
    assert_same(out, reference[1])


DISK_SIZES = ("64k", "96k", "112k", "128k", "160k")
"""tmpfs sizes: a toy checkpoint is ~25 KB in 8 files, so these fill up at different points of the run (best
weights, a checkpoint's files, its seal, the final save)."""

DISK_SCRIPT = r"""
import io, json, sys
from contextlib import redirect_stderr
sys.path.insert(0, {tests!r})
from hf_cgpu.errors import run_main
from hf_cgpu.train import fit
from test_faults import FaultToy, cfg
report = {{}}
for name in {names!r}:
    task, err = FaultToy(), io.StringIO()
    with redirect_stderr(err):
        code = run_main(lambda argv: fit(task, cfg({mnt!r} + "/" + name + "/run")), [])
    report[name] = {{"code": code, "err": err.getvalue(), "calls": task.calls}}
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
def test_real_small_and_read_only_disks(reference, tmp_path):
    """Small tmpfs disks and a read-only one, in a private mount namespace: each run ends in one line and exit 2
    (or, on a disk big enough, finishes); each resumes elsewhere (more room) to the reference run; the read-only
    one spent no step."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace here (unshare -m); the fake full-disk tests above still ran")
    mnt = tmp_path / "mnt"
    names = [f"full{size}" for size in DISK_SIZES] + ["readonly"]
    mounts = [f"mount -t tmpfs -o size={size} tmpfs {mnt}/full{size}" for size in DISK_SIZES]
    mounts.append(f"mount -t tmpfs -o ro,size=16k tmpfs {mnt}/readonly")
    for name in names:
        (mnt / name).mkdir(parents=True)
    script = DISK_SCRIPT.format(tests=str(TESTS), mnt=str(mnt), names=names)
    copies = " && ".join(f"cp -a {mnt}/{n}/run {tmp_path}/{n}-copy" for n in names[:-1])
    shell = " && ".join(mounts) + f' && {sys.executable} -c "$SCRIPT" && {copies}'
    env = {**os.environ, "SCRIPT": script, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    res = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell], capture_output=True,
                         text=True, env=env, timeout=300)
    if res.returncode and "mount" in res.stderr and "REPORT" not in res.stdout:
        pytest.skip(f"tmpfs cannot be mounted here ({res.stderr.strip()[:100]})")
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.split("REPORT ", 1)[1])
    ro = report.pop("readonly")
    assert ro["code"] == 2 and ro["err"].count("\n") == 1 and "Read-only file system" in ro["err"], ro
    assert ro["calls"] == 0
    full = [name for name, r in report.items() if r["code"]]
    assert len(full) >= 3, report  # most of the small disks filled up before the run could finish
    for name, r in report.items():
        if r["code"]:
            assert r["code"] == 2 and r["err"].count("\n") == 1 and r["err"].startswith("error:"), r
            assert "No space left on device" in r["err"] or "is the disk full?" in r["err"], r
            assert "resume with --resume_from_checkpoint latest" in r["err"], r
        copy = tmp_path / f"{name}-copy"
        if r["code"]:
            resume(copy)
        assert_same(copy, reference[1])


# ---------------------------------------------------------------------------------------------------- resume rules


def test_seed_and_effective_batch_changes_are_refused_a_new_split_is_applied_and_recorded(reference, tmp_path,
                                                                                          capsys):
    out = tmp_path / "run"
    shutil.copytree(reference[0] / "checkpoints", out / "checkpoints")  # steps 8 and 12 of the reference run
    shutil.rmtree(out / "checkpoints" / "step_0000012")
    with pytest.raises(CheckpointError, match=r"different model/data \({'seed': \(0, 1\)}"):
        resume(out, seed=1)
    with pytest.raises(CheckpointError, match=r"effective batch of 8 \(micro_batch_size 4 x gradient_accumulation"
                                              r"_steps 2 x 1 processes\); this run asks for 16"):
        resume(out, micro_batch_size=8)
    r = resume(out, micro_batch_size=2, gradient_accumulation_steps=4)
    assert "with micro_batch_size 2 x gradient_accumulation_steps 4 x 1 processes (was 4 x 2 x 1)" in capsys.readouterr().out
    assert (r["micro_batch_size"], r["gradient_accumulation_steps"]) == (2, 4)
    assert r["batch_changes"] == [{"step": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 4,
                                   "processes": 1, "reason": "changed at resume (same effective batch)"}]
    saved = json.loads((out / "all_results.json").read_text())
    assert saved["settings"]["micro_batch_size"] == saved["micro_batch_size"] == 2  # agrees with itself
    assert r["samples_seen"] == reference[1]["results"]["samples_seen"]


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    fit(FaultToy(), cfg(out, resume_from_checkpoint=str(out / "checkpoints" / "step_0000008")))
    assert (out / "checkpoints" / ".superseded-step_0000012").is_dir()
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_0000008", "step_0000012"]
    assert_same(out, reference[1])


# ---------------------------------------------------------------------------------------------------- signals


def test_parent_death_reaches_the_training_process(tmp_path):
    """A launcher killed with SIGKILL (no handler, no forwarding): the kernel sends its child SIGTERM."""
    flag = tmp_path / "signalled"
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path
        from hf_cgpu.train.stopping import Stopping
        with Stopping(max_minutes=0) as stop:
            print("ready", flush=True)
            while not stop.signalled:
                time.sleep(0.01)
            Path({str(flag)!r}).write_text(stop.signal_name)
    """))
    launcher = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, {str(child)!r}]).wait()"],
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)}, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "ready"
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 30
    while not flag.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert flag.read_text() == "SIGTERM"


def test_sigterm_handler_and_parent_death_signal_are_restored(tmp_path):
    from hf_cgpu.train.stopping import Stopping, parent_death_signal

    before = signal.getsignal(signal.SIGTERM)
    previous = parent_death_signal(0)
    with Stopping(max_minutes=0):
        assert parent_death_signal(signal.SIGTERM) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before and parent_death_signal(0) == previous


# ---------------------------------------------------------------------------------------------------- atomic files


def test_atomic_output_leaves_the_old_file_on_error_and_on_kill(tmp_path):
    target = tmp_path / "results.json"
    integrity.atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with integrity.atomic_output(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]

    def child():
        with integrity.atomic_output(target) as tmp:
            tmp.write_text("ha")
            os._exit(KILLED)

    assert in_child(child) == KILLED
    assert target.read_text() == "old"


def test_the_next_atomic_write_removes_what_killed_writers_left_and_nothing_else(tmp_path):
    """The hidden temporaries of killed processes (an export's ``.m.tmp-PID.gguf``, a card's ``.README.tmp-PID.md``,
    a tokenizer folder's ``.tokenizer.tmp-PID``) go with the next atomic write into their folder; those of a running
    process, links, hf_cgpu's other staging names and the user's own files stay; verify and push never see them."""
    from hf_cgpu.hub import upload_file_list

    def child():
        with integrity.atomic_output(tmp_path / "m.gguf") as tmp:
            tmp.write_bytes(b"GGUF half")
            os._exit(KILLED)

    assert in_child(child) == KILLED
    (killed,) = [p.name for p in tmp_path.iterdir()]
    dead = int(killed.split(".tmp-")[1].split(".")[0])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = [f".m.tmp-{alive.pid}.gguf", ".notes.md", f"m.tmp-{dead}.gguf", ".tmp-step_0000004",
                f".README.tmp-{dead}.md.bak", f".tokens-x.bin.tmp-{dead}-0a1b2c3d", ".hf_cgpu.lock"]
        for name in kept:
            (tmp_path / name).write_text("x")
        (tmp_path / f".README.tmp-{dead}.md").write_text("half a card")
        (tmp_path / f".tokenizer.tmp-{dead}").mkdir()
        (tmp_path / f".tokenizer.tmp-{dead}" / "vocab.json").write_text("{}")
        outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
        outside.write_text("not hf_cgpu's")
        (tmp_path / f".link.tmp-{dead}.txt").symlink_to(outside)
        integrity.write_manifest(tmp_path, integrity.build_manifest(tmp_path, "model"))
        assert integrity.verify_folder(tmp_path).files.keys() == {f"m.tmp-{dead}.gguf"}
        assert upload_file_list(tmp_path) == [f"m.tmp-{dead}.gguf", "manifest.json"]
        integrity.atomic_write_text(tmp_path / "README.md", "card")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [*kept, f".link.tmp-{dead}.txt", "README.md", "manifest.json"])
        assert outside.read_text() == "not hf_cgpu's"
    finally:
        alive.kill()
        alive.wait()


def test_a_kill_while_the_tokenizer_is_saved_leaves_no_broken_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from hf_cgpu.data.corpus import load_text_dataset
    from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings

    task = CausalLMTask(GPTSettings(vocab_size=300, tokenizer_train_docs=20))
    ds = load_text_dataset("builtin")
    out = tmp_path / "run"
    out.mkdir()

    def child():
        def dies_half_way(self, save_directory, *a, **k):
            (Path(save_directory) / "tokenizer_config.json").write_bytes(b"")  # the 0-byte file of the issue
            os._exit(KILLED)

        PreTrainedTokenizerFast.save_pretrained = dies_half_way
        task._tokenizer(ds, out, resume=False)

    assert in_child(child) == KILLED
    assert not (out / "tokenizer").exists()  # only a hidden temporary, never a tokenizer that does not load
    tok = task._tokenizer(ds, out, resume=False)
    again = task._tokenizer(ds, out, resume=True)
    assert len(tok) == len(again) and (out / "tokenizer" / "tokenizer_config.json").stat().st_size > 0


def test_a_damaged_saved_tokenizer_is_one_line_at_resume_and_retrained_otherwise(tmp_path):
    from hf_cgpu.data.corpus import load_text_dataset
    from hf_cgpu.errors import CheckpointError
    from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings

    task = CausalLMTask(GPTSettings(vocab_size=300, tokenizer_train_docs=20))
    ds = load_text_dataset("builtin")
    out = tmp_path / "run"
    out.mkdir()
    first = task._tokenizer(ds, out, resume=False)
    (out / "tokenizer" / "tokenizer_config.json").write_bytes(b"")  # damaged on disk (the 0-byte file)
    with pytest.raises(CheckpointError, match="tokenizer this run trained .* cannot be read"):
        task._tokenizer(ds, out, resume=True)
    again = task._tokenizer(ds, out, resume=False)  # no checkpoint depends on it yet: trained and saved anew
    assert len(again) == len(first) and (out / "tokenizer" / "tokenizer_config.json").stat().st_size > 0


def test_a_failed_sample_grid_save_leaves_the_previous_grid_whole(tmp_path, monkeypatch):
    """The grid the card shows (and the push uploads) is written atomically: a full disk (or a kill) half way
    through a save leaves the earlier grid of that step as it was and no partial file in view."""
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from hf_cgpu.tasks.flow_images import FlowMatchingTask

    class Pipe:
        def set_progress_bar_config(self, **kwargs):
            pass

        def __call__(self, batch_size, **kwargs):
            return SimpleNamespace(images=np.full((batch_size, 4, 4, 3), 0.5, dtype=np.float32))

    task = FlowMatchingTask.__new__(FlowMatchingTask)
    task.cfg, task.images, task.show_progress = SimpleNamespace(sample_steps=1, guidance_scale=1.0), torch.zeros(1), False
    monkeypatch.setattr(task, "pipeline", lambda model: Pipe())
    model = SimpleNamespace(config=SimpleNamespace(num_classes=0))
    task.on_evaluate(model, 5, tmp_path)
    grid = tmp_path / "samples" / "step_0000005.png"
    whole = grid.read_bytes()

    def dies_half_way(self, fp, *args, **kwargs):
        Path(fp).write_bytes(whole[:20])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", dies_half_way)
    with pytest.raises(OSError):
        task.on_evaluate(model, 5, tmp_path)
    assert grid.read_bytes() == whole
    assert [p.name for p in grid.parent.iterdir() if not p.name.startswith(".")] == [grid.name]


# ---------------------------------------------------------------------------------------------------- bad data


def _text_dir(tmp_path, files: dict[str, bytes | list]) -> Path:
    import datasets

    d = tmp_path / "text"
    d.mkdir()
    for name, content in files.items():
        if isinstance(content, list):
            datasets.Dataset.from_dict({"text": content}, features=datasets.Features(
                {"text": datasets.Value("string")})).to_parquet(d / name)
        else:
            (d / name).write_bytes(content)
    return d


GOOD_TEXT = ["some words in a document " * 20] * 10


@pytest.mark.parametrize("files, expected", [
    ({"train-00000-of-00002.parquet": GOOD_TEXT, "train-00001-of-00002.parquet": b""},
     r"text/train-00001-of-00002.parquet is empty \(0 bytes\)"),
    ({"train.parquet": GOOD_TEXT, "validation.parquet": []}, r"the validation split has 0 rows \(.*validation.parquet\)"),
    ({"train.parquet": GOOD_TEXT, "validation.parquet": b"PAR1 not really"}, r"validation.parquet is not a readable parquet"),
    ({"train.jsonl": b'{"text": "a b c"}\n{"text": "x"\n{"text": "y"}\n'}, r"train.jsonl line 2: not valid JSON"),
    ({"train.jsonl": b""}, r"train.jsonl is empty \(0 bytes\)"),
    ({"train.parquet": GOOD_TEXT, "validation.parquet": ["   ", ""]}, r"its validation split holds no non-empty document"),
], ids=["0-byte-parquet-shard", "0-row-validation", "corrupt-parquet", "bad-jsonl-line", "0-byte-jsonl",
        "blank-validation"])
def test_bad_text_files_end_in_one_line_naming_the_file(files, expected, tmp_path):
    from hf_cgpu.data.corpus import load_text_dataset

    d = _text_dir(tmp_path, files)
    with pytest.raises(DataError, match=expected) as err:
        load_text_dataset(str(d))
    assert "\n" not in str(err.value)


def _image_parquet(path: Path, rows: list, labels: list, names: list[str] | None = ("a", "b", "c")):
    """A parquet split of images and labels; with ``names`` the label column is a ClassLabel (written into the
    schema afterwards, so that a label past the names can be stored, as a hand-edited file would)."""
    import datasets
    import pyarrow.parquet as pq

    datasets.Dataset.from_dict({"img": rows, "label": labels}, features=datasets.Features(
        {"img": datasets.Image(), "label": datasets.Value("int64")})).to_parquet(path)
    if names:
        table = pq.read_table(path)
        meta = json.loads(table.schema.metadata[b"huggingface"])
        meta["info"]["features"]["label"] = {"names": list(names), "_type": "ClassLabel"}
        pq.write_table(table.replace_schema_metadata({b"huggingface": json.dumps(meta).encode()}), path)


def _png(colour) -> dict:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


@pytest.mark.parametrize("case, expected", [
    ("corrupt_png", r"train.parquet row 2: the image does not decode"),
    ("truncated_png", r"train.parquet row 1: the image does not decode"),
    ("negative_label", r"train.parquet row 3: label -1 is negative"),
    ("label_past_names", r"train.parquet row 1: label 3 is outside the 3 classes"),
    ("label_outside_the_others", r"train.parquet row 2: label 57 is outside the range of the others"),
    ("zero_rows", r"train.parquet\): the train split has 0 rows|the train split has 0 rows"),
])
def test_bad_image_files_end_in_one_line_naming_file_and_row(case, expected, tmp_path):
    from hf_cgpu.data.images import load_image_dataset

    good = [_png((255, 0, 0)), _png((0, 255, 0)), _png((0, 0, 255)), _png((9, 9, 9))]
    labels, names = [0, 1, 2, 0], ("a", "b", "c")
    if case == "corrupt_png":
        good[2] = {"bytes": b"\x89PNG\r\n\x1a\n not an image", "path": None}
    elif case == "truncated_png":
        good[1] = {"bytes": good[1]["bytes"][:40], "path": None}
    elif case == "negative_label":
        labels, names = [0, 1, 2, -1], None
    elif case == "label_past_names":
        labels = [0, 3, 2, 0]
    elif case == "label_outside_the_others":
        labels, names = [0, 1, 57, 1], None
    elif case == "zero_rows":
        good, labels = [], []
    d = tmp_path / "images"
    d.mkdir()
    _image_parquet(d / "train.parquet", good, labels, names)
    with pytest.raises(DataError, match=expected) as err:
        load_image_dataset(str(d), split="train", image_column="img", cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_a_test_label_outside_the_training_classes_is_refused(tmp_path, synthetic_data):
    """A label the training split never has would silently add a class (or index past the embedding)."""
    from hf_cgpu.tasks.flow_images import FlowMatchingTask, FlowSettings

    d = tmp_path / "data"
    d.mkdir()
    shutil.copy(synthetic_data / "train.parquet", d / "train.parquet")
    _image_parquet(d / "test.parquet", [_png((1, 2, 3))] * 12, list(range(12)), names=None)  # 0..11, no gap
    with pytest.raises(DataError, match=r"test.parquet row 10: label 10 is outside the 10 classes .* of the training"):
        fit(FlowMatchingTask(FlowSettings(dataset=str(d), base_channels=16, sample_every_epochs=0)),
            settings(tmp_path / "run", max_steps=1))


def test_a_corrupt_image_through_the_recipe_is_one_line_exit_2_before_training(tmp_path, synthetic_data, capsys,
                                                                               monkeypatch):
    import runpy

    import pyarrow.parquet as pq

    d = tmp_path / "data"
    d.mkdir()
    shutil.copy(synthetic_data / "test.parquet", d / "test.parquet")
    table = pq.read_table(synthetic_data / "train.parquet").to_pylist()
    table[7]["img"] = {"bytes": b"\x89PNG\r\n\x1a\ngarbage", "path": None}

    _image_parquet(d / "train.parquet", [r["img"] for r in table], [r["label"] for r in table],
                   names=[f"c{k}" for k in range(10)])
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["train_flow.py", "--preset", "tiny", "--dataset", str(d), "--output_dir",
                                      str(tmp_path / "run"), "--progress", "false"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(TESTS.parent / "recipes" / "train_flow.py"), run_name="__main__")
    err = capsys.readouterr().err  # datasets' progress bars are on stderr too: the error is its one last line
    last = err.rstrip("\n").split("\n")[-1]
    assert exit_.value.code == 2 and "Traceback" not in err and last.startswith("error:")
    assert f"{d / 'train.parquet'} row 7: the image does not decode" in last
    assert not (tmp_path / "run" / "checkpoints").exists()
