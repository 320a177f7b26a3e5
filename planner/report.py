"""Report of a planning run: plan.json, ranking.csv, strategies.csv, report.md, a
self-contained report.html (figures embedded) and the PNG figures; and the scaling report of
``compare``. This module turns planning results into plain data (tables, sentences, figure
series); ``reports/`` draws the figures and writes the documents."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from planner.background import Background
from planner.objective import group_price_per_gpu_hour, priced
from planner.planning import Evaluated, PlanningResult, cheapest_meeting_deadline
from planner.provenance import stale_calibration
from profiles.datafile import write_text_atomic
from reports import figures
from reports.document import (
    Bullets,
    Document,
    Heading,
    Image,
    Note,
    Paragraph,
    Table,
    write_document,
)
from simulator.costs.memory import GIB
from simulator.specs.job import RULE, JobSpec
from simulator.validation import cached_validation


@dataclass(frozen=True, slots=True)
class ReportFiles:
    directory: Path
    plan: Path | None
    report_md: Path
    report_html: Path
    ranking_csv: Path
    strategies_csv: Path
    figures: tuple[Path, ...]


def gpus_label(evaluated: Evaluated, job: JobSpec | None = None) -> str:
    """'16+8', or with each set's device on a mixed cluster: '16 h20+8 h100-80gb'."""
    sets = evaluated.plan.located_sets()
    if job is None or job.cluster.is_homogeneous:
        return "+".join(str(s.gpus) for s in sets)
    return "+".join(f"{s.gpus} {job.cluster.device_of(s.node_group)}" for s in sets)


def _configs(evaluated: Evaluated) -> str:
    parts = []
    for role, rp in evaluated.plan.roles.items():
        text = f"{role}:{rp.parallel.short()}/mb{rp.parallel.micro_batch_size}/" \
               f"{rp.parallel.recompute}"
        if rp.generation is not None:
            text += f" gen:tp{rp.generation.tp}"
        parts.append(text)
    return "; ".join(parts)


def ranking_table(result: PlanningResult) -> pd.DataFrame:
    rows = []
    for rank, e in enumerate(result.ranking, start=1):
        rows.append({"rank": rank, "placement": e.plan.placement,
                     "gpus_per_set": gpus_label(e, result.job),
                     "parallel_configs": _configs(e),
                     "iteration_seconds": e.iteration_seconds,
                     "throughput_tokens_per_s": e.throughput_tokens_per_s,
                     "dollars_per_iteration": e.dollars_per_iteration,
                     "tokens_per_dollar": e.tokens_per_dollar,
                     "peak_memory_gib_per_gpu": e.simulation.peak_memory_bytes_per_gpu / GIB})
    columns = ["rank", "placement", "gpus_per_set", "parallel_configs", "iteration_seconds",
               "throughput_tokens_per_s", "dollars_per_iteration", "tokens_per_dollar",
               "peak_memory_gib_per_gpu"]
    if not priced(result.job):
        columns.remove("dollars_per_iteration")
        columns.remove("tokens_per_dollar")
    return pd.DataFrame(rows, columns=columns)


def strategies_table(result: PlanningResult) -> pd.DataFrame:
    rows = []
    searched = result.best
    entries = [("searched" if searched is None or searched.plan.strategy == "searched"
                else searched.plan.strategy, searched,
                searched.plan.placement if searched else "", result.infeasible_reason)]
    entries += [(s.name, s.result, s.placement, s.reason) for s in result.strategies]
    for name, evaluated, placement, reason in entries:
        rows.append({
            "strategy": name, "placement": placement,
            "gpus_per_set": gpus_label(evaluated, result.job) if evaluated else "",
            "iteration_seconds": evaluated.iteration_seconds if evaluated else None,
            "throughput_tokens_per_s": evaluated.throughput_tokens_per_s if evaluated else None,
            **({"dollars_per_iteration": evaluated.dollars_per_iteration if evaluated else None,
                "tokens_per_dollar": evaluated.tokens_per_dollar if evaluated else None}
               if priced(result.job) else {}),
            "peak_memory_bytes_per_gpu": (evaluated.simulation.peak_memory_bytes_per_gpu
                                          if evaluated else None),
            "feasible": evaluated is not None,
            "reason": "" if evaluated else reason})
    return pd.DataFrame(rows)


