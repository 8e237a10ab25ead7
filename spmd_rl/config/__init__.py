"""A run's settings, free of torch (the launcher reads them before any GPU work): the root
dataclass, its choices, loading and validation (run_config), TOML files and overrides (toml_io),
the shipped presets (presets), what may change at a resume (resume_check), and what a key missing
from an older version's config.toml means (older_configs)."""
