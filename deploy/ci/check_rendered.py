#!/usr/bin/env python3
"""Checks the rendered shardwire Kubernetes manifests, the Grafana dashboard and the Dockerfile.

Run by scripts/check-deploy after `kustomize build` of every overlay; not meant to be run by
hand (but it can be: see --help). Each check prints PASS/FAIL with the overlay and the reason;
the last line is "N passed, M failed". Exit status 1 when anything failed.

Checks, per rendered overlay:
  schema   every object against the Kubernetes JSON schemas of kubernetes-validate (offline,
           strict: unknown fields are errors) for each --kube-version; ServiceMonitor against
           deploy/ci/schemas/servicemonitor-monitoring-v1.json (a hand-written subset of the
           CRD; the Kubernetes schemas do not cover CRDs). An unknown kind is a failure.
  refs     selectors match pod labels; Services select pods and their target ports (named, or
           numeric) are declared container ports; ServiceMonitor selects a Service port; configMap/secret volumes and items
           name objects/keys that are rendered; StatefulSet serviceName is a headless Service.
  node     DaemonSet runs `serve --config F`, F resolves through a volume mount to a
           ConfigMap key; that serve.toml passes `shardwire config check` (the file alone;
           `sources` given by the env alone is added from the effective config); with the
           container's SHARDWIRE_* env applied (`shardwire config print`; an envFrom is not
           applied: it fails where it sets SHARDWIRE_* variables, a rendered ConfigMap/Secret
           by its keys or any source by a SHARDWIRE_ prefix, passes where its prefix cannot
           begin SHARDWIRE_, and warns for an unrendered object), a startup probe httpGet /healthz gives the start at least
           MIN_START_S, readiness is httpGet /readyz and liveness /healthz, all on the port of
           `admin`, `admin` is not
           loopback under hostNetwork, the `data` port is data_listen's, the trainer socket's
           directory is a hostPath mount, secret_file resolves to a rendered Secret key, the
           memory limit exceeds the pools' host memory (pool_size per lane), `sources` are exactly the StatefulSet's pods,
           `receive = "devmem"` has NET_ADMIN and its dma-buf (memory = "cuda", or
           /dev/udmabuf granted: a device plugin resource named *udmabuf*, or privileged;
           memory = "auto" in a pod that sees GPUs without the grant is a warning).
  source   StatefulSet runs `source --config F`; source.toml passes
           `shardwire config check --source-config` (as the node's: `datasets` given by the
           env alone is added), and loads with its SHARDWIRE_* env; listen port = container port = Service
           port; where a container port `admin` is declared or a Service targets it, `admin`
           is set, not loopback, on that port (an `admin` nothing declares or scrapes is not
           compared); secret_file resolves; every dataset dir is on a mounted volume; a
           cache_dir on an emptyDir (the node's disk) has an ephemeral-storage request of at
           least cache_size, and no ephemeral-storage limit or sizeLimit below it. A source
           Deployment (found by DNS) is scaled by an HPA and sets no replicas of its own.
  trainer  the example Job's --socket and SHARDWIRE_SOCKET are serve.toml `socket`, it mounts
           the same hostPath at the socket's directory, its dataset is served, and its uid and
           groups may connect under serve.toml socket_mode and allowed_uids/allowed_gids.
Once: the Grafana dashboard (JSON, Prometheus datasource variable used by every panel, every
expression parses as PromQL, references only metrics that service/src or node/src registers, in the form
the exporter renders them, and shows the README's core metrics; others are warnings) and the Dockerfile (parsed with BuildKit's parser: multi-stage, the
release build, a non-root USER, ENTRYPOINT ["shardwire"], EXPOSEd default ports, Rust
version >= the workspace's rust-version, a debian runtime installs ca-certificates, context
exclusions, applied as BuildKit does (order, `!`, `**`) to representative paths, keep every
workspace member and exclude every .gitignore entry).
--self-test breaks the first overlay (and named ones: object-storage, gpu, elastic), the Dockerfile and
its context exclusions in known ways and requires each breakage to be caught, and makes valid
changes each leniency allows and requires them to pass (with their warning, or none).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

Doc = dict[str, Any]

# The image's USER (deploy/Dockerfile; checked there): the uid/gid of a pod that sets none.
IMAGE_UID, IMAGE_GID = 10001, 10001

# --------------------------------------------------------------------------------------------
# results


class Results:
    def __init__(self, quiet: bool = False) -> None:
        self.passed = 0
        self.failed = 0
        self.quiet = quiet
        self.failures: list[str] = []
        self.warnings: list[str] = []

    def warn(self, scope: str, msg: str) -> None:
        self.warnings.append(f"WARN [{scope}] {msg}")
        if not self.quiet:
            print(f"WARN [{scope}] {msg}")

    def check(self, scope: str, name: str, errors: list[str], detail: str = "") -> bool:
        if errors:
            self.failed += 1
            for e in errors:
                line = f"FAIL [{scope}] {name}: {e}"
                self.failures.append(line)
                if not self.quiet:
                    print(line)
            return False
        self.passed += 1
        if not self.quiet:
            print(f"PASS [{scope}] {name}" + (f" ({detail})" if detail else ""))
        return True


# --------------------------------------------------------------------------------------------
# helpers


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    f = find(docs, kind, name)
    if len(f) != 1:
        raise CheckError(f"expected exactly one {kind}{' ' + name if name else ''}, found {len(f)}")
    return f[0]


class CheckError(Exception):
    pass


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def containers(spec: Doc) -> list[Doc]:
    return list(spec.get("containers", [])) + list(spec.get("initContainers", []))


def container_by_subcommand(workload: Doc, sub: str) -> Doc:
    """The container that runs `shardwire SUB` (the image's ENTRYPOINT is `shardwire`)."""
    for c in pod_spec(workload).get("containers", []):
        try:
            argv = argv_of(c)
        except CheckError:
            continue
        if argv and argv[0] == sub:
            return c
    raise CheckError(f"{workload['kind']}/{workload['metadata']['name']}: no container runs `shardwire {sub}`")


def argv_of(c: Doc) -> list[str]:
    """shardwire's arguments: `args` under the image's ENTRYPOINT, or a `command` of shardwire."""
    cmd = list(c.get("command", []))
    if cmd and posixpath.basename(cmd[0]) != "shardwire":
        raise CheckError(f"container {c['name']}: command {cmd} does not run shardwire")
    return cmd[1:] + list(c.get("args", []))


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def resolve_file(workload: Doc, c: Doc, path: str) -> tuple[Doc, str | None]:
    """Maps a file path inside container c to (volume, key): subPath mounts and whole-volume
    directory mounts. key None: the path is the mount point itself (a directory)."""
    vols = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for t in workload["spec"].get("volumeClaimTemplates", []):
        vols.setdefault(t["metadata"]["name"], {"name": t["metadata"]["name"], "persistentVolumeClaim": {"claimName": t["metadata"]["name"]}})
    best: tuple[int, Doc, str | None] | None = None
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") or "/"
        v = vols.get(m["name"])
        if v is None:
            continue
        if m.get("subPath"):
            if path == mp:
                cand = (len(mp), v, m["subPath"])
            else:
                continue
        elif path == mp:
            cand = (len(mp), v, None)
        elif path.startswith(mp + "/"):
            cand = (len(mp), v, path[len(mp) + 1 :])
        else:
            continue
        if best is None or cand[0] > best[0]:
            best = cand
    if best is None:
        raise CheckError(f"container {c['name']}: {path} is on no volume mount")
    _, vol, rel = best
    # configMap/secret `items` remap keys to paths
    src = vol.get("configMap") or vol.get("secret")
    if src is not None and rel is not None and src.get("items"):
        for it in src["items"]:
            if it["path"] == rel:
                return vol, it["key"]
        raise CheckError(f"container {c['name']}: {path}: volume {vol['name']} projects no item at {rel}")
    return vol, rel


def object_keys(doc: Doc) -> set[str]:
    return set(doc.get("data") or {}) | set(doc.get("stringData") or {}) | set(doc.get("binaryData") or {})


def mount_for_dir(c: Doc, directory: str) -> Doc | None:
    for m in c.get("volumeMounts", []):
        if m["mountPath"].rstrip("/") == directory.rstrip("/") and not m.get("subPath"):
            return m
    return None


def container_port(c: Doc, port: Any) -> int | None:
    """A probe's port: a number as it is (a probe may name an undeclared port), a name through
    the container's ports."""
    if isinstance(port, int):
        return port
    for p in c.get("ports", []):
        if p.get("name") == port:
            return p["containerPort"]
    return None


def declared_port(c: Doc, port: Any) -> int | None:
    """A Service's targetPort in container c: a name or a number of one of its declared ports
    (a number alone proves nothing listens there)."""
    for p in c.get("ports", []):
        if p.get("name") == port or (isinstance(port, int) and p.get("containerPort") == port):
            return p["containerPort"]
    return None


def host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


_QUANT = {
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "": 1,
}


def quantity_bytes(q: Any) -> int:
    s = str(q)
    m = re.fullmatch(r"([0-9.]+)(?:e([0-9]+))?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?", s)
    if not m:
        raise CheckError(f"cannot parse quantity {s!r}")
    n = float(m.group(1)) * (10 ** int(m.group(2)) if m.group(2) else 1)
    return int(n * _QUANT[m.group(3) or ""])


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------------------------
# the shardwire binary

SHARDWIRE_PREFIX = "SHARDWIRE_"


def may_begin_shardwire(prefix: str) -> bool:
    """Whether an envFrom `prefix` followed by some key can make a SHARDWIRE_* variable."""
    return prefix.startswith(SHARDWIRE_PREFIX) or SHARDWIRE_PREFIX.startswith(prefix)


def env_from_findings(c: Doc, docs: list[Doc]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for container c's envFrom sources, whose SHARDWIRE_* variables this
    check does not apply. A `prefix` that cannot begin SHARDWIRE_ passes. A rendered ConfigMap
    or Secret is judged by its keys: one that becomes SHARDWIRE_* fails. An unrendered one (made
    out of band, e.g. object-store credentials) is a warning, or a failure where its prefix turns
    every key into a SHARDWIRE_* variable."""
    errs: list[str] = []
    warns: list[str] = []
    for src in c.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if not may_begin_shardwire(prefix):
            continue
        kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src.get("secretRef") or {})
        name = ref.get("name")
        what = f"container {c['name']}: envFrom {kind} {name}" + (f" with prefix {prefix!r}" if prefix else "")
        fix = ("set SHARDWIRE_* variables in `env` with literal values (or in the TOML file), or give the envFrom "
               "a prefix that cannot begin SHARDWIRE_")
        found = find(docs, kind, name)
        if found:
            bad = sorted(prefix + k for k in object_keys(found[0]) if (prefix + k).startswith(SHARDWIRE_PREFIX))
            if bad:
                errs.append(f"{what} sets {bad}, which this check does not apply: cannot evaluate the effective config; {fix}")
        elif prefix.startswith(SHARDWIRE_PREFIX):
            errs.append(f"{what} is not rendered and makes each of its keys a SHARDWIRE_* variable, whose value "
                        f"cannot be read here: cannot evaluate the effective config; {fix}")
        else:
            warns.append(f"{what} is not rendered, so its keys cannot be read here: a SHARDWIRE_* key in it would "
                         f"override the config this check evaluated; {fix}")
    return errs, warns


class Shardwire:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        # Nothing from the caller's environment may leak into the configuration layers.
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWIRE_")}

    @functools.cached_property
    def env_layer_works(self) -> bool:
        """Whether this build applies SHARDWIRE_* variables to the configuration (probe)."""
        env = dict(self.base_env, SHARDWIRE_FLOWS="3")
        p = self.run(["config", "print"], env)
        return p.returncode == 0 and json.loads(p.stdout).get("flows") == 3

    def env_for(self, c: Doc, docs: list[Doc]) -> tuple[dict[str, str], list[str]]:
        """The environment container c's shardwire runs with, as far as it sets SHARDWIRE_*
        variables (literal `env` values), and warnings. Raises CheckError where the effective
        config cannot be known: a SHARDWIRE_* env from a reference, or an envFrom that sets
        SHARDWIRE_* variables (env_from_findings)."""
        env = dict(self.base_env)
        errs, warns = env_from_findings(c, docs)
        if errs:
            raise CheckError("; ".join(errs))
        for e in c.get("env", []):
            if e["name"].startswith(SHARDWIRE_PREFIX):
                if "value" not in e:
                    raise CheckError(f"container {c['name']}: env {e['name']} is not a literal value; cannot evaluate the effective config")
                env[e["name"]] = str(e["value"])
        return env, warns

    def run(self, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.binary, *args], env=env, capture_output=True, text=True, timeout=30)

    def check_and_print(self, toml_text: str, source: bool, env: dict[str, str]) -> tuple[list[str], Doc | None]:
        """`config print --config FILE` with the container's env (the effective config, as
        `serve` and `source` read it), then `config check FILE`, which judges the file alone (it
        applies no SHARDWIRE_* variable). The key a start needs, `sources` (`datasets` for a
        source), may come from the pod's env alone: where the file does not give it, the checked
        file gets the effective value (with_env_given_key). Returns (errors, effective)."""
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / ("source.toml" if source else "serve.toml")
            f.write_text(toml_text, encoding="utf-8")
            extra = ["--source-config"] if source else []
            p = self.run(["config", "print", "--config", str(f), *extra], env)
            if p.returncode != 0:
                # The file's own error first: `config check` names it without blaming the env.
                r = self.run(["config", "check", str(f), *extra], env)
                if r.returncode != 0 and not needs_env_given_key(toml_text, "datasets" if source else "sources"):
                    return [f"`shardwire config check{' --source-config' if source else ''}` failed: {(r.stderr or r.stdout).strip()}"], None
                return [f"`shardwire config print` with the container's SHARDWIRE_* env failed: {(p.stderr or p.stdout).strip()}"], None
            eff = json.loads(p.stdout)
            f.write_text(with_env_given_key(toml_text, "datasets" if source else "sources", eff), encoding="utf-8")
            r = self.run(["config", "check", str(f), *extra], env)
            if r.returncode != 0:
                return [f"`shardwire config check{' --source-config' if source else ''}` failed: {(r.stderr or r.stdout).strip()}"], None
            return [], eff


def with_env_given_key(text: str, key: str, eff: Doc) -> str:
    """`text` with `key = <its effective value>` first where the file does not give `key` and
    the env does (a non-empty effective value): `config check` then judges the file's own keys
    alone, and a pod that lists its `sources` or `datasets` only in its env still passes. A
    file that is not TOML is returned as it is (`config check` names its error)."""
    value = eff.get(key)
    if not value or not needs_env_given_key(text, key):
        return text
    if key in tomllib.loads(text):
        # `key = []` in the file, the env's value over it: the empty line goes, or the key
        # would be given twice.
        text = drop_toml_key(text, key)
    # A JSON array of strings is a TOML array; first, so that it is no table's key.
    return f"{key} = {json.dumps(value, ensure_ascii=False)}\n{text}"


def needs_env_given_key(text: str, key: str) -> bool:
    """Whether the TOML `text` leaves top-level `key` to the env: absent or empty (`[]`, `""`).
    A file that is not TOML gives nothing to add to (`config check` names its error)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return key not in doc or doc[key] in ([], "")


# --------------------------------------------------------------------------------------------
# (b) schemas


class Schemas:
    def __init__(self, versions: list[str], crd_dir: Path) -> None:
        import jsonschema
        import kubernetes_validate
        import kubernetes_validate.utils as kvu

        # The same files, parsed once instead of per object.
        kvu.schema_contents = functools.lru_cache(maxsize=None)(kvu.schema_contents)
        self.kv = kubernetes_validate
        self.jsonschema = jsonschema
        self.versions = versions
        self.crds: dict[tuple[str, str], Any] = {}
        sm = json.loads((crd_dir / "servicemonitor-monitoring-v1.json").read_text())
        self.crds[("monitoring.coreos.com/v1", "ServiceMonitor")] = jsonschema.Draft202012Validator(sm)

    def validate(self, doc: Doc) -> list[str]:
        key = (doc.get("apiVersion", ""), doc.get("kind", ""))
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if key in self.crds:
            return [
                f"{name}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message} (CRD subset schema)"
                for e in self.crds[key].iter_errors(doc)
            ]
        errs = []
        for v in self.versions:
            try:
                self.kv.validate(doc, v, strict=True)
            except self.kv.utils.ValidationError as e:
                errs.append(f"{name}: k8s {v}: {'.'.join(map(str, e.path)) or '<root>'}: {e.message}")
            except self.kv.utils.SchemaNotFoundError as e:
                errs.append(f"{name}: no schema: {e.message}")
        return errs


# --------------------------------------------------------------------------------------------
# (refs) object references


def check_refs(docs: list[Doc]) -> list[str]:
    errs: list[str] = []
    workloads = [d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment", "Job")]
    by_kind_name = {(d["kind"], d["metadata"]["name"]) for d in docs}
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    if len(namespaces) != 1 or None in namespaces:
        errs.append(f"namespaced objects are in {sorted(map(str, namespaces))}: expected one namespace")
    for w in workloads:
        wn = f"{w['kind']}/{w['metadata']['name']}"
        tl = w["spec"]["template"]["metadata"].get("labels", {})
        sel = w["spec"].get("selector", {}).get("matchLabels")
        if w["kind"] != "Job" and (not sel or not labels_match(sel, tl)):
            errs.append(f"{wn}: selector {sel} does not match template labels {tl}")
        spec = pod_spec(w)
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        claim_names = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in containers(spec):
            for m in c.get("volumeMounts", []):
                if m["name"] not in vols and m["name"] not in claim_names:
                    errs.append(f"{wn}: container {c['name']} mounts unknown volume {m['name']}")
        for v in spec.get("volumes", []):
            for kind, field, namefield in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
                src = v.get(field)
                if src is None:
                    continue
                target = find(docs, kind, src[namefield])
                if not target:
                    errs.append(f"{wn}: volume {v['name']} references {kind} {src[namefield]} which is not rendered")
                    continue
                keys = object_keys(target[0])
                for it in src.get("items", []):
                    if it["key"] not in keys:
                        errs.append(f"{wn}: volume {v['name']}: {kind} {src[namefield]} has no key {it['key']}")
        if w["kind"] == "StatefulSet":
            svc = find(docs, "Service", w["spec"]["serviceName"])
            if not svc or svc[0]["spec"].get("clusterIP") != "None":
                errs.append(f"{wn}: serviceName {w['spec']['serviceName']} is not a rendered headless Service")
    for s in find(docs, "Service"):
        sel = s["spec"].get("selector") or {}
        pods = [w for w in workloads if labels_match(sel, w["spec"]["template"]["metadata"].get("labels", {}))]
        if not pods:
            errs.append(f"Service/{s['metadata']['name']}: selector {sel} matches no workload's pods")
            continue
        for p in s["spec"].get("ports", []):
            tp = p.get("targetPort", p["port"])
            for w in pods:
                if not any(declared_port(c, tp) for c in pod_spec(w)["containers"]):
                    errs.append(f"Service/{s['metadata']['name']}: targetPort {tp} is no declared container port of {w['kind']}/{w['metadata']['name']}")
    for sm in find(docs, "ServiceMonitor"):
        sel = sm["spec"]["selector"].get("matchLabels", {})
        svcs = [s for s in find(docs, "Service") if labels_match(sel, s["metadata"].get("labels", {}))]
        if not svcs:
            errs.append(f"ServiceMonitor/{sm['metadata']['name']}: selector {sel} matches no Service")
        for ep in sm["spec"].get("endpoints", []):
            for s in svcs:
                if ep.get("port") not in {p.get("name") for p in s["spec"]["ports"]}:
                    errs.append(f"ServiceMonitor/{sm['metadata']['name']}: port {ep.get('port')} is not a named port of Service/{s['metadata']['name']}")
    if not any(k in ("StatefulSet", "Deployment") and n == "shardwire-source" for k, n in by_kind_name):
        errs.append("neither StatefulSet/shardwire-source nor Deployment/shardwire-source is rendered")
    for k, n in [("DaemonSet", "shardwire-node"), ("Service", "shardwire-source"),
                 ("Secret", "shardwire-secret"), ("Job", "shardwire-trainer-example"), ("Service", "shardwire-node-metrics")]:
        if (k, n) not in by_kind_name:
            errs.append(f"{k}/{n} is not rendered")
    return errs


# --------------------------------------------------------------------------------------------
# (c)+(d) node, source, trainer


def toml_of(docs: list[Doc], w: Doc, c: Doc, path: str) -> str:
    vol, key = resolve_file(w, c, path)
    if "configMap" not in vol or key is None:
        raise CheckError(f"{path} is not a ConfigMap key (volume {vol['name']})")
    cm = one(docs, "ConfigMap", vol["configMap"]["name"])
    if key not in (cm.get("data") or {}):
        raise CheckError(f"ConfigMap {cm['metadata']['name']} has no key {key}")
    return cm["data"][key]


def secret_ok(docs: list[Doc], w: Doc, c: Doc, path: str | None) -> list[str]:
    if not path:
        return ["secret_file is not set (sources accept only loopback peers without it)"]
    try:
        vol, key = resolve_file(w, c, path)
    except CheckError as e:
        return [f"secret_file {path}: {e}"]
    if "secret" not in vol or key is None:
        return [f"secret_file {path} is not a Secret key (volume {vol['name']})"]
    sec = find(docs, "Secret", vol["secret"]["secretName"])
    if not sec or key not in object_keys(sec[0]):
        return [f"secret_file {path}: Secret {vol['secret']['secretName']} has no key {key}"]
    return []


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def admin_scrapers(docs: list[Doc], w: Doc) -> list[str]:
    """The rendered Services that select workload w's pods and target their port `admin`
    (components/source-metrics; a ServiceMonitor reaches the pods only through such a Service)."""
    pod = w["spec"]["template"]["metadata"].get("labels", {})
    out = []
    for svc in find(docs, "Service"):
        sel = svc["spec"].get("selector") or {}
        if sel and labels_match(sel, pod) and any(p.get("targetPort") == "admin" for p in svc["spec"].get("ports", [])):
            out.append(f"Service/{svc['metadata']['name']}")
    return out


def source_admin(c: Doc, eff: dict, scrapers: list[str]) -> list[str]:
    """The source's admin endpoint (/v1/status, /metrics) against its container port `admin` and
    the Services that target that port (`scrapers`). Compared only where the port is declared or
    targeted: then source.toml `admin` listens on it, on an address the pod network reaches (not
    loopback). An `admin` nothing declares or scrapes (e.g. loopback, for `kubectl exec ... curl`)
    needs no port; a port declared or scraped without `admin` has nothing listening."""
    admin, declared = eff.get("admin"), container_port(c, "admin")
    users = ([f"the source container declares port `admin` ({declared})"] if declared is not None else []) + \
        [f"{s} targets port `admin`" for s in scrapers]
    if not users:
        return []
    who = " and ".join(users)
    if not admin:
        return [f"{who}, but source.toml sets no `admin`: nothing listens there"]
    host, port = host_port(admin)
    errs = []
    if is_loopback(host):
        errs.append(f"source.toml admin = {admin} is loopback, but {who}: nothing outside the pod reaches it; "
                    f"listen on 0.0.0.0:{port}, or drop the port `admin` and what scrapes it")
    if declared != port:
        errs.append(f"source.toml admin = {admin}, but {who}: the port `admin` must be {port}, where the admin endpoint "
                    "listens (Services such as components/source-metrics scrape it)")
    return errs


def cache_disk(w: Doc, c: Doc, eff: dict) -> list[str]:
    """A source's cache_dir on an emptyDir (not `medium: Memory`) lives on the node's kubelet
    disk: the container must request that much `ephemeral-storage` (at least cache_size), or the
    scheduler reserves nothing there; the source refuses a cache_size above the free space at
    start (crash loop on a small disk), and sources sharing a node each see the same free space
    and together fill it (DiskPressure evicts every pod there). A limit or sizeLimit below
    cache_size evicts the pod as its cache fills. A cache on another volume (a PVC, local NVMe)
    is not compared."""
    cache, size = eff.get("cache_dir"), int(eff.get("cache_size") or 0)
    if not cache or not size:
        return []
    try:
        vol, _ = resolve_file(w, c, cache)
    except CheckError:
        return []  # reported by source_wiring
    ed = vol.get("emptyDir")
    if ed is None or ed.get("medium") == "Memory":
        return []
    gib = f"cache_size {size / (1 << 30):g}GiB"
    res = c.get("resources") or {}
    req = (res.get("requests") or {}).get("ephemeral-storage")
    lim = (res.get("limits") or {}).get("ephemeral-storage")
    errs = []
    if req is None or quantity_bytes(req) < size:
        asked = f"requests ephemeral-storage {req}" if req is not None else "requests no ephemeral-storage"
        errs.append(f"cache_dir {cache} is on emptyDir {vol['name']} (the node's disk), but the source container {asked}, "
                    f"less than {gib}: the scheduler reserves no room for the cache, so the source "
                    "fails its start where the disk has less free, and sources sharing a node fill it; request at least "
                    "cache_size (deploy/README.md, \"Elastic sources: the cache's disk\")")
    if lim is not None and quantity_bytes(lim) < size:
        errs.append(f"ephemeral-storage limit {lim} < {gib}: the pod is evicted as its cache fills")
    if ed.get("sizeLimit") is not None and quantity_bytes(ed["sizeLimit"]) < size:
        errs.append(f"emptyDir {vol['name']} sizeLimit {ed['sizeLimit']} < {gib}: the pod is evicted as its cache fills")
    return errs


def source_workload(docs: list[Doc]) -> Doc:
    """The source tier: StatefulSet/shardwire-source (stable names) or, in the elastic overlay,
    Deployment/shardwire-source (found by DNS)."""
    for kind in ("StatefulSet", "Deployment"):
        if find(docs, kind, "shardwire-source"):
            return one(docs, kind, "shardwire-source")
    raise CheckError("no StatefulSet or Deployment shardwire-source")


def source_service_name(docs: list[Doc], w: Doc) -> str:
    """The Service of the source pods: a StatefulSet's serviceName, else the headless Service
    whose selector matches the Deployment's pods."""
    if w["kind"] == "StatefulSet":
        return w["spec"]["serviceName"]
    pod = w["spec"]["template"]["metadata"].get("labels", {})
    for svc in find(docs, "Service"):
        sel = svc["spec"].get("selector") or {}
        if svc["spec"].get("clusterIP") == "None" and sel and labels_match(sel, pod):
            return svc["metadata"]["name"]
    raise CheckError(f"no headless Service selects the pods of {w['kind']}/{w['metadata']['name']}")


def dns_sources(docs: list[Doc], dep: Doc, eff: dict, port) -> tuple[list[str], str]:
    """A Deployment of sources: serve.toml names them by one `dns:` entry for their headless
    Service on its port; an HPA scales that Deployment, which sets no `replicas` of its own (an
    apply would reset the HPA's count), and a PodDisruptionBudget covers its pods (it drains on
    SIGTERM: the grace period must exceed drain_timeout_secs)."""
    errs = []
    ns = dep["metadata"].get("namespace", "")
    svc = source_service_name(docs, dep)
    names = (svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local")
    entries = eff["sources"]
    if len(entries) != 1 or not entries[0].startswith("dns:"):
        errs.append(f"serve.toml sources {entries}: a Deployment's pods are found by one dns:NAME:PORT entry")
    else:
        host, p = host_port(entries[0][len("dns:"):])
        if host not in names or p != port:
            errs.append(f"source {entries[0]} is not headless Service {svc} (namespace {ns}) on port {port}")
    hpas = [h for h in find(docs, "HorizontalPodAutoscaler")
            if h["spec"]["scaleTargetRef"].get("kind") == "Deployment" and h["spec"]["scaleTargetRef"].get("name") == dep["metadata"]["name"]]
    if not hpas:
        errs.append(f"no HorizontalPodAutoscaler scales Deployment/{dep['metadata']['name']}")
    elif "replicas" in dep["spec"]:
        errs.append(f"Deployment/{dep['metadata']['name']} sets replicas: {dep['spec']['replicas']} while "
                    f"HorizontalPodAutoscaler/{hpas[0]['metadata']['name']} scales it: every `kubectl apply` resets the "
                    "count (sources drain at once, their cache slices are read from the bucket again); drop spec.replicas")
    pod = dep["spec"]["template"]["metadata"].get("labels", {})
    if not any(labels_match(b["spec"]["selector"].get("matchLabels", {}), pod) for b in find(docs, "PodDisruptionBudget")):
        errs.append(f"no PodDisruptionBudget selects the pods of Deployment/{dep['metadata']['name']}")
    return errs, f"sources = {entries} -> headless Service {svc}:{port}; HPA and PDB on Deployment/{dep['metadata']['name']}"


def check_node_source_trainer(docs: list[Doc], sw: Shardwire, res: Results, scope: str) -> None:
    # A check's warnings, printed before its verdict.
    warned: list[str] = []

    def guarded(name: str, fn: Callable[[], tuple[list[str], str]]) -> None:
        try:
            errs, detail = fn()
        except CheckError as e:
            errs, detail = [str(e)], ""
        for w in warned:
            res.warn(scope, w)
        warned.clear()
        res.check(scope, name, errs, detail)

    state: dict[str, Any] = {}

    # ---- source (first: the node's `sources` are checked against it)
    def source_config() -> tuple[list[str], str]:
        sts = source_workload(docs)
        c = container_by_subcommand(sts, "source")
        argv = argv_of(c)
        cfg = flag_value(argv, "--config")
        if argv[0] != "source" or not cfg:
            return [f"source container runs {argv}: expected `source --config FILE`"], ""
        text = toml_of(docs, sts, c, cfg)
        env, warns = sw.env_for(c, docs)
        warned.extend(warns)
        errs, eff = sw.check_and_print(text, True, env)
        if eff is not None:
            state["source"] = (sts, c, eff)
        return errs, f"{cfg}: shardwire config check --source-config ok"

    guarded("source.toml passes `shardwire config check --source-config`", source_config)

    def source_wiring() -> tuple[list[str], str]:
        if "source" not in state:
            return ["skipped: source.toml did not load"], ""
        sts, c, eff = state["source"]
        errs = []
        _, port = host_port(eff["listen"])
        if container_port(c, "control") != port:
            errs.append(f"container port `control` {container_port(c, 'control')} != source.toml listen port {port}")
        svc = one(docs, "Service", source_service_name(docs, sts))
        sp = [p for p in svc["spec"]["ports"] if declared_port(c, p.get("targetPort", p["port"])) == port]
        if not sp:
            errs.append(f"Service {svc['metadata']['name']} has no port targeting {port}")
        else:
            state["source_port"] = sp[0]["port"]
        errs += source_admin(c, eff, admin_scrapers(docs, sts))
        errs += secret_ok(docs, sts, c, eff.get("secret_file"))
        names = []
        for spec in eff["datasets"]:
            name, _, d = spec.partition("=")
            names.append(name)
            if re.match(r"^(s3|gs|az|file|https?)://", d):
                # Object storage: no volume, but the cache (if any) must be a writable mount.
                cache = eff.get("cache_dir")
                if cache:
                    try:
                        resolve_file(sts, c, cache)
                    except CheckError:
                        errs.append(f"dataset {name}: cache_dir {cache} is on no volume mount of the source container")
                    ro = [m for m in c.get("volumeMounts", []) if m["mountPath"].rstrip("/") == cache.rstrip("/") and m.get("readOnly")]
                    if ro:
                        errs.append(f"cache_dir {cache} is mounted read-only")
                continue
            try:
                resolve_file(sts, c, d)
            except CheckError:
                errs.append(f"dataset {name}: {d} is on no volume mount of the source container")
        errs += cache_disk(sts, c, eff)
        state["datasets"] = names
        return errs, f"listen :{port}, Service port {state.get('source_port')}, datasets {names}"

    guarded("source: ports, Secret, dataset volume and cache disk agree with source.toml", source_wiring)

    # ---- node
    def node_config() -> tuple[list[str], str]:
        ds = one(docs, "DaemonSet", "shardwire-node")
        c = container_by_subcommand(ds, "serve")
        argv = argv_of(c)
        cfg = flag_value(argv, "--config")
        if argv[0] != "serve" or not cfg:
            return [f"node container runs {argv}: expected `serve --config FILE`"], ""
        if len(argv) != 3:
            return [f"node container runs {argv}: flags beyond --config would override serve.toml; keep them in the file"], ""
        text = toml_of(docs, ds, c, cfg)
        env, warns = sw.env_for(c, docs)
        warned.extend(warns)
        errs, eff = sw.check_and_print(text, False, env)
        if eff is not None:
            state["node"] = (ds, c, eff)
        return errs, f"{cfg}: shardwire config check ok"

    guarded("serve.toml passes `shardwire config check`", node_config)

    def node_probes() -> tuple[list[str], str]:
        if "node" not in state:
            return ["skipped: serve.toml did not load"], ""
        ds, c, eff = state["node"]
        errs = []
        host, admin_port = host_port(eff["admin"])
        for probe, path in (("startupProbe", "/healthz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            p = c.get(probe)
            if not p or "httpGet" not in p:
                errs.append(f"{probe} is not an httpGet probe")
                continue
            g = p["httpGet"]
            if g.get("path") != path:
                errs.append(f"{probe} path {g.get('path')!r} != {path!r}")
            port = container_port(c, g.get("port"))
            if port != admin_port:
                errs.append(f"{probe} port {g.get('port')!r} (= {port}) != admin port {admin_port} (serve.toml admin = {eff['admin']})")
            if g.get("scheme", "HTTP") != "HTTP":
                errs.append(f"{probe} scheme {g.get('scheme')}: the admin API is plain HTTP")
        start_s = startup_budget(c.get("startupProbe") or {})
        if c.get("startupProbe") and start_s < MIN_START_S:
            errs.append(f"startupProbe gives the start {start_s}s (initialDelaySeconds + periodSeconds x failureThreshold) "
                        f"< {MIN_START_S}s: the admin API answers only once NICs, GPUs and lanes are up, and liveness would kill a slow start")
        spec = pod_spec(ds)
        if spec.get("hostNetwork"):
            if is_loopback(host):
                errs.append(f"admin = {eff['admin']} is loopback: with hostNetwork the kubelet probes the node IP; use 0.0.0.0:{admin_port}")
            if spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
                errs.append("hostNetwork without dnsPolicy ClusterFirstWithHostNet: the sources' cluster DNS names will not resolve")
        return errs, f"startup /healthz ({start_s}s), readiness /readyz, liveness /healthz on :{admin_port} = admin {eff['admin']}"

    guarded("node: probes match the admin API (startup /healthz, /readyz, /healthz, admin port)", node_probes)

    def node_wiring() -> tuple[list[str], str]:
        if "node" not in state:
            return ["skipped: serve.toml did not load"], ""
        ds, c, eff = state["node"]
        errs = []
        _, data_port = host_port(eff["data_listen"])
        if container_port(c, "data") != data_port:
            errs.append(f"container port `data` {container_port(c, 'data')} != data_listen port {data_port}")
        sock_dir = posixpath.dirname(eff["socket"])
        m = mount_for_dir(c, sock_dir)
        vols = {v["name"]: v for v in pod_spec(ds).get("volumes", [])}
        if m is None or "hostPath" not in vols.get(m["name"], {}):
            errs.append(f"socket directory {sock_dir} (serve.toml socket = {eff['socket']}) is not a hostPath mount")
        else:
            state["socket_hostpath"] = vols[m["name"]]["hostPath"]["path"]
            if m.get("readOnly"):
                errs.append(f"socket directory mount {sock_dir} is read-only: the node service creates the socket there")
        errs += secret_ok(docs, ds, c, eff.get("secret_file"))
        if eff.get("admin_token_file"):
            errs += [e.replace("secret_file", "admin_token_file") for e in secret_ok(docs, ds, c, eff["admin_token_file"])]
        # SIGTERM arrives after the preStop hook; the service then needs up to
        # drain_timeout_secs (where this build has the key) before the kubelet's SIGKILL.
        grace = pod_spec(ds).get("terminationGracePeriodSeconds", 30)
        pre = ((c.get("lifecycle") or {}).get("preStop") or {})
        pre_s = 0
        cmd = (pre.get("exec") or {}).get("command") or []
        if len(cmd) == 2 and cmd[0] == "sleep":
            pre_s = int(cmd[1])
        elif "sleep" in pre:
            pre_s = int(pre["sleep"]["seconds"])
        drain_s = int(eff.get("drain_timeout_secs", 0))
        if grace < pre_s + drain_s + 5:
            errs.append(f"terminationGracePeriodSeconds {grace} < preStop {pre_s}s + drain_timeout_secs {drain_s}s + 5s")
        lim = c.get("resources", {}).get("limits", {}).get("memory")
        margin = 256 << 20
        charged, what = host_pool(eff, pod_spec(ds))
        if lim is None:
            errs.append("no memory limit on the node container")
        elif quantity_bytes(lim) < charged + margin:
            errs.append(f"memory limit {lim} < {what} + 256MiB: memfd pool pages are charged to this pod")
        tok = f", admin token {eff['admin_token_file']}" if eff.get("admin_token_file") else ""
        return errs, (f"data :{data_port}{tok}, socket dir {sock_dir} = hostPath {state.get('socket_hostpath')}, "
                      f"memory limit {lim} >= {what} + 256MiB, grace {grace}s >= {pre_s}s + {drain_s}s + 5s")

    guarded("node: data port, socket hostPath, Secret keys, memory limit and grace period agree with serve.toml", node_wiring)

    def node_sources() -> tuple[list[str], str]:
        if "node" not in state or "source" not in state:
            return ["skipped: serve.toml or source.toml did not load"], ""
        _, _, eff = state["node"]
        sts, _, _ = state["source"]
        if sts["kind"] == "Deployment":
            return dns_sources(docs, sts, eff, state.get("source_port"))
        ns = sts["metadata"].get("namespace", "")
        svc = sts["spec"]["serviceName"]
        port = state.get("source_port")
        n = sts["spec"].get("replicas", 1)
        want = {f"{sts['metadata']['name']}-{i}" for i in range(n)}
        got = set()
        errs = []
        for s in eff["sources"]:
            host, p = host_port(s)
            parts = host.split(".")
            pod = parts[0]
            rest = ".".join(parts[1:])
            ok_rest = rest in (svc, f"{svc}.{ns}", f"{svc}.{ns}.svc") or rest.startswith(f"{svc}.{ns}.svc.")
            if not ok_rest or pod not in want or p != port:
                errs.append(f"source {s} is not a pod of StatefulSet {sts['metadata']['name']} ({n} replicas) via Service {svc} on port {port}")
            got.add(pod)
        if got != want:
            errs.append(f"serve.toml sources name pods {sorted(got)}; the StatefulSet has {sorted(want)}")
        return errs, f"{len(eff['sources'])} sources = {n} StatefulSet pods via {svc}:{port}"

    guarded("node: `sources` are exactly the source StatefulSet's pods (or the Deployment's, by DNS)", node_sources)

    def node_devmem() -> tuple[list[str], str]:
        if "node" not in state:
            return ["skipped: serve.toml did not load"], ""
        ds, c, eff = state["node"]
        errs, detail, warns = devmem_errors(pod_spec(ds), c, eff)
        warned.extend(warns)
        return errs, detail

    guarded("node: receive = devmem has NET_ADMIN and its dma-buf (memory = cuda, auto with GPUs, or /dev/udmabuf granted)",
            node_devmem)

    def trainer() -> tuple[list[str], str]:
        if "node" not in state:
            return ["skipped: serve.toml did not load"], ""
        ds, nc, eff = state["node"]
        job = one(docs, "Job", "shardwire-trainer-example")
        c = container_by_subcommand(job, "consume")
        argv = argv_of(c)
        errs = []
        sock = eff["socket"]
        if flag_value(argv, "--socket") != sock:
            errs.append(f"--socket {flag_value(argv, '--socket')} != serve.toml socket {sock}")
        envs = {e["name"]: e.get("value") for e in c.get("env", [])}
        if envs.get("SHARDWIRE_SOCKET") != sock:
            errs.append(f"SHARDWIRE_SOCKET {envs.get('SHARDWIRE_SOCKET')} != serve.toml socket {sock}")
        ds_name = flag_value(argv, "--dataset")
        if "--jsonl" not in argv:
            errs.append("consume without --jsonl")
        if state.get("datasets") is not None and ds_name not in state["datasets"]:
            errs.append(f"--dataset {ds_name} is not served (source.toml datasets {state['datasets']})")
        m = mount_for_dir(c, posixpath.dirname(sock))
        vols = {v["name"]: v for v in pod_spec(job).get("volumes", [])}
        if m is None or "hostPath" not in vols.get(m["name"], {}):
            errs.append(f"the trainer does not mount a hostPath at {posixpath.dirname(sock)}")
        elif vols[m["name"]]["hostPath"]["path"] != state.get("socket_hostpath"):
            errs.append(f"trainer hostPath {vols[m['name']]['hostPath']['path']} != node hostPath {state.get('socket_hostpath')}")
        # The socket is owned by the node process's uid and primary gid, with socket_mode.
        nuid, node_gid, _ = pod_ids(pod_spec(ds), nc)
        tuid, tgid, tgids = pod_ids(pod_spec(job), c)
        mode = socket_mode_bits(eff.get("socket_mode", "0660"))
        refused = socket_access(mode, (nuid, node_gid), (tuid, tgid, tgids),
                                (eff.get("allowed_uids") or [], eff.get("allowed_gids") or []))
        if refused:
            errs.append(refused)
        return errs, (f"socket {sock} ({mode:04o}, uid {nuid} gid {node_gid}), hostPath {state.get('socket_hostpath')}, "
                      f"dataset {ds_name}, trainer uid {tuid} groups {sorted(tgids)} may connect")

    guarded("trainer Job: socket, hostPath, dataset and group match the node", trainer)


# --------------------------------------------------------------------------------------------
# dashboard


# The metrics the dashboard must show (README.md, Admin API); others the service exports and
# the dashboard lacks are warnings, so adding a metric does not break this check.
REQUIRED_METRICS = {
    "shardwire_bytes_received_total", "shardwire_shards_received_total", "shardwire_crc_failures_total",
    "shardwire_refetches_total", "shardwire_batches_delivered_total", "shardwire_source_bytes_received_total",
    "shardwire_source_up", "shardwire_pool_bytes_used", "shardwire_pool_bytes_free",
    "shardwire_pool_bytes_reserved", "shardwire_leases_outstanding", "shardwire_streams_open",
}


def exported_metrics(srcs: list[Path]) -> tuple[dict[str, str], bool]:
    """{name: counter|gauge|histogram} registered by the node service (service/src and the
    node library it runs, node/src), and whether histogram buckets are configured (without
    them metrics-exporter-prometheus renders histograms as summaries: NAME{quantile=...},
    NAME_sum, NAME_count)."""
    out: dict[str, str] = {}
    buckets = False
    for f in sorted(f for src in srcs for f in src.rglob("*.rs")):
        text = f.read_text()
        for kind, name in re.findall(r'metrics::(counter|gauge|histogram)!\(\s*"(shardwire_[a-z0-9_]+)"', text):
            out[name] = kind
        # service/src/prom.rs: the described families, ("kind", "name", "help"), and the
        # float counters it renders itself (`pub const STALL: &str = "..._total"`).
        for kind, name in re.findall(r'\(\s*"(counter|gauge|histogram)",\s*"(shardwire_[a-z0-9_]+)"', text):
            out[name] = kind
        for name in re.findall(r'pub const STALL: &str = "(shardwire_[a-z0-9_]+)"', text):
            out[name] = "counter"
        # node/src/counters.rs: the `counters!` table, `field => status: Unit, "name", label, help;`
        # (every entry is a counter).
        for name in re.findall(r'=>\s*[a-z_0-9]+:\s*[A-Za-z]+,\s*"(shardwire_[a-z0-9_]+)"', text):
            out[name] = "counter"
        buckets = buckets or "set_buckets" in text
    return out, buckets


def check_dashboard(path: Path, srcs: list[Path]) -> tuple[list[str], str, list[str]]:
    import promql_parser

    errs: list[str] = []
    try:
        dash = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{path}: not JSON: {e}"], "", []
    tl = dash.get("templating", {}).get("list", [])
    dsvars = [v for v in tl if v.get("type") == "datasource" and v.get("query") == "prometheus"]
    if not dsvars:
        errs.append("no Prometheus datasource variable (type datasource, query prometheus)")
    dsname = dsvars[0]["name"] if dsvars else "datasource"
    want_ds = {"${%s}" % dsname, "$" + dsname}
    kinds, buckets = exported_metrics(srcs)
    src = ", ".join(str(x) for x in srcs)
    exported = set(kinds)
    if not exported:
        errs.append(f"found no exported metrics in {src}")
    used: set[str] = set()
    exprs = 0

    def parse(expr: str, where: str) -> None:
        nonlocal exprs
        exprs += 1
        e = expr
        for var, val in (("$__rate_interval", "1m"), ("$__interval", "1m"), ("$__range", "1h")):
            e = e.replace(var, val)
        e = re.sub(r"\$\{?[a-zA-Z_][a-zA-Z0-9_]*\}?", ".*", e)
        try:
            ast = promql_parser.parse(e)
        except ValueError as ex:
            errs.append(f"{where}: PromQL does not parse: {ex}: {expr}")
            return
        names: list[str] = []

        def visit(n: Any) -> bool:
            if isinstance(n, promql_parser.VectorSelector) and n.name:
                names.append(n.name)
            return True

        promql_parser.walk(ast, visit)
        for n in names:
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            if n not in exported and kinds.get(base) == "histogram":
                if n.endswith("_bucket") and not buckets:
                    errs.append(f"{where}: {n}: the service exports {base} as a summary (no buckets configured); use {base}{{quantile=...}}")
                n = base
            used.add(n)
            if n not in exported:
                errs.append(f"{where}: metric {n} is not exported by the service ({src})")

    def panels(ps: Iterable[Doc]) -> Iterable[Doc]:
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    n_panels = 0
    for p in panels(dash.get("panels", [])):
        if p.get("type") == "row":
            continue
        n_panels += 1
        where = f"panel {p.get('title')!r}"
        if (p.get("datasource") or {}).get("uid") not in want_ds:
            errs.append(f"{where}: datasource is not the ${dsname} variable")
        if not p.get("targets"):
            errs.append(f"{where}: no queries")
        for t in p.get("targets", []):
            if (t.get("datasource") or {}).get("uid") not in want_ds:
                errs.append(f"{where}: target {t.get('refId')}: datasource is not the ${dsname} variable")
            parse(t.get("expr", ""), where)
    for v in tl:
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.fullmatch(r"label_values\((.*),\s*[a-zA-Z_]+\)", q or "")
            if m:
                parse(m.group(1), f"variable {v['name']}")
    missing = (REQUIRED_METRICS & exported) - used
    if missing:
        errs.append(f"required metrics not on the dashboard: {sorted(missing)}")
    gone = REQUIRED_METRICS - exported
    if gone:
        errs.append(f"required metrics no longer exported by the service: {sorted(gone)}")
    warnings = [f"exported by the service but not on the dashboard: {m}" for m in sorted(exported - used)]
    return errs, (f"{n_panels} panels, {exprs} PromQL expressions parsed, "
                  f"{len(used & exported)}/{len(exported)} exported metrics used"), warnings


def check_dockerfile(path: Path, repo: Path, sw: Shardwire) -> tuple[list[str], str]:
    import dockerfile

    errs: list[str] = []
    cmds = dockerfile.parse_file(str(path))
    args = {}
    for c in cmds:
        if c.cmd == "ARG" and "=" in c.value[0]:
            k, v = c.value[0].split("=", 1)
            args.setdefault(k, v)

    def expand(s: str) -> str:
        return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), s)

    stages: list[dict[str, Any]] = []
    for c in cmds:
        if c.cmd == "FROM":
            v = c.value
            stages.append({"image": expand(v[0]), "name": v[2] if len(v) >= 3 and v[1].upper() == "AS" else None, "cmds": []})
        elif stages:
            stages[-1]["cmds"].append(c)
    if len(stages) < 2:
        return [f"{len(stages)} stage(s): expected a multi-stage build"], ""
    build, final = stages[0], stages[-1]
    runs = " ".join(" ".join(c.value) for c in build["cmds"] if c.cmd == "RUN")
    if "cargo build --release -p shardwire --locked" not in re.sub(r"\s+", " ", runs):
        errs.append("the build stage does not run `cargo build --release -p shardwire --locked`")
    m = re.match(r"rust:(\d+)\.(\d+)", build["image"])
    ws = tomllib.loads((repo / "Cargo.toml").read_text())
    need = ws["workspace"]["package"]["rust-version"]
    if not m:
        errs.append(f"build image {build['image']} is not rust:MAJOR.MINOR-...")
    elif tuple(map(int, m.groups())) < tuple(map(int, need.split(".")[:2])):
        errs.append(f"build image {build['image']} is older than rust-version {need}")
    rel_b = re.search(r"(bookworm|bullseye|trixie)", build["image"])
    rel_f = re.search(r"(bookworm|bullseye|trixie|debian\d+)", final["image"])
    if not re.match(r"(debian:.*-slim|gcr\.io/distroless/cc)", final["image"]):
        errs.append(f"runtime image {final['image']} is not debian:*-slim or distroless/cc")
    if rel_b and rel_f and rel_b.group(1) != rel_f.group(1) and not rel_f.group(1).startswith("debian"):
        errs.append(f"builder ({rel_b.group(1)}) and runtime ({rel_f.group(1)}) Debian releases differ: glibc mismatch")
    fc = final["cmds"]
    final_runs = re.sub(r"\s+", " ", " ".join(" ".join(c.value) for c in fc if c.cmd == "RUN"))
    if final["image"].startswith("debian:") and not re.search(r"apt-get install [^&;|]*\bca-certificates\b", final_runs):
        errs.append("the debian runtime stage does not `apt-get install ca-certificates`: the TLS client verifies https object "
                    "stores (s3://, gs://, az://, https://) against the system's CA roots (rustls-native-certs, /etc/ssl/certs) "
                    "and ships none; without them every https request fails")
    if not any(c.cmd == "COPY" and any(f == f"--from={build['name']}" for f in c.flags) for c in fc):
        errs.append(f"the runtime stage copies nothing --from={build['name']}")
    ep = [c for c in fc if c.cmd == "ENTRYPOINT"]
    if not ep or not ep[-1].json or list(ep[-1].value) != ["shardwire"]:
        errs.append('ENTRYPOINT is not ["shardwire"] (exec form)')
    users = [expand(c.value[0]) for c in fc if c.cmd == "USER"]
    if not users or users[-1].split(":")[0] in ("0", "root"):
        errs.append("the runtime stage does not switch to a non-root USER")
    elif users[-1] != f"{IMAGE_UID}:{IMAGE_GID}":
        errs.append(f"USER {users[-1]} != {IMAGE_UID}:{IMAGE_GID}, which the manifests assume (check_rendered.IMAGE_UID/GID)")
    exposed = {int(p.split("/")[0]) for c in fc if c.cmd == "EXPOSE" for p in c.value}
    env = dict(sw.base_env)
    want = set()
    for src in (False, True):
        p = sw.run(["config", "print", *(["--source-config"] if src else [])], env)
        if src and p.returncode != 0:
            want.add(7500)  # the source config needs a dataset to print; its default listen port
            continue
        if p.returncode == 0:
            eff = json.loads(p.stdout)
            for k in ("admin", "data_listen", "listen"):
                if k in eff:
                    want.add(host_port(eff[k])[1])
    if not want <= exposed:
        errs.append(f"EXPOSE {sorted(exposed)} lacks default ports {sorted(want - exposed)}")
    ign = path.with_name(path.name + ".dockerignore")
    members = ws["workspace"].get("members", [])
    gitignore = (repo / ".gitignore").read_text().splitlines() if (repo / ".gitignore").exists() else []
    for f in (ign, repo / "deploy/dockerignore.example"):
        if f.exists():
            errs += context_errors(f.name, f.read_text().splitlines(), members, gitignore, build_files(repo, members))
        else:
            errs.append(f"{f} is missing: the build context would include target/ and .git/")
    return errs, f"{len(stages)} stages ({build['image']} -> {final['image']}), USER {users[-1] if users else '-'}, EXPOSE {sorted(exposed)}"


def docker_pattern(pat: str) -> Callable[[str], bool]:
    """One cleaned .dockerignore pattern as a test of a slash path, as moby/patternmatcher
    compiles it: plain text matches exactly, `P/**` is a prefix, `**/S` a suffix, anything else
    a regexp where `**` spans directories, `*` and `?` stay within one element and `\\` escapes.
    Raises re.error on a malformed pattern."""
    rx, kind, i = "^", "exact", 0
    while i < len(pat):
        ch = pat[i]
        if pat.startswith("**", i):
            j = i + 2 + (pat[i + 2 : i + 3] == "/")
            if j >= len(pat):
                rx, kind = (rx, "prefix") if kind == "exact" else (rx + ".*", "regexp")
            else:
                rx, kind = rx + "(.*/)?", "regexp"
            kind = "suffix" if i == 0 else kind
            i = j
            continue
        if ch in "*?":
            rx, kind = rx + ("[^/]*" if ch == "*" else "[^/]"), "regexp"
        elif ch == "\\" and i + 1 < len(pat):
            rx, kind, i = rx + "\\" + pat[i + 1], "regexp", i + 1
        elif ch in "[]":
            rx, kind = rx + ch, "regexp"
        else:
            rx += re.escape(ch)
        i += 1
    if kind == "exact":
        return lambda p: p == pat
    if kind == "prefix":
        return lambda p: p.startswith(pat[:-2])
    if kind == "suffix":
        suf = pat[2:]
        return lambda p: p.endswith(suf) or (suf[:1] == "/" and p == suf[1:])
    compiled = re.compile(rx + "$")
    return lambda p: compiled.match(p) is not None


def dockerignore_rules(lines: list[str]) -> tuple[list[tuple[bool, str, Callable[[str], bool]]], list[str]]:
    """A .dockerignore's patterns in order, as (re-include `!`, text, test), and the errors of
    malformed ones. Each is trimmed and cleaned, a leading / dropped (the context root)."""
    rules, errs = [], []
    for ln in lines:
        text = ln.strip()
        if not text or text.startswith("#"):
            continue
        neg = text.startswith("!")
        pat = posixpath.normpath(text[1:].strip() if neg else text).lstrip("/")
        if pat in ("", "."):
            continue
        try:
            rules.append((neg, text, docker_pattern(pat)))
        except re.error as e:
            errs.append(f"pattern {text!r} does not compile: {e}")
    return rules, errs


def docker_excludes(rules: list[tuple[bool, str, Callable[[str], bool]]], path: str) -> tuple[bool, str | None]:
    """Whether BuildKit leaves context path `path` out (moby/patternmatcher
    MatchesOrParentMatches: the last pattern matching the path or one of its parent
    directories decides; `!` re-includes), and that pattern's text (None: none matched)."""
    parents = path.split("/")[:-1]
    excluded, last = False, None
    for neg, text, test in rules:
        if neg != excluded:
            continue
        if test(path) or any(test("/".join(parents[: i + 1])) for i in range(len(parents))):
            excluded, last = not neg, text
    return excluded, last


def gitignore_samples(entry: str, members: list[str]) -> list[str]:
    """Context paths that .gitignore `entry` ignores, standing for it: the entry with each
    wildcard made concrete, at the root, and for an entry git matches at any depth (no slash
    but a trailing one) also nested and in every workspace member; each also with a file
    inside it (the entry may name a directory)."""

    def one_char(m: re.Match) -> str:
        return "_" if m.group(1) else (m.group(2)[:1] or "_")

    concrete = re.sub(r"\[([!^]?)([^\]]*)\]", one_char, entry)
    concrete = concrete.replace("**", "d").replace("*", "x").replace("?", "x").strip("/")
    anchored = "/" in entry.rstrip("/")
    bases = [""] if anchored else ["", "a/b/", *(f"{m}/" for m in members)]
    return [p for b in bases for p in (b + concrete, b + concrete + "/x")]


def build_files(repo: Path, members: list[str]) -> list[str]:
    """The files the release build reads: the workspace's Cargo.toml and Cargo.lock, and every
    file git tracks in a member (sources, and what they include, such as gpu/kernels' PTX).
    Without git (an exported tree), each member's manifest and src/lib.rs stand for them."""
    root = ["Cargo.toml", "Cargo.lock"]
    try:
        p = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--", *members],
                           capture_output=True, check=True, timeout=60)
        tracked = [f for f in p.stdout.decode().split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        tracked = []
    return root + (tracked or [f"{m}/{f}" for m in members for f in ("Cargo.toml", "src/lib.rs")])


def context_errors(name: str, lines: list[str], members: list[str], gitignore: list[str],
                   keep: list[str] | None = None) -> list[str]:
    """Build-context exclusions (a .dockerignore's lines), tested as BuildKit applies them on
    representative paths: they keep the files the build reads (`keep`: the workspace's
    manifests and every file git tracks in a member, [`build_files`]), and exclude every .gitignore entry (local environments and test
    state: sent as context and copied by `COPY . .`, any change to them would re-run the
    release build). Equivalent spellings (`.venv*`, `**/target`, an allowlist of `*` then
    `!KEEP` lines) pass."""
    rules, errs = dockerignore_rules(lines)
    errs = [f"{name}: {e}" for e in errs]
    if keep is None:
        keep = ["Cargo.toml", "Cargo.lock", *(f"{m}/{f}" for m in members for f in ("Cargo.toml", "src/lib.rs"))]
    for path in keep:
        out, by = docker_excludes(rules, path)
        if out:
            errs.append(f"{name}: pattern {by!r} excludes {path}, which the build needs")
            break
    for g in (ln.strip() for ln in gitignore):
        if not g or g.startswith(("#", "!")):
            continue
        for path in gitignore_samples(g, members):
            out, by = docker_excludes(rules, path)
            if not out:
                how = f"re-included by {by!r}" if by else "no pattern matches it"
                errs.append(f"{name}: does not exclude {path} (.gitignore {g!r}; {how}): it would enter the build context")
                break
    return errs


# --------------------------------------------------------------------------------------------
# self-test: every check must catch its breakage


def set_toml_key(docs: list[Doc], file: str, key: str, value: str) -> None:
    for cm in find(docs, "ConfigMap"):
        if file in (cm.get("data") or {}):
            text = cm["data"][file]
            new, n = re.subn(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", text)
            cm["data"][file] = new if n else text + f"\n{key} = {value}\n"


def drop_toml_key(text: str, key: str) -> str:
    """`text` without its top-level `key`: the key's line and as many after it as its value
    spans (an array over several lines)."""
    want = {k: v for k, v in tomllib.loads(text).items() if k != key}
    lines = text.splitlines(keepends=True)
    i = next(n for n, line in enumerate(lines) if re.match(rf"{key}\s*=", line))
    for j in range(i + 1, len(lines) + 1):
        rest = "".join(lines[:i] + lines[j:])
        try:
            if tomllib.loads(rest) == want:
                return rest
        except tomllib.TOMLDecodeError:
            continue
    raise AssertionError(f"cannot drop {key} from {text!r}")


def move_toml_key_to_env(docs: list[Doc], file: str, key: str, c: Doc) -> None:
    """Drops `key` from ConfigMap key `file` and gives container c its value instead, as the
    literal env SHARDWIRE_<KEY> (a JSON array, as docs/CONFIGURATION.md writes one)."""
    value = None
    for cm in find(docs, "ConfigMap"):
        text = (cm.get("data") or {}).get(file)
        if text is not None and key in tomllib.loads(text):
            value = tomllib.loads(text)[key]
            cm["data"][file] = drop_toml_key(text, key)
    assert value is not None, f"no ConfigMap gives {key} in {file}"
    c.setdefault("env", []).append({"name": f"SHARDWIRE_{key.upper()}", "value": json.dumps(value)})


def node_container(docs: list[Doc]) -> Doc:
    return container_by_subcommand(one(docs, "DaemonSet", "shardwire-node"), "serve")


def source_container(docs: list[Doc]) -> Doc:
    return container_by_subcommand(source_workload(docs), "source")


def add_env_config_map(docs: list[Doc], data: dict[str, str]) -> None:
    """Renders ConfigMap shardwire-env (in the node's namespace) holding `data`."""
    ns = one(docs, "DaemonSet", "shardwire-node")["metadata"].get("namespace")
    docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "shardwire-env", "namespace": ns}, "data": data})


def mutations() -> list[tuple[str, Callable[[list[Doc]], None]]]:
    def ready_path(d):
        node_container(d)["readinessProbe"]["httpGet"]["path"] = "/ready"

    def live_port(d):
        node_container(d)["livenessProbe"]["httpGet"]["port"] = 7499

    def admin_loopback(d):
        set_toml_key(d, "serve.toml", "admin", '"127.0.0.1:7400"')

    def admin_port(d):
        set_toml_key(d, "serve.toml", "admin", '"0.0.0.0:7402"')

    def env_override(d):
        node_container(d).setdefault("env", []).append({"name": "SHARDWIRE_ADMIN", "value": "0.0.0.0:9999"})

    def unknown_key(d):
        set_toml_key(d, "serve.toml", "flowz", "3")

    def unknown_source_key(d):
        set_toml_key(d, "source.toml", "listen_addr", '"0.0.0.0:7500"')

    def bad_port_type(d):
        node_container(d)["ports"][0]["containerPort"] = "7400"

    def unknown_field(d):
        pod_spec(one(d, "DaemonSet", "shardwire-node"))["hostNetwrk"] = True

    def socket_dir(d):
        set_toml_key(d, "serve.toml", "socket", '"/var/run/other/trainer.sock"')

    def trainer_env(d):
        c = container_by_subcommand(one(d, "Job", "shardwire-trainer-example"), "consume")
        for e in c["env"]:
            if e["name"] == "SHARDWIRE_SOCKET":
                e["value"] = "/tmp/trainer.sock"

    def replicas(d):
        one(d, "StatefulSet", "shardwire-source")["spec"]["replicas"] = 3

    def memory(d):
        node_container(d)["resources"]["limits"]["memory"] = "64Mi"

    def secret_key(d):
        s = one(d, "Secret", "shardwire-secret")
        for f in ("data", "stringData"):
            (s.get(f) or {}).pop("shared-secret", None)

    def token_key(d):
        s = one(d, "Secret", "shardwire-secret")
        for f in ("data", "stringData"):
            (s.get(f) or {}).pop("admin-token", None)
        for v in pod_spec(one(d, "DaemonSet", "shardwire-node"))["volumes"]:
            if "secret" in v:
                v["secret"]["items"] = [i for i in v["secret"].get("items", []) if i["key"] != "admin-token"]

    def trainer_group(d):
        j = one(d, "Job", "shardwire-trainer-example")
        pod_spec(j)["securityContext"]["runAsGroup"] = 20000

    def svc_selector(d):
        one(d, "Service", "shardwire-node-metrics")["spec"]["selector"] = {"app.kubernetes.io/component": "nothing"}

    def grace(d):
        pod_spec(one(d, "DaemonSet", "shardwire-node"))["terminationGracePeriodSeconds"] = 10

    def numeric_target(d):
        one(d, "Service", "shardwire-node-metrics")["spec"]["ports"][0]["targetPort"] = 9999

    def no_startup(d):
        node_container(d).pop("startupProbe", None)

    def short_startup(d):
        node_container(d)["startupProbe"].update(periodSeconds=5, failureThreshold=3)

    def devmem_host(d):
        set_toml_key(d, "serve.toml", "receive", '"devmem"')
        set_toml_key(d, "serve.toml", "memory", '"host"')

    def devmem_auto_no_gpu(d):
        set_toml_key(d, "serve.toml", "receive", '"devmem"')
        set_toml_key(d, "serve.toml", "memory", '"auto"')

    def env_from_rendered(d):
        add_env_config_map(d, {"RUST_LOG": "info", "SHARDWIRE_ADMIN": "0.0.0.0:9999"})
        node_container(d)["envFrom"] = [{"configMapRef": {"name": "shardwire-env"}}]

    def env_from_prefixed(d):
        node_container(d)["envFrom"] = [{"prefix": "SHARDWIRE_", "configMapRef": {"name": "shardwire-env"}}]

    def socket_mode(d):
        set_toml_key(d, "serve.toml", "socket_mode", '"0600"')

    def allowed_uids(d):
        set_toml_key(d, "serve.toml", "allowed_uids", "[0]")

    def no_sources(d):
        for cm in find(d, "ConfigMap"):
            if "sources" in tomllib.loads((cm.get("data") or {}).get("serve.toml", "")):
                cm["data"]["serve.toml"] = drop_toml_key(cm["data"]["serve.toml"], "sources")

    return [
        ("grace period shorter than preStop + drain", grace),
        ("readiness path /ready", ready_path),
        ("liveness port 7499", live_port),
        ("admin on loopback", admin_loopback),
        ("admin port 7402", admin_port),
        ("SHARDWIRE_ADMIN env override", env_override),
        ("unknown serve.toml key", unknown_key),
        ("unknown source.toml key", unknown_source_key),
        ("containerPort as a string", bad_port_type),
        ("unknown pod spec field", unknown_field),
        ("socket outside the hostPath", socket_dir),
        ("trainer SHARDWIRE_SOCKET mismatch", trainer_env),
        ("3 source replicas vs 2 sources", replicas),
        ("memory limit below pool_size", memory),
        ("Secret without shared-secret", secret_key),
        ("admin token file not in the Secret", token_key),
        ("trainer group cannot open the socket", trainer_group),
        ("metrics Service selects nothing", svc_selector),
        ("numeric targetPort no container declares", numeric_target),
        ("node without a startup probe", no_startup),
        ("startup probe of 15 s", short_startup),
        ("receive = devmem with host memory and no /dev/udmabuf", devmem_host),
        ("receive = devmem with memory = auto in a pod without GPUs", devmem_auto_no_gpu),
        ("envFrom of a rendered ConfigMap with a SHARDWIRE_* key", env_from_rendered),
        ("envFrom of an unrendered ConfigMap with prefix SHARDWIRE_", env_from_prefixed),
        ("socket_mode 0600 shuts the trainer's group out", socket_mode),
        ("allowed_uids without the trainer's uid", allowed_uids),
        ("serve.toml without `sources`, and no SHARDWIRE_SOURCES", no_sources),
    ]


def overlay_mutations() -> list[tuple[str, str, Callable[[list[Doc]], None]]]:
    """Breakages of one named overlay (what base does not have): (overlay, label, mutate)."""

    def source_admin_port(d):
        set_toml_key(d, "source.toml", "admin", '"0.0.0.0:7591"')

    def source_admin_unset(d):
        for cm in find(d, "ConfigMap"):
            if "source.toml" in (cm.get("data") or {}):
                cm["data"]["source.toml"] = re.sub(r"(?m)^admin\s*=.*$", "", cm["data"]["source.toml"])

    def source_admin_loopback(d):
        set_toml_key(d, "source.toml", "admin", '"127.0.0.1:7590"')

    def devmem_host_gpu(d):
        set_toml_key(d, "serve.toml", "receive", '"devmem"')
        set_toml_key(d, "serve.toml", "memory", '"host"')

    def hpa_replicas(d):
        one(d, "Deployment", "shardwire-source")["spec"]["replicas"] = 3

    def cache_no_ephemeral_request(d):
        for k in ("requests", "limits"):
            source_container(d)["resources"][k].pop("ephemeral-storage", None)

    def cache_small_ephemeral_request(d):
        source_container(d)["resources"]["requests"]["ephemeral-storage"] = "100Gi"

    def cache_over_size_limit(d):
        set_toml_key(d, "source.toml", "cache_size", '"220GiB"')
        source_container(d)["resources"]["requests"]["ephemeral-storage"] = "220Gi"

    return [
        ("object-storage", "source admin on another port than the scraped `admin`", source_admin_port),
        ("object-storage", "source without admin while its port `admin` is scraped", source_admin_unset),
        ("object-storage", "source admin on loopback while its port `admin` is scraped", source_admin_loopback),
        ("gpu", "receive = devmem with host memory in a GPU pod without /dev/udmabuf", devmem_host_gpu),
        ("elastic", "replicas set on the source Deployment an HPA scales", hpa_replicas),
        ("elastic", "emptyDir cache with no ephemeral-storage request", cache_no_ephemeral_request),
        ("elastic", "emptyDir cache larger than the ephemeral-storage request", cache_small_ephemeral_request),
        ("elastic", "emptyDir cache larger than the emptyDir's sizeLimit and the container's limit", cache_over_size_limit),
    ]


def acceptances() -> list[tuple[str | None, str, Callable[[list[Doc]], None], str | None]]:
    """Valid changes the checks must accept (their leniencies): (overlay, None for the first;
    label; mutate; a warning it must give, None: it must give none)."""

    def source_admin_loopback_unscraped(d):
        set_toml_key(d, "source.toml", "admin", '"127.0.0.1:7590"')

    def source_admin_undeclared(d):
        set_toml_key(d, "source.toml", "admin", '"0.0.0.0:7591"')

    def devmem_auto_gpu(d):
        set_toml_key(d, "serve.toml", "receive", '"devmem"')
        set_toml_key(d, "serve.toml", "memory", '"auto"')

    def env_from_unrendered_secret(d):
        source_container(d)["envFrom"] = [{"secretRef": {"name": "minio-creds"}}]

    def env_from_prefix(d):
        node_container(d)["envFrom"] = [{"prefix": "AWS_", "secretRef": {"name": "minio-creds"}}]

    def env_from_rendered_clean(d):
        add_env_config_map(d, {"RUST_LOG": "info", "AWS_REGION": "us-east-1"})
        node_container(d)["envFrom"] = [{"configMapRef": {"name": "shardwire-env"}}]

    def sources_by_env(d):
        move_toml_key_to_env(d, "serve.toml", "sources", node_container(d))

    def datasets_by_env(d):
        move_toml_key_to_env(d, "source.toml", "datasets", source_container(d))

    def sources_empty_in_file_given_by_env(d):
        move_toml_key_to_env(d, "serve.toml", "sources", node_container(d))
        for cm in find(d, "ConfigMap"):
            data = cm.get("data") or {}
            if "serve.toml" in data:
                data["serve.toml"] = "sources = []\n" + data["serve.toml"]

    return [
        (None, "source admin on loopback, no port `admin` declared or scraped", source_admin_loopback_unscraped, None),
        (None, "source admin on a port nothing declares or scrapes", source_admin_undeclared, None),
        ("gpu", "receive = devmem with memory = auto in a GPU pod", devmem_auto_gpu, "falls back to host memory"),
        ("object-storage", "envFrom of an unrendered Secret (AWS_* credentials) on the source",
         env_from_unrendered_secret, "Secret minio-creds is not rendered"),
        (None, "envFrom with prefix AWS_ of an unrendered Secret", env_from_prefix, None),
        (None, "envFrom of a rendered ConfigMap without SHARDWIRE_* keys", env_from_rendered_clean, None),
        # `config check` judges the file alone: a pod that gives a start's required key only
        # by its env starts, so it passes (it failed when `config check` stopped merging env).
        (None, "`sources` only in a SHARDWIRE_SOURCES env override", sources_by_env, None),
        (None, "`datasets` only in a SHARDWIRE_DATASETS env override", datasets_by_env, None),
        (None, "`sources = []` in the file, a SHARDWIRE_SOURCES env override over it",
         sources_empty_in_file_given_by_env, None),
    ]


def drop_line(text: str, line: str) -> str:
    return re.sub(rf"(?m)^{re.escape(line)}\n", "", text)


def dockerfile_mutations() -> list[tuple[str, Callable[[str, str, list[str]], tuple[str, str]]]]:
    """Breakages of (Dockerfile, its .dockerignore) text, given the workspace members."""

    def no_ca(df, ign, members):
        return re.sub(r"--no-install-recommends ca-certificates", "--no-install-recommends procps", df), ign

    def venv_streaming(df, ign, members):
        return df, drop_line(ign, ".venv-streaming")

    def reinclude(df, ign, members):
        return df, ign + "!.venv-streaming\n"

    def allowlist_pycache(df, ign, members):
        return df, drop_line(allowlist(members), "**/__pycache__")

    def member_sources(df, ign, members):
        return df, ign + "**/src\n"

    def allowlist_sources_only(df, ign, members):
        # Manifests and src/ back in, but not gpu/kernels/*.ptx, which gpu/src/kernels.rs
        # includes: the release build fails.
        keep = "".join(f"!{m}/Cargo.toml\n!{m}/src\n" for m in members)
        return df, f"*\n!Cargo.toml\n!Cargo.lock\n{keep}"

    return [
        ("runtime stage without ca-certificates", no_ca),
        ("context exclusions without a git-ignored folder", venv_streaming),
        ("a git-ignored folder re-included by a later `!`", reinclude),
        ("an allowlist whose `!MEMBER/**` re-includes __pycache__", allowlist_pycache),
        ("an exclusion of the members' sources", member_sources),
        ("an allowlist of the members' manifests and src/ only (no PTX)", allowlist_sources_only),
    ]


def allowlist(members: list[str]) -> str:
    """A .dockerignore in allowlist style: everything out, the workspace back in, then what git
    ignores inside the workspace out again."""
    keep = "".join(f"!{m}/**\n" for m in members)
    return f"*\n!Cargo.toml\n!Cargo.lock\n{keep}**/__pycache__\n**/*.pyc\n**/*.egg-info\nclient/python/build\n"


def dockerfile_acceptances() -> list[tuple[str, Callable[[str, str, list[str]], tuple[str, str]]]]:
    """Equivalent .dockerignore spellings the context check must accept."""

    def venv_glob(df, ign, members):
        return df, drop_line(drop_line(ign, ".venv"), ".venv-streaming") + ".venv*\n"

    def any_depth_target(df, ign, members):
        return df, re.sub(r"(?m)^target$", "**/target", ign)

    def negation_first(df, ign, members):
        return df, "!.venv-streaming\n" + ign

    def allowlisted(df, ign, members):
        return df, allowlist(members)

    return [
        ("`.venv*` for .venv and .venv-streaming", venv_glob),
        ("`**/target` for /target", any_depth_target),
        ("a `!` before the pattern it would undo", negation_first),
        ("an allowlist: `*`, then `!Cargo.toml`, `!MEMBER/**`, ...", allowlisted),
    ]


def self_test(rendered: list[tuple[str, list[Doc]]], schemas: Schemas, sw: Shardwire, res: Results, repo: Path) -> None:
    """Each known breakage must make a check fail that passed before; each valid change in
    acceptances() must make none fail (and give its warning, or none)."""
    overlays = dict(rendered)
    base_name = rendered[0][0]
    plan = [(base_name, label, fn, None) for label, fn in mutations()] + \
        [(name, label, fn, None) for name, label, fn in overlay_mutations()] + \
        [(name or base_name, label, fn, ("accept", warn)) for name, label, fn, warn in acceptances()]
    baselines: dict[str, Results] = {}
    for name, label, mutate, accept in plan:
        if name not in overlays:
            res.warn("self-test", f"skipped `{label}`: overlay {name} is not rendered")
            continue
        if "env override" in label and not sw.env_layer_works:
            res.warn("self-test", f"skipped `{label}`: this shardwire build ignores SHARDWIRE_* variables "
                     "(`SHARDWIRE_FLOWS=3 shardwire config print` prints flows = 2), so a pod's env cannot change its config either")
            continue
        if name not in baselines:
            baselines[name] = Results(quiet=True)
            run_overlay(overlays[name], name, schemas, sw, baselines[name])
        broken = copy.deepcopy(overlays[name])
        mutate(broken)
        inner = Results(quiet=True)
        run_overlay(broken, name, schemas, sw, inner)
        new = [f for f in inner.failures if f not in baselines[name].failures]
        where = "" if name == base_name else f" ({name})"
        if accept is None:
            caught = new[0].split("] ", 1)[1] if new else ""
            res.check("self-test", f"catches: {label}{where}", [] if new else ["no new failure"], caught[:150])
            continue
        warned = [w for w in inner.warnings if w not in baselines[name].warnings]
        res.check("self-test", f"accepts: {label}{where}", acceptance_errors(broken == overlays[name], new, warned, accept[1]),
                  (warned[0].split("] ", 1)[1] if warned else "no warning")[:150])
    dockerfile_self_test(repo, sw, res)


def acceptance_errors(unchanged: bool, new: list[str], warned: list[str], want: str | None) -> list[str]:
    """Why an accepted change was not accepted: it changed nothing (the test would prove
    nothing), it made a check fail, or its warnings are not the one wanted (or none)."""
    if unchanged:
        return ["the change changed nothing"]
    errs = [f"new failure: {f}" for f in new]
    if want is None:
        errs += [f"unexpected warning: {w}" for w in warned]
    elif not any(want in w for w in warned):
        errs.append(f"no warning containing {want!r} (warnings: {warned})")
    return errs


def dockerfile_self_test(repo: Path, sw: Shardwire, res: Results) -> None:
    """The Dockerfile mutations must each add an error, the acceptances none."""
    df_path = repo / "deploy/Dockerfile"
    df, ign = df_path.read_text(), df_path.with_name(df_path.name + ".dockerignore").read_text()
    members = tomllib.loads((repo / "Cargo.toml").read_text())["workspace"].get("members", [])
    before, _ = check_dockerfile(df_path, repo, sw)
    cases = [(label, fn, False) for label, fn in dockerfile_mutations()] + \
        [(label, fn, True) for label, fn in dockerfile_acceptances()]
    for label, mutate, accept in cases:
        bdf, bign = mutate(df, ign, members)
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "Dockerfile"
            p.write_text(bdf)
            p.with_name("Dockerfile.dockerignore").write_text(bign)
            after, _ = check_dockerfile(p, repo, sw)
        new = [e for e in after if e not in before]
        if accept:
            errs = ["the change changed nothing"] if (bdf, bign) == (df, ign) else [f"new failure: {e}" for e in new]
            res.check("self-test", f"accepts: {label}", errs)
        else:
            res.check("self-test", f"catches: {label}", [] if new else ["no new failure"], new[0][:150] if new else "")


def run_overlay(docs: list[Doc], scope: str, schemas: Schemas, sw: Shardwire, res: Results) -> None:
    errs: list[str] = []
    for d in docs:
        errs += schemas.validate(d)
    kinds = sorted({d["kind"] for d in docs})
    res.check(scope, f"schemas (k8s {', '.join(schemas.versions)}, strict)", errs, f"{len(docs)} objects: {', '.join(kinds)}")
    res.check(scope, "object references (selectors, ports, volumes, Secret/ConfigMap keys)", check_refs(docs))
    check_node_source_trainer(docs, sw, res, scope)


#: Lanes counted for `lanes = "auto"` on GPU nodes (one per GPU; H100/H200 hosts have 8).
GPU_NODE_LANES = 8


def host_pool(eff: dict, spec: dict) -> tuple[int, str]:
    """The host memory the node's stream pools may take (bytes, and how it is made up):
    `pool_size` per lane in host memory (a lanes table: one lane per entry; "auto": one, or
    GPU_NODE_LANES on GPU nodes, where every GPU gets a lane), none with `memory = "cuda"` (the
    pools are GPU memory)."""
    pool, lanes, memory = eff["pool_size"], eff.get("lanes", "auto"), eff.get("memory", "host")
    if memory == "cuda":
        return 0, f"no host pool (memory = cuda: pool_size {pool >> 20}MiB of GPU memory per lane)"
    gpu_nodes = "nvidia.com/gpu.present" in (spec.get("nodeSelector") or {})
    n = len(lanes) if isinstance(lanes, list) else GPU_NODE_LANES if gpu_nodes else 1
    how = "table" if isinstance(lanes, list) else "auto, GPU nodes" if gpu_nodes else "auto"
    return pool * n, f"pool_size {pool >> 20}MiB x {n} lane(s) ({how})"


#: The least time a startup probe must give the node's start (NIC and GPU probes, one lane per
#: GPU, a devmem bind): the CLI itself waits 30 s for an interrupted start's blocking work.
MIN_START_S = 120


def startup_budget(probe: Doc) -> int:
    """Seconds a startup probe lets a start take before the kubelet restarts the container."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def udmabuf_grant(c: Doc) -> str | None:
    """How container c gets /dev/udmabuf, or None: a device plugin resource named *udmabuf* in
    its limits (or requests), or a privileged container (every device). A hostPath mount of the
    device alone is no grant: the container's device cgroup refuses the open."""
    if (c.get("securityContext") or {}).get("privileged"):
        return "privileged"
    res = c.get("resources") or {}
    for key in [*(res.get("limits") or {}), *(res.get("requests") or {})]:
        if "udmabuf" in key:
            return f"resource {key}"
    return None


def gpu_access(spec: Doc, c: Doc) -> str | None:
    """How the node container sees GPUs, or None: an nvidia.com/gpu (or MIG) resource, the
    NVIDIA RuntimeClass, or NVIDIA_VISIBLE_DEVICES naming devices (the NVIDIA runtime's)."""
    res = c.get("resources") or {}
    for key in [*(res.get("limits") or {}), *(res.get("requests") or {})]:
        if key == "nvidia.com/gpu" or key.startswith("nvidia.com/mig-"):
            return f"resource {key}"
    if "nvidia" in (spec.get("runtimeClassName") or "").lower():
        return f"runtimeClassName {spec['runtimeClassName']}"
    for e in c.get("env", []):
        if e["name"] == "NVIDIA_VISIBLE_DEVICES" and str(e.get("value", "")).lower() not in ("", "void", "none"):
            return f"NVIDIA_VISIBLE_DEVICES={e['value']}"
    return None


def devmem_errors(spec: Doc, c: Doc, eff: dict) -> tuple[list[str], str, list[str]]:
    """`receive = "devmem"` in the node container (pod spec `spec`): NET_ADMIN (NIC queue
    binding), and each lane's RX dma-buf: GPU memory with memory = "cuda", else a udmabuf from
    /dev/udmabuf, which the container must be granted. memory = "auto" picks CUDA where it is
    usable: in a pod that sees GPUs a missing grant is a warning (auto falls back to host memory
    where CUDA is not usable), elsewhere an error. Returns (errors, detail, warnings)."""
    receive, memory = eff.get("receive"), eff.get("memory")
    if receive != "devmem":
        return [], f"receive = {receive}: no devmem binding required", []
    errs, warns = [], []
    sc = c.get("securityContext") or {}
    caps = {x.upper().removeprefix("CAP_") for x in (sc.get("capabilities") or {}).get("add", [])}
    if not sc.get("privileged") and "NET_ADMIN" not in caps:
        errs.append("receive = devmem binds NIC queues over netdev netlink: the node container needs capability NET_ADMIN")
    grant = udmabuf_grant(c)
    gpus = gpu_access(spec, c) if memory == "auto" else None
    fix = ("set memory = \"cuda\" (GPU-direct), or grant the device: a device plugin resource named *udmabuf* "
           "in the container's limits, or privileged: true (a hostPath mount alone is refused by the device cgroup)")
    if memory != "cuda" and grant is None:
        if gpus:
            warns.append(f"receive = devmem with memory = auto: auto picks GPU memory (this pod sees GPUs: {gpus}), "
                         "but where CUDA is not usable it falls back to host memory, whose RX dma-buf is a udmabuf from "
                         f"/dev/udmabuf, which this container is not granted, and the start fails; {fix}")
        else:
            errs.append(f"receive = devmem with memory = {memory}: each lane's RX dma-buf is a udmabuf from /dev/udmabuf, "
                        "which this container is not granted (the start fails: '/dev/udmabuf: No such file or directory'"
                        f"{'; auto picks GPU memory only in a pod that sees GPUs, and this one sees none' if memory == 'auto' else ''}); "
                        f"{fix}")
    if memory == "cuda":
        via = "GPU memory (memory = cuda)"
    elif grant is not None:
        via = f"/dev/udmabuf via {grant}"
    else:
        via = f"GPU memory (memory = auto, GPUs via {gpus})"
    return errs, f"receive = devmem: NET_ADMIN, dma-buf from {via}", warns


def pod_ids(spec: Doc, ctr: Doc) -> tuple[int, int, set[int]]:
    """A container's uid, primary gid and groups (primary, supplementalGroups, fsGroup); the
    image's USER where the pod sets none."""
    psc, csc = spec.get("securityContext") or {}, ctr.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser", IMAGE_UID))
    gid = csc.get("runAsGroup", psc.get("runAsGroup", IMAGE_GID))
    extra = [psc["fsGroup"]] if "fsGroup" in psc else []
    return uid, gid, {gid, *psc.get("supplementalGroups", []), *extra}


def socket_mode_bits(mode: Any) -> int:
    """serve.toml socket_mode ("0660", "660", "0o660") as permission bits."""
    m = str(mode)
    return int(m[2:] if m[:2].lower() == "0o" else m, 8)


def socket_access(mode: int, owner: tuple[int, int], trainer: tuple[int, int, set[int]],
                  allowed: tuple[list[int], list[int]]) -> str | None:
    """Why a trainer (uid, primary gid, groups) cannot use the node's socket, or None.
    connect() needs write permission on the socket file (owner `owner`, `mode`): the owner's
    bit if the uid is the owner's, else the group's if the file's group is among its groups,
    else the others'. Then the node checks allowed_uids/allowed_gids when either is set
    (SO_PEERCRED and SO_PEERGROUPS: the uid, the primary gid or any of its groups)."""
    (ouid, ogid), (uid, gid, groups), (uids, gids) = owner, trainer, allowed
    if uid == ouid:
        bit, who = 0o200, f"its owner (uid {ouid})"
    elif ogid in groups:
        bit, who = 0o020, f"its group (gid {ogid})"
    else:
        bit, who = 0o002, "others"
    if not mode & bit:
        return (f"socket_mode {mode:04o} gives {who} no write permission on the socket (uid {ouid} gid {ogid}), "
                f"which connect() needs: the trainer runs as uid {uid} groups {sorted(groups)}")
    if (uids or gids) and uid not in uids and gid not in gids and not groups & set(gids):
        return (f"allowed_uids {uids} / allowed_gids {gids} refuse the trainer (uid {uid}, primary gid {gid}, "
                f"groups {sorted(groups)})")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="the shardwire binary")
    ap.add_argument("--repo", required=True, type=Path)
    ap.add_argument("--kube-versions", default="1.28,1.37")
    ap.add_argument("--self-test", action="store_true", help="also check that known breakages are caught")
    ap.add_argument("rendered", nargs="+", help="NAME=FILE of kustomize output")
    a = ap.parse_args()

    repo = a.repo.resolve()
    sw = Shardwire(a.bin)
    schemas = Schemas(a.kube_versions.split(","), repo / "deploy/ci/schemas")
    res = Results()
    rendered = []
    for spec in a.rendered:
        name, _, f = spec.partition("=")
        docs = load_docs(Path(f))
        rendered.append((name, docs))
        print(f"---- {name}: {len(docs)} objects")
        run_overlay(docs, name, schemas, sw, res)

    print("---- dashboard, Dockerfile")
    errs, detail, warnings = check_dashboard(repo / "deploy/grafana/shardwire-dashboard.json", [repo / "service/src", repo / "node/src"])
    for w in warnings:
        res.warn("grafana", w)
    res.check("grafana", "dashboard: datasource variable, PromQL parses, metrics exported and covered", errs, detail)
    errs, detail = check_dockerfile(repo / "deploy/Dockerfile", repo, sw)
    res.check("docker", "Dockerfile (BuildKit parser): stages, build command, non-root, entrypoint, ports, context", errs, detail)

    if a.self_test:
        print(f"---- self-test on {rendered[0][0]} (and named overlays), the Dockerfile and its context: "
              "each breakage must make a check fail that passed before, each valid change none")
        self_test(rendered, schemas, sw, res, repo)

    print(f"\n{res.passed} passed, {res.failed} failed")
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
