"""The `--emit kubernetes` manifests run as their pods would run them, on this machine.

For each API the test emits a 2-node manifest (2 workers per node), then starts one local
process per pod running the pod's container command exactly as written there, after the two
substitutions Kubernetes makes:

- the environment the operator gives the pod. PyTorchJob, from training-operator v1.9.0
  (pkg/controller.v1/pytorch/envvar.go and master.go): PYTHONUNBUFFERED, MASTER_PORT and
  PET_MASTER_PORT (the Master's container `pytorch`, port `pytorchjob-port`; the operator fails
  the job when there is none), MASTER_ADDR and PET_MASTER_ADDR (`<job>-master-0`), WORLD_SIZE
  (replicas x nprocPerNode, 1 when unset), RANK and PET_NODE_RANK (0 on the Master, 1 + index on
  Worker i), PET_NNODES. JobSet: the Job controller's JOB_COMPLETION_INDEX and the pod's
  `batch.kubernetes.io/job-completion-index` annotation (what the manifest's fieldRef reads).
  Both: HOSTNAME, the pod's hostname;
- `$(VAR)` in command and args expanded from the container's environment (`$$` is a literal
  `$`, an undefined `$(VAR)` stays as written), as the kubelet does.

Names resolve as in the cluster: each pod runs in a user, mount and UTS namespace of its own
(`unshare`), with its pod hostname and an /etc/hosts that maps every pod's names (hostname,
`<hostname>.<subdomain>`, the FQDN; the PyTorchJob services `<job>-master-0` ...) to a loopback
address of its own, pod 0 at 127.0.0.1. Where namespaces cannot be made, the pods share the
machine's names instead and the rendezvous host is pointed at 127.0.0.1 (the operator's
MASTER_ADDR, the JobSet's pod-0 name in the command): the command still runs as emitted.

The job trains a linear model for 4 SGD steps with averaged gradients: both pods exit 0, every
rank ends with the same weights, and they equal one process's training on all ranks' data.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import torch
import yaml

from plait.cli import main
from tests.dist.test_launch_e2e import clean_env, free_port, results, script

pytestmark = pytest.mark.dist

PY = sys.executable
STEPS, ROWS, WORKERS, NODES = 4, 8, 4, 2
TRUE_W = [1.0, -2.0, 0.5, 3.0]

TRAIN = f"""
import torch
import torch.distributed as dist
from plait.launch import init

world = init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({STEPS}):
    x = torch.randn({ROWS}, 4, generator=torch.Generator().manual_seed(1000 * step + world.rank))
    loss = torch.nn.functional.mse_loss(model(x), x @ torch.tensor({TRUE_W}).unsqueeze(1))
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world.world_size
    opt.step()
weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
print(f"RESULT rank={{world.rank}} size={{world.world_size}} node={{world.node_rank}}"
      f" weights={{weights}}", flush=True)
