"""One ``hybridflow execute`` run on the controller: start the worker groups, drive the
algorithm's program iteration by iteration, keep the records, and survive what a long run
meets.

- **Checkpoints** (``checkpoint_every``): every trained role's state through torch
  distributed checkpointing (``executor.checkpoint``), and the controller's own (the
  iteration, the prompt generator's and the data position's state, Safe-RLHF's multiplier,
  the records so far) as JSON; written into ``RUN/checkpoints/.iter_N.partial`` and renamed
  to ``iter_N`` when whole, so a checkpoint directory is complete or absent.
- **Resume** (``resume``): the run's plan, job and options, its last checkpoint's state, and
  the iterations after it; a resumed run computes what the uninterrupted one computes.
- **Worker failure**: the run restarts its worker groups from the last checkpoint (or the
  start), at most ``max_restarts`` times; ``meta.json`` lists each failure and the time it
  cost; the records roll back to the checkpoint's, so no row is lost or written twice.
- **Interrupt** (SIGINT): the workers end, Ray stops if the run started it, the records of
  the finished iterations are written beside the last checkpoint.
- **One-step-off** plans: the rollout set is one more worker group (after the training
  sets) holding the actor's generation replicas; a sync group joins it to the trainer's
  actor (``executor.weight_sync``) and the rollout set receives the weights at the start, after
  a restore, and after every update (``executor.drivers``). A resumed one-step-off run
  generates its first batch after the checkpoint with the restored weights (the
  uninterrupted run had it in flight with the weights one update older).

``execute`` and ``check_plan`` (``execute --dry-run``) are the entry points; the checks and
options they use live in ``executor.run``, which imports nothing from here.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn

from executor.run import (
    ExecutionOptions,
    RunFailedError,
    RunResult,
    _start_ray,
    effective_backends,
    effective_checkpoints,
    hf_tokenizer_files,
    plan_gpus,
    role_configs,
    validate_for_execution,
)
from profiles.datafile import (
    SpecError,
    json_text,
    read_text_file,
    to_mapping,
    write_text_atomic,
)
from simulator.plan import Plan
from simulator.specs.job import JobSpec

CHECKPOINTS_KEPT = 2
"""Complete checkpoints kept in RUN/checkpoints (older ones are removed)."""

NODE_NAMES = {"generate": "generate", "values": "infer", "log_probs": "infer",
              "scores": "infer", "update": "train"}


class RunInterruptedError(RuntimeError):
    """The run was stopped (SIGINT); the message says what was kept."""


def checkpoint_directories(run: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_")
            and (p / "controller.json").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def read_controller_state(directory: Path) -> dict[str, Any]:
    path = directory / "controller.json"
    try:
        state = json.loads(read_text_file(path, what="UTF-8 JSON"))
    except json.JSONDecodeError as exc:
        raise SpecError(f"not a readable checkpoint: {exc}", source=str(path)) from None
    if not isinstance(state, dict):
        raise SpecError("not a readable checkpoint: expected a JSON mapping",
                        source=str(path))
    for key in ("iterations_done", "generator", "rows", "metrics"):
        if key not in state:
            raise SpecError("missing key", key=key, source=str(path))
    return state


class RunSession:
    """The controller's side of one run (see the module's docstring)."""

    def __init__(self, job: JobSpec, plan: Plan, options: ExecutionOptions):
        self.job = job
        self.plan = plan
        self.options = options
        self.say = options.log or (lambda _message: None)
        self.resume_from: Path | None = None
        if options.resume is not None:
            found = checkpoint_directories(options.resume)
            if not found:
                raise SpecError(f"{options.resume} has no complete checkpoint "
                                "(checkpoints/iter_N with controller.json)", key="--resume")
            self.resume_from = found[-1]
        self.task = validate_for_execution(job, plan, options)
        self.configs = role_configs(job, plan, options, self.task)
        self.checkpoints = effective_checkpoints(job, options)
        self.backends = effective_backends(job, plan)
        self.trained = [r for r in job.gpu_roles if self.configs[r].trainable]
        self.groups: list[Any] = []
        self.handles: dict[str, Any] = {}
        self.records: list[Any] = []
        self.rows: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.kill_workers = False
        """Set when a worker failed or the run was interrupted: the workers are then killed,
        not asked to stop, since a rank may wait in a collective (with a failed peer) for its
        whole timeout."""
        self.checkpoints_written: list[dict[str, Any]] = []
        self.warmup: list[float] = []
        self.cost_warmup: list[float] = []
        self.last_checkpoint: Path | None = self.resume_from
        self.last_checkpoint_time = time.time()
        self.started_at = time.time()
        self.origin = time.time()
        self.worker_code: dict[str, Any] = {}
        self.node_map: Any = None
        self.ctx: Any = None

    # ----- workers ---------------------------------------------------------------------

    def start_workers(self) -> None:
        """Worker groups, roles built, role handles and the controller's context."""
        import torch

        from executor.controller import RoleHandle, WorkerGroup
        from executor.drivers import Context
        from executor.placement import gpu_nodes, map_plan_nodes
        from executor.protocols import RankLayout
        from executor.reward_function import load_reward_function

        job, plan, options = self.job, self.plan, self.options
        self.node_map = map_plan_nodes(plan, job.cluster.gpus_per_node,
                                       gpu_nodes(self.ray.nodes()),
                                       local=options.address is None)
        # The training sets, then the rollout set of a one-step-off plan.
        self.groups = [WorkerGroup(self.ray, i, s, options.worker_setup,
                                   self.node_map.bundle_nodes(plan, i,
                                                              job.cluster.gpus_per_node))
                       for i, s in enumerate(plan.located_sets())]
        self.worker_code = self.ray.get(self.groups[0].workers[0].code_location.remote())
        for role in job.gpu_roles:
            tp = plan.roles[role].parallel.tp
            if tp > 1:
                self.groups[plan.set_index(role)].check_groups_share_nodes(
                    tp, f"{role}'s tp={tp}")
        rollout_generation = plan.roles["actor"].generation if plan.rollout else None
        if rollout_generation is not None and rollout_generation.tp > 1:
            self.groups[-1].check_groups_share_nodes(
                rollout_generation.tp, f"the rollout's generation tp={rollout_generation.tp}")
        for group in self.groups:
            for role in group.colocated.roles:
                group.build(self.configs[role])
        self.records = []
        self.handles = {}
        for role in job.gpu_roles:
            rp = plan.roles[role]
            layout = RankLayout(world=rp.parallel.world_size, dp=rp.parallel.dp,
                                tp=rp.parallel.tp, pp=rp.parallel.pp,
                                gen_tp=rp.generation.tp if rp.generation else 1)
            names = {m: f"{role}.{op}" for m, op in NODE_NAMES.items()}
            self.handles[role] = RoleHandle(self.groups[plan.set_index(role)], role, layout,
                                            self.records.append, names)
        if rollout_generation is not None:
            gpus, tp = self.groups[-1].colocated.gpus, rollout_generation.tp
            # Whole generation replicas: micro-DP is one replica per tp group.
            self.handles["rollout"] = RoleHandle(
                self.groups[-1], "rollout", RankLayout(world=gpus, dp=gpus // tp, tp=tp,
                                                       gen_tp=tp),
                self.records.append, {m: f"actor.{op}" for m, op in NODE_NAMES.items()},
                label="actor")
        work = job.workload
        self.ctx = Context(handles=self.handles, task=self.task, rl=self.configs["actor"].rl,
                           prompts_per_iteration=work.prompts_per_iteration,
                           samples_per_prompt=work.samples_per_prompt,
                           reward_from_model="reward" in self.handles,
                           cost_from_model="cost" in self.handles,
                           multiplier=options.rl.lambda_init,
                           reward_function=None if job.reward_function is None else
                           load_reward_function(job.reward_function.path,
                                                job.reward_function.name),
                           generator=torch.Generator().manual_seed(options.seed),
                           mode=plan.mode, steps=options.steps)
        self.ctx.records = self.records
        if rollout_generation is not None:
            self.form_weight_sync()
            self.sync_rollout()

    def form_weight_sync(self) -> None:
        """The sync group: the trainer actor's rank 0 and every rollout rank, over a store on
        that rank 0 (``executor.weight_sync``)."""
        from executor.batch import Batch

        trainer, rollout = self.groups[self.plan.set_index("actor")], self.groups[-1]
        members = 1 + len(rollout.workers)
        one_node = len(set(trainer.nodes[:1] + rollout.nodes)) == 1
        host = "127.0.0.1" if one_node else trainer.addresses[0]
        opened, _ = self.ray.get(trainer.workers[0].call.remote(
            "actor", "open_weight_sync", Batch(meta={"host": host, "members": members})))
        meta = Batch(meta={"address": f"{host}:{opened.meta['port']}", "members": members})
        self.ray.get([w.call.remote("actor", "join_weight_sync", meta)
                      for w in trainer.workers]
                     + [w.call.remote("rollout", "join_weight_sync", meta)
                        for w in rollout.workers])

    def sync_rollout(self) -> None:
        """The trainer's current weights to the rollout set, outside any iteration (at the
        start and after a restore)."""
        from executor.drivers import sync_weights

        sync_weights(self.ctx)
        self.records.clear()

    def stop_workers(self, graceful: bool = True) -> None:
        for group in self.groups:
            group.shutdown(graceful=graceful)
        self.groups = []

    # ----- checkpoints -----------------------------------------------------------------

    def controller_state(self, iterations_done: int) -> dict[str, Any]:
        return {"iterations_done": iterations_done,
                "generator": self.ctx.generator.get_state().tolist(),
                "multiplier": self.ctx.multiplier,
                "data_position": self.task.cursor.state if self.job.data is not None
                else None,
                "reward_warmup_losses": self.warmup,
                "cost_warmup_losses": self.cost_warmup,
                "rows": self.rows, "metrics": self.metrics,
                "plan": self.plan.to_value(), "roles": self.trained,
                "seconds": time.time() - self.started_at}

    def save_checkpoint(self, iterations_done: int) -> Path:
        """Every trained role's state and the controller's, renamed into place whole."""
        from executor.batch import Batch

        assert self.options.out is not None
        start = time.time()
        root = self.options.out / "checkpoints"
        final = root / f"iter_{iterations_done:06d}"
        partial = root / f".{final.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        pending = [self.handles[role].save_checkpoint(
            Batch(meta={"directory": str(partial / role)}), node=f"{role}.checkpoint")
            for role in self.trained]
        written = sum(p.result().meta.get("bytes", 0.0) for p in pending)
        self.records.clear()  # checkpoint calls are not stages of an iteration
        write_text_atomic(partial / "controller.json",
                          json_text(self.controller_state(iterations_done), default=str))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in checkpoint_directories(self.options.out)[:-CHECKPOINTS_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        self.last_checkpoint = final
        self.last_checkpoint_time = time.time()
        self.checkpoints_written.append({"iterations_done": iterations_done,
                                         "seconds": time.time() - start,
                                         "bytes_rank_sum": written, "path": str(final)})
        self.write_records()
        return final

    def restore(self, directory: Path) -> int:
        """Every trained role's state and the controller's from ``directory``; returns the
        iterations it had done."""
        import torch

        from executor.batch import Batch

        state = read_controller_state(directory)
        if state.get("plan") != json.loads(json_text(self.plan.to_value(), default=str)):
            raise SpecError("the checkpoint was written by another plan", key="--resume",
                            source=str(directory))
        pending = [self.handles[role].load_checkpoint(
            Batch(meta={"directory": str(directory / role)}), node=f"{role}.restore")
            for role in self.trained]
        for call in pending:
            call.result()
        if "rollout" in self.handles:
            self.sync_rollout()
        self.records.clear()
        self.ctx.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        self.ctx.multiplier = state.get("multiplier", self.ctx.multiplier)
        if self.job.data is not None and state.get("data_position"):
            self.task.cursor.restore(state["data_position"])
        self.rows = list(state["rows"])
        self.metrics = list(state["metrics"])
        self.warmup = list(state.get("reward_warmup_losses", []))
        self.cost_warmup = list(state.get("cost_warmup_losses", []))
        return int(state["iterations_done"])

    # ----- records ---------------------------------------------------------------------

    def run_meta(self, seconds: float) -> dict[str, Any]:
        import torch

        from executor.records import machine, versions

        options, job, task = self.options, self.job, self.task
        return {"plan": self.plan.to_value(), "job": job.to_value(), "mode": self.plan.mode,
                "options": {**options.to_saved(), "checkpoints": dict(self.checkpoints)},
                **({"data": {"data": to_mapping(job.data),
                             "tokenizer": task.tokenizer_directory,
                             "train_prompts": len(task.train),
                             "dropped": task.train.dropped,
                             "truncated": task.train.truncated}}
                   if job.data is not None else {}),
                "reward_warmup_losses": self.warmup, "cost_warmup_losses": self.cost_warmup,
                **({"data_position": task.cursor.state} if job.data is not None else {}),
                "checkpoints_written": self.checkpoints_written,
                "restarts": self.restarts,
                **({"resumed_from": str(self.resume_from)} if self.resume_from else {}),
                "versions": versions(), "machine": machine(), "seconds": seconds,
                "worker_code": self.worker_code,
                "node_map": {str(k): n.node_id for k, n in self.node_map.nodes.items()}
                if self.node_map is not None else {},
                "worker_nodes": [group.nodes for group in self.groups],
                "clock_offsets_seconds": [
                    [{"offset": o, "uncertainty": u} for o, u in group.clock_offsets]
                    for group in self.groups],
                "ray_address": options.address or (
                    "local" if torch.cuda.device_count() else "local (virtual GPUs)")}

    def write_records(self, **extra: Any) -> None:
        from executor.records import write_run

        if self.options.out is None:
            return
        meta = self.run_meta(time.time() - self.started_at)
        meta.update(extra)
        write_run(self.options.out, self.rows, self.metrics, meta, self.plan)

    def fail(self, failure: Exception, iteration: int) -> NoReturn:
        """Write the records of the finished iterations and raise RunFailedError."""
        from executor.controller import WorkerFailedError

        self.kill_workers = isinstance(failure, WorkerFailedError)

        where = ""
        if self.options.out is not None:
            detail = ({"iteration": iteration, "operation": failure.operation,
                       "set": failure.location, "rank": failure.rank, "cause": failure.cause}
                      if isinstance(failure, WorkerFailedError) else
                      # The user's reward function runs on the controller.
                      {"iteration": iteration, "operation": "reward function",
                       "set": "controller", "rank": None, "cause": str(failure)})
            self.write_records(failure=detail)
            finished = len(self.metrics)
            where = f"; records of the {finished} finished iteration(s) in {self.options.out}"
        raise RunFailedError(f"{failure}{where}") from None

    # ----- the run ---------------------------------------------------------------------

    def run(self) -> RunResult:
        from executor.controller import WorkerFailedError

        options = self.options
        self.ray, self.started_ray = _start_ray(self.plan, options.address,
                                                options.worker_logs)
        try:
            try:
                return self._run()
            except WorkerFailedError:
                # Failed outside an iteration (warm-up, restore, a restart): the same as in one.
                self.kill_workers = True
                raise
            except KeyboardInterrupt:
                # Ranks may be inside a call (or a collective): kill them, do not wait.
                self.kill_workers = True
                kept = f"{len(self.metrics)} finished iteration(s)"
                where = ""
                if options.out is not None:
                    self.write_records(interrupted={"after_iterations": len(self.metrics),
                                                    "at": time.time()})
                    where = f" in {options.out}"
                last = f"; last checkpoint {self.last_checkpoint}" if self.last_checkpoint \
                    else ""
                raise RunInterruptedError(f"interrupted: the records of {kept} are kept"
                                          f"{where}{last}") from None
        finally:
            self.stop_workers(graceful=not self.kill_workers)
            if self.started_ray:
                self.ray.shutdown()

    def _run(self) -> RunResult:
        from executor.controller import WorkerFailedError
        from executor.reward_function import RewardFunctionError

        options, job = self.options, self.job
        self.say(f"starting {plan_gpus(self.plan)} workers in {len(self.plan.sets)} "
                 "colocated set(s)"
                 + (f" and a rollout set ({self.plan.mode})" if self.plan.rollout else ""))
        if job.framework_profile.offload.params:
            self.say(f"the {job.framework} profile also offloads parameters; the executor "
                     "keeps them on the GPUs (it offloads optimizer states and gradients)")
        self.start_workers()
        if self.node_map.shared_machine:
            self.say("the plan's nodes all run on this machine's one Ray node (a local run: "
                     "its node layout is not reproduced)")
        if job.data is not None:
            task = self.task
            self.say(f"data: {len(task.train)} training prompts"
                     + (f", {len(task.val)} held out" if task.val else "")
                     + f" (longest {task.prompt_length} tokens"
                     + (f"; {task.train.dropped} longer ones left out"
                        if task.train.dropped else "")
                     + (f"; {task.train.truncated} truncated" if task.train.truncated else "")
                     + f"), tokenizer {task.tokenizer_directory}")
        if self.resume_from is not None:
            first = self.restore(self.resume_from)
            self.say(f"resumed from {self.resume_from} after iteration {first}")
        else:
            self.warm_up()
            first = 0
        self.tokenizer_files = hf_tokenizer_files(self.task) if job.data is not None else {}
        self.writer = None
        if options.log_tensorboard and options.out is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(options.out / "tensorboard"))
        iteration = first
        while iteration < options.steps:
            try:
                done = self.iterate(iteration)
            except WorkerFailedError as failure:
                iteration = self.recover(failure, iteration)
                continue
            except RewardFunctionError as failure:
                self.fail(failure, iteration)
            if not done:
                break
            iteration += 1
        if options.save_hf is not None or options.save_hf_critic is not None:
            try:
                self.save_hf_checkpoints()
            except WorkerFailedError as failure:
                self.fail(failure, len(self.metrics))
            for role, directory in (("actor", options.save_hf),
                                    ("critic", options.save_hf_critic)):
                if directory is not None:
                    self.say(f"{role} written as a Hugging Face checkpoint to {directory}")
        if self.writer is not None:
            self.writer.close()
        seconds = time.time() - self.started_at
        self.write_records()
        return RunResult(rows=self.rows, metrics=self.metrics, out=options.out,
                         seconds=seconds)

    def warm_up(self) -> None:
        """Fit the reward (and cost) models to the built-in task's rules before RL."""
        from executor.drivers import fit_reward_model

        ctx, options, work = self.ctx, self.options, self.job.workload
        if ctx.reward_from_model and options.reward_warmup_steps > 0 and self.task.has_rule:
            self.warmup = fit_reward_model(ctx, options.reward_warmup_steps,
                                           work.prompts_per_iteration)
            self.say(f"reward model fitted to the rule: loss {self.warmup[0]:.4f} -> "
                     f"{self.warmup[-1]:.4f}")
        if ctx.cost_from_model and options.reward_warmup_steps > 0 and self.task.has_rule:
            self.cost_warmup = fit_reward_model(ctx, options.reward_warmup_steps,
                                                work.prompts_per_iteration, role="cost")
            self.say(f"cost model fitted to the rule: loss {self.cost_warmup[0]:.4f} -> "
                     f"{self.cost_warmup[-1]:.4f}")
        self.records.clear()

    def held_out(self) -> Any:
        work = self.job.workload
        if self.job.data is None:
            return self.task.held_out_batch(work.prompts_per_iteration, self.options.seed)
        return self.task.held_out_batch(work.prompts_per_iteration)

    def iterate(self, iteration: int) -> bool:
        """One iteration, its records, and what follows it (a checkpoint, a validation, a
        Hugging Face export); False when the data is used up."""
        from executor.data import DataExhaustedError
        from executor.drivers import run_iteration, validation_scores
        from executor.records import measurement_rows

        options, plan = self.options, self.plan
        self.records.clear()
        start = time.time()
        position = self.task.cursor.state if self.job.data is not None else None
        try:
            summary = run_iteration(self.ctx, self.job.algorithm, iteration)
        except DataExhaustedError as exhausted:
            self.say(f"{exhausted}: the run ends after {iteration} iteration(s)")
            return False
        end = time.time()
        rows = measurement_rows(list(self.records), iteration, plan, self.origin,
                                self.backends)
        tokens = sum(r.tokens for r in self.records if r.operation == "generate")
        rows.append({"iteration": iteration, "node": "iteration", "role": "controller",
                     "operation": "iteration", "location": -1, "set": "controller",
                     "gpus": plan_gpus(plan), "parallel": plan.placement,
                     "sequences": 0, "tokens": tokens,
                     "start_seconds": start - self.origin, "end_seconds": end - self.origin,
                     "wall_seconds": end - start, "compute_seconds": None,
                     "dispatch_seconds": None})
        metric = {"iteration": iteration, "seconds": end - start, **summary,
                  "actor_lr": options.actor_lr, "critic_lr": options.critic_lr,
                  "tokens_per_s": tokens / (end - start),
                  **({"data_epoch": position["epoch"], "data_offset": position["offset"]}
                     if position else {})}
        # After the iteration's records: an export, a validation, a checkpoint.
        if options.save_hf_every and (iteration + 1) % options.save_hf_every == 0 \
                and iteration + 1 < options.steps:
            self.save_hf_checkpoints()
        if options.validate_every and ((iteration + 1) % options.validate_every == 0
                                       or iteration + 1 == options.steps):
            metric.update(validation_scores(self.ctx, self.held_out(), iteration))
        # The iteration counts once all of it has run (a failure above repeats it whole).
        self.rows.extend(rows)
        self.metrics.append(metric)
        if self.writer is not None:
            for name, value in metric.items():
                if isinstance(value, (int, float)) and name != "iteration":
                    self.writer.add_scalar(name, value, iteration)
            self.writer.flush()
        if options.checkpoint_every and options.out is not None and \
                ((iteration + 1) % options.checkpoint_every == 0
                 or iteration + 1 == options.steps):
            self.save_checkpoint(iteration + 1)
        constraint = (f", cost {summary['rule_cost']:.2f}, lambda {summary['lambda']:.3f}"
                      if "lambda" in summary else "")
        done = len(self.metrics)
        remaining = (time.time() - self.origin) / max(done, 1) * (options.steps - iteration - 1)
        validation = (f", validation {metric['val_score']:.3f}"
                      if "val_score" in metric else "")
        self.say(f"iteration {iteration + 1}/{options.steps}: {end - start:.2f} s, score "
                 f"{summary['rule_score']:.3f}, solved {summary['solved']:.2f}{constraint}"
                 f"{validation}"
                 f"{f', about {remaining:.0f} s to go' if remaining >= 1 else ''}")
        return True

    def recover(self, failure: Exception, iteration: int) -> int:
        """After a worker failed in ``iteration``: restart the worker groups from the last
        checkpoint (or the start) and return the iteration to run next; or, when the
        restarts are used up, write the records and fail."""
        if len(self.restarts) >= self.options.max_restarts:
            if self.restarts:
                self.say(f"a worker failed again after {len(self.restarts)} restart(s)")
            self.fail(failure, iteration)
        detected = time.time()
        checkpoint = self.last_checkpoint
        self.say(f"worker failure in iteration {iteration + 1}: {failure}; restarting the "
                 f"workers from {checkpoint or 'the start'}")
        self.stop_workers(graceful=False)
        self.start_workers()
        if checkpoint is not None:
            restored = self.restore(checkpoint)
        else:  # no checkpoint yet: the run starts over, as a fresh run would
            restored = 0
            self.rows, self.metrics = [], []
            self.warm_up()
            if self.job.data is not None:
                self.task.cursor.restore({**self.task.cursor.state, "epoch": 0, "offset": 0})
        self.restarts.append({
            "iteration": iteration, "cause": str(failure),
            "restored_to_iteration": restored,
            "checkpoint": str(checkpoint) if checkpoint else None,
            # The work since the checkpoint is done again, plus the restart itself.
            "seconds_lost": time.time() - self.last_checkpoint_time,
            "restart_seconds": time.time() - detected})
        self.last_checkpoint_time = time.time()
        self.write_records()
        return restored

    def save_hf_checkpoints(self) -> None:
        """The actor (and the critic when asked) as Hugging Face checkpoints, with the
        tokenizer the prompts were tokenized with."""
        from executor.batch import Batch

        for role, directory in (("actor", self.options.save_hf),
                                ("critic", self.options.save_hf_critic)):
            if directory is not None:
                self.handles[role].save_hf(Batch(meta={
                    "directory": str(directory), "files": self.tokenizer_files})).result()
        self.records.clear()


def check_plan(job: JobSpec, plan: Plan, options: ExecutionOptions) -> dict[str, Any]:
    """``execute --dry-run``: every check ``execute`` makes before a worker starts (the
    engines installed, each role's layout, the data and checkpoints, the run directory), and
    what the run would start, without starting Ray. Raises SpecError."""
    session = RunSession(job, plan, options)
    return {"algorithm": job.algorithm, "mode": plan.mode, "gpus": plan_gpus(plan),
            "placement": plan.placement,
            "roles": {role: {"training": training, "generation": generation,
                             "gpus": plan.roles[role].parallel.world_size}
                      for role, (training, generation) in session.backends.items()},
            "prompts": "the built-in digit-sorting task" if job.data is None else
            f"{len(session.task.train)} prompts of the job's data"}


def execute(job: JobSpec, plan: Plan, options: ExecutionOptions) -> RunResult:
    """Run ``plan`` for ``options.steps`` iterations of ``job``'s algorithm (from a saved
    checkpoint with ``options.resume``): checks everything before a worker starts, then
    drives the controller's program (``RunSession``)."""
    return RunSession(job, plan, options).run()
