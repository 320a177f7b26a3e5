"""``hybridflow import``: launches written the way verl's and OpenRLHF's example scripts are
(shell variables, arithmetic, continuation lines, legacy keys), read as a job and a plan; every
setting the planner does not price refused in one line naming it; ``plan --baseline``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.export.importing import ImportContext, preset_for
from planner.export.launch import expand, integer_arithmetic, read_launch
from planner.export.openrlhf_import import import_openrlhf
from planner.export.verl_import import import_verl
from profiles.datafile import SpecError

ROOT = Path(__file__).resolve().parents[1]
VERL_MODULES = ("verl.trainer.main_ppo",)

GRPO_SCRIPT = """\
set -x
export VLLM_USE_V1=1
gen_tp=2
max_prompt_length=$((256 * 2))
max_response_length=$((1024 * 2))
n_resp=8
use_kl_loss=False

python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.train_batch_size=256 \\
    data.max_prompt_length=${max_prompt_length} \\
    data.max_response_length=${max_response_length} \\
    actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.model.enable_gradient_checkpointing=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.actor.use_kl_loss=$use_kl_loss \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=$gen_tp \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \\
    actor_rollout_ref.rollout.n=$n_resp \\
    algorithm.use_kl_in_reward=False \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=${NNODES:-2} $@
"""

PPO_MEGATRON_SCRIPT = """\
python3 -m verl.trainer.main_ppo --config-path=./config --config-name='ppo_megatron_trainer' \\
    algorithm.adv_estimator=gae \\
    data.train_batch_size=512 \\
    data.max_prompt_length=1024 \\
    data.max_response_length=512 \\
    actor_rollout_ref.model.path=meta-llama/Llama-3.1-8B-Instruct \\
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \\
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=8 \\
    actor_rollout_ref.rollout.name=vllm \\
    critic.model.path=meta-llama/Llama-3.1-8B-Instruct \\
    critic.ppo_micro_batch_size_per_gpu=2 \\
    critic.megatron.tensor_model_parallel_size=4 \\
    reward_model.enable=True \\
    reward_model.model.path=/nonexistent/FsfairX-LLaMA3-RM \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=2
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_shell_expansion_and_arithmetic() -> None:
    assert expand("${A:-x}/$B/${C}", {"B": "b", "C": "c"}) == "x/b/c"
    assert expand("$((max * 2))", {"max": "1024"}) == "2048"
    assert expand("$(( (a + b) * 3 ))", {"a": "2048", "b": "4096"}) == "18432"
    assert integer_arithmetic("7 / 2") == 3
    assert integer_arithmetic("os.system(1)") is None
    assert expand("$UNSET/x", {}) == "$UNSET/x"


