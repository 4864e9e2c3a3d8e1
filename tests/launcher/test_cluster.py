"""Clusters: the TrainJob and PyTorchJob manifests (checked with Kubeflow's own API models), the TrainJob
pods' command run under the environment Kubeflow Trainer gives them, the sbatch script (run for real with
stand-in srun/scontrol on test hosts), and reading the ranks and addresses torchrun, Slurm and a PyTorchJob
give."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, cli_in_process, final_weights, tiny_config

from dtrain.config.schema import load_config
from dtrain.dist import expand_hostlist, expand_tasks_per_node, read_cluster_env, read_env
from dtrain.errors import UserError
from dtrain.launcher import runs

sys.path.insert(0, str(ROOT / "scripts"))
import testhosts

# What the TrainJob CRD requires of metadata.name (kubeflow/trainer, trainjob_types.go's XValidation rules).
TRAINJOB_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# What the Trainer's webhook requires of a runtime patch's manager (validation.IsDomainPrefixedPath).
DOMAIN_PREFIXED_PATH = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[\w.~/-]+$")


def trainjob_model(job: dict):
    """The manifest through Kubeflow Trainer's API models (kubeflow-trainer-api, generated from the
    TrainJob's OpenAPI spec; pydantic, strict types, required fields). The models drop a key they do not
    know, so the way back to a dict must give the manifest itself: a misspelt or unknown field, or a value
    of another type, shows as a difference."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    model = TrainerV1alpha1TrainJob.from_dict(job)
    assert model.to_dict() == job
    return model


