"""The doctor: turns a run's measured step profile into ranked factors and concrete config changes.

Model. A synchronous step on every rank is its data wait + its compute + its exposed communication, and
all ranks finish a step together. From ``profile.json`` the step is split into parts that add up to it:

* ``data_loading``   mean data wait
* ``compute``        forward + backward compute of the fastest rank (the work every slot must do)
* ``batch_size``     per-step fixed costs (optimizer step, bookkeeping) of the fastest rank: they do
                     not grow with the batch, so a bigger batch amortizes them
* ``communication``  exposed all-reduce time of the slowest rank (it waits least for peers), the part
                     that moves bytes (bandwidth-bound)
* ``sync_frequency`` the same exposed time's per-message part (buckets x measured one-float latency):
                     a cost paid per synchronization, which only syncing less often removes
* ``straggler``      the remainder: time ranks spend waiting for the slowest rank
* ``precision``      on a GPU with tensor cores training in float32: the part of the compute that lower
                     precision would save, from matmul throughput measured on that very device at the end
                     of the run (``device_facts.matmul_tflops``); an upper bound, as if compute were all
                     matmuls. Zero on CPU and when already in mixed precision.

Each factor's action is predicted from the same numbers (e.g. aggregation_frequency k divides the
communication and waiting by k). Predictions assume the other parts stay as measured. The advice is held
to what it can deliver: a change predicted within 2% of today is not advised (nor, on one slot, anything
about exchanging gradients); a rank is named, with what to check on its host, only when it is chronically
last (``stragglers.chronic_rank``); and one change has one predicted speed-up wherever it appears (one
slot: the scaling estimate's; more loader workers: one loader plan).

The doctor diagnoses only phases it saw: a trial that calls ``loss.backward()`` / ``opt.step()`` itself
leaves them in ``other`` (``profile.json``'s ``unobserved_phases``), and then gets one line saying so, the
measured data wait and the rest of the step, and no change or prediction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dtrain.explain import advice, efficiency
from dtrain.explain.costmodel import CostModel, ratio
from dtrain.profiling.record import ProfileRecord

FACTORS = ("communication", "data_loading", "compute", "precision", "straggler", "batch_size", "sync_frequency")
# Keep this share of the device's memory free when advising a bigger batch.
MEMORY_HEADROOM = 0.9
AGGREGATION_TO_TRY = 4
MIN_GAIN = advice.MIN_GAIN  # a change predicted to gain no more than this is not advised
# The change two models can propose (the straggler's fallback on two slots, and the scaling estimate).
ONE_SLOT = ("resources.slots_per_trial", 1)


def _speedup(step: float, new_step: float, samples_factor: float = 1.0) -> float:
    return samples_factor * step / new_step if new_step > 0 else float("inf")


class Predictor:
    """Every predicted speed-up of the doctor, from the one cost model (:mod:`dtrain.explain.costmodel`): a
    change's samples/s over the model's own figure for the run as it was (so the model's bias cancels), and
    its 80% interval, kept by change for the table and ``--verify``."""

    def __init__(self, profile: ProfileRecord) -> None:
        self.model = CostModel.from_profile(profile)
        self.here = self.model.measured_target()
        self.base = self.model.predict(self.here)
        self.intervals: dict[str, tuple[float, float]] = {}

    def gain(self, action: str, *, less_step: float = 0.0, **changes: Any) -> float:
        """``action``'s predicted speed-up (``changes`` to the run's :class:`Target`; ``less_step``: seconds
        a change removes that the model does not see, such as a chronic straggler's lag)."""
        pred = self.model.predict(replace(self.here, **changes))
        value, low, high = ratio(pred, self.base)
        if less_step > 0:
            shrink = pred.step / max(pred.step - less_step, 1e-12)
            value, low, high = value * shrink, low * shrink, high * shrink
        self.intervals[action] = (low, high)
        return value


def unobserved_note(profile: ProfileRecord) -> str:
    """One line: which phases the run did not see and why (its trial calls loss.backward() / opt.step()),
    and the fix; empty when every phase was seen."""
    missing = profile.unobserved_phases or []
    if not missing:
        return ""
    calls = [c for c, phase in (("self.context.backward(loss)", "forward"),
                                ("self.context.step_optimizer(opt)", "optimizer")) if phase in missing]
    raw = [c for c, phase in (("loss.backward()", "forward"), ("opt.step()", "optimizer")) if phase in missing]
    return (f"the step's phases were not observed: train_batch calls {' / '.join(raw)} itself, not "
            f"{' / '.join(calls)}, so {', '.join(missing)} are counted in 'other'; call {' and '.join(calls)} "
            "for a diagnosis")


def _unobserved_diagnosis(profile: ProfileRecord) -> dict[str, Any]:
    """A step whose phases were not all seen: only what was measured whatever train_batch does (the step and
    the wait for its batch), and no factor, change or prediction built on the phases not seen."""
    ranks = [r.seconds_per_step for r in profile.per_rank]
    step = sum(r.step for r in ranks) / len(ranks)
    data = min(r.data for r in ranks)
    rest = max(0.0, step - data)
    factors = [
        {"factor": "data_loading", "share": data / step, "seconds_per_step": data, **_factor(
            None, None, "the wait for the next batch, measured before train_batch whatever it calls", None)},
        {"factor": "train_batch", "share": rest / step, "seconds_per_step": rest, **_factor(
            None, None, f"not split into phases ({', '.join(profile.unobserved_phases or [])} not observed)",
            None)},
    ]
    factors.sort(key=lambda f: f["seconds_per_step"], reverse=True)
    return {"slots": profile.slots, "samples_per_second": profile.samples_per_second, "step_seconds": step,
            "top_factor": None, "phases_observed": False, "unobserved_phases": list(profile.unobserved_phases or []),
            "verdict": unobserved_note(profile), "factors": factors, "recommendations": [],
            "scaling": {"estimated_one_slot_speedup": None, "slower_than_one_slot": False},
            **efficiency.doctor_fields(profile)}


def diagnose(profile: ProfileRecord) -> dict[str, Any]:
    """Ranked factors, recommendations and a verdict (the ``--json`` document). A profile whose step phases
    were not all observed gets no diagnosis of them (:func:`unobserved_note` says why)."""
    if not profile.phases_observed:
        return _unobserved_diagnosis(profile)
    predictor = Predictor(profile)
    ranks = [r.seconds_per_step for r in profile.per_rank]
    slots = profile.slots
    step = sum(r.step for r in ranks) / len(ranks)
    # The wait every rank has: one rank's slower loader is that rank straggling, not slow data loading.
    data = min(r.data for r in ranks)
    work = [r.data + r.forward + r.backward + r.optimizer + r.other for r in ranks]
    late = advice.straggler(profile, work)
    # The rank the others wait for: the one that arrives last at the collectives (measured), else the one
    # with the most work; its exposed time is pure communication (it waited for no one).
    slowest = late["rank"] if late is not None else max(range(len(ranks)), key=lambda i: work[i])
    fastest = min(range(len(ranks)), key=lambda i: work[i])
    compute = ranks[fastest].forward + ranks[fastest].backward
    fixed = ranks[fastest].optimizer + ranks[fastest].other
    cpu_work = compute + fixed
    # One loader plan for one change: a rank chronically late loading its batch sets the wait more loader
    # workers must hide, for the data factor and the straggler factor alike.
    chronic_data = late is not None and bool(late["chronic"]) and late["phase"] == "data"
    loader = advice.loader_plan(profile, ranks[slowest].data if chronic_data else data, step, cpu_work)
    comm = profile.comm
    exposed = ranks[slowest].comm_exposed
    busy = comm.busy_seconds_per_step
    per_message = min(1.0, comm.buckets_per_step * comm.latency_seconds / busy) if busy > 0 else 0.0
    sync_part, bandwidth_part = exposed * per_message, exposed * (1 - per_message)
    straggler = max(0.0, step - data - compute - fixed - exposed)
    precision = _precision_gain(profile)
    saved = compute * (1 - 1 / precision[1]) if precision is not None else 0.0
    seconds = {"communication": bandwidth_part, "data_loading": data, "compute": compute - saved,
               "precision": saved, "straggler": straggler, "batch_size": fixed, "sync_frequency": sync_part}

    gbs = profile.global_batch_size
    k = AGGREGATION_TO_TRY
    scaling = _scaling(profile, slots, predictor)
    aggregation = predictor.gain(f"optimizations.aggregation_frequency: {k}", aggregation=k) if slots > 1 else None
    factors = {
        "communication": _communication_factor(profile, aggregation, k, gbs, predictor) if slots > 1
        else _nothing_to_exchange(),
        "sync_frequency": _factor(
            "optimizations.aggregation_frequency", k,
            f"{comm.buckets_per_step:.0f} all-reduce(s) per step at {1e3 * comm.latency_seconds:.2f} ms "
            f"latency each; exchanging gradients every {k} batches pays that once per {k} batches "
            f"(effective batch {k * gbs})",
            aggregation) if slots > 1 else _nothing_to_exchange(),
        "data_loading": _data_factor(step, data, loader, predictor),
        "straggler": _straggler_factor(profile, late, step, straggler, loader, scaling, predictor),
        "batch_size": _batch_factor(profile, gbs, predictor),
        "precision": _precision_factor(profile, precision, predictor),
        "compute": _factor(
            None, None,
            "forward and backward compute: the useful work. A step dominated by it scales well; a faster "
            "device or more slots are what make it faster", None),
    }
    for f in factors.values():
        _worth_it(f)
    ranked = sorted(FACTORS, key=lambda f: seconds[f], reverse=True)
    table = [{"factor": f, "share": seconds[f] / step, "seconds_per_step": seconds[f], **factors[f]} for f in ranked]
    one_slot = scaling["estimated_one_slot_speedup"]
    # The scaling entry goes first so that, tied with a factor proposing the same change, it is the one kept.
    candidates = [{"factor": "scaling", "key": ONE_SLOT[0], "value": ONE_SLOT[1], "predicted_speedup": one_slot,
                   "action": f"{ONE_SLOT[0]}: {ONE_SLOT[1]}"}] if scaling["slower_than_one_slot"] else []
    candidates += [{"factor": f["factor"], "key": f["key"], "value": f["value"],
                    "predicted_speedup": f["predicted_speedup"], "action": f"{f['key']}: {f['value']}"}
                   for f in table if f["key"] is not None and f["share"] >= 0.05]
    recommendations = _unique(sorted((r for r in candidates if _gains(r["predicted_speedup"])),
                                     key=lambda r: r["predicted_speedup"], reverse=True))
    for row in [*table, *recommendations]:
        if row["key"] is not None and f"{row['key']}: {row['value']}" in predictor.intervals:
            row["predicted_interval"] = list(predictor.intervals[f"{row['key']}: {row['value']}"])
    top = ranked[0]
    return {
        "slots": slots,
        "samples_per_second": profile.samples_per_second,
        "step_seconds": step,
        "top_factor": top,
        "phases_observed": True,
        "verdict": _verdict(top, table[0], scaling, slots, profile),
        "factors": table,
        "recommendations": recommendations,
        "scaling": scaling,
        **efficiency.doctor_fields(profile),
    }


def add_checkpoint_advice(diagnosis: dict[str, Any], finish: dict[str, Any] | None) -> None:
    """Add the goodput model's ``min_checkpoint_period`` advice (:mod:`dtrain.explain.goodput`) to a diagnosis:
    a recommendation with its predicted time saving, and ``finish`` (time and cost to finish) as is."""
    diagnosis["finish"] = finish
    advice_ = finish.get("advice") if finish else None
    if advice_:
        diagnosis["recommendations"].append({"factor": "checkpoints", **{k: advice_[k] for k in (
            "key", "value", "predicted_speedup", "action", "why")}})
        diagnosis["recommendations"].sort(key=lambda r: r["predicted_speedup"], reverse=True)


def _straggler_factor(profile: ProfileRecord, late: dict[str, Any] | None, step: float, straggler: float,
                      loader: dict[str, Any], scaling: dict[str, Any], predictor: Predictor) -> dict[str, Any]:
    """Name the rank the others wait for (host, lag, slow phase) and what to check there, only for a rank
    that is chronically last: where ranks take turns, no rank is to blame, and the factor says so with no
    change to try. The config change is the real fix where one exists (a slow loader: more loader workers);
    one slot fewer is the fallback, predicted with the remaining slots doing its share of the batch, and
    offered only where it is predicted faster."""
    slots = profile.slots
    if late is None:
        return _factor(None, None, "one slot: nothing to wait for", None)
    if not late["chronic"]:
        return _factor(None, None, advice.turns_text(late, straggler), None)
    fixed_speedup = _speedup(step, step - straggler)
    # One slot fewer, on the hosts that remain: the cost model re-prices the work and the exchange, and the
    # straggler's lag leaves with it (one slot is the scaling estimate itself: one change, one prediction).
    fewer = slots - 1
    if fewer == ONE_SLOT[1]:
        leave_out = scaling["estimated_one_slot_speedup"]
    else:
        hosts = profile.hosts - 1 if profile.hosts > 1 and profile.slots // profile.hosts == 1 else profile.hosts
        leave_out = predictor.gain(f"resources.slots_per_trial: {fewer}", less_step=straggler, slots=fewer,
                                   nodes=max(1, hosts), threads=None)
    worth = _gains(leave_out)
    leave = ("resources.slots_per_trial", fewer, leave_out) if worth else None
    why = advice.straggler_text(late, f"resources.slots_per_trial: {fewer}", one_host=profile.hosts == 1,
                                fallback_speedup=leave_out)
    late = {**late, "fixed_speedup": fixed_speedup}
    if late["phase"] == "data":  # a loader fix: the rank is always late, and late loading its batch
        return _factor("data_loader.num_workers", loader["workers"], why, _loader_gain(loader, step, predictor),
                       alternative=leave, straggler=late)
    if leave is None:
        return _factor(None, None, why, None, straggler=late)
    return _factor(leave[0], leave[1], why, leave[2], straggler=late)


def _loader_gain(plan: dict[str, Any], step: float, predictor: Predictor) -> float:
    """The cost model with the data wait that ``plan``'s loader processes leave (the rest of the step as is)."""
    data = predictor.base.parts["data"]
    left = max(0.0, plan["step_seconds"] - (step - data))
    return predictor.gain(f"data_loader.num_workers: {plan['workers']}", data_workers_step=left)


def _data_factor(step: float, data: float, plan: dict[str, Any], predictor: Predictor) -> dict[str, Any]:
    """More loader processes per slot, as many as the machine's cores and the probed load make worth it
    (``plan``: :func:`dtrain.explain.advice.loader_plan`)."""
    return _factor("data_loader.num_workers", plan["workers"],
                   f"slots wait {1e3 * data:.2f} ms per step for their next batch: {plan['why']} (dtrain bench "
                   "--synthetic shows the ceiling)", _loader_gain(plan, step, predictor))


def _communication_factor(profile: ProfileRecord, aggregation: float | None, k: int, gbs: int,
                          predictor: Predictor) -> dict[str, Any]:
    """Fewer bytes (fp16 compression, where the run's strategy can honour it: its capabilities are
    recorded in the profile from the strategy registry) or fewer exchanges (aggregation)."""
    comm = profile.comm
    aggregate = ("optimizations.aggregation_frequency", k, aggregation)
    why = (f"exposed all-reduce moves {_mb(comm.bytes_per_step)} per step at "
           f"{_mb(comm.algbw_bytes_per_second)}/s; aggregating {k} batches per exchange sends them a {k}th as "
           f"often (effective batch {k * gbs})")
    if "fp16" not in profile.strategy_compressions:
        key, value, speedup = aggregate
        return _factor(key, value, why + f"; sync.strategy {profile.strategy} cannot compress gradients",
                       speedup)
    compress = ("optimizations.gradient_compression", "fp16",
                predictor.gain("optimizations.gradient_compression: fp16", compression="fp16"))
    return _best_of(compress, aggregate, why + "; fp16 compression halves the bytes")


def _precision_gain(profile: ProfileRecord) -> tuple[str, float] | None:
    """(precision to try, measured matmul speed-up over the current one) on a tensor-core GPU, else None."""
    facts = profile.device_facts
    current = {"32-true": "fp32", "tf32": "tf32"}.get(profile.precision)
    if facts is None or facts.type != "cuda" or not facts.tensor_cores or current is None:
        return None
    tflops = facts.matmul_tflops
    if tflops is None or not tflops.of(current):
        return None
    best = max((("bf16-mixed", "bf16"), ("tf32", "tf32")), key=lambda c: tflops.of(c[1]))
    if best[1] == current:
        return None
    gain = tflops.of(best[1]) / tflops.of(current)
    return (best[0], gain) if gain > 1.05 else None


def _precision_factor(profile: ProfileRecord, precision: tuple[str, float] | None,
                      predictor: Predictor) -> dict[str, Any]:
    if precision is None:
        return _factor(None, None, "no lower precision measured faster here (CPU, no tensor cores, or already "
                       "mixed precision)", None)
    name, gain = precision
    device = profile.device_facts.name if profile.device_facts is not None else "GPU"
    return _factor("precision", name,
                   f"the step is trained in {profile.precision}; matmuls ran {gain:.1f}x faster in {name} on this "
                   f"{device} (measured); compute shrinks by up "
                   "to that factor (weights stay float32; bf16 needs no loss scaling)",
                   predictor.gain(f"precision: {name}", precision_gain=gain))


def _batch_factor(profile: ProfileRecord, gbs: int, predictor: Predictor) -> dict[str, Any]:
    """A bigger global batch, as big as the device's memory allows (GPU: peak memory vs the card's)."""
    factor = 2.0
    facts = profile.device_facts
    on_gpu = facts is not None and facts.type == "cuda"
    peak = max((r.peak_memory_bytes for r in profile.per_rank), default=0.0)
    memory_note = ""
    if facts is not None and on_gpu and peak > 0 and facts.total_memory_bytes:
        # Activations grow with the batch, weights and optimizer state do not: scaling the whole peak is
        # the conservative bound.
        room = MEMORY_HEADROOM * facts.total_memory_bytes / peak
        factor = min(factor, float(int(room * 4) / 4))
        memory_note = f"; peak GPU memory {peak / 2**30:.1f} of {facts.total_memory_bytes / 2**30:.0f} GiB"
    elif not on_gpu and peak > 0 and profile.memory_total_bytes:
        # CPU: every slot on a host holds its peak RSS (libraries included, which do not grow: conservative).
        total = profile.memory_total_bytes
        room = MEMORY_HEADROOM * total / (peak * advice.local_slots(profile))
        factor = min(factor, float(int(room * 4) / 4))
        memory_note = (f"; peak RSS {peak / 2**30:.2f} GiB per slot x {advice.local_slots(profile)} on a "
                       f"{total / 2**30:.0f} GiB host")
    if factor < 1.25:
        return _factor(None, None, f"a bigger batch would amortize fixed costs, but it does not fit{memory_note}",
                       None)
    new_gbs = int(gbs * factor)
    return _factor(
        "hyperparameters.global_batch_size", new_gbs,
        "optimizer step and bookkeeping cost the same whatever the batch; a bigger batch spreads them "
        f"(and communication) over more samples. {advice.batch_change(profile, new_gbs)['text']}{memory_note}",
        # More samples per step: data and compute grow with them as probed; fixed costs and the exchange do not.
        predictor.gain(f"hyperparameters.global_batch_size: {new_gbs}", global_batch=new_gbs))


def _factor(key: str | None, value: Any, why: str, speedup: float | None,
            alternative: tuple[str, Any, float | None] | None = None,
            straggler: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "value": value, "why": why, "predicted_speedup": speedup}
    if alternative is not None:
        out["alternative"] = {"key": alternative[0], "value": alternative[1], "predicted_speedup": alternative[2]}
    if straggler is not None:
        out["straggler"] = straggler
    return out


def _nothing_to_exchange() -> dict[str, Any]:
    return _factor(None, None, "one slot: no gradients to exchange", None)


def _gains(speedup: float | None) -> bool:
    return speedup is not None and speedup > MIN_GAIN


def _worth_it(factor: dict[str, Any]) -> None:
    """Drop a change predicted to gain less than ``MIN_GAIN`` (the alternative takes its place if it gains):
    the row keeps its share and its why, and says why nothing is to try."""
    alt = factor.get("alternative")
    if alt is not None and not _gains(alt["predicted_speedup"]):
        del factor["alternative"]
        alt = None
    if factor["key"] is None or _gains(factor["predicted_speedup"]):
        return
    speedup = factor["predicted_speedup"]
    if speedup is not None:
        factor["why"] += (f"; {factor['key']}: {factor['value']} is predicted at {speedup:.2f}x, "
                          f"{'no faster than' if speedup < 1 else 'within 2% of'} today: not worth a change")
    if alt is not None:
        factor.update(key=alt["key"], value=alt["value"], predicted_speedup=alt["predicted_speedup"])
        del factor["alternative"]
    else:
        factor.update(key=None, value=None, predicted_speedup=None)


def _unique(recommendations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per config change (two factors can point at the same one): the best-ranked is kept."""
    seen: set[str] = set()
    out = []
    for rec in recommendations:
        if rec["action"] not in seen:
            seen.add(rec["action"])
            out.append(rec)
    return out


def _best_of(first: tuple[str, Any, float], second: tuple[str, Any, float], why: str) -> dict[str, Any]:
    """A factor with two candidate actions: the one predicted faster leads, the other is the alternative."""
    lead, other = sorted((first, second), key=lambda a: a[2], reverse=True)
    return _factor(lead[0], lead[1], why, lead[2], alternative=other)


def _scaling(profile: ProfileRecord, slots: int, predictor: Predictor) -> dict[str, Any]:
    """One slot doing the whole global batch, by the cost model: its data and compute at N x the per-slot
    batch as the end-of-run probe measured them (a small model's step is mostly per-step overhead, which
    N x the batch does not multiply), with the host's cores to itself, and no exchange."""
    if slots == 1:
        return {"estimated_one_slot_speedup": 1.0, "slower_than_one_slot": False, "estimated_scaling_efficiency": 1.0}
    one = predictor.gain(f"{ONE_SLOT[0]}: {ONE_SLOT[1]}", slots=1, nodes=1, threads=None)
    low, high = predictor.intervals[f"{ONE_SLOT[0]}: {ONE_SLOT[1]}"]
    speedup = 1 / one  # N slots' samples/s over one slot's
    return {"estimated_one_slot_speedup": one,
            "estimated_speedup_vs_one_slot": speedup,
            "estimated_speedup_vs_one_slot_interval": [1 / high, 1 / low],
            "estimated_scaling_efficiency": speedup / slots,
            "estimated_one_slot_step_seconds": predictor.model.predict(
                replace(predictor.here, slots=1, nodes=1, threads=None)).step,
            "work_growth_with_batch": advice.probe_growth(profile.batch_scaling)[0]
            if profile.batch_scaling is not None else None,
            "slower_than_one_slot": speedup < 1.0}


def _verdict(top: str, row: dict[str, Any], scaling: dict[str, Any], slots: int, profile: ProfileRecord) -> str:
    share = f"{100 * row['share']:.0f}%"
    lead = f"{top.replace('_', ' ')} is the top factor ({share} of the step)"
    fewer = scaling["slower_than_one_slot"]
    # The one-slot change is stated once, in the scaling sentence below, with its one figure.
    change = row["key"] is not None and not (fewer and (row["key"], row["value"]) == ONE_SLOT)
    if top == "straggler":  # who, or that ranks take turns (then there is nothing to try)
        late = row.get("straggler") or {}
        lead += f": {row['why']}"
        if late.get("fixed_speedup"):
            lead += f"; fixing it: about {late['fixed_speedup']:.1f}x samples/s"
        if change:
            lead += f"; {row['key']}: {row['value']}: about {row['predicted_speedup']:.1f}x"
    elif change:
        lead += f": try {row['key']}: {row['value']}, predicted about {row['predicted_speedup']:.1f}x samples/s"
    if fewer:
        lead = (f"{slots} slots are SLOWER than 1 would be here (estimated "
                f"{scaling['estimated_speedup_vs_one_slot']:.2f}x of one slot): communication and {_cpus(profile)} "
                f"cost more than they buy; use resources.slots_per_trial: 1 (about "
                f"{scaling['estimated_one_slot_speedup']:.2f}x samples/s) or make each step bigger. Then: " + lead)
    return lead


def _cpus(profile: ProfileRecord) -> str:
    """'2 slots x 1 thread on 2 CPU cores' (cores as the run recorded them)."""
    slots, threads = profile.slots, profile.threads_per_slot
    cores = advice.usable_cores(profile)
    where = f" on {cores} CPU core(s)" + (" per host" if profile.hosts > 1 else "") if cores else ""
    return f"{slots} slots x {threads} thread(s){where}"


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f} MB"


def render(diagnosis: dict[str, Any]) -> str:
    """The doctor's table as text (rich), for the terminal and the end-of-run summary."""
    from rich.table import Table

    from dtrain.explain.render import as_text

    table = Table(title=f"dtrain doctor: {diagnosis['slots']} slot(s), {diagnosis['samples_per_second']:,.0f} "
                        f"samples/s, step {1e3 * diagnosis['step_seconds']:.2f} ms")
    for col in ("factor", "share", "ms/step", "try", "predicted (80%)"):
        table.add_column(col, justify="right" if col in ("share", "ms/step", "predicted (80%)") else "left")
    for f in diagnosis["factors"]:
        action = f"{f['key']}: {f['value']}" if f["key"] else "-"
        predicted = f"{f['predicted_speedup']:.2f}x" if f["predicted_speedup"] else "-"
        if f["predicted_speedup"] and "predicted_interval" in f:
            predicted += " ({:.2f}-{:.2f})".format(*f["predicted_interval"])
        table.add_row(f["factor"], f"{100 * f['share']:.0f}%", f"{1e3 * f['seconds_per_step']:.2f}", action, predicted)
    # Why, in the user's terms (learning-rate rule, what to check on a host), for the factors with a change.
    # The straggler's too, with no change: it says that ranks take turns, or why one slot fewer would not help.
    notes = "".join(f"  {f['factor']}: {f['why']}\n" for f in diagnosis["factors"][:4]
                    if (f["key"] or f["factor"] == "straggler") and f["share"] >= 0.05)
    checkpoints = next((r for r in diagnosis["recommendations"] if r["factor"] == "checkpoints"), None)
    extra = (f"checkpoints: {checkpoints['action']} (predicted {checkpoints['predicted_speedup']:.2f}x less time to "
             f"finish): {checkpoints['why']}\n") if checkpoints else ""
    lines = "".join(f"{line}\n" for line in diagnosis.get("efficiency", []))
    return as_text(table) + f"verdict: {diagnosis['verdict']}\n" + extra + (f"why:\n{notes}" if notes else "") + lines
