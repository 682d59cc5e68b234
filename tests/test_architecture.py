"""The rules of the house (docs/architecture.md, "Rules"), checked on the code itself:
services share code only through the core library and the torch-free RPC layer; no service
imports another; the router and the RPC layer load no torch; the code and the tests meet only
where the tests import the code (tests/support/ is the tests' own)."""

from __future__ import annotations

import ast
import functools
import gc
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())


@functools.cache
def parse(path: Path) -> ast.Module:
    """`ast.parse` once per file and session, with the garbage collector held off: CPython 3.11's
    AST constructor fails with "SystemError: AST constructor recursion depth mismatch" when a
    finalizer that runs Python code (an asyncio task's 'exception was never retrieved' log, left by
    an earlier test) runs inside it, and only a collection runs such finalizers there. (A
    `gc.collect()` before each parse, a collection of the whole session's heap per file, made the
    file's rules take 250 s of a 32-minute suite.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text())
    finally:
        if enabled:
            gc.enable()


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (ast.walk sees both),
    including `importlib.import_module("x")` with a literal name."""
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value)
    return out


def package_imports(package: str) -> list[tuple[str, str]]:
    """(file, imported module) for every import in the top-level package `package`."""
    return [(str(f.relative_to(ROOT)), m) for f in sorted((ROOT / package).rglob("*.py")) for m in imports_of(f)]


def test_no_service_imports_another():
    assert {"router", "delta_store", "gpu_worker"} <= set(SERVICES)
    bad = []
    for svc in SERVICES:
        for f in (ROOT / "services" / svc).rglob("*.py"):
            for mod in imports_of(f):
                parts = mod.split(".")
                if parts[0] == "services" and len(parts) > 1 and parts[1] != svc:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_rpc_layer_imports_no_service_and_no_torch():
    bad = [
        f"{f.relative_to(ROOT)} imports {m}"
        for f in (ROOT / "bitdelta" / "rpc").rglob("*.py")
        for m in imports_of(f)
        if m.split(".")[0] in ("services", "torch", "bitdelta_kernels")
    ]
    assert not bad, "\n".join(bad)


def test_the_store_server_imports_no_client():
    """The store and its client share the protocol's constants through `bitdelta.rpc.wire`, never
    the server through its own client."""
    bad = [
        f"{f.relative_to(ROOT)} imports {m}"
        for f in (ROOT / "services" / "delta_store").rglob("*.py")
        for m in imports_of(f)
        if m == "bitdelta.rpc.clients" or m.startswith("bitdelta.rpc.clients.")
    ]
    assert not bad, "\n".join(bad)


def test_importing_the_router_loads_no_torch_and_no_other_service():
    code = (
        "import sys, services.router.server, services.router.__main__, bitdelta.rpc.clients.worker, "
        "bitdelta.rpc.clients.delta_store, bitdelta.rpc.config; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'bitdelta_kernels') "
        "or m.startswith(('services.gpu_worker', 'services.delta_store'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_kernels_import_nothing_of_the_core_or_the_services():
    """The arrows point one way: `bitdelta` imports `bitdelta_kernels` (the model's fused linear, the
    bit convention in `bitdelta_kernels.bits`), so no module of `bitdelta_kernels` may import `bitdelta`
    (or a service)."""
    assert ("bitdelta/model.py", "bitdelta_kernels") in package_imports("bitdelta")  # the direction kept
    bad = [
        f"{f} imports {m}"
        for f, m in package_imports("bitdelta_kernels")
        if m.split(".")[0] in ("bitdelta", "services")
    ]
    assert not bad, "\n".join(bad)


def test_no_other_installed_distribution_provides_a_top_level_package_of_the_project():
    """A top-level package whose name another installed distribution also uses shadows it, or is
    shadowed, by sys.path's order. Transformers 5.25 brought Hugging Face's `kernels` distribution,
    whose top-level `kernels` hid this project's kernel package when it was named so ("cannot import
    name 'bitdelta_delta_batched' from 'kernels'"); it is `bitdelta_kernels` since. (`tests` is the
    suite's, kept apart by tests/__init__.py.)"""
    ours = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"tests"}
    assert {"bitdelta", "bitdelta_kernels", "services"} <= ours
    clash = {
        name: sorted(set(dists) - {"bitdelta-serve"})
        for name, dists in importlib.metadata.packages_distributions().items()
        if name in ours and set(dists) - {"bitdelta-serve"}
    }
    assert not clash, f"installed distributions that also provide the project's top-level packages: {clash}"
    for name in ours:  # and each resolves to this checkout, whatever else is installed
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).resolve().parent == ROOT / name, (name, spec)


