"""Cluster files that start a `plait run` job: an sbatch script or a Kubernetes manifest.

`plait run --emit slurm|kubernetes [flags] script.py args` writes, instead of running, a file
that runs the same command on every node of a cluster:

| target | file | node rank from | rendezvous host |
|---|---|---|---|
| `slurm` | sbatch script, one `srun` task per node | `$SLURM_NODEID` | first host |
| `kubernetes` | Kubeflow `PyTorchJob` (`--k8s-api pytorchjob`) | `$(RANK)` | `$(MASTER_ADDR)` |
| `kubernetes` | `JobSet` of one Indexed Job (`--k8s-api jobset`) | completion index | pod 0 |

In every case each node runs `plait run --worker-num W --local-worker-num L --node-rank R
--master-addr A --master-port P ...`, so the c10d rendezvous, restarts and logs behave as on
a workstation. Restarts belong to `--max-restarts` (the pods use `restartPolicy: Never`).

The manifests are checked against the published CRD schemas and the operators' own rules
(tests/unit/test_launch_k8s_schema.py, schemas in tests/data/k8s), and their container command is
run as pods would run it (tests/dist/test_launch_k8s_pods.py). The rules those checks pinned:

- PyTorchJob: the training operator reads the rendezvous port from the container named
  `pytorch`, port `pytorchjob-port` (training-operator v1.9 `getPortFromPyTorchJob`; its webhook
  refuses a job with no container named `pytorch`); Master has exactly 1 replica.
- Names: a DNS-1035 label (lower-case letters, digits, '-', starting with a letter, at most 63),
  as the PyTorchJob webhook and JobSet require; JobSet also refuses a name whose pod names
  `<name>-node-0-<index>-xxxxx` would pass 63 characters.
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from enum import StrEnum

import yaml

from plait.errors import LaunchError
from plait.launch.config import RunConfig

__all__ = ["EmitOptions", "EmitTarget", "KubernetesApi", "emit", "plait_run_argv"]

PYTORCHJOB_CONTAINER = "pytorch"
"""The container name the Kubeflow training operator requires (`PyTorchJobDefaultContainerName`)."""
PYTORCHJOB_PORT = "pytorchjob-port"
"""The port name it reads `MASTER_PORT` from (`PyTorchJobDefaultPortName`)."""
JOBSET_REPLICATED_JOB = "node"
"""Name of the JobSet's one replicated job: pods are `<name>-node-0-<node rank>`."""
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_MAX_NAME = 63


class EmitTarget(StrEnum):
    """What `--emit` writes."""

    SLURM = "slurm"
    KUBERNETES = "kubernetes"


class KubernetesApi(StrEnum):
    """Which Kubernetes job API the manifest uses."""

    PYTORCHJOB = "pytorchjob"
    JOBSET = "jobset"


@dataclass(frozen=True, kw_only=True, slots=True)
class EmitOptions:
    """Settings of the emitted file that `plait run` itself does not need."""

    target: EmitTarget
    """slurm or kubernetes."""
    job_name: str = "plait"
    """Job name (Slurm job name, Kubernetes object name)."""
    image: str | None = None
    """Container image (Kubernetes; required there)."""
    k8s_api: KubernetesApi = KubernetesApi.PYTORCHJOB
    """PyTorchJob (Kubeflow training operator) or JobSet."""

    def __post_init__(self) -> None:
        if self.target is EmitTarget.KUBERNETES and not self.image:
            raise LaunchError(
                "--emit kubernetes needs --image: the container image that holds plait, torch"
                " and the script (e.g. --image registry.example.com/team/train:1.0)."
            )
        if not _DNS1035.fullmatch(self.job_name) or len(self.job_name) > _MAX_NAME:
            raise LaunchError(
                f"--job-name {self.job_name!r} is not a DNS-1035 label, which Kubernetes job"
                " names must be: lower-case letters, digits and '-', starting with a letter and"
                f" ending with a letter or digit, at most {_MAX_NAME} characters"
                " (e.g. 'llama-pretrain')."
            )


def plait_run_argv(config: RunConfig, *, node_rank: str, master_addr: str) -> list[str]:
    """The `plait run` command line every node runs (node rank and host as given)."""
    argv = [
        "plait", "run",
        "--worker-num", str(config.worker_num),
        "--local-worker-num", str(config.local_worker_num),
        "--master-addr", master_addr,
        "--master-port", str(config.master_port),
        "--node-rank", node_rank,
        "--cluster-timeout", f"{config.cluster_timeout:g}",
        "--max-restarts", str(config.max_restarts),
        "--tail-worker-log", ",".join(map(str, config.tail_ranks)) or "none",
    ]  # fmt: skip
    if config.log_dir:
        argv += ["--log-dir", config.log_dir]
    if config.join:
        argv.append("--join")
    if config.bind_core:
        argv.append("--bind-core")
    if config.checkpoint_dir:
        argv += ["--checkpoint-dir", config.checkpoint_dir]
    if config.run_id != "plait":
        argv += ["--run-id", config.run_id]
    return [*argv, *config.program]


