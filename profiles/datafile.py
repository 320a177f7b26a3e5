"""Typed loading of the project's data files (YAML / JSON) into frozen dataclasses.

Every user-facing file (device profiles, model specs, jobs, plans) goes through here so that a
bad file always produces the same kind of message: ``FILE: KEY: PROBLEM``. This module is at the
bottom of the package stack (``profiles`` <- ``simulator`` <- ``planner``), which is why the
simulator's specs import it from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import stat
import tempfile
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class SpecError(ValueError):
    """A problem in user input, phrased for the user: which file, which key, what is wrong."""

    def __init__(self, problem: str, *, key: str | None = None, source: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.key = key
        self.source = source

    def within(self, key_prefix: str | None = None, source: str | None = None) -> SpecError:
        """The same error seen from an enclosing mapping (``key`` gets ``key_prefix.``)."""
        key = self.key
        if key_prefix:
            key = f"{key_prefix}.{key}" if key else key_prefix
        return SpecError(self.problem, key=key, source=self.source or source)

    def __str__(self) -> str:
        parts = [p for p in (self.source, self.key) if p]
        return ": ".join([*parts, self.problem])


MAX_INPUT_BYTES = 2**31
"""Largest text input read whole (jobs, plans, profiles, run records; 2 GiB): the
measurements of a run of about a million iterations (a PPO iteration writes about 2 KB),
small enough that a wrong path (a disk image) fails in a line instead of filling memory.
Training data is streamed, never read whole."""


def check_regular_file(path: str | os.PathLike[str]) -> os.stat_result:
    """The file's status, or a SpecError naming it when it is missing, a directory, a FIFO,
    socket or device, or cannot be looked at. A FIFO is refused before anything opens it:
    opening one blocks until something writes to it."""
    source = str(path)
    try:
        info = Path(path).stat()
    except FileNotFoundError:
        raise SpecError("file not found", source=source) from None
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror or exc}", source=source) from None
    if stat.S_ISDIR(info.st_mode):
        raise SpecError("is a directory, expected a file", source=source)
    if not stat.S_ISREG(info.st_mode):
        raise SpecError("not a regular file (a pipe, socket or device), expected a file",
                        source=source)
    return info


def read_text_file(path: str | os.PathLike[str], *, what: str = "UTF-8 text") -> str:
    """A user's text file, whole; anything else (see ``check_regular_file``; unreadable, not
    UTF-8, larger than ``MAX_INPUT_BYTES``) is a SpecError naming the file."""
    path = Path(path)
    source = str(path)
    info = check_regular_file(path)
    if info.st_size > MAX_INPUT_BYTES:
        raise SpecError(f"{info.st_size} bytes, larger than the {MAX_INPUT_BYTES} this input "
                        "may have: is it the right file?", source=source)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"not a text file (expected {what})", source=source) from None
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror or exc}", source=source) from None


def read_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML (safe_load) or JSON file whose top level must be a mapping."""
    path = Path(path)
    source = str(path)
    text = read_text_file(path, what="UTF-8 YAML or JSON")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"not valid JSON: line {exc.lineno}: {exc.msg}", source=source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or "could not parse"
        raise SpecError(f"not valid YAML: {where}{what}", source=source) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise SpecError(f"top level must be a mapping of keys, got {kind}", source=source)
    return data


