"""``hybridflow execute``: check a plan, start (or join) Ray, build the worker groups, run the
algorithm's controller program for N iterations, write the records."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from executor.algorithms import RLConfig
from executor.hybrid_engine import TransitionMode
from executor.task import SortDigits
from profiles.datafile import SpecError, to_mapping
from simulator.plan import Plan
from simulator.predict import VALUE_HEAD_ROLES
from simulator.specs.job import JobSpec

SUPPORTED_ALGORITHMS = ("ppo", "grpo", "remax", "safe-rlhf")


@dataclass(kw_only=True, frozen=True)
class ExecutionOptions:
    """How to run a plan."""

    steps: int = 2
    """RL iterations."""
    seed: int = 0
    out: Path | None = None
    """Run directory for measurements.csv, metrics.csv, meta.json, trace.json."""
    address: str | None = None
    """Ray cluster to join; None starts a local one (virtual GPUs where there are none)."""
    transition: TransitionMode = "micro_dp"
    """Actor train -> generate: 3D-HybridEngine micro-DP all-gather, or naive full gather."""
    actor_lr: float = 1e-2
    critic_lr: float = 1e-2
    rl: RLConfig = field(default_factory=RLConfig)
    task: SortDigits = field(default_factory=SortDigits)
    temperature: float = 1.0
    top_p: float = 1.0
    reward_warmup_steps: int = 20
    """Steps fitting the reward (and cost) model to the task's rules before RL (model
    rewards / costs only)."""
    log: Callable[[str], None] | None = None
    worker_setup: str | None = None
    """``module:function`` every worker imports and calls before building models
    (site-specific preparation)."""
    validate_every: int = 0
    """Every this many iterations (and after the last), greedy responses to held-out prompts
    are scored: the validation reward in metrics.csv (0: never)."""
    save_hf: Path | None = None
    """Where to write the trained actor as a Hugging Face checkpoint at the end (config.json
    + model.safetensors); None: nothing is written."""
    save_hf_every: int = 0
    """Also write it every this many iterations (replacing the previous one whole; 0: only
    at the end)."""
    save_hf_critic: Path | None = None
    """Where to write the trained critic, as a Hugging Face ``LlamaForTokenClassification``
    with one label (the same times as the actor); None: nothing is written."""
    log_tensorboard: bool = False
    """Also write every iteration's metrics as TensorBoard scalars (the run directory's
    ``tensorboard/``)."""
    checkpoints: dict[str, str] = field(default_factory=dict)
    """role -> local Hugging Face checkpoint directory its model starts from (the reference
    takes the actor's when it has none of its own and the same model)."""
    worker_logs: bool | None = None
    """Show the workers' output (CUDA and NCCL messages, out-of-memory reports) on the
    driver's stderr; None: on with ``address``, off for a local Ray."""


class RunFailedError(RuntimeError):
    """A worker failed during the run; the message names the operation, the rank and the
    cause, and where the records of the finished iterations are."""


@dataclass(frozen=True)
class RunResult:
    rows: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    out: Path | None
    seconds: float


def validate_for_execution(job: JobSpec, plan: Plan, options: ExecutionOptions) -> Any:
    """Everything that can be checked before a worker starts; raises SpecError. Returns the
    task the controller's program takes its prompts from (the built-in one, or the job's
    data read and tokenized)."""
    from executor.backends import check_available, check_megatron_layout
    from executor.trainer import check_layout, compute_dtype

    if job.algorithm not in SUPPORTED_ALGORITHMS:
        raise SpecError(f"the executor runs {', '.join(SUPPORTED_ALGORITHMS)}; "
                        f"{job.algorithm} is planned but not executable yet", key="algorithm")
    plan.validate(job)
    compute_dtype(job.workload.dtype)
    chosen_backends = effective_backends(job, plan)
    checkpoints = effective_checkpoints(job, options)
    check_checkpoints(job, checkpoints)
    task = prepare_task(job, options, checkpoints, chosen_backends)
    max_new_tokens = response_cap(job, task)
    for role in job.gpu_roles:
        rp = plan.roles[role]
        spec = job.model(role)
        training, generation = chosen_backends[role]
        check_available(role, training, generation, spec=spec, parallel=rp.parallel,
                        generation_config=rp.generation)
        if training == "megatron":
            check_megatron_layout(spec, rp.parallel, key=f"roles.{role}.parallel",
                                  generation=rp.generation)
            if role == "actor" and job.algorithm == "safe-rlhf" and options.rl.ptx_coef > 0:
                raise SpecError("Safe-RLHF's pretraining (ptx) loss runs on a second input, "
                                "which the Megatron backend's pipeline schedule does not "
                                "compute; train the actor with the torch backend or set "
                                "ptx_coef 0", key="backends.actor.training")
        else:
            check_layout(spec, rp.parallel, key=f"roles.{role}.parallel",
                         generation=rp.generation)
        if rp.generation is not None and rp.parallel.tp % rp.generation.tp:
            raise SpecError(f"generation tp={rp.generation.tp} must divide training "
                            f"tp={rp.parallel.tp} (3D-HybridEngine)",
                            key=f"roles.{role}.generation.tp")
        longest = task.prompt_length + max_new_tokens
        if spec.learned_positions and spec.learned_positions < longest:
            raise SpecError(f"{spec.name} has {spec.learned_positions} learned positions; the "
                            f"task's sequences reach {longest} tokens", key=f"models.{role}")
        if spec.vocab < task.vocab_needed:
            what = "the tokenizer has" if job.data is not None else "the task needs"
            raise SpecError(f"{spec.name} has {spec.vocab} tokens; {what} "
                            f"{task.vocab_needed}", key=f"models.{role}")
    work = job.workload
    sequences = work.prompts_per_iteration * (work.samples_per_prompt
                                              if job.algorithm == "grpo" else 1)
    # Reward and cost models train too (fitted to the task's rules before RL), on batches of
    # prompts_per_iteration sequences.
    fitted = [r for r in ("reward", "cost")
              if r in job.gpu_roles and options.reward_warmup_steps > 0]
    for role, rows, what in [(r, sequences, "iteration") for r in job.dataflow.trained_roles] + \
            [(r, work.prompts_per_iteration, "fitting step") for r in fitted]:
        dp = plan.roles[role].parallel.dp
        if rows % (dp * work.mini_batches_per_epoch):
            raise SpecError(f"{rows} sequences per {what} do not split into {dp} "
                            "data-parallel ranks x "
                            f"{work.mini_batches_per_epoch} mini-batches ({role}); choose a "
                            f"multiple of {dp * work.mini_batches_per_epoch}",
                            key="workload.prompts_per_iteration")
    if options.steps < 1:
        raise SpecError("must be at least 1", key="--steps")
    if job.reward_function is not None:
        from executor.reward_function import load_reward_function

        load_reward_function(job.reward_function.path, job.reward_function.name)
    if options.save_hf is not None or options.save_hf_critic is not None:
        from executor.model import llama_exportable

        for role, key, directory in (("actor", "--save-hf", options.save_hf),
                                     ("critic", "--save-hf-critic", options.save_hf_critic)):
            if directory is None:
                continue
            if role not in job.gpu_roles:
                raise SpecError(f"{job.algorithm} has no critic to write", key=key)
            problem = llama_exportable(job.model(role))
            if problem:
                raise SpecError(problem, key=key)
            if Path(directory).exists() and not Path(directory).is_dir():
                raise SpecError(f"{directory} exists and is not a directory", key=key)
    if options.log_tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise SpecError("TensorBoard logging needs the tensorboard package: pip install "
                            "tensorboard", key="--log") from None
    budget = planned_kv_cache_budget_bytes(job, plan)
    if budget is not None and budget <= 0:
        raise SpecError(f"the plan leaves the actor's generation no memory for its KV cache "
                        f"({budget / 2**30:.1f} GiB per GPU on {job.cluster.profile().name}); plan "
                        "again or give the set more GPUs", key="roles.actor.generation")
    # Megatron roles of one set share Megatron's (per-process) parallel state.
    from dataclasses import replace

    replace(plan, roles={role: replace(rp, training_backend=chosen_backends[role][0])
                         for role, rp in plan.roles.items()}).check_backends()
    return task


def effective_checkpoints(job: JobSpec, options: ExecutionOptions) -> dict[str, str]:
    """role -> the checkpoint directory its model starts from: ``--checkpoint`` where given,
    else the job's model directory when it holds weights (``*.safetensors``)."""
    from_job = {role: path for role, path in job.model_paths.items()
                if role in job.gpu_roles and any(Path(path).glob("*.safetensors"))}
    return {**from_job, **options.checkpoints}


def hf_tokenizer_files(task: Any) -> dict[str, bytes]:
    """The tokenizer's files as ``save_pretrained`` writes them (what a Hugging Face
    checkpoint directory carries beside the weights)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        task.tokenizer.save_pretrained(scratch)
        return {p.name: p.read_bytes() for p in Path(scratch).iterdir() if p.is_file()}


def response_cap(job: JobSpec, task: Any) -> int:
    """Tokens a response may have: the workload's longest response; for the built-in task
    at most its answer plus EOS."""
    longest = job.workload.response_length.max_tokens
    if job.data is None:
        return min(task.response_length + 1, longest)
    return longest


def prepare_task(job: JobSpec, options: ExecutionOptions, checkpoints: dict[str, str],
                 backends: dict[str, tuple[str, str]]) -> Any:
    """The built-in task, or the job's data: the tokenizer found and checked against every
    model's, the files read and tokenized (errors name the file and row)."""
    if job.data is None:
        return options.task
    from executor.data import build_dataset_task, has_tokenizer, load_tokenizer, same_tokenizer

    if job.algorithm == "safe-rlhf":
        raise SpecError("Safe-RLHF's cost rule and pretraining data belong to the built-in "
                        "task; with data: run ppo, grpo or remax", key="data")
    if job.reward_function is None and job.models.get("reward") == "rule":
        raise SpecError("the data has no rule of its own: give reward_function (with "
                        "reward: rule) or a reward model", key="data")
    if "reward" in job.gpu_roles and "reward" not in checkpoints:
        raise SpecError("a reward model for your data must start from its trained weights: "
                        "give its checkpoint directory (models.reward: DIR or --checkpoint "
                        "reward=DIR)", key="models.reward")
    megatron = [r for r, (training, _) in backends.items() if training == "megatron"]
    if megatron:
        raise SpecError(f"prompts of different lengths are left-padded, which the Megatron "
                        f"backend does not take yet; train {', '.join(megatron)} with the "
                        "torch backend (backends: {role: {training: torch}})", key="data")
    directory = job.data.tokenizer
    if directory is None:
        actor = checkpoints.get("actor")
        if actor is None or not has_tokenizer(actor):
            raise SpecError("no tokenizer: give data.tokenizer, or an actor checkpoint "
                            "directory with its tokenizer files", key="data.tokenizer")
        directory = actor
    task = build_dataset_task(job.data, directory,
                              max_prompt_length=job.workload.prompt_length)
    # Every model reads the actor's token ids: a role whose checkpoint has another tokenizer
    # would read them as different words.
    for role, path in checkpoints.items():
        if has_tokenizer(path) and str(Path(path).resolve()) != str(
                Path(directory).resolve()):
            other = load_tokenizer(path, key=f"--checkpoint {role}")
            if not same_tokenizer(other, task.tokenizer):
                raise SpecError(f"{role}'s tokenizer ({path}) differs from the one the prompts "
                                f"are tokenized with ({directory}); every model reads the "
                                "same token ids", key=f"models.{role}")
    if options.validate_every and task.val is None:
        raise SpecError("validation needs held-out prompts: give data.val_files",
                        key="--validate-every")
    return task

def check_checkpoints(job: JobSpec, checkpoints: dict[str, str]) -> None:
    """Each checkpoint names a role on GPUs and a directory whose tensors have the names and
    shapes of that role's model (read from the files' headers, before any worker starts)."""
    from executor.model import InitialWeights

    for role, directory in checkpoints.items():
        key = f"--checkpoint {role}"
        if role not in job.gpu_roles:
            raise SpecError(f"{role} is not a model of this job on GPUs (roles: "
                            f"{', '.join(job.gpu_roles)})", key=key)
        if not Path(directory).is_dir():
            raise SpecError(f"{directory} is not a directory", key=key)
        try:
            InitialWeights(job.model(role), value_head=role in VALUE_HEAD_ROLES,
                           checkpoint=directory)
        except SpecError as exc:
            raise SpecError(exc.problem, key=key) from None


def effective_backends(job: JobSpec, plan: Plan) -> dict[str, tuple[str, str]]:
    """role -> (training backend, generation backend): the job's ``backends:`` where it says,
    else the plan's training backend and native generation."""
    out = {}
    for role in job.gpu_roles:
        chosen = job.backends.get(role)
        training = (chosen.training if chosen and chosen.training
                    else plan.roles[role].training_backend)
        out[role] = (training, chosen.generation if chosen else "native")
    return out


def planned_kv_cache_budget_bytes(job: JobSpec, plan: Plan) -> int | None:
    """The KV-cache bytes per GPU the simulator leaves the actor's generation under this plan
    (what the engine may use; None when the job generates nothing)."""
    from simulator.predict import estimate_plan, first_generate_node

    node = estimate_plan(job, plan).nodes.get(first_generate_node(job))
    budget = node.detail.get("kv_budget_bytes") if node is not None else None
    return None if budget is None else int(budget)


def role_configs(job: JobSpec, plan: Plan, options: ExecutionOptions,
                 task: Any = None) -> dict[str, Any]:
    from executor.generation import SamplingParams
    from executor.roles import RoleConfig
    from executor.trainer import OptimConfig

    task = options.task if task is None else task
    checkpoints = effective_checkpoints(job, options)

    dataflow = job.dataflow
    work = job.workload
    rl = options.rl.resolved(job.algorithm)
    backends = effective_backends(job, plan)
    kv_budget = planned_kv_cache_budget_bytes(job, plan)
    offload = job.framework_profile.offload
    configs = {}
    for index, role in enumerate(job.gpu_roles):
        rp = plan.roles[role]
        trainable = role in dataflow.trained_roles or role in ("reward", "cost")
        lr = options.actor_lr if role == "actor" else options.critic_lr
        sampling = None
        if rp.generation is not None:
            sampling = SamplingParams(max_new_tokens=response_cap(job, task),
                                      eos_token_id=task.eos_token_id,
                                      pad_token_id=task.pad_token_id,
                                      temperature=options.temperature, top_p=options.top_p)
        configs[role] = RoleConfig(
            role=role, spec=job.model(role), parallel=rp.parallel, trainable=trainable,
            value_head=role in VALUE_HEAD_ROLES, seed=options.seed * 1000 + index,
            algorithm=job.algorithm, generation=rp.generation, optim=OptimConfig(lr=lr),
            rl=rl, sampling=sampling, ppo_epochs=work.ppo_epochs,
            mini_batches=work.mini_batches_per_epoch,
            infer_micro_batch=work.infer_micro_batch_size, transition=options.transition,
            generation_backend=backends[role][1], training_backend=backends[role][0],
            dtype=work.dtype, checkpoint=checkpoints.get(role),
            kv_cache_budget_bytes=kv_budget if rp.generation is not None else None,
            offload_optimizer=trainable and offload.optimizer,
            offload_grads=trainable and offload.grads)
    # The reference starts as a copy of the actor: same seed, same model.
    if "ref" in configs and "actor" in configs and \
            job.model("ref") == job.model("actor"):
        from dataclasses import replace

        configs["ref"] = replace(configs["ref"], seed=configs["actor"].seed,
                                 checkpoint=checkpoints.get("ref", checkpoints.get("actor")))
    return configs


PACKAGES = ("executor", "simulator", "profiles", "planner", "reports")
"""The project's packages, shipped to a cluster's workers (``runtime_env`` ``py_modules``)."""
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "CUDA_LAUNCH_",
                          "HF_", "VLLM_")
