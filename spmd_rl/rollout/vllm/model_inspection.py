"""vLLM's model inspection done in this process, not in a fresh Python (a narrow adapter).

Holds for vLLM 0.26 (a slim build for Hopper). Before it builds a model, vLLM inspects the
model class (is it multimodal, does it support pipeline parallelism, ...). Unless
VLLM_CACHE_ROOT/modelinfos holds the answer for this class and this version of its source
(vllm/model_executor/models/registry.py, `_LazyRegisteredModel.inspect_model_cls`), it asks a new
Python process, `_run_in_subprocess`, which imports torch and vLLM from scratch: most of an
engine start with an empty cache (docs/performance.md, "Why the defaults are what they are"; the
log shows it as the gap between vLLM's "non-default args" and "Resolved architecture" lines). Our
cache root is the run's (`rollout.compile_cache_dir`), so every new run would pay it.

vLLM uses the subprocess so that inspecting does not initialize CUDA in the process that calls it.
Our process has CUDA initialized already (the actor is on the GPU) and imports the model's vLLM
module moments later anyway, so here the inspection runs in-process: `in_process_inspection`
replaces `_run_in_subprocess` by a plain call while the engine is built, then puts it back. vLLM
still writes its cache file. Where the function is not there (another vLLM), nothing is replaced.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

REGISTRY_MODULE = "vllm.model_executor.models.registry"
PATCHED = "_run_in_subprocess"


class InspectionCount:
    """How many inspections ran in this process (the GPU test reads it: a start with an empty
    cache must have run one here)."""

    in_process = 0


def _run_here(fn: Callable[[], Any]) -> Any:
    InspectionCount.in_process += 1
    return fn()


@contextlib.contextmanager
def in_process_inspection(registry: Any = None) -> Iterator[bool]:
    """While the block runs, vLLM's registry inspects model classes in this process. Yields whether
    it could (False: this vLLM has no `_run_in_subprocess`; its own way is kept). `registry`: the
    module to patch (tests pass a stand-in); default vLLM's."""
    if registry is None:
        import importlib

        try:
            registry = importlib.import_module(REGISTRY_MODULE)
        except ImportError:  # a vLLM laid out otherwise (or a test's stand-in)
            registry = None
    original = getattr(registry, PATCHED, None)
    if not callable(original):
        log.debug("%s has no %s: vLLM inspects the model its own way", getattr(registry, "__name__", registry), PATCHED)
        yield False
        return
    setattr(registry, PATCHED, _run_here)
    try:
        yield True
    finally:
        setattr(registry, PATCHED, original)
