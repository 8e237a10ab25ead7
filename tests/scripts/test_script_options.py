"""Scripts launched by torchrun take only option names that no torchrun option starts with, and every
script of scripts/ starts as its docstring runs it (`python scripts/...py`, no PYTHONPATH).

torchrun's argparse parser classifies every argument, also those after the script: an option of the
script that is a prefix of torchrun's own (`--run` of `--run-path`, `--n` of `--nnodes`) stops the
launch with "ambiguous option" (exit 2) before the script runs."""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from tests.helpers import ROOT

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py")) + glob.glob(os.path.join(ROOT, "scripts", "*", "*.py")) + glob.glob(os.path.join(ROOT, "tests", "gpu", "*.py"))
                 + [os.path.join(ROOT, "spmd_rl", "ppo.py"), os.path.join(ROOT, "spmd_rl", "export.py")])


def script_options(path: str) -> list[str]:
    """The `--name` strings of every add_argument call in a script's source."""
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            out += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
    return out


def torchrun_options() -> list[str]:
    return [s for action in get_args_parser()._actions for s in action.option_strings if s.startswith("--")]


def test_the_option_scan_finds_the_known_clash():
    assert any(o.startswith("--run") for o in torchrun_options()) and "--trained-run" in script_options(
        os.path.join(ROOT, "tests", "gpu", "export_worker.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.relpath(p, ROOT) for p in SCRIPTS])
def test_no_script_option_is_a_prefix_of_a_torchrun_option(path):
    ours = torchrun_options()
    clashes = {o: [t for t in ours if t.startswith(o)] for o in script_options(path)}
    assert not {o: t for o, t in clashes.items() if t}, f"{os.path.relpath(path, ROOT)}: rename these options"


COMMANDS = [p for p in SCRIPTS if p.startswith(os.path.join(ROOT, "scripts", "")) and script_options(p)]


@pytest.mark.parametrize("path", COMMANDS, ids=[os.path.relpath(p, ROOT) for p in COMMANDS])
def test_every_script_imports_what_it_needs_from_where_it_lies(path):
    """`--help` after the script's imports: a module it finds only through the test's own sys.path
    (scripts/, the repository root) fails here, as for a user."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, path, "--help"], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