def test_hub_names_match_presets_of_the_same_architecture() -> None:
    assert preset_for("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert preset_for("Qwen/Qwen2-7B-Instruct") == "qwen2.5-7b"
    assert preset_for("Qwen/Qwen2.5-Math-7B") == "qwen2.5-7b"
    assert preset_for("meta-llama/Llama-3.1-8B-Instruct") == "llama3.1-8b"
    assert preset_for("deepseek-ai/deepseek-llm-7b-chat") == "deepseek-llm-7b"
    assert preset_for('"${RAY_DATA_HOME}/models/Qwen2.5-Math-7B"') == "qwen2.5-7b"
    assert preset_for("sfairXC/FsfairX-LLaMA3-RM-v0.1") is None


def test_a_verl_grpo_script_without_kl(tmp_path: Path) -> None:
    script = write(tmp_path / "run.sh", GRPO_SCRIPT)
    launch = read_launch(script, VERL_MODULES)
    job, plan = import_verl(launch, ImportContext(device="h100-80gb"))
    assert job.algorithm == "grpo" and job.kl_term == "none" and "ref" not in job.gpu_roles
    assert job.cluster.total_gpus == 16  # ${NNODES:-2}
    work = job.workload
    assert (work.prompts_per_iteration, work.samples_per_prompt) == (256, 8)
    assert (work.prompt_length, work.response_length.max_tokens) == (512, 2048)
    assert work.mini_batches_per_epoch == 4 and work.infer_micro_batch_size == 8
    actor = plan.roles["actor"]
    assert actor.parallel.short() == "pp1-tp1-dp16-fsdp" and actor.parallel.recompute == "full"
    assert actor.parallel.micro_batch_size == 2
    assert (actor.generation.tp, actor.generation.memory_utilization) == (2, 0.6)
    # NNODES from outside the script.
    launch = read_launch(script, VERL_MODULES, env={"NNODES": "4"})
    job, _ = import_verl(launch, ImportContext(device="h100-80gb"))
    assert job.cluster.total_gpus == 32


def test_a_verl_megatron_ppo_script_with_a_reward_model(tmp_path: Path) -> None:
    script = write(tmp_path / "run.sh", PPO_MEGATRON_SCRIPT)
    launch = read_launch(script, VERL_MODULES)
    with pytest.raises(SpecError, match="give --model reward=") as info:
        import_verl(launch, ImportContext(device="h100-80gb"))
    assert info.value.key == "reward.reward_model.model_path"
    job, plan = import_verl(launch, ImportContext(device="h100-80gb",
                                                  models={"reward": "llama3.1-8b"}))
    assert job.algorithm == "ppo" and job.kl_term == "none"
    assert plan.placement == "actor,critic,reward"
    assert plan.roles["actor"].parallel.short() == "pp2-tp4-dp2-zero1"
    # The critic keeps verl's pp default (1) and its own tp.
    assert plan.roles["critic"].parallel.short() == "pp1-tp4-dp4-zero1"
    assert plan.roles["actor"].generation.tp == 8  # vLLM's own copy: any tp
    assert plan.roles["reward"].parallel.tp == 2  # verl's reward server default


@pytest.mark.parametrize(("line", "key"), [
    ("actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.rollout.enforce_eager"),
    ("actor_rollout_ref.rollout.name=trtllm", "actor_rollout_ref.rollout.name"),
    ("actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_rank"),
    ("actor_rollout_ref.actor.fsdp_config.fsdp_size=3",
     "actor_rollout_ref.actor.fsdp_config.fsdp_size"),
    ("algorithm.adv_estimator=rloo", "algorithm.adv_estimator"),
])
def test_an_unpriced_verl_setting_is_refused_by_name(tmp_path: Path, line: str,
                                                     key: str) -> None:
    text = GRPO_SCRIPT.replace("    trainer.n_gpus_per_node=8", f"    {line} \\\n"
                               "    trainer.n_gpus_per_node=8")
    launch = read_launch(write(tmp_path / "run.sh", text), VERL_MODULES)
    with pytest.raises(SpecError) as info:
        import_verl(launch, ImportContext(device="h100-80gb"))
    assert info.value.key == key and "\n" not in str(info.value)


def test_a_verl_script_that_rolls_out_with_sglang(tmp_path: Path) -> None:
    text = GRPO_SCRIPT.replace("    trainer.n_gpus_per_node=8", "    actor_rollout_ref.rollout."
                               "name=sglang \\\n    trainer.n_gpus_per_node=8")
    launch = read_launch(write(tmp_path / "run.sh", text), VERL_MODULES)
    job, plan = import_verl(launch, ImportContext(device="h100-80gb"))
    assert job.rollout_engine == "sglang" and job.rollout.weight_backup_on_host_link
    assert plan.roles["actor"].generation.pp == 1
    vllm_job, _ = import_verl(read_launch(write(tmp_path / "v.sh", GRPO_SCRIPT),
                                                  VERL_MODULES),
                                      ImportContext(device="h100-80gb"))
    assert vllm_job.rollout_engine is None


def test_an_openrlhf_launch_with_legacy_flags(tmp_path: Path) -> None:
    args = write(tmp_path / "args.txt", """\
--ref_num_nodes 1
--ref_num_gpus_per_node 8
--actor_num_nodes 1
--actor_num_gpus_per_node 8
--vllm_num_engines 4
--vllm_tensor_parallel_size 2
--colocate_all_models
--pretrain OpenRLHF/Llama-3-8b-sft-mixture
--remote_rm_url /path/to/reward_func.py
--advantage_estimator group_norm
--n_samples_per_prompt 8
--rollout_batch_size 128
--train_batch_size 256
--micro_train_batch_size 1
--micro_rollout_batch_size 4
--prompt_max_len 1024
--generate_max_len 1024
--zero_stage 3
--gradient_checkpointing
--packing_samples
--init_kl_coef 1e-3
--use_kl_loss
""")
    launch = read_launch(args, ("openrlhf.cli.train_ppo_ray",))
    job, plan = import_openrlhf(launch, ImportContext(device="a100-80gb",
                                                      models={"actor": "llama3-8b"}))
    assert job.algorithm == "grpo" and job.kl_term == "loss"
    assert plan.placement == "actor,ref"
    assert plan.roles["actor"].parallel.short() == "pp1-tp1-dp8-fsdp"
    assert plan.roles["actor"].parallel.recompute == "full"
    assert plan.roles["ref"].parallel.sharding == "fsdp"
    assert job.workload.mini_batches_per_epoch == 4  # 128 x 8 / 256


def test_an_openrlhf_launch_with_token_budgets(tmp_path: Path) -> None:
    lines = """\
--train.colocate_all
--actor.num_gpus_per_node 8
--ref.num_gpus_per_node 8
--vllm.num_engines 4
--vllm.tensor_parallel_size 2
--ds.tensor_parallel_size 2
--actor.model_name_or_path Qwen/Qwen2.5-7B-Instruct
--reward.remote_url /path/to/reward_func.py
--algo.advantage.estimator group_norm
--rollout.n_samples_per_prompt 8
--rollout.batch_size 128
--train.batch_size 256
--rollout.max_new_tokens 4096
--data.max_len 5120
--zero_stage 3
--train.dynamic_batch_enable
--train.max_tokens_per_gpu 8192
"""
    launch = read_launch(write(tmp_path / "args.txt", lines), ("openrlhf.cli.train_ppo_ray",))
    _, plan = import_openrlhf(launch, ImportContext(device="h100-80gb"))
    # The experience's budget defaults to the training's (packing turned on with them).
    for role in ("actor", "ref"):
        assert plan.roles[role].parallel.infer_micro_batch_tokens == 8192
    assert plan.roles["actor"].parallel.micro_batch_tokens == 8192
    assert plan.roles["ref"].parallel.micro_batch_tokens == 0
    more = lines + "--rollout.max_tokens_per_gpu 16384\n"
    _, plan = import_openrlhf(read_launch(write(tmp_path / "more.txt", more),
                                          ("openrlhf.cli.train_ppo_ray",)),
                              ImportContext(device="h100-80gb"))
    assert plan.roles["ref"].parallel.infer_micro_batch_tokens == 16384
    # Ring attention: one size for every model, at OpenRLHF's one KV head per all-gather.
    ring = lines + "--ds.ring_attn_size 2\n"
    _, plan = import_openrlhf(read_launch(write(tmp_path / "ring.txt", ring),
                                          ("openrlhf.cli.train_ppo_ray",)),
                              ImportContext(device="h100-80gb"))
    assert {rp.parallel.cp for rp in plan.roles.values()} == {2}
    for extra, key in (("--ds.ring_attn_size 3\n", "--ds.ring_attn_size"),
                       ("--ds.ring_attn_size 2\n--ds.ring_attn_head_stride 2\n",
                        "--ds.ring_attn_head_stride")):
        with pytest.raises(SpecError) as info:
            import_openrlhf(read_launch(write(tmp_path / "odd.txt", lines + extra),
                                        ("openrlhf.cli.train_ppo_ray",)),
                            ImportContext(device="h100-80gb"))
        assert info.value.key == key
    bad = lines + "--train.max_tokens_per_gpu 0\n"
    with pytest.raises(SpecError) as info:
        import_openrlhf(read_launch(write(tmp_path / "bad.txt", bad),
                                    ("openrlhf.cli.train_ppo_ray",)),
                        ImportContext(device="h100-80gb"))
    assert info.value.key == "--train.max_tokens_per_gpu"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True,
                          text=True, cwd=ROOT, check=False)


