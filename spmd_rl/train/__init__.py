"""The training side of a step: log-probs and values with their losses (actor, critic), the
mini/micro-batch update loop (update), the old log-probs (old_logprobs), the optimizer and its
schedule (optim), and moving training state off the GPU while the engine generates (offload)."""
