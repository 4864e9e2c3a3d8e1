"""dtrain on one GPU next to a plain loop, per precision: steady throughput, the first steps, MFU, and the
operations and kernels one step runs.

    .venv/bin/python bench/gpu.py [--steps 200] [--warmup 30] [--batch 32] [--rounds 3] [--ops 5] [--json FILE]

Workload: the GPT-like causal LM of bench/models.py (6 layers, d=512, 8 heads, vocab 8192, 256 tokens,
27.4M parameters), batch 32, AdamW lr 3e-4, random tokens, 1 slot on ``cuda:0``.

Rows, run alternately round after round (so drift hits all alike):

* plain loops, pinned memory and non-blocking copies, nothing else: ``fp32``; ``tf32``; ``bf16`` (autocast
  around forward and loss, backward and optimizer outside); ``fp16`` (the same in float16, with
  ``torch.amp.GradScaler``: scale, step, update); ``bf16-resident``: bf16 on one batch kept on the device;
* ``dtrain run`` with ``precision`` 32-true / tf32 / bf16-mixed / 16-mixed, profiling on, 32-true with
  profiling off, and bf16-mixed on ``data_loader.synthetic`` (one batch kept on the device), held against
  ``bf16-resident``: where the bf16 gap closes without a data path, the data path (the loader, the side
  stream's copy) is where it was.

Steady state: plain loops time steps ``warmup``..``steps`` between two device synchronizations; dtrain rows
give ``summary.json``'s ``samples_per_second`` (device-timed profiled steps after ``warmup``) and
``samples_per_second_all_steps`` (every step over device-synchronized time). First steps: the plain loop's
time from its first batch to the end of step ``warmup`` (synchronized); dtrain's ``first_steps`` (time to
the first step from the worker's start, and the warm-up steps' excess over steady ones). The targets of
issue 46: dtrain at >= 0.98 of the plain loop in bf16, >= 0.97 in fp16, 1.00 in fp32 (steady state).

``dtrain doctor --try precision=...`` on the profiled fp32 run is held against the precision rows' measured
gains, and ``--try hyperparameters.global_batch_size=2B`` on the fp32 and bf16-mixed runs against those
precisions run again at twice the batch (issue 45: within +/-20% on a GPU).

``--ops N`` then profiles N steady steps of the plain bf16 loop and of dtrain's bf16-mixed run with
torch.profiler (CPU and CUDA): per step, the aten operations and CUDA kernels of each and the ones that
differ, and the host time of a step. That says where a gap comes from, where the timings only say that
there is one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROOT = HERE.parent

TRIAL = '''
import json
import time
import torch
import dtrain
from models import GPT, RandomTokens, lm_loss
from gpu import count_ops


class _Ops(dtrain.LoopCallback):
    def __init__(self, first, steps, out):
        self.first, self.steps, self.out, self.profiler = first, steps, out, None

    def on_step_end(self, batch_idx):
        if batch_idx == self.first - 1:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            self.profiler.start()
            self.start = time.perf_counter()
        elif batch_idx == self.first + self.steps - 1:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            host = (time.perf_counter() - self.start) / self.steps
            self.profiler.stop()
            with open(self.out, "w") as f:
                json.dump(count_ops(self.profiler, self.steps, host), f)


class GPTTrial(dtrain.PyTorchTrial):
    def __init__(self, context):
        super().__init__(context)
        self.hp = context.get_hparams()
        self.model = context.wrap_model(GPT())
        self.opt = context.wrap_optimizer(torch.optim.AdamW(self.model.parameters(), lr=3e-4))

    def build_training_data(self):
        return RandomTokens(records=8192)

    def build_callbacks(self):
        out = self.hp.get("ops_out")
        return {"ops": _Ops(self.hp["ops_first"], self.hp["ops_steps"], out)} if out else {}

    def train_batch(self, batch, epoch_idx, batch_idx):
        tokens, targets = batch
        loss = lm_loss(self.model(tokens), targets)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}
'''

PLAIN = ("fp32", "tf32", "bf16", "fp16", "bf16-resident")
# (precision, profiling, synthetic data). Synthetic: one batch kept on the device, as the plain loop's
# "-resident" variant: the pair without any data path, so a gap that closes there is the data path's.
DTRAIN = (("32-true", True, False), ("32-true", False, False), ("tf32", True, False), ("bf16-mixed", True, False),
          ("16-mixed", True, False), ("bf16-mixed", True, True))
# Precisions also run at twice the batch: the doctor's --try global_batch_size on the batch's run is held
# against them (issue 45: within +/-20%). fp32 is the device's bound here; bf16 the host's.
DOUBLED = ("32-true", "bf16-mixed")
PRECISION_TRIES = ("tf32", "bf16-mixed", "16-mixed")
# Which plain loop each dtrain precision is held against.
BASELINE = {"32-true": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def baseline(precision: str, synthetic: bool) -> str:
    return "bf16-resident" if synthetic else BASELINE[precision]


def count_ops(profiler: Any, steps: int, host_seconds: float) -> dict[str, Any]:
    """Per step: aten operations and CUDA kernels by name (torch.profiler's events), and host seconds."""
    ops: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += 1
        elif event.name.startswith("aten::"):
            ops[event.name] += 1
    return {"ops": {k: v / steps for k, v in ops.items()}, "kernels": {k: v / steps for k, v in kernels.items()},
            "host_seconds_per_step": host_seconds}


GPU = torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
               dtype: torch.dtype | None, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    """One step of the hand-written loop: autocast around forward and loss (``dtype`` None: none), backward,
    the optimizer's step, through ``scaler`` where fp16 has one."""
    from models import lm_loss

    with torch.autocast(tokens.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = lm_loss(model(tokens), targets)
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()


def plain_loop(variant: str, steps: int, warmup: int, batch: int, ops_steps: int = 0,
               device: torch.device = GPU) -> dict[str, Any]:
    """A hand-written loop (see the module's doc): steady samples/s and the first steps' seconds; with
    ``ops_steps``, the operations of that many steps after the warm-up instead. ``...-resident``: one batch
    copied to the device once and used at every step (no data path)."""
    from models import GPT, RandomTokens

    precision, resident = variant.removesuffix("-resident"), variant.endswith("-resident")
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.manual_seed(0)
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    loader: Any = torch.utils.data.DataLoader(RandomTokens(records=8192), batch_size=batch, shuffle=True,
                                              drop_last=True, pin_memory=device.type == "cuda")
    last = warmup + ops_steps if ops_steps else steps
    if resident:
        one = [t.to(device) for t in next(iter(loader))]
        loader = [one] * (last + 1)
    profiler, out = None, {}
    _sync(device)
    begin = start = time.perf_counter()
    for i, (tokens, targets) in enumerate(loader):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
            out["first_steps_seconds"] = start - begin
            if ops_steps:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                profiler.start()
        if i == last:
            break
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        plain_step(model, opt, scaler, dtype, tokens, targets)
    _sync(device)
    seconds = time.perf_counter() - start
    torch.backends.cuda.matmul.allow_tf32 = False
    if last > len(loader):
        raise SystemExit(f"--steps {last} is more than the loader's {len(loader)} batches")
    if profiler is not None:
        profiler.stop()
        return count_ops(profiler, ops_steps, seconds / ops_steps)
    return {**out, "steady": (last - warmup) * batch / seconds}


def dtrain_run(precision: str, profiling: bool, synthetic: bool, steps: int, warmup: int, batch: int, tmp: Path,
               ops_steps: int = 0, tries: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``dtrain run`` of the GPT trial; its summary's figures (or, with ``ops_steps``, its operations), and
    what ``dtrain doctor --try`` says of it for each of ``tries``."""
    (tmp / "gpt_trial.py").write_text(TRIAL)
    (tmp / "models.py").write_text((HERE / "models.py").read_text())
    (tmp / "gpu.py").write_text(Path(__file__).read_text())
    ops_out = tmp / f"ops-{precision}.json"
    hparams: dict[str, Any] = {"global_batch_size": batch}
    if ops_steps:
        hparams.update(ops_out=str(ops_out), ops_first=warmup, ops_steps=ops_steps)
        steps = warmup + ops_steps + 1
    config = {"name": "gpu", "entrypoint": "gpt_trial:GPTTrial", "hyperparameters": hparams,
              "resources": {"slots_per_trial": 1}, "max_length": {"batches": steps}, "scheduling_unit": 50,
              "precision": precision, "profiling": {"enabled": profiling, "warmup_steps": warmup},
              "data_loader": {"synthetic": synthetic}}
    import yaml

    cfg = tmp / "gpu.yaml"
    cfg.write_text(yaml.safe_dump(config))
    run_dir = tmp / f"run-{precision}-{profiling}-{synthetic}-{time.monotonic_ns()}"
    subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1200)
    if ops_steps:
        return json.loads(ops_out.read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    profile_file = run_dir / "profile.json"
    steps_probed = json.loads(profile_file.read_text()).get("model_steps") if profile_file.exists() else None
    first = summary.get("first_steps") or {}
    doctor = ask_doctor(run_dir, tries) if tries else None
    return {"all_steps": summary["samples_per_second_all_steps"], "steady": summary["samples_per_second"],
            "time_to_first_step": first.get("time_to_first_step_seconds"), "first_steps_seconds": first.get("seconds"),
            "first_steps_excess": first.get("excess_seconds"), "mfu": (summary.get("flops") or {}).get("mfu"),
            "breakdown": summary.get("step_breakdown_seconds", {}), "doctor": doctor, "model_steps": steps_probed}


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def doctor_tries(precision: str, profiling: bool, synthetic: bool, batch: int) -> tuple[str, ...]:
    """What the doctor is asked of a run at the bench's batch: other precisions (of the fp32 run), twice the
    batch (of the runs :data:`DOUBLED` also measures)."""
    if not profiling or synthetic:
        return ()
    tries = tuple(f"precision={p}" for p in PRECISION_TRIES) if precision == "32-true" else ()
    return tries + ((f"hyperparameters.global_batch_size={2 * batch}",) if precision in DOUBLED else ())


def ask_doctor(run_dir: Path, tries: tuple[str, ...]) -> dict[str, Any]:
    """What ``dtrain doctor --try`` predicts for the run (issue 45: within +/-20% of the measured gain on a
    GPU): gain and 80% interval per change (a precision by its name, twice the batch as ``batch=N``), or why
    it cannot say."""
    argv = [sys.executable, "-m", "dtrain.cli", "doctor", str(run_dir), "--json",
            *[a for t in tries for a in ("--try", t)]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    answers = json.loads(done.stdout)["tries"]
    said: dict[str, Any] = {str(t["value"]) if t["key"] == "precision" else f"batch={t['value']}":
                            {k: t[k] for k in ("gain", "low", "high", "reason")} for t in answers}
    # What the predictions rest on, kept so that a prediction far off can be taken apart after the lease.
    profile = json.loads((run_dir / "profile.json").read_text())
    said["_inputs"] = {k: profile.get(k) for k in ("model_steps", "seconds_per_step", "device_facts")}
    said["_profile"] = profile  # whole: a later model can be asked the same question (dtrain doctor on a copy)
    return said


def print_doctor(ours: dict[tuple[str, bool, bool], list[dict[str, Any]]],
                 doubled: dict[str, list[dict[str, Any]]]) -> None:
    """The doctor's predictions against the gains measured: other precisions from the fp32 run (the precision
    rows), twice the batch from each run :data:`DOUBLED` also ran at twice the batch."""
    header = False
    for run_precision in ("32-true", *[p for p in DOUBLED if p != "32-true"]):
        runs = ours.get((run_precision, True, False), [])
        base = _median([r["steady"] for r in runs])
        asked = [r.get("doctor") for r in runs if r.get("doctor")]
        if not asked or not base:
            continue
        if "error" in asked[0]:
            print(f"\ndtrain doctor failed on the {run_precision} run: {asked[0]['error']}")
            continue
        if not header:
            print("\n| dtrain doctor on the run --try | predicted gain (80% interval) | measured (steady) | error |")
            print("|---|---|---|---|")
            header = True
        for change, said in asked[0].items():
            if change.startswith("_"):
                continue
            batched = change.startswith("batch=")
            other = doubled.get(run_precision, []) if batched else ours.get((change, True, False), [])
            measured = _median([r["steady"] for r in other])
            gain = measured / base if measured else None
            what = f"{run_precision} run: {change if batched else f'precision={change}'}"
            if said["gain"] is None:
                print(f"| {what} | none: {said['reason']} | {'-' if gain is None else f'{gain:.2f}x'} | - |")
                continue
            error = f"{100 * (said['gain'] / gain - 1):+.0f}%" if gain else "-"
            print(f"| {what} | {said['gain']:.2f}x ({said['low']:.2f}-{said['high']:.2f}) | "
                  f"{_fmt(gain, '.2f')}x | {error} |")


def plain_all_steps(run: dict[str, Any], steps: int, warmup: int, batch: int) -> float:
    """A plain loop's samples/s over all its steps: its first steps' seconds plus the steady ones'."""
    return steps * batch / (run["first_steps_seconds"] + (steps - warmup) * batch / run["steady"])


def dtrain_wall_steady(run: dict[str, Any], steps: int, warmup: int, batch: int) -> float:
    """A dtrain run's samples/s on the wall clock after its warm-up steps, as the plain loop's steady state is
    timed: all its steps' time less its first steps'. Its own steady figure times each step from start to end
    and leaves out the trainer's work between steps (reports, metric sums), which a host-bound step pays."""
    train_seconds = steps * batch / run["all_steps"]
    return (steps - warmup) * batch / (train_seconds - run["first_steps_seconds"])


def print_tables(plain: dict[str, list[dict[str, Any]]], ours: dict[tuple[str, bool, bool], list[dict[str, Any]]],
                 steps: int, warmup: int, batch: int) -> None:
    """Steady rows are held against their plain loop's steady state, dtrain's own (device-timed steps) and on
    the wall clock as the plain loop is; a run without profiling has no steady state of its own (its samples/s
    are all its steps'), so it is held against the plain loop's all steps."""
    print("\n| what | steady samples/s | vs its plain loop | wall clock steady | vs plain, wall clock | all steps | "
          "first steps s | to first step s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    all_plain = {v: _median([plain_all_steps(r, steps, warmup, batch) for r in runs]) for v, runs in plain.items()}
    for variant, runs in plain.items():
        steady = _median([r["steady"] for r in runs]) or 0.0
        print(f"| plain loop, {variant} | {steady:,.0f} | 1.00 | {steady:,.0f} | 1.00 | {all_plain[variant]:,.0f} | "
              f"{_fmt(_median([r['first_steps_seconds'] for r in runs]), '.2f')} | - | - |")
    for (precision, profiling, synthetic), runs in ours.items():
        base = baseline(precision, synthetic)
        steady = _median([r["steady"] for r in runs]) or 0.0
        mfu, all_steps = _median([r["mfu"] for r in runs]), _median([r["all_steps"] for r in runs]) or 0.0
        first, to_first = (_median([r[k] for r in runs]) for k in ("first_steps_seconds", "time_to_first_step"))
        name = f"dtrain, {precision}, profiling {'on' if profiling else 'off'}" + (", synthetic" if synthetic else "")
        reference = _median([r["steady"] for r in plain[base]]) or 1.0
        if profiling:
            wall = _median([dtrain_wall_steady(r, steps, warmup, batch) for r in runs]) or 0.0
            shown, ratio = f"{steady:,.0f}", f"{steady / reference:.3f}"
            wall_shown, wall_ratio = f"{wall:,.0f}", f"{wall / reference:.3f}"
        else:
            shown, ratio = "-", f"{all_steps / (all_plain[base] or 1.0):.3f} (all steps)"
            wall_shown, wall_ratio = "-", "-"
        print(f"| {name} | {shown} | {ratio} | {wall_shown} | {wall_ratio} | {all_steps:,.0f} | {_fmt(first, '.2f')} | "
              f"{_fmt(to_first, '.2f')} | {'-' if mfu is None else f'{100 * mfu:.1f}%'} |")


def print_op_diff(plain: dict[str, Any], ours: dict[str, Any]) -> None:
    """What dtrain's bf16 step runs that the plain bf16 loop's does not, and the reverse, per step."""
    for kind in ("ops", "kernels"):
        a, b = plain[kind], ours[kind]
        diff = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)),
                      key=lambda d: -abs(d[0]))
        print(f"\n{kind} per step: plain bf16 {sum(a.values()):.0f}, dtrain bf16-mixed {sum(b.values()):.0f}; "
              f"differences (dtrain - plain), largest first:")
        for delta, name in diff[:25]:
            print(f"  {delta:+8.2f}  {name[:110]}")
    print(f"\nhost seconds per step (profiled): plain {1e3 * plain['host_seconds_per_step']:.2f} ms, dtrain "
          f"{1e3 * ours['host_seconds_per_step']:.2f} ms")


