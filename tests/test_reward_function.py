"""The user's reward function: loaded only from the file the job names, called with decoded
texts and the data row, and every way it can go wrong reported in one line naming the row."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from executor.reward_function import RewardFunctionError, load_reward_function, score_texts
from executor.task import SortDigits
from profiles.datafile import SpecError
from simulator.specs.job import job_from_mapping, load_job


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_load_errors_name_the_key(tmp_path: Path) -> None:
    cases = [
        (tmp_path / "missing.py", "compute_score", "reward_function.path", "is not a file"),
        (write(tmp_path / "broken.py", "def compute_score(:\n"), "compute_score",
         "reward_function.path", "SyntaxError"),
        (write(tmp_path / "raises.py", "raise RuntimeError('no GPU here')\n"),
         "compute_score", "reward_function.path", "RuntimeError: no GPU here"),
        (write(tmp_path / "other.py", "def score(p, r, row):\n    return 1.0\n"),
         "compute_score", "reward_function.name", "has no function compute_score"),
    ]
    for path, name, key, problem in cases:
        with pytest.raises(SpecError) as caught:
            load_reward_function(str(path), name)
        assert caught.value.key == key and problem in str(caught.value)


def test_scores_are_floats_or_mappings_and_bad_ones_name_the_row(tmp_path: Path) -> None:
    def mixed(prompt: str, response: str, row: dict) -> object:
        return {"score": 0.5} if prompt == "a" else 1

    assert score_texts(mixed, ["a", "b"], ["x", "y"], [{}, {}], "reward.infer").tolist() == \
        [0.5, 1.0]
    for bad, problem in ((math.nan, "returned nan"), ("0.3", "returned '0.3'"),
                         ({"value": 1.0}, "returned None"), (True, "returned True")):
        with pytest.raises(RewardFunctionError, match=f"row 1: the reward function {problem}"):
            score_texts(lambda p, r, row, bad=bad: 0.0 if p == "a" else bad,
                        ["a", "b"], ["x", "y"], [{}, {}], "reward.infer")

    def boom(prompt: str, response: str, row: dict) -> float:
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match="row 0: the reward function raised KeyError"):
        score_texts(boom, ["a"], ["x"], [{}], "reward.infer")


def test_the_task_gives_text_and_rows() -> None:
    task = SortDigits()
    prompt = torch.tensor([1, 4 + 3, 4 + 1, 4 + 2, 3])
    assert task.text(prompt) == "3 1 2"
    assert task.text(torch.tensor([4 + 1, 4 + 2, 2, 4 + 3])) == "1 2"  # stops at EOS
    assert task.row(prompt) == {"digits": [3, 1, 2], "answer": "1 2 3"}


def test_the_job_names_its_reward_function(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "algorithm: grpo\nmodels: {actor: tiny-2l, ref: tiny-2l, reward: rule}\n"
        "cluster: {nodes: 1, gpus_per_node: 2}\nworkload: {samples_per_prompt: 2}\n"
        "reward_function: {path: my_reward.py, name: score}\n")
    with pytest.raises(SpecError, match=r"reward_function\.path: file not found: .*my_reward"):
        load_job(job_file)
    (tmp_path / "my_reward.py").write_text("def score(prompt, response, row):\n    return 0.0\n")
    (tmp_path / "r.py").write_text("")
    job = load_job(job_file)
    assert job.reward_function is not None
    assert job.reward_function.path == str(tmp_path.resolve() / "my_reward.py")  # beside the job
    assert job.to_value()["reward_function"]["name"] == "score"
    with pytest.raises(SpecError, match=r"give models\.reward: rule"):
        job_from_mapping({"algorithm": "ppo", "models": {r: "tiny-2l" for r in (
            "actor", "critic", "ref", "reward")}, "cluster": {"nodes": 1, "gpus_per_node": 2},
            "reward_function": {"path": str(tmp_path / "r.py")}})
    with pytest.raises(SpecError, match="not a function name"):
        job_from_mapping({"algorithm": "grpo", "models": {"actor": "tiny-2l", "ref": "tiny-2l",
                                                          "reward": "rule"},
                          "cluster": {"nodes": 1, "gpus_per_node": 2},
                          "workload": {"samples_per_prompt": 2},
                          "reward_function": {"path": str(tmp_path / "r.py"),
                                              "name": "not valid"}})
