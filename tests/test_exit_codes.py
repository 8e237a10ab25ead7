"""The exit statuses (spmd_rl/exit_codes.py): each named once, each in its module's table."""

import ast
import os
import re

from spmd_rl import exit_codes
from tests.helpers import ROOT as REPO


def exit_names() -> dict[str, int]:
    return {k: v for k, v in vars(exit_codes).items() if k.startswith("EXIT_")}


def test_each_status_is_a_row_of_the_table():
    names = exit_names()
    assert set(names.values()) == {0, 1, 2, 3, 4, 130}  # distinct statuses, one name each
    for name, value in names.items():
        assert re.search(rf"^\| {value} +\| {name} +\|", exit_codes.__doc__, re.M), name


def assigned_exit_names(path: str) -> list[str]:
    """The EXIT_* names a module binds at its top level (assignment or tuple assignment)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and n.id in exit_names():
                    names.append(n.id)
    return names


def test_no_other_module_defines_a_status():
    found = {}
    for top in ("spmd_rl", "launch", "scripts"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                path = os.path.join(root, f)
                if f.endswith(".py") and path != exit_codes.__file__:
                    names = assigned_exit_names(path)
                    if names:
                        found[os.path.relpath(path, REPO)] = names
    assert found == {}, f"exit statuses defined outside spmd_rl/exit_codes.py: {found}"
