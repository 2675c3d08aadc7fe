"""MkDocs hooks (mkdocs.yml's ``hooks:``): files from outside ``docs/`` shown on the site.

- ``<!-- include: benchmarks/RESULTS.md -->`` in a page is replaced by that file, its
  headings one level down and its relative links rewritten to work from the page.
- A link to a file outside ``docs/`` (a benchmark script, a test) becomes its path from the
  repository root, in code: the site has no such page. In an included file and in the
  demo's generated reports (``demo/``), so does a link to a file that is not there (a
  report's ``runs.json``, which is not committed). Any other broken link is left for
  ``mkdocs build --strict`` to report.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
INCLUDE = re.compile(r"<!-- include: (\S+) -->")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,5} )", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)


def _outside_code(markdown: str, change: Any) -> str:
    """``markdown`` with ``change`` applied to the text outside its fenced code blocks."""
    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out.append(change(markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(change(markdown[last:]))
    return "".join(out)


def _relink(markdown: str, source_dir: Path, page_dir: Path, lenient: bool) -> str:
    """The links of ``markdown``, written relative to ``source_dir``, made relative to
    ``page_dir``; code blocks are left as they are."""

    def fix(m: re.Match[str]) -> str:
        bang, text, target = m.groups()
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):  # a URL or an anchor
            return m.group(0)
        path, _, anchor = target.partition("#")
        file = (source_dir / path).resolve()
        if file.is_relative_to(DOCS) and (file.exists() or not lenient):
            rel = posixpath.relpath(file.as_posix(), page_dir.resolve().as_posix())
            return f"{bang}[{text}]({rel}{'#' + anchor if anchor else ''})"
        shown = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else path
        name = text.strip("`")
        return f"`{name}`" if name in (shown, file.name) else f"{text} (`{shown}`)"

    return _outside_code(markdown, lambda text: LINK.sub(fix, text))


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Includes, then links (see the module's docstring)."""
    page_dir = (DOCS / page.file.src_path).parent

    def include(m: re.Match[str]) -> str:
        file = ROOT / m.group(1)
        text = _outside_code(file.read_text(encoding="utf-8"), lambda s: HEADING.sub(r"#\1", s))
        return _relink(text, file.parent, page_dir, lenient=True)

    markdown = INCLUDE.sub(include, markdown)
    generated = page.file.src_path.startswith("demo/")
    return _relink(markdown, page_dir, page_dir, lenient=generated)
