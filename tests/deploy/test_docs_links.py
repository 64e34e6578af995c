"""README.md and docs/: every relative link resolves (a file or folder of this repository, and
a `#section` anchor to a heading of the page it names), the index docs/README.md links every
page, and no page narrates how the code got here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", flags=re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.I)
# What docs must not say: rounds of work, issue numbers, verdicts, gitignored run folders.
HISTORY = {
    "a numbered session or round": re.compile(r"\b(session|round|phase) \d+\b", flags=re.I),
    "an issue number": re.compile(r"\bissue #?\d+|(?<![\w&/])#\d{1,5}\b", flags=re.I),
    "a met / not met verdict": re.compile(r"\b(not met\b|met\)|, met\b)", flags=re.I),
    "a path under runs/": re.compile(r"(?<![\w./-])runs/"),
}


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(page: Path) -> list[str]:
    text = prose(page.read_text())
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def broken(page: Path, target: str) -> str | None:
    """Why a link from `page` does not resolve; None when it does (or is not relative)."""
    if SCHEME.match(target):
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if not dest.exists():
        return f"{target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: {dest.name} has no heading for #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = [why for target in links(page) if (why := broken(page, target))]
    assert not problems, problems


def test_the_link_check_finds_broken_links(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Serving shapes\n\n## `baton serve` flags\n")
    page = tmp_path / "b.md"
    page.write_text("")
    assert broken(page, "a.md#baton-serve-flags") is None
    assert broken(page, "a.md#serving-shapes") is None
    assert broken(page, "a.md#flags") == "a.md#flags: a.md has no heading for #flags"
    assert broken(page, "c.md") == "c.md: no such file"
    assert broken(page, "../outside.md") == "../outside.md: outside the repository"
    assert broken(page, "https://example.com/x.md") is None
    text = "[x](a.md) `[y](gone.md)`\n```\n[z](gone.md)\n```\n[w]: c.md\n"
    page.write_text(text)
    assert links(page) == ["a.md", "c.md"]


def test_the_index_links_every_page():
    index = DOCS / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    missing = [p.relative_to(ROOT) for p in DOCS.rglob("*.md") if p != index and p not in linked]
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_narrates_its_history(page):
    text = page.read_text()
    found = [f"{what}: {m.group(0)!r}" for what, rx in HISTORY.items() for m in rx.finditer(text)]
    assert not found, found


def tracked_text_files() -> list[Path]:
    """Every file git tracks that is text (sources, scripts, manifests, docs), but this one:
    its patterns name what they look for."""
    import subprocess

    names = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    out = []
    for name in names:
        path = ROOT / name
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            path.read_text()
        except UnicodeDecodeError:
            continue
        out.append(path)
    return out


# In code a run folder is a legitimate default (`--out runs/...`); a session-named one is not.
CODE_HISTORY = {**HISTORY, "a path under runs/": re.compile(r"(?<![\w./-])runs/s\d")}


def test_no_file_narrates_its_history():
    """Code comments, test names, benchmark output and data files too, not only the docs."""
    found = [
        f"{path.relative_to(ROOT)}: {what}: {m.group(0)!r}"
        for path in tracked_text_files()
        for what, rx in CODE_HISTORY.items()
        for m in rx.finditer(path.read_text())
    ]
    assert not found, found
