"""The GPU check's plan: its checks (PLAN: what each runs, on how many GPUs, in about how many
seconds), the scheduler that runs them over the machine's GPUs, and the packing of the plan into
calls that each fit a time limit (scripts/gpu_check.py runs them).

Scheduling (`schedule`). Each check of PLAN is a pytest subprocess with CUDA_VISIBLE_DEVICES set to
its GPUs, its own work directory (--basetemp, logs under gpu_logs/<check>) and the vLLM compile
cache of its GPUs (VLLM_CACHE_ROOT per GPU set, reused by the next check there). Checks start in
PLAN order as soon as their GPUs are free: a 1-GPU check takes any free GPU (the 1-GPU checks run
side by side, one per GPU); a check of more GPUs waits for all of them, and no check after it in
PLAN starts before it. A `small` check (a tiny model with a fixed small KV cache) takes no GPU for
itself: it runs beside the others on the GPU(s) least loaded with small checks. A check started
where a small check runs gets SPMD_RL_GPU_SHARED=1 (its runs then skip the step-to-step check of
the device's free memory); a check started on GPUs of its own gets 0, and no small check joins it
later (a small check waits for GPUs that are free or already shared), so the drift check runs
wherever a check has its GPUs to itself. A small check itself is shared unless it is the last check
left. An `alone` check never has a small one beside it. A check may need fewer GPUs where the
cards have more memory (Check.gpus_by_memory: the 7B preset on 2 cards of >= 120 GiB, else on 4;
the cards' memory is nvidia-smi's memory.total of the smallest visible GPU, or --gpu-gib; unknown
counts as 80 GB cards). A check that needs more GPUs than the machine has is n/a; a check that
cannot start with its expected seconds left in the budget is NOT RUN, which fails the whole check
like a FAIL; a running check is stopped at the budget's end.

Expected seconds (2xH200, 2026-11-23: preset-7b 405 s, preset-0.5b 312 s, preset-1.5b over 370 s,
learning-1gpu 70 s, the learning-2gpu pair 60 s; the rest from earlier runs and estimates; each
preset starts vLLM with CUDA graphs twice (33-68 s each) and compiles its layers twice (22-36 s),
and the 7B one writes and reads an 86 GB checkpoint (40 s each way); families and reward-model:
215 s and 101 s, and the LoRA rows: lora 257 s, learning-lora 98 s, the one-GPU 7-8B LoRA presets
362-366 s, all on one H100 on 2026-11-26; side by side on four H100s, lora took 381 s and the LoRA
presets 417-454 s, which their seconds now are). The whole plan was about 30 minutes on
2xH200 and 27 on one GPU (the 2-GPU checks n/a) before families and reward-model (about 5 minutes
of 1-GPU work) and the LoRA rows (about 25); on two 80 GB GPUs preset-7b is n/a (it needs 4 of
them): with --max-call-s 570 and a quick set-up, 3 calls on eight 80 GB GPUs, 5 calls on four 80 GB GPUs,
7 on two 141 GB GPUs, 6 on two 80 GB ones, 9 on one (the tool preset at TP=2 needs two GPUs).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

PRESET_TEST = "tests/gpu/test_presets_gpu.py::test_preset_trains_saves_and_resumes"
TRAINER_TEST = "tests/gpu/test_trainer_gpu.py::test_training_steps_with_vllm"
LEARNING_TEST = "tests/gpu/test_learning_gpu.py::test_learns"
MOE_TEST = "tests/gpu/test_moe_gpu.py"
TAIL_S = 20.0
"""Seconds a call needs after its checks: results, the logs tarball, the table."""
MULTITURN_TEST = "tests/gpu/test_multiturn_learning_gpu.py::test_learns_a_task_that_needs_the_environment"


@dataclass(frozen=True)
class Check:
    name: str
    """What --only names."""
    targets: tuple[str, ...]
    """pytest node ids or files."""
    gpus: int = 1
    """GPUs it needs (of one host)."""
    secs: float = 60.0
    """Expected seconds on an H200 (the schedule printed at start; a check starts only if this much
    of the budget is left)."""
    small: bool = False
    """A tiny model with a fixed small KV cache: runs beside other checks on their GPUs."""
    alone: bool = False
    """No small check beside it: it needs its GPUs' whole memory (qwen7b on two GPUs), or its tests
    read the device's free memory with no switch to turn that off (the colocation check)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of its pytest."""
    archs: tuple[str, ...] = ()
    """Random-weight model directories it reads (tests/gpu/runs.py builds them in the background
    at the start, on the CPU)."""
    needs: tuple[str, ...] = ()
    """Python packages its tests import beyond the project's own (gpu_check refuses to start, naming
    the install, where one is missing: the check would fail after its other tests ran)."""
    gpus_by_memory: tuple[tuple[float, int], ...] = ()
    """(GiB per card, GPUs) pairs, in order: where every card has at least that much memory, the check
    needs that many GPUs instead of `gpus` (`for_cards`; test_presets_gpu.Preset has the same pairs,
    and picks the same count from torch's view of the cards)."""

    def gpus_on(self, card_gib: float) -> int:
        """The GPUs it needs on cards of `card_gib` GiB each (0: unknown, `gpus`)."""
        return next((n for gib, n in self.gpus_by_memory if card_gib and card_gib >= gib), self.gpus)


