"""Example environments for multi-turn rollouts (rollout.environment); copy one to start your own."""
