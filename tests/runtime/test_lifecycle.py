"""Process lifecycle: clean exits with their documented codes, the exit abort's
mechanism forced, ranks that die with their launcher, start-up phases that are logged."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from spmd_rl.runtime.distributed import free_port
from spmd_rl.telemetry.startup import StartupClock
from tests.helpers import ROOT

TINY = os.path.join(ROOT, "configs", "tiny-cpu.toml")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)

# Rank 0 leaves a collective in flight; its completion (rank 1 joins 1 s late) makes a gloo worker
# thread drop the last reference to a tensor with a Python object, which takes the GIL. A device
# mesh keeps the process group alive past destroy_process_group(), as DTensor's caches do in a run.
# Unowned, the group's threads then run on into interpreter teardown, where such a late GIL
# request ends the thread inside a noexcept destructor: std::terminate, the SIGABRT at exit
# (seen with gdb: ConcretePyInterpreterVTable::decref from ProcessGroupGloo::runLoop after each
# collective). Owned, the teardown joins them before the process exits.
TEARDOWN_WORKER = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.runtime import lifecycle

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    if dist.get_rank() == 0:
        t = torch.ones(8)
        work = dist.all_reduce(t, async_op=True)
        del work, t
    else:
        time.sleep(1)
        dist.all_reduce(torch.ones(8))
    if sys.argv[1] == "owned":
        lifecycle.destroy_process_group()
    else:
        dist.destroy_process_group()
        time.sleep(2)  # the collective is long done
    print("threads after teardown:", lifecycle.process_group_threads(), flush=True)
""")


def _two_ranks(code: str, *args: str, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Run `code` as ranks 0 and 1 of a gloo group."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(ENV, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_teardown_joins_the_process_group_threads_a_mesh_keeps_alive():
    for rank, p in enumerate(_two_ranks(TEARDOWN_WORKER, "unowned")):
        assert "threads after teardown: ['" in p.stdout, ("the hazard this guards against is gone?", p.stdout)
    for rank, p in enumerate(_two_ranks(TEARDOWN_WORKER, "owned")):
        assert p.returncode == 0, (rank, p.returncode, p.stderr[-2000:])
        assert "threads after teardown: []" in p.stdout, (rank, p.stdout)


@pytest.mark.parametrize("mode,n", [("finish", 1), ("preempt", 1), ("config", 2)])  # N=200: scripts/probes/stress_exit.sh
def test_stress_exit_each_mode_exits_with_its_documented_code(tmp_path, mode, n):
    """scripts/probes/stress_exit.sh: 0 finished, 3 (EXIT_PREEMPTED) on SIGTERM, 2 on a config error;
    every run, and no process left behind. (200 runs of a mode: run the script by hand.)"""
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "probes", "stress_exit.sh"), "--mode", mode, "--keep", str(n)],
                       cwd=ROOT, env=dict(ENV, STRESS_DIR=str(tmp_path)), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and f"mode={mode} runs={n} failures=0" in p.stdout, p.stdout + p.stderr[-3000:]
    if mode == "finish":  # the start-up phases reach the first step's metrics, and the log
        with open(tmp_path / "finish_1" / "run" / "metrics.jsonl") as f:
            first = json.loads(f.readline())
        for phase in ("imports", "distributed", "data", "model_build", "reference_critic", "engine", "checkpoint_load",
                      "total"):
            assert first[f"time/startup_{phase}"] >= 0, phase
        parts = sum(v for k, v in first.items() if k.startswith("time/startup_") and k != "time/startup_total")
        assert parts <= first["time/startup_total"] + 0.05  # phases are disjoint parts of the total
        log = (tmp_path / "finish_1" / "run" / "trainer.log").read_text()
        assert "start-up: model_build took" in log and "since the process started" in log
        assert "still running" not in log, "the teardown must leave no thread behind"


def _rank_pids(needle: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if needle.encode() in cmd and b"spmd_rl.ppo" in cmd and b"torch.distributed.run" not in cmd:
                pids.append(int(pid))
    return pids


def test_ranks_die_with_their_launcher(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "spmd_rl.ppo",
           "--config", TINY, f"trainer.run_dir={run_dir}", "data.val_files=[]", "trainer.total_steps=1000", "trainer.save_every=1", "trainer.keep_last=2"]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        latest = run_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 300
        while not latest.exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = _rank_pids(str(run_dir))
        assert latest.exists() and len(ranks) == 2, f"the run did not get going (ranks {ranks})"
        agent.kill()  # SIGKILL: torchrun gets no chance to stop its workers
        agent.wait()
        deadline = time.monotonic() + 10
        while _rank_pids(str(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _rank_pids(str(run_dir))
        assert not left, f"ranks {left} kept running 10 s after their launcher was killed"
    finally:
        for pid in _rank_pids(str(run_dir)):
            os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
    # the run directory is intact: `latest` names a complete checkpoint of both ranks
    name = latest.read_text().strip()
    assert sorted(os.listdir(run_dir / "checkpoints" / name))[-2:] == ["trainer_state_rank0.pt", "trainer_state_rank1.pt"]


def test_startup_clock_phases_metrics_and_heartbeat(caplog):
    clock = StartupClock(heartbeat_s=0.05, start=time.time())
    with caplog.at_level(logging.INFO, logger="spmd_rl"):
        with clock("data"):
            pass
        clock.begin("model_build")
        deadline = time.monotonic() + 30
        while "still in model_build" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        clock.begin("fsdp_wrap")  # ends model_build
        clock.finish()
    assert "still in model_build" in caplog.text, "a long phase must keep talking"
    assert clock._thread is None, "finish() joins the heartbeat thread"
    m = clock.take_metrics()
    assert set(m) == {"time/startup_data", "time/startup_model_build", "time/startup_fsdp_wrap", "time/startup_total"}
    assert m["time/startup_model_build"] > 0 and m["time/startup_total"] >= sum(
        v for k, v in m.items() if k != "time/startup_total")
    assert clock.take_metrics() == {}, "only the first step gets them"
    for line in ("start-up: data took", "start-up: model_build took", "start-up: fsdp_wrap took", "since the process started"):
        assert line in caplog.text


def test_release_meshes_passes_over_dead_weak_proxies():
    """torch.compile leaves weakref.proxy objects among gc's objects; isinstance on a dead one raises
    ReferenceError, which ended a compiled run's teardown."""
    import gc
    import weakref

    import torch.distributed.device_mesh  # noqa: F401  (what _release_meshes looks for)

    from spmd_rl.runtime import lifecycle

    class Referent:
        pass

    target = Referent()
    dead = [weakref.proxy(target)]
    del target
    gc.collect()
    with pytest.raises(ReferenceError):
        isinstance(dead[0], str)
    lifecycle._release_meshes()  # must not raise
