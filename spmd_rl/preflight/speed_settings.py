"""The settings that trade memory for speed, chosen at start where the config says "auto".

The keys (SPEED_KEYS): model.gradient_checkpointing and model.gradient_checkpointing_layers,
actor.max_token_len_per_gpu, actor.logprob_max_token_len_per_gpu, actor.offload_optimizer,
rollout.stay_awake, rollout.weights_stay_on_gpu, and the engine's rollout.max_num_seqs. A value the user set is kept.
Each training "auto" gets the value of the fastest candidate the memory plan
(spmd_rl/preflight/memory.py's `plan_for`) predicts to fit. The candidates, fastest first, one
setting before the next (a candidate earlier on the first setting comes first whatever the rest):

1. gradient checkpointing: off, then on with the fewest layers first (CHECKPOINT_SHARES): each
   checkpointed layer runs its forward twice;
2. the optimizer offload: off, then on: two host<->device copies of the moments per optimizer step;
3. the update's token budget: largest first (fewer micro-batches, each with its launches and idle
   time), from the tokens one GPU holds of a mini-batch (at most BUDGET_MAX) down to the longest
   sequence, halving;
4. the vLLM engine awake between steps, then asleep (not with rollout.offload_train_states): awake, a
   step saves its wake-up and sleep (the KV cache mapped and unmapped, PyTorch's cache emptied), and
   training runs beside the whole engine, which fits where the KV cache is sized to the step
   (rollout.kv_cache_tokens);
5. the engine's weights kept on the GPU while it sleeps, then sent to host memory (with LoRA's adapter
   sync only; off otherwise): kept, a step saves their copy to the host at sleep and back at wake-up;
6. the log-prob pass's token budget: likewise, from the tokens one GPU holds of the whole step.

A candidate fits when every training phase of its plan (the updates and the log-prob pass) stays
within (1 - MARGIN) of the device and the whole plan fits (MemoryPlan.fits: generation takes the
engine's share, which vLLM allocates exactly). The first that fits is chosen; where none does, the
last (the least memory), which trainer.memory_check then refuses with its fixes. Without a GPU
(no device memory to compare) or where the plan cannot read the model's shape, "auto" takes
NO_GPU_VALUES (the keys' defaults), so a CPU run resolves alike every time.

rollout.max_num_seqs does not change the plan (vLLM's share of the device is fixed by
rollout.gpu_memory_utilization): "auto" builds the engine for the most sequences of one engine call,
up to SEQS_MAX (`engine_sequences`), and each call runs as many of them at once as the KV cache holds
at the responses' expected lengths (spmd_rl/rollout/vllm/running_cap.py).

`resolve(cfg, world_size, device_total)` writes the values into the config before anything else
reads them and names the keys in `Config.auto_chosen` (config.toml notes them); the entry point
calls it once the process group exists (spmd_rl/build.py's choose_speed_settings) and logs
`SpeedChoice.line()`. A resumed run chooses again on its own GPUs: the same GPUs give the same
values, others may not, and the resume check logs every value that changed (none of these keys
changes what a checkpoint holds: preflight/resume.py).
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spmd_rl.config.actor import ActorConfig
from spmd_rl.config.checks import AUTO
from spmd_rl.config.model import ModelConfig
from spmd_rl.config.rollout import RolloutConfig
from spmd_rl.preflight import memory
from spmd_rl.runtime import memory_plan as mp

if TYPE_CHECKING:
    from spmd_rl.config.run_config import Config

CHECKPOINTING = "model.gradient_checkpointing"
LAYERS = "model.gradient_checkpointing_layers"
OFFLOAD = "actor.offload_optimizer"
UPDATE = "actor.max_token_len_per_gpu"
LOGPROB = "actor.logprob_max_token_len_per_gpu"
AWAKE = "rollout.stay_awake"
STAY = "rollout.weights_stay_on_gpu"
SEQS = "rollout.max_num_seqs"
SPEED_KEYS = (CHECKPOINTING, LAYERS, OFFLOAD, UPDATE, AWAKE, STAY, LOGPROB, SEQS)
"""The keys that take "auto"."""

NO_GPU_VALUES: dict[str, Any] = {
    CHECKPOINTING: ModelConfig.gradient_checkpointing, LAYERS: ModelConfig.gradient_checkpointing_layers,
    OFFLOAD: ActorConfig.offload_optimizer, UPDATE: ActorConfig.max_token_len_per_gpu,
    LOGPROB: ActorConfig.logprob_max_token_len_per_gpu, AWAKE: RolloutConfig.stay_awake,
    STAY: RolloutConfig.weights_stay_on_gpu,
    SEQS: RolloutConfig.max_num_seqs}
"""What "auto" takes where the plan cannot compare (no GPU, a shape it cannot read): each key's default."""

