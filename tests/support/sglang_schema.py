"""Regenerate (or check) the committed SGLang protocol fixture from the pinned SGLang release's own source.

The fixture ``tests/fixtures/sglang_schema.json`` records, for the endpoints t1async uses:

- ``classes``: every request/response dataclass of ``python/sglang/srt/managers/io_struct.py`` that
  those routes take or answer: field names in declaration order (inherited ``BaseReq`` fields
  included), the annotation as source text, the default as source text (``null`` when the field is
  required) and ``required``;
- ``routes``: path -> ``{"methods": [...], "function": name, "body": dataclass name or null,
  "query": {name: default source}, "always_status": N or null}`` (N: the route only raises that
  HTTP status, e.g. 404 for a retired route) read from the route decorators of
  ``python/sglang/srt/entrypoints/http_server.py``;
- ``meta_info_keys``: the ``meta_info`` keys ``python/sglang/srt/managers/tokenizer_manager.py``
  writes (dict literals assigned to ``meta_info`` and ``meta_info["key"] = ...`` stores), so a
  release that adds per-token ``weight_versions`` shows up as a fixture change;
- ``sglang_version``, ``dist_file`` and its ``sha256``.

Nothing is executed from SGLang: the three files are parsed with :mod:`ast` straight out of the wheel
(a zip), which is downloaded with ``pip download sglang==VERSION --no-deps`` into a cache folder
(``$T1ASYNC_CACHE`` or ``~/.cache/t1async``, then ``sglang/``). SGLang's source is never committed.

Usage (``tools/sglang_schema.py`` is a thin CLI over :func:`main`; the contract tests import this module
to fetch the wheel and parse it)::

    python tools/sglang_schema.py            # rewrite the fixture from the pinned release
    python tools/sglang_schema.py --check    # exit 1 and print the difference if they disagree
    python tools/sglang_schema.py --version 0.5.10.post1   # pin another release (then commit)

Source of the protocol: SGLang ``io_struct.py`` (dataclasses served by FastAPI as JSON bodies) and
``http_server.py`` (``@app.get/post/api_route`` routes).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support import FIXTURES

PINNED_VERSION = "0.5.10.post1"
"""The SGLang release t1async speaks (newest 0.5.x the package index served on 2026-12-01)."""

FIXTURE = FIXTURES / "sglang_schema.json"

ROUTES = [
    "/generate", "/health", "/health_generate", "/model_info", "/server_info", "/get_weight_version", "/flush_cache",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/update_weight_version", "/get_weights_by_name", "/pause_generation",
    "/continue_generation", "/abort_request",
]
"""The routes t1async (client, weight sync, fake server, embedded sampler) relies on."""

EXTRA_CLASSES = ["FlushCacheReqOutput", "UpdateWeightsFromDistributedReqOutput", "InitWeightsUpdateGroupReqOutput",
                 "UpdateWeightsFromTensorReqOutput"]
"""Response dataclasses recorded besides the request bodies the routes take."""

_FILES = {
    "io_struct": "sglang/srt/managers/io_struct.py",
    "http_server": "sglang/srt/entrypoints/http_server.py",
    "tokenizer_manager": "sglang/srt/managers/tokenizer_manager.py",
}


class SchemaError(RuntimeError):
    """The release could not be downloaded or its source did not parse as expected."""


def cache_dir() -> Path:
    """Folder holding downloaded SGLang distributions (``$T1ASYNC_CACHE/sglang`` or ``~/.cache/t1async/sglang``)."""
    root = os.environ.get("T1ASYNC_CACHE") or str(Path.home() / ".cache" / "t1async")
    return Path(root) / "sglang"


def download(version: str = PINNED_VERSION, dest: Path | None = None, timeout_s: float = 300.0) -> Path:
    """Return the path of ``sglang-VERSION-*.whl``, downloading it with pip if it is not cached.

    Raises:
        SchemaError: pip failed (its last output lines are in the message) or saved no wheel.
    """
    dest = dest or cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "--only-binary", ":all:",
           "-d", str(dest), "--quiet", "--disable-pip-version-check"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SchemaError(f"pip download sglang=={version} took over {timeout_s:.0f} s") from None
    found = sorted(dest.glob(f"sglang-{version}-*.whl"))
    if r.returncode != 0 or not found:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise SchemaError(f"pip download sglang=={version} failed (exit {r.returncode}): {tail}")
    return found[0]


def read_sources(wheel: Path) -> dict[str, str]:
    """The three parsed files' text out of the wheel (a zip), keyed ``io_struct``, ``http_server``,
    ``tokenizer_manager``.

    Raises:
        SchemaError: a file is missing from the wheel (SGLang moved it: update ``_FILES``).
    """
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        out = {}
        for key, path in _FILES.items():
            if path not in names:
                raise SchemaError(f"{wheel.name} has no {path}; SGLang moved it, update tests/support/sglang_schema.py _FILES")
            out[key] = z.read(path).decode("utf-8")
    return out


def _src(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _dataclass_fields(cls: ast.ClassDef) -> list[dict]:
    fields = []
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        default = stmt.value
        # field(default=..., kw_only=True) / field(default_factory=...): record the default itself
        if isinstance(default, ast.Call) and _src(default.func) in ("field", "dataclasses.field"):
            kws = {k.arg: k.value for k in default.keywords}
            if "default" in kws:
                default = kws["default"]
            elif "default_factory" in kws:
                default = ast.Call(func=kws["default_factory"], args=[], keywords=[])
            else:
                default = None
        fields.append({"name": stmt.target.id, "type": _src(stmt.annotation), "default": _src(default),
                       "required": default is None})
    return fields


def parse_classes(io_struct: str, wanted: list[str]) -> dict[str, dict]:
    """Fields of each dataclass in ``wanted`` (base classes defined in the same file first).

    Raises:
        SchemaError: a wanted class is not defined in ``io_struct``.
    """
    tree = ast.parse(io_struct)
    defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def collect(name: str) -> list[dict]:
        cls = defs[name]
        inherited = [f for b in cls.bases if isinstance(b, ast.Name) and b.id in defs for f in collect(b.id)]
        own = _dataclass_fields(cls)
        own_names = {f["name"] for f in own}
        return [f for f in inherited if f["name"] not in own_names] + own

    out = {}
    for name in wanted:
        if name not in defs:
            raise SchemaError(f"io_struct.py defines no class {name}")
        out[name] = {"fields": collect(name)}
    return out


def _always_raises(fn: ast.AST) -> int | None:
    """The status of a ``raise HTTPException(status_code=N, ...)`` that is the route's whole body
    (a retired route, such as ``/get_weight_version`` answering 404), else None."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Call):
        kws = {k.arg: k.value for k in body[0].exc.keywords}
        if _src(body[0].exc.func) == "HTTPException" and isinstance(kws.get("status_code"), ast.Constant):
            return int(kws["status_code"].value)
    return None


