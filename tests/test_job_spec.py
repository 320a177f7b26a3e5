from __future__ import annotations

from pathlib import Path

import pytest

from profiles.datafile import SpecError
from simulator.specs.job import RULE, JobSpec, job_from_mapping, load_job
from simulator.specs.lengths import LengthDistribution, parse_lengths
from tests.conftest import EXAMPLES, write

BASE = """\
algorithm: ppo
models: {actor: tiny-2l, critic: tiny-2l, ref: tiny-2l, reward: tiny-2l}
cluster: {nodes: 1, gpus_per_node: 4, device: a100-80gb}
workload: {prompts_per_iteration: 16, prompt_length: 32, response_length: 32}
"""


def test_examples_load() -> None:
    for path in EXAMPLES.glob("*.yaml"):
        job = load_job(path)
        assert job.cluster.total_gpus > 0
        assert set(job.models) == set(job.dataflow.roles)


def test_default_job_is_the_papers(paper_job: JobSpec) -> None:
    assert paper_job.algorithm == "ppo"
    assert paper_job.cluster.total_gpus == 16
    assert paper_job.workload.tokens_per_iteration() == 1024 * 2048
    assert {m.name for m in paper_job.models.values()} == {"llama2-7b"}


@pytest.mark.parametrize(
    ("old", "new", "key", "problem"),
    [
        ("algorithm: ppo", "algorithm: dpo", "algorithm", "unknown algorithm 'dpo'"),
        ("prompt_length: 32", "prompt_length: -5", "workload.prompt_length",
         "must be a positive integer"),
        ("prompt_length: 32", "prompt_lenght: 32", "workload.prompt_lenght", "unknown key"),
        ("reward: tiny-2l}", "reward: tiny-2l, cost: tiny-2l}", "models.cost",
         "ppo has no role 'cost'"),
        ("critic: tiny-2l, ", "", "models.critic", "missing"),
        ("actor: tiny-2l", "actor: rule", "models.actor", "only reward, cost can be a rule"),
        ("nodes: 1", "nodes: 0", "cluster.nodes", "must be a positive integer"),
        ("device: a100-80gb", "device: tpu-v9", "cluster.device", "unknown device profile"),
        ("response_length: 32", "response_length: -1", "workload.response_length",
         "must be a positive integer"),
        ("response_length: 32", "response_length: {distribution: zipf}",
         "workload.response_length.distribution", "must be one of"),
        ("response_length: 32", "response_length: {distribution: uniform, min: 9, max: 3}",
         "workload.response_length.min", "min <= max"),
        ("cluster:", "clutser:", "clutser", "unknown key"),
        ("prompts_per_iteration: 16", "prompts_per_iteration: 100000000",
         "workload.prompts_per_iteration", "above the planner's limit of 16777216"),
    ],
)
def test_bad_job_names_file_key_and_problem(tmp_path: Path, old: str, new: str, key: str,
                                            problem: str) -> None:
    assert old in BASE
    path = write(tmp_path / "job.yaml", BASE.replace(old, new))
    with pytest.raises(SpecError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}"), message
    assert problem in message


def test_parallel_pins_are_checked(tmp_path: Path) -> None:
    path = write(tmp_path / "job.yaml", BASE + "parallel:\n  actor: {tp: 8}\n")
    with pytest.raises(SpecError, match=r"parallel.actor.tp: tp=8 is larger than a node \(4"):
        load_job(path)
    path = write(tmp_path / "job.yaml", BASE + "parallel:\n  critic: {generation_tp: 2}\n")
    with pytest.raises(SpecError, match="only the actor generates"):
        load_job(path)
    path = write(tmp_path / "job.yaml", BASE + "parallel:\n  actor: {tp: 3}\n")
    with pytest.raises(SpecError, match="does not divide the 4 heads"):
        load_job(path)


def test_rule_reward_and_grpo_group_size(tmp_path: Path) -> None:
    text = BASE.replace("algorithm: ppo", "algorithm: grpo").replace("critic: tiny-2l, ", "")
    text = text.replace("reward: tiny-2l", "reward: rule")
    path = write(tmp_path / "job.yaml", text)
    with pytest.raises(SpecError, match="samples_per_prompt must be >= 2"):
        load_job(path)
    path = write(tmp_path / "job.yaml", text.replace("response_length: 32",
                                                     "response_length: 32, samples_per_prompt: 4"))
    job = load_job(path)
    assert job.models["reward"] == RULE
    assert job.gpu_roles == ("actor", "ref")
    assert job.rule_roles == ("reward",)


