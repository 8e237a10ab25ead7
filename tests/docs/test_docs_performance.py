"""Measurements live in docs/performance.md, not in the code: no dates in the package or the presets,
every pointer to a section of docs/performance.md names one that exists, and the page holds the
current results only (its history is docs/performance-history.md)."""

import os
import re
import subprocess

from tests.helpers import ROOT

PERFORMANCE = os.path.join(ROOT, "docs", "performance.md")
DATE = re.compile(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")
MAX_LINES = 400


def tracked(*prefixes: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *prefixes], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split() if os.path.isfile(os.path.join(ROOT, f))]


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def sections() -> list[str]:
    return [line[3:].strip() for line in read(PERFORMANCE).splitlines() if line.startswith("## ")]


def section_pointers(text: str) -> list[str]:
    """The quoted names that follow a mention of docs/performance.md (or a Markdown link to it), up to
    the end of its clause (a closing parenthesis, a semicolon or a sentence's end), comment markers
    and line breaks folded away: `docs/performance.md, "Why the defaults are what they are"` names that section."""
    flat = re.sub(r"\n\s*(?:#+|//)?\s*", " ", text)
    names = []
    for m in re.finditer(r"docs/performance\.md(?:\]\([^)]*\))?", flat):
        names += re.findall(r'"([A-Z][^"]{2,80})"', clause(flat[m.end():m.end() + 300]))
    return names


def clause(text: str) -> str:
    """`text` up to a closing parenthesis, a semicolon or a full stop outside double quotes."""
    quoted = False
    for i, c in enumerate(text):
        quoted ^= c == '"'
        if not quoted and (c in ");" or (c == "." and text[i + 1:i + 2] in (" ", ""))):
            return text[:i]
    return text


def test_no_dates_in_the_package_or_the_presets():
    dated = [f"{f}:{n}" for f in tracked("spmd_rl", "configs")
             for n, line in enumerate(read(f).splitlines(), 1) if DATE.search(line)]
    assert not dated, f"dates belong in docs/performance.md, not in code or presets: {dated}"


def test_pointers_to_performance_md_name_its_sections():
    heads = sections()
    files = [f for f in tracked() if f.endswith((".py", ".md", ".toml", ".sh"))
             and not f.startswith("docs/performance") and f != "tests/docs/test_docs_performance.py"]
    broken = [f"{f}: {name!r}" for f in files for name in section_pointers(read(f))
              if not any(h.startswith(name) for h in heads)]
    assert not broken, f"no such section in docs/performance.md: {broken}"


def test_section_pointers_are_found():
    text = 'x (docs/performance.md, "Update MFU" and "Weight sync"; the log\'s "Other") "Not this"'
    assert section_pointers(text) == ["Update MFU", "Weight sync"]
    assert section_pointers('# see docs/performance.md,\n# "Two and four\n# GPUs"') == ["Two and four GPUs"]
    assert section_pointers('[docs/performance.md](performance.md), "CPU (the default job)"') == ["CPU (the default job)"]


def test_performance_md_is_current_results_with_its_history_apart():
    text = read(PERFORMANCE)
    assert len(text.splitlines()) <= MAX_LINES, "move superseded results to docs/performance-history.md"
    assert "performance-history.md" in text.split("\n## ")[0]
    assert "History" not in sections()
    assert os.path.isfile(os.path.join(ROOT, "docs", "performance-history.md"))
