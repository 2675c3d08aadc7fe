"""MkDocs hooks (mkdocs.yml's ``hooks:``): files from outside ``docs/`` shown on the site.

- ``<!-- include: benchmarks/RESULTS.md -->`` in a page is replaced by that file, its
  relative links rewritten to work from the page.
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
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)


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
        return f"{text} (`{shown}`)" if text.strip("`") != shown else f"`{shown}`"

    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out.append(LINK.sub(fix, markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(LINK.sub(fix, markdown[last:]))
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Includes, then links (see the module's docstring)."""
    page_dir = (DOCS / page.file.src_path).parent

    def include(m: re.Match[str]) -> str:
        file = ROOT / m.group(1)
        return _relink(file.read_text(encoding="utf-8"), file.parent, page_dir, lenient=True)

    markdown = INCLUDE.sub(include, markdown)
    generated = page.file.src_path.startswith("demo/")
    return _relink(markdown, page_dir, page_dir, lenient=generated)
