"""report.html from the report's Markdown: tables, emphasis and lists rendered as HTML, text
that looks like HTML escaped, plots embedded as data URIs (the page needs no other file)."""

from __future__ import annotations

import base64
from html.parser import HTMLParser
from pathlib import Path

from replaykv.accept.report import html_page

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.srcs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.srcs += [v or "" for k, v in attrs if k == "src"]


def test_markdown_tables_emphasis_escaping_and_embedded_plots(tmp_path: Path) -> None:
    (tmp_path / "kl.png").write_bytes(PNG)
    md = (
        "# Acceptance\n\n**verdict: FAIL** (1 of 2 criteria)\n\n"
        "| criterion | value | passed |\n|---|---|---|\n| exact | 1.0 | yes |\n| kl <b>x</b> | 0.3 | no |\n\n"
        "- one\n- two\n\n## Plots\n\n![kl.png](kl.png)\n"
    )
    page = html_page(md, tmp_path, ["kl.png"])
    parsed = Tags()
    parsed.feed(page)
    assert parsed.tags.count("table") == 1 and parsed.tags.count("tr") == 3 and parsed.tags.count("th") == 3
    assert {"h1", "h2", "strong", "ul", "li", "img"} <= set(parsed.tags)
    assert "b" not in parsed.tags and "kl &lt;b&gt;x&lt;/b&gt;" in page
    assert parsed.srcs == ["data:image/png;base64," + base64.b64encode(PNG).decode()]
    assert "**" not in page
