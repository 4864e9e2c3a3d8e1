"""``dtrain plan RUN_DIR``: what other slot and node counts, and the doctor's options, would give.

From one measured run (its ``profile.json``) and a link's bandwidth and latency, predict samples/s,
scaling efficiency and the time to finish the run's ``max_length`` for other configurations, as a table,
a PNG and ``--json``. The model (same global batch: strong scaling, as ``dtrain bench``):

* **work** per slot: the fastest rank's data, compute (forward + backward) and fixed costs (optimizer,
  bookkeeping); data and compute change with the per-slot batch as the run's end-of-run probe measured
  (``batch_scaling``: per-step overhead stays, per-sample work scales), fixed costs do not. More local
  slots than cores share them: work x local slots / cores beyond one slot per core.
* **communication**, a ring all-reduce of the gradients (``parameters x 4`` bytes, half with fp16
  compression): each rank sends ``2(N-1)/N`` of them through the slowest link on its ring (the given
  link between hosts, else the bandwidth this run achieved), plus a per-exchange cost that grows with
  the ``N-1`` ring steps, calibrated so that the measured configuration reproduces its own exposed
  communication (on a shared machine that cost includes waking processes up), plus the link's latency
  per ring step between hosts. DDP overlaps all buckets but the last with backward compute: exposed is
  the larger of the last bucket's share and what backward could not hide. With ``aggregation_frequency``
  k, one exchange per k batches.
* **waiting** for slower ranks: the doctor's straggler time, kept for every multi-slot configuration.

Threads: each slot is credited with the threads the measured run had (more threads on fewer slots only
help where cores are idle; not credited, so one slot is predicted conservatively).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.explain import advice
from dtrain.profiling.record import load_run_profile

OPTIONS = ("base", "aggregation", "compression", "fusion", "precision")


@dataclass(frozen=True)
class Link:
    """Between hosts: bytes per second and seconds of latency per ring step (None: as measured)."""

    bytes_per_second: float | None
    latency_seconds: float
    label: str


def parse_link(text: str | None) -> Link | None:
    """``200mbit``, ``1gbit,0.2ms`` (tc's SI units) or ``measured``; None when not given."""
    if text is None:
        return None
    if text.strip() == "measured":
        return Link(None, 0.0, "measured")
    rate, _, latency = text.partition(",")
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "mb": 1e6, "gb": 1e9}
    for suffix, scale in units.items():
        number = rate.strip().lower().removesuffix(suffix)
        if rate.strip().lower().endswith(suffix) and _is_number(number):
            seconds = 0.0
            if latency:
                value = latency.strip().lower()
                factor = 1e-3 if value.endswith("ms") else 1e-6 if value.endswith("us") else None
                digits = value.removesuffix("ms").removesuffix("us")
                if factor is None or not _is_number(digits):
                    raise UserError(f"--link {text!r}: the latency after the comma must look like 0.2ms or 50us")
                seconds = float(digits) * factor
            if float(number) <= 0:
                raise UserError(f"--link {text!r}: the rate must be positive")
            return Link(float(number) * scale, seconds, text)
    raise UserError(f"--link {text!r}: expected a rate like 200mbit or 1gbit (optionally ',0.2ms'), or 'measured'")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Measured:
    """What one run tells the model."""

    slots: int
    hosts: int
    cores: int
    per_slot_batch: int
    global_batch: int
    data: float
    compute: float
    backward: float
    fixed: float
    exposed: float
    straggler: float
    grad_bytes: float
    buckets: float
    bandwidth: float  # bytes/s the run's ring achieved per link (busbw), 0 when not measured
    latency: float  # one-float all-reduce, seconds
    work_growth: float
    load_growth: float
    aggregation: int
    compression: str
    compressions: tuple[str, ...]
    precision_gain: float | None
    samples_per_second: float
    total_batches: int | None
    probe_bytes: float = 0.0
    probe_seconds: float = 0.0

    @classmethod
    def from_run(cls, run_dir: Path) -> Measured:
        from dtrain.explain.doctor import diagnose

        profile = load_run_profile(run_dir)
        diagnosis = diagnose(profile)
        factors = {f["factor"]: f for f in diagnosis["factors"]}
        ranks = [r.seconds_per_step for r in profile.per_rank]
        fastest = min(ranks, key=lambda r: r.data + r.forward + r.backward + r.optimizer + r.other)
        work_growth, load_growth = advice.probe_growth(profile.batch_scaling)
        comm, probe = profile.comm, profile.allreduce_probe
        precision = factors.get("precision", {})
        gain = None
        if precision.get("key") and precision.get("seconds_per_step"):
            compute = fastest.forward + fastest.backward
            saved = float(precision["seconds_per_step"])
            gain = compute / (compute - saved) if compute > saved else None
        return cls(
            slots=profile.slots, hosts=profile.hosts, cores=profile.cpu_cores or 1,
            per_slot_batch=profile.per_slot_batch_size, global_batch=profile.global_batch_size,
            data=min(r.data for r in ranks), compute=fastest.forward + fastest.backward,
            backward=fastest.backward, fixed=fastest.optimizer + fastest.other,
            exposed=comm.exposed_seconds_per_step if profile.slots > 1 else 0.0,
            straggler=float(factors["straggler"]["seconds_per_step"]),
            grad_bytes=4.0 * profile.parameters,
            buckets=max(1.0, comm.buckets_per_step or 1.0),
            bandwidth=comm.busbw_bytes_per_second,
            latency=comm.latency_seconds,
            work_growth=work_growth, load_growth=load_growth,
            aggregation=profile.aggregation_frequency,
            compression=profile.gradient_compression,
            compressions=tuple(profile.strategy_compressions), precision_gain=gain,
            samples_per_second=profile.samples_per_second, total_batches=_total_batches(run_dir),
            probe_bytes=probe.bytes if probe is not None else 0.0,
            probe_seconds=probe.seconds if probe is not None else 0.0)


