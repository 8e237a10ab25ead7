"""trainer.val_every = -1: no validation, not even after the last step (benchmarks: random weights never
stop, so their validation runs every response to data.max_response_length); 0: after the last step
only. Both on conftest's runs: -1 on the run without saves or validations (which
tests/e2e/test_save_every.py reads too), 0 on tiny_run (tiny_cmd's)."""

from tests.helpers.cpu_runs import read_metrics


def test_val_every_minus_one_never_validates(tiny_run_without_saves_or_validations):
    m = read_metrics(tiny_run_without_saves_or_validations[0])
    assert sorted(m) == [1, 2] and not any("val/acc" in m[s] for s in m), m


def test_val_every_zero_validates_after_the_last_step_only(tiny_run):
    m = read_metrics(tiny_run[0])  # trainer.val_every = 0 (tiny_cmd's), 2 steps
    assert "val/acc" in m[2] and "val/acc" not in m[1], m
