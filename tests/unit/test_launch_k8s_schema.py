"""`plait run --emit kubernetes` against the published CRD schemas and the operators' rules.

The schemas are the `openAPIV3Schema` of Kubeflow's PyTorchJob CRD (training-operator v1.9.0)
and of the JobSet CRD (kubernetes-sigs/jobset), trimmed as tests/data/k8s/README.md says. Both
inline the core objects they embed (PodTemplateSpec, Container, EnvVar, batch/v1 JobSpec), as
controller-gen writes them, so one schema checks the whole manifest.

The API server reads such a structural schema more strictly than plain JSON Schema does, and
`k8s_validator` reads it the same way:

- an object with `properties` is closed: a field it does not name is refused (kubectl's
  default strict field validation; without it the field would be silently dropped), unless it
  says `x-kubernetes-preserve-unknown-fields`;
- `x-kubernetes-int-or-string` takes an integer or a string, `format: int32/int64` the range;
- `x-kubernetes-list-type: map` refuses two items with the same `x-kubernetes-list-map-keys`
  (a key's schema default counts when the item leaves it out), `set` refuses duplicates.

What the schema cannot say and the operators check (webhooks, controllers) is tested beside
it from their sources: the PyTorchJob container and port names, the Master's one replica, the
DNS-1035 object name, the JobSet's pod-name length.
Nothing here starts a process; each case takes milliseconds.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from jsonschema import validators

from plait.cli import main
from plait.launch import LaunchError
from plait.launch.emit import (
    PYTORCHJOB_CONTAINER,
    PYTORCHJOB_PORT,
    EmitOptions,
    EmitTarget,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
SCHEMAS = {"pytorchjob": "pytorchjob.v1.schema.json", "jobset": "jobset.v1alpha2.schema.json"}
API_VERSIONS = {"pytorchjob": ("kubeflow.org/v1", "PyTorchJob"),
                "jobset": ("jobset.x-k8s.io/v1alpha2", "JobSet")}  # fmt: skip
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# k8s.io/apimachinery validation.IsDNS1035Label
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# The ObjectMeta fields a client may write (k8s.io/apimachinery ObjectMeta; the rest are
# the server's). The CRDs say only `metadata: {type: object}`: the server checks metadata.
OBJECT_META = {"name", "generateName", "namespace", "labels", "annotations", "finalizers",
               "ownerReferences"}  # fmt: skip


def closed(schema: Any) -> Any:
    """`schema` with every object that names its `properties` closed to other fields."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _int_or_string(_v: Any, on: bool, instance: Any, _schema: dict) -> Iterator[Any]:
    if on and (isinstance(instance, bool) or not isinstance(instance, int | str)):
        yield jsonschema.ValidationError(f"{instance!r} is neither an integer nor a string")


def _list_type(_v: Any, kind: str, instance: Any, schema: dict) -> Iterator[Any]:
    if not isinstance(instance, list):
        return
    if kind == "set":
        seen = [json.dumps(item, sort_keys=True) for item in instance]
        if len(seen) != len(set(seen)):
            yield jsonschema.ValidationError(f"duplicate items in a list of type set: {instance}")
    elif kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        props = schema.get("items", {}).get("properties", {})
        tuples = [
            tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
            for item in instance
            if isinstance(item, dict)
        ]
        dupes = sorted({t for t in tuples if tuples.count(t) > 1}, key=str)
        if dupes:
            yield jsonschema.ValidationError(
                f"duplicate keys {dict(zip(keys, dupes[0], strict=True))} in a list of type map"
            )


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker(())
    for name, (low, high) in INT_RANGES.items():
        checker.checks(name)(lambda v, lo=low, hi=high: not isinstance(v, int) or lo <= v <= hi)
    return checker


K8sValidator = validators.extend(
    jsonschema.Draft4Validator,
    {"x-kubernetes-int-or-string": _int_or_string, "x-kubernetes-list-type": _list_type},
)


def k8s_validator(api: str) -> jsonschema.protocols.Validator:
    """A validator of `api`'s manifests that reads the CRD schema as the API server does."""
    doc = json.loads((DATA / SCHEMAS[api]).read_text())
    return K8sValidator(closed(doc["openAPIV3Schema"]), format_checker=_format_checker())


