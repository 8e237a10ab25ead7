"""Checkpoints: asynchronous saves hold the staged state, failures never become `latest`,
broken checkpoints are detected and skipped, and a directory of only broken ones is an error."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from spmd_rl.checkpoint.checkpointer import MANIFEST, Checkpointer, CheckpointError, ModelAndOptimizer, verify
from spmd_rl.exit_codes import EXIT_PREEMPTED
from tests.helpers.dist_utils import run_distributed


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()  # optimizer state exists
    return model, opt


def snapshot(model, opt):
    """Independent copy of what a checkpoint must hold: parameters and Adam moments."""
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in model.parameters()]
    return params, moments


def train_step(model, opt):
    model(torch.randn(3, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def assert_holds(model, opt, snap):
    params, moments = snap
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, params[k], rtol=0, atol=0)
    for p, m in zip(model.parameters(), moments):
        for k, v in m.items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=0, atol=0)


def test_async_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path, monkeypatch):
    """The write is held back until two more steps changed every weight in place: the checkpoint
    must still hold the weights and Adam moments of the step it was taken at."""
    model, opt = make_model()
    ck = Checkpointer(str(tmp_path), keep_last=2, async_save=True)
    gate = threading.Event()
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write = FileSystemWriter.write_data

    def held_write(self, plan, planner):
        assert gate.wait(60)
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held_write)
    snap = snapshot(model, opt)
    ck.save(1, {"actor": ModelAndOptimizer(model, opt)}, {"step": 1})
    assert ck.latest() is None, "nothing may be visible before the write finished"
    for _ in range(2):
        train_step(model, opt)
    gate.set()
    ck.wait()
    ck.close()
    assert ck.latest() == str(tmp_path / "step_1") and verify(ck.latest()) is None

    fresh, fresh_opt = make_model(seed=1)
    state = Checkpointer(str(tmp_path), keep_last=2).load(ck.latest(), {"actor": ModelAndOptimizer(fresh, fresh_opt)})
    assert state == {"step": 1}
    assert_holds(fresh, fresh_opt, snap)


def test_a_save_failing_in_the_background_is_one_errno_line_and_the_next_save_works(tmp_path, monkeypatch, caplog):
    """A write error of the background save (here DCP's writer raising ENOSPC itself): one error
    line naming the errno, the partial directory removed, step 1 stays the latest, the run goes on
    and the next save is written. (The disk filling up for real: tests/checkpoint/test_checkpoint_space.py.)"""
    model, opt = make_model()
    ck = Checkpointer(str(tmp_path), keep_last=5, async_save=True)
    models = {"actor": ModelAndOptimizer(model, opt)}
    ck.save(1, models, {"step": 1})
    assert ck.wait() is True
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write = FileSystemWriter.write_data

    def broken_write(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken_write)
    with caplog.at_level(logging.INFO, logger="spmd_rl.checkpoint.checkpointer"):
        assert ck.save(2, models, {"step": 2}) is not None  # returns: the failure happens in the background
        assert ck.wait() is False
    # ours only: torch 2.11's DCP also logs the exception to its own logger (c10d's, a NullHandler that
    # does not propagate to the run's console; pytest's capture sees it)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("spmd_rl")]
    assert len(errors) == 1 and errors[0].startswith("checkpoint of step 2 not written: rank 0: [Errno 28] No space "
                                                     "left on device (ENOSPC)"), errors
    assert f"removed {tmp_path / 'step_2.tmp'}, step_1 stays the latest; training goes on" in errors[0]
    assert not os.path.exists(tmp_path / "step_2.tmp") and not os.path.exists(tmp_path / "step_2")
    assert ck.latest() == str(tmp_path / "step_1") and ck.find_resume("auto") == str(tmp_path / "step_1")
    monkeypatch.setattr(FileSystemWriter, "write_data", write)
    ck.save(3, models, {"step": 3})
    ck.close()
    assert ck.complete_steps() == [1, 3] and ck.find_resume("auto") == str(tmp_path / "step_3")


def test_several_async_saves_in_one_process_reuse_their_buffers_and_resume_from_the_last(tmp_path, monkeypatch):
    """Four asynchronous saves through one Checkpointer (the run's stager), training between them:
    each becomes complete, the last one resumes into a fresh model with the weights and Adam moments
    of its step, and every save after the first copies into the host buffers of the first. On torch
    2.11, torch's DefaultStager closed its inner stager after each save and the second one failed
    (KeyError: <class 'type'>); checkpoint_staging.HostStager keeps it for the run."""
    from spmd_rl.checkpoint.staging import HostStager

    staged_ptrs = []
    stage = HostStager.stage

    def recording_stage(self, state_dict):
        staged = stage(self, state_dict)
        weights = staged["actor"]["model"]
        staged_ptrs.append({k: v.data_ptr() for k, v in weights.items()})
        return staged

    monkeypatch.setattr(HostStager, "stage", recording_stage)
    model, opt = make_model()
    ck = Checkpointer(str(tmp_path), keep_last=2, async_save=True)
    models = {"actor": ModelAndOptimizer(model, opt)}
    for step in range(1, 5):
        train_step(model, opt)
        snap = snapshot(model, opt)
        ck.save(step, models, {"step": step})
        train_step(model, opt)  # changes every weight while the save is written
        if step == 4:
            ck.close()
    assert len(staged_ptrs) == 4 and all(p == staged_ptrs[0] for p in staged_ptrs[1:]), staged_ptrs
    assert ck.complete_steps() == [3, 4] and ck.find_resume("auto") == str(tmp_path / "step_4")
    fresh, fresh_opt = make_model(seed=1)
    resumed = Checkpointer(str(tmp_path), keep_last=2, async_save=True)
    assert resumed.load(resumed.find_resume("auto"), {"actor": ModelAndOptimizer(fresh, fresh_opt)}) == {"step": 4}
    assert_holds(fresh, fresh_opt, snap)
    resumed.save(5, {"actor": ModelAndOptimizer(fresh, fresh_opt)}, {"step": 5})  # the resumed run saves on
    resumed.close()
    assert resumed.complete_steps() == [4, 5]


def save_steps(root, steps, async_save):
    model, opt = make_model()
    ck = Checkpointer(str(root), keep_last=len(steps), async_save=async_save)
    snaps = {}
    for s in steps:
        train_step(model, opt)
        snaps[s] = snapshot(model, opt)
        ck.save(s, {"actor": ModelAndOptimizer(model, opt)}, {"step": s})
    ck.close()
    return snaps


@pytest.mark.parametrize("damage", ["truncate", "delete", "metadata"])
def test_a_broken_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, damage):
    snaps = save_steps(tmp_path, [2, 4], async_save=False)
    broken = tmp_path / "step_4"
    data = sorted(f for f in os.listdir(broken) if f.endswith(".distcp"))[0]
    if damage == "truncate":
        with open(broken / data, "r+b") as f:
            f.truncate(os.path.getsize(broken / data) // 2)
    elif damage == "delete":
        os.remove(broken / data)
    else:
        with open(broken / ".metadata", "r+b") as f:
            f.truncate(10)
    assert verify(str(broken)) is not None and verify(str(tmp_path / "step_2")) is None
    ck = Checkpointer(str(tmp_path), keep_last=2)
    with caplog.at_level(logging.WARNING, logger="spmd_rl.checkpoint.checkpointer"):
        path = ck.find_resume("auto")
    assert path == str(tmp_path / "step_2")
    assert f"checkpoint {broken} is broken" in caplog.text and "resuming from" in caplog.text
    model, opt = make_model(seed=3)
    assert ck.load(path, {"actor": ModelAndOptimizer(model, opt)}) == {"step": 2}
    assert_holds(model, opt, snaps[2])


def test_a_checkpoint_of_another_model_is_refused_before_loading(tmp_path):
    """A checkpoint copied away from its run directory escapes the config check at resume: the
    shapes are compared with DCP's metadata instead of failing inside dcp.load on every rank."""
    save_steps(tmp_path, [1], async_save=False)
    path = str(tmp_path / "step_1")
    ck = Checkpointer(str(tmp_path), keep_last=2)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint {path} holds another model: actor.model.0.weight has shape [16, 8] there, [32, 8] in this "
            "run's model; resume it with the model settings it was trained with")):
        ck.load(path, {"actor": ModelAndOptimizer(wider, torch.optim.AdamW(wider.parameters()))})
    model, opt = make_model()
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {path} holds another model: it holds no critic")):
        ck.load(path, {"actor": ModelAndOptimizer(model, opt), "critic": ModelAndOptimizer(*make_model())})
    assert ck.load(path, {"actor": ModelAndOptimizer(model, opt)}) == {"step": 1}


