"""The process and its GPUs: torch.distributed and device meshes (distributed), sequence-parallel
groups (sp_groups), host tensors onto the device (transfer), device memory (gpu_memory), ordered
teardown (lifecycle), signals and requeue (preemption), and one run per run_dir (run_lock)."""