def schema_errors(api: str, manifest: dict) -> list[str]:
    """Every schema error in `manifest`, as 'path: message', plus the metadata rules."""
    errors = [
        "/".join(map(str, e.absolute_path)) + ": " + e.message
        for e in k8s_validator(api).iter_errors(manifest)
    ]
    meta = manifest.get("metadata", {})
    errors += [f"metadata/{k}: not an ObjectMeta field" for k in sorted(set(meta) - OBJECT_META)]
    name = meta.get("name", "")
    if not DNS1035.fullmatch(name) or len(name) > 63:
        errors.append(f"metadata/name: {name!r} is not a DNS-1035 label")
    if (manifest.get("apiVersion"), manifest.get("kind")) != API_VERSIONS[api]:
        errors.append(f"apiVersion/kind: {manifest.get('apiVersion')}/{manifest.get('kind')}")
    return errors


def emitted(api: str, tmp_path: Path, *flags: str) -> dict:
    """The manifest `plait run --emit kubernetes --k8s-api api` writes for `flags`."""
    train = tmp_path / "train.py"
    train.write_text("print('hi')\n")
    out = tmp_path / f"{api}.yaml"
    argv = ["run", "--emit", "kubernetes", "--k8s-api", api, "--image", "reg.example/t:1",
            "-o", str(out), *flags, str(train), "--lr", "0.1"]  # fmt: skip
    assert main(argv) == 0
    return yaml.safe_load(out.read_text())


FLAG_SETS = {
    "one-node": ["--worker-num", "2"],
    "two-nodes": ["--worker-num", "4", "--local-worker-num", "2", "--job-name", "llama-7b"],
    "twelve-nodes-all-flags": [
        "--worker-num", "96", "--local-worker-num", "8", "--master-port", "29400",
        "--max-restarts", "3", "--log-dir", "/logs", "--join", "--bind-core",
        "--checkpoint-dir", "/ckpt", "--run-id", "r1", "--tail-worker-log", "0,8",
    ],
}  # fmt: skip


@pytest.mark.parametrize("api", sorted(SCHEMAS))
@pytest.mark.parametrize("flags", sorted(FLAG_SETS))
def test_launch_k8s_manifest_matches_published_schema(api: str, flags: str, tmp_path) -> None:
    assert schema_errors(api, emitted(api, tmp_path, *FLAG_SETS[flags])) == []


@pytest.mark.parametrize("api", sorted(SCHEMAS))
def test_launch_k8s_manifest_has_no_yaml_aliases(api: str, tmp_path) -> None:
    # The Master and Worker share one container; written as `&id001`/`*id001` it would load,
    # but tools that template or patch the file see one object where there are two.
    emitted(api, tmp_path, *FLAG_SETS["two-nodes"])
    text = (tmp_path / f"{api}.yaml").read_text()
    assert not [e for e in yaml.parse(text) if isinstance(e, yaml.AliasEvent)]
    assert not any(getattr(e, "anchor", None) for e in yaml.parse(text))


def _pod_spec(api: str, doc: dict) -> dict:
    if api == "pytorchjob":
        return doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _set(path: str, value: Any) -> Callable[[str, dict], None]:
    def edit(api: str, doc: dict) -> None:
        node = _pod_spec(api, doc) if path.startswith("pod/") else doc
        *parents, last = path.removeprefix("pod/").split("/")
        for step in parents:
            node = node[int(step)] if step.isdigit() else node[step]
        node[last] = value

    return edit


def _duplicate_env(api: str, doc: dict) -> None:
    container = _pod_spec(api, doc)["containers"][0]
    container["env"] = [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]


def _duplicate_port(api: str, doc: dict) -> None:
    ports = _pod_spec(api, doc)["containers"][0]["ports"]
    ports.append({"name": "other", "containerPort": ports[0]["containerPort"], "protocol": "TCP"})


# What the published schema refuses (and so must the validator): each edit of an emitted
# manifest and the path of the error it must give.
BROKEN = {
    "unknown top-level spec field": (_set("spec/replicas", 2), "spec: Additional properties"),
    "misspelt container field": (_set("pod/containers/0/comand", ["x"]), "containers/0: Addit"),
    "string containerPort": (_set("pod/containers/0/ports/0/containerPort", "80"), "ports/0/co"),
    "port out of int32": (_set("pod/containers/0/ports/0/containerPort", 2**31), "ports/0/co"),
    "container without a name": (_set("pod/containers/0/name", None), "containers/0/name"),
    "command not a list": (_set("pod/containers/0/command", "plait run"), "containers/0/com"),
    "two env vars of one name": (_duplicate_env, "containers/0/env: duplicate keys"),
    "two ports of one number": (_duplicate_port, "containers/0/ports: duplicate keys"),
    "unknown metadata field": (_set("metadata/nmae", "x"), "metadata/nmae: not an ObjectMeta"),
    "upper-case name": (_set("metadata/name", "Llama"), "metadata/name: 'Llama' is not"),
}


