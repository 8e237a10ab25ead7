"""Step metrics over ranks (spmd_rl/telemetry/metrics.rank_reduction through
runtime.distributed.all_reduce_metrics, on 3 gloo ranks): a memory figure is the fullest GPU's,
where the mean would hide the one that runs out; `time/generate_max` the slowest rank's, which the
others wait for; everything else is the mean."""

from tests.helpers.dist_utils import run_distributed


def _body(rank, world):
    import torch

    from spmd_rl.runtime.distributed import all_reduce_metrics
    from spmd_rl.telemetry.metrics import rank_reduction

    mine = {"memory/update_actor_peak_gb": [30.0, 60.0, 45.0][rank],
            "memory/generate_device_gb": [70.0, 50.0, 60.0][rank],
            "memory/free_after_sleep_gb": [40.0, 20.0, 30.0][rank],
            "memory/device_total_gb": [79.2, 79.2, 139.8][rank],
            "memory/offloaded_gb": [3.0, 6.0, 9.0][rank],
            "actor/pg_loss": [1.0, 2.0, 6.0][rank],
            "time/step": [9.0, 10.0, 11.0][rank],
            "time/generate": [4.0, 5.0, 9.0][rank],
            "time/generate_max": [4.0, 5.0, 9.0][rank]}
    got = all_reduce_metrics(mine, torch.device("cpu"), rank_reduction)
    want = {"memory/update_actor_peak_gb": 60.0, "memory/generate_device_gb": 70.0,
            "memory/free_after_sleep_gb": 20.0, "memory/device_total_gb": 79.2,
            "memory/offloaded_gb": 6.0, "actor/pg_loss": 3.0, "time/step": 10.0,
            "time/generate": 6.0, "time/generate_max": 9.0}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want), (got, want)


def test_memory_figures_are_the_fullest_gpus_the_slowest_generation_the_max_and_the_rest_the_mean():
    run_distributed(_body, 3)
