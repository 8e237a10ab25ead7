"""Shipped presets: `--config NAME` finds them from any directory, also after a non-editable install."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from spmd_rl.errors import ConfigError
from tests.helpers import ROOT

TINY = os.path.join(ROOT, "configs", "tiny-cpu.toml")


def test_presets_are_found_by_name_and_listed(tmp_path, monkeypatch):
    from spmd_rl.config.presets import describe_presets, resolve_config
    from spmd_rl.ppo import main

    monkeypatch.chdir(tmp_path)  # not the repository root: configs/X.toml is not a relative path here
    assert resolve_config("tiny-cpu.toml") == resolve_config("tiny-cpu") == TINY
    (tmp_path / "tiny-cpu.toml").write_text("# mine\n")
    assert resolve_config("tiny-cpu.toml") == "tiny-cpu.toml"  # a file in cwd wins over the preset
    with pytest.raises(ConfigError, match="not a preset: .*tiny-cpu"):
        resolve_config("nope.toml")
    listing = describe_presets()
    assert re.search(r"^tiny-cpu +The default job: GRPO on a tiny random-init", listing, re.M), listing
    assert all(f[:-5] in listing for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".toml"))
    assert main(["--list-configs"]) == 0


def test_non_editable_install_ships_the_presets(tmp_path):
    """... and every package of the source tree (a folder with an __init__.py missing from
    pyproject's list would be left out of the install)."""
    packages = sorted(os.path.relpath(d, ROOT) for d, _, files in os.walk(os.path.join(ROOT, "spmd_rl"))
                      if "__init__.py" in files)
    src = tmp_path / "src"
    src.mkdir()
    for item in ("pyproject.toml", "README.md", "spmd_rl", "launch", "configs"):
        path = os.path.join(ROOT, item)
        if os.path.isdir(path):
            shutil.copytree(path, src / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / item)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True)
    shutil.rmtree(src)  # nothing may come from the source tree any more
    missing = [p for p in packages if not (target / p / "__init__.py").is_file()]
    assert not missing, f"packages not installed (add them to pyproject.toml's packages): {missing}"
    code = ("from spmd_rl.config.presets import resolve_config, describe_presets; "
            "print(resolve_config('tiny-cpu')); print(describe_presets())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(target)),
                         check=True, capture_output=True, text=True).stdout
    assert out.splitlines()[0] == str(target / "spmd_rl" / "configs" / "tiny-cpu.toml")
    assert sorted(line.split()[0] for line in out.splitlines()[1:]) == sorted(
        f[:-5] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".toml"))
