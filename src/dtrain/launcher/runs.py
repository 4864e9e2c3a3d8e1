"""A run from the launcher's side: validate everything, lay out the run directory, launch, summarise.

Every check that can fail on bad input happens here, before any worker starts, so a mistake costs one
line and exit code 2 rather than N tracebacks.

Three shapes of run:

* one machine: the elastic agent starts ``slots_per_trial`` local workers;
* several machines (``--nnodes``/``--node-rank``/``--master``, or a Slurm step with one task per node,
  or a Kubeflow PyTorchJob pod): every node validates, then :func:`dtrain.launcher.join.join` brings the nodes
  together and the node hosting the rendezvous makes the run directory, which must be on storage all
  nodes share; each node's agent then starts ``slots_per_trial / nodes`` workers;
* inside a launcher that already started one process per slot (torchrun's workers, ``srun`` with one
  task per slot): no agent; this process trains in place with the rank it was given.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import os
import shutil
import socket
import time
import uuid
from dataclasses import astuple, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dtrain.config.schema import ExperimentConfig, dump_config, load_config
from dtrain.dist import ClusterEnv, DistEnv, gpus_for, read_cluster_env, read_env, resolve_backend
from dtrain.engine import data
from dtrain.engine.failures import Failure, read_reports
from dtrain.engine.precision import check_precision
from dtrain.engine.stopping import STOPPED_FILE
from dtrain.engine.trial import load_trial_class
from dtrain.errors import UserError
from dtrain.launcher import membership, netif, preflight
from dtrain.launcher.agent import LaunchOptions, launch
from dtrain.launcher.forkstart import DTRAIN_WORKER, WorkerModule
from dtrain.launcher.join import join
from dtrain.launcher.rendezvous import JoinError, Rendezvous
from dtrain.launcher.resume import RUN_CONFIG, announce_changes, resume_checkpoint
from dtrain.launcher.resume import config_path as resume_config_path
from dtrain.launcher.runlock import RunLock, lock_run_dir
from dtrain.launcher.runplan import NodeArgs, RunPlan
from dtrain.sync import registry

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from dtrain.launcher.dryrun import DataFacts

log = logging.getLogger(__name__)
JOB_FILE = ".dtrain-job"  # the running job's token, from the node hosting the rendezvous (see _prepare_nodes)


def prepare(config_path: Path | None, overrides: list[str], run_dir: Path | None, resume: Path | None,
            nodes: NodeArgs | None = None) -> RunPlan:
    """Validate the config and inputs, create the run directory and write the resolved config.

    ``config_path`` None: the resumed run's own resolved config (``dtrain run --resume RUN_DIR``).

    One pipeline for every shape of run: read who started this process, validate (:func:`_validate`),
    then place the run directory the way that shape needs (here, through the join of several nodes, or
    through the store of the launcher that started this worker), each with :func:`_create_run_dir`.
    """
    logging.basicConfig(level=logging.WARNING, format="dtrain: warning: %(message)s")
    config_path = resume_config_path(config_path, resume)
    nodes = nodes or NodeArgs()
    cluster = read_cluster_env()
    if cluster is not None and cluster.role == "worker":
        if nodes.given:
            raise UserError(f"this process is already one of the workers {cluster.source} started, so "
                            "--nnodes/--node-rank/--master/--rdzv-* do not apply; drop them, or run dtrain outside "
                            f"{cluster.source} (it starts its own workers)")
        return _prepare_in_place(config_path, overrides, run_dir, resume, cluster)
    rdzv_args = _rendezvous_args(nodes, cluster)
    config = load_config(config_path, overrides)
    rdzv = _rendezvous(rdzv_args, config, cluster) if rdzv_args is not None else None
    if rdzv is not None:
        return _prepare_nodes(config, rdzv, run_dir, resume)
    target = run_dir if run_dir is not None else _default_run_dir(config, resume)
    # An existing directory is locked before anything reads it (a checkpoint another run is writing).
    lock = lock_run_dir(target) if target.is_dir() else None
    try:
        resume_from = _validate(config, config.resources.slots_per_trial, resume)
        lock = lock or lock_run_dir(target)
        _create_run_dir(target, config, resume)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return RunPlan(config, target, resume_from, lock=lock)


def _validate(config: ExperimentConfig, local_slots: int, resume: Path | None, started: bool = False,
              warn: bool = True) -> Path | None:
    """Every check that needs no other process: the trial imports, the batch splits, the backend,
    precision and process counts suit this machine (``started``: another launcher already started these
    workers), the checkpoint to resume from is complete. Returns that checkpoint. ``warn``: give the
    warnings (once per job: not on every worker of an in-place run)."""
    load_trial_class(config.entrypoint, config.code_dir)
    # A parameter server's servers hold no data: its chief worker warns instead, with the training slots.
    servers = registry.lookup(config.sync.strategy).has_server_ranks
    data.per_slot_batch_size(config.global_batch_size, config.resources.slots_per_trial, warn=warn and not servers)
    _check_backend(config, local_slots)
    _check_machine(config, local_slots, started=started)
    if resume is None:
        return None
    found = resume_checkpoint(resume, config)
    if warn:
        announce_changes(resume, config)
    return found


def _create_run_dir(target: Path, config: ExperimentConfig, resume: Path | None) -> bool:
    """Make (or, when resuming in place, reuse) the run directory and write the resolved config there.
    Returns whether it was new."""
    fresh = not (target / "config.yaml").exists()
    _prepare_run_dir(target, continuing=resume is not None and target.resolve() == resume.resolve())
    _write_config(config, target)
    return fresh


@dataclass(frozen=True)
class CheckResult:
    """What ``dtrain check`` found: the resolved config, the per-slot batch, the warnings and what the dry run
    learnt of the trial's data (None where the trial could not be built in this process: see the warnings)."""

    config: ExperimentConfig
    per_slot_batch: int
    training_slots: int
    warnings: list[str]
    trial_data: DataFacts | None = None