@pytest.mark.parametrize("api", sorted(SCHEMAS))
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_launch_k8s_schema_refuses_broken_manifest(api: str, case: str, tmp_path) -> None:
    edit, error = BROKEN[case]
    doc = emitted(api, tmp_path, *FLAG_SETS["two-nodes"])
    broken = copy.deepcopy(doc)
    edit(api, broken)
    assert broken != doc
    errors = schema_errors(api, broken)
    assert any(error in e for e in errors), errors


def test_launch_k8s_schema_checks_api_specific_fields(tmp_path) -> None:
    job = emitted("pytorchjob", tmp_path, *FLAG_SETS["two-nodes"])
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "1"
    job["spec"]["runPolicy"]["backoffLimit"] = 0.5
    assert sorted(e.split(":")[0] for e in schema_errors("pytorchjob", job)) == [
        "spec/pytorchReplicaSpecs/Master/replicas", "spec/runPolicy/backoffLimit"
    ]  # fmt: skip
    jobset = emitted("jobset", tmp_path, *FLAG_SETS["two-nodes"])
    jobset["spec"]["successPolicy"] = {"operator": "Most"}
    del jobset["spec"]["replicatedJobs"][0]["name"]
    assert sorted(e.split(":")[0] for e in schema_errors("jobset", jobset)) == [
        "spec/replicatedJobs/0", "spec/successPolicy/operator"
    ]  # fmt: skip


@pytest.mark.parametrize("flags", sorted(FLAG_SETS))
def test_launch_k8s_pytorchjob_follows_training_operator(flags: str, tmp_path) -> None:
    # training-operator v1.9.0: pkg/webhooks/pytorch/pytorchjob_webhook.go (a container named
    # "pytorch" in every replica, Master replicas == 1, Worker replicas >= 1) and
    # pkg/controller.v1/pytorch/envvar.go getPortFromPyTorchJob (MASTER_PORT is the Master's
    # "pytorch" container's port named "pytorchjob-port"; without it the job never starts).
    doc = emitted("pytorchjob", tmp_path, *FLAG_SETS[flags])
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {"replicas": 1})["replicas"] >= 1
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == PYTORCHJOB_CONTAINER == "pytorch"
        (port,) = container["ports"]
        assert port["name"] == PYTORCHJOB_PORT == "pytorchjob-port"
        flags_ = container["command"]
        assert port["containerPort"] == int(flags_[flags_.index("--master-port") + 1])


@pytest.mark.parametrize("flags", sorted(FLAG_SETS))
def test_launch_k8s_jobset_follows_jobset_webhook(flags: str, tmp_path) -> None:
    # jobset pkg/webhooks/jobset_webhook.go: pod names `<js>-<rjob>-<job index>-<pod index>`
    # plus a 5-character suffix are DNS-1035 labels; Indexed Job pods need restartPolicy
    # Never or OnFailure (batch/v1 validation).
    doc = emitted("jobset", tmp_path, *FLAG_SETS[flags])
    (rjob,) = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    longest = f"{doc['metadata']['name']}-{rjob['name']}-{rjob['replicas'] - 1}-"
    longest += f"{job['completions'] - 1}-abcde"
    assert DNS1035.fullmatch(longest) and len(longest) <= 63
    assert job["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    master = job["template"]["spec"]["containers"][0]["command"]
    name = doc["metadata"]["name"]
    assert master[master.index("--master-addr") + 1] == f"{name}-{rjob['name']}-0-0.{name}"


@pytest.mark.parametrize(
    "name", ["Llama", "1job", "job-", "-job", "job_1", "job.1", "a" * 64, ""]
)  # fmt: skip
def test_launch_k8s_bad_job_names_are_refused(name: str) -> None:
    with pytest.raises(LaunchError, match="DNS-1035 label"):
        EmitOptions(target=EmitTarget.KUBERNETES, job_name=name, image="i:1")


def test_launch_k8s_jobset_name_too_long_for_its_pods(tmp_path, capsys) -> None:
    name = "a" * 48  # a-...-node-0-9-abcde is 63 characters; -node-0-10-abcde is 64
    doc = emitted("jobset", tmp_path, "--job-name", name, "--worker-num", "10",
                  "--local-worker-num", "1")  # fmt: skip
    assert schema_errors("jobset", doc) == []
    argv = ["run", "--emit", "kubernetes", "--k8s-api", "jobset", "--image", "i:1",
            "--job-name", name, "--worker-num", "11", "--local-worker-num", "1",
            str(tmp_path / "train.py")]  # fmt: skip
    assert main(argv) == 2
    assert "at most 47 characters" in capsys.readouterr().err
