"""The library's import graph: no circle anywhere (edgelm/, export/, quantize/, runtime/, writers/, subpackages
included); the runtime's modules each import alone, one way, and never reach torch, export/ or quantize/; the rooms
go one way at folder level too (edgelm/ above export/ and quantize/, above writers/, above runtime/).

The decode loop (runtime/decode.py) is shared by Model and Conversation; a circle (model -> chat -> model)
once hid behind imports inside functions, and two in export/ (families -> gguf -> families, compact_blocks ->
graph -> compact_blocks), so imports are read at every depth of each module, the ones under
`if TYPE_CHECKING:` included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import edgelm.runtime

RUNTIME = Path(edgelm.runtime.__file__).parent
REPO = Path(__file__).resolve().parent.parent
# package name -> folder, as pyproject.toml maps them (the folders are not the import paths)
LIBRARY = {
    "edgelm": REPO / "edgelm",
    "edgelm.export": REPO / "export",
    "edgelm.quantize": REPO / "quantize",
    "edgelm.runtime": REPO / "runtime",
    "edgelm.writers": REPO / "writers",
}
# each room and the rooms it may import, the folders as one graph: the face (edgelm/: the CLI, the server, the cache
# and `edgelm.load`) on top, then export/ and quantize/ (export may use quantize's torch-free block quantizer,
# never the reverse), the writers under both, the runtime under everything
ROOMS = {
    "edgelm": {"edgelm.export", "edgelm.quantize", "edgelm.writers", "edgelm.runtime"},
    "edgelm.export": {"edgelm.quantize", "edgelm.writers", "edgelm.runtime"},
    "edgelm.quantize": {"edgelm.writers", "edgelm.runtime"},
    "edgelm.writers": {"edgelm.runtime"},
    "edgelm.runtime": set(),
}


def module_name(path: Path) -> str:
    """runtime/chat.py -> "chat", runtime/template/sandbox.py -> "template.sandbox", runtime/template/__init__.py
    -> "template"."""
    parts = path.relative_to(RUNTIME).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(module_name(path) for path in RUNTIME.rglob("*.py") if path != RUNTIME / "__init__.py")
FORBIDDEN = {"torch", "export", "quantize", "onnx"}  # roots; edgelm.export and edgelm.quantize by their second name


def module_path(module: str) -> Path:
    path = RUNTIME.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported_names(module: str) -> tuple[set[str], set[str]]:
    """The runtime modules `module` imports (relative imports, at any depth) and the absolute imports' roots."""
    path = module_path(module)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    siblings, absolute = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = package[: len(package) - (node.level - 1)]
            if node.module:  # from .x import y, from ..x import y
                siblings.add(".".join([*base, *node.module.split(".")]))
            else:  # from . import x, y
                siblings.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            absolute.add(node.module)
        elif isinstance(node, ast.Import):
            absolute.update(alias.name for alias in node.names)
    return siblings & set(MODULES), absolute


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in the graph as a path (its first node repeated at the end), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            found = visit(target, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def library_modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Every module of the library by its import name (a package by its own name: its __init__.py)."""
    modules = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if name not in modules:  # edgelm/ holds only edgelm.cli and its own modules, not the mapped rooms
                modules[name] = path
    return modules


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules `name` imports, at any depth: `from X import a` is X.a where that is a module, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            stem = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                targets.add(f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {target for target in targets if target in modules and target != name}


def library_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    modules = library_modules(roots)
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def test_the_graph_reader_sees_a_circle():
    # the check itself can fail: a circle through three modules is reported
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_library_reader_sees_a_circle_through_a_subpackage(tmp_path):
    # a module importing a name from a subpackage, whose module imports back two levels up inside a function
    (tmp_path / "lib" / "sub").mkdir(parents=True)
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "a.py").write_text("from .sub import f\n")
    (tmp_path / "lib" / "sub" / "__init__.py").write_text("from .b import f\n")
    (tmp_path / "lib" / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    graph = library_graph({"pkg": tmp_path / "lib"})
    assert graph["pkg.a"] == {"pkg.sub"} and graph["pkg.sub"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.a"]


def test_the_library_imports_form_no_circle():
    graph = library_graph(LIBRARY)
    for module in ("edgelm.cli", "edgelm.export.families", "edgelm.export.graph", "edgelm.quantize.quantize"):
        assert module in graph, f"{module} is read"
    assert "edgelm.export.families" in graph["edgelm.export.gguf"], "relative imports resolve"
    cycle = find_cycle(graph)
    assert cycle is None, f"library modules import each other in a circle: {' -> '.join(cycle)}"


def room(module: str) -> str:
    """The room a module is in: edgelm.export.graph -> edgelm.export, edgelm.cli.export -> edgelm."""
    inner = [name for name in ROOMS if name != "edgelm" and (module == name or module.startswith(name + "."))]
    return inner[0] if inner else "edgelm"


def test_the_rooms_import_one_way():
    graph = library_graph(LIBRARY)
    assert room("edgelm.writers.onnxfile") == "edgelm.writers" and room("edgelm.cli.quantize") == "edgelm"
    assert "edgelm.writers.onnxfile" in graph["edgelm.export.onnx_export"], "export's writers are read"
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if room(target) != room(module) and room(target) not in ROOMS[room(module)]
    )
    assert not wrong, f"imports against the rooms' direction: {wrong}"


def test_the_runtime_imports_form_no_circle():
    graph = {module: imported_names(module)[0] for module in MODULES}
    assert "decode" in graph and "model" in graph, "the runtime's decode loop and Model modules are read"
    assert "template.sandbox" in graph["template.chat_template"], "imports inside runtime/template/ are read"
    assert "errors" in graph["template.sandbox"], "imports from runtime/template/ to runtime/ are read"
    cycle = find_cycle(graph)
    assert cycle is None, f"runtime modules import each other in a circle: {' -> '.join(cycle)}"


def test_the_decode_loop_does_not_depend_on_model():
    graph = {module: imported_names(module)[0] for module in MODULES}
    for module in ("decode", "kvcache", "chat", "runner"):
        assert "model" not in graph[module], f"runtime/{module}.py imports runtime/model.py"


def test_the_template_package_is_entered_through_its_init():
    # runtime/template/ is one package: the rest of the runtime imports its __init__, never its modules
    graph = {module: imported_names(module)[0] for module in MODULES}
    for module, targets in graph.items():
        if not module.startswith("template"):
            inside = sorted(target for target in targets if target.startswith("template."))
            assert not inside, f"runtime/{module}.py imports {inside}: import them from runtime/template/__init__.py"
        else:
            outside = {"errors", "text"}
            reached = sorted(t for t in targets if not t.startswith("template") and t not in outside)
            assert not reached, f"{module} imports {reached}: the template package needs only errors and text"


@pytest.mark.parametrize("module", MODULES)
def test_the_runtime_never_imports_torch_export_or_quantize(module):
    _, absolute = imported_names(module)
    parts = {name: name.split(".") for name in absolute}
    bad = sorted(
        name
        for name, p in parts.items()
        if p[0] in FORBIDDEN or p[:2] in (["edgelm", "export"], ["edgelm", "quantize"])
    )
    assert not bad, f"runtime/{module}.py imports {bad}"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module):
    # a fresh interpreter per module: an import that only works after another module loaded fails here
    code = f"import edgelm.runtime.{module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"import edgelm.runtime.{module} failed:\n{run.stderr[-2000:]}"


def test_loading_and_generating_do_not_import_jinja2(package):
    # the runtime promises onnxruntime, numpy and tokenizers; chat templates (jinja2) load when chat is first used
    code = (
        "import sys, edgelm.runtime as runtime\n"
        f"model = runtime.load({str(package)!r}, provider='cpu', threads=1)\n"
        "model.generate('ab', 3); list(model.stream('ab', 3)); model.generate_batch(['a', 'bc'], 2)\n"
        "model.generate('ab', 3, speculative='lookup')\n"
        "assert 'jinja2' not in sys.modules, 'jinja2 was imported'\n"
        "assert runtime.Conversation is not None and 'jinja2' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
