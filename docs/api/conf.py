"""Sphinx configuration of gift_jax's API reference site.

Build it (from the repository root; the output folder build/ is ignored by git)::

    .venv/bin/pip install -e ".[docs]"
    .venv/bin/sphinx-build -W --keep-going -b html docs/api build/docs

The narrative pages hold no text of their own: a line ``% readme-section: ## HEADING`` in a page
is replaced, when Sphinx reads the page, by that ``## HEADING`` section of README.md (links to
the repository's ``docs/*.md`` pages rewritten, other repository files named as code), so the
README stays the one source of its examples. The reference pages are autodoc over the
Google-style docstrings (napoleon).
"""

import pathlib
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
# README links to the repository's docs pages: the one that is a page of this site becomes a
# link to it; the others (results pages with their run records) stay repository paths.
SITE_PAGES = {"docs/ARCHITECTURE.md": "architecture.md"}


def readme_section(heading: str) -> str:
    """The body of one section of README.md, without its heading line.

    Args:
      heading: the section's heading line as written in README.md, e.g. ``## GIFT`` (or
        ``# gift_jax`` for the introduction). The section runs to the next ``#`` or ``##``
        heading outside a code block, so it keeps its ``###`` subsections.

    Returns:
      The section's Markdown, its links to ``docs/*.md`` rewritten.

    Raises:
      ValueError: if README.md does not have exactly one such heading.
    """
    lines = README.read_text(encoding="utf-8").splitlines(keepends=True)
    fenced, headings = False, []  # (line index, heading line) outside code blocks
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,2} ", line):
            headings.append((i, line.rstrip("\n")))
    found = [k for k, (_, h) in enumerate(headings) if h == heading]
    if len(found) != 1:
        raise ValueError(f"README.md has {len(found)} headings {heading!r}, not one")
    k = found[0]
    stop = headings[k + 1][0] if k + 1 < len(headings) else len(lines)
    body = "".join(lines[headings[k][0] + 1:stop])

    def link(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if target in SITE_PAGES:
            return f"[{label}]({SITE_PAGES[target]})"
        return f"`{target}`" if label.strip("`") == target else f"{label} (`{target}`)"

    return re.sub(r"\[([^\]]+)\]\(((?:docs|examples|scripts)/[^)#\s]+)\)", link, body)


def _insert_readme_sections(app, docname, source):
    lines = []
    for line in source[0].splitlines(keepends=True):
        m = re.match(r"^% readme-section: (.+?)\s*$", line)
        if m:
            app.env.note_dependency(str(README))
            lines.append(readme_section(m.group(1)))
        else:
            lines.append(line)
    source[0] = "".join(lines)


def setup(app):
    app.connect("source-read", _insert_readme_sections)
