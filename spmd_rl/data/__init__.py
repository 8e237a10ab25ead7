"""What a run reads and scores: Parquet prompts, their tokenization and the sampler (prompts), the
reward functions by data source (rewards), and the offline synthetic tasks (synthetic). A reward
model, a GPU model, lives beside the other models (spmd_rl/model/reward_model.py)."""