def _total_batches(run_dir: Path) -> int | None:
    """The run's ``max_length`` in batches (epochs through the run's own batches per epoch)."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        length = config.get("max_length") or {}
        if length.get("batches"):
            return int(length["batches"])
        summary = json.loads((run_dir / "summary.json").read_text())
        per_epoch = summary["batches"] / summary["epochs"]
        return round(length["epochs"] * per_epoch)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


@dataclass(frozen=True)
class Case:
    slots: int
    nodes: int
    option: str = "base"
    aggregation: int = 1
    compression: str = "none"
    one_bucket: bool = False
    precision_gain: float = 1.0

    @property
    def label(self) -> str:
        return {"base": "as measured", "aggregation": f"aggregation_frequency: {self.aggregation}",
                "compression": f"gradient_compression: {self.compression}", "fusion": "one fused bucket",
                "precision": f"lower precision ({self.precision_gain:.1f}x matmuls)"}[self.option]


def _ring(slots: int) -> float:
    return 2 * (slots - 1) / slots if slots > 1 else 0.0


def _exposed(total: float, buckets: float, backward: float) -> float:
    """All buckets but the last overlap with backward compute."""
    return max(total / buckets, total - backward)


def _busy(exposed: float, buckets: float, backward: float) -> float:
    """The all-reduce time that :func:`_exposed` turns into ``exposed`` (its inverse)."""
    return min(exposed * buckets, exposed + backward)


def _calibrated(m: Measured) -> tuple[float, float]:
    """(per-exchange latency seconds at the measured slot count, bytes/s) of the measured run's own ring,
    such that the model gives back the run's measured exposed communication: the one-float all-reduce
    time is the latency, the rest of an exchange moved the bytes (the whole exchange when the probe is
    slower). Nothing measured (one slot): no latency, unlimited bandwidth: only a given link costs."""
    if m.slots < 2 or m.exposed <= 0:
        return 0.0, float("inf")
    total = _busy(m.exposed * m.aggregation, m.buckets, m.backward)
    nbytes = m.grad_bytes * (0.5 if m.compression == "fp16" else 1.0)
    if m.probe_bytes > 0 and m.probe_seconds > m.latency:
        # The back-to-back all-reduce probe gives the ring's bytes rate; the rest of an exchange in training
        # (waking up, waiting for peers) is a per-exchange cost that grows with the ring's steps.
        bandwidth = _ring(m.slots) * m.probe_bytes / (m.probe_seconds - m.latency)
        return max(0.0, total - _ring(m.slots) * nbytes / bandwidth), bandwidth
    latency = min(m.latency, total)
    moved = total - latency
    return latency, _ring(m.slots) * nbytes / moved if moved > 0 else float("inf")


def predict_step(m: Measured, case: Case, link: Link | None) -> dict[str, float]:
    """Seconds per step, by part, for ``case`` (see the module's docstring for the model)."""
    local = max(1, case.slots // case.nodes)
    measured_local = max(1, m.slots // m.hosts)
    crowd = max(1.0, local / m.cores) / max(1.0, measured_local / m.cores)
    factor = (m.global_batch / case.slots) / m.per_slot_batch if m.per_slot_batch else 1.0
    data = advice.scaled(m.data, m.load_growth, factor) * crowd
    compute = advice.scaled(m.compute, m.work_growth, factor) * crowd / case.precision_gain
    backward = advice.scaled(m.backward, m.work_growth, factor) * crowd / case.precision_gain
    fixed = m.fixed * crowd
    comm = wait = 0.0
    if case.slots > 1:
        latency, bandwidth = _calibrated(m)
        if case.nodes > 1 and link is not None:
            if link.bytes_per_second is not None:
                bandwidth = min(bandwidth, link.bytes_per_second)
            latency += 2 * (case.slots - 1) * link.latency_seconds
        nbytes = m.grad_bytes * (0.5 if case.compression == "fp16" else 1.0)
        steps = (case.slots - 1) / (m.slots - 1) if m.slots > 1 else 0.0
        total = latency * steps + _ring(case.slots) * nbytes / bandwidth
        comm = _exposed(total, 1.0 if case.one_bucket else m.buckets, backward) / case.aggregation
        wait = m.straggler
    step = data + compute + fixed + comm + wait
    return {"data": data, "compute": compute, "fixed": fixed, "communication": comm, "waiting": wait, "step": step}


def cases(m: Measured, slot_counts: list[int], nodes: int) -> list[Case]:
    """Every slot count on one node (and on ``nodes`` where it divides), with the doctor's options."""
    out = []
    for n in slot_counts:
        for hosts in sorted({1, nodes} if nodes > 1 and n % nodes == 0 and n >= nodes else {1}):
            out.append(Case(n, hosts))
            if n > 1:
                out.append(Case(n, hosts, "aggregation", aggregation=4))
                if "fp16" in m.compressions:
                    out.append(Case(n, hosts, "compression", compression="fp16"))
                if m.buckets > 1:
                    out.append(Case(n, hosts, "fusion", one_bucket=True))
            if m.precision_gain:
                out.append(Case(n, hosts, "precision", precision_gain=m.precision_gain))
    return out


def plan(run_dir: Path, slot_counts: list[int], nodes: int = 1, link: Link | None = None) -> dict[str, Any]:
    """The ``--json`` document: one prediction per case."""
    if nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {nodes}")
    if nodes > 1 and link is None:
        raise UserError(f"--nodes {nodes} needs --link RATE (e.g. 200mbit) or --link measured")
    m = Measured.from_run(run_dir)
    one = predict_step(m, Case(1, 1), link)["step"]
    predictions = []
    for case in cases(m, slot_counts, nodes):
        parts = predict_step(m, case, link)
        sps = m.global_batch / parts["step"]
        predictions.append({
            "slots": case.slots, "nodes": case.nodes, "option": case.option, "change": case.label,
            "samples_per_second": sps, "efficiency": sps / (case.slots * m.global_batch / one),
            "seconds_per_step": parts["step"], "parts_seconds": parts,
            "seconds_to_finish": parts["step"] * m.total_batches if m.total_batches else None})
    measured = Case(m.slots, m.hosts, aggregation=m.aggregation, compression=m.compression)
    return {"run_dir": str(run_dir), "measured": {"slots": m.slots, "nodes": m.hosts,
                                                  "samples_per_second": m.samples_per_second,
                                                  "model_samples_per_second": m.global_batch / predict_step(
                                                      m, measured, link)["step"]},
            "link": link.label if link else None, "total_batches": m.total_batches, "predictions": predictions}


def render(doc: dict[str, Any]) -> str:
    from rich.table import Table

    from dtrain.explain.render import as_text

    table = Table(title=f"dtrain plan from {doc['run_dir']} ({doc['measured']['slots']} slot(s) measured at "
                        f"{doc['measured']['samples_per_second']:,.0f} samples/s; link {doc['link'] or 'as measured'})")
    for col in ("slots", "nodes", "change", "samples/s", "efficiency", "ms/step", "to finish"):
        table.add_column(col, justify="left" if col == "change" else "right")
    for p in doc["predictions"]:
        finish = p["seconds_to_finish"]
        table.add_row(str(p["slots"]), str(p["nodes"]), p["change"], f"{p['samples_per_second']:,.0f}",
                      f"{100 * p['efficiency']:.0f}%", f"{1e3 * p['seconds_per_step']:.2f}",
                      f"{finish:,.0f} s" if finish is not None else "-")
    return as_text(table, width=140)


def plot(doc: dict[str, Any], path: Path) -> None:
    from dtrain.explain.render import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for p in doc["predictions"]:
        series.setdefault((p["nodes"], p["change"]), []).append((p["slots"], p["samples_per_second"]))
    for (hosts, change), points in sorted(series.items()):
        points.sort()
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=f"{hosts} node(s), {change}")
    m = doc["measured"]
    ax.scatter([m["slots"]], [m["samples_per_second"]], color="black", zorder=5, label="measured run")
    ax.set_xlabel("slots")
    ax.set_ylabel("predicted samples/s")
    ax.set_title("dtrain plan")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
