"""Helpers the tests share, in one place (tests/README.md maps the folders):

- `ROOT` (here): the repository's root, the directory of pyproject.toml;
- `cpu_runs`: torchrun commands of the tiny CPU job, running them, reading their metrics.jsonl;
- `dist_utils`: `run_distributed`, a test body in N gloo processes;
- `multiturn_tools`: tools and environments the multi-turn tests name in their configs.

Fixtures (`tiny_run`, `tiny_run_without_saves_or_validations`, `tiny_default_run`, `moe_default_run`, `env`,
`small_filesystem`) are in tests/conftest.py.
"""

import os


def _repository_root(start: str) -> str:
    """The nearest directory above `start` that holds pyproject.toml."""
    here = os.path.dirname(os.path.abspath(start))
    while not os.path.isfile(os.path.join(here, "pyproject.toml")):
        parent = os.path.dirname(here)
        if parent == here:
            raise RuntimeError(f"no pyproject.toml above {start}: tests/ must be inside the repository")
        here = parent
    return here


ROOT = _repository_root(__file__)
