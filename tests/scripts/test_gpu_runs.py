"""The learning checks' runs (tests/gpu/test_learning_gpu.py, test_multiturn_learning_gpu.py: runs.SMALL_ON_VLLM
and each case's overrides) pass the start-up checks (preflight.validate) here, on CPU: a setting the
project refuses would otherwise fail only on a GPU, each check exiting 2 at start."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

import test_learning_gpu  # noqa: E402
import test_multiturn_learning_gpu  # noqa: E402
from runs import command  # noqa: E402

RUNS = {**{name: (test_learning_gpu.LEARN, extra) for runs in test_learning_gpu.CASES.values()
           for name, _, extra in runs},
        **{f"multiturn-{name}": (test_multiturn_learning_gpu.LEARN, extra)
           for name, extra in test_multiturn_learning_gpu.RUNS.items()}}
"""A run's name: its common overrides and its own (as the checks pass them to runs.train_side_by_side)."""
NPROC = {name: nproc for runs in test_learning_gpu.CASES.values() for name, nproc, _ in runs}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_learning_checks_run_passes_the_start_up_checks(name, tmp_path, monkeypatch):
    from spmd_rl import preflight
    from spmd_rl.config.run_config import load_config
    from spmd_rl.rollout.vllm import kwargs as vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)  # no vLLM on the CI machine
    # vLLM's argument names: the run's own engine kwargs stand in, so the project's own refusals are what is checked
    monkeypatch.setattr(vllm_kwargs, "vllm_llm_arg_names", lambda: set(vllm_kwargs._entries(cfg.rollout.engine_kwargs)))
    nproc = NPROC.get(name, 1)
    common, extra = RUNS[name]
    argv = command(nproc, [*common, *test_learning_gpu.case_overrides(extra, tmp_path)], tmp_path / "run", 2, "none")
    args = argv[argv.index("spmd_rl.ppo") + 1:]
    assert args[0] == "--config", args
    cfg = load_config(args[1], args[2:])
    cfg.data.train_files = []  # the run writes its synthetic data at start (data.synthetic_task)
    preflight.validate(cfg, world_size=nproc, gpus_per_node=nproc)
