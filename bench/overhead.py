"""What dtrain costs per step next to a hand-written DDP loop, measured side by side.

    .venv/bin/python bench/overhead.py [--models mlp-0.1m,mlp-1m] [--rounds 15] [--window 300] [--slots 2]
    .venv/bin/python bench/overhead.py --models gpt --slots 1 --window 50      # on a GPU
    .venv/bin/python bench/overhead.py --models mlp-tiny --slots 1 --window 1000  # the fixed cost per step
    .venv/bin/python bench/overhead.py --trial-config '{"profiling": {"enabled": false}}'  # a Trial variant
    .venv/bin/python bench/overhead.py --models mlp-0.1m --rounds 10 --launches 12 --control  # resolve ~1%
    .venv/bin/python bench/overhead.py --modes raw,script      # an unmodified script, profiled from outside

Three ways to train the same model on the same data, each a job of ``--slots`` workers started by torch's
elastic agent (``torch.distributed.run``), 1 CPU thread per worker (``OMP_NUM_THREADS=1``):

* ``raw``: a plain DDP loop (DistributedSampler, DataLoader, ``loss.backward()``, ``opt.step()``);
* ``own``: the same loop through ``dtrain.init()`` (``ctx.setup``, ``ctx.loader``, ``ctx.backward``,
  ``ctx.step_optimizer``);
* ``trial``: a ``PyTorchTrial`` run by dtrain's trainer, profiling on (the default), reports every 100 steps;
* ``script`` (only where ``--modes`` names it): ``raw``'s loop unchanged, with dtrain's script profiler loaded
  from outside (``DTRAIN_PROFILE``, as ``dtrain launch`` and ``-m dtrain.profile`` load it): what profiling a
  user's own script costs it.

The three jobs run at the same time but take turns: after ``--warmup`` steps each job trains in windows of
``--window`` steps, and a window only starts when the driver says it is that job's turn (the others wait
between two steps, idle). A window is timed from the start of its first step to the start of the next
window's, device-synchronized at both ends on CUDA, so everything between steps counts. Each round runs
one window of every mode back to back (the order rotates), so a ratio compares windows a few seconds
apart: on a shared machine whose speed drifts by +/-15% from one minute to the next, fresh jobs per mode
(this script's first design) could not resolve a few percent. The table gives each mode's median steps/s
and the median of its per-round ratios to raw, and rank 0's CPU time per step (``time.process_time``, all
its threads) with the median per-round ratio raw/mode: the work a mode adds, without the waiting; a second
table splits that CPU time by thread (the loop's thread in user and kernel mode, all others) and counts
page faults and context switches per step (``getrusage``), which instruction counts
(bench/step_instructions.py) do not see. Goal: >= 0.98 everywhere. On the 2-core test machine rounds
spread by +/-20%, and two identical jobs (``--control``) land a few percent apart for a whole launch,
however many rounds it has: to resolve ~1%, take medians over many fresh launches (``--launches 12`` or
more) and compare only runs made side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODES = ("raw", "own", "trial")
SCRIPT = "script"
# A second, independent raw DDP job (``--control``): its ratio to raw is the bench's own noise floor, i.e. how
# far two identical jobs (fresh processes of the same code) land apart on this machine.
CONTROL = "raw-again"


# ------------------------------------------------------------------------------------ in a worker


class Turns:
    """This job's timed windows: after ``warmup`` steps, ``rounds`` windows of ``window`` steps, each
    started only on the driver's word (file ``go-<mode>-<k>`` in ``folder``); rank 0 answers with the
    window's steps/s (file ``done-<mode>-<k>``). Every rank says when it is warmed up (``ready-<mode>-<rank>``)
    and, after the last window, waits for ``go-<mode>-<rounds>`` to finish its run."""

    POLL_SECONDS = 0.005

    def __init__(self, args: argparse.Namespace, device: torch.device, rank: int) -> None:
        self.folder, self.mode = Path(args.turns), args.mode
        self.warmup, self.window, self.rounds = args.warmup, args.window, args.rounds
        self.device, self.rank = device, rank
        self.start = self.cpu_start = 0.0
        self.usage_start = resource.getrusage(resource.RUSAGE_SELF)
        self.main_start = resource.getrusage(resource.RUSAGE_THREAD)  # the training loop's thread

    @property
    def steps(self) -> int:
        """Steps the job trains: warm-up, the windows, and one more step that ends the last window."""
        return self.warmup + self.rounds * self.window + 1

    def at(self, step: int) -> None:
        """Call at the start of every step."""
        if step < self.warmup or (step - self.warmup) % self.window:
            return
        k = (step - self.warmup) // self.window
        if k > 0:
            speed = self.window / (self._now() - self.start)
            cpu_ms = 1e3 * (time.process_time() - self.cpu_start) / self.window
            usage = self._usage_per_step()
            if self.rank == 0:
                part = self.folder / f".done-{self.mode}-{k - 1}"
                part.write_text(json.dumps({"steps_per_second": speed, "cpu_ms_per_step": cpu_ms, **usage}))
                part.rename(self.folder / f"done-{self.mode}-{k - 1}")  # the driver never reads half a file
        if k == 0:  # warmed up: the driver starts round 0 once every rank of every job is here
            (self.folder / f"ready-{self.mode}-{self.rank}").touch()
        # After the last window too: no job's end of run (checkpoint, report) may overlap a timed window.
        go = self.folder / f"go-{self.mode}-{k}"
        while not go.exists():
            time.sleep(self.POLL_SECONDS)
        self.start = self._now()
        self.cpu_start = time.process_time()
        self.usage_start = resource.getrusage(resource.RUSAGE_SELF)
        self.main_start = resource.getrusage(resource.RUSAGE_THREAD)

    def _usage_per_step(self) -> dict[str, float]:
        """The window's CPU per step split by thread and mode (``getrusage``): the training loop's thread in
        user and kernel mode, every other thread (Gloo's, DataLoader's) together; and the process's page
        faults and voluntary context switches. Kernel time and faults are work instruction counts miss."""
        now, then = resource.getrusage(resource.RUSAGE_SELF), self.usage_start
        main, main_then = resource.getrusage(resource.RUSAGE_THREAD), self.main_start
        main_user, main_sys = main.ru_utime - main_then.ru_utime, main.ru_stime - main_then.ru_stime
        every = now.ru_utime + now.ru_stime - then.ru_utime - then.ru_stime
        return {"main_user_ms": 1e3 * main_user / self.window, "main_sys_ms": 1e3 * main_sys / self.window,
                "other_threads_ms": 1e3 * (every - main_user - main_sys) / self.window,
                "minor_faults": (now.ru_minflt - then.ru_minflt) / self.window,
                "voluntary_switches": (now.ru_nvcsw - then.ru_nvcsw) / self.window}

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _batches(loader: Any, sampler: Any) -> Any:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def run_raw(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from models import loss_of, workload
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model, data, kind = workload(args.model)
    model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None) if dist.get_world_size() > 1 else model
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True, pin_memory=cuda)
    turns = Turns(args, device, rank)
    for step, (x, y) in zip(range(turns.steps), _batches(loader, sampler), strict=False):
        turns.at(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = loss_of(kind, ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    dist.barrier()  # neither rank closes its connections while the other may still use them
    dist.destroy_process_group()


def run_own(args: argparse.Namespace) -> None:
    from models import loss_of, workload

    import dtrain

    ctx = dtrain.init(seed=0)
    model, data, kind = workload(args.model)
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = ctx.loader(data, batch_size=args.batch)
    turns = Turns(args, ctx.device, ctx.rank)
    epoch, step = 0, 0
    while step < turns.steps:
        ctx.set_epoch(epoch)
        for x, y in loader:
            if step == turns.steps:
                break
            turns.at(step)
            loss = loss_of(kind, model(ctx.to_device(x)), ctx.to_device(y))
            ctx.backward(loss)
            ctx.step_optimizer(opt)
            step += 1
        epoch += 1
    ctx.close()


def make_trial_class() -> type:
    from trials.workload import WorkloadTrial

    import dtrain

    class BenchTrial(WorkloadTrial):
        """The bench's workload as a Trial; takes its turns from inside ``train_batch``."""

        def __init__(self, context: dtrain.TrialContext) -> None:
            super().__init__(context)
            self.turns = Turns(argparse.Namespace(**context.get_hparams()["turns"]), context.device, context.rank)

        def before_step(self, batch_idx: int) -> None:
            self.turns.at(batch_idx)

    return BenchTrial