def test_import_then_plan_against_it(tmp_path: Path) -> None:
    script = write(tmp_path / "run.sh", GRPO_SCRIPT)
    done = run("import", str(script), "--from", "verl", "--device", "h100-80gb", "--out",
               str(tmp_path / "imp"), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["feasible"] and summary["iteration_seconds"] > 0
    assert "actor.generate" in summary["stages"] and "ref.infer" not in summary["stages"]
    planned = run("plan", "--baseline", str(tmp_path / "imp" / "plan.json"), "--out",
                  str(tmp_path / "rep"), "--json")
    assert planned.returncode == 0, planned.stderr
    result = json.loads(planned.stdout)
    baseline = result["baseline"]
    assert baseline["baseline_iteration_seconds"] == pytest.approx(
        summary["iteration_seconds"])
    assert baseline["saved_seconds"] == pytest.approx(
        baseline["baseline_iteration_seconds"] - result["best"]["iteration_seconds"])
    assert baseline["stage_changes"]
    # Bad input: one line, exit 2.
    bad = run("import", str(script), "--from", "verl")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--device" in bad.stderr


def test_context_parallelism(tmp_path: Path) -> None:
    # The actor's context_parallel_size; the critic keeps its own default.
    text = PPO_MEGATRON_SCRIPT.replace(
        "    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \\",
        "    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \\\n"
        "    actor_rollout_ref.actor.megatron.context_parallel_size=2 \\")
    launch = read_launch(write(tmp_path / "run.sh", text), VERL_MODULES)
    _, plan = import_verl(launch, ImportContext(device="h100-80gb",
                                                models={"reward": "llama3.1-8b"}))
    actor, critic = (plan.roles[r].parallel for r in ("actor", "critic"))
    assert (actor.tp, actor.pp, actor.cp, actor.dp, actor.data_shards) == (4, 2, 2, 2, 1)
    assert critic.cp == 1


def test_hybrid_sharding_groups(tmp_path: Path) -> None:
    # fsdp_size 8 on two nodes: two groups of a node each (verl's (ddp, fsdp) mesh); the
    # reference keeps its own size.
    text = GRPO_SCRIPT.replace("use_kl_loss=False", "use_kl_loss=True").replace(
        "    trainer.n_gpus_per_node=8", """\
    actor_rollout_ref.actor.fsdp_config.fsdp_size=8 \\
    actor_rollout_ref.ref.fsdp_config.fsdp_size=-1 \\
    trainer.n_gpus_per_node=8""")
    launch = read_launch(write(tmp_path / "run.sh", text), VERL_MODULES)
    _, plan = import_verl(launch, ImportContext(device="h100-80gb"))
    actor, ref = plan.roles["actor"].parallel, plan.roles["ref"].parallel
    assert (actor.sharding, actor.dp, actor.fsdp_size, actor.fsdp_replicas) == ("fsdp", 16, 8, 2)
    assert (ref.sharding, ref.fsdp_size) == ("fsdp", 0)


LONG_ASYNC_SCRIPT = """\
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 28))
sp_size=4
python -m verl.experimental.fully_async_policy.fully_async_main \\
    data.max_prompt_length=${max_prompt_length} \\
    data.max_response_length=${max_response_length} \\
    data.train_batch_size=0 \\
    data.gen_batch_size=1 \\
    actor_rollout_ref.rollout.n=16 \\
    algorithm.adv_estimator=grpo \\
    algorithm.use_kl_in_reward=False \\
    actor_rollout_ref.actor.use_kl_loss=False \\
    actor_rollout_ref.actor.strategy=fsdp2 \\
    actor_rollout_ref.model.path=Qwen/Qwen2.5-Math-7B \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.hybrid_engine=False \\
    actor_rollout_ref.actor.use_dynamic_bsz=True \\
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(((max_prompt_length + \\
max_response_length) * 2)) \\
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$(((max_prompt_length + \\
max_response_length) * 3)) \\
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \\
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=${sp_size} \\
    actor_rollout_ref.actor.fsdp_config.fsdp_size=8 \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.calculate_log_probs=True \\
    trainer.nnodes=2 \\
    trainer.n_gpus_per_node=8 \\
    rollout.nnodes=2 \\
    rollout.n_gpus_per_node=8 \\
    rollout.total_rollout_steps=204800 \\
    async_training.staleness_threshold=0.1 \\
    async_training.trigger_parameter_sync_step=4 \\
    async_training.require_batches=4 \\
    async_training.partial_rollout=True \\
    async_training.use_rollout_log_probs=True
"""


def test_a_long_response_fully_async_run_with_hybrid_sharding_fits(tmp_path: Path) -> None:
    # The shape of verl's DAPO fully-async recipes on H20: 30k-token sequences, token budgets
    # of two sequences per GPU over Ulysses sp 4, FSDP groups of a node. The FSDP engine's loss
    # holds bf16 logits with their gradient in place, so the 61k-token micro-batch fits
    # (with fp32 logits and gradient it would need 96 GiB of the H20's 96).
    script = write(tmp_path / "run.sh", LONG_ASYNC_SCRIPT)
    done = run("import", str(script), "--from", "verl", "--device", "h20", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["feasible"], summary
    assert summary["mode"] == "async"
    assert "hsdp8-sp4" in summary["plan"]


def test_token_budgets_and_host_memory_between_calls(tmp_path: Path) -> None:
    text = GRPO_SCRIPT.replace("use_kl_loss=False", "use_kl_loss=True").replace(
        "    trainer.n_gpus_per_node=8", """\
    actor_rollout_ref.actor.use_dynamic_bsz=True \\
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(( (max_prompt_length + \\
max_response_length) * 2 )) \\
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=12000 \\
    actor_rollout_ref.ref.fsdp_config.param_offload=True \\
    trainer.n_gpus_per_node=8""")
    launch = read_launch(write(tmp_path / "run.sh", text), VERL_MODULES)
    _, plan = import_verl(launch, ImportContext(device="h100-80gb"))
    actor, ref = plan.roles["actor"].parallel, plan.roles["ref"].parallel
    assert (actor.micro_batch_tokens, actor.infer_micro_batch_tokens) == (5120, 12000)
    # The reference's log-prob settings follow the actor's (verl's interpolation).
    assert ref.infer_micro_batch_tokens == 5120 and ref.offload_params
    assert not actor.offload_params
    text = text.replace("log_prob_max_token_len_per_gpu=12000",
                        "log_prob_max_token_len_per_gpu=1000")
    launch = read_launch(write(tmp_path / "run.sh", text), VERL_MODULES)
    with pytest.raises(SpecError, match="at least the longest sequence"):
        import_verl(launch, ImportContext(device="h100-80gb"))


def test_a_nemo_rl_recipe_with_its_defaults_chain(tmp_path: Path) -> None:
    from planner.export.launch import Launch
    from planner.export.nemo_rl_import import import_nemo_rl

    (tmp_path / "base.yaml").write_text("""\
grpo: {num_prompts_per_step: 64, num_generations_per_prompt: 32}
policy:
  model_name: Qwen/Qwen2.5-7B-Instruct
  train_global_batch_size: 512
  train_micro_batch_size: 1
  logprob_batch_size: 2
  max_total_sequence_length: 4096
  megatron_cfg: {enabled: true, tensor_model_parallel_size: 2,
                 pipeline_model_parallel_size: 1, activation_checkpointing: true,
                 recompute_granularity: selective}
  dtensor_cfg: {enabled: false}
  generation:
    max_new_tokens: 3072
    vllm_cfg: {tensor_parallel_size: 4, gpu_memory_utilization: 0.6}
data: {max_input_seq_length: 1024}
cluster: {gpus_per_node: 8, num_nodes: 4}
""")
    (tmp_path / "recipes").mkdir()
    recipe = write(tmp_path / "recipes" / "grpo-7b.yaml", """\
defaults: ../base.yaml
loss_fn: {reference_policy_kl_penalty: 0}
grpo: {num_prompts_per_step: 128}
""")
    context = ImportContext(device="h100-80gb")
    job, plan = import_nemo_rl(Launch(source=str(recipe), module=""), context)
    assert job.framework == "nemo-rl" and job.kl_term == "none"
    assert (job.workload.prompts_per_iteration, job.workload.samples_per_prompt) == (128, 32)
    assert job.workload.mini_batches_per_epoch == 8  # 128 x 32 / 512
    assert (job.workload.prompt_length, job.workload.response_length.max_tokens) == (1024, 3072)
    actor = plan.roles["actor"]
    assert actor.parallel.short() == "pp1-tp2-dp16-zero1"
    assert actor.parallel.recompute == "selective" and actor.generation.tp == 4
    assert job.cluster.total_gpus == 32 and "ref" not in plan.roles
    # Megatron's context parallelism is read (a dp divisor); the DTensor policy's is refused.
    (tmp_path / "recipes" / "cp.yaml").write_text(
        "defaults: grpo-7b.yaml\npolicy: {megatron_cfg: {context_parallel_size: 4}}\n")
    _, plan = import_nemo_rl(Launch(source=str(tmp_path / "recipes" / "cp.yaml"), module=""),
                             ImportContext(device="h100-80gb"))
    assert plan.roles["actor"].parallel.short() == "pp1-tp2-dp16-zero1-cp4"
    (tmp_path / "recipes" / "dtensor-cp.yaml").write_text(
        "defaults: grpo-7b.yaml\npolicy: {megatron_cfg: {enabled: false}, dtensor_cfg: "
        "{enabled: true, tensor_parallel_size: 1, context_parallel_size: 2}}\n")
    with pytest.raises(SpecError) as info:
        import_nemo_rl(Launch(source=str(tmp_path / "recipes" / "dtensor-cp.yaml"), module=""),
                       ImportContext(device="h100-80gb"))
    assert info.value.key == "policy.dtensor_cfg.context_parallel_size"


def test_a_nemo_rl_run_script_whose_base_recipe_is_not_here(tmp_path: Path) -> None:
    script = write(tmp_path / "run.sh", """\
uv run examples/run_grpo.py --config examples/configs/grpo_math_1B.yaml \\
    cluster.gpus_per_node=8 policy.model_name=Qwen/Qwen2.5-1.5B \\
    data.max_input_seq_length=256 policy.generation.max_new_tokens=256
""")
    launch = read_launch(script, ("run_grpo.py",))
    from planner.export.nemo_rl_import import import_nemo_rl

    context = ImportContext(device="h100-80gb")
    job, plan = import_nemo_rl(launch, context)
    assert any("base GRPO recipe" in note for note in context.notes)
    assert job.workload.prompts_per_iteration == 32  # NeMo-RL's base recipe
    assert plan.roles["actor"].parallel.short() == "pp1-tp1-dp8-fsdp"
    assert plan.roles["ref"].parallel.tp == plan.roles["actor"].parallel.tp
