"""One declaration per server option.

A `ServerArgs` field is declared with `OptionGroup.opt(default, help, ...)`: its annotation is the
type, and the `Option` in its metadata carries the help, the group and the CLI spelling. The
argparse flags (`add_cli_options`), the defaults (the dataclass field) and the generic checks
(`check_options`: choices and declared bounds) all come from that one declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_METADATA_KEY = "option"


@dataclass(frozen=True)
class Option:
    help: str
    group: str
    choices: tuple[Any, ...] | None = None
    aliases: tuple[str, ...] = ()  # further flag spellings, e.g. --tp for --tp-size
    nargs: str | None = None
    parse: Callable[[str], Any] | None = None  # turns the flag's text into the value; default: the annotated type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def bounds(self) -> str | None:
        """The declared range as the error message says it (">= 1", "in (0, 1)"), or None."""
        lo, hi = (self.ge if self.gt is None else self.gt), (self.le if self.lt is None else self.lt)
        if lo is not None and hi is not None:
            return f"in {'[' if self.gt is None else '('}{lo}, {hi}{']' if self.lt is None else ')'}"
        if lo is not None:
            return f"{'>=' if self.gt is None else '>'} {lo}"
        if hi is not None:
            return f"{'<=' if self.lt is None else '<'} {hi}"
        return None

    def within_bounds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )


@dataclass(frozen=True)
class OptionGroup:
    """A `--help` section; its options are the fields declared with its `opt`."""

    title: str

    def opt(
        self,
        default: T,
        help: str,
        *,
        choices: tuple[Any, ...] | None = None,
        aliases: tuple[str, ...] = (),
        nargs: str | None = None,
        parse: Callable[[str], Any] | None = None,
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
        lt: float | None = None,
    ) -> T:
        option = Option(help, self.title, choices, aliases, nargs, parse, ge, gt, le, lt)
        return dataclasses.field(default=default, metadata={_METADATA_KEY: option})


def option_of(f: dataclasses.Field) -> Option:
    return f.metadata[_METADATA_KEY]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(hint: Any) -> Any:
    """`int` for `int | None`; the annotation itself otherwise."""
    if isinstance(hint, types.UnionType):
        (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_cli_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`, in argument groups in the order they first appear."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        o = option_of(f)
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(o.group)
        names = (flag(f.name), *o.aliases)
        value_type = _value_type(hints[f.name])
        if value_type is bool:
            assert f.default is False, f"{f.name}: a bool option is an off-by-default switch"
            groups[o.group].add_argument(*names, dest=f.name, action="store_true", help=o.help)
            continue
        parse = o.parse or (value_type if value_type in (int, float) else str)
        groups[o.group].add_argument(
            *names, dest=f.name, type=parse, default=f.default, choices=o.choices, nargs=o.nargs, help=o.help
        )


def check_options(obj: Any) -> None:
    """The checks every declaration implies: a value among its choices and within its bounds (None is
    accepted where it is the default)."""
    for f in dataclasses.fields(obj):
        o, value = option_of(f), getattr(obj, f.name)
        if value is None and f.default is None:
            continue
        if o.choices is not None and value not in o.choices:
            raise ValueError(f"{flag(f.name)} must be one of {', '.join(map(str, o.choices))}; got {value!r}")
        bounds = o.bounds()
        if bounds is not None and (value is None or not o.within_bounds(value)):
            raise ValueError(f"{flag(f.name)} must be {bounds}, got {value}")
