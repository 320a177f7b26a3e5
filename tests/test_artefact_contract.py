"""One contract for every plan the tool writes (issue 29): whatever job it came from (any
algorithm, mode, framework, cluster kind, dense or MoE), a plan file

- is written with its report, and the report renders it;
- is reproduced exactly by ``simulate`` (the same predicted seconds);
- exports to every framework, or is refused in one line naming a key;
- exports to the job's own framework (the planner searched that framework's space);
- is checked by ``execute --dry-run`` without starting a worker: it runs, or is refused in
  one line naming a key.

Random jobs are drawn with hypothesis (``HYBRIDFLOW_CONTRACT_EXAMPLES`` raises the count to
hunt for bugs; CI runs a fixed, derandomized set). The commands run in-process, as the CLI
calls them; one job also walks them through the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from profiles.datafile import SpecError
from tests.conftest import ROOT, run_cli

CONTRACT_EXAMPLES = int(os.environ.get("HYBRIDFLOW_CONTRACT_EXAMPLES", "14"))
"""Random jobs per suite run."""

TARGETS = ("verl", "openrlhf", "nemo-rl")
ALGORITHMS = {"verl": ["ppo", "grpo", "grpo", "remax"], "openrlhf": ["ppo", "grpo"],
              "nemo-rl": ["grpo"], "hybridflow": ["ppo", "grpo", "remax", "safe-rlhf"]}
"""Each framework's trainers (its profile's space.algorithms; a job asking another is refused
before any plan, a path the CLI tests cover)."""
DENSE = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama2-7b", "llama3-8b"]


@st.composite
def feasible_jobs(draw: st.DrawFn) -> dict:
    """Jobs a user would plan: mostly ones that fit, in every mode and framework, some on a
    mixed cluster, some MoE, some without a KL term."""
    framework = draw(st.sampled_from(["verl", "openrlhf", "nemo-rl", "hybridflow"]))
    algorithm = draw(st.sampled_from(ALGORITHMS[framework]))
    moe = draw(st.integers(0, 5)) == 0
    actor = "qwen3-30b-a3b" if moe else draw(st.sampled_from(DENSE))
    models: dict = {"actor": actor, "ref": actor}
    if algorithm in ("ppo", "safe-rlhf"):
        models["critic"] = draw(st.sampled_from(DENSE[:3]))
        models["reward"] = models["critic"]
        if algorithm == "safe-rlhf":
            models["cost"] = models["critic"]
    else:
        models["reward"] = "rule" if draw(st.booleans()) else draw(st.sampled_from(DENSE[:2]))
    device = draw(st.sampled_from(["h100-80gb", "a100-80gb"]))
    nodes = draw(st.sampled_from([1, 2, 4])) if not moe else draw(st.sampled_from([2, 4]))
    cluster: dict = {"nodes": nodes, "gpus_per_node": 8, "device": device}
    if draw(st.integers(0, 6)) == 0:
        cluster = {"node_groups": [cluster, {"nodes": 1, "gpus_per_node": 8,
                                             "device": "h20"}]}
    samples = draw(st.sampled_from([4, 8])) if algorithm == "grpo" else 1
    job: dict = {
        "algorithm": algorithm, "framework": framework, "models": models, "cluster": cluster,
        "mode": draw(st.sampled_from(["sync", "one_step_off", "async", "auto"])),
        "workload": {
            "prompts_per_iteration": draw(st.sampled_from([64, 128, 256, 512])),
            "samples_per_prompt": samples,
            "prompt_length": draw(st.sampled_from([256, 1024])),
            "response_length": draw(st.sampled_from([
                512, {"distribution": "lognormal", "median": 600, "sigma": 0.7, "max": 2048}])),
            "mini_batches_per_epoch": draw(st.sampled_from([1, 2, 4])),
        },
    }
    if algorithm == "grpo" and draw(st.booleans()):
        job["kl"] = "none"
        del models["ref"]
    return job


def one_line(exc: SpecError) -> None:
    assert str(exc) and "\n" not in str(exc), str(exc)
    assert exc.key, f"the refusal names no key: {exc}"


def walk_plan(job, plan_file: Path, commands: dict[str, int]) -> None:
    """Every command on one plan file (written by plan or compare)."""
    from executor.run import ExecutionOptions
    from executor.session import check_plan
    from planner.export import export_files
    from simulator.engine import simulate
    from simulator.plan import load_plan

    plan = load_plan(plan_file)
    predicted = plan.predicted["iteration_seconds"]
    simulated = simulate(job, plan)
    commands["simulate"] += 1
    assert simulated.feasible, simulated.reasons
    assert simulated.iteration_seconds == pytest.approx(predicted, rel=1e-9), \
        f"simulate gives {simulated.iteration_seconds} s; the plan says {predicted} s"
    for target in TARGETS:
        commands["export"] += 1
        try:
            files = export_files(plan, job, target)
        except SpecError as exc:
            one_line(exc)
            # The plan of a framework's own search always exports to it; the job may still
            # lack something the framework needs to run (e.g. OpenRLHF's reward file).
            assert target != job.framework_profile.name or exc.key.startswith("job."), \
                f"a {target} plan does not export to {target}: {exc}"
            event(f"export to {target}: refused")
            continue
        assert files
    commands["execute --dry-run"] += 1
    try:
        check_plan(job, plan, ExecutionOptions(steps=1))
        event("execute --dry-run: runs")
    except SpecError as exc:
        one_line(exc)
        event("execute --dry-run: refused")


COMMANDS: dict[str, int] = {"plan": 0, "report": 0, "simulate": 0, "export": 0,
                            "execute --dry-run": 0}
"""Commands run over the suite (printed with -s)."""


@settings(max_examples=CONTRACT_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(mapping=feasible_jobs())
def test_every_plan_file_works_with_every_command(mapping: dict) -> None:
    from planner.planning import plan_job
    from planner.report import write_plan_report
    from simulator.plan import job_as_planned
    from simulator.specs.job import job_from_mapping

    try:
        job = job_from_mapping(mapping, source="job.yaml")
    except SpecError as exc:  # e.g. a framework that does not run this algorithm
        one_line(exc)
        event(f"job refused: {exc.key}: {exc.problem[:60]}")
        return
    COMMANDS["plan"] += 1
    try:
        result = plan_job(job)
    except SpecError as exc:
        one_line(exc)
        event(f"plan refused: {exc.key}: {exc.problem[:60]}")
        return
    if result.best is None:
        assert result.infeasible_reason
        event("does not fit")
        return
    with tempfile.TemporaryDirectory() as tmp:
        files = write_plan_report(result, tmp)
        COMMANDS["report"] += 1
        html = (Path(tmp) / "report.html").read_text(encoding="utf-8")
        assert result.best.plan.placement in html
        assert files.plan is not None
        plans = [Path(files.plan)]
        # The best plan of each mode (the report's modes table) as compare would write it.
        for i, outcome in enumerate(result.modes):
            if outcome.result is not None:
                path = Path(tmp) / f"mode-{i}.json"
                outcome.result.plan.save(path)
                plans.append(path)
        for path in plans:
            from simulator.plan import load_plan

            walk_plan(job_as_planned(job, load_plan(path)), path, COMMANDS)
    event(f"mode {result.best.plan.mode}")


def test_an_asynchronous_plan_walks_through_the_cli(tmp_path: Path) -> None:
    """The CLI on the documented path that crashed: plan an asynchronous job, simulate its
    plan (the same seconds), export it, dry-run it."""
    job = tmp_path / "job.yaml"
    job.write_text((ROOT / "planner/examples/grpo-qwen-rule.yaml").read_text()
                   + "mode: one_step_off\n")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(list(args), cwd=tmp_path)

    planned = cli("plan", "--config", str(job), "--out", "rep", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads((tmp_path / "rep/plan.json").read_text())
    assert plan["mode"] == "one_step_off"
    simulated = cli("simulate", "--plan", "rep/plan.json", "--json")
    assert simulated.returncode == 0, simulated.stderr
    assert json.loads(simulated.stdout)["iteration_seconds"] == pytest.approx(
        plan["predicted"]["iteration_seconds"], rel=1e-9)
    exported = cli("export", "rep/plan.json", "--to", "verl", "--out", "v")
    assert exported.returncode == 0, exported.stderr
    checked = cli("execute", "rep/plan.json", "--dry-run")
    assert checked.returncode in (0, 2) and "internal error" not in checked.stderr, \
        checked.stderr
    assert not (tmp_path / "runs").exists()