PLAN: list[Check] = [  # order = priority (the docstring's rules)
    # its model: drawn on its GPUs. The full 7B actor fits two 141 GB cards, not two 80 GB ones (the
    # start-up memory check refuses it there, naming 4 GPUs or LoRA): 4 of those
    Check("preset-7b", (f"{PRESET_TEST}[qwen7b]",), gpus=4, gpus_by_memory=((120.0, 2),), secs=430, alone=True),
    Check("learning-1gpu", (f"{LEARNING_TEST}[1gpu]",), secs=80, small=True),
    Check("learning-2gpu", (f"{LEARNING_TEST}[2gpu]",), gpus=2, secs=70, small=True),
    Check("preset-long", (f"{PRESET_TEST}[qwen1.5b-long]",), gpus=2, secs=250, archs=("qwen2-1.5b",)),
    Check("ulysses", ("tests/gpu/test_ulysses_gpu.py",), gpus=2, secs=150),
    # the tool preset through a TP=2 engine (multi-turn rollouts with tensor parallelism)
    Check("preset-0.5b-tool-tp2", (f"{PRESET_TEST}[qwen0.5b-gsm8k-tool-tp2]",), gpus=2, secs=330,
          archs=("qwen2-0.5b",)),
    # kernels before the presets: on one GPU the learning check runs beside it (whose tests read no
    # free memory), and the presets have their GPU to themselves (their free-memory drift check runs)
    Check("kernels", ("tests/gpu/test_checkpoint_gpu.py", "tests/gpu/test_offload_gpu.py",
                      "tests/gpu/test_sharded_init_gpu.py", "tests/gpu/test_packing_gpu.py",
                      "tests/gpu/test_fused_gpu.py", "tests/gpu/test_update_sync_gpu.py"), secs=150,
          needs=("liger_kernel",)),
    # Qwen3, Llama 3 and Gemma 3 shapes through vLLM, 3 steps each; a run of 4 steps with a 1.5B reward
    # model (secs: 1xH100, 2026-11-26: 215 s and 101 s)
    Check("families", ("tests/gpu/test_model_families_gpu.py",), secs=230,
          archs=("qwen3-0.6b", "llama3.2-1b", "gemma3-1b")),
    Check("reward-model", ("tests/gpu/test_reward_model_gpu.py",), secs=120, archs=("qwen2-0.5b",)),
    # a mixture of experts through vLLM's fused-MoE kernels (needs the vLLM bundle with its MoE kernels:
    # scripts/gpu_check.sh): Qwen3-30B-A3B's layers (4 of them), 3 steps with routing replay on and off;
    # LoRA on the tiny MoE (secs: 1xH200, 2026-11-28: moe 275 s, moe-lora 111 s)
    Check("moe", (f"{MOE_TEST}::test_moe_trains_through_vllm_and_replay_takes_the_engines_routes",), secs=330,
          archs=("qwen3-30b-a3b-4layers",)),
    Check("moe-lora", (f"{MOE_TEST}::test_lora_on_moe_syncs_the_base_and_the_adapter_into_vllm",), secs=120,
          archs=("qwen3-moe-tiny",)),
    # GLM-4.7-Flash's family (latent attention, sigmoid router) at its layer shape, and LoRA on its attention
    # (secs: 1xH200, 2026-11-29: the training run 95-106 s; the LoRA worker an estimate)
    Check("moe-glm", (f"{MOE_TEST}::test_glm_family_trains_through_vllm_with_replay",
                      f"{MOE_TEST}::test_glm_latent_attention_lora_reaches_vllm_as_preflight_says"), secs=230,
          archs=("glm-4.7-flash-4layers",)),
    # the 30B-A3B LoRA preset as shipped on four GPUs (secs: an estimate; its 61 GB model drawn on its GPUs)
    Check("preset-30b-a3b-lora", (f"{PRESET_TEST}[qwen3-30b-a3b-lora]",), gpus=4, secs=540, alone=True),
    # the full fine-tuning preset: 8 GPUs of >= 120 GiB, else 16 (secs: an estimate)
    Check("preset-30b-a3b", (f"{PRESET_TEST}[qwen3-30b-a3b]",), gpus=16, gpus_by_memory=((120.0, 8),), secs=600,
          alone=True),
    # LoRA: the adapter's sync into vLLM both ways (0.5B), its learning check, the one-GPU 7-8B presets
    Check("lora", ("tests/gpu/test_lora_gpu.py", f"{TRAINER_TEST}[lora-1gpu-adapter]",
                   f"{TRAINER_TEST}[lora-1gpu-merged]"), secs=390, archs=("qwen2-0.5b",)),
    Check("learning-lora", (f"{LEARNING_TEST}[lora-1gpu]",), secs=100, small=True),
    # partial rollouts: cut responses resumed as new vLLM requests, the learning check with them on
    Check("learning-partial", (f"{LEARNING_TEST}[partial-1gpu]",), secs=100, small=True),
    # (their 7-8B models drawn on their GPU, in seconds: the CPU prebuild of a 7B shape took ~4 minutes;
    # secs: the four LoRA rows side by side on 4xH100, 2026-11-26: lora 381 s, the presets 417-454 s)
    Check("preset-7b-lora", (f"{PRESET_TEST}[qwen7b-lora]",), secs=470),
    Check("preset-qwen3-8b-lora", (f"{PRESET_TEST}[qwen3-8b-lora]",), secs=470),
    Check("preset-llama-8b-lora", (f"{PRESET_TEST}[llama3.1-8b-lora]",), secs=470),
    Check("preset-0.5b", (f"{PRESET_TEST}[qwen0.5b-gsm8k]",), secs=320, archs=("qwen2-0.5b",)),
    Check("preset-1.5b", (f"{PRESET_TEST}[qwen1.5b-gsm8k]",), secs=450, archs=("qwen2-1.5b",)),
    Check("multiturn-learning", (MULTITURN_TEST,), secs=170, small=True),
    Check("preset-0.5b-tool", (f"{PRESET_TEST}[qwen0.5b-gsm8k-tool]",), secs=330, archs=("qwen2-0.5b",)),
    Check("ppo", (f"{TRAINER_TEST}[ppo-1gpu-shipped]",), secs=150, archs=("qwen2-0.5b",)),
    Check("export", ("tests/gpu/test_export_gpu.py",), secs=90),
    Check("colocate", ("tests/gpu/test_colocate.py",), secs=90, alone=True,
          env=(("SPMD_RL_GPU_LAYOUTS", "0.5b-tp1"),)),
    Check("offload", (f"{TRAINER_TEST}[grpo-1gpu-tp1-offload]",), secs=100),
]


