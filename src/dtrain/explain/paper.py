"""``dtrain plan --what-if SPEC``: the cost model on paper, for scales this machine cannot run.

Nothing is measured here: every input is given, and the output says so. The spec is comma-separated
``key=value`` pairs (rates in tc's units, as ``--link``)::

    params=330M            parameters (K, M, G suffixes)
    compute=441ms@256      one GPU's forward + backward for a batch of 256 samples (per-sample: scales with it)
    gpus-per-node=8
    intra=2400gbit:2us     the link among a node's GPUs: rate and latency per ring step
    inter=1600gbit:5us     each node's network (all its NICs together) and latency per ring step
    global=65536           strong scaling: this global batch split over the GPUs (accumulated if need be)
    batch=32               or weak scaling: this batch per GPU (the default: compute's batch)
    grad-bytes=2           bytes per gradient element on the wire (2: fp16 all-reduce; default 4)
    overhead=20ms          per optimizer step beyond compute (optimizer, bookkeeping; default 0, said so)
    overlap=no             whether the all-reduce overlaps backward (DDP: yes, the default; after
                           gradient accumulation: no)

The exchange is an all-reduce of DDP's 25 MB buckets across every GPU, through the slower of the two links:
a ring (one latency per step) or, across nodes, NCCL's tree where its tuner would find it faster; each step
waits for the slowest of N GPUs, with a per-GPU spread fitted to published results (``fitted_intervals.json``).
Each row names the input whose uncertainty widens its interval most.
"""

from __future__ import annotations

import math
from typing import Any

from dtrain.errors import UserError
from dtrain.explain import fitted
from dtrain.explain.costmodel import CostModel, Link, RingLink, Source, Target
from dtrain.explain.facts import Facts, Work
from dtrain.explain.plandoc import explained

KEYS = ("params", "compute", "gpus-per-node", "intra", "inter", "global", "batch", "grad-bytes", "overhead",
        "overlap")
REQUIRED = ("params", "compute", "gpus-per-node", "intra", "inter")
SUFFIX = {"k": 1e3, "m": 1e6, "g": 1e9}
RATE = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "mb": 1e6, "gb": 1e9}
TIME = {"ms": 1e-3, "us": 1e-6, "s": 1.0}
MAX_GPUS = 1024
# The cost model's uncertainty names as the spec's inputs.
WIDEST = {"compute": "compute (the given per-GPU time)", "link_given": "intra (the link within a node)",
          "inter_given": "inter (the link between nodes)",
          "unmeasured_drift": "step-to-step spread and stragglers (not given; fitted to published results)"}


def _bad(key: str, value: str, rule: str) -> UserError:
    return UserError(f"--what-if {key}={value!r}: {rule}")


def _count(key: str, value: str) -> float:
    text = value.strip().lower()
    scale = SUFFIX.get(text[-1:], 1.0)
    try:
        number = float(text[:-1] if text[-1:] in SUFFIX else text) * scale
    except ValueError:
        raise _bad(key, value, "expected a number like 330M or 25.6M") from None
    if not number > 0 or not math.isfinite(number):
        raise _bad(key, value, "must be positive")
    return number


def _seconds(key: str, value: str) -> float:
    text = value.strip().lower()
    for suffix in ("ms", "us", "s"):
        if text.endswith(suffix):
            try:
                number = float(text.removesuffix(suffix)) * TIME[suffix]
            except ValueError:
                break
            if number >= 0 and math.isfinite(number):
                return number
    raise _bad(key, value, "expected a time like 120ms, 5us or 0.3s")


def _link(key: str, value: str) -> tuple[float, float]:
    rate, _, latency = value.partition(":")
    text = rate.strip().lower()
    for suffix, scale in RATE.items():
        if text.endswith(suffix):
            try:
                number = float(text.removesuffix(suffix)) * scale
            except ValueError:
                break
            if number > 0 and math.isfinite(number):
                return number, _seconds(key, latency) if latency else 0.0
    raise _bad(key, value, "expected RATE[:LATENCY] like 200gbit:5us")


