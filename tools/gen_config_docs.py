"""Generate docs/configuration.md from the typed config (``t1async/config.py``, or the files of a
``t1async/config/`` package) by reading its source with ``ast``: nothing is imported, so the page
can be regenerated without the project's dependencies.

What it reads:
- every ``@dataclass`` class: one section of keys; the root is the dataclass named ``Config``
  (a field whose type is another dataclass is a sub-section: ``learner.abnormal``);
- each field's annotation, default (``field(default_factory=X)`` shown as what it builds) and the
  attribute docstring on the line(s) under it;
- ``enum.Enum`` classes defined in those files (and their subclasses, such as the config's
  ``Choice``): a field typed with one lists its values;
- a field's rule, ``field(metadata=rule(ok, "what is valid"))`` or ``choice(Enum, "...")``
  (t1async/config/rules.py): its text is shown as ``Valid: ...``.

Usage::

    python tools/gen_config_docs.py            # write docs/configuration.md
    python tools/gen_config_docs.py --check    # exit 1 when the page is stale (tests/house/test_docs.py)
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
ENUM_BASES = {"Enum", "StrEnum", "IntEnum", "Flag", "IntFlag"}


@dataclass
class Field:
    name: str
    annotation: str
    default: str | None
    doc: str
    type_names: set[str]
    valid: str = ""  # the text of the field's rule: what a valid value is


@dataclass
class Section:
    name: str
    doc: str
    bases: list[str]
    fields: list[Field] = field(default_factory=list)


@dataclass
class EnumClass:
    name: str
    doc: str
    members: list[tuple[str, str, str]]  # (member name, value, docstring)


def config_sources(root: Path = ROOT) -> list[Path]:
    """``t1async/config.py`` and/or every ``.py`` file under ``t1async/config/``."""
    files = [root / "t1async" / "config.py"] if (root / "t1async" / "config.py").is_file() else []
    files += sorted((root / "t1async" / "config").rglob("*.py")) if (root / "t1async" / "config").is_dir() else []
    if not files:
        raise SystemExit("gen_config_docs: neither t1async/config.py nor t1async/config/ exists")
    return files


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def _base_names(node: ast.ClassDef) -> list[str]:
    out = []
    for b in node.bases:
        if isinstance(b, ast.Name):
            out.append(b.id)
        elif isinstance(b, ast.Attribute):
            out.append(b.attr)
    return out


def _docstring_after(body: list[ast.stmt], i: int) -> str:
    """The attribute docstring: a bare string literal right after statement ``i``."""
    if i + 1 < len(body):
        nxt = body[i + 1]
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            return inspect.cleandoc(nxt.value.value)
    return ""


def _annotation(node: ast.expr, src: str) -> tuple[str, set[str]]:
    """The annotation as written, and every name in it (to find dataclasses and enums)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        src, node = node.value, ast.parse(node.value, mode="eval").body
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    return _source(node, src), names


def _source(node: ast.expr, src: str) -> str:
    """The expression as written in the source (``1e-6``, not ``1e-06``), on one line."""
    text = ast.get_source_segment(src, node) or ast.unparse(node)
    return " ".join(text.split()) if "\n" in text else text


def _default(value: ast.expr | None, src: str) -> str | None:
    """The default as a reader would write it: ``field(default_factory=list)`` is ``[]``."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute)) and \
            (value.func.id if isinstance(value.func, ast.Name) else value.func.attr) == "field":
        kw = {k.arg: k.value for k in value.keywords}
        if "default" in kw:
            return _source(kw["default"], src)
        factory = kw.get("default_factory")
        if factory is None:
            return None
        if isinstance(factory, ast.Lambda):
            return _source(factory.body, src)
        name = _source(factory, src)
        return {"list": "[]", "dict": "{}", "set": "set()", "tuple": "()"}.get(name, f"{name}()")
    return _source(value, src)


def _valid(value: ast.expr | None, module_names: dict[str, ast.expr]) -> str:
    """The text of a field's rule: the last string argument of ``rule(...)`` / ``choice(...)`` in
    ``field(metadata=...)``, the metadata given inline or by a module-level name ('' if none)."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))):
        return ""
    meta = next((k.value for k in value.keywords if k.arg == "metadata"), None)
    if isinstance(meta, ast.Name):
        meta = module_names.get(meta.id)
    if isinstance(meta, ast.Call) and meta.args:
        last = meta.args[-1]
        if isinstance(last, ast.Constant) and isinstance(last.value, str):
            return last.value
    return ""


