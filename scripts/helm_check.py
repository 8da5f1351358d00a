#!/usr/bin/env python3
"""Checks the Helm chart deploy/helm/bmq offline: lint, render, schema validation, and the
broker configuration each pod would run with.

    target/helm-venv/bin/python scripts/helm_check.py [--out DIR]

Run with the interpreter of scripts/helm-venv.sh (helm-python-sdk: Helm's engine as a
library; kubernetes-validate: the Kubernetes API schemas). What it checks:

1. Every value of values.yaml is documented in the chart's README.md. The chart's copies of the dashboards and alert rules (deploy/helm/bmq/files/) are identical
   to dashboards/grafana/*.json and dashboards/prometheus/alerts.yml (Helm reads no file outside
   the chart; scripts/helm-sync-files.sh refreshes the copies).
2. `helm lint --strict` of every scenario below, for the oldest and the newest Kubernetes
   release of Chart.yaml's kubeVersion.
3. Renders each scenario (1, 3 and 5 replicas; TLS off, and on with cert-manager; tokens;
   monitoring), and validates every manifest of a built-in kind against the strict schemas
   (kubernetes-validate --strict: unknown fields are errors) of the oldest and the newest
   release. A built-in kind without a schema is an error. The CRD kinds (cert-manager
   Certificate, monitoring.coreos.com PodMonitor, ServiceMonitor and PrometheusRule) have no
   schema there: they are checked structurally instead (their required fields, and that they
   agree with the StatefulSet and the Services). The built-in kinds also go through the
   `kubernetes-validate --strict` command for the oldest and newest release.
4. For each pod of each scenario, runs the chart's start script (from the rendered ConfigMap,
   with the rendered Secret's files) with its paths moved into a scratch directory, parses the
   configuration it writes with tomllib, and checks it: node id = ordinal + 1, members 1..N at
   the pods' stable DNS names through the headless Service, the ports of the container and of
   the Services, TLS files from the pod's own Secret, the tokens. With --out DIR the files are
   kept as DIR/<scenario>/node-<id>.toml (tests/tests/helm.rs loads them with the broker's own
   configuration parser).
   Pods from ordinal cluster.initialMembers up list only themselves, with `join` naming the
   initial members' peer addresses.
5. Values that cannot work are refused at render time (replicas 0 and 8, a grace period not
   above the graceful stop timeout, cert-manager without TLS, cluster.initialMembers 0, 8,
   not a whole number, or above replicas at install).
6. A scale-up with cluster.initialMembers at the installed size renders the running pods'
   ConfigMap and pod template unchanged: the StatefulSet rolls none of them.

Prints one line per scenario and exits 1 with every failure listed when anything is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import helm_python as helm
import kubernetes_validate.utils as kv
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/bmq"
RELEASE = "rel"
NAMESPACE = "bmq-ns"
CRD_KINDS = {
    ("cert-manager.io/v1", "Certificate"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
ADMIN_TOKEN = "admin-token-for-the-chart-check-0123456789"
TOKENS = [
    {"name": "orders", "secret": "orders-secret-0123456789abcdef",
     "domains": ["bmq.test"], "permissions": ["produce", "consume"]},
    {"name": "ops", "secret": "ops-secret-0123456789abcdef",
     "domains": ["*"], "permissions": ["admin"]},
]


def scenarios() -> dict[str, dict]:
    """Name -> values. Every replica count with TLS off and on; tokens and monitoring on top."""
    out: dict[str, dict] = {}
    for n in (1, 3, 5):
        out[f"n{n}-plain"] = {"replicas": n}
        out[f"n{n}-tls"] = {"replicas": n, "tls": {"enabled": True, "certManager": {"enabled": True}}}
    out["n3-tls-auth-monitoring"] = {
        "replicas": 3,
        "tls": {"enabled": True, "certManager": {"enabled": True}, "bmqpAllowPlaintext": True},
        "auth": {"enabled": True, "adminToken": ADMIN_TOKEN, "tokens": TOKENS, "bmqpIdentity": "orders"},
        "monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
        "broker": {"extraConfig": "[storage]\ncache_mb = 16\n"},
    }
    # Grown from 3 initial members to 5: pods 3 and 4 join.
    out["n5-initial3-tls-auth"] = {
        "replicas": 5,
        "cluster": {"initialMembers": 3},
        "tls": {"enabled": True, "certManager": {"enabled": True}},
        "auth": {"enabled": True, "adminToken": ADMIN_TOKEN, "tokens": TOKENS},
    }
    out["n5-servicemonitor-existing-secrets"] = {
        "replicas": 5,
        "tls": {"enabled": True, "secretPrefix": "my-node-certs"},
        "auth": {"enabled": True, "existingSecret": "my-bmq-auth"},
        "monitoring": {"serviceMonitor": {"enabled": True}},
        "terminationGracePeriodSeconds": 45,
    }
    return out


# Values the chart must refuse (a render error naming the value).
REFUSED = {
    "replicas 0": ({"replicas": 0}, "replicas"),
    "replicas 8": ({"replicas": 8}, "replicas"),
    "grace period not above the stop timeout": (
        {"terminationGracePeriodSeconds": 10, "broker": {"gracefulStopTimeoutMs": 10000}},
        "terminationGracePeriodSeconds"),
    "cert-manager without TLS": ({"tls": {"certManager": {"enabled": True}}}, "tls.enabled"),
    "auth without a token": ({"auth": {"enabled": True}}, "auth"),
    "initialMembers 0": ({"cluster": {"initialMembers": 0}}, "cluster.initialMembers"),
    "initialMembers 8": ({"replicas": 7, "cluster": {"initialMembers": 8}}, "cluster.initialMembers"),
    "initialMembers not a whole number": ({"cluster": {"initialMembers": 2.5}}, "cluster.initialMembers"),
    "initialMembers a string": ({"cluster": {"initialMembers": "three"}}, "cluster.initialMembers"),
    "initialMembers above replicas at install": (
        {"replicas": 3, "cluster": {"initialMembers": 5}}, "cluster.initialMembers"),
}


def check_scale_up_rolls_nothing(f: Failures) -> None:
    """Growing with cluster.initialMembers set to the installed size renders, for the running
    pods, exactly what they run: the same ConfigMap and the same pod template (so the
    StatefulSet controller rolls none of them), whether the install left initialMembers null
    or set it. The upgrade is rendered as an upgrade (not an install)."""
    chart = helm.Chart.load(CHART)
    base = {"tls": {"enabled": True, "certManager": {"enabled": True}},
            "auth": {"enabled": True, "adminToken": ADMIN_TOKEN, "tokens": TOKENS}}

    def parts(values: dict, is_install: bool) -> tuple[dict, dict]:
        rendered = chart.render({**base, **values}, name=RELEASE, namespace=NAMESPACE, is_install=is_install)
        docs = [d for p, t in sorted(rendered.items()) if not p.endswith("NOTES.txt")
                for d in yaml.safe_load_all(t) if d]
        sts = one(docs, "StatefulSet")
        return one(docs, "ConfigMap", f"{sts['metadata']['name']}-config")["data"], sts["spec"]["template"]

    installed = parts({"replicas": 3}, True)
    for what, values in (("replicas 5, initialMembers 3", {"replicas": 5, "cluster": {"initialMembers": 3}}),
                         ("replicas 4, initialMembers 3", {"replicas": 4, "cluster": {"initialMembers": 3}})):
        grown = parts(values, False)
        f.check(grown[0] == installed[0], f"scale-up to {what}: the ConfigMap differs from the 3-replica install's")
        f.check(grown[1] == installed[1], f"scale-up to {what}: the pod template differs from the 3-replica install's")
    pinned = parts({"replicas": 3, "cluster": {"initialMembers": 3}}, True)
    f.check(pinned == installed, "initialMembers 3 renders other pods than null with 3 replicas")
    # The check is not vacuous: without initialMembers, growing changes the member set.
    f.check(parts({"replicas": 5}, False)[0] != installed[0],
            "replicas 5 with initialMembers null renders the 3-replica ConfigMap")


class Failures:
    def __init__(self) -> None:
        self.items: list[str] = []

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.items.append(what)
        return ok


def kube_versions() -> tuple[str, str]:
    """The oldest and newest Kubernetes minor releases of Chart.yaml's kubeVersion
    (">=1.A.0-0 <1.B.0-0": 1.A and 1.(B-1))."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    m = re.fullmatch(r">=\s*1\.(\d+)\.0(?:-0)?\s+<\s*1\.(\d+)\.0(?:-0)?", meta["kubeVersion"])
    if not m:
        raise SystemExit(f"helm-check: Chart.yaml kubeVersion {meta['kubeVersion']!r} is not '>=1.A.0-0 <1.B.0-0'")
    return f"1.{m.group(1)}", f"1.{int(m.group(2)) - 1}"