MARGIN = 0.10
"""The share of the device a chosen candidate's training phases leave free: the plan is within about
10% of measured peaks (tests/runtime/test_memory_plan.py)."""

BUDGET_MAX = 32768
"""The largest token budget "auto" picks: the largest at which the plan's activation terms were checked
against measured peaks (docs/performance.md, "Memory peaks per preset"). Above it the plan is untested,
and a budget past what fills the GPU adds no speed."""

SEQS_MAX = 512
"""The most sequences "auto" lets the engine decode at once: vLLM captures CUDA graphs for decode
batches up to 512 by default, and a larger batch decodes without them."""

CHECKPOINT_SHARES = (0.25, 0.5, 0.75, 1.0)
"""model.gradient_checkpointing_layers tried where "auto" turns checkpointing on, fewest first."""


# --------------------------------------------------------------------------- the candidates


def auto_keys(cfg: Config) -> list[str]:
    """The speed keys set to "auto"."""
    return [k for k in SPEED_KEYS if value_of(cfg, k) == AUTO]


def value_of(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def set_value(cfg: Config, key: str, value: Any) -> None:
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)


def checkpointing_options(cfg: Config, world_size: int) -> list[dict[str, Any]]:
    on, share = cfg.model.gradient_checkpointing, cfg.model.gradient_checkpointing_layers
    shares = CHECKPOINT_SHARES if share == AUTO else (share,)
    with_it = [{CHECKPOINTING: True, LAYERS: s} for s in shares]
    without = [{CHECKPOINTING: False, LAYERS: NO_GPU_VALUES[LAYERS] if share == AUTO else share}]
    return without + with_it if on == AUTO else (with_it if on else without)


def offload_options(cfg: Config, world_size: int) -> list[dict[str, Any]]:
    offload = cfg.actor.offload_optimizer
    return [{OFFLOAD: v} for v in ((False, True) if offload == AUTO else (offload,))]


def budget_ladder(top: int, floor: int) -> list[int]:
    """`top`, the powers of two below it and above `floor`, then `floor`: largest first."""
    top = max(top, floor)
    ladder, p = [top], 1 << (top - 1).bit_length() - 1 if top > 1 else 0
    while p > floor:
        ladder.append(p)
        p //= 2
    return list(dict.fromkeys([*ladder, floor]))


def budget_options(cfg: Config, world_size: int, key: str, rows: int) -> list[dict[str, Any]]:
    """`key`'s values: itself where set, else (packed sequences) the ladder from the tokens of
    `rows` sequences per data-parallel rank down to the longest sequence, per GPU of a sequence-
    parallel group (actor.check_batches' floor); 0 (micro-batches of sequences) without packing."""
    value = value_of(cfg, key)
    if value != AUTO:
        return [{key: value}]
    if not cfg.model.remove_padding:
        return [{key: 0}]
    sp, longest = max(cfg.trainer.ulysses_size, 1), cfg.data.max_prompt_length + cfg.data.max_response_length
    top = min(math.ceil(rows * longest / sp), BUDGET_MAX)
    return [{key: b} for b in budget_ladder(top, math.ceil(longest / sp))]


def update_options(cfg: Config, world_size: int) -> list[dict[str, Any]]:
    ranks = world_size // max(cfg.trainer.ulysses_size, 1)
    return budget_options(cfg, world_size, UPDATE, cfg.actor.mini_batch_rows(cfg.rollout.n, ranks))


def awake_options(cfg: Config, world_size: int) -> list[dict[str, Any]]:
    """Awake, then asleep, for the vLLM engine without rollout.offload_train_states (asleep otherwise)."""
    awake = cfg.rollout.stay_awake
    if awake != AUTO:
        return [{AWAKE: awake}]
    can = cfg.rollout.engine == "vllm" and not cfg.rollout.offload_train_states
    return [{AWAKE: True}, {AWAKE: False}] if can else [{AWAKE: False}]