@dataclass
class Row:
    item: str
    result: str  # PASS, FAIL, n/a, NOT RUN
    seconds: float
    gpus: str = "-"
    note: str = ""
    check: str = ""
    """The PLAN check it belongs to."""
    machine: str = ""
    """The GPUs it ran on (`machine_name`), for a table whose calls ran on several machines."""


@dataclass
class Slot:
    """A check placed on GPUs (what `schedule` hands the runner)."""
    check: Check
    gpus: tuple[int, ...]
    started: float = 0.0
    rows: list[Row] = field(default_factory=list)
    thread: threading.Thread | None = None


Runner = Callable[[Check, tuple[int, ...], float, bool], list[Row]]
"""runner(check, GPU indices, seconds it may take, shared: other checks may use its GPUs) -> its rows."""


def schedule(checks: list[Check], n_gpus: int, budget_s: float, runner: Runner, poll_s: float = 0.5,
             clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = print) -> list[Row]:
    """Run `checks` over `n_gpus` GPUs under `budget_s` seconds (the module's docstring); rows in
    PLAN order."""
    start = clock()
    deadline = start + budget_s
    results: dict[int, list[Row]] = {}
    pending = []
    for i, c in enumerate(checks):
        if c.gpus > n_gpus:
            results[i] = [Row(c.name, "n/a", 0.0, "-", f"needs {c.gpus} GPUs, {n_gpus} visible", c.name)]
        else:
            pending.append(i)
    busy: dict[int, int] = {}  # GPU -> index of the big check on it
    shared_big: set[int] = set()  # big checks started beside a small one: more small ones may join them
    small_load = [0] * max(n_gpus, 1)
    running: dict[int, Slot] = {}

    def launch(i: int, gpus: tuple[int, ...], shared: bool) -> None:
        slot = Slot(checks[i], gpus, clock())
        left = deadline - clock()

        def work() -> None:
            try:
                slot.rows = runner(slot.check, gpus, left, shared)
            except Exception as e:  # a broken check is a FAIL with its reason; the others go on
                slot.rows = [Row(slot.check.name, "FAIL", clock() - slot.started, gpu_label(gpus),
                                 f"{type(e).__name__}: {e}"[:120])]
            for row in slot.rows:
                row.check = row.check or slot.check.name

        slot.thread = threading.Thread(target=work, daemon=True)
        running[i] = slot
        say(f"[gpu_check] {checks[i].name}: started on GPU {gpu_label(gpus)} at {clock() - start:.0f}s"
            + (", beside other checks (its free-memory drift check is off)" if shared else ""))
        slot.thread.start()

    while pending or running:
        for i, slot in list(running.items()):
            if not slot.thread.is_alive():
                results[i] = slot.rows
                del running[i]
                for g in slot.gpus:
                    if busy.get(g) == i:
                        del busy[g]
                if slot.check.small:
                    for g in slot.gpus:
                        small_load[g] -= 1
                say(f"[gpu_check] {slot.check.name}: done in {clock() - slot.started:.0f}s")
        for i in list(pending):
            c = checks[i]
            left = deadline - clock()
            if left < c.secs:
                results[i] = [Row(c.name, "NOT RUN", 0.0, "-", f"{left:.0f}s of the budget left, it needs about "
                                  f"{c.secs:.0f}s", c.name)]
                pending.remove(i)
                continue
            if c.small:  # on GPUs with no big check, or whose big check was started as shared
                allowed = [g for g in range(n_gpus) if g not in busy or busy[g] in shared_big]
                if len(allowed) < c.gpus:
                    continue
                order = sorted(allowed, key=lambda g: (small_load[g], g in busy, g))
                gpus = tuple(sorted(order[:c.gpus]))
                shared = any(g in busy or small_load[g] for g in gpus) or len(pending) > 1
                for g in gpus:
                    small_load[g] += 1
            else:
                free = [g for g in range(n_gpus) if g not in busy and not (c.alone and small_load[g])]
                if len(free) < c.gpus:
                    if c.gpus > 1:
                        break  # it waits for all its GPUs, and nothing after it goes first
                    continue
                gpus = tuple(free[:c.gpus])
                shared = any(small_load[g] for g in gpus)
                for g in gpus:
                    busy[g] = i
                if shared:
                    shared_big.add(i)
            pending.remove(i)
            launch(i, gpus, shared)
        if pending or running:
            time.sleep(poll_s)
    return [row for i in sorted(results) for row in results[i]]