def parse_routes(http_server: str, io_classes: set[str], wanted: list[str]) -> dict[str, dict]:
    """Route table of ``http_server`` restricted to ``wanted`` paths (absent ones are left out:
    the fixture then says the release has no such route)."""
    tree = ast.parse(http_server)
    routes: dict[str, dict] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_cls, query = None, {}
        args = fn.args.args
        defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
        for a, d in zip(args, defaults):
            ann = _src(a.annotation)
            if ann in io_classes:
                body_cls = ann
            elif isinstance(d, ast.Call) and _src(d.func) == "Query":
                query[a.arg] = _src(d.args[0]) if d.args else None
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and _src(dec.func.value) == "app" and dec.args and isinstance(dec.args[0], ast.Constant)):
                continue
            kind, path = dec.func.attr, dec.args[0].value
            if kind == "api_route":
                kws = {k.arg: k.value for k in dec.keywords}
                methods = sorted(ast.literal_eval(kws["methods"])) if "methods" in kws else ["GET"]
            elif kind in ("get", "post", "put", "delete"):
                methods = [kind.upper()]
            else:
                continue
            if path in wanted:
                r = routes.setdefault(path, {"methods": [], "function": fn.name, "body": body_cls, "query": query,
                                             "always_status": _always_raises(fn)})
                r["methods"] = sorted(set(r["methods"]) | set(methods))
    return dict(sorted(routes.items()))


def parse_meta_info_keys(tokenizer_manager: str) -> list[str]:
    """Every key the tokenizer manager writes into a ``meta_info`` dict (sorted)."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse(tokenizer_manager)):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == "meta_info" and isinstance(node.value, ast.Dict):
                    keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                if (isinstance(t, ast.Subscript) and _src(t.value) == "meta_info"
                        and isinstance(t.slice, ast.Constant)):
                    keys.add(t.slice.value)
        if (isinstance(node, ast.Call) and _src(node.func) == "meta_info.update" and node.args
                and isinstance(node.args[0], ast.Dict)):
            keys |= {k.value for k in node.args[0].keys if isinstance(k, ast.Constant)}
    return sorted(k for k in keys if isinstance(k, str))


def build_schema(wheel: Path, version: str) -> dict:
    """The fixture's content for ``wheel`` (see the module docstring)."""
    src = read_sources(wheel)
    all_classes = {n.name for n in ast.parse(src["io_struct"]).body if isinstance(n, ast.ClassDef)}
    routes = parse_routes(src["http_server"], all_classes, ROUTES)
    wanted = sorted({r["body"] for r in routes.values() if r["body"]} | set(EXTRA_CLASSES))
    return {
        "sglang_version": version,
        "dist_file": wheel.name,
        "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "routes": routes,
        "classes": parse_classes(src["io_struct"], wanted),
        "meta_info_keys": parse_meta_info_keys(src["tokenizer_manager"]),
    }


def load_fixture(path: Path = FIXTURE) -> dict:
    """The committed fixture."""
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=None, help=f"SGLang release (default: the fixture's, else {PINNED_VERSION})")
    ap.add_argument("--check", action="store_true", help="compare with the committed fixture instead of writing it")
    ap.add_argument("--out", type=Path, default=FIXTURE)
    a = ap.parse_args(argv)
    version = a.version or (load_fixture(a.out)["sglang_version"] if a.out.exists() else PINNED_VERSION)
    try:
        schema = build_schema(download(version), version)
    except SchemaError as e:
        print(f"sglang_schema: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(schema, indent=1, sort_keys=False) + "\n"
    if a.check:
        if a.out.read_text() != text:
            print(f"sglang_schema: {a.out} disagrees with sglang=={version}; run python tools/sglang_schema.py",
                  file=sys.stderr)
            return 1
        print(f"sglang_schema: {a.out} matches sglang=={version}")
        return 0
    a.out.write_text(text)
    print(f"sglang_schema: wrote {a.out} from {schema['dist_file']} ({len(schema['routes'])} routes, "
          f"{len(schema['classes'])} classes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
