"""The user's own reward function (``reward_function: {path, name}`` in the job): a Python
function the user explicitly points to, called on the controller with (prompt text, response
text, data row) and returning a float or a mapping with a ``score``. Nothing else read from
files is executed."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from profiles.datafile import SpecError


class RewardFunctionError(RuntimeError):
    """The user's reward function raised or returned something that is not a finite score;
    the message names the iteration's row and the function."""


def load_reward_function(path: str, name: str) -> Callable[..., Any]:
    """Import ``name`` from the Python file ``path``; SpecError naming the key otherwise."""
    file = Path(path)
    if not file.is_file():
        raise SpecError(f"{path} is not a file", key="reward_function.path")
    spec = importlib.util.spec_from_file_location(f"hybridflow_reward_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise SpecError(f"{path} is not a Python module", key="reward_function.path")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's module failed at import: say so in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SpecError(f"importing {path} failed: {type(exc).__name__}: {first}",
                        key="reward_function.path") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise SpecError(f"{path} has no function {name}", key="reward_function.name")
    return function


def score_texts(function: Callable[..., Any], prompts: Sequence[str],
                responses: Sequence[str], rows: Sequence[dict],
                where: str) -> torch.Tensor:
    """The function's score of every (prompt, response, row), as a float tensor."""
    scores = []
    for index, (prompt, response, row) in enumerate(zip(prompts, responses, rows,
                                                        strict=True)):
        try:
            value = function(prompt, response, row)
        except Exception as exc:  # the user's code: report which row, in one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise RewardFunctionError(f"{where}, row {index}: the reward function raised "
                                      f"{type(exc).__name__}: {first}") from None
        if isinstance(value, dict):
            value = value.get("score")
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not math.isfinite(value):
            raise RewardFunctionError(f"{where}, row {index}: the reward function returned "
                                      f"{value!r}, not a finite number (or a mapping with a "
                                      "finite 'score')")
        scores.append(float(value))
    return torch.tensor(scores)
