"""The dependency direction of docs/design.md, read from the source with ``ast``: the core
(``flowgrpo/`` but its composition edges) imports nothing from ``pipelines/`` or
``reward_models/`` and no edge; its modules import each other without a cycle; the edges import
the adapters and rewards at module top; an import inside a function defers a heavy or optional
dependency and says why in a comment."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The composition edges: the command line and the policies wire the adapters and rewards in.
EDGES = {"flowgrpo.cli", "flowgrpo.__main__", "flowgrpo.commands", "flowgrpo.commands.common",
         "flowgrpo.commands.evaluate", "flowgrpo.commands.grid", "flowgrpo.commands.sample",
         "flowgrpo.flow_policy", "flowgrpo.llm", "flowgrpo.tiny_recipe"}
IMPLEMENTATIONS = ("pipelines", "reward_models")
# What an import inside a function may defer: libraries that take seconds to import (diffusers,
# transformers, peft, torchvision, open_clip) or that are optional or platform-specific.
DEFERRABLE = ("diffusers", "transformers", "peft", "torchvision", "open_clip", "tokenizers",
              "deepspeed", "bitsandbytes", "tensorboard", "wandb", "matplotlib", "xformers",
              "fcntl", "trl")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_files() -> dict[str, Path]:
    files = {module_name(p): p for p in sorted((ROOT / "flowgrpo").rglob("*.py"))}
    return {name: path for name, path in files.items() if name not in EDGES}


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(path: Path, type_checking: bool = False) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) of every runtime import of ``path``
    (``if TYPE_CHECKING:`` blocks are not run; ``type_checking`` counts them too). ``from a import b`` counts as ``a.b`` when
    ``a.b`` is a module of this repository, else as ``a``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else \
        module_name(path).rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child) and not type_checking:
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    candidate = f"{base}.{alias.name}"
                    is_module = (ROOT / Path(*candidate.split("."))).with_suffix(".py").is_file() \
                        or (ROOT / Path(*candidate.split(".")) / "__init__.py").is_file()
                    found.append((candidate if is_module else base, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def core_graph(type_checking: bool = False) -> dict[str, set[str]]:
    core = core_files()
    graph: dict[str, set[str]] = {}
    for name, path in core.items():
        targets = {target for target, _, _ in imports(path, type_checking)}
        # importing a.b.c runs a and a.b too, except the packages this module is in (they are
        # being imported already when it runs)
        expanded = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 2)}
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in expanded if t in core and t != name and t not in own}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_core_imports_no_adapter_no_reward_and_no_edge():
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}"
           for name, path in core_files().items() for target, line, _ in imports(path)
           if target.split(".")[0] in IMPLEMENTATIONS or target in EDGES]
    assert not bad, "\n".join(bad)


def test_the_core_modules_import_each_other_without_a_cycle():
    assert find_cycle(core_graph()) is None, " -> ".join(find_cycle(core_graph()))


def test_no_cycle_even_through_type_checking_imports():
    """An import kept for annotations only still draws a dependency in the reader's picture of
    the package: none closes a cycle."""
    cycle = find_cycle(core_graph(type_checking=True))
    assert cycle is None, " -> ".join(cycle)


def test_imports_inside_functions_defer_a_heavy_dependency_and_say_why():
    """In the core and the edges alike, an import inside a function is of a slow or optional
    library (``DEFERRABLE``) and has a comment on its line or the line above."""
    bad = []
    files = sorted((ROOT / "flowgrpo").rglob("*.py"))
    for path in files:
        lines = path.read_text().splitlines()
        for target, line, in_function in imports(path):
            if not in_function:
                continue
            above = line - 2   # the line above the run of import lines this one ends
            while above > 0 and lines[above].strip().startswith(("from ", "import ")):
                above -= 1
            commented = "#" in lines[line - 1] or lines[above].strip().startswith("#")
            if target.split(".")[0] not in DEFERRABLE or not commented:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    assert not bad, "\n".join(dict.fromkeys(bad))


def test_the_edges_import_the_adapters_and_rewards_at_module_top():
    bad = []
    for path in sorted((ROOT / "flowgrpo").rglob("*.py")):
        if module_name(path) not in EDGES:
            continue
        bad += [f"{path.relative_to(ROOT)}:{line} imports {target} inside a function"
                for target, line, in_function in imports(path)
                if in_function and target.split(".")[0] in IMPLEMENTATIONS]
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The parser sees function-level and relative imports and skips TYPE_CHECKING blocks; the
    cycle finder finds a cycle."""
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipelines\n"
                      "def f():\n    import diffusers  # slow\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imports(source) == [("typing", 1, False), ("diffusers", 5, True)]
    finally:
        ROOT = saved
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
