"""The dependency rules (docs/design.md), checked on the source and on what an import
really loads: keys and db import no kernel library; keys, bench and ops know no DB, no
SQLAlchemy and no runtime (the integrations compose them)."""

import ast
import fnmatch
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tuner"
KERNEL_LIBRARIES = ("triton", "sgl_kernel", "flashinfer")


def imported_modules(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["keys", "db"])
def test_keys_and_db_import_no_kernel_library(package):
    assert not {m for m in imported_modules(package) if m.split(".")[0] in KERNEL_LIBRARIES}
    code = (f"import sys, tuner.{package}; "
            f"print([m for m in {KERNEL_LIBRARIES!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("package", ["bench", "ops", "workload"])
def test_bench_and_ops_know_no_db(package):
    assert not {m for m in imported_modules(package) if m == "tuner.db" or m.startswith("tuner.db.")}


@pytest.mark.parametrize("package", ["keys", "bench", "workload", "ops"])
def test_importing_keys_bench_or_ops_loads_no_db_runtime_or_sqlalchemy(package):
    """Transitively, in a fresh process: a direct-import check let `import tuner.ops` load the
    runtime and, through it, the DB layer and SQLAlchemy."""
    code = (f"import sys, tuner.{package}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sqlalchemy' "
            "or m.startswith(('tuner.db', 'tuner.runtime', 'tuner.integrations'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def module_graph() -> dict[str, set[str]]:
    """Each tuner module -> the tuner modules it imports anywhere in its file (lazy imports
    inside functions too), `from package import module` resolved to the module."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_import_circles_are_found():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_tuners_modules_import_each_other_in_no_circle():
    """Lazy imports count: ops re-exported the drop-ins of integrations, and bench's two timers
    imported each other."""
    graph = module_graph()
    assert {"tuner.integrations.fa3", "tuner.bench.cuda_timer", "tuner.workload.shapes"} <= set(graph)
    assert import_circles(graph) == []


def test_db_imports_nothing_that_composes_it():
    """The LightLLM export, made to write what the runtime serves, imported the runtime's
    borrowing rule from inside tuner.db: it moved up to the integrations."""
    above = ("tuner.runtime", "tuner.integrations", "tuner.sweep", "tuner.search", "tuner.ops", "tuner.cli")
    assert not {m for m in imported_modules("db") if m.startswith(above)}


def test_ops_import_no_integration_and_no_runtime():
    assert not {m for m in imported_modules("ops") if m.startswith(("tuner.integrations", "tuner.runtime"))}


def test_keys_import_nothing_but_the_standard_library_themselves_and_settings():
    allowed = {"__future__", "json", "math", "operator", "dataclasses", "typing", "tuner"}  # from tuner import settings
    assert {m for m in imported_modules("keys") if not m.startswith("tuner.keys")} <= allowed


def test_settings_import_nothing_of_tuner():
    tree = ast.parse((ROOT / "settings.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {n for n in names if n == "tuner" or n.startswith("tuner.")}


def test_pyproject_packages_every_subpackage_and_the_shipped_tunings():
    """pyproject.toml lists the packages by hand (tuning_cache/ travels as tuner.shipped):
    a new subpackage left off the list would be missing from wheels."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT.parent).parts) for p in ROOT.rglob("__init__.py")}
    assert set(project["packages"]) == on_disk | {"tuner.shipped"}
    assert project["package-dir"] == {"tuner.shipped": "tuning_cache"}
    from tuner.db.shipped import SHIPPED_GLOBS

    assert project["package-data"]["tuner.shipped"] == list(SHIPPED_GLOBS)  # what the layer reads, wheels carry


# A commit id: 7-12 hex digits (git's short form) or 40, with both a letter and a digit,
# standing alone or ending a file name (serving_other_2734bd6). Not one: a fingerprint id
# (16 digits), a digest (64), a hex constant (0x74756E72: after an "x").
COMMIT_ID = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])"
                       r"(?:[0-9a-f]{7,12}|[0-9a-f]{40})(?![0-9A-Za-z])")
RESULTS_DIR = re.compile(r"benchmarks/results|\bresults/[\w./*-]+\.(?:json|txt)")
FILE_NAME = re.compile(r"[\w.*-]+\.(?:json|txt|log|db|png)(?:\.xz|\.gz)?")


TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}


def comments_and_strings(path: Path):
    """(first line, text) of every comment and string literal (docstrings among them)."""
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in TEXT_TOKENS:
            yield token.start[0], token.string


def test_no_comment_or_string_names_a_commit_or_a_result_file():
    """Histories of measurements, with their result files and commits, live in docs/decisions.md;
    code says what and why. A result file is anything under benchmarks/results (a name may be
    given with a * for the commit, or without its .xz)."""
    def unpacked(name: str) -> str:
        return name.removesuffix(".xz").removesuffix(".gz")

    results = ROOT.parent / "benchmarks" / "results"
    result_names = {unpacked(p.name) for p in results.rglob("*") if p.is_file() and p.name != "README.md"}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for first_line, text in comments_and_strings(path):
            named = [*COMMIT_ID.finditer(text), *RESULTS_DIR.finditer(text)]
            named += [m for m in FILE_NAME.finditer(text)
                      if m.group().split(".")[0].strip("*")  # *.tunings.json names no one file
                      and any(fnmatch.fnmatchcase(result, unpacked(m.group())) for result in result_names)]
            found += [f"{name}:{first_line + text[:m.start()].count(chr(10))}: {m.group()}" for m in named]
    assert not found, "\n".join(found)