def current_umask() -> int:
    """The process's file-creation mask (reading it means setting it, so set it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename.

    A crash or a full disk leaves either the old file or the new one, never half of either.
    The file gets the mode any other tool's output would (0666 less the umask), not the
    temporary file's 0600, so teammates on a shared filesystem can read it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~current_umask())
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (inf, nan) replaced by ``None``.

    Python's json writes ``Infinity`` and ``NaN``, which strict JSON parsers reject; an
    infeasible plan's time is infinite, so every JSON the project writes goes through here.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
        return json_safe(value.item())
    return value


def json_text(value: Any, *, indent: int | None = 2, default: Callable[[Any], Any] | None = None
              ) -> str:
    """Strict JSON text of ``value`` (non-finite numbers as ``null``), ending in a newline."""
    return json.dumps(json_safe(value), indent=indent, allow_nan=False, default=default) + "\n"


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) if not isinstance(a, str) else a for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return repr(value)


def convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert it (e.g. list -> tuple)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return convert(value, option, key)
            except SpecError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise SpecError(f"expected {_type_name(tp)}, got {_describe(value)}", key=key)
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise SpecError(
            f"must be one of {', '.join(map(str, allowed))}; got {_describe(value)}", key=key
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(f"expected true or false, got {_describe(value)}", key=key)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise SpecError(f"expected an integer, got {_describe(value)}", key=key)
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # PyYAML (YAML 1.1) reads 1.5e12 (no sign in the exponent) as a string.
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise SpecError(f"expected a number, got {_describe(value)}", key=key)
        if not math.isfinite(number):
            raise SpecError(f"expected a finite number, got {_describe(value)}", key=key)
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise SpecError(f"expected a string, got {_describe(value)}", key=key)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise SpecError(f"expected a mapping, got {_describe(value)}", key=key)
        return from_mapping(tp, value, key_prefix=key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"expected a list, got {_describe(value)}", key=key)
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise SpecError(f"expected a mapping, got {_describe(value)}", key=key)
        key_tp, value_tp = get_args(tp) or (Any, Any)
        out = {}
        for k, v in value.items():
            k = convert(k, key_tp, f"{key}")
            out[k] = convert(v, value_tp, f"{key}.{k}")
        return out
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise SpecError(f"expected {_type_name(tp)}, got {_describe(value)}", key=key)


def field_parser(parse: Callable[[Any, str], Any]) -> dict[str, Any]:
    """Dataclass field metadata: parse this field's raw value with ``parse(value, key)``."""
    return {"parse": parse}


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """' (did you mean 'x'?)' for the closest of ``choices`` to a mistyped ``word`` (case
    ignored), or '' when none is close."""
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def from_mapping(
    cls: type[T],
    data: Mapping[str, Any],
    *,
    source: str | None = None,
    key_prefix: str = "",
) -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types.

    Fields may carry ``metadata={"parse": fn}`` for values with several accepted forms.
    Errors raised by ``cls.__post_init__`` as :class:`SpecError` get the key prefix and source.
    """
    if not isinstance(data, Mapping):
        raise SpecError(f"expected a mapping, got {_describe(data)}", key=key_prefix or None,
                        source=source)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    prefix = f"{key_prefix}." if key_prefix else ""
    unknown = [k for k in data if k not in fields]
    if unknown:
        allowed = ", ".join(fields)
        hint = did_you_mean(str(unknown[0]), list(fields))
        raise SpecError(
            f"unknown key{hint} (allowed: {allowed})", key=f"{prefix}{unknown[0]}",
            source=source
        )
    kwargs: dict[str, Any] = {}
    try:
        for name, field in fields.items():
            if name not in data:
                no_default = (
                    field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING
                )
                if no_default:
                    raise SpecError("missing required key", key=f"{prefix}{name}")
                continue
            parse = field.metadata.get("parse")
            if parse is not None:
                kwargs[name] = parse(data[name], f"{prefix}{name}")
            else:
                kwargs[name] = convert(data[name], hints[name], f"{prefix}{name}")
        try:
            return cls(**kwargs)
        except SpecError as exc:
            raise exc.within(key_prefix or None) from None
    except SpecError as exc:
        if source and not exc.source:
            raise exc.within(source=source) from None
        raise


def to_mapping(obj: Any) -> Any:
    """A dataclass (tree) as plain dicts/lists, for JSON/YAML output (derived fields, those
    not given to the constructor, are left out)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_mapping(v) for k, v in obj.items()}
    return obj


def require(condition: bool, problem: str, key: str | None = None) -> None:
    """Raise :class:`SpecError` with ``problem`` unless ``condition`` holds (for __post_init__)."""
    if not condition:
        raise SpecError(problem, key=key)


def merged_mapping(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``, section by section (nested mappings merge key by key;
    anything else in ``override`` replaces what ``base`` has)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged_mapping(out[key], value)
        else:
            out[key] = value
    return out


__all__ = [
    "SpecError",
    "convert",
    "did_you_mean",
    "field_parser",
    "from_mapping",
    "merged_mapping",
    "read_mapping",
    "require",
    "to_mapping",
    "write_text_atomic",
]
