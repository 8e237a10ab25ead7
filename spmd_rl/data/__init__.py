"""What a run reads and scores: Parquet prompts, their tokenization and the sampler (prompts), the
reward functions by data source (rewards), and the offline synthetic tasks (synthetic)."""
