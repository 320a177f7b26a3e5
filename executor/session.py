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

import time
from pathlib import Path
from typing import Any, NoReturn

from executor.controller import WorkerFailedError
from executor.data import DataExhaustedError
from executor.drivers import fit_reward_model, run_iteration, validation_scores
from executor.ledger import RunLedger
from executor.records import machine, measurement_rows, versions, write_run
from executor.reward_function import RewardFunctionError
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
from executor.run_checkpoints import CheckpointStore, latest_checkpoint
from executor.run_workers import RunWorkers
from profiles.datafile import to_mapping
from simulator.plan import Plan
from simulator.specs.job import JobSpec


class RunInterruptedError(RuntimeError):
    """The run was stopped (SIGINT); the message says what was kept."""


class RunSession:
    """The controller's side of one run (see the module's docstring): the run's inputs, its
    workers (``RunWorkers``), its records (``RunLedger``) and its checkpoints
    (``CheckpointStore``)."""

    def __init__(self, job: JobSpec, plan: Plan, options: ExecutionOptions):
        self.job = job
        self.plan = plan
        self.options = options
        self.say = options.log or (lambda _message: None)
        self.resume_from = latest_checkpoint(options.resume) \
            if options.resume is not None else None
        self.task = validate_for_execution(job, plan, options)
        self.configs = role_configs(job, plan, options, self.task)
        self.checkpoints = effective_checkpoints(job, options)
        """The Hugging Face directories the roles start from."""
        self.backends = effective_backends(job, plan)
        self.trained = [r for r in job.gpu_roles if self.configs[r].trainable]
        self.ledger = RunLedger()
        self.store = CheckpointStore(options.out, self.resume_from)
        self.workers: RunWorkers | None = None
        self.started_at = time.time()
        self.tokenizer_files: dict[str, bytes] = {}
        self.writer: Any = None
        """TensorBoard's SummaryWriter with ``log_tensorboard``."""

    # ----- checkpoints -----------------------------------------------------------------

    def controller_state(self, iterations_done: int) -> dict[str, Any]:
        ctx = self.workers.ctx
        return {"iterations_done": iterations_done,
                "generator": ctx.generator.get_state().tolist(),
                "multiplier": ctx.multiplier,
                "data_position": self.task.cursor.state if self.job.data is not None
                else None,
                **self.ledger.state(),
                "plan": self.plan.to_value(), "roles": self.trained,
                "seconds": time.time() - self.started_at}

    def save_checkpoint(self, iterations_done: int) -> Path:
        """Every trained role's state and the controller's, renamed into place whole."""
        record = self.store.write(
            iterations_done, lambda directory: self.workers.save_roles(self.trained, directory),
            self.controller_state(iterations_done))
        self.ledger.checkpoints_written.append(record)
        self.write_records()
        return Path(record["path"])

    def restore(self, directory: Path) -> int:
        """Every trained role's state and the controller's from ``directory``; returns the
        iterations it had done."""
        import torch

        state = self.store.read(directory, self.plan.to_value())
        self.workers.load_roles(self.trained, directory)
        ctx = self.workers.ctx
        ctx.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        ctx.multiplier = state.get("multiplier", ctx.multiplier)
        if self.job.data is not None and state.get("data_position"):
            self.task.cursor.restore(state["data_position"])
        self.ledger.restore(state)
        return int(state["iterations_done"])

    # ----- records ---------------------------------------------------------------------

    def run_meta(self, seconds: float) -> dict[str, Any]:
        import torch

        options, job, task, ledger = self.options, self.job, self.task, self.ledger
        return {"plan": self.plan.to_value(), "job": job.to_value(), "mode": self.plan.mode,
                "options": {**options.to_saved(), "checkpoints": dict(self.checkpoints)},
                **({"data": {"data": to_mapping(job.data),
                             "tokenizer": task.tokenizer_directory,
                             "train_prompts": len(task.train),
                             "dropped": task.train.dropped,
                             "truncated": task.train.truncated}}
                   if job.data is not None else {}),
                "reward_warmup_losses": ledger.reward_warmup_losses,
                "cost_warmup_losses": ledger.cost_warmup_losses,
                **({"data_position": task.cursor.state} if job.data is not None else {}),
                "checkpoints_written": ledger.checkpoints_written,
                "restarts": ledger.restarts,
                **({"resumed_from": str(self.resume_from)} if self.resume_from else {}),
                "versions": versions(), "machine": machine(), "seconds": seconds,
                **(self.workers.run_meta() if self.workers is not None else {}),
                "ray_address": options.address or (
                    "local" if torch.cuda.device_count() else "local (virtual GPUs)")}

    def write_records(self, **extra: Any) -> None:
        if self.options.out is None:
            return
        meta = self.run_meta(time.time() - self.started_at)
        meta.update(extra)
        write_run(self.options.out, self.ledger.rows, self.ledger.metrics, meta, self.plan)

    def fail(self, failure: Exception, iteration: int) -> NoReturn:
        """Write the records of the finished iterations and raise RunFailedError."""
        self.workers.kill = isinstance(failure, WorkerFailedError)
        where = ""
        if self.options.out is not None:
            detail = ({"iteration": iteration, "operation": failure.operation,
                       "set": failure.location, "rank": failure.rank, "cause": failure.cause}
                      if isinstance(failure, WorkerFailedError) else
                      # The user's reward function runs on the controller.
                      {"iteration": iteration, "operation": "reward function",
                       "set": "controller", "rank": None, "cause": str(failure)})
            self.write_records(failure=detail)
            where = (f"; records of the {self.ledger.finished} finished iteration(s) in "
                     f"{self.options.out}")
        raise RunFailedError(f"{failure}{where}") from None

    # ----- the run ---------------------------------------------------------------------

    def run(self) -> RunResult:
        options = self.options
        ray, started_ray = _start_ray(self.plan, options.address, options.worker_logs)
        self.workers = RunWorkers(ray, self.job, self.plan, self.configs)
        try:
            try:
                return self._run()
            except WorkerFailedError:
                # Failed outside an iteration (warm-up, restore, a restart): the same as in one.
                self.workers.kill = True
                raise
            except KeyboardInterrupt:
                # Ranks may be inside a call (or a collective): kill them, do not wait.
                self.workers.kill = True
                kept = f"{self.ledger.finished} finished iteration(s)"
                where = ""
                if options.out is not None:
                    self.write_records(interrupted={"after_iterations": self.ledger.finished,
                                                    "at": time.time()})
                    where = f" in {options.out}"
                last = f"; last checkpoint {self.store.last}" if self.store.last else ""
                raise RunInterruptedError(f"interrupted: the records of {kept} are kept"
                                          f"{where}{last}") from None
        finally:
            self.workers.stop()
            if started_ray:
                ray.shutdown()

    def _say_start(self) -> None:
        job = self.job
        self.say(f"starting {plan_gpus(self.plan)} workers in {len(self.plan.sets)} "
                 "colocated set(s)"
                 + (f" and a rollout set ({self.plan.mode})" if self.plan.rollout else ""))
        if job.framework_profile.offload.params:
            self.say(f"the {job.framework} profile also offloads parameters; the executor "
                     "keeps them on the GPUs (it offloads optimizer states and gradients)")

    def _say_data(self) -> None:
        task = self.task
        self.say(f"data: {len(task.train)} training prompts"
                 + (f", {len(task.val)} held out" if task.val else "")
                 + f" (longest {task.prompt_length} tokens"
                 + (f"; {task.train.dropped} longer ones left out"
                    if task.train.dropped else "")
                 + (f"; {task.train.truncated} truncated" if task.train.truncated else "")
                 + f"), tokenizer {task.tokenizer_directory}")

    def _run(self) -> RunResult:
        options, job = self.options, self.job
        self._say_start()
        self.workers.start(options, self.task)
        if self.workers.node_map.shared_machine:
            self.say("the plan's nodes all run on this machine's one Ray node (a local run: "
                     "its node layout is not reproduced)")
        if job.data is not None:
            self._say_data()
        if self.resume_from is not None:
            first = self.restore(self.resume_from)
            self.say(f"resumed from {self.resume_from} after iteration {first}")
        else:
            self.warm_up()
            first = 0
        self.tokenizer_files = hf_tokenizer_files(self.task) if job.data is not None else {}
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
        self._export_at_the_end()
        if self.writer is not None:
            self.writer.close()
        seconds = time.time() - self.started_at
        self.write_records()
        return RunResult(rows=self.ledger.rows, metrics=self.ledger.metrics, out=options.out,
                         seconds=seconds)

    def _export_at_the_end(self) -> None:
        options = self.options
        if options.save_hf is None and options.save_hf_critic is None:
            return
        try:
            self.save_hf_checkpoints()
        except WorkerFailedError as failure:
            self.fail(failure, self.ledger.finished)
        for role, directory in (("actor", options.save_hf),
                                ("critic", options.save_hf_critic)):
            if directory is not None:
                self.say(f"{role} written as a Hugging Face checkpoint to {directory}")

    def warm_up(self) -> None:
        """Fit the reward (and cost) models to the built-in task's rules before RL."""
        ctx, options, work = self.workers.ctx, self.options, self.job.workload
        if ctx.reward_from_model and options.reward_warmup_steps > 0 and self.task.has_rule:
            losses = fit_reward_model(ctx, options.reward_warmup_steps,
                                      work.prompts_per_iteration)
            self.ledger.reward_warmup_losses = losses
            self.say(f"reward model fitted to the rule: loss {losses[0]:.4f} -> "
                     f"{losses[-1]:.4f}")
        if ctx.cost_from_model and options.reward_warmup_steps > 0 and self.task.has_rule:
            losses = fit_reward_model(ctx, options.reward_warmup_steps,
                                      work.prompts_per_iteration, role="cost")
            self.ledger.cost_warmup_losses = losses
            self.say(f"cost model fitted to the rule: loss {losses[0]:.4f} -> "
                     f"{losses[-1]:.4f}")
        self.workers.records.clear()

    def held_out(self) -> Any:
        work = self.job.workload
        if self.job.data is None:
            return self.task.held_out_batch(work.prompts_per_iteration, self.options.seed)
        return self.task.held_out_batch(work.prompts_per_iteration)

    def iterate(self, iteration: int) -> bool:
        """One iteration, its records, and what follows it (a checkpoint, a validation, a
        Hugging Face export); False when the data is used up."""
        options, plan, workers = self.options, self.plan, self.workers
        workers.records.clear()
        start = time.time()
        position = self.task.cursor.state if self.job.data is not None else None
        try:
            summary = run_iteration(workers.ctx, self.job.algorithm, iteration)
        except DataExhaustedError as exhausted:
            self.say(f"{exhausted}: the run ends after {iteration} iteration(s)")
            return False
        end = time.time()
        rows = measurement_rows(list(workers.records), iteration, plan, self.started_at,
                                self.backends)
        tokens = sum(r.tokens for r in workers.records if r.operation == "generate")
        rows.append({"iteration": iteration, "node": "iteration", "role": "controller",
                     "operation": "iteration", "location": -1, "set": "controller",
                     "gpus": plan_gpus(plan), "parallel": plan.placement,
                     "sequences": 0, "tokens": tokens,
                     "start_seconds": start - self.started_at,
                     "end_seconds": end - self.started_at,
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
            metric.update(validation_scores(workers.ctx, self.held_out(), iteration))
        self.ledger.finish_iteration(rows, metric)
        self._log_scalars(metric, iteration)
        if options.checkpoint_every and options.out is not None and \
                ((iteration + 1) % options.checkpoint_every == 0
                 or iteration + 1 == options.steps):
            self.save_checkpoint(iteration + 1)
        self._say_iteration(iteration, end - start, summary, metric)
        return True

    def _log_scalars(self, metric: dict[str, Any], iteration: int) -> None:
        """The iteration's numbers to TensorBoard, when it is on."""
        if self.writer is None:
            return
        for name, value in metric.items():
            if isinstance(value, (int, float)) and name != "iteration":
                self.writer.add_scalar(name, value, iteration)
        self.writer.flush()

    def _say_iteration(self, iteration: int, seconds: float, summary: dict[str, Any],
                       metric: dict[str, Any]) -> None:
        steps = self.options.steps
        constraint = (f", cost {summary['rule_cost']:.2f}, lambda {summary['lambda']:.3f}"
                      if "lambda" in summary else "")
        done = self.ledger.finished
        remaining = (time.time() - self.started_at) / max(done, 1) * (steps - iteration - 1)
        validation = (f", validation {metric['val_score']:.3f}"
                      if "val_score" in metric else "")
        self.say(f"iteration {iteration + 1}/{steps}: {seconds:.2f} s, score "
                 f"{summary['rule_score']:.3f}, solved {summary['solved']:.2f}{constraint}"
                 f"{validation}"
                 f"{f', about {remaining:.0f} s to go' if remaining >= 1 else ''}")

    def recover(self, failure: Exception, iteration: int) -> int:
        """After a worker failed in ``iteration``: restart the worker groups from the last
        checkpoint (or the start) and return the iteration to run next; or, when the
        restarts are used up, write the records and fail."""
        restarts = self.ledger.restarts
        if len(restarts) >= self.options.max_restarts:
            if restarts:
                self.say(f"a worker failed again after {len(restarts)} restart(s)")
            self.fail(failure, iteration)
        detected = time.time()
        checkpoint = self.store.last
        self.say(f"worker failure in iteration {iteration + 1}: {failure}; restarting the "
                 f"workers from {checkpoint or 'the start'}")
        self.workers.kill = True
        self.workers.stop()
        self.workers.kill = False
        self.workers.start(self.options, self.task)
        if checkpoint is not None:
            restored = self.restore(checkpoint)
        else:  # no checkpoint yet: the run starts over, as a fresh run would
            restored = 0
            self.ledger.start_over()
            self.warm_up()
            if self.job.data is not None:
                self.task.cursor.restore({**self.task.cursor.state, "epoch": 0, "offset": 0})
        restart_seconds = time.time() - detected
        restarts.append({
            "iteration": iteration, "cause": str(failure),
            "restored_to_iteration": restored,
            "checkpoint": str(checkpoint) if checkpoint else None,
            # The work since the checkpoint is done again, plus the restart itself.
            "seconds_lost": self.store.restarted(),
            "restart_seconds": restart_seconds})
        self.write_records()
        return restored

    def save_hf_checkpoints(self) -> None:
        """The actor (and the critic when asked) as Hugging Face checkpoints, with the
        tokenizer the prompts were tokenized with."""
        from executor.batch import Batch

        for role, directory in (("actor", self.options.save_hf),
                                ("critic", self.options.save_hf_critic)):
            if directory is not None:
                self.workers.handles[role].save_hf(Batch(meta={
                    "directory": str(directory), "files": self.tokenizer_files})).result()
        self.workers.records.clear()


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
