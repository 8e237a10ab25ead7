"""Tools for multi-turn rollouts ([[rollout.tools]]): plain typed functions with docstrings."""