"""Environment variables of the driver that workers on other nodes receive too."""


def cluster_runtime_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """What a Ray cluster's workers need, whatever their node has: the project's code (its
    packages, uploaded once per run and put first on the workers' path) and the
    communication settings of the driver's environment."""
    environ = dict(os.environ if environ is None else environ)
    root = Path(__file__).resolve().parents[1]
    env_vars = {"OMP_NUM_THREADS": "1"}
    env_vars.update({k: v for k, v in environ.items()
                     if k.startswith(FORWARDED_ENV_PREFIXES)})
    return {"py_modules": [str(root / name) for name in PACKAGES],
            "env_vars": env_vars}


def _start_ray(plan: Plan, address: str | None,
               worker_logs: bool | None = None) -> tuple[Any, bool]:
    import ray

    if ray.is_initialized():
        started = False
    elif address:
        ray.init(address=address, runtime_env=cluster_runtime_env(),
                 log_to_driver=True if worker_logs is None else worker_logs)
        started = True
    else:
        import torch

        gpus = plan.total_gpus
        # Virtual GPUs where there are none: placement groups, bundles, fractional GPUs and
        # CUDA_VISIBLE_DEVICES then behave as on a GPU cluster. Real GPUs are Ray's to count.
        real_gpus = torch.cuda.device_count()
        ray.init(num_gpus=None if real_gpus else gpus,
                 num_cpus=max(2, gpus + 2), include_dashboard=False,
                 log_to_driver=bool(worker_logs),
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1",
                                           "PYTHONPATH": os.pathsep.join(_python_path())}})
        started = True
    available = ray.cluster_resources().get("GPU", 0)
    if available < plan.total_gpus:
        if started:
            ray.shutdown()
        where = "the Ray cluster at --address" if address else "this machine"
        raise SpecError(f"the plan needs {plan.total_gpus} GPUs, {where} has {available:g}",
                        key="--address" if address else "sets")
    return ray, started