def test_only_broken_checkpoints_is_a_one_line_error(tmp_path):
    save_steps(tmp_path, [2], async_save=True)
    os.remove(tmp_path / "step_2" / "trainer_state_rank0.pt")
    with pytest.raises(CheckpointError) as e:
        Checkpointer(str(tmp_path), keep_last=2).find_resume("auto")
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and "trainer_state_rank0.pt is missing" in msg
    assert "move that directory away" in msg
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        Checkpointer(str(tmp_path), keep_last=2).find_resume(str(tmp_path / "step_2"))


def test_manifest_sizes_catch_a_file_shortened_past_what_metadata_covers(tmp_path):
    save_steps(tmp_path, [1], async_save=True)
    path = tmp_path / "step_1"
    assert os.path.isfile(path / MANIFEST)
    with open(path / "trainer_state_rank0.pt", "r+b") as f:  # not a DCP file: only the manifest knows its size
        f.truncate(os.path.getsize(path / "trainer_state_rank0.pt") - 1)
    assert "trainer_state_rank0.pt has" in verify(str(path))


def test_unfinished_saves_alone_start_fresh(tmp_path):
    os.makedirs(tmp_path / "step_2.tmp")
    assert Checkpointer(str(tmp_path), keep_last=2).find_resume("auto") is None