BenchTrial = make_trial_class() if os.environ.get("DTRAIN_BENCH_TRIAL") else None


def run_trial_mode(args: argparse.Namespace) -> None:
    from dtrain.config.schema import config_from_dict
    from dtrain.engine.trainer import run_trial

    run_dir = Path(args.turns) / "trial-run"  # the same folder on every rank
    run_dir.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    turns = {k: getattr(args, k) for k in ("turns", "mode", "warmup", "window", "rounds")}
    config = config_from_dict({
        "name": "overhead", "entrypoint": "overhead:BenchTrial", "code_dir": str(HERE),
        "hyperparameters": {"global_batch_size": args.batch * world, "model": args.model, "turns": turns},
        "resources": {"slots_per_trial": world}, "max_length": {"batches": Turns(args, torch.device("cpu"), 0).steps},
        "checkpoint_storage": {"path": "checkpoints"}, **json.loads(args.trial_config),
    })
    run_trial(config, run_dir, None, quiet=True)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    {"raw": run_raw, CONTROL: run_raw, SCRIPT: run_raw, "own": run_own, "trial": run_trial_mode}[args.mode](args)


def modes_of(args: argparse.Namespace) -> tuple[str, ...]:
    modes = tuple(args.modes.split(","))
    if modes[0] != "raw" or not set(modes) <= {*MODES, SCRIPT}:
        raise SystemExit(f"--modes starts with raw (the ratios' base) and names some of {', '.join((*MODES, SCRIPT))}")
    return (*modes, CONTROL) if args.control else modes