dist.destroy_process_group()
"""


def one_process_weights() -> list[float]:
    """What the job must end with: the same steps on every rank's rows at once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.cat([
            torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1000 * step + rank))
            for rank in range(WORKERS)
        ])  # fmt: skip
        loss = torch.nn.functional.mse_loss(model(x), x @ torch.tensor(TRUE_W).unsqueeze(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


@dataclass
class Pod:
    """One pod as the cluster would start it: names, address, container and environment."""

    hostname: str
    names: list[str]
    """Every name that resolves to this pod (hostname, FQDN, services)."""
    address: str
    container: dict
    env: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][-._A-Za-z0-9]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of a command or args item."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(one, text)


def container_env(pod: Pod) -> dict[str, str]:
    """The container's own `env` (values and fieldRefs) followed by what the cluster adds."""
    env: dict[str, str] = {}
    for var in pod.container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        m = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
        if m is None or m.group(1) not in pod.annotations:
            pytest.fail(f"the pod has no {path} (annotations {pod.annotations})")
        env[var["name"]] = pod.annotations[m.group(1)]
    return {**env, **pod.env, "HOSTNAME": pod.hostname}


def pytorchjob_pods(doc: dict) -> list[Pod]:
    """The Master and Worker pods of a PyTorchJob, as training-operator v1.9.0 makes them."""
    name, specs = doc["metadata"]["name"], doc["spec"]["pytorchReplicaSpecs"]
    master = next(
        (c for c in specs["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch"),
        None,
    )
    port = next(
        (p for p in (master or {}).get("ports", []) if p["name"] == "pytorchjob-port"), None
    )
    if port is None:
        pytest.fail("training-operator: no container 'pytorch' with port 'pytorchjob-port'")
    replicas = [("master", 0)] + [
        ("worker", i) for i in range(specs.get("Worker", {}).get("replicas", 0))
    ]
    pods = []
    for node, (role, index) in enumerate(replicas):
        spec = specs[role.capitalize()]["template"]["spec"]
        (container,) = spec["containers"]
        host = f"{name}-{role}-{index}"  # the pod's name, hostname and headless service
        pods.append(Pod(hostname=host, names=[host], address=f"127.0.0.{node + 1}",
                        container=container, env={
            "PYTHONUNBUFFERED": "1",
            "MASTER_PORT": str(port["containerPort"]),
            "PET_MASTER_PORT": str(port["containerPort"]),
            "MASTER_ADDR": f"{name}-master-0",
            "PET_MASTER_ADDR": f"{name}-master-0",
            "WORLD_SIZE": str(len(replicas)),
            "RANK": str(node),
            "PET_NODE_RANK": str(node),
            "PET_NNODES": str(len(replicas)),
        }))  # fmt: skip
    return pods


def jobset_pods(doc: dict, namespace: str = "default") -> list[Pod]:
    """The pods of a JobSet's Indexed Jobs, with DNS hostnames as the JobSet controller sets."""
    name = doc["metadata"]["name"]
    subdomain = doc["spec"].get("network", {}).get("subdomain", name)
    pods = []
    for rjob in doc["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        for job_index in range(rjob["replicas"]):
            for index in range(job["completions"]):
                (container,) = job["template"]["spec"]["containers"]
                host = f"{name}-{rjob['name']}-{job_index}-{index}"
                fqdn = f"{host}.{subdomain}.{namespace}.svc.cluster.local"
                pods.append(Pod(
                    hostname=host, names=[fqdn, f"{host}.{subdomain}", host],
                    address=f"127.0.0.{len(pods) + 1}", container=container,
                    env={"JOB_COMPLETION_INDEX": str(index)},
                    annotations={"batch.kubernetes.io/job-completion-index": str(index)},
                ))  # fmt: skip
    return pods


@cache
def namespaces_work() -> bool:
    """Whether this machine lets an unprivileged process make user, mount and UTS namespaces."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "--uts", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


IN_POD = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


def pod_argv(pod: Pod, hosts: Path, env: dict[str, str]) -> list[str]:
    """The pod's command, expanded, inside its own namespaces where the machine allows."""
    argv = [expand(a, env) for a in [*pod.container["command"], *pod.container.get("args", [])]]
    if not namespaces_work():
        return argv
    return ["unshare", "--user", "--map-root-user", "--mount", "--uts", "--",
            "sh", "-c", IN_POD, "sh", str(hosts), pod.hostname, *argv]  # fmt: skip


def run_pods(pods: list[Pod], tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """Start every pod at once; wait for all of them."""
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "".join(f"{p.address} {' '.join(p.names)}\n" for p in pods) + "127.0.0.1 localhost\n"
    )
    bin_dir = tmp_path / "bin"  # the image's `plait` entry point
    bin_dir.mkdir()
    (bin_dir / "plait").write_text(f'#!/bin/sh\nexec "{PY}" -m plait "$@"\n')
    (bin_dir / "plait").chmod(0o755)
    procs = []
    for pod in pods:
        env = container_env(pod)
        if not namespaces_work():  # the pods share this machine's names: point them at pod 0
            env.update({k: "127.0.0.1" for k in ("MASTER_ADDR", "PET_MASTER_ADDR") if k in env})
        argv = pod_argv(pod, hosts, env)
        if not namespaces_work():
            argv = ["127.0.0.1" if a in pods[0].names else a for a in argv]
        base = clean_env()
        base["PATH"] = f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"
        procs.append(subprocess.Popen(
            argv, env={**base, **env}, cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def emitted(api: str, tmp_path: Path) -> dict:
    train = script(tmp_path, "train.py", TRAIN)
    out = tmp_path / "job.yaml"
    argv = ["run", "--emit", "kubernetes", "--k8s-api", api, "--image", "reg.example/t:1",
            "--job-name", "tiny", "--worker-num", str(WORKERS),
            "--local-worker-num", str(WORKERS // NODES), "--master-port", str(free_port()),
            "--cluster-timeout", "90", "--tail-worker-log", "all", "-o", str(out), train]  # fmt: skip
    assert main(argv) == 0
    return yaml.safe_load(out.read_text())


# JobSet's pods nightly: the same launcher path as PyTorchJob's, which make test runs
@pytest.mark.parametrize("api", ["pytorchjob", pytest.param("jobset", marks=pytest.mark.nightly)])
def test_launch_k8s_pods_train(api: str, tmp_path: Path) -> None:
    doc = emitted(api, tmp_path)
    pods = pytorchjob_pods(doc) if api == "pytorchjob" else jobset_pods(doc)
    assert len(pods) == NODES
    procs = run_pods(pods, tmp_path)
    for pod, proc in zip(pods, procs, strict=True):
        assert proc.returncode == 0, f"pod {pod.hostname}:\n{proc.stdout}\n{proc.stderr}"
    expected = one_process_weights()
    local = WORKERS // NODES
    for node, proc in enumerate(procs):
        lines = results(proc.stdout)
        ranks = [int(line.split()[0].removeprefix("rank=")) for line in lines]
        assert ranks == [node * local + i for i in range(local)], lines
        for line in lines:
            assert f"size={WORKERS} node={node}" in line, line
            weights = [float(w) for w in line.split("weights=[")[1].rstrip("]").split(",")]
            assert weights == pytest.approx(expected, abs=1e-6), (line, expected)