def _failure_on_one_rank(rank, world, root):
    """Rank 0's commit fails (its verification finds a file cut short, no write error behind it)
    while rank 1's write went fine: both ranks raise at the next save, together, with rank 0's
    reason, and step 1 stays the latest."""
    model, opt = make_model()
    models = {"actor": ModelAndOptimizer(model, opt)}
    ck = Checkpointer(root, keep_last=5, async_save=True)
    ck.save(1, models, {"step": 1})
    ck.wait()
    if rank == 0:
        import spmd_rl.checkpoint.saving as mod

        mod.verify = lambda path, world_size=None: "__0_0.distcp is truncated (injected)"
    ck.save(2, models, {"step": 2})
    train_step(model, opt)
    with pytest.raises(CheckpointError) as e:
        ck.save(3, models, {"step": 3})
    assert "step 2 failed: rank 0: CheckpointError: checkpoint of step 2 failed verification after writing: " \
        "__0_0.distcp is truncated (injected); step_1 stays the latest" in str(e.value), str(e.value)
    ck.close()
    assert ck.complete_steps() == [1] and open(os.path.join(root, "latest")).read().strip() == "step_1"


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    run_distributed(_failure_on_one_rank, 2, str(tmp_path))


# --------------------------------------------------------------------------- whole runs (2 ranks)


def launch_ranks(run_dir, logs, overrides, fault=""):
    """The trainer's 2 ranks with torchrun's environment, each with its own exit status."""
    from spmd_rl.runtime.distributed import free_port
    from tests.helpers import ROOT
    from tests.helpers.cpu_runs import TINY

    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("SPMD_RL_CHECKPOINT_FAULT", None)
        if fault:
            env["SPMD_RL_CHECKPOINT_FAULT"] = fault
        out = open(logs / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "spmd_rl.ppo", "--config", TINY,
                                       f"trainer.run_dir={run_dir}", *overrides], cwd=ROOT, env=env,
                                      stdout=out, stderr=subprocess.STDOUT))
    return procs


