"""docs/ARCHITECTURE.md's module table names every module of the package, and no other."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_module_table_lists_exactly_the_package_modules():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text[text.index("| module | what it holds |"):]
    table = table[:table.index("\n\n")]
    listed = re.findall(r"^\| `(gift_jax/[\w/]+\.py)` \|", table, flags=re.M)
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gift_jax").rglob("*.py")
                     if p.name != "__init__.py")
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == modules, (
        f"missing: {sorted(set(modules) - set(listed))}; "
        f"not a module: {sorted(set(listed) - set(modules))}")