def modes_table(result: PlanningResult) -> pd.DataFrame:
    """The best plan of each mode side by side (steady-state seconds per step for the
    asynchronous ones)."""
    rows = []
    for m in result.modes:
        e = m.result
        extra = e.simulation.extra if e is not None else {}
        rows.append({
            "mode": m.name, "staleness": m.staleness,
            "allowed": "yes" if m.allowed else "no (job's mode)",
            "plan": e.plan.describe(result.job) if e else "",
            "gpus_per_set": gpus_label(e, result.job) if e else "",
            "iteration_seconds": e.iteration_seconds if e else None,
            "throughput_tokens_per_s": e.throughput_tokens_per_s if e else None,
            "generation_seconds": extra.get("generation_seconds"),
            "trainer_seconds": extra.get("trainer_seconds"),
            "weight_sync_seconds": extra.get("weight_sync_seconds"),
            "reason": "" if e else m.reason})
    return pd.DataFrame(rows)


def _all_evaluated(result: PlanningResult) -> list[tuple[str, Evaluated]]:
    out = []
    if result.best is not None:
        out.append((result.best.plan.strategy, result.best))
    out += [(s.name, s.result) for s in result.strategies if s.result is not None]
    return out


def stage_table(result: PlanningResult) -> pd.DataFrame:
    """Seconds of each operation under each strategy (one iteration)."""
    columns = {}
    for name, e in _all_evaluated(result):
        columns[name] = {stage: seconds for stage, seconds in e.simulation.stage_seconds.items()}
        columns[name]["iteration"] = e.iteration_seconds
    return pd.DataFrame(columns)


def _job_summary(result: PlanningResult) -> list[tuple[str, str]]:
    job = result.job
    work = job.workload
    models = ", ".join(f"{role}={'rule' if m == RULE else m.name}"
                       for role, m in job.models.items())
    cluster = job.cluster
    profiles = ", ".join(f"{p.name} ({p.provenance.source})"
                         for p in _distinct_profiles(job))
    return [
        ("algorithm", job.algorithm),
        ("models", models),
        ("cluster", cluster.describe()),
        ("workload", f"{work.prompts_per_iteration} prompts x {work.samples_per_prompt} "
                     f"samples, prompt {work.prompt_length} tokens, response "
                     f"{work.response_length.to_value()} tokens, {work.ppo_epochs} epoch(s) "
                     f"of {work.mini_batches_per_epoch} mini-batches, {work.dtype}"),
        ("device profile" if cluster.is_homogeneous else "device profiles", profiles),
    ]


def _cost_line(result: PlanningResult) -> str:
    """What the best plan costs, and what it was ranked by."""
    best = result.best
    assert best is not None and best.dollars_per_iteration is not None
    pay_for = (best.plan.predicted or {}).get("paying_for", "cluster")
    paying = ("every GPU of the cluster" if pay_for == "cluster"
              else "only the GPUs the plan uses")
    cluster = result.job.cluster
    prices = "; ".join(dict.fromkeys(
        f"{g.profile().name} ${group_price_per_gpu_hour(cluster, i):.2f}/GPU-hour"
        for i, g in enumerate(cluster.node_groups)))
    return (f"Cost: **${best.dollars_per_iteration:,.2f} per iteration**, "
            f"{best.tokens_per_dollar:,.0f} tokens per dollar, paying for {paying} ({prices}).")


def _distinct_profiles(job: JobSpec) -> list:
    """The cluster's device profiles, each once (by name), in the job's order."""
    return list({p.name: p for p in reversed(job.cluster.profiles())}.values())[::-1]