def test_length_distributions() -> None:
    fixed = parse_lengths(100, "r")
    assert fixed.sample(3) == (100, 100, 100) and fixed.max_tokens == 100
    uniform = parse_lengths({"distribution": "uniform", "min": 100, "max": 300}, "r")
    assert uniform.mean_tokens() == pytest.approx(200, rel=0.01)
    normal = parse_lengths({"distribution": "normal", "mean": 500, "std": 200, "max": 600}, "r")
    sample = normal.sample(1000)
    assert max(sample) == 600  # clipped at max: the mass above piles up there
    assert sum(s == 600 for s in sample) > 250
    lognormal = parse_lengths({"distribution": "lognormal", "median": 400, "sigma": 0.8,
                               "max": 4096}, "r")
    tail = lognormal.sample(1000)
    assert sorted(tail) == list(tail)
    assert tail[499] == pytest.approx(400, rel=0.02)
    assert lognormal.mean_tokens() > 400  # right-skewed
    with pytest.raises(SpecError, match="lognormal needs median, sigma and max"):
        parse_lengths({"distribution": "lognormal", "median": 400}, "r")


def test_max_entropy_lengths_keep_the_mean_and_weigh_towards_the_cap_as_the_mean_rises(
) -> None:
    """Only the mean and the cap known: the truncated exponential of that mean (Jaynes)."""
    low = parse_lengths({"distribution": "max_entropy", "mean": 795, "max": 3969}, "r")
    sample = low.sample(2048)
    assert sum(sample) / len(sample) == pytest.approx(795, rel=0.005)
    assert low.mean_tokens() == 795
    assert sorted(sample) == list(sample) and sample[-1] <= 3969
    # Falling density: the median sits below the mean, the longest of 2048 near the cap.
    assert sample[1024] < 795 and sample[-1] > 3800
    high = parse_lengths({"distribution": "max_entropy", "mean": 3283, "max": 3992}, "r")
    tail = high.sample(2048)
    assert sum(tail) / len(tail) == pytest.approx(3283, rel=0.005)
    assert tail[1024] > 3283  # rising density: lengths pile up against the cap
    middle = parse_lengths({"distribution": "max_entropy", "mean": 500, "min": 1, "max": 999},
                           "r")
    assert middle.sample(5) == pytest.approx((100, 300, 500, 700, 899), abs=1)  # uniform
    assert low.to_value() == {"distribution": "max_entropy", "max": 3969, "mean": 795}
    with pytest.raises(SpecError, match="mean: need min <= mean <= max"):
        parse_lengths({"distribution": "max_entropy", "mean": 5000, "max": 4096}, "r")
    with pytest.raises(SpecError, match="max_entropy needs mean and max"):
        parse_lengths({"distribution": "max_entropy", "mean": 500}, "r")


def test_empirical_lengths_from_csv(tmp_path: Path) -> None:
    csv = write(tmp_path / "lengths.csv", "length,count\n100,3\n1000,1\n")
    dist = parse_lengths({"distribution": "empirical", "csv": "lengths.csv"}, "r", tmp_path)
    assert isinstance(dist, LengthDistribution)
    assert dist.max_tokens == 1000
    assert dist.mean_tokens() == pytest.approx(325)
    assert dist.sample(4) == (100, 100, 100, 1000)
    write(csv, "length,count\n100,3\nabc,1\n")
    with pytest.raises(SpecError, match="line 3"):
        parse_lengths({"distribution": "empirical", "csv": str(csv)}, "r")
    write(csv, "tokens\n5\n")
    with pytest.raises(SpecError, match="needs a 'length' column"):
        parse_lengths({"distribution": "empirical", "csv": str(csv)}, "r")


def test_typos_get_a_did_you_mean_and_device_and_model_names_ignore_case() -> None:
    base = {"algorithm": "grpo", "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b",
                                            "reward": "rule"},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "h100-80gb"},
            "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 4}}
    with pytest.raises(SpecError, match=r"modles: unknown key \(did you mean 'models'\?\)"):
        job_from_mapping({**{k: v for k, v in base.items() if k != "models"},
                          "modles": base["models"]})
    with pytest.raises(SpecError, match=r"workload\.prompt_lenght: unknown key \(did you mean "
                                        r"'prompt_length'\?\)"):
        job_from_mapping({**base, "workload": {**base["workload"], "prompt_lenght": 8}})
    with pytest.raises(SpecError, match=r"unknown device profile 'h100-80gv' \(did you mean "
                                        r"'h100-80gb'\?\)"):
        job_from_mapping({**base, "cluster": {**base["cluster"], "device": "h100-80gv"}})
    with pytest.raises(SpecError, match=r"unknown model 'qwen2.5-7c' \(did you mean "
                                        r"'qwen2.5-7b'\?\)"):
        job_from_mapping({**base, "models": {**base["models"], "ref": "qwen2.5-7c"}})
    shouted = job_from_mapping({**base, "cluster": {**base["cluster"], "device": "H100-80GB"},
                                "models": {**base["models"], "actor": "Qwen2.5-7B"}})
    assert shouted.cluster.profile().name == "h100-80gb"
    assert shouted.model("actor").name == "qwen2.5-7b"
