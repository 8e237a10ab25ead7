"""Fixtures of the GPU tests."""

import pytest


@pytest.fixture(scope="module")
def env():
    """One process, a world of one (NCCL default group) on the current GPU, for a test module."""
    from spmd_rl.distributed import destroy_distributed, init_distributed

    env = init_distributed("cuda")
    yield env
    destroy_distributed()
