"""`rollout.engine_kwargs`: what a user may add to the colocated engine's `vllm.LLM(...)` arguments.

`spmd_rl.rollout.vllm.engine.engine_kwargs` passes them after the project's own, so any name
`vllm.LLM` takes reaches vLLM. `check_engine_kwargs` (called by config validation, before the
process group or any model exists) refuses, as one line naming the key and the fix:
- engine kwargs while `rollout.engine` is not "vllm";
- a name the colocated design fixes (`FIXED`: the model directory and how its weights arrive, the
  in-process launcher and the parallel layout, sleep mode, token ids in and out, the log-prob mode
  the actor's ratio needs), with the reason;
- a name a `rollout.*` key already sets (`ROLLOUT_KEYS`), naming that key;
- a name `vllm.LLM` does not take, with the closest ones it does (`vllm_llm_arg_names`: vLLM is
  imported for this, only when engine kwargs are set);
- `rollout.engine = "vllm"` on a Python that cannot import vLLM (otherwise an ImportError
  traceback on every rank once the models are loaded).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import importlib.util
import inspect
import sys
from typing import Any, Callable, Collection

from spmd_rl.errors import ConfigError

_WEIGHTS = "the engine starts from dummy weights and gets the actor's weights at every step"
_LAYOUT = ("the engine's layout comes from the launch: one replica per rollout.tensor_parallel_size consecutive "
           "torchrun ranks, each on its own rank's GPU")

FIXED: dict[str, str] = {
    "model": "the engine is built on the actor's model directory (model.path) and gets the actor's weights at "
             "every step",
    "model_weights": _WEIGHTS,
    "load_format": _WEIGHTS,
    "skip_tokenizer_init": "the engine takes and returns token ids; its stop tokens come from the model's config files",
    "runner": "the engine must generate tokens with their log-probs (vLLM's generate runner)",
    "convert": "the engine must generate tokens with their log-probs (vLLM's generate runner)",
    "logprobs_mode": "the actor's importance ratio needs each sampled token's log-prob after temperature "
                     "(processed_logprobs)",
    "enable_sleep_mode": "the engine sleeps between rollouts so that training gets its memory (rollout.sleep_level "
                         "sets how deep)",
    "distributed_executor_backend": "the engine runs inside each torchrun process (external_launcher)",
    "worker_cls": "weight syncs load into the model of vLLM's own worker in this process",
    **{k: "set from model.lora_rank and model.lora_sync (the adapter sync's LoRA layers)"
       for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")},
    "lora_target_modules": "set from model.lora_target_modules (the engine's LoRA layers wrap what the adapter "
                           "adapts)",
    "enable_return_routed_experts": "set from actor.router_replay (\"engine\" on a mixture-of-experts model)",
    "device_ids": _LAYOUT,
    "pipeline_parallel_size": _LAYOUT,
    "prefill_context_parallel_size": _LAYOUT,
    "nnodes": _LAYOUT,
    "node_rank": _LAYOUT,
    "master_addr": _LAYOUT,
    "master_port": _LAYOUT,
    **{f"data_parallel_{k}": _LAYOUT for k in ("size", "rank", "start_rank", "size_local", "address", "rpc_port",
                                                "hybrid_lb", "external_lb", "multi_port_external_lb", "backend")},
}
"""Names the colocated engine fixes (spmd_rl/rollout/vllm/engine.py says what it relies on), with why."""

ROLLOUT_KEYS: dict[str, str] = {
    **{name: f"rollout.{name}" for name in (
        "tensor_parallel_size", "dtype", "seed", "max_model_len", "gpu_memory_utilization", "max_num_seqs",
        "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching", "enable_chunked_prefill",
        "disable_custom_all_reduce", "cudagraph_capture_sizes", "block_size")},
    "kv_cache_memory_bytes": "rollout.kv_cache_tokens",
    "compilation_config.cudagraph_capture_sizes": "rollout.cudagraph_capture_sizes",
    "compilation_config.mode": "rollout.vllm_compile",
    "compilation_config.level": "rollout.vllm_compile",
    "compilation_config.cudagraph_mode": "rollout.vllm_compile",
}
"""Names (an entry of a table argument as `table.entry`) that a rollout.* key sets."""


def vllm_import_problem() -> str | None:
    """Why vLLM cannot be imported, found without importing it (None: it is installed)."""
    return None if importlib.util.find_spec("vllm") is not None else "No module named 'vllm'"


def vllm_llm_arg_names() -> frozenset[str]:
    """The keyword arguments `vllm.LLM(...)` takes: its own parameters and `EngineArgs`' fields
    (the rest of `**kwargs` goes to `EngineArgs`). Imports vLLM (ImportError if it cannot be)."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs) if f.init}
    names |= {p.name for p in inspect.signature(LLM.__init__).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(names)


def _vllm_version() -> str:
    try:
        return f" (vLLM {importlib.metadata.version('vllm')})"
    except importlib.metadata.PackageNotFoundError:
        return ""


def _missing_vllm(problem: str) -> ConfigError:
    return ConfigError(f'rollout.engine = "vllm" needs vLLM, which {sys.executable} cannot import ({problem}): '
                       'install it (pip install -e ".[vllm]" on a GPU machine), or set rollout.engine = "hf"')


def _entries(kwargs: dict[str, Any]) -> list[str]:
    """`name` of every entry and `name.entry` of every entry of a table value."""
    return [n for name, v in kwargs.items() for n in [name, *(f"{name}.{k}" for k in (v if isinstance(v, dict) else ()))]]


def check_engine_kwargs(rollout, arg_names: Callable[[], Collection[str]] | None = None) -> None:
    """Refuse `rollout.engine_kwargs` that cannot work (see the module's docstring). `arg_names`:
    where the names `vllm.LLM` takes come from (default `vllm_llm_arg_names`, which imports
    vLLM; tests give a list)."""
    kwargs = rollout.engine_kwargs
    if rollout.engine != "vllm":
        if kwargs:
            raise ConfigError(f"rollout.engine_kwargs ({', '.join(kwargs)}) are arguments of vllm.LLM but "
                              f'rollout.engine = {rollout.engine!r}: set rollout.engine = "vllm", or remove '
                              "rollout.engine_kwargs")
        return
    for name in _entries(kwargs):
        key = f"rollout.engine_kwargs.{name}"
        if name in FIXED:
            raise ConfigError(f"{key} cannot be set: {FIXED[name]}; remove it")
        if name in ROLLOUT_KEYS:
            raise ConfigError(f"{key} duplicates {ROLLOUT_KEYS[name]}: set {ROLLOUT_KEYS[name]} instead, and remove "
                              "it from rollout.engine_kwargs")
    if arg_names is None and not kwargs:
        problem = vllm_import_problem()  # cheap: vLLM itself is imported once the engine is built
        if problem is not None:
            raise _missing_vllm(problem)
        return
    try:
        known = set((arg_names or vllm_llm_arg_names)())
    except ImportError as e:
        raise _missing_vllm(f"{type(e).__name__}: {e}") from None
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known - set(FIXED)), n=3, cutoff=0.7)
            hint = f" (did you mean {' or '.join(ROLLOUT_KEYS.get(c, c) for c in close)}?)" if close else ""
            raise ConfigError(f"rollout.engine_kwargs.{name} is not an argument of vllm.LLM{_vllm_version()}{hint}: "
                              "fix or remove it (see vLLM's EngineArgs)")
