"""The exported files judged by the frameworks' own code (``make test`` installs verl 0.9.1
and OpenRLHF 0.11.2 without their dependencies, see the Makefile):

- verl: the overrides are composed with verl's own Hydra config tree (the config the run
  script names) and pass verl's own ``validate_config``; an unknown key or a batch verl
  cannot divide is caught.
- OpenRLHF: ``openrlhf/cli/train_ppo_ray.py`` builds its parser inside ``if __name__ ==
  "__main__":``, so the test takes that block's statements from the installed file (ast),
  runs the ones that build the parser and, after parsing, OpenRLHF's own argument checks
  (``hierarchize`` loaded from its file, everything before ``train(args)``), never
  ``train``: the definitions and checks are OpenRLHF's, not a copy.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
from datetime import datetime
from pathlib import Path

import pytest

from planner.export.openrlhf import openrlhf_files
from planner.export.verl import parse_verl_files, verl_files
from tests.dataset_fixtures import make_tokenizer
from tests.test_export import job_of, strategy

VERL_CASES = [("ppo", "colocate"), ("ppo-verl-pools", "searched"),
              ("ppo-one-step-off", "searched"), ("grpo-async", "searched"),
              ("grpo-moe", "searched")]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face model directory (config + word-level tokenizer), what verl's
    model config reads; nothing is downloaded."""
    directory = make_tokenizer(tmp_path_factory.mktemp("tiny-model"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 4, "vocab_size": 38, "max_position_embeddings": 4096}))
    return directory


def verl_config(overrides_text: str, script_text: str, extra: list[str]):
    pytest.importorskip("hydra", reason="hydra-core is not installed (make test installs it)")
    pytest.importorskip("verl", reason="verl 0.9.1 is not installed (make test installs it)")
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    module, config, _values = parse_verl_files(overrides_text, script_text)
    root = Path(verl.__file__).parent
    config_dir = root / (module.replace("verl.", "", 1).rsplit(".", 1)[0].replace(".", "/")) \
        / "config" if module.startswith("verl.experimental") else root / "trainer" / "config"
    overrides = [line for line in overrides_text.splitlines() if line] + extra
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=config, overrides=overrides)


def verl_validate(cfg) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg),
                    use_critic=need_critic(cfg))


def model_overrides(files: dict[str, str], model: Path) -> list[str]:
    """What a user appends after run_verl.sh: their checkpoints in place of the
    placeholders (the paths the job named stay)."""
    return [f"{key}={model}" for key in
            ("actor_rollout_ref.model.path", "critic.model.path",
             "reward.reward_model.model_path")
            if f"{key}=models/" in files["verl_overrides.txt"]]


@pytest.mark.parametrize(("name", "which"), VERL_CASES)
def test_verl_composes_and_validates_the_export(name: str, which: str, tiny_model: Path) -> None:
    plan = strategy(name, which)
    files = verl_files(plan, job_of(plan))
    cfg = verl_config(files["verl_overrides.txt"], files["run_verl.sh"],
                      model_overrides(files, tiny_model))
    verl_validate(cfg)
    # What verl reads is what the plan says.
    gen = plan.roles["actor"].generation
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == gen.tp
    assert cfg.data.train_batch_size == job_of(plan).workload.prompts_per_iteration
    actor_set = plan.set_of("actor")
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == actor_set.gpus
    if plan.rollout is not None:
        assert cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node == plan.rollout.gpus


def test_verl_takes_megatrons_first_and_last_stage_sizes(tiny_model: Path) -> None:
    plan = strategy("grpo-uneven-pp", "searched")
    files = verl_files(plan, job_of(plan))
    cfg = verl_config(files["verl_overrides.txt"], files["run_verl.sh"],
                      model_overrides(files, tiny_model))
    verl_validate(cfg)
    # 6 layers on 4 stages: middle stages of 2, the first and last of 1; the reference
    # worker resolves the actor's override.
    for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref):
        assert role.megatron.pipeline_model_parallel_size == 4
        override = role.megatron.override_transformer_config
        assert (override.num_layers_in_first_pipeline_stage,
                override.num_layers_in_last_pipeline_stage) == (1, 1)


