#!/usr/bin/env python3
"""Renders the Helm chart deploy/helm/bmq and turns its StatefulSet into a plan for running each
pod as a container: what a kubelet would do, written down for tests/tests/helm_pods.rs.

    target/helm-venv/bin/python scripts/helm_pods.py --values JSON --out DIR [--secrets DIR]

Writes DIR/plan.json and, per pod, DIR/<pod>/<volume>/ with the files of each ConfigMap,
Secret and projected volume the pod mounts (keys and item paths as Kubernetes lays them out,
modes from defaultMode, group-owned by the pod's fsGroup when run as root, readable by all
otherwise). Secrets the chart renders are taken from the render; the others (TLS certificates
in production) from --secrets DIR/<secret name>/<key>. A Secret or key that exists nowhere is
an error, as the pod would not start, unless the volume marks it optional.

plan.json: {"network": the headless Service, "pods": [{"name", "hostname", "aliases" (the
pod's DNS names through the headless Service), "image", "command", "env" (fieldRef and
secretKeyRef resolved), "user", "read_only_root", "drop_all_capabilities",
"no_new_privileges", "mounts": [{"source", "target", "read_only"}], "tmpfs": [target],
"claims": [{"name", "target"}], "ports": {name: port}, "readiness", "liveness", "startup"
({"path", "port"}), "pre_stop": command, "grace_seconds"}]}.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/bmq"
RELEASE = "rel"
NAMESPACE = "bmq-ns"
CLUSTER_DOMAIN = "cluster.local"


def render(values: dict) -> list[dict]:
    rendered = helm.Chart.load(CHART).render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if not path.endswith("NOTES.txt"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


class Sources:
    """The ConfigMaps and Secrets a pod can name: rendered ones, then --secrets DIR."""

    def __init__(self, docs: list[dict], secrets_dir: Path | None) -> None:
        self.configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
        self.secrets: dict[str, dict[str, bytes]] = {}
        for d in docs:
            if d["kind"] == "Secret":
                data = {k: base64.b64decode(v) for k, v in (d.get("data") or {}).items()}
                data.update({k: v.encode() for k, v in (d.get("stringData") or {}).items()})
                self.secrets[d["metadata"]["name"]] = data
        self.secrets_dir = secrets_dir

    def configmap(self, name: str) -> dict[str, bytes]:
        if name not in self.configmaps:
            raise SystemExit(f"helm-pods: ConfigMap {name} is not rendered")
        return {k: v.encode() for k, v in self.configmaps[name].items()}

    def has_secret(self, name: str) -> bool:
        return name in self.secrets or (self.secrets_dir is not None and (self.secrets_dir / name).is_dir())

    def secret(self, name: str) -> dict[str, bytes]:
        if name in self.secrets:
            return self.secrets[name]
        d = self.secrets_dir / name if self.secrets_dir else None
        if d is None or not d.is_dir():
            raise SystemExit(f"helm-pods: Secret {name} is neither rendered nor in --secrets")
        return {f.name: f.read_bytes() for f in d.iterdir() if f.is_file()}


def write_files(dest: Path, files: dict[str, bytes], mode: int, group: int | None) -> None:
    for rel, content in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        if os.geteuid() == 0 and group is not None:
            os.chown(path, 0, group)
            path.chmod(mode)
        else:
            path.chmod(mode | 0o444)
    for d in [dest, *[p for p in dest.rglob("*") if p.is_dir()]]:
        if os.geteuid() == 0 and group is not None:
            os.chown(d, 0, group)
        d.chmod(0o755)


def pick(files: dict[str, bytes], items: list[dict] | None, what: str) -> dict[str, bytes]:
    if not items:
        return files
    out = {}
    for item in items:
        if item["key"] not in files:
            raise SystemExit(f"helm-pods: {what} has no key {item['key']}")
        out[item["path"]] = files[item["key"]]
    return out


def pod_plan(sts: dict, headless: dict, sources: Sources, ordinal: int, out: Path) -> dict:
    name = f"{sts['metadata']['name']}-{ordinal}"
    spec = sts["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    group = spec.get("securityContext", {}).get("fsGroup")
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    mounts, tmpfs, claim_mounts = [], [], []
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        target, ro = m["mountPath"], bool(m.get("readOnly"))
        if m["name"] in claims:
            claim_mounts.append({"name": m["name"], "target": target})
            continue
        v = volumes[m["name"]]
        dest = out / name / m["name"]
        if "emptyDir" in v:
            tmpfs.append(target)
            continue
        if "configMap" in v:
            cm = v["configMap"]
            files = pick(sources.configmap(cm["name"]), cm.get("items"), f"ConfigMap {cm['name']}")
            write_files(dest, files, cm.get("defaultMode", 0o644), group)
        elif "secret" in v:
            s = v["secret"]
            files = pick(sources.secret(s["secretName"]), s.get("items"), f"Secret {s['secretName']}")
            write_files(dest, files, s.get("defaultMode", 0o644), group)
        elif "projected" in v:
            p = v["projected"]
            files = {}
            for src in p["sources"]:
                s = src["secret"]
                # An optional Secret that does not exist adds no files, as under Kubernetes.
                if s.get("optional") and not sources.has_secret(s["name"]):
                    continue
                files.update(pick(sources.secret(s["name"]), s.get("items"), f"Secret {s['name']}"))
            write_files(dest, files, p.get("defaultMode", 0o644), group)
        else:
            raise SystemExit(f"helm-pods: volume {m['name']} of a kind this plan does not know: {sorted(v)}")
        mounts.append({"source": str(dest), "target": target, "read_only": ro})

    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = name
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = sources.secret(ref["name"])[ref["key"]].decode()
        else:
            raise SystemExit(f"helm-pods: env {e['name']} of a kind this plan does not know")

    pod_sc = spec.get("securityContext", {})
    sc = c.get("securityContext", {})
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}

    def probe(kind: str) -> dict | None:
        p = c.get(kind)
        if not p:
            return None
        port = p["httpGet"]["port"]
        return {"path": p["httpGet"]["path"], "port": ports[port] if isinstance(port, str) else port}

    headless_name = headless["metadata"]["name"]
    return {
        "name": name,
        "hostname": name,
        "aliases": [
            f"{name}.{headless_name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}",
            f"{name}.{headless_name}.{NAMESPACE}.svc",
            f"{name}.{headless_name}",
        ],
        "image": c["image"],
        "command": c.get("command", []) + c.get("args", []),
        "env": env,
        "user": f"{sc.get('runAsUser', pod_sc.get('runAsUser'))}:{sc.get('runAsGroup', pod_sc.get('runAsGroup'))}",
        "read_only_root": bool(sc.get("readOnlyRootFilesystem")),
        "drop_all_capabilities": sc.get("capabilities", {}).get("drop") == ["ALL"],
        "no_new_privileges": sc.get("allowPrivilegeEscalation") is False,
        "mounts": mounts,
        "tmpfs": tmpfs,
        "claims": claim_mounts,
        "ports": ports,
        "readiness": probe("readinessProbe"),
        "liveness": probe("livenessProbe"),
        "startup": probe("startupProbe"),
        "pre_stop": c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command"),
        "grace_seconds": spec.get("terminationGracePeriodSeconds", 30),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", default="{}", help="chart values as JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--secrets", type=Path, help="DIR/<secret name>/<key>: Secrets the chart does not render")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    docs = render(json.loads(args.values))
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"]]
    sources = Sources(docs, args.secrets)
    pods = [pod_plan(sts, headless, sources, i, args.out) for i in range(sts["spec"]["replicas"])]
    plan = {"network": headless["metadata"]["name"], "pods": pods}
    (args.out / "plan.json").write_text(json.dumps(plan, indent=2))
    print(f"helm-pods: {len(pods)} pods of {sts['metadata']['name']} planned in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
