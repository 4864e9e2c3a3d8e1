"""``dtrain compare``: the same trial under several weight-synchronization strategies, side by side.

Each strategy trains for the same number of steps on the same slots (a parameter server turns
``sync.parameter_server.servers`` of them into servers, so it has fewer workers: same hardware, not same
workers), then the table compares throughput, communication, memory and what was learned.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dtrain.config.model import samples_only_sets
from dtrain.config.schema import load_config
from dtrain.errors import UserError
from dtrain.explain.render import as_text, pyplot
from dtrain.launcher import runs
from dtrain.launcher.runplan import NodeArgs
from dtrain.profiling.record import load_profile
from dtrain.profiling.runsummary import load_summary
from dtrain.sync import registry


def parse_strategies(text: str | None) -> list[str]:
    """``--strategies`` (comma-separated; None: every registered strategy)."""
    known = registry.names()
    if text is None:
        return list(known)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise UserError(f"--strategies expects a comma-separated list from {', '.join(known)}; got {text!r}"
                        + (f" ({registry.unknown_message(unknown[0])})" if unknown else ""))
    return list(dict.fromkeys(names))


def run_strategy(config: Path, strategy: str, steps: int, out: Path, overrides: list[str],
                 nodes: NodeArgs | None, debug: bool) -> dict[str, Any] | None:
    sets = [*overrides, f"sync.strategy={strategy}", f"max_length={{batches: {steps}}}",
            # The last training report (the "final loss") averages the last tenth of the run.
            "min_validation_period=null", "min_checkpoint_period=null", f"scheduling_unit={max(1, steps // 10)}",
            "profiling.enabled=true"]
    plan = runs.prepare(config, sets, run_dir=out / strategy, resume=None, nodes=nodes)
    failure = runs.execute(plan, quiet=True, debug=debug)
    if failure is not None:
        raise UserError(f"compare: strategy {strategy} failed on rank {failure.rank}: {failure.message}")
    if not plan.chief:
        return None
    return summarize_run(plan.run_dir, strategy)


def summarize_run(run_dir: Path, strategy: str) -> dict[str, Any]:
    profile = load_profile(run_dir / "profile.json")
    summary = load_summary(run_dir / "summary.json")
    training = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
                if json.loads(ln)["kind"] == "training"]
    ranks = profile.per_rank
    # A strategy whose communication dtrain cannot see (FSDP's hooks) shows "not measured", not zero.
    measured = profile.comm_measured
    return {
        "strategy": strategy,
        "workers": profile.slots,
        "samples_per_second": profile.samples_per_second,
        "comm_bytes_per_step": profile.comm.bytes_per_step if measured else None,
        "exposed_comm_seconds_per_step": profile.comm.exposed_seconds_per_step if measured else None,
        "step_seconds": profile.seconds_per_step.step.mean,
        "peak_memory_bytes_per_rank": max(r.peak_memory_bytes for r in ranks),
        "state_bytes_per_rank": max(r.state_bytes for r in ranks),
        "final_loss": training[-1]["metrics"].get("loss") if training else None,
        "validation": summary.validation,
        "run_dir": str(run_dir),
    }


def render_table(rows: list[dict[str, Any]]) -> str:
    from rich.table import Table

    table = Table(title="dtrain compare: same trial, same steps, same slots")
    for col in ("strategy", "workers", "samples/s", "comm MB/step", "exposed comm ms/step", "peak RSS MB/rank",
                "params+optim MB/rank", "final loss", "validation"):
        table.add_column(col, justify="left" if col in ("strategy", "validation") else "right")
    for r in rows:
        val = ", ".join(f"{k} {v:.4f}" for k, v in r["validation"].items())
        loss = f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-"
        comm, exposed = r["comm_bytes_per_step"], r["exposed_comm_seconds_per_step"]
        table.add_row(r["strategy"], str(r["workers"]), f"{r['samples_per_second']:,.0f}",
                      f"{comm / 1e6:.3f}" if comm is not None else "not measured",
                      f"{1e3 * exposed:.2f}" if exposed is not None else "not measured",
                      f"{r['peak_memory_bytes_per_rank'] / 2**20:.0f}", f"{r['state_bytes_per_rank'] / 2**20:.3f}",
                      loss, val or "-")
    return as_text(table, width=160)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    names = [r["strategy"] for r in rows]
    panels = [("samples/s", [r["samples_per_second"] for r in rows]),
              ("exposed comm (ms/step)", [1e3 * (r["exposed_comm_seconds_per_step"] or 0) for r in rows]),
              ("comm (MB/step)", [(r["comm_bytes_per_step"] or 0) / 1e6 for r in rows]),
              ("params+optimizer (MB/rank)", [r["state_bytes_per_rank"] / 2**20 for r in rows])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color="tab:blue")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(config: Path, strategies: list[str], steps: int, out: Path | None, overrides: list[str],
            nodes: NodeArgs | None, debug: bool) -> Path | None:
    """Run each strategy; the chief writes compare.json, compare.txt and compare.png under ``out``."""
    cfg = load_config(config, overrides)
    overrides = [*samples_only_sets(cfg), *overrides]
    out = out or Path("runs") / f"compare-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for strategy in strategies:
        print(f"dtrain compare: {strategy} ...", flush=True)
        row = run_strategy(config, strategy, steps, out, overrides, nodes, debug)
        if row is not None:
            rows.append(row)
    if not rows:  # not the chief node: it only took part
        return None
    table = render_table(rows)
    (out / "compare.json").write_text(json.dumps(rows, indent=2))
    (out / "compare.txt").write_text(table)
    plot(rows, out / "compare.png")
    print(table, end="")
    print(f"dtrain compare: results in {out} (compare.json, compare.txt, compare.png)")
    return out


# ------------------------------------------------------------------ dtrain compare RUN_A RUN_B: two runs, side by side
def _run_row(run_dir: Path) -> dict[str, Any]:
    """One run's figures for the side-by-side table (a Trial's or a script's run)."""
    from dtrain.explain.doctor import diagnose
    from dtrain.profiling.phases import PHASES
    from dtrain.profiling.record import load_run_profile

    p = load_run_profile(run_dir)
    d = diagnose(p)
    top = d.factor(d.top_factor) if d.top_factor else None
    return {"run_dir": str(run_dir), "slots": p.slots, "global_batch_size": p.global_batch_size,
            "samples_per_second": p.samples_per_second, "step_seconds": p.seconds_per_step.step.mean,
            "phases": {ph: p.seconds_per_step.of(ph).mean for ph in PHASES},
            "comm_bytes_per_step": p.comm.bytes_per_step if p.comm_measured else None,
            "top_factor": top.factor if top else None, "top_share": top.share if top else None,
            "script_sha256": p.script.script_sha256 if p.script is not None else None,
            "findings": [f.name for f in d.script_findings]}


