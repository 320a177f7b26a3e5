"""``hybridflow execute``: check a plan, start (or join) Ray, build the worker groups, run the
algorithm's controller program for N iterations, write the records."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from executor.algorithms import RLConfig
from executor.hybrid_engine import TransitionMode
from executor.task import SortDigits
from profiles.datafile import SpecError, from_mapping, to_mapping
from simulator.plan import Plan
from simulator.predict import VALUE_HEAD_ROLES
from simulator.specs.job import JobSpec

SUPPORTED_ALGORITHMS = ("ppo", "grpo", "remax", "safe-rlhf")
EXECUTABLE_MODES = ("sync", "one_step_off")
"""Plan modes the executor runs (``simulator/specs/asynchrony.py``); ``async`` (streaming
rollouts) is planned, not run."""


def plan_gpus(plan: Plan) -> int:
    """GPUs a run of ``plan`` takes: its training sets and its rollout set."""
    return sum(s.gpus for s in plan.located_sets())


def _optional_path(value: Any, key: str) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpecError(f"expected a directory path or null, got {value!r}", key=key)
    return Path(value)


RUN_LOCAL_OPTIONS = ("out", "address", "log", "resume", "worker_logs")
"""Options of one invocation, not of the run (where it writes, which Ray, its console): a
run's meta.json does not keep them and ``--resume`` takes them from its own command line."""


@dataclass(kw_only=True, frozen=True)
class ExecutionOptions:
    """How to run a plan. A run keeps every option but ``RUN_LOCAL_OPTIONS`` in its
    meta.json (``to_saved``), and ``--resume`` reads them back (``from_saved``)."""

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
    save_hf: Path | None = field(default=None, metadata={"parse": _optional_path})
    """Where to write the trained actor as a Hugging Face checkpoint at the end (config.json
    + model.safetensors); None: nothing is written."""
    save_hf_every: int = 0
    """Also write it every this many iterations (replacing the previous one whole; 0: only
    at the end)."""
    save_hf_critic: Path | None = field(default=None, metadata={"parse": _optional_path})
    """Where to write the trained critic, as a Hugging Face ``LlamaForTokenClassification``
    with one label (the same times as the actor); None: nothing is written."""
    log_tensorboard: bool = False
    """Also write every iteration's metrics as TensorBoard scalars (the run directory's
    ``tensorboard/``)."""
    checkpoint_every: int = 0
    """Save the trained roles' weights and optimizer states, the data position, the random
    generators' states and the records every this many iterations (0: never)."""
    resume: Path | None = None
    """Continue the run in this directory from its last checkpoint (its plan, job and
    options; ``steps`` may be raised)."""
    max_restarts: int = 2
    """After a worker fails, restart the worker groups from the last checkpoint (or the
    start) at most this many times, then fail."""
    checkpoints: dict[str, str] = field(default_factory=dict)
    """role -> local Hugging Face checkpoint directory its model starts from (the reference
    takes the actor's when it has none of its own and the same model)."""
    worker_logs: bool | None = None
    """Show the workers' output (CUDA and NCCL messages, out-of-memory reports) on the
    driver's stderr; None: on with ``address``, off for a local Ray."""

    def to_saved(self) -> dict[str, Any]:
        """The run's options as meta.json keeps them (plain JSON values)."""
        return {f.name: _saved_value(getattr(self, f.name)) for f in fields(self)
                if f.name not in RUN_LOCAL_OPTIONS}

    @classmethod
    def from_saved(cls, saved: Any, *, source: str | None = None,
                   **local: Any) -> ExecutionOptions:
        """The options ``to_saved`` wrote (a key it did not write, or a value of the wrong
        type, is a SpecError naming ``options.KEY``), with this invocation's ``local``
        options (``RUN_LOCAL_OPTIONS``) and any overrides."""
        options = from_mapping(cls, saved, source=source, key_prefix="options")
        return replace(options, **local)


def _saved_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    return to_mapping(value)


class RunFailedError(RuntimeError):
    """A worker failed during the run; the message names the operation, the rank and the
    cause, and where the records of the finished iterations are."""


@dataclass(frozen=True)
class RunResult:
    rows: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    out: Path | None
    seconds: float


def check_setup_hook(spec: str) -> None:
    """``--worker-setup MODULE[:FUNCTION]`` imported on the controller first, so a typo fails
    here in one line instead of in every worker."""
    import importlib

    from executor.worker import setup_hook_parts

    module, function = setup_hook_parts(spec)
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:  # the user's module: any import error is theirs to see
        raise SpecError(f"cannot import {module!r}: {type(exc).__name__}: {exc}",
                        key="--worker-setup") from None
    if not callable(getattr(loaded, function, None)):
        raise SpecError(f"module {module!r} has no function {function!r} (give "
                        "MODULE:FUNCTION)", key="--worker-setup")


