"""``hybridflow plan`` and ``hybridflow compare``: the search, its report and the sizes compared."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from profiles.datafile import SpecError

if TYPE_CHECKING:
    pass
from planner.cli.common import (
    EXIT_DOES_NOT_FIT,
    _about,
    _checked,
    _emit_json,
    _load_job,
    _load_plan_and_job,
    cli,
)


def _number_list(text: str, parse: Any, flag: str) -> tuple:
    try:
        values = tuple(parse(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecError(f"expected comma-separated numbers, got {text!r}", key=flag) from None
    return values


def _search_options(top: int, backend: str, micro_batches: str, max_num_seqs: str = "",
                    memory_utilization: str = "", objective: str = "throughput",
                    pay_for: str = "cluster", deadline: float | None = None,
                    deadline_without_objective: bool = False) -> Any:
    from planner.objective import Ranking
    from planner.search import SearchOptions
    from planner.space import SpaceOptions

    flags = {"objective": "--objective", "pay_for": "--pay-for",
             "deadline_seconds_per_iteration": "--deadline-seconds-per-iteration"}
    try:
        ranking = Ranking(objective=objective, pay_for=pay_for,  # type: ignore[arg-type]
                          deadline_seconds_per_iteration=deadline)
    except SpecError as exc:
        raise SpecError(exc.problem, key=flags.get(exc.key or "", exc.key)) from None
    if deadline is not None and objective != "cost-at-deadline" and \
            not deadline_without_objective:
        raise SpecError("a deadline ranks plans only with --objective cost-at-deadline",
                        key="--deadline-seconds-per-iteration")

    sizes = _number_list(micro_batches, int, "--micro-batches")
    if not sizes or min(sizes) < 1:
        raise SpecError("give at least one positive integer", key="--micro-batches")
    caps = _number_list(max_num_seqs, int, "--max-num-seqs")
    if caps and min(caps) < 1:
        raise SpecError("running-batch caps must be positive integers", key="--max-num-seqs")
    fractions = _number_list(memory_utilization, float, "--gpu-memory-utilization")
    if fractions and not all(0 < f <= 1 for f in fractions):
        raise SpecError("fractions must be in (0, 1]", key="--gpu-memory-utilization")
    return SearchOptions(top_k=top, ranking=ranking, space=SpaceOptions(
        backend=backend, micro_batches=sizes, max_num_seqs=caps,  # type: ignore[arg-type]
        memory_utilization=fractions))


def _resized(job: Any, gpus: int | None, source: str | None) -> Any:
    if gpus is None:
        return job
    try:
        return job.with_cluster(job.cluster.with_total_gpus(gpus))
    except SpecError as exc:
        # On a mixed cluster the sizes that work depend on the job's groups: name its file.
        where = None if job.cluster.is_homogeneous else (source or "the default job")
        raise SpecError(exc.problem, key="--gpus", source=where) from None


def _search_flags(f: Any) -> Any:
    f = click.option("--deadline-seconds-per-iteration", "deadline", type=float, default=None,
                     help="With --objective cost-at-deadline: the slowest iteration allowed, "
                          "in seconds (compare: also reports the cheapest cluster size that "
                          "meets it).")(f)
    f = click.option("--pay-for", "pay_for", type=click.Choice(["cluster", "used"]),
                     default="cluster", show_default=True,
                     help="Dollars count every GPU of the cluster (unused ones too), or only "
                          "the GPUs the plan uses.")(f)
    f = click.option("--objective", type=click.Choice(["throughput", "cost",
                                                       "cost-at-deadline"]),
                     default="throughput", show_default=True,
                     help="Rank plans by tokens per second, by tokens per dollar (fewest "
                          "dollars per iteration), or by dollars among the plans that meet "
                          "--deadline-seconds-per-iteration. Prices: the device profiles' "
                          "price_per_gpu_hour or the job's node groups'.")(f)
    f = click.option("--gpu-memory-utilization", "memory_utilization", default="",
                     help="Rollout gpu_memory_utilization values to try beside the framework's "
                          "default, e.g. 0.5,0.7,0.9.")(f)
    f = click.option("--max-num-seqs", "max_num_seqs", default="",
                     help="Rollout running-batch caps to try beside the framework's default, "
                          "e.g. 256,1024.")(f)
    f = click.option("--micro-batches", default="1,2,4", show_default=True,
                     help="Training micro-batch sizes to try (sequences per GPU).")(f)
    f = click.option("--backend", type=click.Choice(["any", "megatron", "fsdp", "simulated"]),
                     default="any", show_default=True,
                     help="Layouts to search: any = what the installed executor backends run "
                          "(torch FSDP2, and Megatron-core when installed); megatron or fsdp "
                          "alone; simulated = every layout the simulator prices, executable "
                          "or not (e.g. generation pp > 1).")(f)
    return click.option("--top", "top", type=click.IntRange(min=1), default=5,
                        show_default=True, help="Plans to keep in the ranking.")(f)


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Job YAML (default: the job stored in --plan, else the HybridFlow paper's "
                   "PPO 7B job on 16 A100s).")
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="Resize the job's cluster to this many GPUs.")
@click.option("--out", type=click.Path(file_okay=False), default="hybridflow-report",
              show_default=True, help="Directory for the plan and the report.")
@click.option("--placement", default=None,
              help='Evaluate only this placement, e.g. "actor,ref|critic,reward".')
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="Evaluate this plan file (with the standard strategies beside it).")
@click.option("--baseline", "baseline_path", type=click.Path(dir_okay=False), default=None,
              help="A plan you already run (e.g. from `hybridflow import`): search, then show "
                   "what the best plan saves against it and why (its job is the job to plan "
                   "unless --config gives one).")
@_search_flags
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def plan(config: str | None, gpus: int | None, out: str, placement: str | None,
         plan_path: str | None, baseline_path: str | None, top: int, backend: str,
         micro_batches: str, max_num_seqs: str, memory_utilization: str, objective: str,
         pay_for: str, deadline: float | None, as_json: bool) -> None:
    """Search the best placement and parallel configs; write the plan and a report."""
    from planner.background import Background
    from planner.planning import with_confidence
    from planner.progress import SearchProgress
    from simulator.plan import parse_placement

    if placement and plan_path:
        raise SpecError("give --placement or --plan, not both", key="--placement")
    if baseline_path and plan_path:
        raise SpecError("give --plan (evaluate it) or --baseline (search and compare), not "
                        "both", key="--baseline")
    given = baseline = None
    if plan_path:
        given, job = _load_plan_and_job(plan_path, config)
        job = _resized(job, gpus, config or plan_path)
        _checked(given, job, plan_path)
    elif baseline_path:
        if gpus is not None:
            raise SpecError("the baseline runs on its own cluster; leave out --gpus",
                            key="--gpus")
        baseline, job = _load_plan_and_job(baseline_path, config, require_job=True)
        _checked(baseline, job, baseline_path)
    else:
        job = _resized(_load_job(config), gpus, config)
    options = _search_options(top, backend, micro_batches, max_num_seqs, memory_utilization,
                              objective, pay_for, deadline)
    pinned = None
    if placement:
        try:
            groups = parse_placement(placement, job.gpu_roles)
        except SpecError as exc:
            raise SpecError(exc.problem, key="--placement") from None
        pinned = tuple(tuple(r for r in job.gpu_roles if r in g) for g in groups)
    from planner.provenance import stale_calibration

    for profile in {p.name: p for p in job.cluster.profiles()}.values():
        stale = stale_calibration(profile)
        if stale:
            click.echo(f"hybridflow: warning: {stale}", err=True)
    progress = SearchProgress(enabled=not as_json)
    with Background(_searched, job, options, pinned, given, progress) as searching:
        # The report's libraries (matplotlib, pandas: about a second) load here while the
        # search runs in a child process, where a second core is free; the confidence reads
        # the validation table, which needs pandas too.
        from planner.report import plan_json, write_plan_report

        with _about(config or plan_path):
            result = with_confidence(searching.result(), options.ranking)
    from planner.sanity import plan_warnings

    warnings = plan_warnings(result.job, result.best)
    for warning in warnings:
        click.echo(f"hybridflow: warning: {warning}", err=True)
    files = write_plan_report(result, out)
    comparison = None
    if baseline is not None:
        from planner.baseline import compare_with_baseline

        with _about(baseline_path):
            comparison = compare_with_baseline(job, baseline, result.best)
    if as_json:
        summary = {**plan_json(result), "warnings": warnings}
        if comparison is not None:
            summary["baseline"] = comparison.to_value()
        _emit_json(summary)
    else:
        _print_plan(result, files)
        if comparison is not None:
            click.echo(f"against the baseline ({baseline_path}):")
            for line in comparison.lines():
                click.echo(f"  {line}")
    if result.best is None:
        if not as_json:
            click.echo(f"does not fit: {result.infeasible_reason}", err=True)
        sys.exit(EXIT_DOES_NOT_FIT)


def _searched(job: Any, options: Any, pinned: Any, given: Any, progress: Any) -> Any:
    """``search_plans``, its progress line ended in the process that drew it."""
    from planner.planning import search_plans

    try:
        return search_plans(job, options, pinned=pinned, given=given, progress=progress)
    finally:
        progress.close()


def _print_plan(result: Any, files: Any) -> None:
    from planner.report import gpus_label

    job = result.job
    click.echo(f"{job.algorithm.upper()} on {job.cluster.describe()}: searched in "
               f"{result.search_seconds:.2f} s "
               f"({result.stats.candidates_evaluated} candidates)")
    rows = []
    if result.best is not None:
        rows.append((result.best.plan.strategy, result.best))
    rows += [(s.name, s.result) for s in result.strategies]
    width = max([12] + [len(gpus_label(e, job)) + 1 for _, e in rows if e is not None])
    dollars = any(e is not None and e.dollars_per_iteration is not None for _, e in rows)
    click.echo(f"  {'strategy':<11} {'placement':<28} {'GPUs':<{width}} {'s/iter':>9} "
               f"{'tokens/s':>10}" + (f" {'$/iter':>9} {'tokens/$':>11}" if dollars else ""))
    for name, evaluated in rows:
        if evaluated is None:
            outcome = next(s for s in result.strategies if s.name == name)
            click.echo(f"  {name:<11} {outcome.placement:<28} {'-':<{width}} {'-':>9} "
                       f"{'-':>10}  ({outcome.reason})")
            continue
        gpus = gpus_label(evaluated, job)
        cost = ""
        if dollars and evaluated.dollars_per_iteration is not None:
            cost = (f" {evaluated.dollars_per_iteration:>9,.2f} "
                    f"{evaluated.tokens_per_dollar or 0:>11,.0f}")
        click.echo(f"  {name:<11} {evaluated.plan.placement:<28} {gpus:<{width}} "
                   f"{evaluated.iteration_seconds:>9.2f} "
                   f"{evaluated.throughput_tokens_per_s:>10,.0f}{cost}")
    if result.modes:
        click.echo("modes (best plan of each; asynchronous ones at their steady state):")
        click.echo(f"  {'mode':<14} {'staleness':>9} {'GPUs':<{width}} {'s/iter':>9} "
                   f"{'tokens/s':>10}  allowed")
        for m in result.modes:
            e = m.result
            if e is None:
                click.echo(f"  {m.name:<14} {m.staleness:>9} {'-':<{width}} {'-':>9} "
                           f"{'-':>10}  ({m.reason})")
                continue
            click.echo(f"  {m.name:<14} {m.staleness:>9} {gpus_label(e, job):<{width}} "
                       f"{e.iteration_seconds:>9.2f} {e.throughput_tokens_per_s:>10,.0f}  "
                       f"{'yes' if m.allowed else 'no (set mode: auto to allow)'}")
    if result.best is not None:
        click.echo(f"best plan: {result.best.plan.describe(job)}")
    if result.confidence is not None:
        for line in result.confidence.lines():
            click.echo(line)
    click.echo(f"report: {files.report_html} (also report.md, plan.json, ranking.csv, "
               "strategies.csv, PNG figures)")


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Job YAML (default: the HybridFlow paper's PPO 7B job).")
@click.option("--gpus", "gpu_list", required=True,
              help="Cluster sizes to compare, e.g. 16,32,64,96,128.")
@click.option("--out", type=click.Path(file_okay=False), default="hybridflow-compare",
              show_default=True)
@_search_flags
@click.option("--json", "as_json", is_flag=True, help="One JSON array on stdout.")
def compare(config: str | None, gpu_list: str, out: str, top: int, backend: str,
            micro_batches: str, max_num_seqs: str, memory_utilization: str, objective: str,
            pay_for: str, deadline: float | None, as_json: bool) -> None:
    """The same job at several cluster sizes: throughput per strategy and the winner (and,
    with a deadline, the cheapest size whose best plan meets it)."""
    from planner.planning import plan_job
    from planner.progress import SearchProgress
    from planner.report import deadline_verdict, gpus_label, plan_json, write_compare_report

    try:
        sizes = [int(x) for x in gpu_list.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"expected comma-separated integers, got {gpu_list!r}",
                        key="--gpus") from None
    if not sizes:
        raise SpecError("give at least one cluster size", key="--gpus")
    base = _load_job(config)
    options = _search_options(top, backend, micro_batches, max_num_seqs, memory_utilization,
                              objective, pay_for, deadline, deadline_without_objective=True)
    if deadline is not None:
        from planner.objective import check_prices

        with _about(config):
            check_prices(base)
    results = []
    for gpus in sizes:
        job = _resized(base, gpus, config)
        progress = SearchProgress(enabled=not as_json, label=f"{gpus} GPUs")
        with _about(config):
            results.append(plan_job(job, options, progress=progress))
        progress.close()
    files = write_compare_report(results, out, deadline)
    if as_json:
        _emit_json([plan_json(r) for r in results])
        return
    click.echo(f"{'GPUs':>6} {'winner placement':<28} {'GPUs per set':<14} {'s/iter':>9} "
               f"{'tokens/s':>10}   colocate / standalone / split tokens/s")
    for r in results:
        strategies = " / ".join(f"{s.result.throughput_tokens_per_s:,.0f}" if s.result else "-"
                                for s in r.strategies)
        if r.best is None:
            click.echo(f"{r.job.cluster.total_gpus:>6} does not fit")
            continue
        gpus_per_set = gpus_label(r.best, r.job)
        click.echo(f"{r.job.cluster.total_gpus:>6} {r.best.plan.placement:<28} "
                   f"{gpus_per_set:<14} {r.best.iteration_seconds:>9.2f} "
                   f"{r.best.throughput_tokens_per_s:>10,.0f}   {strategies}"
                   + (f"   ${r.best.dollars_per_iteration:,.2f}/iter"
                      if r.best.dollars_per_iteration is not None else ""))
    if deadline is not None:
        click.echo(deadline_verdict(results, deadline))
    click.echo(f"report: {files}")
