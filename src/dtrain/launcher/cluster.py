"""Job files for clusters: a Kubeflow Trainer ``TrainJob`` (or the older ``PyTorchJob``) manifest and a
Slurm ``sbatch`` script.

Each starts ``dtrain run`` once per node; dtrain's own multi-machine launch (torch's elastic agent and
rendezvous, :mod:`dtrain.launcher.agent`) does the rest. Kubeflow Trainer v2 (``trainer.kubeflow.org``)
gives each pod ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` and
``PET_NPROC_PER_NODE``, which the TrainJob's command hands to dtrain as its own flags; the v1 training
operator's ``PyTorchJob`` pods have ``MASTER_ADDR``/``MASTER_PORT`` or ``PET_RDZV_ENDPOINT`` as well, which
dtrain reads itself (:func:`dtrain.dist.read_cluster_env`); Slurm's ``srun`` sets ``SLURM_*``. Nothing here
talks to a cluster: the files are printed for you to submit.
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.errors import UserError

if TYPE_CHECKING:  # the CLI imports this module to build its parser: keep that light (no pydantic)
    from dtrain.config.schema import ExperimentConfig

# The v1 training operator finds the master's port by these names (kubeflow.org/v1 PyTorchJob defaults).
CONTAINER_NAME = "pytorch"
PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 29500
# `dtrain k8s --api`: the manifest's kind, the current one first (the default).
APIS = ("trainjob", "pytorchjob")
# Kubeflow Trainer's runtime for torchrun-style jobs (manifests/base/runtimes/torch_distributed.yaml): its one
# replicated job and its trainer container are both named "node", and its torch plugin sets the PET_* variables.
TORCH_RUNTIME = "torch-distributed"
TRAINER_NODE = "node"
# runtimePatches are keyed by their manager, which the Trainer's webhook requires to be a domain-prefixed
# path (DOMAIN/PATH, as Kueue's "kueue.x-k8s.io/manager").
PATCH_MANAGER = "dtrain/k8s"


@dataclass(frozen=True)
class Layout:
    """How a job spreads over nodes: node count (or elastic range) and slots per node."""

    min_nodes: int
    max_nodes: int
    slots_per_node: int
    gpus: bool

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def nnodes_arg(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}" if self.elastic else str(self.max_nodes)


def layout(config: ExperimentConfig, nnodes: str, gpus: bool | None) -> Layout:
    """Split ``resources.slots_per_trial`` over the nodes; UserError when it does not divide."""
    from dtrain.launcher.rendezvous import parse_nnodes

    low, high = parse_nnodes(nnodes)
    slots = config.resources.slots_per_trial
    if slots % high:
        raise UserError(f"resources.slots_per_trial {slots} does not divide across {high} nodes: every node runs "
                        f"the same number of slots; use a multiple of {high} (--slots) or a node count that "
                        f"divides {slots}")
    use_gpus = config.backend == "nccl" if gpus is None else gpus
    if use_gpus and config.backend == "gloo":
        raise UserError("--gpus with backend: gloo would reserve GPUs the job never uses; set backend: nccl or auto")
    return Layout(low, high, slots // high, use_gpus)


def _k8s_name(name: str) -> str:
    """A resource name from the experiment name: an RFC 1035 label (a TrainJob's rule: a letter first),
    at most 50 characters, so that the pods' host names (``NAME-node-0-0``) stay within 63."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"dtrain-{cleaned}".rstrip("-")
    return cleaned[:50].rstrip("-")


def _kubelet_literal(text: str) -> str:
    """``text`` escaped so that the container gets it unchanged: the kubelet expands ``$(VAR)`` in a
    container's command and reduces ``$$`` to ``$`` (a ``--set`` value may hold either), and leaves any
    other ``$`` alone, so a ``$`` is doubled where ``$`` or ``(`` follows it."""
    return re.sub(r"\$(?=[$(])", "$$", text)


def _pod_resources(lay: Layout) -> dict[str, Any]:
    # Quantities as strings: the API's form (Quantity is a string; the models refuse a bare number there).
    return ({"limits": {"nvidia.com/gpu": str(lay.slots_per_node)}} if lay.gpus
            else {"requests": {"cpu": str(lay.slots_per_node)}})


def _storage(workdir: str, pvc: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts: a memory-backed /dev/shm (DataLoader workers share
    tensors through it, and a pod's default is 64 MB), and the claim on WORKDIR/runs."""
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if pvc:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": pvc}})
        mounts.append({"name": "runs", "mountPath": f"{workdir.rstrip('/')}/runs"})
    return volumes, mounts


def trainjob(config: ExperimentConfig, config_path: str, image: str, lay: Layout, port: int | None = None,
             workdir: str = "/workspace", pvc: str | None = None, extra_args: list[str] | None = None,
             runtime: str = TORCH_RUNTIME) -> dict:
    """A Kubeflow Trainer v2 ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``, Trainer 2.2 or later) on the
    ``torch-distributed`` ClusterTrainingRuntime: ``numNodes`` pods, each running ``dtrain run`` with its
    node arguments taken from the PET_* variables the runtime's torch plugin gives the pod.

    ``port`` None: the master's port is the operator's (``PET_MASTER_PORT``). A fixed node count only:
    Kubeflow Trainer has no elastic policy for torch (``numNodes`` is a number; ``elasticPolicy`` was
    removed from the runtime API in 2.2, never implemented), so an elastic range is refused.
    """
    if lay.elastic:
        raise UserError(f"--nnodes {lay.nnodes_arg}: a TrainJob runs a fixed number of nodes (Kubeflow Trainer has "
                        "no elastic policy); give --nnodes N, or use --api pytorchjob for an elastic range")
    # The node arguments come from the pod's PET_* variables, expanded by a shell into dtrain's own flags,
    # rather than left to dtrain's reading of the environment: that reading (dist.read_cluster_env) knows
    # the v1 operator's MASTER_ADDR/MASTER_PORT, which Trainer v2 does not set, and flags win over it; the
    # manifest then says what each pod runs, and dtrain checks the flags as on any machine. The shell also
    # sets the working directory, which a TrainJob's trainer cannot (it has no workingDir); `exec` makes
    # dtrain the container's main process, so the kubelet's SIGTERM reaches it and becomes a clean stop.
    master_port = "$PET_MASTER_PORT" if port is None else str(port)
    dtrain = " ".join(shlex.quote(c) for c in ["dtrain", "run", config_path, *(extra_args or [])])
    script = (f"cd {shlex.quote(workdir)} && exec {dtrain} --nnodes \"$PET_NNODES\" "
              f"--node-rank \"$PET_NODE_RANK\" --master \"$PET_MASTER_ADDR:{master_port}\"")
    volumes, mounts = _storage(workdir, pvc)
    pod_patch = {"volumes": volumes, "containers": [{"name": TRAINER_NODE, "volumeMounts": mounts}]}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": _k8s_name(config.name), "labels": {"app.kubernetes.io/managed-by": "dtrain"}},
        "spec": {
            "runtimeRef": {"name": runtime, "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"},
            "trainer": {
                "image": image,
                "command": ["sh", "-c", _kubelet_literal(script)],
                "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                "numNodes": lay.max_nodes,
                # Given, so that PET_NPROC_PER_NODE is dtrain's slots per node ("auto" would be every GPU the
                # node has; on CPUs, the requested cores), which dtrain checks against the config.
                "numProcPerNode": lay.slots_per_node,
                "resourcesPerNode": _pod_resources(lay),
            },
            # The trainer's fields have no volumes: they are a patch of the runtime's pod template.
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": TRAINER_NODE,
                                    "template": {"spec": {"template": {"spec": pod_patch}}}}]}}}}],
        },
    }


