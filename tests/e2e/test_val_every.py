"""trainer.val_every: 0 validates after the last step only; -1 never (benchmarks: random weights
never stop, so their validation runs every response to data.max_response_length)."""

import pytest

from tests.helpers.cpu_runs import read_metrics, run_cmd, tiny_cmd


@pytest.mark.parametrize("val_every,validated", [(0, True), (-1, False)])
def test_val_every_zero_validates_after_the_last_step_and_minus_one_never(tmp_path, val_every, validated):
    run_dir = tmp_path / "run"
    p = run_cmd(tiny_cmd(run_dir, f"trainer.val_every={val_every}", "trainer.save_every=-1",
                         "trainer.tensorboard=false", nproc=1))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = read_metrics(run_dir)
    assert sorted(m) == [1, 2], sorted(m)
    assert ("val/acc" in m[2]) == validated and not any("val/acc" in m[s] for s in m if s != 2), m
