"""The in-process model inspection adapter (spmd_rl/rollout/vllm/model_inspection.py) on a stand-in
for vLLM 0.26's registry module; tests/gpu/test_colocate.py checks it inside the real vLLM."""

from __future__ import annotations

import os
import types

import pytest

from spmd_rl.rollout.vllm import model_inspection as vmi


def _registry():
    """A stand-in registry whose `_run_in_subprocess` runs `fn` in another process, as vLLM's does."""
    reg = types.ModuleType("fake_registry")

    def _run_in_subprocess(fn):
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:
            return pool.apply(_call, (fn,))

    reg._run_in_subprocess = _run_in_subprocess
    reg.inspect = lambda: reg._run_in_subprocess(os.getpid)  # what inspect_model_cls does, by name
    return reg


def _call(fn):
    return fn()


def test_inspection_runs_in_this_process_inside_the_block_only():
    reg = _registry()
    original = reg._run_in_subprocess
    assert reg.inspect() != os.getpid()  # the stand-in really uses another process
    before = vmi.InspectionCount.in_process
    with vmi.in_process_inspection(reg) as patched:
        assert patched
        assert reg.inspect() == os.getpid()
    assert vmi.InspectionCount.in_process == before + 1
    assert reg._run_in_subprocess is original
    assert reg.inspect() != os.getpid()


def test_the_original_comes_back_after_an_error():
    reg = _registry()
    original = reg._run_in_subprocess
    with pytest.raises(RuntimeError, match="engine failed"):
        with vmi.in_process_inspection(reg):
            raise RuntimeError("engine failed")
    assert reg._run_in_subprocess is original


def test_a_vllm_without_the_function_is_left_as_it_is():
    reg = types.ModuleType("other_registry")
    with vmi.in_process_inspection(reg) as patched:
        assert not patched
        assert not hasattr(reg, "_run_in_subprocess")


def test_no_vllm_installed_means_nothing_to_patch():
    """The CPU machines have no vLLM: the default registry import fails quietly."""
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here: the real registry is patched (tests/gpu/test_colocate.py)")
    except ImportError:
        pass
    with vmi.in_process_inspection() as patched:
        assert not patched
