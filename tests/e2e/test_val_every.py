"""trainer.val_every = -1: no validation, not even after the last step (benchmarks: random weights never
stop, so their validation runs every response to data.max_response_length). That 0 validates after
the last step only: tests/e2e/test_save_every.py, on its run."""

from tests.helpers.cpu_runs import read_metrics, run_cmd, tiny_cmd


def test_val_every_minus_one_never_validates(tmp_path):
    run_dir = tmp_path / "run"
    p = run_cmd(tiny_cmd(run_dir, "trainer.val_every=-1", "trainer.save_every=-1", "trainer.tensorboard=false",
                         nproc=1))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = read_metrics(run_dir)
    assert sorted(m) == [1, 2] and not any("val/acc" in m[s] for s in m), m
