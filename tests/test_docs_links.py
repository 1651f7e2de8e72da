"""Every relative link in README.md, FORMAT.md and docs/*.md names a file of the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "FORMAT.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links in text, outside code, that are not URLs or in-page anchors."""
    text = _CODE.sub("", _FENCE.sub("", text))
    out = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def test_the_link_finder_skips_code_urls_and_anchors():
    text = "[a](x.md) [b](https://e.org/y) [c](#sec) ![d](p.png) `[e](no.md)`\n```\n[f](no2.md)\n```\n[g](z.md#h)"
    assert relative_links(text) == ["x.md", "p.png", "z.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page.read_text()):
        path = (page.parent / target).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_the_docs_table_of_contents_lists_every_page():
    toc = ROOT / "docs" / "README.md"
    listed = {(toc.parent / t).resolve() for t in relative_links(toc.read_text())}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")} - {toc}
    assert not pages - listed, f"docs/README.md does not list: {sorted(p.name for p in pages - listed)}"