def _python_path() -> list[str]:
    """The project root on workers' path (an editable install already provides it)."""
    root = str(Path(__file__).resolve().parents[1])
    current = os.environ.get("PYTHONPATH", "")
    return [root, *[p for p in current.split(os.pathsep) if p]]


def execute(job: JobSpec, plan: Plan, options: ExecutionOptions) -> RunResult:
    """Run ``plan`` for ``options.steps`` iterations of ``job``'s algorithm."""
    import torch

    from executor.batch import Batch
    from executor.controller import RoleHandle, WorkerFailedError, WorkerGroup
    from executor.data import DataExhaustedError
    from executor.drivers import DRIVERS, Context, fit_reward_model, validation_scores
    from executor.placement import gpu_nodes, map_plan_nodes
    from executor.protocols import RankLayout
    from executor.records import machine, measurement_rows, versions, write_run
    from executor.reward_function import RewardFunctionError, load_reward_function

    task = validate_for_execution(job, plan, options)
    configs = role_configs(job, plan, options, task)
    checkpoints = effective_checkpoints(job, options)
    say = options.log or (lambda _message: None)
    started_at = time.time()
    ray, started_ray = _start_ray(plan, options.address, options.worker_logs)
    groups: list[WorkerGroup] = []
    try:
        say(f"starting {plan.total_gpus} workers in {len(plan.sets)} colocated set(s)")
        if job.framework_profile.offload.params:
            say(f"the {job.framework} profile also offloads parameters; the executor keeps "
                "them on the GPUs (it offloads optimizer states and gradients)")
        node_map = map_plan_nodes(plan, job.cluster.gpus_per_node, gpu_nodes(ray.nodes()),
                                  local=options.address is None)
        if node_map.shared_machine:
            say("the plan's nodes all run on this machine's one Ray node (a local run: its "
                "node layout is not reproduced)")
        groups = [WorkerGroup(ray, i, s, options.worker_setup,
                              node_map.bundle_nodes(plan, i, job.cluster.gpus_per_node))
                  for i, s in enumerate(plan.sets)]
        worker_code = ray.get(groups[0].workers[0].code_location.remote())
        for role in job.gpu_roles:
            if plan.roles[role].parallel.tp > 1:
                groups[plan.set_index(role)].check_groups_share_nodes(
                    plan.roles[role].parallel.tp, f"{role}'s tp={plan.roles[role].parallel.tp}")
        for group in groups:
            for role in group.colocated.roles:
                group.build(configs[role])
        node_names = {"generate": "generate", "values": "infer", "log_probs": "infer",
                      "scores": "infer", "update": "train"}
        records: list = []
        backends = effective_backends(job, plan)
        handles = {}
        for role in job.gpu_roles:
            rp = plan.roles[role]
            layout = RankLayout(world=rp.parallel.world_size, dp=rp.parallel.dp,
                                tp=rp.parallel.tp, pp=rp.parallel.pp,
                                gen_tp=rp.generation.tp if rp.generation else 1)
            names = {m: f"{role}.{op}" for m, op in node_names.items()}
            handles[role] = RoleHandle(groups[plan.set_index(role)], role, layout,
                                       records.append, names)
        work = job.workload
        if job.data is not None:
            say(f"data: {len(task.train)} training prompts"
                + (f", {len(task.val)} held out" if task.val else "")
                + f" (longest {task.prompt_length} tokens"
                + (f"; {task.train.dropped} longer ones left out" if task.train.dropped else "")
                + (f"; {task.train.truncated} truncated" if task.train.truncated else "")
                + f"), tokenizer {task.tokenizer_directory}")
        ctx = Context(handles=handles, task=task, rl=configs["actor"].rl,
                      prompts_per_iteration=work.prompts_per_iteration,
                      samples_per_prompt=work.samples_per_prompt,
                      reward_from_model="reward" in handles,
                      cost_from_model="cost" in handles,
                      multiplier=options.rl.lambda_init,
                      reward_function=None if job.reward_function is None else
                      load_reward_function(job.reward_function.path,
                                           job.reward_function.name),
                      generator=torch.Generator().manual_seed(options.seed))
        ctx.records = records
        warmup: list[float] = []
        cost_warmup: list[float] = []
        if ctx.reward_from_model and options.reward_warmup_steps > 0 and task.has_rule:
            warmup = fit_reward_model(ctx, options.reward_warmup_steps,
                                      work.prompts_per_iteration)
            say(f"reward model fitted to the rule: loss {warmup[0]:.4f} -> {warmup[-1]:.4f}")
        if ctx.cost_from_model and options.reward_warmup_steps > 0 and task.has_rule:
            cost_warmup = fit_reward_model(ctx, options.reward_warmup_steps,
                                           work.prompts_per_iteration, role="cost")
            say(f"cost model fitted to the rule: loss {cost_warmup[0]:.4f} -> "
                f"{cost_warmup[-1]:.4f}")
        records.clear()
        driver = DRIVERS[job.algorithm]
        held_out = task.held_out_batch(work.prompts_per_iteration, options.seed) \
            if job.data is None else task.held_out_batch(work.prompts_per_iteration)
        rows: list[dict[str, Any]] = []
        metrics: list[dict[str, Any]] = []
        origin = time.time()
        def run_meta(seconds: float) -> dict[str, Any]:
            return {"plan": plan.to_value(), "job": job.to_value(),
                    "options": {"steps": options.steps, "seed": options.seed,
                                "transition": options.transition,
                                "actor_lr": options.actor_lr, "critic_lr": options.critic_lr,
                                "rl": to_mapping(options.rl),
                                "task": to_mapping(options.task) if job.data is None else
                                {"data": to_mapping(job.data),
                                 "tokenizer": task.tokenizer_directory,
                                 "train_prompts": len(task.train),
                                 "dropped": task.train.dropped,
                                 "truncated": task.train.truncated},
                                "reward_warmup_steps": options.reward_warmup_steps,
                                "checkpoints": dict(checkpoints),
                                "validate_every": options.validate_every,
                                "save_hf": str(options.save_hf) if options.save_hf else None,
                                "save_hf_critic": str(options.save_hf_critic)
                                if options.save_hf_critic else None},
                    "reward_warmup_losses": warmup, "cost_warmup_losses": cost_warmup,
                    **({"data_position": task.cursor.state} if job.data is not None else {}),
                    "versions": versions(),
                    "machine": machine(), "seconds": seconds,
                    "worker_code": worker_code,
                    "node_map": {str(k): n.node_id for k, n in node_map.nodes.items()},
                    "worker_nodes": [group.nodes for group in groups],
                    "clock_offsets_seconds": [
                        [{"offset": o, "uncertainty": u} for o, u in group.clock_offsets]
                        for group in groups],
                    "ray_address": options.address or (
                        "local" if torch.cuda.device_count() else "local (virtual GPUs)")}

        def fail(failure: Exception, iteration: int, finished: int) -> NoReturn:
            """Write the records of the ``finished`` iterations and raise RunFailedError."""
            where = ""
            if options.out is not None:
                meta = run_meta(time.time() - started_at)
                meta["failure"] = (
                    {"iteration": iteration, "operation": failure.operation,
                     "set": failure.location, "rank": failure.rank, "cause": failure.cause}
                    if isinstance(failure, WorkerFailedError) else
                    # The user's reward function runs on the controller.
                    {"iteration": iteration, "operation": "reward function",
                     "set": "controller", "rank": None, "cause": str(failure)})
                write_run(options.out, rows, metrics, meta, plan)
                where = f"; records of the {finished} finished iteration(s) in {options.out}"
            raise RunFailedError(f"{failure}{where}") from None

        tokenizer_files = hf_tokenizer_files(task) if job.data is not None else {}

        def save_hf_checkpoints() -> None:
            """The actor (and the critic when asked) as Hugging Face checkpoints, with the
            tokenizer the prompts were tokenized with."""
            for role, directory in (("actor", options.save_hf),
                                    ("critic", options.save_hf_critic)):
                if directory is not None:
                    handles[role].save_hf(Batch(meta={
                        "directory": str(directory), "files": tokenizer_files})).result()

        writer = None
        if options.log_tensorboard and options.out is not None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(options.out / "tensorboard"))
        finished = options.steps
        for iteration in range(options.steps):
            records.clear()
            start = time.time()
            position = task.cursor.state if job.data is not None else None
            try:
                summary = driver(ctx, iteration)
            except (WorkerFailedError, RewardFunctionError) as failure:
                # Keep what finished; the failed iteration's partial calls are left out.
                fail(failure, iteration, finished=iteration)
            except DataExhaustedError as exhausted:
                say(f"{exhausted}: the run ends after {iteration} iteration(s)")
                finished = iteration
                break
            end = time.time()
            rows.extend(measurement_rows(list(records), iteration, plan, origin, backends))
            rows.append({"iteration": iteration, "node": "iteration", "role": "controller",
                         "operation": "iteration", "location": -1, "set": "controller",
                         "gpus": plan.total_gpus, "parallel": plan.placement,
                         "sequences": 0, "tokens": sum(r.tokens for r in records
                                                       if r.operation == "generate"),
                         "start_seconds": start - origin, "end_seconds": end - origin,
                         "wall_seconds": end - start, "compute_seconds": None,
                         "dispatch_seconds": None})
            tokens = sum(r.tokens for r in records if r.operation == "generate")
            metrics.append({"iteration": iteration, "seconds": end - start, **summary,
                            "actor_lr": options.actor_lr, "critic_lr": options.critic_lr,
                            "tokens_per_s": tokens / (end - start),
                            **({"data_epoch": position["epoch"],
                                "data_offset": position["offset"]} if position else {})})
            if writer is not None:
                for name, value in metrics[-1].items():
                    if isinstance(value, (int, float)) and name != "iteration":
                        writer.add_scalar(name, value, iteration)
                writer.flush()
            try:  # after the iteration's records: a checkpoint, a validation
                if options.save_hf_every and (iteration + 1) % options.save_hf_every == 0 \
                        and iteration + 1 < options.steps:
                    save_hf_checkpoints()
                if options.validate_every and ((iteration + 1) % options.validate_every == 0
                                               or iteration + 1 == options.steps):
                    metrics[-1].update(validation_scores(ctx, held_out, iteration))
                    summary = {**summary, "val_score": metrics[-1]["val_score"]}
            except (WorkerFailedError, RewardFunctionError) as failure:
                fail(failure, iteration, finished=iteration + 1)
            constraint = (f", cost {summary['rule_cost']:.2f}, lambda {summary['lambda']:.3f}"
                          if "lambda" in summary else "")
            remaining = (time.time() - origin) / (iteration + 1) * (options.steps - iteration - 1)
            validation = (f", validation {summary['val_score']:.3f}"
                          if "val_score" in summary else "")
            say(f"iteration {iteration + 1}/{options.steps}: {end - start:.2f} s, score "
                f"{summary['rule_score']:.3f}, solved {summary['solved']:.2f}{constraint}"
                f"{validation}"
                f"{f', about {remaining:.0f} s to go' if remaining >= 1 else ''}")
        if options.save_hf is not None or options.save_hf_critic is not None:
            try:
                save_hf_checkpoints()
            except WorkerFailedError as failure:
                fail(failure, finished - 1, finished=finished)
            for role, directory in (("actor", options.save_hf),
                                    ("critic", options.save_hf_critic)):
                if directory is not None:
                    say(f"{role} written as a Hugging Face checkpoint to {directory}")
        if writer is not None:
            writer.close()
        seconds = time.time() - started_at
        if options.out is not None:
            write_run(options.out, rows, metrics, run_meta(seconds), plan)
        return RunResult(rows=rows, metrics=metrics, out=options.out, seconds=seconds)
    finally:
        for group in groups:
            group.shutdown()
        if started_ray:
            ray.shutdown()
