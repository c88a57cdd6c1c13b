"""The dashboard shows what others wrote as data, never as markup: no live link to a host the operator did not configure.

What a page renders as markdown is checked the way the browser's renderer reads it: CommonMark (links,
autolinks, HTML) through markdown-it, then GFM's literal autolinks (``www.``, ``http(s)://``, e-mail),
which remark-gfm finds in the text *after* escapes are resolved (mdast-util-gfm-autolink-literal)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import streamlit as st
from markdown_it import MarkdownIt
from streamlit.testing.v1 import AppTest
from ui_support import EVIL, PHISH, build_run_ledger, copy_ledger, plant_markup

from ddiloco.ui import APP_PATH, LEDGER_URL_ENV, loaders
from ddiloco.ui.widgets import ZWSP, md, safe_link

pytestmark = pytest.mark.timeout(120)

HOSTILE = [
    PHISH,
    f"session expired, sign in again: https://{EVIL}/sso",
    f"www.{EVIL}/x",
    f"ops@{EVIL}",
    f"<https://{EVIL}>",
    f"<a href='https://{EVIL}'>x</a>",
    f"![img](https://{EVIL}/p.png)",
    f":red[**alarm**] [x][ref]\n\n[ref]: https://{EVIL}",
    f"&#x5B;x&#x5D;(https://{EVIL})",
    "# heading\n- list",
    "$\\href{https://evil.example}{x}$",
]
RENDERER = MarkdownIt("commonmark")
# mdast-util-gfm-autolink-literal's two patterns.
GFM_URL = re.compile(r"(https?://|www(?=\.))([-.\w]+)([^ \t\r\n]*)", re.I)
GFM_EMAIL = re.compile(r"(?<![\w.+-])([-.\w+]+)@([-\w]+(?:\.[-\w]+)+)")


def live_links(markdown: str) -> list[str]:
    """Every link target a GFM renderer would make live from ``markdown``."""
    found: list[str] = []
    texts: list[str] = []
    for block in RENDERER.parse(markdown):
        if block.type == "html_block":
            found.append(block.content)
        inline = []
        for t in block.children or []:
            if t.type == "link_open":
                found.append(str(t.attrGet("href")))
            elif t.type == "image":
                found.append(str(t.attrGet("src")))
            elif t.type == "html_inline":
                found.append(t.content)
            elif t.type in ("text", "text_special", "code_inline"):
                inline.append(t.content)
        texts.append("".join(inline))
    for text in texts:
        found += [m.group(0) for m in GFM_URL.finditer(text) if "." in m.group(2)]
        found += [m.group(0) for m in GFM_EMAIL.finditer(text)]
    return found


@pytest.mark.parametrize("text", HOSTILE)
def test_escaped_text_renders_as_itself_with_no_link(text):
    # The check itself sees the link or markup in the raw text.
    assert live_links(text) or re.search(r"<(h1|li|a|img)\b", RENDERER.render(text)), text
    shown = md(text)
    assert live_links(shown) == [], shown
    html = RENDERER.render(shown)
    assert "<a " not in html and "<img" not in html and "<h1" not in html and "<li" not in html
    rendered = re.sub(r"<[^>]+>", "", html).strip().replace(ZWSP, "")
    for entity, char in (("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"')):
        rendered = rendered.replace(entity, char)
    assert rendered == " ".join(text.split())  # shown as written


def test_ordinary_ids_need_no_zero_width_characters():
    assert ZWSP not in md("us-0 run_2024.v1 sync-inprocess")


@pytest.mark.parametrize(
    "url, shown",
    [
        ("http://127.0.0.1:4200/runs/flow-run/1", True),
        ("https://app.prefect.cloud/account/a/workspace/w/runs/flow-run/1", True),
        ("javascript:alert(document.cookie)", False),
        ("JavaScript:alert(1)", False),
        ("data:text/html;base64,PHNjcmlwdD4=", False),
        ("vbscript:x", False),
        ("//evil.example/x", False),
        ("https://", False),
        (" https://evil.example", False),
        ("https://evil.example/\njavascript:x", False),
        (None, False),
        (42, False),
    ],
)
def test_only_absolute_http_links_are_rendered(url, shown):
    assert safe_link(url) == (url if shown else None)


# --- the pages, on a ledger a hostile writer filled -----------------------------------------------


@pytest.fixture(scope="module")
def hostile_ledger(tmp_path_factory):
    base = build_run_ledger(tmp_path_factory.getbasetemp() / "ui-run")
    ledger = copy_ledger(base, tmp_path_factory.mktemp("hostile-ledger"))
    plant_markup(ledger)
    return ledger


@pytest.fixture(autouse=True)
def fresh_caches():
    st.cache_data.clear()
    st.cache_resource.clear()
    yield
    st.cache_data.clear()
    st.cache_resource.clear()


def markdown_shown(at: AppTest) -> list[str]:
    """The markdown source of every element Streamlit renders as markdown."""
    out = []
    for kind in ("title", "header", "subheader", "markdown", "caption", "error", "warning", "info", "success"):
        out += [str(e.value) for e in getattr(at, kind)]
    return out


def link_targets(at: AppTest) -> list[str]:
    """Link buttons' URLs and every cell of a link column."""
    urls = [e.proto.url for e in at.get("link_button")]
    for frame in at.dataframe:
        if "flow_run_url" in frame.value.columns:
            urls += [u for u in frame.value["flow_run_url"] if u is not None]
    return urls


@pytest.mark.parametrize("page, run", [(None, None), ("views/run_health.py", "ui"), ("views/run_health.py", PHISH),
                                       ("views/run_health.py", f"[session expired, sign in again](https://{EVIL}/sso)")])
def test_no_page_links_to_a_host_the_operator_did_not_configure(monkeypatch, hostile_ledger, page, run):
    monkeypatch.setenv(LEDGER_URL_ENV, hostile_ledger.url)
    monkeypatch.setattr(loaders, "utcnow", lambda: hostile_ledger.end + timedelta(seconds=1))
    at = AppTest.from_file(str(APP_PATH), default_timeout=60)
    if run is not None:
        at.query_params["run"] = run
    at.run()
    if page is not None:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    sources = markdown_shown(at)
    assert any("URGENT" in s or "session expired" in s for s in sources), "the planted text must be on the page, as text"
    for source in sources:
        assert live_links(source) == [], source
    for url in link_targets(at):
        assert safe_link(url) == url and EVIL not in url, url
