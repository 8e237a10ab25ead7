"""trainer.profile_steps (spmd_rl/step_profiler.py): the profiled step's files, its phase table
against the phases' own timers, and the key's check."""

from __future__ import annotations

import gzip
import json
import os
import re
import time

import pytest
import torch

from dist_utils import run_distributed
from spmd_rl import step_profiler
from spmd_rl.errors import ConfigError


def test_phase_table_matches_the_phases_wall_time(tmp_path):
    """Two named phases under the profiler: each row's wall time is what a clock around it saw."""
    walls = {}
    with step_profiler.profiled_step(1, str(tmp_path), 0, torch.device("cpu")):
        for name, seconds in (("generate", 0.05), ("update_actor", 0.12)):
            t0 = time.perf_counter()
            with step_profiler.phase_range(name):
                time.sleep(seconds)
                torch.ones(64, 64) @ torch.ones(64, 64)
            walls[name] = (time.perf_counter() - t0) * 1e3
    text = (tmp_path / "step_1_rank0.txt").read_text()
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^\| (\w+) \| ([\d.]+) \| [\d.]+ \| - \|$", text, re.M)}
    assert set(rows) == {"generate", "update_actor"}, text
    for name, wall in walls.items():
        assert rows[name] == pytest.approx(wall, rel=0.1, abs=2.0), (name, rows[name], wall)
    assert "aten::mm" in text  # the op table follows
    trace = json.loads(gzip.open(tmp_path / "step_1_rank0.json.gz").read())
    assert {"phase/generate", "phase/update_actor"} <= {e.get("name") for e in trace["traceEvents"]}


@pytest.mark.parametrize("steps", ["[0]", "[4]"])
def test_steps_outside_the_run_are_refused(tmp_path, steps):
    from test_config import valid_cfg

    with pytest.raises(ConfigError, match=r"trainer.profile_steps = \[\d\]: \[\d\] not between 1 and trainer.total_steps = 3"):
        valid_cfg(tmp_path, [f"trainer.profile_steps={steps}", "trainer.total_steps=3",
                             f'trainer.run_dir="{tmp_path}/run"']).validate(world_size=1)


def _fit_body(rank, world, base):
    from test_old_logprobs import _trainer

    trainer = _trainer(f"{base}/run", f"{base}/data", ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                                                       "actor.micro_batch_size_per_gpu=4", "trainer.total_steps=2",
                                                       "trainer.save_every=-1", "trainer.profile_steps=[2]"], rank)
    trainer.fit()
    trainer.close()


def test_a_run_profiles_the_steps_it_names(tmp_path):
    """A 2-step run with trainer.profile_steps = [2]: step 2's files only, with the step's phases."""
    run_distributed(_fit_body, 1, str(tmp_path))
    files = sorted(os.listdir(tmp_path / "run" / "profile"))
    assert files == ["step_2_rank0.json.gz", "step_2_rank0.txt"], files
    text = (tmp_path / "run" / "profile" / "step_2_rank0.txt").read_text()
    for phase in ("generate", "reward", "adv", "update_actor"):
        assert re.search(rf"^\| {phase} \| [\d.]+ \|", text, re.M), (phase, text[:2000])