def finish(procs, timeout=300):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_preemption_waits_for_the_save_in_flight_and_broken_checkpoints_are_a_one_line_error(tmp_path):
    """SIGTERM (both ranks, as SLURM sends it) while the async save of step 4 is held back 4 s:
    the ranks finish their step, wait for step 4, checkpoint their step and exit 3. Then every
    checkpoint broken: a one-line error on rank 0 and exit 2, nothing in the run directory touched.
    (A SIGKILL with a save in flight and the fallback past a truncated checkpoint: tests/e2e/test_e2e.py's
    kill-and-resume test.)"""
    from tests.helpers.cpu_runs import read_metrics

    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    common = ["trainer.save_every=2", "trainer.val_every=0", "data.val_files=[]", "trainer.tensorboard=false"]
    procs = launch_ranks(run_dir, tmp_path, ["trainer.total_steps=40", *common], fault="delay@4:4")
    deadline = time.time() + 300
    log = run_dir / "trainer.log"
    while not (log.exists() and "step_4: training stalled" in log.read_text()):
        assert time.time() < deadline and all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()
        time.sleep(0.05)
    assert not (ckpts / "step_4").exists(), "step 4 must still be in flight when the signal comes"
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes = finish(procs)
    text = log.read_text()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], (codes, (tmp_path / "rank0.log").read_text()[-3000:])
    stopped = max(read_metrics(run_dir))
    assert 4 <= stopped < 40
    assert (ckpts / "latest").read_text().strip() == f"step_{stopped}"
    assert "checkpoint step_4 complete" in text
    assert text.index("checkpoint step_4 complete") <= text.index(f"checkpoint step_{stopped} complete")
    steps = Checkpointer(str(ckpts), keep_last=2).complete_steps()
    assert steps[-1] == stopped and len(steps) == 2, steps
    for s in steps:
        assert verify(str(ckpts / f"step_{s}"), 2) is None

    for s in steps:
        os.remove(ckpts / f"step_{s}" / "trainer_state_rank1.pt")
    before = {d: sorted(os.listdir(ckpts / d)) for d in os.listdir(ckpts) if d != "latest"}
    metrics_size = os.path.getsize(run_dir / "metrics.jsonl")
    procs = launch_ranks(run_dir, tmp_path, [f"trainer.total_steps={stopped + 4}", *common])
    assert finish(procs) == [2, 2]
    errors = [line for r in range(2) for line in (tmp_path / f"rank{r}.log").read_text().splitlines()
              if line.startswith("checkpoint error:")]
    assert len(errors) == 1 and str(ckpts) in errors[0] and "trainer_state_rank1.pt is missing" in errors[0], errors
    assert "Traceback" not in (tmp_path / "rank0.log").read_text() + (tmp_path / "rank1.log").read_text()
    assert before == {d: sorted(os.listdir(ckpts / d)) for d in os.listdir(ckpts) if d != "latest"}
    assert os.path.getsize(run_dir / "metrics.jsonl") == metrics_size


@pytest.mark.parametrize("async_save", [False, True])
def test_a_rank_writes_its_shards_in_several_files_and_they_load_back(tmp_path, monkeypatch, async_save):
    """checkpoint.WRITE_THREADS threads per rank, each writing a file of its own (DCP's default of
    one thread bounded a 7B save at ~1.1 GB/s); the checkpoint verifies and resumes bit for bit."""
    import spmd_rl.checkpoint.saving as saving

    monkeypatch.setattr(saving, "WRITE_THREADS", 3)
    snaps = save_steps(tmp_path, [1], async_save)
    files = sorted(f for f in os.listdir(tmp_path / "step_1") if f.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"], files
    assert verify(str(tmp_path / "step_1"), 1) is None
    fresh, fresh_opt = make_model(seed=1)
    Checkpointer(str(tmp_path), keep_last=1).load(str(tmp_path / "step_1"), {"actor": ModelAndOptimizer(fresh, fresh_opt)})
    assert_holds(fresh, fresh_opt, snaps[1])