def expected_schedule(checks: list[Check], n_gpus: int) -> tuple[list[str], float]:
    """The schedule the expected seconds give (printed at start, before any GPU time is spent):
    its lines and its expected total seconds. It places the checks as `schedule` does: each on the
    GPUs that are free first (a check of several GPUs waits for as many, not for all the machine's,
    and no check after it starts before it), a small one beside the others."""
    t = [0.0] * n_gpus  # when each GPU's checks end
    after = 0.0  # no check starts before a check of several GPUs placed before it
    alone_until = 0.0  # a small check starts after the alone checks placed before it
    end = 0.0
    lines = []
    for c in checks:
        if c.gpus > n_gpus:
            lines.append(f"  {c.name:14s} n/a (needs {c.gpus} GPUs)")
            continue
        if c.small:
            lines.append(f"  {c.name:14s} beside the others ({c.gpus} GPU{'s' if c.gpus > 1 else ''}): "
                         f"{alone_until:5.0f} -> {alone_until + c.secs:5.0f}s")
            end = max(end, alone_until + c.secs)
            continue
        gpus = tuple(sorted(sorted(range(n_gpus), key=lambda g: (t[g], g))[:c.gpus]))
        begin = max([after, *(t[g] for g in gpus)])
        finish = begin + c.secs
        lines.append(f"  {c.name:14s} GPU {gpu_label(gpus)}: {begin:5.0f} -> {finish:5.0f}s")
        for g in gpus:
            t[g] = finish
        if c.gpus > 1:
            after = begin
        if c.alone:
            alone_until = max(alone_until, finish)
    total = max([end, *t])
    lines.append(f"  expected total: {total:.0f}s")
    return lines, total


