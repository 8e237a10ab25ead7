"""Training learns, through the colocated vLLM engine: the GPU tests of real shapes use
random weights, whose reward is 0, so their GRPO advantages and gradients are 0 and would not
notice an update that goes nowhere.

A small random-weight Qwen2 (model.arch = "small": 4 layers, hidden 256, head_dim 64, the
character tokenizer's 64-token vocabulary) learns the synthetic successor task (prompt "384",
answer "5") by GRPO alone, from reward about 0.02 to well above it in 40 steps, on the shipped
GPU path: fp32 masters, bf16 compute, packed rows, vLLM (eager: the model is too small for CUDA
graphs to matter, and eager starts in seconds) with a fixed 256 MiB KV cache (512 responses of 18 tokens need 20 MB), so that it can run
beside another check on the same GPU. One optimizer step per step (one mini-batch): the step is
on-policy, and the old log-probs come from the update's forward.

The setting, chosen from CPU runs (2 gloo ranks, HF engine, fp32; reward per step): lr 1e-3 with 4
optimizer steps per step (the earlier setting) rose to 0.5-0.69 and fell back to 0.19-0.44 as its
entropy collapsed to 0.05; lr 3e-4 with one step rose steadily but slowly (0.52 at step 40, 0.83 at
60); lr 1e-3 with one step, 32 prompts x 16 samples: at step 40, the mean of the last 5 steps was
0.65, 0.51, 0.64 and 0.66 over four seeds, from 0.01-0.03 at step 1, with no collapse over 60
steps (0.77 at 60). THRESHOLD = 0.35 leaves room for bf16 and the engine's own sampling, and is over ten
times step 1's.

Cases: `1gpu`; `2gpu` runs trainer.fsdp_size = 0 (FSDP over both ranks) and 1 (each rank a
replica: the gradients all-reduced) at once, on the same two GPUs, rollout TP=1 x 2 replicas. Both
must learn, and their first two steps must agree on what depends on the weights and the gradient
(`same_update`):
- step 1's rollouts (the same seeds and data): reward, its spread, lengths, exactly equal. They
  are what the comparison stands on, not a check of the layouts: step 1's pg_loss, for one, is
  minus the token-mean advantage these rollouts fix (the update is on-policy: ratio exactly 1), so
  it is not compared.
- step 1's grad norm within 1e-3 relative: the same bf16 forward and backward on the same rows,
  the fp32 gradients of two ranks summed through a reduce-scatter or an all-reduce; a missed sync
  or a wrong average shows tens of percent (a sum instead of a mean: 2x).
- after the update, step 2: its rollouts exactly equal again (the engine samples from the synced
  weights: an optimizer step or a weight sync that differs between the layouts changes them),
  the actor's entropy on them within 5e-4 relative and the grad norm within 1e-3. Not the norm of
  the parameter change: AdamW's first step moves every weight by about lr whatever the gradient's
  scale, so that norm would not see a wrong average.
Measured noise (CPU, 2 gloo ranks, the HF engine, this LEARN setting with trainer.device="cpu",
rollout.engine="hf", 3 steps): fsdp_size 0 against 1, bf16 compute: grad norm 7.7e-7 relative
at step 1 (1.0e-6 at 2, 9.6e-7 at 3), entropy and rollouts identical at every step; fp32:
2.9e-7. The same layout in bf16 against fp32 (every rounding different, the bound of bf16 noise):
grad norm 3.2e-4 at step 1, entropy 5.4e-6, 3.8e-5 at step 2. The tolerances sit above that bound;
what they must catch sits far above them: an update 10% smaller (lr 9e-4 against 1e-3) moves step
2's entropy by 2.4e-3, its grad norm by 6% and its reward (0.0430 against 0.0449). On the GPU
(2xH200) step 1's grad norm agreed to 5 digits (0.78667). With two ranks the summed gradients are
the same bits in both layouts (a + b = b + a), hence the same weights after step 1 and the same
step-2 rollouts; if the GPU ever samples step 2 differently with step 1's grad norm equal, that
assumption broke, not the update.
"""

from __future__ import annotations

import pytest
from runs import SMALL_ON_VLLM, check_run, keep_logs, read_metrics, skip_reason, summary, train_side_by_side

pytestmark = pytest.mark.gpu

STEPS = 40
THRESHOLD = 0.35
LEARN = SMALL_ON_VLLM
CASES = {"1gpu": [("1gpu", 1, [])], "2gpu": [("2gpu-fsdp0", 2, ["trainer.fsdp_size=0"]),
                                             ("2gpu-fsdp1", 2, ["trainer.fsdp_size=1"])],
         "lora-1gpu": [("lora-1gpu", 1, ["LORA_MODEL", "model.lora_rank=8", "model.lora_alpha=32", "actor.lr=3e-3"])],
         "partial-1gpu": [("partial-1gpu", 1, ["rollout.partial_rollouts=true", "rollout.partial_chunk_tokens=1",
                                               'algorithm.rollout_is="token"'])]}
