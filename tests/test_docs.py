"""The API reference site (docs/api) cannot silently rot: the README names the command that
builds it (and .ci/run runs it), its gift_jax page documents exactly ``gift_jax.__all__``, each
subpackage has its page, and every README section a page pulls in exists. Cheap: no build."""

import importlib.util
import pathlib
import re

import pytest

import gift_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "api"
BUILD = "sphinx-build -W --keep-going -b html docs/api build/docs"


def _site_pages():
    return sorted(p for p in SITE.rglob("*") if p.suffix in (".md", ".rst"))


def test_readme_names_the_docs_build_command_and_ci_runs_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f'.venv/bin/pip install -e ".[docs]" && .venv/bin/{BUILD}' in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r'sphinx-build"? -W --keep-going -q -b html docs/api build/docs', ci)
    assert re.search(r"^run_pair oldest .*\bdocs\b", ci, flags=re.M), "oldest pair lacks [docs]"
    assert re.search(r"^docs = \[", (ROOT / "pyproject.toml").read_text(), flags=re.M)


def test_the_gift_jax_page_documents_exactly_the_public_api():
    page = (SITE / "reference" / "gift_jax.rst").read_text(encoding="utf-8")
    assert ".. currentmodule:: gift_jax" in page
    documented = re.findall(r"^\.\. auto(?:function|class|data):: (\w+)$", page, flags=re.M)
    assert len(documented) == len(set(documented)), "a name is documented twice"
    missing = sorted(set(gift_jax.__all__) - set(documented))
    extra = sorted(set(documented) - set(gift_jax.__all__))
    assert not missing, (f"gift_jax.__all__ names not on docs/api/reference/gift_jax.rst: "
                         f"{missing}; add an autofunction/autoclass/autodata line (and the "
                         f"autosummary entry) under the section they belong to")
    assert not extra, f"docs/api/reference/gift_jax.rst documents non-exports: {extra}"
    listed = re.findall(r"^   (\w+)$", page, flags=re.M)  # the autosummary tables
    assert sorted(listed) == sorted(documented), "autosummary tables != documented names"


@pytest.mark.parametrize("package", ["comm", "whitening", "lowrank", "models", "training",
                                     "data"])
def test_each_subpackage_has_a_reference_page_in_the_toctree(package):
    page = SITE / "reference" / f"{package}.rst"
    assert f".. automodule:: gift_jax.{package}\n" in page.read_text(encoding="utf-8")
    assert f"reference/{package}\n" in (SITE / "index.md").read_text(encoding="utf-8")


def test_every_readme_section_a_page_pulls_in_exists_once():
    spec = importlib.util.spec_from_file_location("docs_conf", SITE / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    markers = [(p.name, m) for p in _site_pages()
               for m in re.findall(r"^% readme-section: (.+?)\s*$", p.read_text(), flags=re.M)]
    assert len(markers) >= 4  # the introduction and the examples
    for name, heading in markers:
        body = conf.readme_section(heading)  # raises unless exactly one such heading
        assert body.strip(), (name, heading)
        assert "](docs/" not in body, (name, heading)  # repository links rewritten
    headings = {h for _, h in markers}
    for example in ("## Using the quantized all-reduce", "## GIFT", "## PLUMAGE"):
        assert example in headings, f"no docs page shows the README's {example!r} example"
