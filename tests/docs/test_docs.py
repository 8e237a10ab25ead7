"""README.md stays a front door and the docs pages stay reachable: README at most 150 lines, the CPU
install line .ci/run reads from it, every relative link of README.md and docs/*.md resolves, and
every file docs/layout.md's tree names exists."""

import glob
import os
import re

from tests.helpers import ROOT


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_readme_is_short_and_keeps_the_line_ci_reads():
    text = read("README.md")
    assert len(text.splitlines()) <= 150, "README.md is a front door: move the long text to a docs/ page"
    # .ci/run: sed -n 's/^\(pip install torch==.*\)# CPU machine$/\1/p' README.md
    assert len(re.findall(r"^pip install torch==.*# CPU machine$", text, re.M)) == 1


def test_relative_links_resolve():
    broken = []
    for page in ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        for link in re.findall(r"\]\(([^)#\s]+)[^)]*\)", read(page)):
            if "://" not in link and not os.path.exists(os.path.join(ROOT, os.path.dirname(page), link)):
                broken.append(f"{page}: {link}")
    assert not broken, broken


def test_layout_names_only_files_that_exist():
    """Each `name.py` / `name.sh` (`*` a wildcard) of the tree is a file of the repository."""
    text = read("docs/layout.md")
    tree = text[text.index("```\n") + 4:text.rindex("```")]
    files = []
    for d, dirs, fs in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        files += [os.path.relpath(os.path.join(d, f), ROOT) for f in fs]
    missing = []
    for name in sorted(set(re.findall(r"[\w*]+\.(?:py|sh)\b", tree))):
        pattern = re.compile(r"(^|/)" + re.escape(name).replace(r"\*", r"\w*") + "$")
        if not any(pattern.search(f) for f in files):
            missing.append(name)
    assert not missing, f"docs/layout.md names files that do not exist: {missing}"
