"""Shared test helpers: multi-process ranks with a hard deadline, and the dtrain CLI with one too.

A hang must fail fast: every helper kills all the processes it started when one fails or time is up.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TRIALS = Path(__file__).resolve().parent / "trials"


def free_port() -> int:
    """A port free now, not held (see :func:`held_port` for one a process started later will serve)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port for a store that a process started later serves, kept from other sockets until the block ends
    (:func:`dtrain.dist.hold_port`): a free port let go at once may be any connection's by then."""
    with contextlib.closing(port_hold()) as sock:
        yield sock.getsockname()[1]


def port_hold() -> socket.socket:
    """:func:`dtrain.dist.hold_port` of a port the kernel picks; the caller closes it."""
    from dtrain.dist import hold_port

    sock = hold_port()
    if sock is None:
        raise OSError("no free local port")
    return sock


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle: torch's multiprocessing reductions would pass tensors as shared-memory handles that
        # die with this process.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        sys.exit(1)


def run_ranks(fn: Callable[..., Any], world_size: int = 2, timeout: float = 60.0, args: tuple = (),
              daemon: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return each rank's result.

    Fails (and kills every rank) as soon as one rank raises or dies, or when ``timeout`` passes; the
    failing rank's traceback is re-raised in the test. ``daemon=False`` for ranks that start processes of their
    own (a DataLoader's loader processes); they are killed all the same.
    """
    with held_port() as port:
        return _run_ranks(fn, world_size, timeout, args, port, daemon)


def _run_ranks(fn: Callable[..., Any], world_size: int, timeout: float, args: tuple, port: int,
               daemon: bool = True) -> list[Any]:
    from dtrain.launcher import forkstart

    # Fork where dtrain's launcher would (a CPU build; each rank sets one thread above): the ranks inherit
    # this process's torch instead of importing it again (about 4 s of CPU per rank). Forked from this
    # process itself: it serves no store (rank 0 does), so no thread here looks up names while it forks.
    fork = forkstart.can_fork()
    if fork:
        forkstart.preload_torch()
    ctx = mp.get_context("fork" if fork else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, queue, args), daemon=daemon)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout}s (got results from {sorted(results)})")
            try:
                rank, status, value = queue.get(timeout=0.2)
            except Exception:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if not results or len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def dtrain_cli(*args: str, timeout: float = 120.0, cwd: Path | None = None) -> CliResult:
    """Run ``dtrain ARGS`` in its own process group; on timeout kill the group (launcher and workers)."""
    return python_command("-m", "dtrain.cli", *args, timeout=timeout, cwd=cwd)


def python_command(*args: str, timeout: float = 120.0, cwd: Path | None = None) -> CliResult:
    """Run ``python ARGS`` (this interpreter) in its own process group, killed whole on timeout."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd or ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"python {' '.join(args)} did not finish in {timeout}s\n{out}\n{err}") from None
    return CliResult(proc.returncode, out, err)


def torch_teardown_abort(stderr: str) -> bool:
    """Whether a plain script under torchrun (no dtrain in its processes) failed only by torch's own abort in
    Python's teardown, after its code had finished: a Gloo thread dropping a finished collective cannot take
    the GIL then (pytorch#179291). dtrain's workers free the group first (dtrain.engine.scriptprof); a
    reference run of torch alone cannot, so its tests accept this one failure and check its outputs."""
    return "terminate called without an active exception" in stderr and "(SIGABRT)" in stderr


# Signals a launcher run in this process takes over (its supervisor, torch's agent, the workers' stop).
_LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def cli_in_process(*args: str, cwd: Path | None = None) -> CliResult:
    """``dtrain ARGS`` with the launcher in this process (workers are still real processes).

    For bad input and generators, which never start a worker, and for runs whose test does not signal or
    kill the launcher, nor reads what the workers print: a subprocess would pay torch's and matplotlib's
    imports again (a tiny run: about 6.6 s in a fresh process, 1.9 s once they are loaded), and the workers
    forked from this process's fork server (dtrain.launcher.forkstart), which lives on, find them imported
    there. The launcher's changes to the environment and signal handlers are undone afterwards, so one run
    cannot leak its thread count or status folder into the next test. A hang is still bounded: the run's
    collective timeout and watchdog, then pytest-timeout.
    """
    import contextlib
    import io

    from dtrain import cli

    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    environ = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        os.chdir(cwd or ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:  # argparse's own exits
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            if handler is not None:  # None: set outside Python, never replaced by dtrain
                signal.signal(sig, handler)
    return CliResult(code, out.getvalue(), err.getvalue())


def cli_with_workers(capfd: Any, *args: str) -> CliResult:
    """:func:`cli_in_process`, with what its workers (processes of their own, which write to this test's
    descriptors) printed before what the launcher printed."""
    result = cli_in_process(*args)
    workers = capfd.readouterr()
    return CliResult(result.code, workers.out + result.stdout, workers.err + result.stderr)


# The end-of-run probes time what the doctor and `dtrain plan` price changes by, at about a second per run of
# the tiny trial: tiny_config leaves them off, and tests of what they measure or price turn them on with this.
PROBED = {"profiling.probes": True}


def copy_trial(folder: Path) -> None:
    """tests/trials/tiny.py into ``folder`` with its bytecode (`make test` compiles the tests): every process of
    a run imports the trial, and where bytecode may not be written (PYTHONDONTWRITEBYTECODE) each would compile
    it again. The copy keeps the source's time, which the bytecode is checked against."""
    source = TRIALS / "tiny.py"
    shutil.copy2(source, folder)
    compiled = Path(importlib.util.cache_from_source(str(source)))
    if compiled.is_file():
        (folder / "__pycache__").mkdir(exist_ok=True)
        shutil.copy2(compiled, folder / "__pycache__" / compiled.name)


def tiny_config(tmp: Path, **overrides: Any) -> Path:
    """Write an experiment config for tests/trials/tiny.py into ``tmp``; nested keys with dotted names. The
    end-of-run probes are off unless ``**PROBED``."""
    cfg: dict[str, Any] = {
        "name": "tiny",
        "entrypoint": "tiny:TinyTrial",
        "hyperparameters": {"global_batch_size": 16, "train_size": 256, "val_size": 61},
        "resources": {"slots_per_trial": 2, "collective_timeout_seconds": 30},
        # Several CPU slots on one machine: explicit, so a machine with one GPU runs these tests too.
        "backend": "gloo",
        "max_length": {"batches": 24},
        "scheduling_unit": 8,
        "seed": 3,
        "profiling": {"probes": False},
    }
    for key, value in overrides.items():
        node = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    copy_trial(tmp)
    path = tmp / "experiment.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def final_weights(run_dir: Path, batches: int | None = None) -> dict:
    """The model state of a run's newest checkpoint (or of the one at ``batches``)."""
    import torch

    name = str(batches) if batches else (run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(run_dir / "checkpoints" / name / "model.pt", weights_only=True)


def train(config: Path, run_dir: Path, *args: str, ok: bool = True) -> CliResult:
    """``dtrain run CONFIG --run-dir RUN_DIR --quiet ARGS`` in this process; exit 0 asserted unless not ``ok``."""
    result = cli_in_process("run", str(config), "--run-dir", str(run_dir), "--quiet", *args)
    if ok:
        assert result.code == 0, result.stderr
    return result


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path