def check_copies(f: Failures) -> None:
    pairs = [(CHART / "files/alerts.yml", ROOT / "dashboards/prometheus/alerts.yml")]
    sources = sorted((ROOT / "dashboards/grafana").glob("*.json"))
    pairs += [(CHART / "files" / s.name, s) for s in sources]
    copies = {p.name for p in (CHART / "files").glob("*.json")}
    f.check(copies == {s.name for s in sources},
            f"chart files/*.json {sorted(copies)} differ from dashboards/grafana/*.json "
            "(run scripts/helm-sync-files.sh)")
    for copy, source in pairs:
        f.check(copy.is_file() and copy.read_bytes() == source.read_bytes(),
                f"{copy.relative_to(ROOT)} is not identical to {source.relative_to(ROOT)} "
                "(run scripts/helm-sync-files.sh)")


def value_paths(values: dict, prefix: str = "") -> list[str]:
    """The dotted paths of values.yaml's leaves (a list or an empty map is a leaf)."""
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += value_paths(value, f"{path}.")
        else:
            out.append(path)
    return out


def check_values_documented(f: Failures) -> None:
    """Every value of values.yaml is named in the chart's README.md table, itself or through
    a parent (`probes.readiness.*`, `resources`)."""
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in value_paths(values):
        parts = path.split(".")
        names = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        f.check(any(f"| `{n}` |" in readme or f"| `{n}.*` |" in readme for n in names),
                f"values.yaml: {path} is not documented in deploy/helm/bmq/README.md")


