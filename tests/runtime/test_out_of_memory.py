"""An out-of-memory error in a step is one line on every rank that has it, on CPU.

Two kinds reach the trainer: PyTorch's torch.OutOfMemoryError, and vLLM's: its sleep-mode allocator,
when wake_up cannot map its pool, prints `CUDA Error: out of memory at .../cumem_allocator.cpp:163` on
std::cerr (native code: fd 2) and then raises the same text as a RuntimeError. Both become the
trainer's one line naming the phase (trainer.PhaseTimer -> preflight.memory.OutOfMemory), printed by
every rank that ran out (its own GPU's memory: not the input error every rank meets alike, which
rank 0 alone reports), with vLLM's raw line held back; an error that is not an out-of-memory one
keeps its traceback and whatever it printed. The engine's errors are simulated: a fake engine here,
and the HF engine's wake_up patched in a real 2-rank torchrun of the tiny preset.
"""

from __future__ import annotations

import glob
import os
import subprocess
import weakref

import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.cpu_runs import tiny_cmd

CUMEM_LINE = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"
ERRORS = {  # kind -> (what native code prints on fd 2 first, the exception raised)
    "vllm-cumem": (CUMEM_LINE, lambda: RuntimeError(CUMEM_LINE)),
    "torch": ("", lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a "
                                                 "total capacity of 79.19 GiB\nof which 1.5 GiB is free.")),
    "not-oom": ("CUDA Error: invalid argument at /workspace/csrc/cumem_allocator.cpp:120",
                lambda: RuntimeError("shapes differ")),
}


class FailingEngine:
    """An engine whose wake_up prints what vLLM's allocator would (straight to fd 2, as C++ does),
    plus a line of its own, and raises."""

    def __init__(self, kind: str):
        self.kind = kind

    def wake_up(self, tags=None):
        native, error = ERRORS[self.kind]
        os.write(2, f"engine: waking {tags}\n".encode())
        if native:
            os.write(2, (native + "\n").encode())
        raise error()


@pytest.mark.parametrize("kind", list(ERRORS))
def test_an_error_waking_the_engine_is_the_trainers_line_or_passes_with_what_it_printed(kind, capfd):
    from spmd_rl.preflight.memory import OutOfMemory
    from spmd_rl.trainer import PhaseTimer, Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.engine = FailingEngine(kind)
    native, _ = ERRORS[kind]
    with pytest.raises(Exception) as e:
        trainer.sync_weights(PhaseTimer(torch.device("cpu")))
    err = capfd.readouterr().err
    assert "engine: waking ['weights']" in err, err  # the engine's other output is kept
    if kind == "not-oom":
        assert type(e.value) is RuntimeError and str(e.value) == "shapes differ"
        assert native in err, err  # nothing held back around an error that is not an out-of-memory one
        return
    assert isinstance(e.value, OutOfMemory)
    assert str(e.value).startswith("out of GPU memory in the step's wake phase ("), str(e.value)
    assert "CUDA Error" not in err and "cumem_allocator" not in err, err  # vLLM's own line is the trainer's now


def test_teardown_releases_the_optimizer_before_the_engine_maps_its_pool_back():
    """Trainer.close: after an out-of-memory step no training tensor may be left when the sleeping
    engine maps its pool back to shut down (it ran out of memory there too, and its RuntimeError came
    out of the teardown as a traceback): the learning-rate schedulers held the optimizers, and with
    them every parameter and AdamW moment."""
    from spmd_rl.train.optim import make_scheduler
    from spmd_rl.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.actor = torch.nn.Linear(4, 4)
    trainer.actor_opt = torch.optim.AdamW(trainer.actor.parameters())
    trainer.actor(torch.ones(2, 4)).sum().backward()
    trainer.actor_opt.step()
    trainer.actor_sched = make_scheduler(trainer.actor_opt, 1, 10, "constant", 0.0)
    trainer.critic_opt = trainer.critic_sched = None
    held = weakref.ref(trainer.actor.weight)
    seen = []

    class Engine:
        def close(self):
            seen.append(held())

    trainer.engine = Engine()
    trainer.close()
    assert seen == [None], "a parameter was still alive when the engine shut down"