def compare_runs(run_a: Path, run_b: Path) -> dict[str, Any]:
    """Two run directories' figures, and B over A where a ratio means something."""
    a, b = _run_row(run_a), _run_row(run_b)
    speedup = b["samples_per_second"] / a["samples_per_second"] if a["samples_per_second"] else None
    return {"a": a, "b": b, "speedup": speedup}


def render_runs(result: dict[str, Any]) -> str:
    """The side-by-side table: samples/s, the step and each phase, bytes all-reduced, the top factor."""
    from rich.table import Table

    a, b = result["a"], result["b"]
    table = Table(title=f"dtrain compare: A {a['run_dir']}  vs  B {b['run_dir']}")
    for col in ("", "A", "B", "B / A"):
        table.add_column(col, justify="left" if not col else "right")

    def row(name: str, x: float | None, y: float | None, fmt: str) -> None:
        ratio = f"{y / x:.2f}x" if x and y is not None else "-"
        table.add_row(name, format(x, fmt) if x is not None else "-", format(y, fmt) if y is not None else "-", ratio)

    row("samples/s", a["samples_per_second"], b["samples_per_second"], ",.0f")
    table.add_row("slots x global batch", f"{a['slots']} x {a['global_batch_size']}",
                  f"{b['slots']} x {b['global_batch_size']}", "")
    row("step ms", 1e3 * a["step_seconds"], 1e3 * b["step_seconds"], ".2f")
    for phase in a["phases"]:
        row(f"  {phase} ms", 1e3 * a["phases"][phase], 1e3 * b["phases"][phase], ".2f")
    mb = [r["comm_bytes_per_step"] / 1e6 if r["comm_bytes_per_step"] is not None else None for r in (a, b)]
    row("all-reduced MB/step", mb[0], mb[1], ".3f")
    table.add_row("top factor", *(f"{r['top_factor']} ({100 * r['top_share']:.0f}%)" if r["top_factor"] else "-"
                                  for r in (a, b)), "")
    table.add_row("script findings", *(", ".join(r["findings"]) or "-" for r in (a, b)), "")
    text = as_text(table, width=160)
    if a["script_sha256"] and b["script_sha256"]:
        same = a["script_sha256"] == b["script_sha256"]
        text += "the same script\n" if same else "the script differs between the runs (sha256)\n"
    return text


def cmd_compare(args: Any) -> int:
    """``dtrain compare CONFIG ...`` (strategies) or ``dtrain compare RUN_A RUN_B`` (two runs side by side)."""
    paths: list[Path] = list(args.config)
    if len(paths) == 2:
        missing = [str(p) for p in paths if not p.is_dir()]
        if missing:
            raise UserError(f"dtrain compare RUN_A RUN_B: {missing[0]!r} is not a run directory; pass two directories "
                            "made by dtrain run or dtrain launch")
        result = compare_runs(paths[0], paths[1])
        print(json.dumps(result, indent=2) if getattr(args, "json", False) else render_runs(result), end="")
        return 0
    if len(paths) != 1:
        raise UserError(f"dtrain compare takes one experiment YAML, or two run directories (RUN_A RUN_B); got "
                        f"{len(paths)} paths")
    config = paths[0]
    if config.is_dir():
        raise UserError(f"config {str(config)!r} is a directory; pass the experiment YAML file itself, or two run "
                        "directories to put side by side")
    overrides = [*args.overrides, *([f"resources.slots_per_trial={args.slots}"] if args.slots else [])]
    compare(config, parse_strategies(args.strategies), args.steps, args.out, overrides, NodeArgs.from_args(args),
            args.debug)
    return 0