def split_calls(checks: list[Check], n_gpus: int, seconds: float) -> list[list[Check]]:
    """`checks` in groups whose expected schedule fits `seconds` each, one group per call: the
    largest first (GPU-seconds; small checks last, they take no GPU of their own), each into the
    first group it fits in; each group then runs in PLAN order, and the groups go in the order of
    their first check (a check longer than `seconds` by itself gets a call of its own)."""
    order = {c.name: i for i, c in enumerate(checks)}

    def in_plan_order(group: list[Check]) -> list[Check]:
        return sorted(group, key=lambda c: order[c.name])

    groups: list[list[Check]] = []
    for c in sorted(checks, key=lambda c: (c.small, -min(c.gpus, n_gpus) * c.secs, order[c.name])):
        for g in groups:
            if expected_schedule(in_plan_order(g + [c]), n_gpus)[1] <= seconds:
                g.append(c)
                break
        else:
            groups.append([c])
    return sorted((in_plan_order(g) for g in groups), key=lambda g: order[g[0].name])


def default_budget(checks: list[Check], n_gpus: int) -> float:
    """The budget that follows the plan: twice its expected seconds plus 5 minutes."""
    return 2 * expected_schedule(checks, max(n_gpus, 1))[1] + 300


def for_cards(checks: list[Check], card_gib: float) -> list[Check]:
    """`checks` with the GPU count each needs on cards of `card_gib` GiB (Check.gpus_by_memory):
    what the scheduler and the plan use, so that a check needing more GPUs than the machine has is n/a."""
    return [dataclasses.replace(c, gpus=c.gpus_on(card_gib)) for c in checks]


def gpu_label(gpus: tuple[int, ...]) -> str:
    """The GPU column of a row: '0,1', or '-' for none."""
    return ",".join(str(g) for g in gpus) or "-"
