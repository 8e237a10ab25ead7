"""examples/my_task/ run exactly as its README.md says (its commands, read from it, in a copy of
examples/), for a few steps: the data script, the reward-function config, the environment config."""

import os
import re
import shlex
import shutil
import subprocess
import sys

from tests.helpers import ROOT
from tests.helpers.cpu_runs import read_metrics

EXAMPLE = os.path.join(ROOT, "examples", "my_task")
FEW_STEPS = ["trainer.total_steps=3", "trainer.val_every=3", "trainer.save_every=3", "trainer.tensorboard=false"]


def readme_commands() -> list[list[str]]:
    with open(os.path.join(EXAMPLE, "README.md")) as f:
        block = re.search(r"```\n(.*?)```", f.read(), re.S).group(1)
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def run_as_written(argv: list[str], cwd, *overrides: str) -> str:
    """`python ...` and `torchrun ...` with this interpreter (torchrun as its module)."""
    head = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"]}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run(head[argv[0]] + argv[1:] + list(overrides), cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


def test_the_example_task_runs_as_its_readme_says(tmp_path):
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples", ignore=shutil.ignore_patterns("data"))
    make_data, with_reward, with_env = readme_commands()
    assert make_data[:2] == ["python", "examples/my_task/make_data.py"], make_data
    run_as_written(make_data, tmp_path)
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "examples/my_task/data/train.parquet").to_pylist()
    assert len(rows) >= 200 and all(r["ground_truth"] == r["prompt"][0] for r in rows)

    for argv, name in ((with_reward, "config.toml"), (with_env, "env.toml")):
        assert argv[-2:] == ["--config", f"examples/my_task/{name}"], argv
        run_dir = tmp_path / "runs" / name
        out = run_as_written(argv, tmp_path, f"trainer.run_dir={run_dir}", *FEW_STEPS)
        assert "step 3/3" in out and (run_dir / "checkpoints" / "step_3").is_dir(), out[-3000:]
        m = read_metrics(run_dir)
        assert 0 <= m[3]["reward/mean"] <= 1 and 0 <= m[3]["val/acc"] <= 1, m[3]
        with open(run_dir / "config.toml") as f:
            saved = f.read()
        assert 'synthetic_task = ""' in saved, saved
        if name == "env.toml":  # the environment's reward alone: no reward function, no refusal
            assert 'custom_function = ""' in saved and "multiturn/turns_mean" in m[3], m[3]
            assert "data_source 'my_task/first_digit' has no scorer" in out
