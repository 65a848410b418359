"""The config reference, generated from the config Structs themselves, never copied by hand:
every setting's dotted path, type, default and docstring (the string under its field in the
source), one page per top-level section.

    python -m rlasync.config.reference docs/reference/config      # writes <section>.md
    entries = settings()                                          # [Setting(path="trainer.lr", ...)]

A field that is a Struct (or a list or union of them) is a subsection: its fields are listed under
its path (``engine.*`` once for each backend, each backend's own fields marked).
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from .loader import Config


class Setting(msgspec.Struct, frozen=True):
    path: str
    """Dotted, as in YAML and in overrides (``trainer.lora.rank``)."""
    type: str
    default: str
    doc: str
    only: str = ""
    """The ``engine.backend`` a field belongs to, when only one backend has it."""


def field_docs(cls: type) -> dict[str, str]:
    """Each field of ``cls`` (and of the Structs it derives from) -> the docstring under it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, msgspec.Struct)) or klass is msgspec.Struct:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        statements = body.body
        for statement, following in zip(statements, [*statements[1:], None]):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                text = following.value.value if _is_docstring(following) else ""  # type: ignore[union-attr]
                docs[statement.target.id] = inspect.cleandoc(text) if text else ""
    return docs


def _is_docstring(node: ast.stmt | None) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _structs(kind: Any) -> list[type[msgspec.Struct]]:
    """The Structs a field of type ``kind`` holds (itself, in a union, a list or a dict)."""
    options = typing.get_args(kind) or (kind,)
    found = [o for o in options if isinstance(o, type) and issubclass(o, msgspec.Struct)]
    for option in options:
        if typing.get_origin(option) in (list, dict, tuple):
            found += _structs(option)
    return found


def _type_name(kind: Any) -> str:
    """``kind`` as a reader writes it: ``float > 0``, ``int >= 0``, ``str | None``."""
    if typing.get_origin(kind) is typing.Annotated:
        inner, *metas = typing.get_args(kind)
        bounds = [
            f"{sign} {getattr(meta, name)}"
            for meta in metas
            for name, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
            if getattr(meta, name, None) is not None
        ]
        return " ".join([_type_name(inner), *bounds[:1]]) + (f", {bounds[1]}" if len(bounds) > 1 else "")
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(option) for option in typing.get_args(kind))
    name = kind.__name__ if isinstance(kind, type) and not typing.get_args(kind) else str(kind)
    for noise in ("typing.", "rlasync.config.", "msgspec."):
        name = name.replace(noise, "")
    return name.replace("NoneType", "None")


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        return repr(field.default)
    if field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
        return "" if isinstance(value, msgspec.Struct) else repr(value)
    return "(required)"


def settings(cls: type[msgspec.Struct] = Config, prefix: str = "") -> list[Setting]:
    """Every setting under ``cls``, in field order (the engine's backends each in turn)."""
    out: dict[str, Setting] = {}
    docs = field_docs(cls)
    parent = cls.__mro__[1]
    backend = parent is not msgspec.Struct and bool(cls.__struct_config__.tag)  # an engine backend's own
    base = {f.name for f in msgspec.structs.fields(parent)} if backend else set()
    for field in msgspec.structs.fields(cls):
        path = f"{prefix}{field.encode_name}"
        inner = _structs(field.type)
        for struct in inner:  # a subsection; a setting two backends share is listed once, for both
            for entry in settings(struct, f"{path}."):
                seen = out.get(entry.path)
                only = ", ".join(filter(None, [seen.only, entry.only])) if seen is not None else entry.only
                out[entry.path] = msgspec.structs.replace(seen or entry, only=only)
        if not inner:
            only = str(cls.__struct_config__.tag) if backend and field.name not in base else ""
            out[path] = Setting(path, _type_name(field.type), _default(field), docs.get(field.name, ""), only)
    return list(out.values())


def pages(entries: list[Setting] | None = None) -> dict[str, str]:
    """``<section>.md`` -> its Markdown: a table of the section's settings."""
    grouped: dict[str, list[Setting]] = {}
    for entry in entries if entries is not None else settings():
        grouped.setdefault(entry.path.split(".")[0], []).append(entry)
    out = {}
    for section, rows in grouped.items():
        lines = [
            f"# `{section}`",
            "",
            "Generated from `rlasync.config` by `python -m rlasync.config.reference` (do not edit).",
            "",
        ]
        for row in rows:
            only = f" (engine.backend={row.only})" if row.only else ""
            lines += [f"## `{row.path}`{only}", "", f"`{row.type}`, default `{row.default}`", "", row.doc, ""]
        out[f"{section}.md"] = "\n".join(lines).rstrip() + "\n"
    out["index.md"] = _index({section: len(rows) for section, rows in grouped.items()})
    return out


def _index(counts: dict[str, int]) -> str:
    """The reference's first page: each section (-> its number of settings) with what its
    Struct's docstring says it is."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(Config)}
    docs = field_docs(Config)
    lines = [
        "# Configuration",
        "",
        "Generated from `rlasync.config` by `python -m rlasync.config.reference` (do not edit).",
        "",
        "A run's config is one YAML file of these sections; any setting can be given on the command",
        "line too, by its dotted path (`rlasync train CONFIG trainer.lr=3e-4 'agent.tools=[calculator]'`).",
        "A key that is not here, or a value of the wrong type, stops the run before it starts with one",
        "line naming the setting. `load_config(path, overrides)` reads the same in a script.",
        "",
        "| section | what it sets | settings |",
        "|---|---|---|",
    ]
    for section, count in counts.items():
        kinds = _structs(fields[section].type)
        summary = inspect.getdoc(kinds[0]) if kinds else docs.get(section, "")
        first = " ".join((summary or "").split("\n\n")[0].split())
        lines.append(f"| [`{section}`]({section}.md) | {first} | {count} |")
    return "\n".join(lines) + "\n"


def main(folder: str) -> None:
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (target / name).write_text(text)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/reference/config")