def check(config_path: Path, overrides: list[str]) -> CheckResult:
    """Every check ``dtrain run`` makes on one machine before training, and nothing else: no run directory,
    no process. That includes what its workers check of the trial's data: the trial is built in this
    process (:mod:`dtrain.launcher.dryrun`). Raises :class:`UserError` with one line."""
    from dtrain.config.rungs import too_few_trials
    from dtrain.launcher import dryrun

    with preflight.collect_warnings() as warnings:
        config = load_config(config_path, overrides)
        load_trial_class(config.entrypoint, config.code_dir)
        slots = config.resources.slots_per_trial
        training = registry.lookup(config.sync.strategy).training_slots(config)  # servers do not train
        per_slot = data.per_slot_batch_size(config.global_batch_size, training)
        _check_backend(config, slots)
        warnings.extend(preflight.check_machine(config, slots))
        preflight.check_storage(config.checkpoint_storage.path)
        facts = None
        obstacle = dryrun.obstacle()
        if obstacle is None:
            facts = dryrun.check_trial_data(config, training, per_slot)
        else:
            warnings.append(f"the trial's data was not checked ({obstacle}): dtrain run checks it against the "
                            "global batch when its workers start; run dtrain check in a process of its own")
        searcher = config.searcher
        too_few = too_few_trials(searcher, searcher.max_length or config.max_length) if searcher else None
        if too_few is not None:  # a dtrain search of this config would say it at its start
            warnings.append(too_few)
    return CheckResult(config, per_slot, training, list(warnings), facts)


def _check_machine(config: ExperimentConfig, local_slots: int, started: bool = False) -> None:
    for warning in preflight.check_machine(config, local_slots, started):
        log.warning("%s", warning)
    preflight.check_storage(config.checkpoint_storage.path)


def _default_run_dir(config: ExperimentConfig, resume: Path | None) -> Path:
    return resume if resume is not None else Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"


# ------------------------------------------------------------------------------------ several nodes


def _rendezvous_args(nodes: NodeArgs, cluster: ClusterEnv | None) -> NodeArgs | None:
    """The command line's multi-node options, completed by a Slurm/PyTorchJob node environment (the
    command line wins where both say something)."""
    if cluster is not None and cluster.role == "node":
        env = NodeArgs(nnodes=cluster.nnodes, node_rank=cluster.node_rank, master=cluster.endpoint,
                       rdzv_backend=cluster.rdzv_backend, rdzv_id=cluster.rdzv_id)
        nodes = NodeArgs(*(mine if mine is not None else theirs for mine, theirs in zip(
            astuple(nodes), astuple(env), strict=True)))
    return nodes if nodes.given else None


