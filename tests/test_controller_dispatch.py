"""The driver's serialization of each model call's batch (framework ``controller`` settings):
by-value dispatch to every worker of a shard's model-parallel group costs tp x pp copies,
a shared (``ray.put``) shard one; frameworks whose batch bytes are not counted pay nothing."""

from __future__ import annotations

import pytest

from profiles.datafile import SpecError
from profiles.framework import ControllerSettings, load_framework
from simulator.costs.transfer import controller_dispatch_seconds
from simulator.default_plan import colocate_plan
from simulator.predict import estimate_plan
from simulator.specs.job import job_from_mapping

GB = 1e9


def settings(**overrides) -> ControllerSettings:
    values = {"dispatch": "per_worker", "collect": "every_worker",
              "infer_input_bytes_per_token": 24, "train_input_bytes_per_token": 32,
              "infer_output_bytes_per_token": 4, "serialize_bytes_per_s": 0.5 * GB,
              "deserialize_bytes_per_s": 5 * GB}
    values.update(overrides)
    return ControllerSettings(**values)


def seconds(controller: ControllerSettings, operation: str, *, workers_per_shard: int,
            data_parallel: int = 4) -> float:
    return controller_dispatch_seconds(controller, operation=operation, sequences=2048,
                                       padded_tokens=4096, data_parallel=data_parallel,
                                       workers_per_shard=workers_per_shard)


def test_by_value_dispatch_pickles_the_batch_once_per_worker_of_a_shard() -> None:
    slots = 2048 * 4096
    per_worker = settings()
    train_1, train_16 = (seconds(per_worker, "train", workers_per_shard=w) for w in (1, 16))
    # Driver: copies x 32-byte slots at 0.5 GB/s; each worker unpickles its quarter at 5 GB/s.
    assert train_16 == pytest.approx(16 * slots * 32 / (0.5 * GB) + slots * 32 / 4 / (5 * GB))
    assert train_16 - train_1 == pytest.approx(15 * slots * 32 / (0.5 * GB))
    infer_16 = seconds(per_worker, "infer", workers_per_shard=16)
    assert infer_16 == pytest.approx(
        16 * slots * 24 / (0.5 * GB) + 16 * slots * 4 / (5 * GB)
        + slots * 24 / 4 / (5 * GB) + slots * 4 / 4 / (0.5 * GB))


def test_a_shared_shard_is_pickled_once_whatever_the_model_parallel_group() -> None:
    shared = settings(dispatch="shared", collect="one_per_shard")
    assert seconds(shared, "train", workers_per_shard=16) == pytest.approx(
        seconds(shared, "train", workers_per_shard=1))
    assert seconds(shared, "infer", workers_per_shard=16) < \
        seconds(settings(), "infer", workers_per_shard=16) / 10


def test_uncounted_batches_and_generation_calls_cost_nothing() -> None:
    assert seconds(ControllerSettings(), "train", workers_per_shard=16) == 0
    assert seconds(settings(), "generate", workers_per_shard=16) == 0


@pytest.mark.parametrize(("base", "key", "value", "problem"), [
    ("nemo-rl", "train_input_bytes_per_token", -1, "must be >= 0"),
    ("nemo-rl", "serialize_bytes_per_s", 0, "must be > 0"),
    ("verl", "train_input_bytes_per_token", 32, "needed when a batch byte count is set"),
])
def test_bad_controller_settings_name_the_key(tmp_path, base, key, value, problem) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"base: {base}\nname: bad\ncontroller:\n  {key}: {value}\n")
    with pytest.raises(SpecError, match=problem) as error:
        load_framework(str(path))
    assert "controller." in str(error.value) and str(path) in str(error.value)