def _accuracy_notes(profiles: list, kind: dict[str, bool]) -> str:
    """``_accuracy_note`` of each profile, with the uncalibrated profiles named together (they
    share one statement: the validation against published measurements for a job of ``kind``:
    ``_accuracy_note``'s keyword arguments)."""
    calibrated = [_accuracy_note(p, **kind) for p in profiles
                  if p.provenance.accuracy or p.provenance.fitted_on]
    plain = [p for p in profiles if not (p.provenance.accuracy or p.provenance.fitted_on)]
    if len(plain) > 1:
        note = _accuracy_note(plain[0], **kind)
        names = ", ".join(f"{p.name} ({p.provenance.source})" for p in plain)
        calibrated.append(f"Profiles {names} have not been calibrated on runs;"
                          + note.split("has not been calibrated on runs;", 1)[1])
    else:
        calibrated += [_accuracy_note(p, **kind) for p in plain]
    return " ".join(calibrated)


def _accuracy_note(profile, *, mixture_of_experts: bool = False,
                   asynchronous: bool = False) -> str:
    """What is known about how far to trust predictions made with ``profile``, for a job of
    this kind (the validation groups of other kinds are left to ``hybridflow validate``)."""
    provenance = profile.provenance
    stale = stale_calibration(profile)
    warning = f" Warning: {stale}." if stale else ""
    when = (f" (fitted {provenance.fitted_at}, commit {provenance.commit or 'unknown'})"
            if provenance.fitted_at else "")
    if provenance.accuracy:
        acc = provenance.accuracy
        plans = acc.get("held_out_plans", acc.get("held_out_runs", 0))
        tau = (f", ranking of plans (Kendall tau) {acc['kendall_tau']:.2f}"
               if "kendall_tau" in acc else "")
        bias = f", bias {acc['bias_pct']:+.1f}%" if "bias_pct" in acc else ""
        return (f"Profile {profile.name}: {provenance.source}{when}. Its measured error on "
                f"{plans:.0f} held-out executor plans: median |error| of the iteration time "
                f"{acc.get('median_abs_error_pct', 0):.1f}%, max "
                f"{acc.get('max_abs_error_pct', 0):.1f}%{bias}{tau}.{warning}")
    if provenance.fitted_on:
        return (f"Profile {profile.name}: {provenance.source}{when}; relative RMS error of the "
                f"fitted stage times {provenance.residual_before or 0:.0%} -> "
                f"{provenance.residual_after or 0:.0%} (not measured on held-out runs)."
                f"{warning}")
    _, groups = cached_validation()
    shown = [g for g in groups if g.applies_to(mixture_of_experts=mixture_of_experts,
                                               asynchronous=asynchronous)]
    parts = [f"{g.group}: mean |error| {g.mean_abs_error_pct:.1f}%, max "
             f"{g.max_abs_error_pct:.1f}%, bias {g.bias_pct:+.1f}% ({g.bias_direction})"
             for g in shown]
    kind = ("mixture-of-experts" if mixture_of_experts else "dense") + \
        (", asynchronous" if asynchronous else "")
    return (f"Profile {profile.name} ({provenance.source}) has not been calibrated on runs; "
            f"the cost models' error against published measurements for {kind} jobs "
            f"(`hybridflow validate` lists all {len(groups)} groups) is "
            + "; ".join(parts) + ".")


def _why(result: PlanningResult) -> list[str]:
    best = result.best
    if best is None:
        return [result.infeasible_reason]
    lines = []
    feasible = [s for s in result.strategies if s.result is not None]
    if feasible:
        runner = min(feasible, key=lambda s: s.result.iteration_seconds)  # type: ignore[union-attr]
        other = runner.result
        assert other is not None
        gain = other.iteration_seconds / best.iteration_seconds - 1
        if best.plan.placement == other.plan.placement and abs(gain) < 1e-9:
            lines.append(f"The best plan is the standard **{runner.name}** placement "
                         f"({best.plan.placement}) with its best parallel configs.")
        else:
            lines.append(f"The searched plan ({best.plan.placement}) is {gain:.1%} faster than "
                         f"the best standard strategy, **{runner.name}** "
                         f"({other.iteration_seconds:.1f} s vs {best.iteration_seconds:.1f} s "
                         "per iteration).")
            diffs = []
            for stage, seconds in best.simulation.stage_seconds.items():
                theirs = other.simulation.stage_seconds.get(stage)
                if theirs is not None:
                    diffs.append((theirs - seconds, stage, theirs, seconds))
            diffs.sort(reverse=True)
            for delta, stage, theirs, seconds in diffs[:3]:
                if abs(delta) > 0.01 * best.iteration_seconds:
                    lines.append(f"- `{stage}`: {seconds:.1f} s here vs {theirs:.1f} s under "
                                 f"{runner.name} ({'-' if delta > 0 else '+'}"
                                 f"{abs(delta):.1f} s)")
    for label, idle in best.simulation.idle_fraction.items():
        lines.append(f"- set `{label}` is idle {idle:.0%} of the iteration")
    if best.estimate.transition is not None:
        t = best.estimate.transition
        lines.append(f"- the actor's train->generate transition (3D-HybridEngine, micro-DP "
                     f"groups of {t.group_size}) moves {t.bytes_received_per_gpu / 1e9:.2f} GB "
                     f"per GPU in {t.seconds * 1000:.1f} ms")
        update = _weight_update_line(best)
        if update:
            lines.append(update)
    for m in best.estimate.memory:
        lines.append(f"- set `{m.label}` peaks at {m.peak.total / GIB:.1f} GiB per GPU during "
                     f"`{m.peak_node}` ({m.headroom_bytes / GIB:.1f} GiB headroom)")
    return lines


