"""Every Python block of README.md runs as written (a fresh process, 8 simulated CPU devices
set up by the block itself), and the training loops it shows train."""

import pathlib
import re
import subprocess
import sys

import pytest
from trainer_kit import script_env

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"),
                    flags=re.M | re.S)


def _heading(block: str) -> str:
    text = README.read_text(encoding="utf-8")
    before = text[:text.index(block)]
    return re.findall(r"^## (.+)$", before, flags=re.M)[-1]


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", BLOCKS, ids=[_heading(b) for b in BLOCKS])
def test_readme_block_runs(block, tmp_path):
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