def lint(f: Failures, name: str, values: dict, versions: tuple[str, ...]) -> None:
    for version in versions:
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{version}.0")
        for e in report.get("errors") or []:
            f.items.append(f"{name}: helm lint (Kubernetes {version}): {e}")
        for msg in report.get("messages") or []:
            if msg["severity"] >= 2:
                f.items.append(f"{name}: helm lint (Kubernetes {version}): {msg['path']}: {msg['error']}")


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(CHART)
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template"] = path
                docs.append(doc)
    return docs


def validate_schemas(f: Failures, name: str, docs: list[dict], versions: tuple[str, ...]) -> int:
    """kubernetes-validate --strict of every built-in kind; returns how many were validated."""
    count = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        resource = {k: v for k, v in doc.items() if k != "__template"}
        what = f"{name}: {doc['kind']}/{doc['metadata']['name']} ({doc['__template']})"
        for version in versions:
            try:
                kv.validate(resource, version, strict=True)
                count += 1
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                f.items.append(f"{what}: invalid for Kubernetes {version}: {path}: {e.message}")
            except kv.SchemaNotFoundError as e:
                f.items.append(f"{what}: {e.message}")
    return count


def validate_with_cli(f: Failures, rendered: dict[str, list[dict]], versions: tuple[str, ...],
                      scratch: Path) -> None:
    """The same manifests through the kubernetes-validate command itself (--strict), as a
    second opinion on the library calls above. The command only warns about a kind it has no
    schema for, which is why the library is the check that counts; here the CRD kinds are left
    out and any warning is a failure."""
    scratch.mkdir(parents=True, exist_ok=True)
    files = []
    for name, docs in rendered.items():
        path = scratch / f"{name}.yaml"
        builtin = [{k: v for k, v in d.items() if k != "__template"} for d in docs
                   if (d["apiVersion"], d["kind"]) not in CRD_KINDS]
        path.write_text(yaml.safe_dump_all(builtin))
        files.append(str(path))
    cli = Path(sys.executable).with_name("kubernetes-validate")
    args = [str(cli), "--strict", "--quiet"]
    for v in versions:
        args += ["-k", f"{v}.0"]
    proc = subprocess.run(args + files, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or proc.stdout.strip():
        f.items.append(f"kubernetes-validate --strict exited {proc.returncode}: {proc.stdout.strip()} {proc.stderr.strip()}")


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) != 1:
        raise AssertionError(f"expected one {kind}{' ' + name if name else ''}, found {len(found)}")
    return found[0]


