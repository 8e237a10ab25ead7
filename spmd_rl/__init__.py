"""spmd_rl: SPMD reinforcement-learning post-training for LLMs (PPO, GRPO, RLOO, REINFORCE++).

One process per GPU (torchrun), an FSDP2 actor and a colocated rollout engine in every rank.
Entry point: `python -m spmd_rl.ppo --config configs/X.toml key.sub=value ...`.
"""

__version__ = "0.1.0"