# The one exception: `bitdelta.LLM`, the offline API on the worker's engine, imported on first use
# by the package's __getattr__ (importing the core still loads no service; tested below).
CORE_TO_SERVICE = {("bitdelta/__init__.py", "services.gpu_worker.offline")}


def test_the_core_imports_no_service():
    bad = [
        f"{f} imports {m}"
        for f, m in package_imports("bitdelta")
        if m.split(".")[0] == "services" and (f, m) not in CORE_TO_SERVICE
    ]
    assert not bad, "\n".join(bad)
    code = "import sys, bitdelta, bitdelta.generation; print(any(m.startswith('services') for m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


def module_edges(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (at the top or inside a function): `from a.b import c`
    names a.b.c where that is a module, else a.b (its package's __init__)."""
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            out |= subs or ({node.module} & modules)
    return out


def test_no_import_cycle_in_the_code():
    """The code's modules import one another in one direction: no module reaches itself through
    its imports, lazy ones inside functions included (a cycle is usually a function-local import
    hiding it: the subcommand modules once took `CliError` from the CLI that registers them)."""
    files = {
        ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
        for pkg in ("bitdelta", "bitdelta_kernels", "services")
        for f in sorted((ROOT / pkg).rglob("*.py"))
        if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    }
    graph = {m: module_edges(f, set(files)) - {m} for m, f in files.items()}  # less a `__main__` block's own import
    for f, m in CORE_TO_SERVICE:  # the core's one lazy arrow to a service (above)
        graph[".".join(Path(f).with_suffix("").parts).removesuffix(".__init__")].discard(m)
    assert graph["bitdelta.cli"] >= {"bitdelta.cli_error", "bitdelta.inspect_report"}  # the graph sees the arrows
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join([*path[path.index(n) :], n]))
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_import_rules_see_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "def g():\n    from bitdelta import model\n    import importlib\n    importlib.import_module('bitdelta_kernels.bits')\n"
    )
    assert imports_of(f) == {"bitdelta", "importlib", "bitdelta_kernels.bits"}


def tracked_py_files() -> list[Path]:
    """Every Python file in the repository (git's list: the virtual environment and data/ are not in it)."""
    r = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [ROOT / f for f in r.stdout.split()]


def test_nothing_outside_tests_imports_the_tests():
    """tests/support/ holds what only the tests use: no module outside tests/ imports it (nor any
    test module); a helper bench/ or scripts/ need as well lives once in `bitdelta.testing`."""
    files = tracked_py_files()
    assert ROOT / "bench" / "router.py" in files  # the list is the repository's
    bad = [
        f"{f.relative_to(ROOT)} imports {m}"
        for f in files
        if f.relative_to(ROOT).parts[0] != "tests"
        for m in imports_of(f)
        if m.split(".")[0] == "tests"
    ]
    assert not bad, "\n".join(bad)


TEST_HELPER_NAMES = ("testing", "conftest", "fixtures", "mocks", "fakes")


