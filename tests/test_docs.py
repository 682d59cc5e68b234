"""The docs name only paths that exist: every repository path a Markdown file names, in backticks
or as a link, is a file or folder of the repository (so a renamed or deleted file cannot leave a
doc pointing at nothing)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a doc may name that is not in the repository: outputs of the set-up, the build and the tests.
GENERATED = ("data/", "build/", ".venv/")
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"[<>{}$…]|\.\.\.")
IMAGE = re.compile(
    r"[a-z0-9][\w.-]*(/[\w.-]+)+:[A-Za-z][\w.-]*"
)  # a container image, NAME:TAG (`bitdelta/router:latest`)


def tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def names_in(folder: str, files: list[str]) -> set[str]:
    """The names directly in `folder` ("" for the root: `services`, `README.md`, `.ci`, ...)."""
    prefix = folder + "/" if folder else ""
    return {f[len(prefix) :].split("/", 1)[0] for f in files if f.startswith(prefix)}


def _clean(token: str) -> str:
    """A path as written, without a test id (`::test_x`), a line (`:12`) or an anchor (`#part`)."""
    token = token.split("::", 1)[0].split("#", 1)[0]
    token = re.sub(r":\d+(-\d+)?$", "", token)
    return token.rstrip(".,;:)")


def named_paths(text: str, doc: str, files: list[str]) -> set[str]:
    """The repository paths Markdown `text` (the file `doc`, relative to the root) names, relative to
    the root. A backticked word without spaces is a path when it has a `/` or a `.` and its first
    part is a name at the top of the repository (`services/router/placement.py`) or in the doc's
    folder (`k8s/` in deploy/; any `name.md` there); commands, flags, URLs, `bitdelta.rpc`, `1/32`
    are not. A link is a path unless it is a URL or an anchor, read relative to the doc's folder."""
    folder = "" if Path(doc).parent == Path(".") else str(Path(doc).parent)
    roots, local = names_in("", files), names_in(folder, files)
    out = set()
    for m in SPAN.finditer(text):
        token = _clean(m.group(1).strip())
        if " " in token or "://" in token or PLACEHOLDER.search(token) or token.startswith(("-", "/", "~")):
            continue
        if IMAGE.fullmatch(token):
            continue
        if "/" not in token and "." not in token:
            continue
        first = token.split("/", 1)[0]
        if first in roots:
            out.add(token)
        elif first in local or ("/" not in token and token.endswith(".md")):  # a sibling doc, even a gone one
            out.add(f"{folder}/{token}".lstrip("/"))
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#") or PLACEHOLDER.search(target):
            continue
        path = _clean(target)
        resolved = (ROOT / Path(doc).parent / path).resolve()
        try:
            out.add(str(resolved.relative_to(ROOT)) + ("/" if path.endswith("/") else ""))
        except ValueError:
            out.add(path)  # outside the repository: reported as missing
    return out


def missing(paths: set[str], files: list[str]) -> list[str]:
    """The paths in `paths` that are neither a tracked file nor a folder of tracked files (a glob
    matches when some file matches it); generated outputs are not checked."""
    present = set(files)
    folders = {f.rsplit("/", i)[0] for f in files for i in range(1, f.count("/") + 1)}
    out = []
    for p in sorted(paths):
        bare = p.rstrip("/")
        if p.startswith(GENERATED) or bare in present or bare in folders:
            continue
        if "*" in p and any(fnmatch.fnmatch(f, bare) for f in present | folders):
            continue
        out.append(p)
    return out


def test_every_path_a_doc_names_exists():
    files = tracked()
    docs = [f for f in files if f.endswith(".md")]
    assert "docs/architecture.md" in docs and "README.md" in docs
    bad = []
    for doc in docs:
        names = named_paths((ROOT / doc).read_text(), doc, files)
        bad += [f"{doc}: {p}" for p in missing(names, files)]
    assert not bad, "docs name paths that do not exist:\n" + "\n".join(bad)


def test_the_extraction_finds_paths_and_only_paths():
    files = [
        "services/router/placement.py",
        "tests/router/test_router.py",
        "docs/router.md",
        "docs/worker.md",
        "README.md",
        "deploy/k8s/30-router.yaml",
    ]
    # data/ is no top-level name of the repository (the set-up makes it): never checked
    text = (
        "See `services/router/placement.py`, `services/router/placment.py` (a typo), "
        "[the router](router.md), [gone](old.md#part), `tests/router/test_router.py::test_x`, "
        "`README.md`; not paths: `--delta-store`, `bitdelta.rpc`, `1/32`, `python -m services.router`, "
        "[a URL](https://example.com/docs/x.md), [anchor](#rules), `data/deltas/v.safetensors`, "
        "`services/<name>/config.py`, `BITDELTA_TOKEN=...`, `services/*/config.py`, `services/router:latest` (an "
        "image); in docs/ `worker.md` "
        "and `workers.md` (a rename), `k8s/` (a name of deploy/, not of docs/)."
    )
    names = named_paths(text, "docs/router.md", files)
    assert names == {
        "services/router/placement.py",
        "services/router/placment.py",
        "docs/router.md",
        "docs/old.md",
        "tests/router/test_router.py",
        "README.md",
        "services/*/config.py",
        "docs/worker.md",
        "docs/workers.md",
    }
    assert missing(names, files) == [
        "docs/old.md",
        "docs/workers.md",
        "services/*/config.py",
        "services/router/placment.py",
    ]
    assert named_paths("`k8s/` and `k8s/30-router.yaml`", "deploy/README.md", files) == {
        "deploy/k8s/",
        "deploy/k8s/30-router.yaml",
    }
    assert missing({"services/*/placement.py", "services/router/"}, files) == []


DOTTED = re.compile(r"`((?:bitdelta|bitdelta_kernels|services)(?:\.\w+)+)(?:\(\))?`")


def resolves(name: str) -> bool:
    """`name` is an importable module, or an attribute chain of one (`bitdelta.rpc.serve.create_server`)."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_a_doc_names_exists():
    """A backticked `bitdelta.x`, `bitdelta_kernels.x` or `services.x` in a doc is a module or something in
    one (protobuf full names, `bitdelta.router.v1.RouterService`, are the protos' own)."""
    bad = [
        f"{doc}: {name}"
        for doc in tracked()
        if doc.endswith(".md")
        for name in sorted({m.group(1) for m in DOTTED.finditer((ROOT / doc).read_text())})
        if ".v1" not in name and not resolves(name)
    ]
    assert not bad, "docs name modules that do not exist:\n" + "\n".join(bad)
    assert resolves("bitdelta.rpc.serve.create_server") and not resolves("bitdelta.rpc.serve.create_sever")