def pytorchjob_model(job: dict):
    """The manifest through the v1 training operator's API models (kubeflow-training's
    ``kubeflow.training.models``, with the Kubernetes client's for the pod template), deserialized as the
    SDK deserializes the API server's answer: required fields checked; as above, the way back must give
    the manifest (the deserializer drops unknown keys and converts types, e.g. "1" to 1)."""
    from kubeflow.training import ApiClient

    class Response:  # what ApiClient.deserialize reads: the body of an HTTP answer
        data = json.dumps(job)

    client = ApiClient()
    model = client.deserialize(Response(), "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(model) == job
    return model


def _manifest(tmp_path, *args, **overrides):
    cfg = tiny_config(tmp_path, **overrides)
    result = cli_in_process("k8s", str(cfg.relative_to(tmp_path)), *args, cwd=tmp_path)
    assert result.code == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_k8s_writes_a_trainjob_by_default(tmp_path):
    job = _manifest(tmp_path, "--image", "registry.example/dtrain:1", "--nnodes", "2", "--pvc", "runs-rwx",
                    "--set", "hyperparameters.lr=0.1", **{"resources.slots_per_trial": 4})
    model = trainjob_model(job)
    assert (model.api_version, model.kind, model.metadata.name) == ("trainer.kubeflow.org/v1alpha1", "TrainJob", "tiny")
    ref = model.spec.runtime_ref
    assert (ref.name, ref.kind, ref.api_group) == ("torch-distributed", "ClusterTrainingRuntime",
                                                   "trainer.kubeflow.org")
    trainer = model.spec.trainer
    assert trainer.image == "registry.example/dtrain:1"
    # 4 slots over 2 nodes: PET_NPROC_PER_NODE must be dtrain's slots per node, which it checks.
    assert (trainer.num_nodes, trainer.num_proc_per_node) == (2, 2)
    assert trainer.resources_per_node.to_dict() == {"requests": {"cpu": "2"}}  # CPU slots: no GPUs asked for
    # The torch plugin owns the PET_* variables: the webhook refuses a TrainJob that sets them.
    assert not [env.name for env in trainer.env if env.name.startswith("PET_")]
    assert trainer.command[:2] == ["sh", "-c"] and len(trainer.command) == 3
    # Volumes go through a runtime patch of the torch-distributed runtime's "node" job and container.
    [patch] = model.spec.runtime_patches
    assert DOMAIN_PREFIXED_PATH.match(patch.manager), patch.manager
    [node_job] = patch.training_runtime_spec.template.spec.replicated_jobs
    pod = node_job.template.spec.template.spec
    [container] = pod.containers
    assert node_job.name == container.name == "node"
    assert {(m.name, m.mount_path) for m in container.volume_mounts} == {("dshm", "/dev/shm"),
                                                                        ("runs", "/workspace/runs")}
    volumes = {v.name: v for v in pod.volumes}
    assert volumes["runs"].persistent_volume_claim.claim_name == "runs-rwx"
    assert volumes["dshm"].empty_dir.medium == "Memory"


def test_k8s_trainjob_with_gpus_and_no_shared_directory(tmp_path):
    cfg = tiny_config(tmp_path, **{"resources.slots_per_trial": 8, "backend": "nccl"})
    result = cli_in_process("k8s", str(cfg), "--image", "img", "--nnodes", "4", "--runtime", "torch-cuda")
    assert result.code == 0, result.stderr
    assert "# NOTE: no --pvc given" in result.stdout  # multi-node runs need one: said in the file
    model = trainjob_model(yaml.safe_load(result.stdout))
    assert model.spec.runtime_ref.name == "torch-cuda"
    trainer = model.spec.trainer
    assert (trainer.num_nodes, trainer.num_proc_per_node) == (4, 2)
    assert trainer.resources_per_node.to_dict() == {"limits": {"nvidia.com/gpu": "2"}}
    [node_job] = model.spec.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs
    assert [v.name for v in node_job.template.spec.template.spec.volumes] == ["dshm"]


def _kubelet_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet makes of a container's command (the Container API's documented rule): ``$(VAR)``
    becomes VAR's value where the container has it, ``$$`` becomes ``$``, anything else stays."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def test_trainjob_pods_give_dtrain_the_node_arguments_from_trainer(tmp_path):
    """The pods' command, expanded by the kubelet and run by sh under the variables the torch-distributed
    runtime gives the third pod: the dtrain it starts is the container's main process (exec), in the
    working directory, with a --set value unchanged, and its node arguments make the rendezvous the
    TrainJob means (static, node rank 2 of 3, the master at node 0's host name and port)."""
    from dtrain.cli import build_parser
    from dtrain.launcher.runplan import NodeArgs

    odd = "hyperparameters.note=it's \"$HOME\" $(PET_NODE_RANK) $$ `id`; x"
    job = _manifest(tmp_path, "--image", "i", "--nnodes", "3", "--workdir", str(tmp_path), "--set", odd,
                    **{"resources.slots_per_trial": 6})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dtrain").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                    "json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'pid': os.getpid()}, "
                                    "open(os.environ['RECORD'], 'w'))\n")
    (bin_dir / "dtrain").chmod(0o755)
    # What the runtime's torch plugin gives each pod, from the TrainJob (kubeflow/trainer, plugins/torch):
    # PET_NODE_RANK is the pod's Job completion index; the master is node 0's host name in the JobSet.
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    pod_env = {"PET_NNODES": str(trainer["numNodes"]), "PET_NODE_RANK": "2",
               "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
               "PET_MASTER_PORT": "29500"}
    env = {**pod_env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": "/home/nobody",
           "RECORD": str(tmp_path / "record.json")}
    argv = [_kubelet_expand(part, env) for part in trainer["command"]]
    proc = subprocess.Popen(argv, env=env, cwd="/")
    assert proc.wait(timeout=30) == 0
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["pid"] == proc.pid and record["cwd"] == str(tmp_path)
    args = build_parser().parse_args(record["argv"])
    assert (args.command, str(args.config), args.overrides) == ("run", "experiment.yaml", [odd])
    pod = read_cluster_env(pod_env)
    config = load_config(tmp_path / "experiment.yaml", args.overrides)
    rdzv = runs._rendezvous(runs._rendezvous_args(NodeArgs.from_args(args), pod), config, pod)
    assert (rdzv.backend, rdzv.node_rank, rdzv.host, rdzv.port, rdzv.min_nodes, rdzv.max_nodes) == (
        "static", 2, "tiny-node-0-0.tiny", 29500, 3, 3)


def test_k8s_refuses_an_elastic_trainjob_and_a_runtime_for_a_pytorchjob(tmp_path):
    cfg = str(tiny_config(tmp_path, **{"resources.slots_per_trial": 6}))
    for args in (["--nnodes", "1:3"], ["--nnodes", "2", "--api", "pytorchjob", "--runtime", "torch-cuda"]):
        result = cli_in_process("k8s", cfg, "--image", "i", *args)
        assert result.code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "use --api pytorchjob for an elastic range" in cli_in_process(
        "k8s", cfg, "--image", "i", "--nnodes", "1:3").stderr


