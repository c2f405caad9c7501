"""Every Python block of README.md and of the documentation site's pages (docs/api/*.md) runs
as written (a fresh process, 8 simulated CPU devices set up by the block itself), and the
training loops they show train. The README stays short: the rest lives on the site's pages."""

import pathlib
import re
import subprocess
import sys

import pytest
from trainer_kit import script_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
#: The README is a page or two (optax's and flax's are the model); details go to docs/api.
README_MAX_LINES = 300


def python_blocks(path: pathlib.Path) -> list[tuple[str, str]]:
    """The ```python blocks of a Markdown file, each with an id: the file's name and the
    nearest heading above the block (``README.md::GIFT``, ``gift.md::Statistics from Flax
    models``)."""
    blocks, heading = [], path.stem
    fence, body = None, []  # fence: None outside code blocks, else the block's language
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence, body = line[3:].strip() or "text", []
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                blocks.append((f"{path.name}::{heading}", "".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        elif m := re.match(r"#{1,6} (.+)$", line.rstrip("\n")):
            heading = m.group(1).strip()
    return blocks


BLOCKS = python_blocks(README) + [b for page in PAGES for b in python_blocks(page)]


def test_the_readme_has_an_example_per_entry_point():
    headings = [name.split("::", 1)[1] for name, _ in python_blocks(README)]
    assert headings == ["Using the quantized all-reduce", "GSPMD trainers", "GIFT", "PLUMAGE"]


def test_the_docs_pages_have_python_examples():
    pages = {name.split("::", 1)[0] for name, _ in BLOCKS if not name.startswith("README")}
    assert {"allreduce.md", "gspmd.md", "gift.md", "plumage.md"} <= pages


def test_the_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move details to a page "
        f"of docs/api/ and link it")


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for _, b in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_python_block_runs(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block, encoding="utf-8")
    env = script_env(JAX_PLATFORMS="cpu")  # the block sets up its devices
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = re.search(r"loss (\S+) -> (\S+)", run.stdout)
    if losses:  # a training loop: the loss falls
        first, last = map(float, losses.groups())
        assert last < first / 4, run.stdout
