"""What a run reads and scores: Parquet prompts, their tokenization and the sampler (prompts), the
reward functions by data source (rewards), a reward model's scores of conversations (reward_model),
and the offline synthetic tasks (synthetic)."""