def validate_for_execution(job: JobSpec, plan: Plan, options: ExecutionOptions) -> Any:
    """Everything that can be checked before a worker starts; raises SpecError. Returns the
    task the controller's program takes its prompts from (the built-in one, or the job's
    data read and tokenized)."""
    from executor.backends import check_available, check_megatron_layout
    from executor.trainer import check_layout, compute_dtype

    if job.algorithm not in SUPPORTED_ALGORITHMS:
        raise SpecError(f"the executor runs {', '.join(SUPPORTED_ALGORITHMS)}; "
                        f"{job.algorithm} is planned but not executable yet", key="algorithm")
    if plan.mode not in EXECUTABLE_MODES:
        raise SpecError(f"the executor runs {' and '.join(EXECUTABLE_MODES)} plans; "
                        f"{plan.mode_label()} (streaming rollouts) is planned but not "
                        "executable yet", key="mode")
    plan.validate(job)
    compute_dtype(job.workload.dtype)
    chosen_backends = effective_backends(job, plan)
    if plan.rollout is not None and chosen_backends["actor"][1] != "native":
        raise SpecError("a rollout set runs the native generation backend (vLLM generates on "
                        "the actor's training GPUs only)", key="backends.actor.generation")
    checkpoints = effective_checkpoints(job, options)
    check_checkpoints(job, checkpoints)
    task = prepare_task(job, options, checkpoints)
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
        if rp.parallel.ulysses > 1:
            raise SpecError("the executor runs no Ulysses sequence parallelism; plan the job "
                            "with framework: hybridflow", key=f"roles.{role}.parallel.ulysses")
        if rp.parallel.offload_params or rp.parallel.offload_optimizer:
            raise SpecError("the executor keeps every state on its GPUs between calls (no "
                            "offload); plan the job with framework: hybridflow",
                            key=f"roles.{role}.parallel.offload_params")
        if rp.generation is not None and plan.rollout is None and \
                rp.parallel.tp % rp.generation.tp:
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
    if options.resume is None and options.out is not None and \
            (Path(options.out) / "meta.json").exists():
        raise SpecError(f"{options.out} holds an earlier run; give another directory, or "
                        f"continue that run with --resume {options.out}", key="--out")
    if options.worker_setup:
        check_setup_hook(options.worker_setup)
    check_megatron_device(chosen_backends, options)
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


def prepare_task(job: JobSpec, options: ExecutionOptions,
                 checkpoints: dict[str, str]) -> Any:
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


def check_megatron_device(chosen_backends: dict[str, tuple[str, str]],
                          options: ExecutionOptions) -> None:
    """Megatron-core's training code asks for CUDA (its model-parallel state, fused kernels
    and RNG tracker): on a local Ray cluster of a machine without a CUDA device it fails in
    the first worker. Say so before any worker starts. A worker-setup hook may prepare the
    workers for CPU (the tests' ``tests.compat.megatron_cpu:install``); a remote cluster's
    devices are not this machine's."""
    megatron = sorted(r for r, (training, _) in chosen_backends.items() if training == "megatron")
    if not megatron or options.address is not None or options.worker_setup:
        return
    import torch

    if not torch.cuda.is_available():
        raise SpecError(f"{', '.join(megatron)} train(s) with Megatron-core, which needs a CUDA "
                        "device, and this machine has none: run on a GPU machine or join its "
                        "Ray cluster with --address, or plan the job with the torch backend "
                        "(backends.ROLE.training: torch); on CPU, the tests run Megatron with "
                        "--worker-setup tests.compat.megatron_cpu:install",
                        key=f"backends.{megatron[0]}.training")


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
    from simulator.plan import job_as_planned
    from simulator.predict import estimate_plan, first_generate_node

    job = job_as_planned(job, plan)
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
            max_model_tokens=(task.prompt_length + response_cap(job, task)
                              if rp.generation is not None else None),
            offload_optimizer=trainable and offload.optimizer,
            offload_grads=trainable and offload.grads)
    # The reference starts as a copy of the actor: same seed, same model.
    from dataclasses import replace

    if "ref" in configs and "actor" in configs and \
            job.model("ref") == job.model("actor"):
        configs["ref"] = replace(configs["ref"], seed=configs["actor"].seed,
                                 checkpoint=checkpoints.get("ref", checkpoints.get("actor")))
    if plan.rollout is not None:
        # One-step-off: the actor trains without a generation engine; the rollout set holds
        # its generation replicas (the same seed: the same draws as on the training GPUs).
        from simulator.specs.parallel import ParallelConfig

        actor = configs["actor"] = replace(configs["actor"], rollout=True)
        gen = actor.generation
        assert gen is not None
        configs["rollout"] = replace(
            actor, role="rollout", trainable=False, checkpoint=None,
            parallel=ParallelConfig(tp=gen.tp, dp=plan.rollout.gpus // gen.tp,
                                    sequence_parallel=False),
            offload_optimizer=False, offload_grads=False)
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

        gpus = plan_gpus(plan)
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
    if available < plan_gpus(plan):
        if started:
            ray.shutdown()
        where = "the Ray cluster at --address" if address else "this machine"
        raise SpecError(f"the plan needs {plan_gpus(plan)} GPUs, {where} has {available:g}",
                        key="--address" if address else "sets")
    return ray, started


def _python_path() -> list[str]:
    """The project root on workers' path (an editable install already provides it)."""
    root = str(Path(__file__).resolve().parents[1])
    current = os.environ.get("PYTHONPATH", "")
    return [root, *[p for p in current.split(os.pathsep) if p]]