def why_blocks(lines: list[str]) -> list:
    """``_why``'s lines as blocks: sentences as paragraphs, runs of '- ' lines as lists."""
    blocks: list = []
    run: list[str] = []
    for line in lines:
        if line.startswith("- "):
            run.append(line[2:])
            continue
        if run:
            blocks.append(Bullets(tuple(run)))
            run = []
        blocks.append(Paragraph(line))
    if run:
        blocks.append(Bullets(tuple(run)))
    return blocks


def _weight_update_line(best: Evaluated) -> str:
    """The whole weight update before each generation of a colocated actor, as a framework's
    refit timer holds it (the parts of ``validate``'s nemo_rl_v03_refit group): states moved
    to host, the engine woken, the transition."""
    generate = best.estimate.nodes.get("actor.generate")
    transition = best.estimate.transition
    if generate is None or transition is None:
        return ""
    offload = generate.detail.get("offload_out_seconds", 0.0)
    wake = generate.detail.get("wake_seconds", 0.0)
    if offload + wake <= 0:
        return ""
    parts = [f"transition {transition.seconds:.2f} s", f"engine wake-up {wake:.2f} s"]
    if offload > 0:
        parts.insert(0, f"states to host {offload:.2f} s")
    return (f"- the whole weight update before generation is priced at "
            f"{offload + wake + transition.seconds:.2f} s ({', '.join(parts)}); NeMo-RL's "
            "published refits of 8-70B models take 4-15 s (v0.3 blog), and `hybridflow "
            "validate` measures this price against them (group nemo_rl_v03_refit)")


def _sets_table(best: Evaluated, job: JobSpec) -> pd.DataFrame:
    rows = []
    for s, memory in zip(best.plan.located_sets(), best.estimate.memory, strict=True):
        pool = job.cluster.pool_of(s.node_group)
        first, last = s.node_range(pool.group.gpus_per_node)
        rows.append({"set": s.label(), "gpus": s.gpus,
                     "node_group": s.node_group, "device": pool.group.profile().name,
                     "gpu_range": f"{s.first_gpu}-{s.first_gpu + s.gpus - 1}",
                     "nodes": f"{first}" if first == last else f"{first}-{last}",
                     "peak_gib_per_gpu": round(memory.peak.total / GIB, 1),
                     "headroom_gib": round(memory.headroom_bytes / GIB, 1)})
    return pd.DataFrame(rows)