def test_k8s_names_are_dns_labels_that_start_with_a_letter(tmp_path):
    for name, expected in (("2-Layer.Net", "dtrain-2-layer-net"), ("__", "dtrain"), ("ok_name", "ok-name")):
        job = _manifest(tmp_path, "--image", "i", "--nnodes", "1", name=name)
        assert job["metadata"]["name"] == expected and TRAINJOB_NAME.match(expected)
    long = _manifest(tmp_path, "--image", "i", "--nnodes", "1", name="x" * 80)["metadata"]["name"]
    assert len(f"{long}-node-0-0") <= 63  # the pods' host names (JobSet: NAME-node-0-INDEX)


def test_k8s_pytorchjob_master_and_workers(tmp_path):
    job = _manifest(tmp_path, "--api", "pytorchjob", "--image", "registry.example/dtrain:1", "--nnodes", "2",
                    "--pvc", "runs-rwx", "--set", "hyperparameters.lr=0.1", **{"resources.slots_per_trial": 4})
    model = pytorchjob_model(job)
    assert (model.api_version, model.kind) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = model.spec.pytorch_replica_specs
    assert replicas["Master"].replicas == 1 and replicas["Worker"].replicas == 1
    assert model.spec.nproc_per_node == "2"  # 4 slots over 2 nodes
    assert model.spec.elastic_policy is None and model.spec.run_policy.clean_pod_policy == "None"
    for spec in replicas.values():
        assert spec.restart_policy == "OnFailure"
        [container] = spec.template.spec.containers
        # The operator finds the master's port by these names and sets MASTER_ADDR/PORT, PET_NODE_RANK.
        assert container.name == "pytorch" and container.image == "registry.example/dtrain:1"
        [port] = container.ports
        assert (port.name, port.container_port, port.protocol) == ("pytorchjob-port", 29500, "TCP")
        assert container.command == ["dtrain", "run", "experiment.yaml", "--nnodes", "2",
                                     "--set", "hyperparameters.lr=0.1"]
        assert container.resources.requests == {"cpu": "2"} and not container.resources.limits
        assert ("runs", "/workspace/runs") in {(m.name, m.mount_path) for m in container.volume_mounts}


def test_k8s_pytorchjob_elastic_with_gpus(tmp_path):
    job = _manifest(tmp_path, "--api", "pytorchjob", "--image", "img", "--nnodes", "1:3",
                    **{"resources.slots_per_trial": 6, "backend": "nccl"})
    pytorchjob_model(job)
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvPort": 29500, "minReplicas": 1,
                                            "maxReplicas": 3, "maxRestarts": 0, "nProcPerNode": 2}
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    [container] = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert container["command"][3:] == ["--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-id", "tiny"]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_the_api_models_refuse_a_broken_manifest(tmp_path, kind):
    """The checks above have teeth: a misspelt field, a number given as a string, a required field
    missing each fail them."""
    job = _manifest(tmp_path, "--api", kind, "--image", "i", "--nnodes", "2")
    check = trainjob_model if kind == "trainjob" else pytorchjob_model
    check(job)
    # (where, new value; None: removed): an unknown field, a number as a string, a required field missing.
    if kind == "trainjob":
        breakages = [(("spec", "trainer", "numNode"), 2), (("spec", "trainer", "numNodes"), "2"),
                     (("spec", "runtimeRef", "name"), None)]
    else:
        master = ("spec", "pytorchReplicaSpecs", "Master")
        breakages = [(("spec", "nprocPerNodes"), "1"), ((*master, "replicas"), "1"),
                     ((*master, "template", "spec", "containers", 0, "name"), None)]
    for (*path, key), value in breakages:
        broken = json.loads(json.dumps(job))
        parent = broken
        for part in path:
            parent = parent[part]
        if value is None:
            del parent[key]
        else:
            parent[key] = value
        with pytest.raises((AssertionError, ValueError)):
            check(broken)


def test_k8s_and_slurm_refuse_slots_that_do_not_divide(tmp_path):
    cfg = str(tiny_config(tmp_path, **{"resources.slots_per_trial": 3}))
    for args in (["k8s", cfg, "--image", "i", "--nnodes", "2"], ["slurm", cfg, "--nodes", "2"]):
        result = cli_in_process(*args)
        assert result.code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("dtrain: error: resources.slots_per_trial 3 does not divide across 2 nodes")


def test_slurm_script_is_valid_bash(tmp_path):
    cfg = tiny_config(tmp_path, backend="auto")
    result = cli_in_process("slurm", str(cfg), "--nodes", "2", "--time", "00:10:00", "--gpus")
    assert result.code == 0, result.stderr
    script = result.stdout
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=1",
                 "#SBATCH --time=00:10:00", 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p',
                 "srun --nodes=2 --ntasks-per-node=1"):
        assert line in script, line
    assert "--nnodes 2 --rdzv-backend c10d" in script and '--master "$MASTER_ADDR:$MASTER_PORT"' in script


