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