def _roles_table(best: Evaluated) -> pd.DataFrame:
    rows = []
    for role, rp in best.plan.roles.items():
        par = rp.parallel
        generation = ""
        serving_ep = (f", ep {rp.generation.ep}" if rp.generation is not None
                      and rp.generation.ep > 1 else "")
        if rp.generation is not None and best.plan.rollout is not None:
            generation = (f"tp {rp.generation.tp}, pp {rp.generation.pp}{serving_ep} on the "
                          f"rollout set ({best.plan.generation_replicas()} replicas)")
        elif rp.generation is not None:
            generation = (f"tp {rp.generation.tp}, pp {rp.generation.pp}{serving_ep}, "
                          f"micro-DP {rp.generation.micro_dp(par)}")
        row = {"role": role, "pp": par.pp, "tp": par.tp, "dp": par.dp}
        if any(p.parallel.ep > 1 or p.parallel.etp > 1 for p in best.plan.roles.values()):
            row.update({"ep": par.ep, "etp": par.etp})  # MoE plans: the expert layout
        rows.append({**row, "sharding": par.sharding, "micro_batch": par.micro_batch_size,
                     "recompute": par.recompute, "generation": generation})
    return pd.DataFrame(rows)


def write_plan_report(result: PlanningResult, out_dir: str | Path) -> ReportFiles:
    """Write every artefact of ``result`` into ``out_dir`` (files replaced atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    job = result.job
    ranking = ranking_table(result)
    strategies = strategies_table(result)
    stages = stage_table(result)
    write_text_atomic(out / "ranking.csv", ranking.to_csv(index=False))
    write_text_atomic(out / "strategies.csv", strategies.to_csv(index=False))
    plan_path = None
    if result.best is not None:
        plan_path = out / "plan.json"
        result.best.plan.save(plan_path)

    title = f"{job.algorithm.upper()} on {job.cluster.total_gpus} GPUs"
    # Each figure is drawn in a child process of its own where cores are free (about a third
    # of a second each), while this one writes the documents.
    drawing = [Background(
        figures.throughput_by_strategy,
        list(strategies["strategy"]), list(strategies["placement"]),
        [None if pd.isna(v) else float(v) for v in strategies["throughput_tokens_per_s"]],
        out / "throughput.png", f"Throughput per strategy - {title}",
        ["" if pd.isna(r) else str(r) for r in strategies["reason"]])]
    if result.best is not None:
        drawing.append(Background(
            figures.timeline_gantt,
            result.best.simulation.timeline, out / "timeline.png",
            f"Best plan {result.best.plan.placement}: one iteration "
            f"({result.best.iteration_seconds:.1f} s)" if result.best.plan.rollout is None else
            f"Best plan, {result.best.plan.mode_label()}: {result.best.simulation.iterations} "
            f"iterations ({result.best.iteration_seconds:.1f} s per steady step)"))
        drawing.append(Background(
            figures.memory_by_set,
            result.best.estimate.memory, out / "memory.png",
            f"Peak memory per GPU of each set - {result.best.plan.placement}"))
    with contextlib.ExitStack() as drawn:
        for figure in drawing:
            drawn.enter_context(figure)
        document = _plan_document(result, out, ranking, strategies, stages, title)
        pngs = [figure.result() for figure in drawing]
    write_document(document, out, "report")  # the HTML embeds the figures
    return ReportFiles(directory=out, plan=plan_path, report_md=out / "report.md",
                       report_html=out / "report.html", ranking_csv=out / "ranking.csv",
                       strategies_csv=out / "strategies.csv", figures=tuple(pngs))


def _plan_document(result: PlanningResult, out: Path, ranking: pd.DataFrame,
                   strategies: pd.DataFrame, stages: pd.DataFrame, title: str) -> Document:
    """The report's text and tables, with the figures in ``out`` named."""
    job = result.job
    summary = _job_summary(result)
    why = _why(result)
    stats = result.stats
    cache = stats.cost_model_cache
    stats_lines = [
        f"search time {result.search_seconds:.2f} s; {stats.placements} placement runs, "
        f"{stats.allocations} allocations reached, "
        f"{stats.partial_allocations_pruned + stats.allocations_pruned} pruned by bound; "
        f"{stats.candidates_evaluated} complete candidates evaluated; "
        f"{stats.configs_evaluated} model configs costed; cost-model cache hit rate "
        f"{cache['hit_rate']:.0%}"]
    accuracy = _accuracy_notes(_distinct_profiles(job), kind={
        "mixture_of_experts": any(job.model(r).moe is not None for r in job.gpu_roles),
        "asynchronous": result.best is not None and result.best.plan.rollout is not None})

    blocks: list = [Note(accuracy)]
    if result.best is not None:
        best = result.best
        blocks += [Heading("Best plan"),
                   Paragraph(f"**{best.plan.placement}** on {gpus_label(best, job)} GPUs: "
                             f"**{best.iteration_seconds:.1f} s** per iteration, "
                             f"**{best.throughput_tokens_per_s:,.0f} tokens/s** "
                             "(prompt + response tokens per iteration / iteration time)."),
                   *([Paragraph(_cost_line(result))] if best.dollars_per_iteration else []),
                   *([Heading("How sure", 3), Bullets(tuple(_confidence_lines(result)))]
                     if result.confidence else []),
                   Table(_sets_table(best, job)), Table(_roles_table(best)),
                   Image(out / "timeline.png"), Image(out / "memory.png")]
    else:
        blocks += [Heading("No plan fits"), Paragraph(result.infeasible_reason)]
    blocks += [Heading("Why this plan"), *why_blocks(why),
               Heading("Standard strategies"), Image(out / "throughput.png"),
               Table(strategies, markdown_drop=("peak_memory_bytes_per_gpu",)),
               Heading("Seconds per operation", 3),
               Table(stages, index=True, index_name="operation"),
               *([Heading("Synchronous and asynchronous modes"), Paragraph(MODES_NOTE),
                  Table(modes_table(result))] if result.modes else []),
               Heading("Ranking"), Table(ranking),
               Heading("Search"), *(Paragraph(line) for line in stats_lines)]
    return Document(title=f"RLHF placement plan: {title}", summary=tuple(summary),
                    blocks=tuple(blocks))