def pytorchjob(config: ExperimentConfig, config_path: str, image: str, lay: Layout, port: int | None = None,
               workdir: str = "/workspace", pvc: str | None = None, extra_args: list[str] | None = None) -> dict:
    """A ``kubeflow.org/v1`` PyTorchJob (the v1 training operator, for clusters without Kubeflow Trainer
    v2): Master (1 pod) + Worker (N-1 pods), or elastic Workers.

    Every pod runs ``dtrain run CONFIG --nnodes N``; the operator's environment gives each pod its node
    rank and the master's address, which dtrain reads. ``pvc`` (a ReadWriteMany claim) is mounted on
    ``WORKDIR/runs`` so that every pod sees the same run directory, as multi-node runs require.
    """
    port = DEFAULT_PORT if port is None else port
    command = ["dtrain", "run", config_path, "--nnodes", lay.nnodes_arg]
    if lay.elastic:
        command += ["--rdzv-backend", "c10d", "--rdzv-id", _k8s_name(config.name)]
    command += list(extra_args or [])
    volumes, mounts = _storage(workdir, pvc)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": workdir,
        "command": [_kubelet_literal(c) for c in command],
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": _pod_resources(lay),
        "volumeMounts": mounts,
    }

    def replica(count: int) -> dict:
        # Copies: shared objects would come out as YAML anchors, which some tools reject.
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [copy.deepcopy(container)], "volumes": copy.deepcopy(volumes)}}}

    spec: dict[str, Any] = {"nprocPerNode": str(lay.slots_per_node)}
    if lay.elastic:
        # Elastic: all pods are Workers; the operator points PET_RDZV_ENDPOINT at worker 0.
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "rdzvPort": port, "minReplicas": lay.min_nodes,
                                 "maxReplicas": lay.max_nodes, "maxRestarts": config.max_restarts,
                                 "nProcPerNode": lay.slots_per_node}
        spec["pytorchReplicaSpecs"] = {"Worker": replica(lay.max_nodes)}
    else:
        replicas = {"Master": replica(1)}
        if lay.max_nodes > 1:
            replicas["Worker"] = replica(lay.max_nodes - 1)
        spec["pytorchReplicaSpecs"] = replicas
    spec["runPolicy"] = {"cleanPodPolicy": "None"}  # keep finished pods' logs for inspection
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": _k8s_name(config.name), "labels": {"app.kubernetes.io/managed-by": "dtrain"}},
        "spec": spec,
    }