def parse(spec: str) -> dict[str, Any]:
    """The spec's values, typed; a missing or unknown key is a one-line UserError."""
    found: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in KEYS:
            raise UserError(f"--what-if: {item.strip()!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
        found[key] = value.strip()
    missing = [k for k in REQUIRED if k not in found]
    if missing:
        raise UserError(f"--what-if needs {', '.join(missing)} (e.g. params=25.6M,compute=120ms@32,gpus-per-node=8,"
                        "intra=2400gbit:2us,inter=100gbit:5us)")
    seconds, _, at = found["compute"].partition("@")
    out: dict[str, Any] = {
        "params": _count("params", found["params"]), "compute": _seconds("compute", seconds),
        "compute_batch": int(_count("compute", at)) if at else None,
        "gpus_per_node": int(_count("gpus-per-node", found["gpus-per-node"])),
        "intra": _link("intra", found["intra"]), "inter": _link("inter", found["inter"]),
        "global": int(_count("global", found["global"])) if "global" in found else None,
        "batch": int(_count("batch", found["batch"])) if "batch" in found else None,
        "grad_bytes": int(_count("grad-bytes", found.get("grad-bytes", "4"))),
        "overhead": _seconds("overhead", found["overhead"]) if "overhead" in found else None,
        "overlap": found.get("overlap", "yes").lower(),
    }
    if out["compute_batch"] is None:
        raise _bad("compute", found["compute"], "give the batch it was measured at, like 120ms@32")
    if out["overlap"] not in ("yes", "no"):
        raise _bad("overlap", found["overlap"], "yes or no")
    if out["grad_bytes"] not in (2, 4):
        raise _bad("grad-bytes", found["grad-bytes"], "2 (fp16/bf16 all-reduce) or 4 (float32)")
    return out


def model(spec: dict[str, Any]) -> tuple[CostModel, str]:
    """The cost model of ``spec`` (one GPU, as if it had run), and the scaling kind ("strong" or "weak")."""
    b0 = spec["compute_batch"]
    overhead = spec["overhead"] or 0.0
    facts = Facts(
        slots=1, hosts=1, device="cuda", cores=1, threads=1,
        per_slot_batch=b0, global_batch=b0, parameters=int(spec["params"]), aggregation=1,
        compression="fp16" if spec["grad_bytes"] == 2 else "none", fusion_mb=None, buckets=0.0, data=0.0,
        compute=spec["compute"], backward_share=2 / 3, fixed=overhead, step=spec["compute"] + overhead,
        work=Work({1: (0.0, spec["compute"] / b0)}), threads_probed=True, concurrent_work=None, load_growth=0.0,
        overlap=spec["overlap"] == "yes", batch_given=True)
    rate, latency = spec["intra"]
    inter_rate, inter_latency = spec["inter"]
    between = Link(inter_rate, inter_latency, f"{inter_rate * 8 / 1e9:g} Gbit/s, {1e6 * inter_latency:g} us")
    sources = [
        Source("compute", f"{1e3 * spec['compute']:g} ms for {b0} samples per GPU, proportional to the batch",
               "given"),
        Source("backward share of compute", "2/3 (backward about twice forward)", "assumed"),
        Source("link within a node", f"{rate * 8 / 1e9:g} Gbit/s, {1e6 * latency:g} us per ring step", "given"),
        Source("link between nodes", between.label + " per node", "given"),
        Source("per-step overhead", f"{1e3 * overhead:g} ms", "given" if spec["overhead"] is not None else "assumed"),
        Source("exchange cost beyond the link (waking up)", "0", "assumed"),
        Source("stragglers: one GPU's step-to-step spread, of its compute",
               f"{100 * fitted.load().terms['paper_jitter']:.2g}% (each step waits for the slowest of N)", "fitted"),
    ]
    built = CostModel(facts, RingLink(latency, rate), "given", 0.0, between, 0.0, "assumed", 1.0, 1.0, sources)
    return built, "strong" if spec["global"] is not None else "weak"


def target(spec: dict[str, Any], gpus: int) -> Target:
    """``gpus`` GPUs of ``spec``: its nodes from GPUs per node, its global batch (given, or per GPU x GPUs)."""
    per_node = spec["gpus_per_node"]
    if gpus == 1:
        return Target(1, 1, spec["global"] or spec["batch"] or spec["compute_batch"], threads=1)
    per_gpu = spec["batch"] or spec["compute_batch"]
    return Target(gpus, max(1, math.ceil(gpus / per_node)), spec["global"] or per_gpu * gpus, threads=1, cores=per_node)


def plan_on_paper(text: str, slot_counts: list[int]) -> dict[str, Any]:
    """``dtrain plan --what-if``'s document: one row per GPU count (nodes from GPUs per node)."""
    spec = parse(text)
    if max(slot_counts) > MAX_GPUS:
        raise UserError(f"--slots: at most {MAX_GPUS} GPUs on paper, got {max(slot_counts)}")
    built, kind = model(spec)
    one = built.predict(target(spec, 1))
    rows, widest = [], ""
    for n in slot_counts:
        pred = built.predict(target(spec, n))
        nodes = pred.target.nodes
        rows.append({"slots": n, "nodes": nodes, "option": "base", "change": f"{kind} scaling",
                     "samples_per_second": pred.samples_per_second, "low": pred.samples_per_second_low,
                     "high": pred.samples_per_second_high,
                     "efficiency": pred.samples_per_second / (n * one.samples_per_second),
                     "seconds_per_step": pred.step, "seconds_per_step_low": pred.low,
                     "seconds_per_step_high": pred.high, "parts_seconds": pred.parts, "seconds_to_finish": None,
                     "finish": None, "widest_input": WIDEST.get(pred.widest, pred.widest),
                     "terms": explained(built, target(spec, n))})
        widest = WIDEST.get(pred.widest, pred.widest)
    if widest:
        built.sources.append(Source("widens the interval most (at the most GPUs)", widest, "fitted"))
    return {"run_dir": None, "what_if": text, "scaling": kind,
            "measured": {"slots": 1, "nodes": 1, "samples_per_second": one.samples_per_second,
                         "model_samples_per_second": one.samples_per_second},
            "link": None, "total_batches": None, "inputs": [s.to_json() for s in built.sources],
            "interval": "80%", "predictions": rows}

