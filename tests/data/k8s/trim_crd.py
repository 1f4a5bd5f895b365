"""Make a CRD's schema into the test data beside this file (run by hand; see README.md).

    python tests/data/k8s/trim_crd.py CRD.yaml VERSION OUT.json [--open PATH ...]

Takes the `openAPIV3Schema` of version VERSION of the CustomResourceDefinition in CRD.yaml,
drops every `description` (documentation only) and the `status` property (never written by
a client), and replaces each subtree named by `--open` (a '/'-separated path of property
names; `*` steps into `additionalProperties`, `[]` into `items`) with an open schema of the
same type (`x-kubernetes-preserve-unknown-fields: true`). An opened subtree accepts anything,
so the trimmed schema never refuses what the published one accepts; plait writes nothing there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    """`node` without its `description` keys, at every depth."""
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def open_subtree(schema: dict, path: str) -> None:
    """Replace the subschema at `path` by an open one of the same type (in place)."""
    *parents, last = path.split("/")
    node = schema
    for step in parents:
        node = _step(node, step)
    props = node["properties"]
    if last not in props:
        raise SystemExit(f"--open {path!r}: no property {last!r} there (has {sorted(props)})")
    props[last] = {"type": props[last]["type"], "x-kubernetes-preserve-unknown-fields": True}


def _step(node: dict, step: str) -> dict:
    if step == "*":
        return node["additionalProperties"]
    if step == "[]":
        return node["items"]
    return node["properties"][step]


def trim(crd: dict, version: str, opened: list[str]) -> dict:
    """The trimmed `openAPIV3Schema` of `version`."""
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    if version not in versions:
        raise SystemExit(f"version {version!r} not in the CRD (has {sorted(versions)})")
    schema = strip_descriptions(versions[version]["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)
    for path in opened:
        open_subtree(schema, path)
    return schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("version")
    parser.add_argument("out", type=Path)
    parser.add_argument("--open", action="append", default=[], metavar="PATH")
    parser.add_argument("--source", required=True, help="repository, commit and path, recorded")
    args = parser.parse_args()
    schema = trim(yaml.safe_load(args.crd.read_text()), args.version, args.open)
    crd = yaml.safe_load(args.crd.read_text())
    doc = {
        "source": args.source,
        "licence": "Apache-2.0",
        "crd": crd["metadata"]["name"],
        "version": args.version,
        "opened": args.open,
        "openAPIV3Schema": schema,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