@pytest.mark.parametrize("kind", list(ERRORS))
def test_an_engine_that_cannot_map_its_pool_back_at_teardown_is_no_traceback(kind, capfd):
    """A sleeping vLLM engine maps its pool back to shut down (engine.close); where that runs out of
    memory too, Trainer.close goes on (the exit releases the memory) with vLLM's raw line held back:
    its RuntimeError came out of the teardown, a traceback after (or in place of) the run's own line.
    Any other error there passes."""
    from spmd_rl.trainer import Trainer

    class Engine:
        def close(self):
            FailingEngine(kind).wake_up()

    class Closing:
        closed = False

        def close(self):
            Closing.closed = True

    trainer = Trainer.__new__(Trainer)
    trainer.engine, trainer.metrics = Engine(), Closing()
    if kind == "not-oom":
        with pytest.raises(RuntimeError, match="shapes differ"):
            trainer.close()
        assert ERRORS[kind][0] in capfd.readouterr().err
        return
    trainer.close()
    assert Closing.closed, "the parts after the engine were not closed"
    err = capfd.readouterr().err
    assert "engine: waking None" in err and "CUDA Error" not in err, err


WRAPPER = '''
import os, sys
sys.path.insert(0, {root!r})
import torch
from spmd_rl.rollout import hf_engine
from tests.runtime.test_out_of_memory import ERRORS

def wake_up(self, tags=None):
    if os.environ["RANK"] == "1":  # rank 1 alone runs out: its GPU's memory, not the run's input
        native, error = ERRORS[os.environ["FAKE_WAKE_ERROR"]]
        if native:
            os.write(2, (native + "\\n").encode())
        raise error()

hf_engine.HFEngine.wake_up = wake_up
from spmd_rl.ppo import main
sys.exit(main(sys.argv[1:]))
'''


def rank_outputs(log_dir) -> dict[int, tuple[str, str]]:
    """Rank -> (stdout, stderr) of a torchrun with --log-dir and --redirects 3."""
    out = {}
    for rank in (0, 1):
        found = {}
        for stream in ("stdout", "stderr"):
            files = glob.glob(os.path.join(str(log_dir), "**", str(rank), f"{stream}.log"), recursive=True)
            assert len(files) == 1, (rank, stream, files)
            found[stream] = open(files[0]).read()
        out[rank] = (found["stdout"], found["stderr"])
    return out


@pytest.mark.parametrize("kind", list(ERRORS))
def test_a_rank_that_runs_out_of_memory_says_so_in_one_line(kind, tmp_path):
    """2 CPU ranks of the tiny preset, rank 1's engine failing as `kind` when it wakes at step 1: rank
    1 prints the one line at once, naming itself (rank 0 never reports rank 1's out-of-memory: before,
    rank 1 left it to rank 0 and died with nothing said, or with vLLM's raw line alone), no traceback
    and no raw allocator line; an error that is not an out-of-memory one keeps its traceback."""
    script = tmp_path / "wrapped_ppo.py"
    script.write_text(WRAPPER.format(root=ROOT))
    cmd = tiny_cmd(tmp_path / "run", "trainer.total_steps=1")
    at = cmd.index("-m", 3)  # torchrun's own options end here; the module it runs follows
    cmd = [*cmd[:at], "--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(script), *cmd[at + 2:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, FAKE_WAKE_ERROR=kind)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stderr[-3000:]
    (out0, err0), (out1, err1) = rank_outputs(tmp_path / "logs").values()
    lines = [line for line in err1.splitlines() if line.strip()]
    if kind == "not-oom":
        assert "Traceback" in out1 and "RuntimeError: shapes differ" in out1, (out1[-3000:], err1[-3000:])
        assert ERRORS[kind][0] in lines, err1[-3000:]  # what it printed is kept
        return
    said = [line for line in lines if "out of memory" in line.lower() or "CUDA Error" in line]
    assert len(said) == 1, err1[-3000:]  # (rank 1 printed nothing else here; other lines would be no failure's)
    assert said[0].startswith("error: rank 1: out of GPU memory in the step's wake phase ("), said[0]
    first = str(ERRORS[kind][1]()).splitlines()[0]
    assert first in said[0], said[0]
    assert "Traceback" not in out1 + err1, out1[-3000:]
    assert "out of GPU memory" not in out0 + err0 and "cumem_allocator" not in out0 + err0, err0[-3000:]
