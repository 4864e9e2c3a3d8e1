"""``dtrain plan RUN_DIR``: what other slot and node counts, and the doctor's options, would give.

Every figure comes from the one cost model (:mod:`dtrain.explain.costmodel`) built on the run's
``profile.json``, with an 80% interval; the table says which inputs were measured on the run, probed
(``--probe``: all-reduces among local processes, for a run that had one slot and so measured no link),
given (``--link`` between nodes) or assumed. A run with one slot never has its communication priced at
zero: without a probe saved beside it, ``dtrain plan`` probes local processes first (a few seconds).
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.explain import precision, predictor
from dtrain.explain.costmodel import CostModel, Link, Prediction, Target
from dtrain.explain.doctor import unobserved_note
from dtrain.explain.exchange import SLOTS, unpriced
from dtrain.explain.facts import Facts
from dtrain.explain.finish import finish, run_costs
from dtrain.explain.plandoc import Input, Measured, PlanDocument, PlanRow, RunCostsFacts, explained
from dtrain.explain.predictor import target_at, too_wide, wide_reason
from dtrain.explain.render import ratio
from dtrain.profiling import commprobe
from dtrain.profiling.record import ProfileRecord, load_run_profile

# Local processes ``--probe`` starts: two slots talk as any two of a ring do; more are priced by ring steps.
PROBE_WORLD = 2


def parse_link(text: str | None) -> Link | None:
    """``RATE[,LATENCY][,BURST]``: ``200mbit``, ``1gbit,0.2ms``, ``200mbit,50us,4000b`` (tc's SI units; a
    burst in bytes, ``b`` or ``kb`` as tc's tbf takes it, for a token-bucket shaper) or ``measured``; None
    when not given."""
    if text is None:
        return None
    if text.strip() == "measured":
        return Link(None, 0.0, "measured")
    rate, *extras = (part.strip().lower() for part in text.split(","))
    bytes_per_second = _with_unit(rate, {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "mb": 1e6, "gb": 1e9})
    if bytes_per_second is None:
        raise UserError(f"--link {text!r}: expected a rate like 200mbit or 1gbit (optionally ',0.2ms' and a "
                        "shaper's burst ',4000b'), or 'measured'")
    if bytes_per_second <= 0:
        raise UserError(f"--link {text!r}: the rate must be positive")
    latencies = [found for e in extras if (found := _with_unit(e, {"ms": 1e-3, "us": 1e-6})) is not None]
    bursts = [found for e in extras if (found := _with_unit(e, {"kb": 1024.0, "b": 1.0})) is not None]
    stray = len(latencies) + len(bursts) != len(extras)
    if stray or len(latencies) > 1 or len(bursts) > 1 or min(bursts, default=1.0) <= 0:
        raise UserError(f"--link {text!r}: after the rate, at most a latency like 0.2ms or 50us and a shaper's "
                        "burst like 4000b or 4kb, comma-separated")
    burst = bursts[0] if bursts else None
    return Link(bytes_per_second, sum(latencies, 0.0), text, burst)


def _with_unit(text: str, units: dict[str, float]) -> float | None:
    """``text``'s number times its unit's factor, or None where it has none of ``units`` (longest first)."""
    for unit, factor in units.items():
        if text.endswith(unit) and _is_number(text.removesuffix(unit)):
            return float(text.removesuffix(unit)) * factor
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the plan: a target and the option it shows."""

    target: Target
    option: str = "base"
    precision: str | None = None  # the "precision" option's config name
    # The per-slot batch the precision's gain was timed at: another one may gain otherwise (bf16 without bf16
    # units gains less at a bigger batch and from more threads; docs/benchmarks.md). With a gain curve
    # (timed at twice it, and on a CPU at other thread counts too) the row's gain is the curve's at its shape.
    timed_batch: int | None = None

    @property
    def label(self) -> str:
        t = self.target
        timed = f" at {self.timed_batch} samples per slot" if self.timed_batch else ""
        if t.precision_curve is not None and self.timed_batch:
            timed = f" from steps of {self.timed_batch} and {2 * self.timed_batch} samples"
        return {"base": "as measured", "aggregation": f"aggregation_frequency: {t.aggregation}",
                "compression": f"gradient_compression: {t.compression}", "fusion": "one fused bucket",
                "precision": f"precision: {self.precision} (compute {ratio(t.precision_gain)}x, measured{timed})",
                }[self.option]


def cases(model: CostModel, p: ProfileRecord, slot_counts: list[int], nodes: int) -> list[Case]:
    """Every slot count on one node (and on ``nodes`` where it divides), with the doctor's options, each
    target built as the doctor builds it (:func:`dtrain.explain.predictor.target_at`). A lower precision is
    shown only where the model's own steps were timed in it: a matmul peak ratio only bounds it."""
    lower = precision.best(p)
    gain = lower.gain if lower is not None else None
    out = []
    sharded = model.facts.sharded is not None  # FSDP: other slot and host counts only (dtrain.explain.exchange)
    for n in slot_counts:
        if sharded and n == 1:
            continue
        for hosts in sorted({1, nodes} if nodes > 1 and n % nodes == 0 and n >= nodes else {1}):
            out.append(Case(target_at(model, n, hosts)))
            if n > 1 and not sharded:
                out.append(Case(target_at(model, n, hosts, aggregation=4), "aggregation"))
                for compression in ("fp16", "powersgd"):
                    if compression in p.strategy_compressions and compression != p.gradient_compression:
                        out.append(Case(target_at(model, n, hosts, compression=compression), "compression"))
                if len(model.buckets(model.facts.gradient_total, False)) > 1:
                    out.append(Case(target_at(model, n, hosts, one_bucket=True), "fusion"))
            if lower is not None and gain is not None:
                out.append(Case(_in_precision(model, target_at(model, n, hosts), lower), "precision",
                                lower.precision, round(model.facts.per_slot_batch)))
    return out


def _in_precision(model: CostModel, target: Target, lower: precision.PrecisionEstimate) -> Target:
    """``target`` trained in ``lower``'s precision; the gain it shows is the curve's at its per-slot batch and
    threads, where the run timed one (else the run's shape's)."""
    changes = lower.changes()
    if lower.curve is not None:
        _, threads = model.local_threads(target)
        changes["precision_gain"] = lower.curve.at((target.global_batch or model.facts.global_batch) / target.slots,
                                                   threads)
    return replace(target, **changes)


def local_probe(run_dir: Path, profile: ProfileRecord, fresh: bool, log: Any) -> commprobe.LocalProbe | None:
    """A one-slot run's link, from local processes: saved beside the run, probed when asked or missing.
    None where no local probe can stand for the run's link (a GPU run, or a run made on another host)."""
    path = run_dir / commprobe.PROBE_FILE
    saved = None if fresh else commprobe.load(path)
    if saved is not None:
        return saved
    hosts = {r.host for r in profile.per_rank}
    if profile.device != "cpu" or (hosts and socket.gethostname() not in hosts):
        if fresh:
            raise UserError(f"--probe: the run trained on {profile.device} on {', '.join(sorted(hosts))}; a local "
                            "Gloo probe here cannot stand for its link. Run dtrain plan --probe on that host, or "
                            "give the link with --link RATE,LATENCY")
        return None
    bare = CostModel.from_profile(profile)
    _, threads = bare.local_threads(Target(PROBE_WORLD))
    log(f"dtrain plan: the run had one slot and measured no link: probing {PROBE_WORLD} local processes "
        f"({threads} thread(s) each; saved as {path.name}) ...")
    try:
        # A stand-in of the trainable parameters: frozen ones exchange nothing.
        probe = commprobe.probe_local(PROBE_WORLD, threads, round(bare.facts.gradient_total / 4),
                                      profile.tensor_fusion_threshold_mb)
    except commprobe.ProbeFailed as exc:
        raise UserError(f"dtrain plan: {exc}") from None
    commprobe.save(probe, path)
    return probe


def build_model(run_dir: Path, link: Link | None = None, probe: bool = False,
                log: Any = None) -> tuple[ProfileRecord, CostModel]:
    """The run's profile and cost model, with a local probe for a one-slot run (see :func:`local_probe`)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    profile = load_run_profile(run_dir)
    if not profile.phases_observed:  # compute would be priced at zero: a confident wrong prediction
        raise UserError(f"dtrain plan cannot predict {run_dir}: {unobserved_note(profile)}")
    found = unpriced(profile)
    if found is not None and found.covers_key(SLOTS):  # every row is another slot count, which this run cannot price
        raise UserError(f"dtrain plan cannot predict {run_dir}: {found.reason}; dtrain bench "
                        f"{run_dir / 'config.yaml'} --slots 2,4 measures slot counts")
    measured_link = profile.slots > 1 and profile.comm_probe is not None
    found = None if measured_link and not probe else local_probe(run_dir, profile, probe, log)
    if found is None:
        return profile, CostModel.from_profile(profile, between_hosts=link)
    # The probe's fp16 all-reduces, for the 16-bit compressions (a multi-slot run's own, where it timed them).
    facts = Facts.of_profile(profile)
    if found.half_points and not facts.half_link_points:
        facts = replace(facts, half_link_points=tuple(found.half_points), link_world=found.world)
    return profile, CostModel.from_facts(facts, found.points, found.world, found.overhead(), between_hosts=link)


# Said wherever hosts are priced on the link a one-host run measured (``--link measured``): that link is the
# host's loopback, and the note gives the one comparison measured here (bench/plan_accuracy.py's rows: Gloo's
# all-reduce of digits' 104 KB over veth between test hosts against 2 local slots, 2026-11-27).
LOOPBACK_BETWEEN_HOSTS = ("as among the run's own slots, measured on one host: its loopback, without a network's "
                          "per-packet costs (between test hosts on this machine's veth, the same exchanges took "
                          "1.2-1.8x as long); give --link RATE,LATENCY for a real network")


def plan(run_dir: Path, slot_counts: list[int], nodes: int = 1, link: Link | None = None, probe: bool = False,
         log: Any = None, mttf_hours: float | None = None, price: float | None = None) -> PlanDocument:
    """One prediction per case, with its interval and the model's inputs; with a per-node ``mttf_hours`` or a
    ``price`` per slot-hour, each case's expected time and cost to finish (failures, restarts and the measured
    checkpoint cost included) and its best checkpoint period."""
    if nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {nodes}")
    if nodes > 1 and link is None:
        raise UserError(f"--nodes {nodes} needs --link RATE (e.g. 200mbit) or --link measured")
    p, model = build_model(run_dir, link if link is not None and link.bytes_per_second is not None else None, probe,
                           log)
    if model.link is None and any(n > 1 for n in slot_counts):
        raise UserError(f"{run_dir}: the run had one slot on {p.device} and no link was measured or given; "
                        "run dtrain plan --probe on the host it trained on, or give --link RATE,LATENCY")
    costs = run_costs(run_dir, p)
    total = costs.total_batches
    unpriced_here = unpriced(p)
    one = model.predict(Target(1)) if model.facts.sharded is None else None
    mine = as_ran(p, model)
    predictions = []
    for case in cases(model, p, slot_counts, nodes):
        pred = model.predict(case.target)
        row = PlanRow.of(case.target, case.option, case.label, pred, one)
        row.seconds_to_finish = pred.step * total if total else None
        # Over the model's own figure for the run as it was: the doctor's gain for the same change.
        row.gain, low, high = predictor.ratio(pred, mine)
        row.terms = explained(model, case.target)
        if too_wide(row.gain, low, high):
            row.reason = wide_reason(f"{case.target.slots} slot(s) on {case.target.nodes} node(s), {case.label}",
                                     low, high, pred.widest)
            row.gain = None
        row.finish = finish(costs, pred.step, case.target.slots, case.target.nodes, mttf_hours, price)
        if row.finish is not None:
            row.seconds_to_finish = row.finish["configured"]["seconds"]
        predictions.append(row)
    inputs = list(model.sources)
    if unpriced_here is not None and model.facts.sharded is not None:
        # What the table leaves out for a sharded run, in the doctor's words.
        inputs.append(Input("not priced", unpriced_here.reason + (f"; one slot: {unpriced_here.alone}" if 1 in
                                                                  slot_counts else ""), "said"))
    if nodes > 1 and p.hosts == 1 and model.between_hosts is None:
        inputs.append(Input("link between hosts", LOOPBACK_BETWEEN_HOSTS, "assumed"))
    return PlanDocument(str(run_dir), Measured(p.slots, p.hosts, p.samples_per_second, mine.samples_per_second),
                        link.label if link else None, total, inputs,
                        predictions, RunCostsFacts(mttf_hours, price, costs.checkpoint_seconds, costs.restart_seconds,
                                                   costs.period_batches))


def as_ran(profile: ProfileRecord, model: CostModel) -> Prediction:
    """The model's figure for the run as it ran: where a given link replaces the one its hosts measured, the
    run on its own link (so a gain is over the run as measured, not over the run re-priced on the given link)."""
    if profile.hosts > 1 and model.between_hosts is not None:
        model = CostModel.from_profile(profile)
    return model.predict(model.measured_target())


def render(doc: PlanDocument) -> str:
    from rich.table import Table

    from dtrain.explain.render import as_text

    m = doc.measured
    title = (f"dtrain plan on paper ({doc.scaling} scaling; nothing measured: every input given, assumed or "
             "fitted to published results)"
             if doc.what_if else
             f"dtrain plan from {doc.run_dir} ({m.slots} slot(s) measured at {m.samples_per_second:,.0f} "
             f"samples/s; link {doc.link or 'as measured'})")
    table = Table(title=title)
    priced = doc.costs is not None and doc.costs.price_per_slot_hour is not None
    # On paper nothing finishes (no run, no batch count): the column shows what widens each interval most.
    last = "widest input" if doc.what_if else "to finish"
    columns = ["slots", "nodes", "change", "samples/s", "80% interval", "efficiency", "ms/step", last]
    for col in [*columns, *(["cost"] if priced else [])]:
        table.add_column(col, justify="left" if col in ("change", "widest input") else "right")
    for p in doc.predictions:
        done = p.seconds_to_finish
        # An interval wider than +/-25% gets no point figure: the row says so, and --verify measures it.
        cells = [str(p.slots), str(p.nodes), p.change, "wide" if p.reason else f"{p.samples_per_second:,.0f}",
                 f"{p.low:,.0f}-{p.high:,.0f}", f"{100 * p.efficiency:.0f}%" if p.efficiency is not None else "-",
                 f"{1e3 * p.seconds_per_step:.2f}",
                 (p.widest_input or "-").split(" (")[0] if doc.what_if
                 else _duration(done) if done is not None else "-"]
        if priced:
            cost = (p.finish or {}).get("configured", {}).get("cost")
            cells.append(f"{cost:,.2f}" if cost is not None else "-")
        table.add_row(*cells)
    inputs = "".join(f"  {i.name}: {i.value} [{i.source}]\n" for i in doc.inputs)
    text = as_text(table, width=160) + f"inputs:\n{inputs}"
    wide = [p for p in doc.predictions if p.reason]
    if wide:
        text += f"wide: {len(wide)} row(s) whose 80% interval is wider than +/-25%, e.g. {wide[0].reason}\n"
    costs = doc.costs
    if costs is not None and costs.mttf_hours_per_node is not None:
        text += (f"  to finish: {doc.total_batches} batches, one checkpoint {costs.checkpoint_seconds:.2f} s, a "
                 f"restart {costs.restart_seconds:.2f} s [measured; starting processes not included], a node "
                 f"failing every {costs.mttf_hours_per_node:g} h [given]\n")
        base = next((p for p in doc.predictions if p.option == "base" and p.slots == m.slots and p.nodes == m.nodes),
                    None)
        advice = base and base.finish and base.finish["advice"]
        if advice:
            text += f"checkpoints: {advice['action']}: {advice['why']}\n"
    return text


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "never"
    return f"{seconds:,.0f} s" if seconds < 3600 else f"{seconds / 3600:,.1f} h"


def plot(doc: PlanDocument, path: Path) -> None:
    from dtrain.explain.render import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[int, str], list[tuple[int, float, float, float]]] = {}
    for p in doc.predictions:
        series.setdefault((p.nodes, p.change), []).append((p.slots, p.samples_per_second, p.low, p.high))
    for (hosts, change), points in sorted(series.items()):
        points.sort()
        xs, ys = [x for x, *_ in points], [y for _, y, _, _ in points]
        err = [[y - lo for _, y, lo, _ in points], [hi - y for _, y, _, hi in points]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{hosts} node(s), {change}")
    m = doc.measured
    ax.scatter([m.slots], [m.samples_per_second], color="black", zorder=5, label="measured run")
    ax.set_xlabel("slots")
    ax.set_ylabel("predicted samples/s (80% interval)")
    ax.set_title("dtrain plan")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