def test_slurm_script_finds_the_first_node_of_a_long_list(tmp_path):
    """A long allocation: scontrol writes its names in pieces; reading only the first must not kill the
    script (with pipefail, a reader that exits early makes scontrol's next write fail with SIGPIPE)."""
    result = cli_in_process("slurm", str(tiny_config(tmp_path)), "--nodes", "2")
    assert result.code == 0, result.stderr
    first_node = next(ln for ln in result.stdout.splitlines() if ln.startswith("FIRST_NODE="))
    (tmp_path / "scontrol").write_text(
        "#!/usr/bin/env python3\nimport sys, time\nfor i in range(20000):\n"
        "    sys.stdout.write(f'node{i:05d}\\n')\n"
        "    if i % 500 == 0:\n        sys.stdout.flush(); time.sleep(0.001)\n")
    (tmp_path / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[00000-19999]"}
    out = subprocess.run(["bash", "-c", f'set -euo pipefail\n{first_node}\necho "$FIRST_NODE"'], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "node00000\n", (out.returncode, out.stdout, out.stderr)


@pytest.mark.slow
@pytest.mark.skipif(testhosts.unavailable_reason() is not None, reason=f"test hosts: {testhosts.unavailable_reason()}")
def test_slurm_script_runs_on_two_hosts(tmp_path, reference_runs):
    """The generated script, run as sbatch would, with stand-ins for scontrol and srun that start one
    task per test host with Slurm's variables: the master comes from the allocation's node list. It is also
    the suite's c10d rendezvous (--rdzv-backend c10d, --rdzv-id) across two hosts, and trains the weights of
    2 local slots."""
    cfg = tiny_config(tmp_path, **{"resources.join_timeout_seconds": 30})
    script = cli_in_process("slurm", str(cfg), "--nodes", "2", "--dtrain", f"{sys.executable} -m dtrain.cli").stdout
    (tmp_path / "job.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    with testhosts.TestHosts(2, pin_cpus=True) as hosts:
        # The allocation h[0-1] (expand_hostlist has its own test); a node's record as Slurm prints it, whose
        # NodeAddr the script reads.
        (bin_dir / "scontrol").write_text("#!/bin/sh\n# scontrol show hostnames LIST | scontrol show node NAME\n"
                                          "case \"$2\" in\n  hostnames) printf 'h0\\nh1\\n' ;;\n"
                                          "  node) echo \"NodeName=$3 Arch=x86_64 NodeAddr=$3 NodeHostName=$3\" ;;\n"
                                          "esac\n")
        tasks = "\n".join(
            f"SLURM_NODEID={i} SLURM_PROCID={i} SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NUM_NODES=2 "
            f"SLURM_STEP_NODELIST='h[0-1]' {' '.join(hosts.argv(i, []))} \"$@\" > {tmp_path}/task{i}.log 2>&1 &"
            for i, h in enumerate(hosts.hosts))
        (bin_dir / "srun").write_text("#!/bin/bash\n# srun OPTIONS... COMMAND: one task per test host\n"
                                      "while [[ $1 == --* ]]; do shift; done\n"
                                      f"{tasks}\nrc=0; for p in $(jobs -p); do wait $p || rc=$?; done; exit $rc\n")
        for tool in ("scontrol", "srun"):
            (bin_dir / tool).chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NODELIST": "h[0-1]", "SLURM_NNODES": "2"}
        proc = subprocess.Popen(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        hosts._procs.append(proc)  # killed by the teardown if anything below fails
        start = time.monotonic()
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            hosts.destroy()
            raise AssertionError("the sbatch script did not finish in 90s") from None
        logs = [p.read_text() if p.exists() else "(no log)" for p in (tmp_path / f"task{i}.log" for i in range(2))]
        assert proc.returncode == 0, (out, logs)
    run_dir = tmp_path / "runs" / "tiny-4242"
    assert "dtrain: done" in "".join(logs), logs
    assert (run_dir / "summary.json").exists() and (run_dir / "logs" / "rank1.log").exists()
    assert time.monotonic() - start < 90
    expected, got = reference_runs.weights(2), final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- launcher environments


def test_hostlists():
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_torchrun_slurm_and_pytorchjob_environments():
    assert read_cluster_env({}) is None
    tr = read_cluster_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"})
    assert (tr.source, tr.role) == ("torchrun", "worker")
    # srun with one task per slot: each task is a worker with Slurm's ranks.
    slurm = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[7-8]", "SLURM_JOB_ID": "123",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    env = read_env(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("n7", 20123)
    # srun with one task per node: each task is a node's agent.
    node = read_cluster_env({**slurm, "SLURM_STEP_NUM_TASKS": "2", "MASTER_PORT": "29999"})
    assert (node.role, node.nnodes, node.node_rank, node.endpoint) == ("node", "2", 1, "n7:29999")
    # A PyTorchJob pod (static): the training operator's variables.
    pod = read_cluster_env({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "4", "RANK": "2",
                            "WORLD_SIZE": "12", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (pod.source, pod.role, pod.nnodes, pod.node_rank, pod.endpoint, pod.nproc_per_node) == (
        "PyTorchJob", "node", "3", 2, "job-master-0:23456", 4)
    # A TrainJob pod (Kubeflow Trainer v2): the master comes as PET_MASTER_ADDR/PORT, with no MASTER_*.
    trainjob = read_cluster_env({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1",
                                 "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"})
    assert (trainjob.source, trainjob.node_rank, trainjob.endpoint) == ("TrainJob", 1, "job-node-0-0.job:29400")
    elastic = read_cluster_env({"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "job-worker-0:29500",
                                "PET_RDZV_BACKEND": "c10d", "PET_NPROC_PER_NODE": "1"})
    assert (elastic.rdzv_backend, elastic.endpoint, elastic.node_rank) == ("c10d", "job-worker-0:29500", None)


def test_pytorchjob_pod_fills_in_what_the_command_line_leaves_out(tmp_path, monkeypatch):
    config = load_config(tiny_config(tmp_path, **{"resources.slots_per_trial": 4}))
    pod = read_cluster_env({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2",
                            "MASTER_ADDR": "job-master-0", "MASTER_PORT": "29500"})
    args = runs._rendezvous_args(runs.NodeArgs(nnodes="2"), pod)  # the manifest's command: --nnodes 2
    rdzv = runs._rendezvous(args, config, pod)
    assert (rdzv.backend, rdzv.node_rank, rdzv.host, rdzv.port, rdzv.max_nodes, rdzv.source) == (
        "static", 1, "job-master-0", 29500, 2, "PyTorchJob")
    wrong = read_cluster_env({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "3",
                              "MASTER_ADDR": "m", "MASTER_PORT": "1"})
    with pytest.raises(UserError, match="PyTorchJob gives 3 process"):
        runs._rendezvous(runs._rendezvous_args(runs.NodeArgs(), wrong), config, wrong)


def test_worker_flags_inside_torchrun_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(UserError, match="already one of the workers torchrun started"):
        runs.prepare(tiny_config(tmp_path), [], None, None, runs.NodeArgs(nnodes="2"))



def _srun_task(rank: int, world: int, cfg: Path, run_dir: Path, port: int):
    """One task of ``srun --ntasks 2``: Slurm's variables, none of torchrun's; ``dtrain run`` as its command."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    os.environ.update({"SLURM_JOB_ID": "99", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                       "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": str(world), "SLURM_STEP_NUM_NODES": "1",
                       "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(world),
                       "MASTER_PORT": str(port)})
    return cli_in_process("run", str(cfg), "--run-dir", str(run_dir), "--quiet")


@pytest.mark.slow
def test_srun_with_one_task_per_slot_trains_in_place(tmp_path):
    """srun started one task per slot (no torchrun): each task trains in place with Slurm's rank and
    world; the first task serves the store its peers learn the run directory from. The tasks are processes
    forked from this one (srun's would import torch first thing, as these have)."""
    from helpers import held_port, run_ranks

    cfg = tiny_config(tmp_path)
    with held_port() as port:  # until the first task serves its store on it
        results = run_ranks(_srun_task, 2, timeout=90, args=(cfg, tmp_path / "r", port))
    for result in results:
        assert result.code == 0, result.stderr
    assert results[0].stdout.count("dtrain: done") == 1 and "on 2 slot(s)" in results[0].stdout
    assert "dtrain: done" not in results[1].stdout  # one summary, from the first task
    summary = yaml.safe_load((tmp_path / "r" / "summary.json").read_text())
    assert summary["slots"] == 2 and summary["batches"] == 24