def _rendezvous(args: NodeArgs, config: ExperimentConfig, cluster: ClusterEnv | None) -> Rendezvous | None:
    """Validate the multi-node options (:meth:`NodeArgs.rendezvous`, shared with ``dtrain launch``), then what
    a config adds; None when they amount to a single node."""
    source = "command line" if cluster is None or cluster.role != "node" else cluster.source
    slots = config.resources.slots_per_trial
    rdzv = args.rendezvous(slots, "resources.slots_per_trial", default_id=f"dtrain-{config.name}",
                           join_timeout=config.resources.join_timeout_seconds,
                           last_call=config.resources.rendezvous_last_call_seconds, source=source)
    if rdzv is None:
        return None
    per_node = slots // rdzv.max_nodes
    if cluster is not None and cluster.role == "node" and cluster.nproc_per_node not in (None, per_node):
        raise UserError(f"{cluster.source} gives {cluster.nproc_per_node} process(es) per node but "
                        f"resources.slots_per_trial {slots} over {rdzv.max_nodes} nodes means {per_node}; make them "
                        "agree")
    if rdzv.backend == "c10d" and rdzv.min_nodes < rdzv.max_nodes:
        _check_elastic_batch(config, rdzv.min_nodes, rdzv.max_nodes, per_node, str(args.nnodes))
    return rdzv


def _prepare_nodes(config: ExperimentConfig, rdzv: Rendezvous, run_dir: Path | None, resume: Path | None) -> RunPlan:
    per_node = config.resources.slots_per_trial // rdzv.max_nodes
    # Checkpoints are read by the host alone, while no worker of the job runs: a node joining a running job
    # must not read one that is being written or pruned.
    _validate(config, per_node, None)
    shared = config.model_dump(mode="json")
    shared.pop("code_dir", None)  # where the code sits may differ between machines
    created: list[Path] = []
    locks: list[RunLock] = []

    def host_prepare() -> dict:
        target = run_dir if run_dir is not None else _default_run_dir(config, resume)
        locks.append(lock_run_dir(target))
        resume_from = None
        if resume is not None:
            resume_from = resume_checkpoint(resume, config)
            announce_changes(resume, config)
        if _create_run_dir(target, config, resume):
            created.append(target)
        membership.clear(target / "logs")
        token = uuid.uuid4().hex
        # Kept while the job runs: a node joining it later checks it sees the same directory.
        (target / JOB_FILE).write_text(token)
        return {"run_dir": str(target.resolve()), "token": token,
                "resume_from": str(resume_from.resolve()) if resume_from else None}

    def node_check(plan: dict) -> None:
        target = Path(plan["run_dir"])
        if run_dir is not None and run_dir.resolve() != target:
            raise UserError(f"this node got --run-dir {run_dir} but the node hosting the rendezvous uses {target}; "
                            "pass the same --run-dir (on shared storage) to every node, or none")
        if _job_token(target) != plan["token"]:
            raise UserError(f"run directory {target}, made by the node hosting the rendezvous, is not visible on "
                            f"this host: multi-machine runs need the run directory on storage every node mounts; "
                            "pass --run-dir on a shared filesystem")

    def host_abort() -> None:
        for lock in locks:
            lock.release()
        for path in created:  # made moments ago for this job, nothing trained: leave no trace
            shutil.rmtree(path, ignore_errors=True)

    nodes, plan = join(rdzv, shared, per_node, config.resources.network_interface, host_prepare, node_check,
                       host_abort)
    target = Path(plan["run_dir"])
    resume_point = Path(plan["resume_from"]) if plan.get("resume_from") else None
    return RunPlan(config, target, resume_point, nodes=nodes, chief=nodes.is_host, lock=locks[0] if locks else None)


def _job_token(run_dir: Path) -> str | None:
    try:
        return (run_dir / JOB_FILE).read_text().strip()
    except OSError:
        return None


def _check_elastic_batch(config: ExperimentConfig, low: int, high: int, per_node: int, nnodes: str) -> None:
    """An elastic job keeps its global batch at every size it may take: it must divide each of them. And it
    continues at another world size, which a strategy keeping optimizer state per rank cannot."""
    strategy = registry.lookup(config.sync.strategy)
    if low < high and strategy.per_rank_optimizer_state:
        raise UserError(f"sync.strategy {config.sync.strategy} keeps optimizer state per rank, so a job cannot go on "
                        f"at another world size: with --nnodes {nnodes} it would stop at its first membership "
                        "change; use sync.strategy ddp or allreduce for an elastic job, or a fixed --nnodes")
    if strategy.has_server_ranks:
        return  # a parameter server's servers hold no data: its workers' count is not the slot count
    batch = config.global_batch_size
    bad = [n for n in range(low, high + 1) if batch % (n * per_node)]
    if bad:
        sizes = [n * per_node for n in range(low, high + 1)]
        lcm = math.lcm(*sizes)
        raise UserError(f"hyperparameters.global_batch_size {batch} does not divide across {bad[0] * per_node} slots "
                        f"({bad[0]} nodes of --nnodes {nnodes}): an elastic job keeps its global batch at every size "
                        f"it may take ({', '.join(map(str, sizes))} slots); use a multiple of {lcm}, or a node "
                        "range whose slot counts divide it")


