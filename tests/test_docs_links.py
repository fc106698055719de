"""Every relative link in the README, the changelog and docs/ points at a file that exists, and every #anchor at a
heading of the linked markdown file (GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_ids(path: Path) -> set[str]:
    ids, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            text = re.sub(r"^#+ ", "", line).strip().lower()
            ids.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return ids


def test_heading_ids_follow_github():
    assert heading_ids(ROOT / "docs" / "performance.md") >= {
        "limits", "the-whole-table-on-one-build-2026-11-28-two-h200s", "end-to-end-generation"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):  # http(s), mailto
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in heading_ids(target):
            bad.append(f"{link}: no heading with that id in {target.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)