def run_start_script(configmap: dict, secret_files: dict[str, str] | None, ordinal: int,
                     sts_name: str, scratch: Path, tls_nodes: list[int] | None = None) -> tuple[str, str]:
    """Runs the ConfigMap's start.sh for pod <sts_name>-<ordinal> with /etc/bmq and /run/bmq
    moved into `scratch`, the TLS files of nodes `tls_nodes` present (placeholders: the
    script only checks they exist); returns the configuration it wrote and its standard
    error."""
    if scratch.exists():
        shutil.rmtree(scratch)
    (scratch / "config").mkdir(parents=True)
    (scratch / "run").mkdir()
    for key, text in configmap["data"].items():
        (scratch / "config" / key).write_text(text)
    if secret_files is not None:
        (scratch / "auth").mkdir()
        for key, text in secret_files.items():
            (scratch / "auth" / key).write_text(text)
    for node in tls_nodes or []:
        (scratch / "tls" / f"node-{node}").mkdir(parents=True)
        for key in ("ca.crt", "tls.crt", "tls.key"):
            (scratch / "tls" / f"node-{node}" / key).write_text("placeholder\n")
    script = configmap["data"]["start.sh"]
    exec_line = 'exec broker --config "$out"'
    assert exec_line in script, "start.sh does not end by exec-ing the broker on its output"
    script = (script.replace(exec_line, "exit 0")
              .replace("/etc/bmq/config/", f"{scratch}/config/")
              .replace("/etc/bmq/auth/", f"{scratch}/auth/")
              .replace("/etc/bmq/tls/", f"{scratch}/tls/")
              .replace("/run/bmq/", f"{scratch}/run/"))
    (scratch / "start.sh").write_text(script)
    proc = subprocess.run(["/bin/sh", str(scratch / "start.sh")], capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                               "POD_NAME": f"{sts_name}-{ordinal}"}, timeout=30)
    if proc.returncode != 0:
        raise AssertionError(f"start.sh failed ({proc.returncode}): {proc.stderr.strip()}")
    return (scratch / "run/broker.toml").read_text(), proc.stderr