# ------------------------------------------------------------------------ inside torchrun or srun


def _prepare_in_place(config_path: Path, overrides: list[str], run_dir: Path | None, resume: Path | None,
                      cluster: ClusterEnv) -> RunPlan:
    """This process is one of the workers another launcher started: take its rank and world as given.

    The first worker makes the run directory and tells the others through the launcher's TCPStore
    (torchrun's agent store, or one it serves itself under ``srun``); after an elastic restart it
    reuses the first attempt's directory, so training resumes from its latest checkpoint.
    """
    env = read_env()
    config = load_config(config_path, overrides)
    if config.resources.slots_per_trial != env.world_size:
        if env.is_chief:
            log.warning("%s started %d workers: resources.slots_per_trial %d is replaced by %d", cluster.source,
                        env.world_size, config.resources.slots_per_trial, env.world_size)
        config = load_config(config_path, [*overrides, f"resources.slots_per_trial={env.world_size}"])
    resume_from = _validate(config, env.local_world_size, resume, started=True, warn=env.is_chief)
    _set_interface_in_place(config, env.master_addr)
    store = _setup_store(env, config.resources.join_timeout_seconds, cluster)
    key = f"dtrain-setup/plan/{env.restart_count}"
    lock = None
    if env.is_chief:
        first = None
        if env.restart_count > 0 and store.check(["dtrain-setup/plan/0"]):
            first = json.loads(store.get("dtrain-setup/plan/0"))
        if first is not None:  # an elastic restart: same run directory, resumed by the worker
            target = Path(first["run_dir"])
            lock = lock_run_dir(target)  # the previous attempt's chief died, and its lock with it
            plan = {**first, "resume_from": None}
        else:
            target = run_dir if run_dir is not None else _default_run_dir(config, resume)
            lock = lock_run_dir(target)
            _create_run_dir(target, config, resume)
            plan = {"run_dir": str(target.resolve()), "resume_from": str(resume_from) if resume_from else None}
        store.set(key, json.dumps(plan))
    else:
        deadline = time.monotonic() + config.resources.join_timeout_seconds
        plan = None
        while plan is None and time.monotonic() < deadline:
            plan = json.loads(store.get(key)) if store.check([key]) else None
            time.sleep(0.05 if plan is None else 0)
        if plan is None:
            raise JoinError(f"rank {env.rank}: the first worker never announced the run directory within "
                            f"{config.resources.join_timeout_seconds:g}s (resources.join_timeout_seconds)")
        target = Path(plan["run_dir"])
        if not (target / "config.yaml").exists():
            raise UserError(f"rank {env.rank}: run directory {target}, made by rank 0, is not visible on this host; "
                            "multi-machine runs need the run directory on storage every node mounts (--run-dir)")
    resume_point = Path(plan["resume_from"]) if plan.get("resume_from") else None
    return RunPlan(config, target, resume_point, in_place=True, chief=env.is_chief, keepalive=store, lock=lock)


def _set_interface_in_place(config: ExperimentConfig, master_addr: str) -> None:
    """Forced interface, else the one routing to the master (the launcher already placed the ranks)."""
    forced = netif.override(config.resources.network_interface)
    if forced is not None:
        name = netif.check_override(forced[0], forced[1], socket.gethostname()).name
    else:
        master_ip = netif.resolve_ipv4(master_addr)
        found = None if ipaddress.ip_address(master_ip).is_loopback else netif.route_interface(master_ip)
        if found is None:
            return  # loopback (one machine) or no route known: Gloo's own default
        name = found
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = name


