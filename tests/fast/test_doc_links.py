"""Every relative link in README.md and docs/*.md leads somewhere: the file exists, and a
``#anchor`` names a heading of the page it points into (GitHub's heading ids).  Links inside
fenced blocks and code spans are text, not links, and are not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's id for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading id of a page, a repeated heading's later ones suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    ids = set()
    for _, line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        ids.add(base if count == 0 else f"{base}-{count}")
    return ids


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in prose_lines(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):     # a code span is text
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            elif anchor and dest.suffix != ".md":
                broken.append(f"{where}: an anchor into a file that is not Markdown")
            elif anchor and anchor not in anchors(dest):
                broken.append(f"{where}: no heading with id {anchor!r} in {dest.relative_to(ROOT)} "
                              f"(ids: {', '.join(sorted(anchors(dest)))})")
    return broken


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, "\n".join(broken)


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Title\n\n## Fabric manager: labs that stay up (`vm up`)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#fabric-manager-labs-that-stay-up-vm-up) [self](#here)\n## Here\n"
                    "[gone](missing.md) [bad](other.md#nowhere) `[code](missing.md)`\n"
                    "```\n[fenced](missing.md)\n```\n[web](https://example.org/x)\n")
    assert [b.split(": ", 2)[1] for b in broken_links(page)] == ["missing.md", "other.md#nowhere"]


def test_slugs_follow_github():
    assert slug("The DMA demo (`vfio-cxl demo dma`)") == "the-dma-demo-vfio-cxl-demo-dma"
    assert slug("Figures") == "figures"
    assert slug("Storage straight into the GPU (`storage` topology)") == "storage-straight-into-the-gpu-storage-topology"