def manifest_yaml(job: dict, config: ExperimentConfig, lay: Layout, pvc: str | None) -> str:
    """The manifest as YAML behind a comment saying what it runs and what it needs."""
    import yaml

    kind = job["kind"]
    header = (f"# {kind} for {config.name!r}: {lay.nnodes_arg} node(s) x {lay.slots_per_node} slot(s)"
              f"{' (GPUs)' if lay.gpus else ''}. Generated by `dtrain k8s`; submit with `kubectl apply -f`.\n")
    if kind == "TrainJob":
        header += (f"# Needs Kubeflow Trainer 2.2 or later and its ClusterTrainingRuntime "
                   f"{job['spec']['runtimeRef']['name']!r}; each pod's\n# `dtrain run` takes its node rank and "
                   "the master from the runtime's PET_* variables.\n")
    else:
        header += ("# Needs the Kubeflow training operator (v1). Each pod runs `dtrain run`, which reads its node "
                   "rank and the master from the operator's environment.\n")
    if not pvc:
        header += ("# NOTE: no --pvc given: the pods share no run directory, which multi-node runs need; add a "
                   "ReadWriteMany volume on WORKDIR/runs.\n")
    # No line folding: the pods' command stays on one line, as written.
    return header + yaml.safe_dump(job, sort_keys=False, width=1 << 20)