def stay_options(cfg: Config, world_size: int) -> list[dict[str, Any]]:
    """Kept on the GPU, then not, where the engine can keep them (LoRA's adapter sync in vLLM)."""
    stay = cfg.rollout.weights_stay_on_gpu
    if stay != AUTO:
        return [{STAY: stay}]
    return [{STAY: True}, {STAY: False}] if cfg.vllm_applies_adapter() else [{STAY: False}]


def logprob_options(cfg: Config, world_size: int) -> list[dict[str, Any]]:
    ranks = world_size // max(cfg.trainer.ulysses_size, 1)
    return budget_options(cfg, world_size, LOGPROB, cfg.data.train_batch_size * cfg.rollout.n // ranks)


AXES = (checkpointing_options, offload_options, update_options, awake_options, stay_options, logprob_options)
"""The settings in the order of the module docstring, the first the most significant."""


def engine_sequences(cfg: Config, world_size: int, device_total: float, shape: mp.ModelShape) -> tuple[int, str]:
    """rollout.max_num_seqs's "auto" (the module docstring) and why, in words: the most sequences of
    one engine call (Config.engine_sequences_per_call), at most SEQS_MAX; the words add what the KV
    cache is predicted to hold at full length (max_model_len), the first call's cap where its limits
    are data.max_response_length (spmd_rl/rollout/vllm/running_cap.py). The key's default with the
    HF engine, which has no KV cache to size."""
    r = cfg.rollout
    if r.engine != "vllm":
        return NO_GPU_VALUES[SEQS], ""
    calls = cfg.engine_sequences_per_call(world_size)
    length = cfg.engine_max_model_len()
    fit = memory.engine_share_kv_tokens(cfg, shape, device_total) // length
    value = max(1, min(calls, SEQS_MAX))
    bound = "a call's most" if value == calls else "vLLM's CUDA graphs' most"
    return value, (f"{bound} (a call has up to {calls}); each call runs as many as the KV cache holds at the "
                   f"responses' expected lengths (it holds {fit} sequences of {length} tokens)")


def candidates(cfg: Config, world_size: int) -> list[dict[str, Any]]:
    """Every combination of SPEED_KEYS' values, fastest first."""
    options = [axis(cfg, world_size) for axis in AXES]
    return [{k: v for part in parts for k, v in part.items()} for parts in itertools.product(*options)]


# --------------------------------------------------------------------------- fitting


def training_phases(plan: mp.MemoryPlan) -> list[mp.Phase]:
    return [p for p in plan.phases if p.name not in memory.GENERATION_PHASES]


def over(plan: mp.MemoryPlan) -> mp.Phase | None:
    """The first phase that keeps the candidate from fitting (None: it fits): a training phase over
    (1 - MARGIN) of the device, or any phase over the device."""
    limit = (1 - MARGIN) * plan.device_total
    return next((p for p in plan.phases if p.total > (plan.device_total if p.name in memory.GENERATION_PHASES
                                                      else limit)), None)


def plan_of(work: Config, candidate: dict[str, Any], world_size: int, device_total: float, shapes) -> mp.MemoryPlan:
    """The plan of `work` (a copy of the config, changed in place) with `candidate`'s values."""
    for key, value in candidate.items():
        set_value(work, key, value)
    return memory.plan_for(work, world_size, device_total, shapes)


@dataclass
class SpeedChoice:
    """What "auto" chose: `values` for every SPEED_KEY (a set one's its own), the chosen values'
    plan and, for each setting whose faster value did not fit, that value's plan."""

    keys: list[str]  # the keys that were "auto"
    values: dict[str, Any]
    plan: mp.MemoryPlan | None = None
    faster: list[tuple[dict[str, Any], mp.MemoryPlan]] | None = None
    why_not_planned: str = ""  # without a plan: no GPU, or the shape's error
    fits: bool = True
    seqs_why: str = ""  # rollout.max_num_seqs's bound, where "auto" chose it with a plan

    def line(self) -> str:
        chosen = describe(self.values, self.keys)
        if self.plan is None:
            return f"speed settings (auto): {chosen} ({self.why_not_planned}: the keys' defaults)"
        total = self.plan.device_total
        peak = max(training_phases(self.plan), key=lambda p: p.total)
        where = (f"training peak {peak.total / mp.GiB:.1f} GiB in {peak.name}, within {1 - MARGIN:.0%} of "
                 f"{total / mp.GiB:.1f} GiB")
        if not self.fits:
            return (f"speed settings (auto): nothing fits within {1 - MARGIN:.0%} of {total / mp.GiB:.1f} GiB; the "
                    f"least memory: {chosen} (training peak {peak.total / mp.GiB:.1f} GiB in {peak.name})")
        rejected = [f"{describe(values, list(values))} {over(plan).total / mp.GiB:.1f} GiB in {over(plan).name}"
                    for values, plan in self.faster or []]
        why = f"; faster would not fit: {', '.join(rejected)}" if rejected else "; each at its fastest"
        seqs = f"; vLLM sequences: {self.seqs_why}" if self.seqs_why else ""
        return f"speed settings (auto): {chosen} ({where}{why}{seqs})"


def describe(values: dict[str, Any], keys: list[str]) -> str:
    """`keys`' values in words (the two checkpointing keys as one)."""
    words = []
    if CHECKPOINTING in keys or LAYERS in keys:
        on, share = values.get(CHECKPOINTING, True), values.get(LAYERS, 1.0)
        words.append("gradient checkpointing " + (("on" if share == 1.0 else f"on {share:g} of the layers") if on
                                                  else "off"))
    if OFFLOAD in keys:
        words.append("optimizer offloaded" if values[OFFLOAD] else "optimizer on the GPU")
    if UPDATE in keys:
        words.append(f"update {values[UPDATE]} tokens/GPU" if values[UPDATE] else "update by sequences")
    if AWAKE in keys and values[AWAKE]:  # an engine awake keeps its weights: no words on them
        words.append("vLLM awake between steps")
    elif STAY in keys:
        words.append("vLLM weights kept on the GPU asleep" if values[STAY] else "vLLM weights off the GPU asleep")
    elif AWAKE in keys:
        words.append("vLLM asleep while training")
    if LOGPROB in keys:
        words.append(f"log-prob {values[LOGPROB]} tokens/GPU" if values[LOGPROB] else "log-prob twice the update's")
    if SEQS in keys:
        words.append(f"vLLM up to {values[SEQS]} sequences at once")
    return ", ".join(words)


def faster_neighbours(chosen: dict[str, Any], cfg: Config, world_size: int) -> list[dict[str, Any]]:
    """For each setting not at its fastest value: its next faster value, the rest as chosen."""
    out = []
    for axis in AXES:
        options = axis(cfg, world_size)
        i = next(i for i, o in enumerate(options) if all(chosen[k] == v for k, v in o.items()))
        if i > 0:
            out.append(options[i - 1])
    return out


def choose(cfg: Config, world_size: int, device_total: float | None) -> SpeedChoice:
    """The values of the fastest candidate that fits (the module docstring), for every SPEED_KEY."""
    keys = auto_keys(cfg)
    defaults = {k: NO_GPU_VALUES[k] if k in keys else value_of(cfg, k) for k in SPEED_KEYS}
    if device_total is None:
        return SpeedChoice(keys, defaults, why_not_planned="no GPU")
    try:
        shapes = (memory.model_shape(cfg), memory.model_shape(cfg, critic=True) if cfg.use_critic else None)
    except (KeyError, TypeError, ValueError) as e:
        return SpeedChoice(keys, defaults, why_not_planned=f"the model's shape is not predicted: {e}")
    seqs, seqs_why = (engine_sequences(cfg, world_size, device_total, shapes[0]) if SEQS in keys
                      else (value_of(cfg, SEQS), ""))
    work = copy.deepcopy(cfg)
    options = candidates(cfg, world_size)
    for candidate in options:
        plan = plan_of(work, candidate, world_size, device_total, shapes)
        if over(plan) is None:
            faster = [(values, plan_of(work, {**candidate, **values}, world_size, device_total, shapes))
                      for values in faster_neighbours(candidate, cfg, world_size)]
            return SpeedChoice(keys, {**candidate, SEQS: seqs}, plan, faster, seqs_why=seqs_why)
    return SpeedChoice(keys, {**options[-1], SEQS: seqs}, plan, fits=False, seqs_why=seqs_why)


def resolve(cfg: Config, world_size: int, device_total: float | None) -> SpeedChoice | None:
    """Replace every "auto" of SPEED_KEYS in `cfg` by `choose`'s value and record them in
    `cfg.auto_chosen`; None (nothing changed) when no key is "auto"."""
    choice = choose(cfg, world_size, device_total) if auto_keys(cfg) else None
    if choice is None:
        return None
    for key in choice.keys:
        set_value(cfg, key, choice.values[key])
    cfg.auto_chosen = tuple(choice.keys)
    return choice
