"""Reading a user's launch: the arguments of a trainer's command line, from a file of
arguments (one per line, as ``hybridflow export`` writes them) or from a run script that
calls the trainer (shell variables it assigns are expanded; ``--env NAME=VALUE`` gives the
ones it takes from outside).

Only what a shell does to a plain command line is done here: backslash continuations joined,
``NAME=value`` / ``export NAME=value`` assignments and ``$NAME`` / ``${NAME}`` /
``${NAME:-default}`` expanded, quotes removed. A word that still holds ``$`` (a variable the
script does not set) is kept as written, and a setting the planner needs from it is refused
in one line naming the variable.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from profiles.datafile import SpecError, read_text_file

_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_MAPFILE = re.compile(r"^mapfile\s+-t\s+(\w+)\s*<\s*(?:<\(.*?)?[\"']?([^\s\"')]+)[\"']?\)?\s*$")
_ARRAY = re.compile(r"\$\{(\w+)\[@\]\}")
_ARITHMETIC = re.compile(r"\$\(\((.*?)\)\)")
_ARITHMETIC_NAME = re.compile(rf"\$?({_NAME})")
_ARITHMETIC_TEXT = re.compile(r"[\d\s+\-*/%()]+")
_VARIABLE = re.compile(rf"\$(?:\{{({_NAME})(?::?-([^}}]*))?\}}|({_NAME}))")


@dataclass(slots=True)
class Launch:
    """The words of one trainer command: the module it runs and its arguments."""

    source: str
    """The file read (named in errors)."""
    module: str
    """``python -m MODULE`` (empty for a file of arguments)."""
    arguments: list[str] = field(default_factory=list)
    """The words after the module, variables expanded."""


def expand(text: str, variables: dict[str, str]) -> str:
    """``text`` with the known ``$NAME``, ``${NAME}`` and ``${NAME:-default}`` replaced and
    integer arithmetic ``$((...))`` of known values worked out."""
    def arithmetic(match: re.Match[str]) -> str:
        inner = _ARITHMETIC_NAME.sub(lambda m: variables.get(m.group(1), m.group(0)),
                                     expand(match.group(1), variables))
        value = integer_arithmetic(inner)
        return match.group(0) if value is None else str(value)

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        if name in variables:
            return variables[name]
        if match.group(2) is not None:
            return match.group(2)
        return match.group(0)

    text = _ARITHMETIC.sub(arithmetic, text) if "$((" in text else text
    return _VARIABLE.sub(substitute, text)


def integer_arithmetic(text: str) -> int | None:
    """The value of a shell arithmetic expression of integers (+ - * / %, parentheses), or
    None when it holds anything else."""
    if not _ARITHMETIC_TEXT.fullmatch(text):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, (ast.Div, ast.FloorDiv)) and b:
                return int(a / b)  # the shell truncates toward zero
            if isinstance(node.op, ast.Mod) and b:
                return a % b
        raise ValueError

    try:
        return value(tree)
    except ValueError:
        return None


def logical_lines(text: str) -> list[str]:
    """The script's lines with backslash continuations joined and comments dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        stripped = current.strip()
        if stripped and not stripped.startswith("#"):
            out.append(stripped)
        current = ""
    if current.strip():
        out.append(current.strip())
    return out


def read_launch(path: str | Path, modules: tuple[str, ...], *,
                env: dict[str, str] | None = None) -> Launch:
    """The command in ``path`` that runs one of ``modules`` (``python3 -m MODULE ...``, or a
    script ``... examples/run_grpo.py ...`` for a module named ``run_grpo.py``), or, when the
    file holds no such command, the file read as one argument per line."""
    source = str(path)
    text = read_text_file(path)
    variables = dict(env or {})
    arrays: dict[str, list[str]] = {}
    here = str(Path(path).resolve().parent)
    variables.setdefault("here", here)
    for line in logical_lines(text):
        mapped = _MAPFILE.match(line)
        if mapped:
            # mapfile -t NAME < <(grep ... "FILE"): an array read from a file of arguments
            # (the run scripts `hybridflow export` writes).
            target = Path(expand(mapped.group(2), variables))
            arrays[mapped.group(1)] = _argument_file(target if target.is_absolute()
                                                     else Path(here) / target, variables)
            continue
        try:
            # Arithmetic first: $((1024 * 2)) holds spaces a word split would break.
            words = shlex.split(_ARITHMETIC.sub(
                lambda m: expand(m.group(0), variables), line), comments=True)
        except ValueError as exc:
            raise SpecError(f"cannot read this shell line ({exc}): {line[:80]}",
                            source=source) from None
        if words[:1] == ["export"]:
            words = words[1:]
        if len(words) == 1 and _ASSIGNMENT.match(words[0]):
            name, value = _ASSIGNMENT.match(words[0]).groups()  # type: ignore[union-attr]
            variables.setdefault(name, expand(value, variables))
            continue
        scripts = [i for i, w in enumerate(words)
                   if any(m.endswith(".py") and w.endswith(m) for m in modules)]
        if scripts:
            # A trainer run as a script (NeMo-RL's `uv run examples/run_grpo.py ...`).
            words = [*words[:scripts[0]], "-m", words[scripts[0]], *words[scripts[0] + 1:]]
            modules = (*modules, words[scripts[0] + 1])
        if "-m" in words:
            at = words.index("-m")
            if at + 1 < len(words) and words[at + 1] in modules:
                arguments = []
                for word in words[at + 2:]:
                    array = _ARRAY.fullmatch(word)
                    if array and array.group(1) in arrays:
                        arguments += arrays[array.group(1)]
                    elif word not in ("$@", "${@}"):
                        arguments.append(expand(word, variables))
                return Launch(source=source, module=words[at + 1], arguments=arguments)
    if any(line.lstrip().startswith(("python", "torchrun", "ray job")) for line in
           logical_lines(text)):
        raise SpecError(f"no `python -m {' | '.join(modules)}` command in the script",
                        source=source)
    return Launch(source=source, module="", arguments=_argument_file(Path(path), variables))


def _argument_file(path: Path, variables: dict[str, str]) -> list[str]:
    """The arguments of a file of them (one or more per line, '#' comments skipped)."""
    arguments = []
    for line in read_text_file(path).splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            try:
                arguments += [expand(w, variables) for w in shlex.split(stripped)]
            except ValueError as exc:
                raise SpecError(f"cannot read this line ({exc}): {stripped[:80]}",
                                source=str(path)) from None
    return arguments


def unresolved(value: str) -> bool:
    """Whether ``value`` still names a shell variable the script did not set."""
    return "$" in value
