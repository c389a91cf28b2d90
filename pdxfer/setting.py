"""A setting's metadata, written once on its dataclass field: default, help, environment name.

``setting(...)`` declares a field; ``settings_of(cls)`` reads the fields back as ``Setting``
records. The CLI flags, the vLLM connector's keys, the ``PDXFER_*`` registry and
docs/configuration.md are all generated from these records, so a default or a help text never
has a second copy to drift from.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    env: str = "",
    choices: tuple[str, ...] = (),
    shown: str = "",
    flags: tuple[str, ...] = (),
    metavar: str = "",
    factory: Callable[[], Any] | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field with its metadata: ``help`` (one text for flags, keys and docs),
    ``env`` (the ``PDXFER_*`` variable that sets it, if any), ``choices`` (the values a user may
    name where the type does not say), ``shown`` (how the docs print the default when
    the value itself would mislead, e.g. ``min(4, cores)`` for 0), and for its command-line
    flag ``flags`` (the option strings, when not the field's name) and ``metavar``."""
    meta = {
        "help": help,
        "env": env,
        "choices": choices,
        "shown": shown,
        "flags": flags,
        "metavar": metavar,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta, repr=repr)
    return field(default=default, metadata=meta, repr=repr)


@dataclass(frozen=True, slots=True)
class Setting:
    """One field of a settings dataclass, as generators read it."""

    name: str
    kind: str
    """``str``, ``int``, ``float``, ``bool``, ``str | None`` ... (a ``Literal`` is ``str``)."""
    default: Any
    """The default value (``MISSING`` when the field is required; a factory's is ``None``)."""
    help: str
    env: str = ""
    choices: tuple[str, ...] = ()
    shown: str = ""
    flags: tuple[str, ...] = ()
    metavar: str = ""

    @property
    def required(self) -> bool:
        return self.default is MISSING


def flag_of(name: str) -> str:
    """A setting's flag: ``bootstrap_timeout_s`` -> ``--bootstrap-timeout``."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def dest_of(s: Setting) -> str:
    """The attribute argparse stores ``s``'s flag under (its first option string's)."""
    return (s.flags or (flag_of(s.name),))[0].lstrip("-").replace("-", "_")


def from_namespace(cls: type, a: Any) -> dict[str, Any]:
    """``cls``'s settings as a parsed namespace holds them (each under its flag's
    ``dest_of``; a repeated flag's list as a tuple), ready for ``cls(**...)``; a setting
    the namespace lacks keeps its field's default."""
    out: dict[str, Any] = {}
    for name, s in settings_of(cls).items():
        if not hasattr(a, dest_of(s)):
            continue
        v = getattr(a, dest_of(s))
        out[name] = tuple(v) if s.kind.startswith("tuple[") and v is not None else v
    return out


def settings_of(cls: type) -> dict[str, Setting]:
    """``cls``'s fields that carry a help text (``setting(...)``, or a plain field with
    ``metadata={"help": ...}``), by name, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        if "help" not in f.metadata:
            continue
        hint = hints[f.name]
        meta = {"env": "", "choices": (), "shown": "", "flags": (), "metavar": "", **f.metadata}
        kind, choices = str(f.type), tuple(meta["choices"])
        if typing.get_origin(hint) is Literal:
            kind, choices = "str", choices or typing.get_args(hint)
        default = f.default if f.default_factory is MISSING else None
        out[f.name] = Setting(
            f.name,
            kind,
            default,
            meta["help"],
            meta["env"],
            choices,
            meta["shown"],
            tuple(meta["flags"]),
            meta["metavar"],
        )
    return out
