"""Checks of a valid config against *this* machine, before any worker starts.

The config schema bounds every number absolutely (:mod:`dtrain.config.schema`); what one machine can take
depends on it: how many worker and loader processes its cores and process limit allow, and whether an
absolute checkpoint folder the user chose can be written. Hard limits are :class:`UserError`; what
merely runs slowly comes back as warnings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dtrain.config.safeyaml import plain
from dtrain.config.schema import ExperimentConfig
from dtrain.errors import ConfigError, UserError

# Workers per core beyond which a machine only thrashes (each worker is a full process with its own
# model copy); loader processes count the same.
PROCESSES_PER_CORE = 8


def cores() -> int:
    """CPU cores this process may use (its affinity mask, not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_machine(config: ExperimentConfig, local_slots: int, started: bool = False) -> list[str]:
    """Refuse slot and loader-worker counts this machine cannot start; return warnings for slow ones.

    ``local_slots`` is the number of workers this node runs; ``started`` when another launcher already
    started them (torchrun, srun), so only their loader processes are still to come.
    """
    n_cores = cores()
    limit = PROCESSES_PER_CORE * n_cores
    workers = config.data_loader.num_workers
    warnings: list[str] = []
    if not started and local_slots > limit:
        raise UserError(f"{local_slots} slots on this machine means {local_slots} worker processes on {n_cores} "
                        f"core(s); at most {limit} ({PROCESSES_PER_CORE} per core): use --slots {min(limit, n_cores)} "
                        "or spread the slots over several nodes (--nnodes)")
    loaders = workers * local_slots
    if loaders > limit:
        raise UserError(f"data_loader.num_workers {workers} x {local_slots} slot(s) = {loaders} loader processes on "
                        f"{n_cores} core(s); at most {limit}: use data_loader.num_workers <= "
                        f"{max(0, limit // max(1, local_slots))}")
    processes = local_slots * (1 + workers) + 1
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and processes > soft:
        raise UserError(f"this run needs about {processes} processes but the process limit (ulimit -u) is {soft}; "
                        "use fewer slots or data_loader.num_workers, or raise the limit")
    if local_slots > n_cores:
        warnings.append(f"{local_slots} slots on {n_cores} core(s): workers share cores, so each step is slower "
                        "than with one slot per core")
    elif local_slots * (1 + workers) > n_cores and workers:
        warnings.append(f"{local_slots} slot(s) x (1 + {workers} loader workers) processes on {n_cores} core(s): "
                        "loaders compete with training for the cores")
    return warnings


def check_storage(path: str) -> None:
    """An absolute checkpoint folder must be creatable and writable here; tried with a temporary folder
    that is removed again (permission bits alone lie for root, e.g. under /proc)."""
    target = Path(path)
    if not target.is_absolute():
        return  # inside the run directory, which prepare creates and probes
    probe_in = target
    while not probe_in.exists() and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    where = plain(path, 120)
    if not probe_in.is_dir():
        raise ConfigError(f"checkpoint_storage.path {where}: {plain(str(probe_in), 120)} is not a folder; choose "
                          "a folder you can write, or a relative path inside the run directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dtrain-write-test-", dir=probe_in))
    except OSError as exc:
        raise ConfigError(f"checkpoint_storage.path {where} is not writable ({plain(exc.strerror or str(exc), 80)} "
                          f"in {plain(str(probe_in), 120)}); choose a folder you can write, or a relative path "
                          "inside the run directory") from None


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def collect_warnings() -> Iterator[list[str]]:
    """The warnings dtrain logs inside the block, as strings (and not printed)."""
    handler = _Collect()
    logger = logging.getLogger("dtrain")
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
