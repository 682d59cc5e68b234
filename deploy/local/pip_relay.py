"""pip's settings on this machine, for `docker build --network host` (scripts/deploy-test.sh).

A build's pip must find packages where this machine's pip does. The index URLs and the CA bundle
pass as they are (the bundle is in the base image the script makes); local places (a find-links
directory, a file:// index) are not in the build, so this serves each over HTTP on a loopback port
for as long as it runs, and prints the settings with those places replaced, one NAME=VALUE a line:

    python deploy/local/pip_relay.py --port 25999 > pip.env   # then the build args: --build-arg NAME=VALUE

The port is fixed so that the same settings give the same build arguments, and docker's layer
cache holds across runs.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import subprocess
import sys
import urllib.parse
from pathlib import Path

SETTINGS = ("index-url", "extra-index-url", "find-links", "cert")  # pip's names; PIP_<NAME> as build args


def pip_settings() -> dict[str, str]:
    """Each setting's value as pip sees it (the environment over the config files)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, tuple[bool, str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if name in SETTINGS:
            from_env = section == ":env:"
            if from_env or not found.get(name, (False, ""))[0]:
                found[name] = (from_env, value.strip().strip("'\""))
    return {name: value for name, (_, value) in found.items() if value}


def local_dir(location: str) -> Path | None:
    """The directory a find-links or index location names on this machine, or None for a remote URL."""
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme in ("http", "https"):
        return None
    path = Path(urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else location)
    if not path.is_dir():
        raise SystemExit(f"pip setting names {location!r}, which is not a directory here")
    return path.resolve()


class Relay(http.server.SimpleHTTPRequestHandler):
    """GET /<i>/<rest> -> roots[i]/<rest> (each root is a local place's parent, so an index's
    relative links to files beside it resolve)."""

    def __init__(self, *a, roots: list[Path], **kw):
        self.roots = roots
        super().__init__(*a, **kw)

    def translate_path(self, path: str) -> str:
        parts = urllib.parse.unquote(urllib.parse.urlparse(path).path).lstrip("/").split("/", 1)
        if not parts[0].isdigit() or int(parts[0]) >= len(self.roots):
            return "/nonexistent"
        root = self.roots[int(parts[0])]
        target = (root / (parts[1] if len(parts) > 1 else "")).resolve()
        return str(target) if target.is_relative_to(root) else "/nonexistent"

    def log_message(self, *a) -> None:  # quiet: pip fetches many files
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True, help="loopback port to serve local places on")
    a = ap.parse_args()
    roots: list[Path] = []
    env: dict[str, str] = {}
    for name, value in pip_settings().items():
        if name == "cert":
            env["PIP_CERT"] = value
            continue
        urls = []
        for location in value.split():
            d = local_dir(location)
            if d is None:
                urls.append(location)
            else:
                roots.append(d.parent)
                urls.append(f"http://127.0.0.1:{a.port}/{len(roots) - 1}/{d.name}/")
        env["PIP_" + name.upper().replace("-", "_")] = " ".join(urls)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), functools.partial(Relay, roots=roots))
    print("\n".join(["# pip settings for docker build", *(f"{k}={v}" for k, v in sorted(env.items()))]), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
