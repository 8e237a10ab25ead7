"""What a run reports: TensorBoard and console metrics (metrics), torch.profiler per phase
(step_profiler), and timed start-up phases (startup)."""
