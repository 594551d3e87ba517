"""The shape of the library, read from its source (no process group needed), as docs/architecture.md describes it:
layers that import only downwards, no import cycle (function-level imports included), error feedback completed
below the front ends, the header agreement run by one module, one registry of collectives, one path switch, and
every module's job stated in its docstring and in docs/architecture.md."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gtopk_ext"

# docs/architecture.md's lines, bottom first: a module may import its own line and the lines below it.
LAYERS = [
    {"gtopk_ext._contract", "gtopk_ext._validate", "gtopk_ext._worker", "gtopk_ext.costs", "gtopk_ext.reference",
     "gtopk_ext._C"},
    {"gtopk_ext.backends", "gtopk_ext.ops", "gtopk_ext.torch_kernels", "gtopk_ext.triton_kernels", "gtopk_ext.dct"},
    {"gtopk_ext.message", "gtopk_ext.wire"},
    {"gtopk_ext.compressors"},
    {"gtopk_ext.collectives"},
    {"gtopk_ext.hierarchical"},
    {"gtopk_ext.paths", "gtopk_ext.momentum", "gtopk_ext.amp"},
    {"gtopk_ext.config"},
    {"gtopk_ext.reduction"},
    {"gtopk_ext.ddp", "gtopk_ext.fsdp", "gtopk_ext.local_sgd", "gtopk_ext.averaging", "gtopk_ext.resume",
     "gtopk_ext.optim", "gtopk_ext.plan"},
    {"gtopk_ext.utils", "gtopk_ext"},
]
# What a front end may not call itself: error feedback is the reduction's, the collectives are reached through it.
OPS_CALLS_ALLOWED = {"gtopk_ext.triton_kernels", "gtopk_ext.torch_kernels", "gtopk_ext.compressors",
                     "gtopk_ext.message", "gtopk_ext.wire", "gtopk_ext.reduction", "gtopk_ext.collectives",
                     "gtopk_ext.amp"}
AGREEMENT = {"gather_headers", "require_same"}
COLLECTIVE_FUNCTIONS = {"sparse_allgather", "gtopk_allreduce", "oktopk_allreduce"}
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by name; triton_kernels/ installs as gtopk_ext.triton_kernels."""
    found = {}
    for folder, prefix in ((PACKAGE, ("gtopk_ext",)), (ROOT / "triton_kernels", ("gtopk_ext", "triton_kernels"))):
        for path in folder.rglob("*.py"):
            if path.is_relative_to(PACKAGE / "triton_kernels"):  # a link to triton_kernels/ in some checkouts
                continue
            parts = prefix + path.relative_to(folder).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The gtopk_ext modules ``name`` imports anywhere in its source (``from pkg import module`` counts as the
    module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {e for e in edges if e in known and e != name}


def runtime_nodes(tree: ast.AST):
    """Every node that runs: all but the bodies of ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def layer_of(name: str) -> int:
    for level, members in enumerate(LAYERS):
        if any(name == m or name.startswith(m + ".") for m in members if m != "gtopk_ext") or name in members:
            return level
    raise AssertionError(f"{name} is on none of the layers: add it to LAYERS (and to DESIGN.md)")


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found) | {"gtopk_ext._C"}  # the compiled library
    return {name: imports(name, path, known) for name, path in found.items()}


def calls(path: pathlib.Path) -> list[tuple[str, str]]:
    """(object, attribute) or ("", function) of every call in the file."""
    seen = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                seen.append((node.func.value.id, node.func.attr))
            elif isinstance(node.func, ast.Name):
                seen.append(("", node.func.id))
    return seen


def test_layers_import_only_downwards():
    wrong = [f"{a} (line {layer_of(a)}) imports {b} (line {layer_of(b)})" for a, targets in graph().items()
             for b in targets if layer_of(b) > layer_of(a)]
    assert not wrong, wrong


def test_no_import_cycle():
    edges = graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_error_feedback_and_collectives_are_reached_through_the_reduction():
    """Only the layers below the reduction, and the reduction, call the ops (the compressor takes what it sends
    out of the residual, the reduction puts back what was not applied); the front ends never call a collective's
    function or the ops."""
    wrong = []
    for name, path in modules().items():
        inside = any(name == m or name.startswith(m + ".") for m in OPS_CALLS_ALLOWED)
        for obj, attr in calls(path):
            if obj == "ops" and not inside and attr[0].islower():
                wrong.append(f"{name} calls ops.{attr}")
            if (attr in COLLECTIVE_FUNCTIONS and not name.startswith("gtopk_ext.collectives")):
                wrong.append(f"{name} calls {attr}")
    assert not wrong, wrong


def test_only_the_protocol_runs_the_header_agreement():
    wrong = [f"{name} calls {attr}" for name, path in modules().items() if name != "gtopk_ext.collectives._protocol"
             for _, attr in calls(path) if attr in AGREEMENT]
    assert not wrong, wrong


def test_one_registry_of_collectives():
    """Only the collectives package maps names to collectives: no other module lists the sparse collectives'
    names."""
    names = {"gtopk", "allgather", "oktopk"}
    wrong = []
    for name, path in modules().items():
        if name.startswith("gtopk_ext.collectives"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                strings = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
                if len(strings & names) >= 2:
                    wrong.append(f"{name}:{node.lineno} lists {sorted(strings & names)}")
    assert not wrong, wrong


def test_one_path_switch():
    """Only the reduction branches on a step's path: the hooks hand each tensor to ``reduce_step`` and reach no
    collective themselves (neither compares with a path nor calls a collective's methods)."""
    paths = {"sparse", "dense16", "dense8", "dense", "nonfinite"}
    wrong = []
    for name, path in modules().items():
        if name not in ("gtopk_ext.ddp.hook", "gtopk_ext.fsdp.hook"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and any(
                    isinstance(c, ast.Constant) and c.value in paths for c in ast.walk(node.test)):
                wrong.append(f"{name}:{node.lineno} branches on a path")
            if isinstance(node, ast.Attribute) and node.attr in {"reduce_dense", "reduce", "average_into"}:
                wrong.append(f"{name}:{node.lineno} calls {node.attr}")
    assert not wrong, wrong


def test_every_module_states_its_job():
    """Each module opens with a docstring (its job), and docs/architecture.md lists it with its job in a line: a
    new module is a new job, written down where a reader looks for it."""
    documented = ARCHITECTURE.read_text()
    undocumented = [name for name, path in modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not undocumented, f"modules without a docstring: {undocumented}"
    listed = [name for name, path in modules().items()
              if f"`{path.relative_to(ROOT).as_posix()}`" not in documented and path.name != "__init__.py"]
    assert not listed, f"modules that docs/architecture.md does not list (as `path`): {listed}"


def test_one_ddp_step_reads_in_six_files():
    """docs/architecture.md lists the library files a reader opens to follow one DDP step, in order, at most six
    (plus the op contracts of csrc/ops.cpp), each a file that exists."""
    text = ARCHITECTURE.read_text()
    section = text.split("## One DDP step", 1)[1].split("\n## ", 1)[0]
    files = [line.split("`")[1] for line in section.splitlines() if line[:1].isdigit() and "`" in line]
    library = [f for f in files if f.startswith("gtopk_ext/")]
    assert 0 < len(library) <= 6 and len(set(library)) == len(library), files
    assert all((ROOT / f).is_file() for f in files), files