def nemo_70b(framework: str):
    return job_from_mapping({
        "algorithm": "grpo", "framework": framework,
        "models": {"actor": "llama3-70b", "ref": "llama3-70b", "reward": "rule"},
        "cluster": {"nodes": 8, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 32,
                     "prompt_length": 127,
                     "response_length": {"distribution": "max_entropy", "mean": 398,
                                         "max": 3969},
                     "mini_batches_per_epoch": 4, "train_micro_batch_size": 1,
                     "infer_micro_batch_size": 4},
        "parallel": {"actor": {"tp": 4, "pp": 4, "sharding": "optimizer",
                               "sequence_parallel": False, "generation_tp": 4},
                     "ref": {"tp": 4, "pp": 4, "sequence_parallel": False}}})


def test_nemo_rl_before_0_7_sends_every_worker_its_own_copy() -> None:
    """70B on 64 GPUs, TP 4 x PP 4: v0.3-v0.5 pickle each shard 16 times, v0.7 once."""
    old, new = nemo_70b("nemo-rl-0.5"), nemo_70b("nemo-rl")
    plan = colocate_plan(old)
    old_nodes = estimate_plan(old, plan).nodes
    new_nodes = estimate_plan(new, plan).nodes
    controller = load_framework("nemo-rl-0.5").controller
    sequences = old_nodes["actor.train"].sequences
    padded = 127 + old.workload.response_length.length_at(2047, 2048)
    assert padded < 127 + 3969  # the batch's longest response, not the cap
    expected = controller_dispatch_seconds(controller, operation="train", sequences=sequences,
                                           padded_tokens=padded, data_parallel=4,
                                           workers_per_shard=16)
    assert old_nodes["actor.train"].detail["dispatch_seconds"] == pytest.approx(expected)
    assert old_nodes["actor.train"].detail["dispatch_seconds"] > \
        8 * new_nodes["actor.train"].detail["dispatch_seconds"] > 0
    assert old_nodes["actor.old_log_prob"].detail["dispatch_seconds"] > \
        new_nodes["actor.old_log_prob"].detail["dispatch_seconds"] > 0
    # The dispatch is part of the node's time.
    assert old_nodes["actor.train"].seconds - new_nodes["actor.train"].seconds == \
        pytest.approx(old_nodes["actor.train"].detail["dispatch_seconds"]
                      - new_nodes["actor.train"].detail["dispatch_seconds"])


def test_verl_batches_are_not_counted_so_verl_pays_no_dispatch() -> None:
    job = nemo_70b("verl")
    nodes = estimate_plan(job, colocate_plan(job)).nodes
    assert nodes["actor.train"].detail["dispatch_seconds"] == 0
    assert nodes["ref.infer"].detail["dispatch_seconds"] == 0


def test_the_70b_blog_case_pickles_3_5_gb_for_its_training_call() -> None:
    """By hand: 2,048 sequences padded to 127 + 3,236 tokens (the longest of a stratified
    batch of 2,048 responses of mean 398 under a 3,969 cap), 32 bytes a slot, one copy for
    each of the 16 workers of a TP 4 x PP 4 shard: 3.53 GB at 0.382 GB/s = 9.23 s, plus
    each worker unpickling its quarter (0.01 s)."""
    job = nemo_70b("nemo-rl-0.5")
    train = estimate_plan(job, colocate_plan(job)).nodes["actor.train"]
    assert train.detail["dispatch_seconds"] == pytest.approx(9.24, abs=0.01)


def test_nemo_rl_0_7_puts_each_shard_once_but_unpickles_every_workers_log_probs() -> None:
    job = nemo_70b("nemo-rl")
    node = estimate_plan(job, colocate_plan(job)).nodes["actor.old_log_prob"]
    slots = 2048 * (127 + 3236)
    serialize, deserialize = 3.82e8, 4.09e9
    driver = slots * 16 / serialize + 16 * slots * 4 / deserialize
    workers = slots * 16 / 4 / deserialize + slots * 4 / 4 / serialize
    assert node.detail["dispatch_seconds"] == pytest.approx(driver + workers)