def emit(config: RunConfig, options: EmitOptions) -> str:
    """The text of the cluster file."""
    if config.elastic:
        raise LaunchError(
            f"--emit {options.target.value} with --nnodes {config.nnodes_text}: the emitted"
            " files start a fixed number of nodes (an sbatch allocation, a job's replicas), so"
            " the job would not be elastic. Pass --nnodes N (or --worker-num) for --emit."
        )
    if options.target is EmitTarget.SLURM:
        return sbatch_script(config, options)
    if options.k8s_api is KubernetesApi.JOBSET:
        return _dump(jobset_manifest(config, options))
    return _dump(pytorchjob_manifest(config, options))


def sbatch_script(config: RunConfig, options: EmitOptions) -> str:
    """An sbatch script: one `srun` task per node, each running `plait run`."""
    inner = shlex.join(
        plait_run_argv(config, node_rank="__NODE_RANK__", master_addr="__MASTER_ADDR__")
    )
    inner = inner.replace("__NODE_RANK__", '"$SLURM_NODEID"').replace(
        "__MASTER_ADDR__", '"$MASTER_ADDR"'
    )
    return "\n".join([
        "#!/bin/bash",
        f"# Generated by `plait run --emit slurm`: {config.worker_num} workers on"
        f" {config.num_nodes} node(s), {config.local_worker_num} per node.",
        f"#SBATCH --job-name={options.job_name}",
        f"#SBATCH --nodes={config.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={options.job_name}-%j.out",
        "# Add your site's options, e.g. #SBATCH --gpus-per-node="
        f"{config.local_worker_num} --time=01:00:00",
        "set -euo pipefail",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_ADDR",
        "# One plait run per node; it starts the node's workers and joins the c10d rendezvous.",
        f"srun --nodes={config.num_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"    bash -c {shlex.quote('exec ' + inner)}",
        "",
    ])  # fmt: skip


def _container(
    config: RunConfig, options: EmitOptions, *, name: str, port: str, node_rank: str, master: str
) -> dict:
    return {
        "name": name,
        "image": options.image,
        "command": plait_run_argv(config, node_rank=node_rank, master_addr=master),
        "ports": [{"name": port, "containerPort": config.master_port}],
    }


def pytorchjob_manifest(config: RunConfig, options: EmitOptions) -> dict:
    """A Kubeflow `PyTorchJob`: pod 0 is the Master, the other nodes are Workers.

    The training operator sets `RANK` (0 on the Master, 1 + index on Worker i), `MASTER_ADDR`
    (the Master's service, `<name>-master-0`) and `MASTER_PORT` (the container port named
    `pytorchjob-port`) in every pod; Kubernetes expands `$(VAR)` in the command from them.
    """
    container = _container(
        config, options, name=PYTORCHJOB_CONTAINER, port=PYTORCHJOB_PORT,
        node_rank="$(RANK)", master="$(MASTER_ADDR)",
    )  # fmt: skip

    def replica(count: int) -> dict:
        return {
            "replicas": count,
            "restartPolicy": "Never",
            "template": {"spec": {"containers": [copy.deepcopy(container)]}},
        }

    specs = {"Master": replica(1)}
    if config.num_nodes > 1:
        specs["Worker"] = replica(config.num_nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": options.job_name},
        "spec": {"runPolicy": {"backoffLimit": 0}, "pytorchReplicaSpecs": specs},
    }


def jobset_manifest(config: RunConfig, options: EmitOptions) -> dict:
    """A `JobSet` with one Indexed Job of `num_nodes` pods; pod i is node i.

    With DNS hostnames on, pod i is `<name>-node-0-<i>` in the subdomain `<name>`, so node 0 is
    reached at `<name>-node-0-0.<name>`; the node rank is the pod's completion index.
    """
    name = options.job_name
    pod = f"{name}-{JOBSET_REPLICATED_JOB}-0-{config.num_nodes - 1}-xxxxx"
    if len(pod) > _MAX_NAME:
        raise LaunchError(
            f"--job-name {name!r} is too long for a JobSet of {config.num_nodes} node(s): its pod"
            f" names ({pod!r}, the JobSet webhook counts a 5-character suffix) would pass"
            f" {_MAX_NAME} characters. Use a name of at most"
            f" {len(name) - (len(pod) - _MAX_NAME)} characters."
        )
    master = f"{name}-{JOBSET_REPLICATED_JOB}-0-0.{name}"
    container = _container(
        config, options, name="plait", port="rendezvous", node_rank="$(NODE_RANK)", master=master
    )
    container["env"] = [{
        "name": "NODE_RANK",
        "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
        }},
    }]  # fmt: skip
    job = {
        "parallelism": config.num_nodes,
        "completions": config.num_nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}
            ],
        },
    }


class _PlainDumper(yaml.SafeDumper):
    """A YAML dumper that writes repeated objects out again instead of as `&id001`/`*id001`."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _dump(manifest: dict) -> str:
    header = "# Generated by `plait run --emit kubernetes`.\n"
    return header + yaml.dump(
        manifest, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False
    )
