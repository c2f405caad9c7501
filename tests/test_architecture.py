"""docs/ARCHITECTURE.md's module table names every module of the package, and no other; every
public function documents its arguments."""

import ast
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


def _public_functions(tree: ast.Module):
    """Module-level functions and methods of module-level classes whose names (and classes'
    names) do not start with ``_``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from ((f"{node.name}.{f.name}", f) for f in node.body
                        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node


def test_public_functions_document_their_arguments():
    """Every public function or method with parameters (``self``/``cls`` aside) has an
    ``Args:`` section in its docstring (optax's and maxtext's Google style)."""
    missing = []
    for path in sorted((ROOT / "gift_jax").rglob("*.py")):
        for name, f in _public_functions(ast.parse(path.read_text())):
            a = f.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs
                      if p.arg not in ("self", "cls")] + [a.vararg, a.kwarg]
            if name.rsplit(".", 1)[-1].startswith("_") or not any(params):
                continue
            if "Args:" not in (ast.get_docstring(f) or ""):
                missing.append(f"{path.relative_to(ROOT)}:{f.lineno} {name}")
    assert not missing, "no Args: section:\n" + "\n".join(missing)