def test_the_code_holds_no_test_only_helper_module():
    """The code's packages hold no helper module for tests, but for `bitdelta.testing`, the one that
    bench/ shares with the tests: each of its modules is imported by bench/ or scripts/ (one that
    only tests import belongs in tests/support/)."""
    bad = [
        str(f.relative_to(ROOT))
        for package in ("bitdelta", "bitdelta_kernels", "services")
        for f in sorted((ROOT / package).rglob("*.py"))
        if (f.stem.startswith("test_") or f.stem in TEST_HELPER_NAMES or f.parent.name in TEST_HELPER_NAMES)
        and f.parent != ROOT / "bitdelta" / "testing"
    ]
    assert not bad, "test-only helpers in the code (move them to tests/support/): " + ", ".join(bad)
    used = {
        m
        for f in tracked_py_files()
        if f.relative_to(ROOT).parts[0] in ("bench", "scripts")
        for m in imports_of(f)
        if m.startswith("bitdelta.testing.")
    }
    shared = {
        f"bitdelta.testing.{f.stem}" for f in (ROOT / "bitdelta" / "testing").glob("*.py") if f.stem != "__init__"
    }
    assert shared and shared <= used, f"only the tests import {sorted(shared - used)}: move it to tests/support/"


# Where the environment may be read: at the edges, once (docs/architecture.md, "One way to configure").
# (file, outermost function or "<module>") -> why
ENV_READERS = {
    ("bitdelta/rpc/config.py", "from_args"): "a service's typed config: flags and BITDELTA_<SERVICE>_*",
    ("bitdelta/rpc/telemetry.py", "endpoint_from"): "OpenTelemetry's standard OTEL_* variables, at start-up",
    ("bitdelta/rpc/telemetry.py", "setup"): "OpenTelemetry's standard OTEL_* variables, at start-up",
    ("bitdelta/precision.py", "choice_from_env"): "BITDELTA_CPU_PRECISION, the --cpu-precision alias, read once",
    ("bitdelta_kernels/settings.py", "from_env"): "the kernel settings' aliases, read once per process",
    ("bitdelta_kernels/configs.py", "interpreting"): "Triton's own TRITON_INTERPRET, read once",
    ("bitdelta/client_cli.py", "<module>"): "the client commands' defaults (BITDELTA_ROUTER, BITDELTA_STORE)",
    ("bitdelta/client_cli.py", "_client"): "the client commands' TLS and token (BITDELTA_TLS_*, BITDELTA_TOKEN)",
    ("bitdelta/family/cli.py", "register"): "--threads' alias BITDELTA_THREADS",
    ("bitdelta/family/__init__.py", "data_dir"): "BITDELTA_DATA, the data directory (the CLI's --data default)",
    ("bitdelta/testing/cluster.py", "__init__"): "the environment it hands the server processes it starts",
    ("services/gpu_worker/parallel.py", "from_env"): "torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*, once",
    ("services/gpu_worker/parallel.py", "_spawn"): "the environment it hands the tensor-parallel ranks it starts",
    ("services/gpu_worker/__main__.py", "<module>"): (
        "torch's THP_MEM_ALLOC_ENABLE and oneDNN's cache bounds, defaulted before the first tensor"
    ),
}


def env_reads(path: Path) -> set[str]:
    """The outermost function (or "<module>") of every `os.environ` / `os.getenv` in `path`."""
    found = set()

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name if where == "<module>" else where)
                continue
            if (
                isinstance(child, ast.Attribute)
                and child.attr in ("environ", "getenv")
                and isinstance(child.value, ast.Name)
                and child.value.id == "os"
            ):
                found.add(where)
            visit(child, where)

    visit(parse(path), "<module>")
    return found


def test_the_environment_is_read_only_at_the_edges():
    """Configuration flows from the typed configs; variables are their aliases, read where a process
    starts or a command parses its flags, never inside a kernel or a request (bitdelta_kernels.settings,
    bitdelta.precision)."""
    bad = [
        f"{rel}: {where} reads the environment"
        for pkg in ("bitdelta", "bitdelta_kernels", "services")
        for f in sorted((ROOT / pkg).rglob("*.py"))
        if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        for rel in [str(f.relative_to(ROOT))]
        for where in env_reads(f)
        if (rel, where) not in ENV_READERS
    ]
    assert not bad, "\n".join(bad)
