"""The RL algorithm, free of models and engines: advantages, policy/value losses, KL penalties and
controllers (algorithms), rollout-mismatch correction (rollout_correction), DAPO dynamic sampling
(dynamic_sampling) and validation metrics such as pass@k (val_metrics)."""
