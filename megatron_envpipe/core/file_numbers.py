"""Numbers read from files (TOML, JSON, CSV): kind and range checked before any conversion.

TOML and JSON give integers of any size: ``float(10**400)`` (and ``10**400 * 1e-3``,
``math.isfinite(10**400)``) raise ``OverflowError``, and Python refuses to parse an integer of
more than 4300 digits at all. So every number a file gives passes through here first:

* :func:`loads_json` / :func:`loads_toml` parse text and refuse, naming the file and the key,
  any number no file of ours holds (an integer beyond :data:`_MAX_FILE_INT`, nan, inf);
* :func:`file_number` checks one parsed value against its :class:`~megatron_envpipe.core.flag_ranges.FlagRange`
  (Python compares ints and floats exactly, without converting) and only then converts it;
* :func:`cell_number` does the same for a CSV cell's text.

Each error is one line: ``FILE: KEY VALUE must be ...``, the value shortened (:func:`short`)
and escaped, so a 400-digit number or a newline in a string never floods or splits the line. Pure Python.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

from megatron_envpipe.core.flag_ranges import FlagRange

__all__ = ["cell_number", "file_number", "loads_json", "loads_toml", "one_line", "short"]

# Larger integers are no measurement, clock or count of ours (the largest, a byte size, is < 2**63).
_MAX_FILE_INT = 2**63 - 1
_MAX_NUMBER_CHARS = 40  # a JSON or CSV number longer than this is refused before it is parsed
_SHORT_CHARS = 40
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

Error = Callable[[str], Exception]


def short(value: Any, limit: int = _SHORT_CHARS) -> str:
    """``value`` as one short line: repr-escaped (a newline shows as ``\\n``), long ones cut with their length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _MAX_FILE_INT:
        # str() of an int over 4300 digits raises: the digit count from its bits (exact to within one)
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = value if isinstance(value, str) and _DECIMAL.fullmatch(value) else repr(value)
    text = one_line(text)
    return text if len(text) <= limit else f"{text[:limit - 5]}... ({len(text)} characters)"


def one_line(value: Any) -> str:
    """``str(value)`` with anything non-printable escaped (``\\n``): text from a file printed as one line."""
    text = str(value)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def file_number(value: Any, rng: FlagRange, where: str, error: Error) -> float | int:
    """``value`` (as TOML/JSON gave it) as a float or int of ``rng``'s kind, after its range check;
    else ``error("WHERE VALUE must be ...")``. ``where`` names the file and key, e.g. ``f.toml: [dynamics] x``."""
    problem = rng.problem(value)
    if problem:
        raise error(f"{where} = {short(value)}: {problem}")
    return int(value) if rng.kind == "int" else float(value)


def cell_number(text: str, rng: FlagRange, where: str, error: Error) -> float | int:
    """A CSV cell's number, of ``rng``'s kind and in its range; else ``error`` naming ``where`` (file:line column)."""
    cell = text.strip()
    if not cell:
        raise error(f"{where}: missing")
    if len(cell) > _MAX_NUMBER_CHARS or not _DECIMAL.fullmatch(cell):
        # nan, inf, 'abc', '0x10', '1_000': no measurement is written so
        raise error(f"{where} {short(cell)} is not a decimal number: {rng.problem('') or 'give a number'}")
    number: float | int = float(cell)
    if rng.kind == "int":
        if not number.is_integer():
            raise error(f"{where} {short(cell)} must be a whole number")
        number = int(number)
    problem = rng.problem(number)
    if problem:
        raise error(f"{where} {short(cell)} {problem}")
    return number


def _check_tree(data: Any, where: str, error: Error, ranges: Mapping[str, FlagRange], toml: bool) -> None:
    """Every number in parsed TOML/JSON is one a file of ours can hold (finite, integers within _MAX_FILE_INT);
    a key of ``ranges`` (dotted path, e.g. ``dynamics.clock_latency_ms``) is held to its own range."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # iterative: a deeply nested file must not exhaust the recursion limit here
        key, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, bool):
            continue
        elif key in ranges and isinstance(item, int | float):
            file_number(item, ranges[key], f"{where}: {_shown(key, toml)}", error)
        elif isinstance(item, int) and abs(item) > _MAX_FILE_INT:
            raise error(f"{where}: {_shown(key, toml)} = {short(item)}: out of range (no figure of this "
                        f"file exceeds {_MAX_FILE_INT:.3g} in magnitude); is it the right file?")
        elif isinstance(item, float) and not math.isfinite(item):
            raise error(f"{where}: {_shown(key, toml)} = {item!r}: must be a finite number")


def _shown(key: str, toml: bool) -> str:
    """A key path as the file's user reads it (``[demo] stages`` in TOML, ``plan.energy_j`` in JSON), one short
    line (a file's key may hold a newline)."""
    table, dot, rest = key.partition(".")
    text = one_line(f"[{table}] {rest}" if toml and dot and "." not in rest else key or "a value")
    return text if len(text) <= 80 else f"{text[:75]}... ({len(text)} characters)"


def loads_toml(text: str, where: str, error: Error, ranges: Mapping[str, FlagRange] | None = None) -> dict[str, Any]:
    """Parsed TOML whose every number is finite and bounded (module docstring); else one-line ``error``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{where}: not valid TOML ({short(str(exc))}); fix the file") from None
    except ValueError:  # an integer of more than 4300 digits (Python refuses to parse it)
        raise error(f"{where}: an integer of more than 4300 digits: no figure of this file is that large; "
                    "is it the right file?") from None
    _check_tree(data, where, error, ranges or {}, toml=True)
    return data


def loads_json(text: str, where: str, error: Error, ranges: Mapping[str, FlagRange] | None = None) -> Any:
    """Parsed JSON, numbers finite and bounded (NaN, Infinity and over-long numbers refused); else ``error``."""

    def constant(name: str) -> None:  # json accepts NaN and Infinity, which no file of ours holds
        raise error(f"{where}: {name} is not a finite number: give finite numbers only")

    def number(kind: type, text: str) -> Any:
        if len(text) > _MAX_NUMBER_CHARS:
            raise error(f"{where}: the number {short(text)} has more than {_MAX_NUMBER_CHARS} characters: "
                        "no figure of this file is written so")
        return kind(text)

    try:
        data = json.loads(text, parse_constant=constant, parse_int=lambda t: number(int, t),
                          parse_float=lambda t: number(float, t))
    except json.JSONDecodeError as exc:
        raise error(f"{where}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply: is it the right file?") from None
    _check_tree(data, where, error, ranges or {}, toml=False)
    return data
