"""A run's settings, free of torch (the launcher reads them before any GPU work): the root
dataclass, its choices, loading and the settings' own checks (run_config, each section's module),
TOML files and overrides (toml_io), the shipped presets (presets), and what a key missing from an
older version's config.toml means (older_configs). It imports nothing of the package but errors:
the checks that need the model, the engine or the machine are spmd_rl/preflight/'s."""