def test_verl_catches_an_unknown_key_and_an_indivisible_batch(tiny_model: Path) -> None:
    from hydra.errors import ConfigCompositionException

    plan = strategy("ppo", "colocate")
    files = verl_files(plan, job_of(plan))
    models = model_overrides(files, tiny_model)
    with pytest.raises(ConfigCompositionException):
        verl_config(files["verl_overrides.txt"], files["run_verl.sh"],
                    [*models, "actor_rollout_ref.actor.no_such_key=1"])
    # 60 prompts on the plan's 16 GPUs: verl's own check refuses the batch.
    cfg = verl_config(files["verl_overrides.txt"], files["run_verl.sh"],
                      [*models, "data.train_batch_size=60",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=15"])
    with pytest.raises((AssertionError, ValueError)):
        verl_validate(cfg)


# ----- OpenRLHF -----


def openrlhf_main_block() -> tuple[list[ast.stmt], list[ast.stmt], Path]:
    """The statements of ``if __name__ == "__main__":`` in the installed train_ppo_ray.py:
    those that build the parser, and those that check the parsed arguments (up to
    ``train(args)``)."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("OpenRLHF 0.11.2 is not installed (make test installs it)")
    package = Path(next(iter(spec.submodule_search_locations)))
    tree = ast.parse((package / "cli" / "train_ppo_ray.py").read_text())
    main = next(node for node in tree.body if isinstance(node, ast.If)
                and "__main__" in ast.unparse(node.test))
    parse_at = next(i for i, node in enumerate(main.body)
                    if "parser.parse_args()" in ast.unparse(node))
    checks = []
    for node in main.body[parse_at + 1:]:
        text = ast.unparse(node)
        if text.startswith("train(args)"):
            break
        if isinstance(node, ast.ImportFrom) and node.module == "openrlhf.utils.config":
            continue  # hierarchize comes from its file (the package __init__ needs DeepSpeed)
        checks.append(node)
    return main.body[:parse_at], checks, package


def openrlhf_parse(arguments: list[str]):
    build, checks, package = openrlhf_main_block()
    config = importlib.util.spec_from_file_location("openrlhf_config",
                                                    package / "utils" / "config.py")
    assert config is not None and config.loader is not None
    config_module = importlib.util.module_from_spec(config)
    config.loader.exec_module(config_module)
    namespace = {"argparse": argparse, "datetime": datetime, "os": __import__("os")}
    exec(compile(ast.Module(body=build, type_ignores=[]), "train_ppo_ray.py", "exec"), namespace)
    parser = namespace["parser"]
    namespace["hierarchize"] = config_module.hierarchize
    namespace["args"] = parser.parse_args(arguments)
    exec(compile(ast.Module(body=checks, type_ignores=[]), "train_ppo_ray.py", "exec"),
         namespace)
    return namespace["args"]


@pytest.mark.parametrize(("name", "which"), [("ppo-fsdp", "colocate"),
                                             ("grpo-async-fsdp", "searched")])
def test_openrlhf_parses_and_checks_the_export(name: str, which: str) -> None:
    plan = strategy(name, which)
    files = openrlhf_files(plan, job_of(plan))
    args = openrlhf_parse([a for a in files["openrlhf_args.txt"].splitlines() if a])
    gen = plan.roles["actor"].generation
    assert args.vllm.tensor_parallel_size == gen.tp
    assert args.actor.num_nodes * args.actor.num_gpus_per_node == plan.set_of("actor").gpus
    assert args.train.async_enable == (plan.rollout is not None)


def test_openrlhf_rejects_an_unknown_argument() -> None:
    plan = strategy("ppo-fsdp", "colocate")
    arguments = [a for a in openrlhf_files(plan, job_of(plan))["openrlhf_args.txt"].splitlines()
                 if a]
    with pytest.raises(SystemExit):
        openrlhf_parse([*arguments, "--train.no_such_flag=1"])