def _confidence_lines(result: PlanningResult, bullet: str = "") -> list[str]:
    """The plan's confidence (planner/confidence.py) as sentences."""
    c = result.confidence
    assert c is not None
    return [bullet + line.strip() for line in c.lines()] + [
        bullet + "How: each finalist's critical path is split into generation, training, "
        "forward passes and the rest; each part's error is drawn from the validation cases "
        "that price that kind of work (`hybridflow validate`), correlated between plans as "
        "one validation group's cases are. A winner fastest in at least 80% of draws is "
        "firm; under 50%, the verdict flips inside the model's error."]


MODES_NOTE = ("sync-colocate: every model on every GPU; sync: the searched synchronous "
              "plan; one_step_off and async: the best split into trainer and rollout GPUs, "
              "timed at the steady state (seconds per step once the pipeline is full: the "
              "busier of the rollout set, generation + weight sync, and the trainer). "
              "Asynchronous steps train on batches generated by a policy up to 'staleness' "
              "updates old.")


def plan_json(result: PlanningResult) -> dict:
    """The machine-readable summary of ``hybridflow plan --json``."""
    best = result.best
    return {
        "best": None if best is None else {
            "placement": best.plan.placement,
            "gpus_per_set": [s.gpus for s in best.plan.sets],
            "node_groups": [s.node_group for s in best.plan.sets],
            "iteration_seconds": best.iteration_seconds,
            "throughput_tokens_per_s": best.throughput_tokens_per_s,
            "dollars_per_iteration": best.dollars_per_iteration,
            "tokens_per_dollar": best.tokens_per_dollar,
            "peak_memory_bytes_per_gpu": best.simulation.peak_memory_bytes_per_gpu,
            "plan": best.plan.to_value(),
        },
        "strategies": [
            {"name": s.name, "placement": s.placement,
             "gpus_per_set": [x.gpus for x in s.result.plan.sets] if s.result else [],
             "iteration_seconds": s.result.iteration_seconds if s.result else None,
             "throughput_tokens_per_s": s.result.throughput_tokens_per_s if s.result else None,
             "dollars_per_iteration": s.result.dollars_per_iteration if s.result else None,
             "feasible": s.feasible, "reason": s.reason}
            for s in result.strategies],
        "ranking": [{"placement": e.plan.placement, "gpus_per_set": [s.gpus for s in e.plan.sets],
                     "node_groups": [s.node_group for s in e.plan.sets],
                     "iteration_seconds": e.iteration_seconds,
                     "throughput_tokens_per_s": e.throughput_tokens_per_s,
                     "dollars_per_iteration": e.dollars_per_iteration,
                     "tokens_per_dollar": e.tokens_per_dollar}
                    for e in result.ranking],
        "modes": [
            {"mode": m.name, "staleness": m.staleness, "allowed": m.allowed,
             "plan": m.result.plan.describe(result.job) if m.result else None,
             "iteration_seconds": m.result.iteration_seconds if m.result else None,
             "throughput_tokens_per_s": m.result.throughput_tokens_per_s if m.result else None,
             "weight_sync_seconds": (m.result.simulation.extra.get("weight_sync_seconds")
                                     if m.result else None),
             "reason": m.reason}
            for m in result.modes],
        "confidence": None if result.confidence is None else result.confidence.to_value(),
        "search_seconds": result.search_seconds,
        "candidates_evaluated": result.stats.candidates_evaluated,
        "feasible": best is not None,
        "reason": result.infeasible_reason,
        "gpus": result.job.cluster.total_gpus,
    }


