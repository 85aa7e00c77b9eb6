"""The house stays walkable: no import cycle between jax-tap's modules, and
every rule registered under the primitive it rewrites."""
import ast
import pathlib

import jaxtap
from jaxtap import _seam
from jaxtap._rules import RULES

SRC = pathlib.Path(jaxtap.__file__).parent


def _module_name(path):
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level_imports(path, name):
    """Modules of this package imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                out.add(target)
            else:
                out.update(f"{target}.{a.name}" for a in node.names)
    return out


def test_no_import_cycle():
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {m: {t for t in _top_level_imports(p, m) if t in modules and t != m} for m, p in modules.items()}
    # a package's __init__ re-exporting its submodules is not a cycle
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m.startswith(t + ".") and modules[t].name == "__init__.py")}
    seen, stack = {}, []

    def visit(m):
        seen[m] = "open"
        stack.append(m)
        for t in graph[m]:
            if seen.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in seen:
                visit(t)
        stack.pop()
        seen[m] = "done"

    for m in sorted(graph):
        if m not in seen:
            visit(m)


def test_rules_are_keyed_by_primitive_objects():
    assert RULES[_seam.scan_p].__name__ == "handle_scan"
    assert RULES[_seam.while_p].__name__ == "handle_while"
    assert {_seam.jit_p, _seam.cond_p, _seam.remat_p, _seam.custom_jvp_call_p} <= set(RULES)
    assert all(hasattr(p, "bind") for p in RULES)


def test_the_options_are_listed_once_and_the_public_signatures_match():
    """Config lists the options; tap.verbose and tap.record spell out the
    same keyword arguments (names, defaults, order) for readers and typing."""
    import dataclasses
    import inspect

    import jaxtap as tap
    from jaxtap._options import Config

    fields = [(f.name, f.default, f.type) for f in dataclasses.fields(Config)]
    for fn, extra in ((tap.verbose, {"f"}), (tap.record, {"fn", "maxlen"})):
        params = [(p.name, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()
                  if p.name not in extra]
        assert params == fields, fn.__name__


def test_a_misspelt_option_names_the_fix():
    import pytest

    import jaxtap as tap

    with pytest.raises(TypeError, match="Did you mean 'sample_every'"):
        tap.TapContext(sample_evry=3)