def sbatch_script(config: ExperimentConfig, config_path: str, lay: Layout, dtrain_cmd: str = "dtrain",
                  time_limit: str | None = None, partition: str | None = None,
                  cpus_per_task: int | None = None, extra_args: list[str] | None = None,
                  resume: str | None = None) -> str:
    """An sbatch script: one ``srun`` task per node runs dtrain's elastic agent; the first node of the
    allocation hosts the c10d rendezvous, on a port derived from the job id (the same on every node).

    Checked on a real Slurm (22.05, ``scripts/slurm_cluster.sh``, ``bench/slurm_check.py``): the one task
    per node must get a CPU per local worker at least, or task binding puts all of that node's workers on
    one core; a requeued job (same id, same run directory) continues from its latest checkpoint; ``resume``
    (a run directory) continues a cancelled or failed job's run in place.
    """
    name = re.sub(r"[^\w.-]+", "-", config.name) or "dtrain"
    # One task per node runs the agent and all of that node's workers: with Slurm's default of one CPU per
    # task, task/affinity or task/cgroup confine them all to one core (seen: Cpus_allowed_list 0 for both
    # workers of a 2-slot node). At least one core per local worker.
    cpus = cpus_per_task or lay.slots_per_node
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={lay.max_nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={cpus}"]
    if lay.gpus:
        lines.append(f"#SBATCH --gpus-per-node={lay.slots_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    # Requeue (preemption, node failure, `scontrol requeue`) is safe: the script resumes the run below.
    # Append: a requeued job would otherwise truncate its output file, losing the first attempt's log.
    lines += [f"#SBATCH --output={name}-%j.out", "#SBATCH --open-mode=append", "#SBATCH --requeue"]
    command = [*shlex.split(dtrain_cmd), "run", config_path, "--nnodes", lay.nnodes_arg, "--rdzv-backend", "c10d",
               *(extra_args or [])]
    quoted = " ".join(shlex.quote(c) for c in command)
    latest = shlex.quote(f"{config.checkpoint_storage.path.rstrip('/')}/latest")
    lines += [
        f"# Generated by `dtrain slurm`: {lay.nnodes_arg} node(s) x {lay.slots_per_node} slot(s) for {config.name!r}.",
        "# srun starts one task per node; each runs dtrain's elastic agent, which starts that node's workers.",
        "set -euo pipefail",
        "# The master is the first node of the allocation, at the address Slurm itself reaches it by (its",
        "# NodeAddr: node names need not resolve); every task computes the same port from the job id.",
        # sed reads the whole list: `head -n 1` would exit early, and on a long node list (more than one
        # buffer of names) scontrol's next write would die of SIGPIPE, which pipefail makes fatal.
        'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        'MASTER_ADDR=$(scontrol show node "$FIRST_NODE" | sed -n \'s/.* NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        'MASTER_ADDR=${MASTER_ADDR:-$FIRST_NODE}',
        "MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}",
        "export MASTER_ADDR MASTER_PORT",
    ]
    if resume is not None:
        lines += ["# Continues the run in RUN_DIR from its latest checkpoint (dtrain slurm --resume).",
                  f"RUN_DIR={shlex.quote(resume)}", 'RESUME=(--resume "$RUN_DIR")']
    else:
        lines += [
            f'RUN_DIR="runs/{name}-$SLURM_JOB_ID"',
            "RESUME=()",
            "# A requeued job keeps its id, so its run directory: continue from the latest checkpoint, or",
            "# (none written yet) keep the first attempt's directory aside and start again.",
            f'if [[ -e "$RUN_DIR"/{latest} ]]; then',
            '    RESUME=(--resume "$RUN_DIR")',
            'elif [[ -e "$RUN_DIR/config.yaml" ]]; then',
            '    mv "$RUN_DIR" "$RUN_DIR.attempt-$(date +%Y%m%d-%H%M%S)"',
            "fi",
        ]
    lines += [
        # --cpus-per-task on srun too: from Slurm 22.05 on, srun no longer inherits sbatch's (release notes).
        f"srun --nodes={lay.max_nodes} --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1 \\",
        f"    {quoted} \\",
        '    --master "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "slurm-$SLURM_JOB_ID" \\',
        '    --run-dir "$RUN_DIR" ${RESUME[@]+"${RESUME[@]}"}',
    ]
    return "\n".join(lines) + "\n"


def config_path_for_job(path: Path) -> str:
    """The config path as the job will see it: as given when relative (the image or the shared working
    directory holds the same tree), else absolute."""
    return str(path) if not path.is_absolute() else str(path.resolve())


# ------------------------------------------------------------------------------------------ commands


def add_parsers(sub: Any, positive_int: Any) -> None:
    """``dtrain k8s`` and ``dtrain slurm`` (called by the CLI's parser builder)."""
    import argparse

    k8s = sub.add_parser("k8s", help="print a Kubeflow TrainJob (or, with --api pytorchjob, a PyTorchJob) manifest "
                         "that runs an experiment on N nodes")
    k8s.add_argument("config", type=Path, help="experiment YAML (the path the image holds it at, when relative)")
    k8s.add_argument("--image", required=True, help="container image with dtrain, the code and the config")
    k8s.add_argument("--nnodes", required=True, metavar="N|MIN:MAX", help="pods (MIN:MAX: elastic, c10d; "
                     "--api pytorchjob only)")
    k8s.add_argument("--api", choices=APIS, default=APIS[0], help="trainjob (default): a Kubeflow Trainer v2 TrainJob "
                     f"(trainer.kubeflow.org/v1alpha1, Trainer 2.2+) on the {TORCH_RUNTIME} ClusterTrainingRuntime; "
                     "pytorchjob: a kubeflow.org/v1 PyTorchJob, for clusters with the older training operator")
    k8s.add_argument("--runtime", default=TORCH_RUNTIME, help=f"TrainJob: the ClusterTrainingRuntime it runs on "
                     f"(default {TORCH_RUNTIME}; one with Kubeflow Trainer's torch policy and a 'node' container)")
    k8s.add_argument("--port", type=positive_int, help=f"rendezvous port (default: PET_MASTER_PORT, which Kubeflow "
                     f"Trainer sets, for a TrainJob; {DEFAULT_PORT} for a PyTorchJob)")
    k8s.add_argument("--workdir", default="/workspace", help="working directory in the image (default /workspace)")
    k8s.add_argument("--pvc", metavar="CLAIM", help="ReadWriteMany PersistentVolumeClaim mounted on WORKDIR/runs "
                     "(multi-node runs need a shared run directory)")
    slurm = sub.add_parser("slurm", help="print an sbatch script that runs an experiment on N nodes")
    slurm.add_argument("config", type=Path, help="experiment YAML (as seen from the submission directory)")
    slurm.add_argument("--nodes", required=True, type=positive_int, metavar="N", help="nodes to allocate")
    slurm.add_argument("--time", dest="time_limit", help="#SBATCH --time, e.g. 02:00:00")
    slurm.add_argument("--partition", help="#SBATCH --partition")
    slurm.add_argument("--cpus-per-task", type=positive_int, help="#SBATCH --cpus-per-task: cores per node for its "
                       "agent and workers (default: one per slot on the node)")
    slurm.add_argument("--resume", metavar="RUN_DIR", help="continue that run (e.g. of a cancelled job) from its "
                       "latest checkpoint, in place (the path as the job sees it)")
    slurm.add_argument("--dtrain", dest="dtrain_cmd", default="dtrain", help="command that runs dtrain on the "
                       "nodes (default 'dtrain'; e.g. '/shared/venv/bin/dtrain')")
    for p in (k8s, slurm):
        p.add_argument("--slots", type=positive_int, help="override resources.slots_per_trial (all nodes together)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key (repeatable); passed on to the job")
        p.add_argument("--gpus", action=argparse.BooleanOptionalAction, default=None,
                       help="slots are GPUs (default: when backend is nccl)")


def _load(args: Any) -> tuple[ExperimentConfig, list[str]]:
    from dtrain.config.schema import load_config

    overrides = list(args.overrides)
    passed: list[str] = []
    for item in args.overrides:
        passed += ["--set", item]
    if args.slots is not None:
        overrides.append(f"resources.slots_per_trial={args.slots}")
        passed += ["--slots", str(args.slots)]
    return load_config(args.config, overrides), passed


def cmd_k8s(args: Any) -> int:
    config, passed = _load(args)
    lay = layout(config, args.nnodes, args.gpus)
    if args.api == "pytorchjob":
        if args.runtime != TORCH_RUNTIME:
            raise UserError("--runtime names a Kubeflow Trainer runtime, which a PyTorchJob does not use; drop it, "
                            "or drop --api pytorchjob")
        job = pytorchjob(config, config_path_for_job(args.config), args.image, lay, port=args.port,
                         workdir=args.workdir, pvc=args.pvc, extra_args=passed)
    else:
        job = trainjob(config, config_path_for_job(args.config), args.image, lay, port=args.port,
                       workdir=args.workdir, pvc=args.pvc, extra_args=passed, runtime=args.runtime)
    print(manifest_yaml(job, config, lay, args.pvc), end="")
    return 0


def cmd_slurm(args: Any) -> int:
    config, passed = _load(args)
    lay = layout(config, str(args.nodes), args.gpus)
    print(sbatch_script(config, config_path_for_job(args.config), lay, dtrain_cmd=args.dtrain_cmd,
                        time_limit=args.time_limit, partition=args.partition, cpus_per_task=args.cpus_per_task,
                        extra_args=passed, resume=args.resume), end="")
    return 0