def check_cluster(f: Failures, name: str, values: dict, docs: list[dict], out: Path | None,
                  scratch: Path) -> None:
    """The StatefulSet, Services, PDB, Secrets and each pod's broker configuration agree."""
    n = values["replicas"]
    tls = values.get("tls", {}).get("enabled", False)
    auth = values.get("auth", {})
    chk = lambda ok, what: f.check(ok, f"{name}: {what}")  # noqa: E731

    sts = one(docs, "StatefulSet")
    spec = sts["spec"]
    sts_name = sts["metadata"]["name"]
    pod = spec["template"]["spec"]
    chk(spec["replicas"] == n, f"StatefulSet replicas {spec['replicas']} != {n}")
    chk(spec["podManagementPolicy"] == "Parallel", "podManagementPolicy is not Parallel")
    chk(spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
        f"updateStrategy {spec['updateStrategy']}")
    claims = spec.get("volumeClaimTemplates", [])
    chk(len(claims) == 1 and claims[0]["metadata"]["name"] == "data", "one volumeClaimTemplate 'data'")

    headless = one(docs, "Service", spec["serviceName"])
    chk(headless["spec"].get("clusterIP") == "None", "the StatefulSet's service is not headless")
    chk(headless["spec"].get("publishNotReadyAddresses") is True, "headless Service does not publish not-ready addresses")
    client_svc = one(docs, "Service", sts_name)
    selector = spec["selector"]["matchLabels"]
    labels = spec["template"]["metadata"]["labels"]
    chk(all(labels.get(k) == v for k, v in selector.items()), "pod labels do not match the selector")
    for svc in (headless, client_svc):
        chk(svc["spec"]["selector"] == selector, f"Service {svc['metadata']['name']} selects other pods")

    containers = pod["containers"]
    chk(len(containers) == 1, "one container")
    c = containers[0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    svc_ports = lambda svc: {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}  # noqa: E731
    chk(svc_ports(headless) == {"peer": (ports["peer"], "peer"), "admin": (ports["admin"], "admin")},
        f"headless Service ports {svc_ports(headless)}")
    want_client = {"client": (ports["client"], "client")}
    if "bmqp" in ports:
        want_client["bmqp"] = (ports["bmqp"], "bmqp")
    chk(svc_ports(client_svc) == want_client, f"client Service ports {svc_ports(client_svc)}")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        chk(c.get(probe, {}).get("httpGet") == {"path": path, "port": "admin"}, f"{probe} is not GET {path} on admin")
    chk(c["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", "/etc/bmq/config/pre-stop.sh"], "preStop hook")
    sc = c["securityContext"]
    chk(sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False
        and sc.get("capabilities", {}).get("drop") == ["ALL"], f"container securityContext {sc}")
    chk(pod["securityContext"].get("runAsNonRoot") is True, "pod does not run as non-root")
    chk("requests" in c.get("resources", {}), "no resource requests")
    env = {e["name"]: e for e in c.get("env", [])}
    chk(env.get("POD_NAME", {}).get("valueFrom") == {"fieldRef": {"fieldPath": "metadata.name"}},
        "POD_NAME is not the pod's name")

    pdb = one(docs, "PodDisruptionBudget")
    chk(pdb["spec"].get("maxUnavailable") == 1 and pdb["spec"]["selector"]["matchLabels"] == selector,
        f"PodDisruptionBudget {pdb['spec']}")

    configmap = one(docs, "ConfigMap", f"{sts_name}-config")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    chk(volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"], "config volume is another ConfigMap")
    chk(mounts.get("config") == "/etc/bmq/config" and mounts.get("run") == "/run/bmq"
        and mounts.get("data") == "/var/lib/bmq", f"mounts {mounts}")
    chk(c["command"] == ["/bin/sh", "/etc/bmq/config/start.sh"], "the container does not run start.sh")

    # The auth Secret's files, as the pod sees them.
    secret_files = None
    if auth.get("enabled"):
        secret_name = volumes["auth"]["secret"]["secretName"]
        chk(mounts.get("auth") == "/etc/bmq/auth", "auth Secret not at /etc/bmq/auth")
        chk(env.get("BMQ_ADMIN_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
            == {"name": secret_name, "key": "admin-token"}, "BMQ_ADMIN_TOKEN is not the Secret's admin-token")
        if auth.get("existingSecret"):
            chk(secret_name == auth["existingSecret"], "existingSecret is not mounted")
            chk(not [d for d in docs if d["kind"] == "Secret"], "a Secret is rendered although existingSecret is set")
            secret_files = {"admin-token": ADMIN_TOKEN}
        else:
            secret_files = dict(one(docs, "Secret", secret_name)["stringData"])
    else:
        chk("auth" not in volumes and "BMQ_ADMIN_TOKEN" not in env, "auth Secret used although auth is off")

    # TLS: one Secret per possible node (1 to 7, whatever replicas is, so that the pod template
    # does not change with it), all projected and optional, each under node-<id>/.
    tls_secrets: dict[int, str] = {}
    if tls:
        chk(mounts.get("tls") == "/etc/bmq/tls", "TLS volume not at /etc/bmq/tls")
        for src in volumes["tls"]["projected"]["sources"]:
            chk(src["secret"].get("optional") is True, f"TLS Secret {src['secret']['name']} is not optional")
            items = {i["key"]: i["path"] for i in src["secret"]["items"]}
            m = re.fullmatch(r"node-(\d+)/tls\.crt", items.get("tls.crt", ""))
            if chk(m is not None, f"TLS projection {items}"):
                node = int(m.group(1))
                tls_secrets[node] = src["secret"]["name"]
                chk(items == {k: f"node-{node}/{k}" for k in ("ca.crt", "tls.crt", "tls.key")}, f"TLS projection {items}")
        chk(sorted(tls_secrets) == list(range(1, 8)), f"TLS Secrets for nodes {sorted(tls_secrets)}")
    else:
        chk("tls" not in volumes, "TLS volume although TLS is off")

    grace = pod["terminationGracePeriodSeconds"]
    hosts = [f"{sts_name}-{i}.{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local" for i in range(n)]
    initial = values.get("cluster", {}).get("initialMembers") or n
    seed_peers = [f"{h}:{ports['peer']}" for h in hosts[:initial]]
    for ordinal in range(n):
        node = ordinal + 1
        try:
            text, stderr = run_start_script(configmap, secret_files, ordinal, sts_name, scratch,
                                            [node] if tls else None)
        except AssertionError as e:
            f.items.append(f"{name}: pod {ordinal}: {e}")
            continue
        if tls:
            # Without its own certificate (an optional Secret not created), the pod must not start.
            try:
                run_start_script(configmap, secret_files, ordinal, sts_name, scratch, [])
                f.items.append(f"{name}: pod {ordinal}: start.sh ran without the node's TLS files")
            except AssertionError as e:
                chk(f"node-{node}/ca.crt" in str(e), f"pod {ordinal}: start.sh without TLS files: {e}")
        if out is not None:
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / f"node-{node}.toml").write_text(text)
        try:
            cfg = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            f.items.append(f"{name}: pod {ordinal}: its configuration is not TOML: {e}")
            continue
        at = f"pod {ordinal}"
        chk(f"is node {node}" in stderr, f"{at}: start.sh does not say it is node {node}")
        chk(cfg.get("node_id") == node, f"{at}: node_id {cfg.get('node_id')} != {node}")
        # The initial members list each other and join nothing; a later pod lists itself
        # alone and joins through the initial members' peer addresses.
        members = cfg.get("members", [])
        if ordinal < initial:
            want_ids, want_hosts, want_join = list(range(1, initial + 1)), hosts[:initial], None
        else:
            want_ids, want_hosts, want_join = [node], [hosts[ordinal]], seed_peers
        chk([m["id"] for m in members] == want_ids, f"{at}: member ids {[m['id'] for m in members]} != {want_ids}")
        chk([m["host"] for m in members] == want_hosts, f"{at}: member hosts {[m['host'] for m in members]} != {want_hosts}")
        chk(cfg.get("join") == want_join, f"{at}: join {cfg.get('join')} != {want_join}")
        for m in members:
            chk((m["client_port"], m["peer_port"], m["admin_port"]) == (ports["client"], ports["peer"], ports["admin"]),
                f"{at}: member {m['id']} ports differ from the container's {ports}")
            chk(m.get("bmqp_port") == ports.get("bmqp"), f"{at}: member {m['id']} bmqp_port")
        chk(cfg.get("listen_host") == "0.0.0.0" and cfg.get("admin", {}).get("listen_host") == "0.0.0.0",
            f"{at}: listeners not on every interface")
        chk(cfg.get("data_dir") == "/var/lib/bmq", f"{at}: data_dir {cfg.get('data_dir')}")
        stop_ms = cfg.get("limits", {}).get("graceful_stop_timeout_ms", 10000)
        chk(grace * 1000 > stop_ms, f"terminationGracePeriodSeconds {grace} is not above graceful_stop_timeout_ms {stop_ms}")
        chk(cfg.get("limits", {}).get("graceful_stop_timeout_ms") == values.get("broker", {}).get("gracefulStopTimeoutMs", 10000),
            f"{at}: graceful_stop_timeout_ms")
        if tls:
            want = {f: f"/etc/bmq/tls/node-{node}/{k}" for f, k in
                    (("ca_file", "ca.crt"), ("cert_file", "tls.crt"), ("key_file", "tls.key"))}
            chk({k: cfg.get("tls", {}).get(k) for k in want} == want, f"{at}: [tls] {cfg.get('tls')}")
        else:
            chk("tls" not in cfg, f"{at}: [tls] although TLS is off")
        if auth.get("enabled"):
            chk(cfg.get("admin", {}).get("token") == ADMIN_TOKEN, f"{at}: admin token not from the Secret")
            if not auth.get("existingSecret"):
                got = [(t["name"], t["secret"], t["domains"], t["permissions"]) for t in cfg.get("auth", {}).get("tokens", [])]
                want_t = [(t["name"], t["secret"], t["domains"], t["permissions"]) for t in auth.get("tokens", [])]
                chk(got == want_t, f"{at}: client tokens {got}")
                chk(cfg.get("auth", {}).get("bmqp_identity") == auth.get("bmqpIdentity") or not auth.get("bmqpIdentity"),
                    f"{at}: bmqp_identity")
        else:
            chk("token" not in cfg.get("admin", {}) and "auth" not in cfg, f"{at}: tokens although auth is off")

    check_custom_resources(f, name, values, docs, sts_name, selector, tls_secrets, hosts)
    check_dashboards(f, name, values, docs)


def check_custom_resources(f: Failures, name: str, values: dict, docs: list[dict], sts_name: str,
                           selector: dict, tls_secrets: dict[int, str], hosts: list[str]) -> None:
    """The CRD kinds, which kubernetes-validate has no schema for: their structure, and that
    they name what the rest of the release renders."""
    chk = lambda ok, what: f.check(ok, f"{name}: {what}")  # noqa: E731
    n = values["replicas"]
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            chk(set(doc) == {"apiVersion", "kind", "metadata", "spec", "__template"},
                f"{doc['kind']}: top-level fields {sorted(doc)}")
            chk(doc["metadata"].get("namespace") == NAMESPACE and bool(doc["metadata"].get("name")),
                f"{doc['kind']}: metadata {doc['metadata']}")
        elif doc["apiVersion"].endswith(".coreos.com/v1") or doc["apiVersion"].startswith("cert-manager"):
            f.items.append(f"{name}: {doc['apiVersion']} {doc['kind']} is not a known CRD kind of the chart")
    tls = values.get("tls", {})
    certs = [d for d in docs if d["kind"] == "Certificate"]
    if tls.get("enabled") and tls.get("certManager", {}).get("enabled"):
        chk(len(certs) == n, f"{len(certs)} Certificates for {n} nodes")
        for cert in certs:
            s = cert["spec"]
            m = re.fullmatch(r".*-node-(\d+)", cert["metadata"]["name"])
            node = int(m.group(1)) if m else 0
            chk(tls_secrets.get(node) == s.get("secretName"),
                f"Certificate {cert['metadata']['name']} writes {s.get('secretName')}, pod reads {tls_secrets.get(node)}")
            chk(f"node-{node}" in s.get("dnsNames", []) and 0 < node <= n and hosts[node - 1] in s["dnsNames"],
                f"Certificate {cert['metadata']['name']} dnsNames {s.get('dnsNames')}")
            chk({"server auth", "client auth"} <= set(s.get("usages", [])), "Certificate usages")
            chk(bool(s.get("issuerRef", {}).get("name")) and s["issuerRef"].get("kind") in ("Issuer", "ClusterIssuer"),
                f"Certificate issuerRef {s.get('issuerRef')}")
    else:
        chk(not certs, "Certificates although cert-manager is off")

    mon = values.get("monitoring", {})
    for kind, key, endpoints in (("PodMonitor", "podMonitor", "podMetricsEndpoints"),
                                 ("ServiceMonitor", "serviceMonitor", "endpoints")):
        found = [d for d in docs if d["kind"] == kind]
        if not mon.get(key, {}).get("enabled"):
            chk(not found, f"{kind} although it is off")
            continue
        if not chk(len(found) == 1, f"{len(found)} {kind}s"):
            continue
        s = found[0]["spec"]
        chk(s["selector"]["matchLabels"] == selector, f"{kind} selects other pods")
        chk(len(s[endpoints]) == 1 and s[endpoints][0]["port"] == "admin"
            and s[endpoints][0]["path"] == "/metrics", f"{kind} endpoint {s[endpoints]}")
        rl = s[endpoints][0]["relabelings"]
        chk({"action": "replace", "targetLabel": "job", "replacement": "bmq"} in rl, f"{kind} does not set job=bmq")
        nodes = {r["regex"]: r["replacement"] for r in rl if r.get("targetLabel") == "node"}
        chk(nodes == {f"{sts_name}-{i}": str(i + 1) for i in range(n)}, f"{kind} node labels {nodes}")
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    if mon.get("prometheusRule", {}).get("enabled"):
        source = yaml.safe_load((ROOT / "dashboards/prometheus/alerts.yml").read_text())
        chk(len(rules) == 1 and rules[0]["spec"] == source, "PrometheusRule spec differs from dashboards/prometheus/alerts.yml")
    else:
        chk(not rules, "PrometheusRule although it is off")


def check_dashboards(f: Failures, name: str, values: dict, docs: list[dict]) -> None:
    found = {}
    for d in docs:
        if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1":
            for key, text in d["data"].items():
                found[key] = text
    for source in sorted((ROOT / "dashboards/grafana").glob("*.json")):
        text = found.pop(source.name, None)
        if f.check(text is not None, f"{name}: no dashboard ConfigMap for {source.name}"):
            f.check(json.loads(text) == json.loads(source.read_text()), f"{name}: dashboard {source.name} differs from its source")
    f.check(not found, f"{name}: dashboard ConfigMaps with no source: {sorted(found)}")


def check_refused(f: Failures) -> None:
    chart = helm.Chart.load(CHART)
    for what, (values, needle) in REFUSED.items():
        try:
            chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
            f.items.append(f"refused values: {what} rendered without an error")
        except helm.HelmError as e:
            f.check(needle in str(e), f"refused values: {what}: the error does not name {needle}: {e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep each pod's configuration under this directory")
    args = parser.parse_args()
    if args.out is not None:
        shutil.rmtree(args.out, ignore_errors=True)
        args.out.mkdir(parents=True)

    oldest, newest = kube_versions()
    available = sorted({kv.major_minor(v) for v in kv.all_versions()}, key=lambda v: int(v.split(".")[1]))
    f = Failures()
    for v in (oldest, newest):
        f.check(v in available, f"kubernetes-validate has no schemas for Kubernetes {v}")
    # Every release the chart claims that kubernetes-validate knows, both ends included.
    minor = lambda v: int(v.split(".")[1])  # noqa: E731
    versions = tuple(v for v in available if minor(oldest) <= minor(v) <= minor(newest))
    lint_versions = (oldest, newest)
    check_copies(f)
    check_values_documented(f)
    rendered: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="helm-check-") as tmp:
        for name, values in scenarios().items():
            before = len(f.items)
            lint(f, name, values, lint_versions)
            try:
                docs = render(values)
            except helm.HelmError as e:
                f.items.append(f"{name}: helm template failed: {e}")
                continue
            rendered[name] = docs
            validated = validate_schemas(f, name, docs, versions)
            try:
                check_cluster(f, name, values, docs, args.out, Path(tmp) / "pod")
            except (AssertionError, KeyError, TypeError, ValueError) as e:
                f.items.append(f"{name}: {type(e).__name__}: {e}")
            kinds = sorted({d["kind"] for d in docs})
            status = "ok" if len(f.items) == before else f"{len(f.items) - before} failure(s)"
            print(f"helm-check: {name}: {len(docs)} manifests ({', '.join(kinds)}), "
                  f"{validated} schema validations (Kubernetes {versions[0]} to {versions[-1]}): {status}")
        validate_with_cli(f, rendered, (versions[0], versions[-1]), Path(tmp) / "cli")
    check_refused(f)
    check_scale_up_rolls_nothing(f)
    if f.items:
        print(f"helm-check: {len(f.items)} failure(s):", file=sys.stderr)
        for item in f.items:
            print(f"  - {item}", file=sys.stderr)
        return 1
    print(f"helm-check: chart {CHART.relative_to(ROOT)} passed ({len(scenarios())} scenarios, "
          f"{len(REFUSED)} refused value sets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