def deadline_verdict(results: list[PlanningResult], deadline_seconds: float) -> str:
    """'The cheapest size that meets 120 s per iteration: 32 GPUs, ...' (or that none does)."""
    cheapest = cheapest_meeting_deadline(results, deadline_seconds)
    if cheapest is None:
        return (f"No size compared meets the deadline of {deadline_seconds:g} s per "
                "iteration.")
    best = cheapest.best
    assert best is not None and best.dollars_per_iteration is not None
    return (f"The cheapest size that meets {deadline_seconds:g} s per iteration: "
            f"{cheapest.job.cluster.total_gpus} GPUs ({best.plan.placement} on "
            f"{gpus_label(best, cheapest.job)}), {best.iteration_seconds:.1f} s and "
            f"${best.dollars_per_iteration:,.2f} per iteration.")


def compare_table(results: list[PlanningResult]) -> pd.DataFrame:
    rows = []
    for r in results:
        row = {"gpus": r.job.cluster.total_gpus,
               "winner_placement": r.best.plan.placement if r.best else "",
               "winner_gpus_per_set": gpus_label(r.best, r.job) if r.best else "",
               "searched_tokens_per_s": r.best.throughput_tokens_per_s if r.best else None,
               "searched_iteration_seconds": r.best.iteration_seconds if r.best else None}
        if priced(r.job):
            row["searched_dollars_per_iteration"] = (r.best.dollars_per_iteration if r.best
                                                     else None)
            row["searched_tokens_per_dollar"] = r.best.tokens_per_dollar if r.best else None
        for s in r.strategies:
            row[f"{s.name}_tokens_per_s"] = (s.result.throughput_tokens_per_s if s.result
                                             else None)
        rows.append(row)
    return pd.DataFrame(rows)


def write_compare_report(results: list[PlanningResult], out_dir: str | Path,
                         deadline_seconds: float | None = None) -> Path:
    """compare.csv, compare.md and throughput_vs_gpus.png (and, with a deadline, the cheapest
    size that meets it); returns the markdown path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = compare_table(results)
    write_text_atomic(out / "compare.csv", table.to_csv(index=False))
    gpus = [r.job.cluster.total_gpus for r in results]
    series: dict[str, list[float | None]] = {"searched": [
        r.best.throughput_tokens_per_s if r.best else None for r in results]}
    for name in ("colocate", "standalone", "split"):
        series[name] = [next((s.result.throughput_tokens_per_s for s in r.strategies
                              if s.name == name and s.result), None) for r in results]
    title = ""
    if results:
        job = results[0].job
        names = sorted({m.name for m in job.models.values() if m != RULE})
        title = f"{job.algorithm.upper()}, {', '.join(names)}"
    figures.throughput_vs_gpus(gpus, series, out / "throughput_vs_gpus.png",
                               f"Throughput per strategy against cluster size - {title}")
    blocks: list = [Image(out / "throughput_vs_gpus.png"), Table(table)]
    if deadline_seconds is not None:
        blocks.append(Paragraph(deadline_verdict(results, deadline_seconds)))
    markdown, _ = write_document(Document(title=f"Scaling: {title}", blocks=tuple(blocks)),
                                 out, "compare", html_too=False)
    return markdown