def _setup_store(env: DistEnv, timeout_seconds: float, cluster: ClusterEnv) -> TCPStore:
    import torch.distributed as tdist

    timeout = timedelta(seconds=timeout_seconds)
    serve = env.is_chief and not env.agent_store
    if not serve:
        master_ip = netif.resolve_ipv4(env.master_addr)
        source = netif.route_source(master_ip)
        problem = netif.wait_listening(os.environ.get("GLOO_SOCKET_IFNAME", ""), source, master_ip,
                                       env.master_port, time.monotonic() + timeout_seconds)
        if problem is not None:
            raise JoinError(f"rank {env.rank}: cannot reach {cluster.source}'s master {env.master_addr}:"
                            f"{env.master_port}: {problem}")
    try:
        return tdist.TCPStore(env.master_addr, env.master_port, None, serve, timeout, wait_for_workers=False,
                              multi_tenant=serve)
    except (RuntimeError, OSError) as exc:
        raise JoinError(f"rank {env.rank}: cannot use the store at {env.master_addr}:{env.master_port}: "
                        f"{str(exc).splitlines()[0]}") from None


def _check_backend(config: ExperimentConfig, slots: int) -> None:
    """The backend (and so the device) this machine gives ``slots`` local workers, and what the
    precision needs of it."""
    backend = resolve_backend(config.backend, slots)
    gpus = gpus_for(slots)
    if backend == "nccl" and slots > gpus:
        raise UserError(f"{slots} slots with NCCL need {slots} GPUs but {gpus} are visible; use --slots {gpus} or "
                        "backend: gloo")
    check_precision(config.precision, "cuda" if backend == "nccl" else "cpu")


def _prepare_run_dir(run_dir: Path, continuing: bool) -> None:
    if not continuing and (run_dir / RUN_CONFIG).exists():
        if _holds_training(run_dir):
            raise UserError(f"run directory {run_dir} already holds a run; continue it with dtrain run --resume "
                            f"{run_dir}, or choose another --run-dir")
        log.warning("run directory %s holds a run that failed or stopped before its first checkpoint: nothing "
                    "trained is kept there, so this run starts in it", run_dir)
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write run directory {run_dir}: {exc.strerror or exc}; "
                        "choose a writable place with --run-dir") from None


def _holds_training(run_dir: Path) -> bool:
    """Whether a run directory holds anything trained: a checkpoint (where its own config says they go, or
    the default place) or a finished run's results."""
    if (run_dir / "summary.json").exists():
        return True
    places = {run_dir / "checkpoints"}
    with contextlib.suppress(UserError):  # unreadable: the default place still counts
        places.add(run_dir / load_config(run_dir / RUN_CONFIG).checkpoint_storage.path)
    return any(place.is_dir() and any(place.iterdir()) for place in places)


def _write_config(config: ExperimentConfig, run_dir: Path) -> None:
    path = run_dir / RUN_CONFIG
    if path.exists():
        old = yaml.safe_load(path.read_text())
        if old != config.model_dump(mode="json"):
            shutil.copy2(path, run_dir / f"config.before-resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml")
    dump_config(config, path)


def execute(plan: RunPlan, quiet: bool, debug: bool, threads: int | None = None) -> Failure | None:
    """Start the workers (``threads``: torch threads per worker; None: :func:`dtrain.launcher.cpu.for_run`); None on
    success, else the root-cause failure. Raises :class:`Stopped` on a signal."""
    if plan.chief:  # a previous stop's, now being resumed (not a running job's, which a late node joins)
        (plan.run_dir / "logs" / STOPPED_FILE).unlink(missing_ok=True)
    args = ["--run-dir", str(plan.run_dir)]
    if plan.resume_from is not None:
        args += ["--resume-from", str(plan.resume_from)]
    if quiet:
        args.append("--quiet")
    if plan.in_place:
        return _train_in_place(args, plan)
    slots = plan.config.resources.slots_per_trial
    if plan.nodes is not None:
        slots //= plan.nodes.max_nodes
    options = LaunchOptions(slots=slots, max_restarts=plan.config.max_restarts, run_dir=plan.run_dir, debug=debug,
                            nodes=plan.nodes, clean_stop=True,
                            checkpoints=plan.run_dir / plan.config.checkpoint_storage.path,
                            grace_seconds=plan.config.resources.preemption_grace_seconds, threads=threads)
    return launch(WorkerModule(DTRAIN_WORKER, tuple(args)), options)


def _train_in_place(args: list[str], plan: RunPlan) -> Failure | None:
    """Run the worker's main in this process; its failure comes back as this rank's one-line report."""
    from dtrain.engine import worker

    rank = read_env().rank
    try:
        worker.main(args)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        mine = [r for r in read_reports(plan.run_dir / "logs", own_ranks={rank}) if r.rank == rank]
        if mine:
            return mine[0].failure()
        return Failure(rank, int(exc.code) if isinstance(exc.code, int) else 1, f"exited with {exc.code}",
                       user_error=False)
    return None