"""lora-1gpu: the adapter alone learns (rank 8 on every linear layer, the adapter sync into vLLM's LoRA
layers, model.lora_sync's default): the samples come from the engine, so an adapter that does not reach
it leaves the reward at step 1's. LoRA leaves the embeddings and the tied head frozen, and at the
small shape's initializer_range 0.02 the random head's logits cannot put enough mass on the right
digit whatever the decoder does (tests/e2e/test_lora_e2e.py says why): the model is the small shape at
0.1. The setting, from CPU runs (HF engine, 32 prompts x 16, one mini-batch; last-5-step mean reward
at step 40, from 0.01-0.03 at step 1): lr 3e-3 gave 0.73-0.85 in fp32 over three seeds and
0.71-0.86 in bf16 with packed rows over three; 2e-3 and 5e-3, rank 32 and initializer_range 0.05
all passed too.
partial-1gpu: partial rollouts (rollout.partial_rollouts) resuming cut responses as new vLLM requests:
every other step trains groups sampled one version earlier, so the engine/actor log-prob gap holds the
staleness as well (MAX_MISMATCH); tests/e2e/test_partial_e2e.py is its CPU twin."""
MAX_MISMATCH = {"partial-1gpu": 1.0}
"""rollout/logprob_diff_mean's bound where it is not check_run's 0.05 (the engine's numerics alone)."""


def lora_model_dir(tmp_path) -> str:
    """The small shape's config.json at initializer_range 0.1 (random weights: model.init = "random")."""
    from spmd_rl.model.loading import random_model_config

    config = random_model_config("small")
    config.initializer_range = 0.1
    path = tmp_path / "small-init0.1"
    config.save_pretrained(path)
    return str(path)


def case_overrides(extra: list[str], tmp_path) -> list[str]:
    """A case's overrides; "LORA_MODEL" stands for lora_model_dir's (in place of the small preset arch)."""
    if "LORA_MODEL" not in extra:
        return extra
    return ['model.arch=""', f'model.path="{lora_model_dir(tmp_path)}"', *[e for e in extra if e != "LORA_MODEL"]]


def learned(name: str, run_dir, log: str, shared: bool) -> dict[int, dict]:
    steps = check_run(name, run_dir, (STEPS,), [log], max_mismatch=MAX_MISMATCH.get(name, 0.05), shared=shared)
    rewards = [steps[s]["reward/mean"] for s in sorted(steps)]
    last = sum(rewards[-5:]) / 5
    print(name, "reward per step", " ".join(f"{r:.2f}" for r in rewards))
    assert last >= THRESHOLD and last >= rewards[0] + 0.25, (name, f"last 5 steps' mean reward {last:.3f}", rewards)
    return steps


@pytest.mark.parametrize("case", list(CASES))
def test_learns(case, tmp_path):
    runs = CASES[case]
    reason = skip_reason(runs[0][1])
    if reason:
        pytest.skip(reason)
    results = {}
    done = train_side_by_side([(name, nproc, [*LEARN, *case_overrides(extra, tmp_path)]) for name, nproc, extra in runs],
                              tmp_path, STEPS)
    for name, (run_dir, text) in done.items():
        results[name] = learned(name, run_dir, text, shared=len(runs) > 1)  # the 2-GPU pair shares its GPUs
        keep_logs(name, [text], run_dir)
        print(summary(name, results[name]))
    if case == "2gpu":
        same_update(read_metrics(tmp_path / "2gpu-fsdp0"), read_metrics(tmp_path / "2gpu-fsdp1"))


ROLLOUT_ONLY = ("reward/mean", "reward/std", "response/length_mean", "prompt/length_mean")


def same_update(a: dict[int, dict], b: dict[int, dict]) -> None:
    """The two layouts' steps 1 and 2 agree (the module's docstring gives the tolerances and why)."""
    for step in (1, 2):
        for key in ROLLOUT_ONLY:
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key],
                                                  f"step {step}'s rollouts differ between the two layouts"
                                                  + (": the update or the weight sync differs" if step == 2 else ""))
        assert a[step]["actor/grad_norm"] > 1e-4, (step, "no real gradient: the comparison would prove nothing")
        assert a[step]["actor/grad_norm"] == pytest.approx(b[step]["actor/grad_norm"], rel=1e-3), (
            step, a[step]["actor/grad_norm"], b[step]["actor/grad_norm"])
    assert a[2]["actor/entropy"] == pytest.approx(b[2]["actor/entropy"], rel=5e-4), (a[2]["actor/entropy"],
                                                                                  b[2]["actor/entropy"])
