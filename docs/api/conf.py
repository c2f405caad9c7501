"""Sphinx configuration of gift_jax's API reference site.

Build it (from the repository root; the output folder build/ is ignored by git)::

    .venv/bin/pip install -e ".[docs]"
    .venv/bin/sphinx-build -W --keep-going -b html docs/api build/docs

The narrative pages are MyST Markdown files of their own (``quickstart.md``, ``training.md``,
``data.md``, ...), written so that their links also work on GitHub: a link to another page is
``page.md``, a link to a repository file is relative to ``docs/api/`` (``../gift_results.md``,
``../../scripts/train.py``). When Sphinx reads a page, such a repository link becomes a link
to the site page where there is one (``docs/ARCHITECTURE.md``: ``architecture.md``) and the
file's path as code otherwise (the results pages, with their run records, stay in the
repository). A page may also pull in a section of README.md: a line
``% readme-section: ## HEADING`` is replaced by that section (its links, relative to the
repository root, rewritten the same way), so the README's short examples are written once.
The reference pages are autodoc over the Google-style docstrings (napoleon).
"""

import pathlib
import posixpath
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout, also when it is not pip-installed

project = "gift_jax"
author = "gift_jax authors"
copyright = "gift_jax authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "gift_jax"

# Google-style docstrings (Args:/Returns:/Raises:), as tests/test_architecture.py requires.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}
autosummary_generate = False

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
# README sections start at ##/### under the page's own # title.
suppress_warnings = ["myst.header"]

README = ROOT / "README.md"
SITE = "docs/api"  # this site's folder in the repository
# Repository docs pages that are also pages of this site (the others, e.g. the results pages
# with their run records, stay repository paths).
SITE_PAGES = {"docs/ARCHITECTURE.md": "architecture.md"}
# A Markdown link: [label](target) with an optional #anchor.
_LINK = re.compile(r"\[([^\]]+)\]\(([^)#\s]+)(#[^)\s]*)?\)")


def rewrite_links(text: str, base: str, docname: str | None = None) -> str:
    """Rewrites the repository links of Markdown text for this site.

    Args:
      text: Markdown.
      base: the folder its relative links start from, relative to the repository root: ``""``
        for README.md, ``"docs/api"`` for a page of this site.
      docname: the page the text is shown on (e.g. ``"gift"``), if any: a link to that page
        itself becomes the word "below" (a README section pointing at its docs page, shown on
        that page).

    Returns:
      The text with each link to a repository file rewritten: to a page of this site, a
      relative link to it (``gift.md``, ``architecture.md``); to any other repository file,
      its path as code (the label and the path when the label says something else). Web
      links, anchors within the page and links that leave the repository are kept.
    """

    def link(m: re.Match) -> str:
        label, target, anchor = m.group(1), m.group(2), m.group(3) or ""
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            return m.group(0)
        path = posixpath.normpath(posixpath.join(base, target))
        if path.startswith("..") or path == ".":
            return m.group(0)
        if path in SITE_PAGES:
            path = f"{SITE}/{SITE_PAGES[path]}"
        page = path[len(SITE) + 1:] if path.startswith(f"{SITE}/") else ""
        if page.endswith(".md") and "/" not in page:  # a page of this site
            if docname is not None and page == f"{docname}.md" and not anchor:
                return "below"
            return f"[{label}]({page}{anchor})"
        return f"`{path}`" if label.strip("`") == path else f"{label} (`{path}`)"

    return _LINK.sub(link, text)


def readme_section(heading: str, docname: str | None = None) -> str:
    """The body of one section of README.md, without its heading line.

    Args:
      heading: the section's heading line as written in README.md, e.g. ``## GIFT`` (or
        ``# gift_jax`` for the introduction, ``### Demo ...`` for a subsection). The section
        runs to the next heading of its level or above outside a code block, so it keeps its
        subsections.
      docname: the page that shows it (see :func:`rewrite_links`).

    Returns:
      The section's Markdown, its links to repository files rewritten (:func:`rewrite_links`).

    Raises:
      ValueError: if README.md does not have exactly one such heading.
    """
    lines = README.read_text(encoding="utf-8").splitlines(keepends=True)
    fenced, headings = False, []  # (line index, level, heading line) outside code blocks
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) ", line)):
            headings.append((i, len(m.group(1)), line.rstrip("\n")))
    found = [k for k, (_, _, h) in enumerate(headings) if h == heading]
    if len(found) != 1:
        raise ValueError(f"README.md has {len(found)} headings {heading!r}, not one")
    k = found[0]
    start, level = headings[k][0], headings[k][1]
    stop = next((i for i, lv, _ in headings[k + 1:] if lv <= level), len(lines))
    return rewrite_links("".join(lines[start + 1:stop]), "", docname)


def _rewrite_page(app, docname, source):
    if not str(app.env.doc2path(docname)).endswith(".md"):
        return
    out, fenced = [], False
    for line in source[0].splitlines(keepends=True):
        m = re.match(r"^% readme-section: (.+?)\s*$", line)
        if line.startswith("```"):
            fenced = not fenced
            out.append(line)
        elif m and not fenced:
            app.env.note_dependency(str(README))
            out.append(readme_section(m.group(1), docname))
        else:
            out.append(line if fenced else rewrite_links(line, SITE, docname))
    source[0] = "".join(out)


def setup(app):
    app.connect("source-read", _rewrite_page)