# ------------------------------------------------------------------------------------------ driver


def start(mode: str, model: str, args: argparse.Namespace, turns: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_BENCH_TRIAL": "1", "PYTHONPATH": str(HERE)}
    env.pop("DTRAIN_PROFILE", None)
    if mode == SCRIPT:  # the installed .pth file loads the hooks in every rank, as under dtrain launch
        env["DTRAIN_PROFILE"] = str(turns / "script-run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.slots),
           str(Path(__file__)), "--worker", "--mode", mode, "--model", model, "--turns", str(turns),
           "--warmup", str(args.warmup), "--window", str(args.window), "--rounds", str(args.rounds),
           "--batch", str(args.batch), "--trial-config", args.trial_config]
    log = (turns / f"{mode}.log").open("w")
    return subprocess.Popen(cmd, env=env, cwd=turns, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(path: Path, jobs: dict[str, subprocess.Popen], turns: Path, timeout: float = 900.0) -> Any:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for mode, job in jobs.items():
            if job.poll() not in (None, 0):
                raise SystemExit(f"the {mode} job failed (exit {job.returncode}):\n"
                                 + (turns / f"{mode}.log").read_text()[-3000:])
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path.name} after {timeout:.0f}s")
        time.sleep(0.005)
    text = path.read_text()
    return json.loads(text) if text else None


def measure(model: str, args: argparse.Namespace, turns: Path) -> dict[str, list[dict[str, float]]]:
    """Every mode's window figures in each round (rank 0's steps/s and CPU ms per step), its windows taking
    turns with the other modes'."""
    turns.mkdir()
    modes = modes_of(args)
    jobs = {mode: start(mode, model, args, turns) for mode in modes}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        for mode in modes:
            for rank in range(args.slots):
                wait_for(turns / f"ready-{mode}-{rank}", jobs, turns)
        for k in range(args.rounds):
            for mode in modes[k % len(modes):] + modes[:k % len(modes)]:
                (turns / f"go-{mode}-{k}").touch()
                runs[mode].append(wait_for(turns / f"done-{mode}-{k}", jobs, turns))
            print(f"  {model} round {k}: " + ", ".join(
                f"{m} {runs[m][-1]['steps_per_second']:.1f} ({runs[m][-1]['cpu_ms_per_step']:.3f} CPU ms)"
                for m in modes) + " steps/s", flush=True)
        for mode, job in jobs.items():
            (turns / f"go-{mode}-{args.rounds}").touch()  # the runs may end now
            if job.wait(timeout=300) != 0:
                # Every window was measured already; seen twice in a session: Gloo aborting in a raw job's
                # destroy_process_group ("terminate called without an active exception").
                print(f"  warning: the {mode} job failed after its last window (exit {job.returncode}); its "
                      f"windows stand. Its log's end:\n" + (turns / f"{mode}.log").read_text()[-600:], flush=True)
    finally:
        for job in jobs.values():
            if job.poll() is None:
                os.killpg(job.pid, 9)
                job.wait()
    return runs


def summarize(model: str, runs: dict[str, list[dict[str, float]]]) -> list[tuple[Any, ...]]:
    """Per mode: median steps/s, median of the per-round speed ratios to raw (and their range), median CPU
    ms per step, and the median of raw's CPU per step over the mode's (the work ratio: what the mode adds,
    free of the waiting and of the machine's speed changes that wall time carries)."""
    rows = []
    for mode in runs:
        mine, raw = runs[mode], runs["raw"]
        speed = [a["steps_per_second"] / b["steps_per_second"] for a, b in zip(mine, raw, strict=True)]
        work = [b["cpu_ms_per_step"] / a["cpu_ms_per_step"] for a, b in zip(mine, raw, strict=True)]
        rows.append((model, mode, statistics.median(r["steps_per_second"] for r in mine), statistics.median(speed),
                     min(speed), max(speed), statistics.median(r["cpu_ms_per_step"] for r in mine),
                     statistics.median(work)))
    return rows


USAGE = ("main_user_ms", "main_sys_ms", "other_threads_ms", "minor_faults", "voluntary_switches")


def usage_rows(model: str, runs: dict[str, list[dict[str, float]]]) -> list[tuple[Any, ...]]:
    """Per mode: the medians over rounds of rank 0's figures per step (:meth:`Turns._usage_per_step`)."""
    return [(model, mode, *(statistics.median(r[key] for r in runs[mode]) for key in USAGE)) for mode in runs]


def over_launches(per_launch: list[list[tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
    """:func:`summarize`'s rows of several launches as one row per mode: the medians over launches, and
    the range of the launches' median speed ratios (not of single rounds). One launch: its own rows, with
    the range of its rounds."""
    if len(per_launch) == 1:
        return per_launch[0]
    rows = []
    for same_mode in zip(*per_launch, strict=True):
        model, mode = same_mode[0][:2]
        ratios = [row[3] for row in same_mode]
        rows.append((model, mode, statistics.median(row[2] for row in same_mode), statistics.median(ratios),
                     min(ratios), max(ratios), statistics.median(row[6] for row in same_mode),
                     statistics.median(row[7] for row in same_mode)))
    return rows


def usage_over_launches(per_launch: list[list[tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
    """:func:`usage_rows` of several launches as one row per mode: each figure's median over launches."""
    return [(*same_mode[0][:2], *(statistics.median(column) for column in list(zip(*same_mode, strict=True))[2:]))
            for same_mode in zip(*per_launch, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp-0.1m,mlp-1m")
    parser.add_argument("--rounds", type=int, default=15, help="timed windows per mode")
    parser.add_argument("--window", type=int, default=300, help="steps per timed window")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="per slot")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--trial-config", default="{}",
                        help='JSON merged into the Trial\'s config, e.g. \'{"profiling": {"enabled": false}}\'')
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--launches", type=int, default=1,
                        help="fresh jobs per mode, one after another; the table gives medians over launches")
    parser.add_argument("--control", action="store_true",
                        help=f"also run a second raw DDP job ({CONTROL}): the ratio two identical jobs show")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"modes compared, raw first: some of {', '.join((*MODES, SCRIPT))}")
    parser.add_argument("--mode", choices=(*MODES, SCRIPT, CONTROL), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--turns", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(f"dtrain overhead: {args.slots} slot(s) x 1 thread, batch {args.batch}/slot, {args.rounds} rounds of "
          f"{args.window}-step windows per mode (after {args.warmup} warm-up steps), {device}, torch "
          f"{torch.__version__}", flush=True)
    rows, usage = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            launches, usages = [], []
            for launch in range(args.launches):
                runs = measure(model, args, Path(tmp) / f"{model}-{launch}")
                launches.append(summarize(model, runs))
                usages.append(usage_rows(model, runs))
                if args.launches > 1:
                    print(f"  {model} launch {launch}: " + ", ".join(f"{row[1]} {row[3]:.3f}" for row in launches[-1])
                          + " (median speed ratio to raw)", flush=True)
            rows += over_launches(launches)
            usage += usage_over_launches(usages)
    spread = "min-max of launches" if args.launches > 1 else "min-max of rounds"
    print(f"\n| model | mode | steps/s (median of {args.rounds} rounds x {args.launches} launch(es)) | speed ratio to "
          f"raw (median) | {spread} | CPU ms/step, rank 0 | work ratio (raw CPU / mode CPU) |")
    print("|---|---|---|---|---|---|---|")
    for model, mode, sps, ratio, lo, hi, cpu, work in rows:
        print(f"| {model} | {mode} | {sps:.1f} | {ratio:.3f} | {lo:.3f}-{hi:.3f} | {cpu:.3f} | {work:.3f} |")
    print("\nRank 0 per step (medians over rounds, then over launches; getrusage): CPU ms of the loop's thread, "
          "user and kernel, and of all other threads; the process's page faults and voluntary context switches"
          "\n\n| model | mode | "
          "loop user ms | loop kernel ms | other threads ms | minor page faults | voluntary switches |")
    print("|---|---|---|---|---|---|---|")
    for model, mode, user, kernel, other, faults, switches in usage:
        print(f"| {model} | {mode} | {user:.3f} | {kernel:.3f} | {other:.3f} | {faults:.2f} | {switches:.2f} |")

if __name__ == "__main__":
    main()
