"""The README stays short, and every page and section it (or a docs page) links to exists: a section
moved out of the README is reachable from it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "monitoring" / "README.md"]
#: What a newcomer reads first (the issue asked for about 150-200 lines); the rest lives in docs/.
README_MAX_LINES = 220


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (not hyphens), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings inside code blocks
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    """Relative links of `page` whose file, or heading in that file, does not exist."""
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link} (no such heading in {target.name})")
    return broken


def test_every_link_in_the_readme_and_docs_resolves():
    problems = {str(page.relative_to(ROOT)): broken_links(page) for page in PAGES if page.exists()}
    assert {page: links for page, links in problems.items() if links} == {}


def test_a_broken_link_is_caught(tmp_path):
    """The negative control: a missing file and a missing heading are both reported."""
    (tmp_path / "other.md").write_text("# Real heading\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](other.md#real-heading) [b](missing.md) [c](other.md#gone) [d](#title) "
                    "[e](#nope) [f](https://example.com)\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#gone (no such heading in other.md)",
                                  "#nope (no such heading in page.md)"]


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert unlinked == []