def parse(files: list[Path]) -> tuple[dict[str, Section], dict[str, EnumClass]]:
    """Every dataclass section and every Enum class of ``files``, by class name, in source order."""
    sections: dict[str, Section] = {}
    enums: dict[str, EnumClass] = {}
    classes: list[tuple[ast.ClassDef, str, dict[str, ast.expr]]] = []
    for path in files:
        src = path.read_text()
        tree = ast.parse(src, filename=str(path))
        names = {t.id: stmt.value for stmt in tree.body if isinstance(stmt, ast.Assign)
                 for t in stmt.targets if isinstance(t, ast.Name)}
        classes += [(node, src, names) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    enum_names = set(ENUM_BASES)
    grew = True
    while grew:  # an Enum's subclass is an Enum too (``class Reward(Choice)``, ``class Choice(str, Enum)``)
        grew = False
        for node, _, _ in classes:
            if node.name not in enum_names and enum_names & set(_base_names(node)):
                enum_names.add(node.name)
                grew = True
    for node, src, module_names in classes:
        doc = inspect.cleandoc(ast.get_docstring(node, clean=False) or "")
        bases = _base_names(node)
        if enum_names & set(bases):
            members = []
            for i, stmt in enumerate(node.body):
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
                if isinstance(target, ast.Name) and not target.id.startswith("_"):
                    v = stmt.value
                    shown = v.value if isinstance(v, ast.Constant) else _source(v, src)
                    members.append((stmt.targets[0].id, str(shown), _docstring_after(node.body, i)))
            enums[node.name] = EnumClass(node.name, doc, members)
        elif _is_dataclass(node):
            sec = Section(node.name, doc, bases)
            for i, stmt in enumerate(node.body):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    ann, names = _annotation(stmt.annotation, src)
                    if "ClassVar" in names:
                        continue
                    sec.fields.append(Field(stmt.target.id, ann, _default(stmt.value, src),
                                            _docstring_after(node.body, i), names, _valid(stmt.value, module_names)))
            sections[node.name] = sec
    return sections, enums


def _md(text: str) -> str:
    """reStructuredText inline markup to Markdown: ``x`` -> `x`, :class:`X` -> `X`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _paragraphs(text: str) -> str:
    """Join each paragraph's lines (keeping list items on their own lines)."""
    out = []
    for para in re.split(r"\n\s*\n", text.strip()):
        lines = [ln.strip() for ln in para.splitlines()]
        buf: list[str] = []
        for ln in lines:
            if re.match(r"^([-*]|\d+\.)\s", ln) and buf:
                out.append(" ".join(buf))
                buf = []
            buf.append(ln)
        out.append(" ".join(buf))
        out.append("")
    return "\n".join(out).strip()


def _default_shown(default: str | None, enums: dict[str, EnumClass]) -> str:
    if default is None:
        return "required"
    m = re.fullmatch(r"(\w+)\.(\w+)", default)
    if m and m.group(1) in enums:  # AdvantageKind.GAE -> its value
        for name, value, _ in enums[m.group(1)].members:
            if name == m.group(2):
                return value
    return default


def _all_fields(sec: Section, sections: dict[str, Section]) -> list[Field]:
    inherited = [f for b in sec.bases if b in sections for f in _all_fields(sections[b], sections)]
    own = {f.name for f in sec.fields}
    return [f for f in inherited if f.name not in own] + sec.fields


def render(sections: dict[str, Section], enums: dict[str, EnumClass], sources: list[Path], root: Path = ROOT) -> str:
    names = ", ".join(f"`{p.relative_to(root).as_posix()}`" for p in sources)
    lines = [
        "# Configuration reference",
        "",
        f"<!-- GENERATED by tools/gen_config_docs.py from {names}: do not edit by hand. -->",
        "",
        f"Generated from the field docstrings in {names} by `python tools/gen_config_docs.py`",
        "(`--check` fails when this page is stale; `tests/house/test_docs.py` runs it). Every key has its default",
        "in code; a YAML file (`configs/*.yaml`) and `key=value` overrides on the command line only change",
        "what they name: `t1async launch configs/local.yaml learner.max_steps=4 rollout.num_actors=3`.",
        "An unknown key or a wrongly typed value is refused in one line naming the key.",
        "",
    ]
    top = sections.get("Config")
    order: list[tuple[str, Section, str]] = []  # (key prefix, section, docstring of the field holding it)
    seen: set[str] = set()

    def visit(prefix: str, sec: Section, field_doc: str) -> None:
        seen.add(sec.name)
        if prefix:
            order.append((prefix, sec, field_doc))
        for f in _all_fields(sec, sections):
            sub = [n for n in f.type_names if n in sections and n not in seen]
            if sub:
                visit(f"{prefix}.{f.name}" if prefix else f.name, sections[sub[0]], f.doc)

    if top is not None:
        visit("", top, "")
    for sec in sections.values():  # dataclasses no section of Config holds
        if sec.name not in seen:
            order.append((sec.name, sec, ""))
            seen.add(sec.name)

    lines.append("Sections: " + ", ".join(f"[`{p}`](#{p.replace('.', '')})" for p, _, _ in order) + ".")
    lines.append("")
    for prefix, sec, field_doc in order:
        lines += [f"## {prefix}", ""]
        lines.append(f"`{sec.name}`" + (f": {_paragraphs(_md(sec.doc))}" if sec.doc else ""))
        if field_doc:
            lines += ["", _paragraphs(_md(field_doc))]
        lines.append("")
        for f in _all_fields(sec, sections):
            if any(n in sections for n in f.type_names):
                key = f"{prefix}.{f.name}"
                lines.append(f"- `{key}`: section [`{key}`](#{key.replace('.', '')})")
                continue
            head = f"- `{prefix}.{f.name}` (`{f.annotation}`, default `{_default_shown(f.default, enums)}`)"
            body = _paragraphs(_md(f.doc)) if f.doc else "(no docstring)"
            lines.append(f"{head}: {body}".replace("\n\n", "\n\n  ").replace("\n- ", "\n  - "))
            if f.valid and not any(n in enums for n in f.type_names):  # (an Enum field lists its values below)
                lines.append(f"  Valid: {_md(f.valid)}.")
            for e in (enums[n] for n in sorted(f.type_names) if n in enums):
                values = ", ".join(f"`{v}`" + (f" ({_md(d).splitlines()[0]})" if d else "") for _, v, d in e.members)
                lines.append(f"  Values (`{e.name}`): {values}.")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def generate(root: Path = ROOT) -> str:
    sources = config_sources(root)
    sections, enums = parse(sources)
    return render(sections, enums, sources, root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    ap.add_argument("--out", type=Path, default=PAGE, help="page to write or check (default docs/configuration.md)")
    ap.add_argument("--root", type=Path, default=ROOT, help="source tree holding t1async/ (default this checkout)")
    args = ap.parse_args(argv)
    text = generate(args.root)
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"gen_config_docs: {args.out} is stale: run python tools/gen_config_docs.py", file=sys.stderr)
            return 1
        print(f"gen_config_docs: {args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"gen_config_docs: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