def _write(path: Path | None, name: str, args: argparse.Namespace, plain: dict[str, list[dict[str, Any]]],
           ours: dict[tuple[str, bool, bool], list[dict[str, Any]]], ops: dict[str, Any],
           doubled: dict[str, list[dict[str, Any]]]) -> None:
    """Every figure so far: written after each row, so a run cut off by its time limit keeps what it measured."""
    if path is not None:
        path.write_text(json.dumps({"device": name, "torch": torch.__version__,
                                    "args": {k: str(v) for k, v in vars(args).items()}, "plain": plain,
                                    "dtrain": {f"{p}/{'on' if on else 'off'}{'/synthetic' if syn else ''}": r
                                               for (p, on, syn), r in ours.items()},
                                    "doubled": doubled, "ops": ops}, indent=2))


def _dtrain_row(row: tuple[str, bool, bool], args: argparse.Namespace, tmp: Path,
                batch: int = 0) -> dict[str, Any] | None:
    """One dtrain row (at ``batch``, else the bench's), or None (said on stderr) where its run failed: the other
    rows still get measured. The doctor is asked of rows at the bench's batch."""
    try:
        return dtrain_run(*row, args.steps, args.warmup, batch or args.batch, tmp,
                          tries=() if batch else doctor_tries(*row, args.batch))
    except (subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
        print(f"  dtrain {row} failed: {exc}", file=sys.stderr, flush=True)
        return None


def reprint(path: Path) -> None:
    """The tables of a stored ``--json`` file (its own steps, warm-up and batch)."""
    stored = json.loads(path.read_text())
    steps, warmup, batch = (int(stored["args"][k]) for k in ("steps", "warmup", "batch"))
    print(f"{stored['device']}, torch {stored['torch']}, steps {warmup}..{steps}, batch {batch}")
    rows = {(p, on == "on", rest == ["synthetic"]): runs for key, runs in stored["dtrain"].items()
            for p, on, *rest in [key.split("/")] if runs}
    print_tables(stored["plain"], rows, steps, warmup, batch)
    print_doctor(rows, stored.get("doubled", {}))
    if stored.get("ops"):
        print_op_diff(stored["ops"]["plain"], stored["ops"]["dtrain"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(PLAIN),
                        help="plain loops to run, comma-separated, and the dtrain rows held against them (more "
                             "rounds of fewer rows in a short GPU lease; the doctor's row needs fp32)")
    parser.add_argument("--ops", type=int, default=0, help="profile this many bf16 steps of each (0: none)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here (after each row)")
    parser.add_argument("--smoke-on-cpu", action="store_true",
                        help="run every row on the CPU (no fp16 rows): checks the script, measures nothing useful")
    parser.add_argument("--table", type=Path, default=None, help="print the tables of a stored --json file")
    args = parser.parse_args()
    if args.table is not None:
        reprint(args.table)
        return
    device = torch.device("cpu") if args.smoke_on_cpu else GPU
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)"
    only = set(args.only.split(","))
    if not only <= set(PLAIN):
        sys.exit(f"--only: unknown {sorted(only - set(PLAIN))}; choose among {', '.join(PLAIN)}")
    variants = [v for v in PLAIN if v in only and (device.type == "cuda" or v != "fp16")]
    rows = [r for r in DTRAIN if baseline(r[0], r[2]) in variants]
    print(f"dtrain GPU bench: {name}, torch {torch.__version__}, GPT-like LM, batch "
          f"{args.batch}, steps {args.warmup}..{args.steps}, {args.rounds} rounds", flush=True)
    plain: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    ours: dict[tuple[str, bool, bool], list[dict[str, Any]]] = {r: [] for r in rows}
    ops: dict[str, Any] = {}
    doubled: dict[str, list[dict[str, Any]]] = {p: [] for p in DOUBLED if (p, True, False) in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for variant in variants:
                plain[variant].append(plain_loop(variant, args.steps, args.warmup, args.batch, device=device))
                print(f"  round {i}: plain {variant} {plain[variant][-1]['steady']:,.0f} samples/s", flush=True)
                _write(args.json, name, args, plain, ours, ops, doubled)
            for row in rows:
                result = _dtrain_row(row, args, Path(tmp))
                if result is not None:
                    ours[row].append(result)
                    print(f"  round {i}: dtrain {row} {result['steady']:,.0f} samples/s steady, "
                          f"{result['all_steps']:,.0f} all steps", flush=True)
                _write(args.json, name, args, plain, ours, ops, doubled)
            for precision in doubled:
                result = _dtrain_row((precision, True, False), args, Path(tmp), batch=2 * args.batch)
                if result is not None:
                    doubled[precision].append(result)
                    print(f"  round {i}: dtrain {precision} at batch {2 * args.batch} {result['steady']:,.0f} "
                          "samples/s steady", flush=True)
                _write(args.json, name, args, plain, ours, ops, doubled)
        print_tables(plain, {r: runs for r, runs in ours.items() if runs}, args.steps, args.warmup, args.batch)
        print_doctor(ours, doubled)
        if args.ops:
            ops = {"plain": plain_loop("bf16", args.steps, args.warmup, args.batch, ops_steps=args.ops, device=device),
                   "dtrain": dtrain_run("bf16-mixed", True, False, args.steps, args.warmup, args.batch,
                                        Path(tmp), ops_steps=args.ops)}
            _write(args.json, name, args, plain, ours, ops, doubled)
            print_op_diff(ops["plain"], ops["dtrain"])


if __name__ == "__main__":
    main()
