"""A run's workers as the controller sees them: the Ray worker groups of the plan's sets (and
of a one-step-off plan's rollout set), the roles built in them, the role handles the drivers
call, the drivers' context, and the records those calls leave. Started at the beginning of a
run and again after a worker failure; stopped gracefully, or killed when a rank may be stuck
in a collective."""

from __future__ import annotations

from typing import Any

import torch

from executor.batch import Batch
from executor.controller import RoleHandle, WorkerGroup
from executor.drivers import Context, sync_weights
from executor.placement import gpu_nodes, map_plan_nodes
from executor.protocols import RankLayout
from executor.reward_function import load_reward_function
from simulator.plan import Plan
from simulator.specs.job import JobSpec

NODE_NAMES = {"generate": "generate", "values": "infer", "log_probs": "infer",
              "scores": "infer", "update": "train"}
"""Each role method's node in the plan's dataflow (``role.operation``)."""


class RunWorkers:
    """The worker groups of one run on ``ray`` (a module, or a stand-in in tests)."""

    def __init__(self, ray: Any, job: JobSpec, plan: Plan, configs: dict[str, Any]):
        self.ray = ray
        self.job = job
        self.plan = plan
        self.configs = configs
        self.groups: list[Any] = []
        self.handles: dict[str, Any] = {}
        self.records: list[Any] = []
        """The calls' records since the last ``records.clear()`` (an iteration's)."""
        self.ctx: Any = None
        self.node_map: Any = None
        self.worker_code: dict[str, Any] = {}
        self.kill = False
        """Set when a worker failed or the run was interrupted: the workers are then killed,
        not asked to stop, since a rank may wait in a collective (with a failed peer) for its
        whole timeout."""

    def start(self, options: Any, task: Any) -> None:
        """Worker groups, roles built, role handles and the drivers' context."""
        job, plan = self.job, self.plan
        self.node_map = map_plan_nodes(plan, job.cluster.gpus_per_node,
                                       gpu_nodes(self.ray.nodes()),
                                       local=options.address is None)
        # The training sets, then the rollout set of a one-step-off plan: every group's
        # workers are asked for before any is waited for, so that their processes start
        # (and their models build) side by side, not one set after another.
        for i, s in enumerate(plan.located_sets()):
            self.groups.append(WorkerGroup(self.ray, i, s, options.worker_setup,
                                           self.node_map.bundle_nodes(
                                               plan, i, job.cluster.gpus_per_node),
                                           form=False))
        for group in self.groups:
            group.form()
        self.worker_code = self.ray.get(self.groups[0].workers[0].code_location.remote())
        self._check_tensor_parallel_groups()
        self.ray.get([ref for group in self.groups for role in group.colocated.roles
                      for ref in group.start_build(self.configs[role])])
        self.records = []
        self.handles = self._role_handles()
        work = job.workload
        self.ctx = Context(handles=self.handles, task=task, rl=self.configs["actor"].rl,
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
        if "rollout" in self.handles:
            self._form_weight_sync()
            self.sync_rollout()

    def _check_tensor_parallel_groups(self) -> None:
        """Every tensor-parallel group (training, and the rollout's generation) on one
        node."""
        plan = self.plan
        for role in self.job.gpu_roles:
            tp = plan.roles[role].parallel.tp
            if tp > 1:
                self.groups[plan.set_index(role)].check_groups_share_nodes(
                    tp, f"{role}'s tp={tp}")
        generation = plan.roles["actor"].generation if plan.rollout else None
        if generation is not None and generation.tp > 1:
            self.groups[-1].check_groups_share_nodes(
                generation.tp, f"the rollout's generation tp={generation.tp}")

    def _role_handles(self) -> dict[str, Any]:
        plan = self.plan
        handles: dict[str, Any] = {}
        for role in self.job.gpu_roles:
            rp = plan.roles[role]
            layout = RankLayout(world=rp.parallel.world_size, dp=rp.parallel.dp,
                                tp=rp.parallel.tp, pp=rp.parallel.pp,
                                gen_tp=rp.generation.tp if rp.generation else 1)
            names = {m: f"{role}.{op}" for m, op in NODE_NAMES.items()}
            handles[role] = RoleHandle(self.groups[plan.set_index(role)], role, layout,
                                       self.records.append, names)
        generation = plan.roles["actor"].generation if plan.rollout else None
        if generation is not None:
            gpus, tp = self.groups[-1].colocated.gpus, generation.tp
            # Whole generation replicas: micro-DP is one replica per tp group.
            handles["rollout"] = RoleHandle(
                self.groups[-1], "rollout", RankLayout(world=gpus, dp=gpus // tp, tp=tp,
                                                       gen_tp=tp),
                self.records.append, {m: f"actor.{op}" for m, op in NODE_NAMES.items()},
                label="actor")
        return handles

    def _form_weight_sync(self) -> None:
        """The sync group: the trainer actor's rank 0 and every rollout rank, over a store on
        that rank 0 (``executor.weight_sync``)."""
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
        sync_weights(self.ctx)
        self.records.clear()

    def stop(self) -> None:
        """Stop every group: gracefully, or killed after a failure or an interrupt."""
        for group in self.groups:
            group.shutdown(graceful=not self.kill)
        self.groups = []

    def save_roles(self, roles: list[str], directory: Any) -> float:
        """Every role in ``roles`` writes its state under ``directory / role``; the bytes
        written, summed over ranks."""
        pending = [self.handles[role].save_checkpoint(
            Batch(meta={"directory": str(directory / role)}), node=f"{role}.checkpoint")
            for role in roles]
        written = sum(p.result().meta.get("bytes", 0.0) for p in pending)
        self.records.clear()  # checkpoint calls are not stages of an iteration
        return written

    def load_roles(self, roles: list[str], directory: Any) -> None:
        """Every role in ``roles`` reads its state from ``directory / role`` (and the rollout
        set gets the restored weights)."""
        pending = [self.handles[role].load_checkpoint(
            Batch(meta={"directory": str(directory / role)}), node=f"{role}.restore")
            for role in roles]
        for call in pending:
            call.result()
        if "rollout" in self.handles:
            self.sync_rollout()
        self.records.clear()

    def run_meta(self) -> dict[str, Any]:
        """Where the workers ran, for the run's meta.json."""
        return {"worker_code": self.worker_code,
                "node_map": {str(k): n.node_id for k, n in self.node_map.nodes.items()}
                if self.node_map is not None else {},
                "worker_nodes": [group.nodes for group in self.groups],
                "clock_offsets_seconds": [
                    [{"offset": o, "uncertainty": u} for o, u in group.clock_offsets]
                    for group in self.groups]}
