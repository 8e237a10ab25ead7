"""What a key missing from a config.toml written by an older version means.

A run writes every key of its version into `<run_dir>/config.toml`; a key added since is missing
there. The run that wrote it behaved as that version did, so the resume check (spmd_rl/preflight/resume.py)
reads a missing key as the value that reproduces that behaviour, never as "no value". The rule,
for every key added to the config:

- where the key's dataclass default is "off" (the behaviour before the key existed: no LoRA
  adapter, no reward model, the tokenizer's own chat template, a weight of 1), that default is
  the value, and nothing is written here;
- otherwise OLD_BEHAVIOUR gives the value, with the reason beside it. A key added with a default
  that changes what a run does belongs here in the same change that adds it
  (tests/config/test_older_configs.py checks this table against the config.toml of every run directory
  in tests/fixtures/old_runs; docs/checkpoints.md).
"""

from __future__ import annotations

from typing import Any

OLD_BEHAVIOUR: dict[str, Any] = {
    "trainer.memory_check": "off",  # added with "error" as its default; versions before it checked no memory
    "trainer.log_samples": 0,  # added with 3 as its default; versions before it showed no samples
    "reward.warn_error_share": 1.0,  # added with 0.05; versions before it never warned of scoring errors
    "rollout.partial_pool_batches": 2,  # added with 3; before it partial rollouts' pool held two batches, no refill
    "rollout.lora_matmul": False,  # added with true; before it vLLM's Punica kernels applied the engine's adapter
}


def with_missing_keys(saved: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`saved` (section.key -> value, of a config.toml) with every key of `defaults` (today's
    dataclass defaults, flattened alike) it lacks, as the version that wrote it behaved."""
    return {**{k: OLD_BEHAVIOUR.get(k, v) for k, v in defaults.items()}, **saved}
