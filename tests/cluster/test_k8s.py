"""The Kubernetes manifests (cluster/k8s/) are valid and run the launcher's topology.

Every core manifest validates against the Kubernetes OpenAPI schemas that
kubernetes-validate ships, in strict mode (an unknown field fails). The
ServiceMonitors are a CRD (monitoring.coreos.com/v1) whose schema the validator
does not have: they are checked structurally here instead. The node DaemonSet,
the router Deployment and the etcd StatefulSet are checked against
:func:`cluster.local.topology`, as tests/cluster/test_compose.py checks
docker-compose: same commands and options, ports and environment, with the
addresses Kubernetes gives (the pod's address, the machine's name). The
optional components (rdma, monitoring, external-etcd) are applied as kustomize
would and the result validated; where ``kubectl`` is installed, ``kubectl
kustomize`` builds the base with and without them, what it builds validates,
and it agrees with that emulation. Finally the commands run: the DaemonSet's
starts a node that joins etcd (and answers its readiness probe where
``--metrics-listen`` exists), the external-etcd environment joins a node to an
etcd with TLS and client certificates, and the Deployment's starts the router
(where ``dkv router serve`` exists), with loopback in place of the pod's address.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cluster.local import METRICS_PORT, NODE_PORT_BASE, PEER_CONTROL_PORT_BASE, ROUTER_PORT, topology
from cluster.process import FdLines, stop_process
from dkv.units import parse_address, parse_size

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "cluster" / "k8s"
# the oldest Kubernetes the manifests claim, and a recent one (kubernetes-validate 1.37 ships 1.25 to 1.37)
K8S_VERSIONS = ("1.27.0", "1.33.0")
CRD_KINDS = {"ServiceMonitor"}
SECRET_EXAMPLE = "secret.example.yaml"
COMPONENTS = ("rdma", "monitoring", "external-etcd")


# ---------------------------------------------------------------- loading


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifest_files() -> list[Path]:
    """Every manifest under cluster/k8s (kustomization files and kustomize patches are not manifests)."""
    patches = {K8S / c / p["path"] for c in COMPONENTS
               for p in _load(K8S / c / "kustomization.yaml")[0].get("patches", [])}
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p not in patches)


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{path.relative_to(K8S)}#{i}", doc) for path in _manifest_files() for i, doc in enumerate(_load(path))]


def _base() -> list[dict[str, Any]]:
    """What `kubectl apply -k cluster/k8s` applies (the base's resources, without components)."""
    kustomization = _load(K8S / "kustomization.yaml")[0]
    return [doc for name in kustomization["resources"] for doc in _load(K8S / name)]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _config(docs: list[dict[str, Any]]) -> dict[str, str]:
    return _one(docs, "ConfigMap", "dkv-config")["data"]


def _resolve(container: dict[str, Any], config: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The container's command with ``$(VAR)`` expanded as the kubelet does, and its environment.

    Values from the ConfigMap are substituted; a field of the pod reads ``<fieldPath>``, a
    Secret's key ``<secret:name/key>``.
    """
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] == "dkv-config", var
            assert ref["key"] in config, f"{var['name']}: the ConfigMap has no key {ref['key']}"
            env[var["name"]] = config[ref["key"]]
        elif "secretKeyRef" in source:
            env[var["name"]] = f"<secret:{source['secretKeyRef']['name']}/{source['secretKeyRef']['key']}>"
        else:
            env[var["name"]] = f"<{source['fieldRef']['fieldPath']}>"

    def expand(arg: str) -> str:
        def one(match: re.Match[str]) -> str:
            assert match.group(1) in env, f"{arg}: $({match.group(1)}) is not in the container's environment"
            return env[match.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)

    return [expand(a) for a in [*container.get("command", []), *container.get("args", [])]], env


def _options(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``prog sub ... --flag value ...`` → (the words before the first option, {flag: value})."""
    first = next(i for i, a in enumerate(argv) if a.startswith("--"))
    pairs = argv[first:]
    assert len(pairs) % 2 == 0 and all(f.startswith("--") for f in pairs[::2]), argv
    flags = pairs[::2]
    assert len(set(flags)) == len(flags), f"an option given twice: {argv}"
    return argv[:first], dict(zip(flags, pairs[1::2]))


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``5Gi``, ``512Mi``, ``1G``) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT]|)", str(quantity))
    assert match, f"cannot read quantity {quantity!r}"
    return int(float(match.group(1)) * _QUANTITY[match.group(2)])


def _probe(container: dict[str, Any], kind: str) -> tuple[str, int]:
    get = container[kind]["httpGet"]
    port = get["port"]
    if isinstance(port, str):  # a named port
        port = next(p["containerPort"] for p in container["ports"] if p.get("name") == port)
    return get["path"], port


def _merge(base: Any, patch: Any) -> Any:
    """A strategic merge as kustomize applies it to these manifests: maps merge, lists of named
    items merge by name, any other list or value is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(i, dict) and "name" in i for i in [*base, *patch])):
        merged_list = [copy.deepcopy(i) for i in base]
        for item in patch:
            at = next((k for k, b in enumerate(merged_list) if b["name"] == item["name"]), None)
            if at is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[at] = _merge(merged_list[at], item)
        return merged_list
    return copy.deepcopy(patch)


def _by_name(value: Any) -> Any:
    """``value`` with every list of named items sorted by name (kustomize puts a patch's items first)."""
    if isinstance(value, dict):
        return {k: _by_name(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_by_name(v) for v in value]
        if items and all(isinstance(i, dict) and "name" in i for i in items):
            items.sort(key=lambda i: i["name"])
        return items
    return value


def _component_patches(*names: str) -> list[dict[str, Any]]:
    """The strategic-merge patches of the named components (all of them without names), in order."""
    return [doc for c in names or COMPONENTS for p in _load(K8S / c / "kustomization.yaml")[0].get("patches", [])
            for doc in _load(K8S / c / p["path"])]


def _validate(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


# ---------------------------------------------------------------- schemas


DOCUMENTS = _documents()


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("where", "doc"), [d for d in DOCUMENTS if d[1]["kind"] not in CRD_KINDS],
                         ids=[d[0] for d in DOCUMENTS if d[1]["kind"] not in CRD_KINDS])
def test_every_manifest_validates_against_the_kubernetes_schemas_strictly(where: str, doc: dict[str, Any],
                                                                          version: str) -> None:
    _validate(doc, version)


def test_the_validator_rejects_an_unknown_field_a_wrong_type_and_a_missing_field() -> None:
    """The check above can fail: what it accepts is what the API server accepts."""
    node = _one(_base(), "DaemonSet", "dkv-node")
    _validate(node, K8S_VERSIONS[0])
    broken = []
    unknown = copy.deepcopy(node)
    _container(unknown, "node")["shmSize"] = "5Gi"  # docker-compose's word, not Kubernetes'
    broken.append(unknown)
    wrong_type = copy.deepcopy(node)
    _container(wrong_type, "node")["ports"][0]["containerPort"] = "7420"
    broken.append(wrong_type)
    missing = copy.deepcopy(node)
    del missing["spec"]["selector"]
    broken.append(missing)
    for doc in broken:
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(doc, K8S_VERSIONS[0])


def test_the_kustomization_applies_every_manifest_and_names_its_optional_components() -> None:
    kustomization = _load(K8S / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == "dkv"
    base_files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", SECRET_EXAMPLE}
    assert set(kustomization["resources"]) == base_files
    text = (K8S / "kustomization.yaml").read_text()
    for name in COMPONENTS:
        component = _load(K8S / name / "kustomization.yaml")[0]
        assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1" and component["kind"] == "Component"
        for resource in component.get("resources", []):
            assert (K8S / name / resource).is_file(), f"{name}: {resource} is missing"
        assert f"# - {name}" in text, f"the kustomization should say how to enable {name}"
    for path, doc in DOCUMENTS:
        assert doc["metadata"].get("namespace", "dkv") == "dkv", path
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "dkv", path


def test_service_monitors_select_a_service_and_its_metrics_port() -> None:
    """ServiceMonitor is a CRD: the schema validator cannot check it, so its shape is checked here."""
    monitors = [doc for _, doc in DOCUMENTS if doc["kind"] == "ServiceMonitor"]
    services = [doc for _, doc in DOCUMENTS if doc["kind"] == "Service"]
    assert {m["metadata"]["name"] for m in monitors} == {"dkv-node", "dkv-router"}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        wanted = monitor["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if wanted.items() <= s["metadata"].get("labels", {}).items()]
        assert len(matched) == 1, f"{monitor['metadata']['name']} should select exactly one Service"
        ports = {p["name"]: p["targetPort"] for p in matched[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
            assert endpoint["path"] == "/metrics" and endpoint["port"] in ports
            assert ports[endpoint["port"]] in (METRICS_PORT, ROUTER_PORT)
        # the Service selects the pods that serve those ports
        pods = [d for d in _base() if d["kind"] in ("DaemonSet", "Deployment")
                and matched[0]["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1


# ---------------------------------------------------------------- agreement with topology()


def test_the_node_daemonset_runs_the_topology_node_command_ports_and_environment() -> None:
    docs = _base()
    config = _config(docs)
    node = _one(docs, "DaemonSet", "dkv-node")
    pod = node["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    container = _container(node, "node")
    command, env = _resolve(container, config)
    spec = topology(1, pool=config["DKV_POOL"], cluster=config["DKV_CLUSTER"])["node-0"]
    words, options = _options(command)
    topo_words, topo_options = _options(spec["command"])
    assert words == topo_words == ["dkv", "serve"]
    assert set(options) == set(topo_options)
    for flag in ("--listen", "--metrics-listen"):
        host, port = parse_address(options[flag])
        assert host == "<status.podIP>", f"{flag} should be the pod's (with hostNetwork, the machine's) address"
        assert port == parse_address(topo_options[flag])[1]
    assert options["--node-id"] == "<spec.nodeName>", "one node per machine: the machine's name is its id"
    for flag in set(topo_options) - {"--listen", "--metrics-listen", "--node-id"}:
        assert options[flag] == topo_options[flag], flag
    ports = container["ports"]
    assert [p["containerPort"] for p in ports] == spec["ports"] == [NODE_PORT_BASE, PEER_CONTROL_PORT_BASE, METRICS_PORT]
    assert all(p["hostPort"] == p["containerPort"] for p in ports), "hostNetwork: host and container ports agree"
    assert set(spec["environment"]) <= set(env)
    assert env["UCX_TLS"] == spec["environment"]["UCX_TLS"]
    assert env["DKV_TOKEN"] == "<secret:dkv-token/token>"


def test_the_router_deployment_and_service_run_the_topology_router() -> None:
    docs = _base()
    config = _config(docs)
    router = _one(docs, "Deployment", "dkv-router")
    assert router["spec"]["replicas"] == 2
    container = _container(router, "router")
    command, env = _resolve(container, config)
    spec = topology(1, cluster=config["DKV_CLUSTER"])["router"]
    words, options = _options(command)
    topo_words, topo_options = _options(spec["command"])
    assert words == topo_words == ["dkv", "router", "serve"]
    assert set(options) == set(topo_options)
    host, port = parse_address(options["--listen"])
    topo_host, topo_port = parse_address(topo_options["--listen"])
    assert host == "0.0.0.0" and port == topo_port == ROUTER_PORT
    for flag in set(topo_options) - {"--listen"}:
        assert options[flag] == topo_options[flag], flag
    assert [p["containerPort"] for p in container["ports"]] == spec["ports"]
    assert set(spec["environment"]) <= set(env) and env["DKV_TOKEN"] == "<secret:dkv-token/token>"
    # the topology's router address is the Service's name and port
    service = _one(docs, "Service", topo_host)
    assert service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(topo_port, ROUTER_PORT)]


def test_the_etcd_statefulset_serves_the_endpoint_the_nodes_and_router_use() -> None:
    docs = _base()
    config = _config(docs)
    etcd = _one(docs, "StatefulSet", "etcd")
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["serviceName"] == "etcd-peer"
    spec = topology(1)["etcd"]
    container = _container(etcd, "etcd")
    command, _ = _resolve(container, config)
    words, options = _options(command)
    topo_words, topo_options = _options(spec["command"])
    assert words == topo_words == ["etcd"]
    assert options["--listen-client-urls"] == topo_options["--listen-client-urls"]
    members = options["--initial-cluster"].split(",")
    assert [m.split("=")[0] for m in members] == [f"etcd-{i}" for i in range(3)]
    assert all(m.endswith(".etcd-peer:2380") for m in members), "members are named by the headless Service"
    assert set(spec["ports"]) <= {p["containerPort"] for p in container["ports"]}
    # http://etcd:2379, the endpoint every dKV process is given, is the client Service
    endpoint = topology(1)["node-0"]["command"]
    endpoint = endpoint[endpoint.index("--etcd") + 1]
    assert config["DKV_ETCD"] == endpoint
    host, port = parse_address(endpoint.removeprefix("http://"))
    service = _one(docs, "Service", host)
    assert service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, 2379)]
    peer = _one(docs, "Service", "etcd-peer")
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True


def test_the_nodes_memory_and_dev_shm_fit_the_pool() -> None:
    docs = _base()
    pool = parse_size(_config(docs)["DKV_POOL"])
    node = _one(docs, "DaemonSet", "dkv-node")
    pod = node["spec"]["template"]["spec"]
    container = _container(node, "node")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    assert _bytes(volume["emptyDir"]["sizeLimit"]) > pool
    # the pool is counted against the container's memory: pool + the freed memory it may keep
    # mapped (1/8, at most 1GiB: dkv.arena) + the process
    from dkv.arena import MAX_TRIM_SLACK, TRIM_SLACK

    needed = pool + min(int(pool * TRIM_SLACK), MAX_TRIM_SLACK) + 512 * 2**20
    resources = container["resources"]
    assert _bytes(resources["limits"]["memory"]) >= needed
    assert _bytes(resources["requests"]["memory"]) >= needed, "request what the pool needs: no overcommit"


def test_probes_and_scrape_annotations_point_at_the_health_and_metrics_endpoints() -> None:
    docs = _base()
    for kind, name, container_name, port in (("DaemonSet", "dkv-node", "node", METRICS_PORT),
                                             ("Deployment", "dkv-router", "router", ROUTER_PORT)):
        workload = _one(docs, kind, name)
        container = _container(workload, container_name)
        assert _probe(container, "readinessProbe") == ("/readyz", port), name
        assert _probe(container, "livenessProbe") == ("/healthz", port), name
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}, name
    etcd = _container(_one(docs, "StatefulSet", "etcd"), "etcd")
    assert _probe(etcd, "readinessProbe") == ("/health", 2379)


def test_every_pod_reads_the_token_from_the_key_the_example_secret_defines_and_no_token_is_committed() -> None:
    example = _load(K8S / SECRET_EXAMPLE)
    assert len(example) == 1 and example[0]["kind"] == "Secret"
    secret = example[0]
    assert secret["stringData"] == {"token": ""}, "commit no token: create the Secret with kubectl"
    refs = []
    for _, doc in DOCUMENTS:
        if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                for var in container.get("env", []):
                    if "secretKeyRef" in var.get("valueFrom", {}):
                        refs.append((doc["metadata"]["name"], var["name"], var["valueFrom"]["secretKeyRef"]))
    assert {(workload, var) for workload, var, _ in refs} == {("dkv-node", "DKV_TOKEN"), ("dkv-router", "DKV_TOKEN")}
    for _, _, ref in refs:
        assert ref == {"name": secret["metadata"]["name"], "key": "token"}
    for path in K8S.rglob("*.yaml"):
        assert not re.search(r"\b[0-9a-f]{32,}\b", path.read_text()), f"{path.name} looks like it holds a secret"


def test_the_rdma_component_patches_the_node_into_a_valid_rdma_daemonset() -> None:
    node = _one(_base(), "DaemonSet", "dkv-node")
    patch = _load(K8S / "rdma" / "node-rdma.yaml")[0]
    patched = _merge(node, patch)
    for version in K8S_VERSIONS:
        _validate(patched, version)
    container = _container(patched, "node")
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["UCX_TLS"].split(",")[0] == "rc" and env["UCX_NET_DEVICES"]
    assert env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert any(k.startswith("rdma/") for k in container["resources"]["limits"])
    # everything else of the node stays: command, token, probes, memory
    assert container["command"] == _container(node, "node")["command"]
    assert env["DKV_TOKEN"] is None and container["resources"]["limits"]["memory"] == "6Gi"
    assert patched["spec"]["template"]["spec"]["volumes"] == node["spec"]["template"]["spec"]["volumes"]


def _etcd_env_variables() -> set[str]:
    """The environment forms of the etcd options every dKV command takes (--etcd-ca ...)."""
    import typing

    from dkv.cli import ETCD_OPTIONS

    return {typing.get_args(annotation)[1].envvar for annotation in ETCD_OPTIONS.values()}


def _external_etcd(workload: dict[str, Any]) -> dict[str, Any]:
    for patch in _component_patches("external-etcd"):
        if (patch["kind"], patch["metadata"]["name"]) == (workload["kind"], workload["metadata"]["name"]):
            workload = _merge(workload, patch)
    return workload


def test_the_external_etcd_component_removes_the_members_and_gives_every_client_the_tls_files() -> None:
    deleted = {(d["kind"], d["metadata"]["name"]) for d in _component_patches("external-etcd")
               if d.get("$patch") == "delete"}
    assert deleted == {(d["kind"], d["metadata"]["name"]) for d in _load(K8S / "etcd.yaml")}
    config = _external_etcd(_one(_base(), "ConfigMap", "dkv-config"))["data"]
    assert all(url.startswith("https://") for url in config["DKV_ETCD"].split(","))
    for kind, name, container_name in (("DaemonSet", "dkv-node", "node"), ("Deployment", "dkv-router", "router")):
        workload = _external_etcd(_one(_base(), kind, name))
        for version in K8S_VERSIONS:
            _validate(workload, version)
        container = _container(workload, container_name)
        pod = workload["spec"]["template"]["spec"]
        env = {v["name"]: v.get("value") for v in container["env"]}
        tls = {k: v for k, v in env.items() if k.startswith("DKV_ETCD_")}
        assert set(tls) == {"DKV_ETCD_CA", "DKV_ETCD_CERT", "DKV_ETCD_KEY"} and set(tls) <= _etcd_env_variables()
        mount = next(m for m in container["volumeMounts"] if m["name"] == "etcd-tls")
        volume = next(v for v in pod["volumes"] if v["name"] == "etcd-tls")
        assert volume["secret"]["secretName"] == "dkv-etcd-tls"
        assert {str(Path(f).parent) for f in tls.values()} == {mount["mountPath"]}
        assert {Path(f).name for f in tls.values()} == {"ca.crt", "tls.crt", "tls.key"}  # the Secret's keys
        user = container.get("securityContext", {}).get("runAsUser")
        if user is not None:  # a non-root client must be able to read the Secret's files
            assert pod["securityContext"]["fsGroup"] == user and volume["secret"]["defaultMode"] & 0o040


async def test_a_node_given_the_external_etcd_components_tls_environment_joins_a_tls_etcd(tmp_path: Path) -> None:
    """The node's command and environment as the external-etcd component makes them (the Secret's files
    where the pod would see them, an etcd with TLS and client certificates) join that etcd."""
    from cluster.etcd_process import make_certificates, start_etcd
    from cluster.local import local_command
    from cluster.process import start_node

    certs = make_certificates(tmp_path / "pki")
    secret = tmp_path / "secret"  # what Secret dkv-etcd-tls holds, under its keys
    secret.mkdir()
    for key, source in (("ca.crt", certs.ca), ("tls.crt", certs.client_cert), ("tls.key", certs.client_key)):
        (secret / key).write_bytes(source.read_bytes())
        (secret / key).chmod(0o400)
    node = _external_etcd(_one(_base(), "DaemonSet", "dkv-node"))
    container = _container(node, "node")
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "etcd-tls")
    config = _external_etcd(_one(_base(), "ConfigMap", "dkv-config"))["data"]
    command, env = _resolve(container, config)
    command = [a.replace("<status.podIP>", "127.0.0.1").replace("<spec.nodeName>", "tls-machine") for a in command]
    env = {k: v.replace(mount, str(secret)) for k, v in env.items() if not v.startswith("<")}
    env["DKV_TOKEN"] = os.urandom(24).hex()
    etcd = start_etcd(certificates=certs)
    started = None
    try:
        local = local_command(command, etcd.url)
        _, options = _options(local[3:])
        extra = [a for flag, value in options.items() if flag not in ("--listen", "--pool") for a in (flag, value)]
        started = start_node(*extra, "--etcd-ttl", "2", pool="64MiB", listen=options["--listen"],
                             workdir=tmp_path / "node", env=env, exit_with_parent=True)
        peers = [sys.executable, "-m", "dkv.cli", "peers", *etcd.settings().cli_args(), "--cluster",
                 options["--cluster"], "--json"]
        deadline = time.monotonic() + 30
        while True:
            result = subprocess.run(peers, capture_output=True, text=True, timeout=60)
            if result.returncode == 0 and "tls-machine" in {m["node_id"] for m in json.loads(result.stdout)}:
                break
            assert time.monotonic() < deadline, f"not registered: {result.stderr[-500:]}\n{started.log_tail()}"
            await asyncio.sleep(0.2)
    finally:
        if started is not None:
            assert started.stop() == 0, started.log_tail()
        etcd.stop()


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_kustomize_builds_the_base_and_every_component_into_valid_manifests(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the kustomizations were checked structurally above")
    base = _kustomize(K8S)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in base) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in _base())
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    to_k8s = os.path.relpath(K8S, overlay)  # kustomize refuses absolute paths
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [to_k8s], "components": [f"{to_k8s}/{c}" for c in COMPONENTS]}))
    everything = _kustomize(overlay)
    etcd_objects = {(d["kind"], d["metadata"]["name"]) for d in _load(K8S / "etcd.yaml")}
    assert {(d["kind"], d["metadata"]["name"]) for d in everything} == (
        {(d["kind"], d["metadata"]["name"]) for d in base} - etcd_objects
        | {("Service", "dkv-node-metrics"), ("ServiceMonitor", "dkv-node"), ("ServiceMonitor", "dkv-router")})
    for doc in everything:
        if doc["kind"] not in CRD_KINDS:
            _validate(doc, K8S_VERSIONS[-1])
    node = _container(_one(everything, "DaemonSet", "dkv-node"), "node")
    assert "IPC_LOCK" in node["securityContext"]["capabilities"]["add"]
    # the Python merge the tests above use agrees with kustomize's (up to the order of named items)
    for kind, name in (("DaemonSet", "dkv-node"), ("Deployment", "dkv-router"), ("ConfigMap", "dkv-config")):
        merged = _one(base, kind, name)
        for patch in _component_patches():
            if (patch["kind"], patch["metadata"]["name"]) == (kind, name):
                merged = _merge(merged, patch)
        assert _by_name(_one(everything, kind, name)) == _by_name(merged), name


# ---------------------------------------------------------------- the manifests' commands run


def _has_option(*words: str, option: str) -> bool:
    """Whether this checkout's ``dkv <words>`` has ``option`` (the router service and the nodes'
    metrics endpoint are built beside these manifests)."""
    result = subprocess.run([sys.executable, "-m", "dkv.cli", *words, "--help"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "COLUMNS": "200"})
    return result.returncode == 0 and option in result.stdout


def _pod_command(kind: str, name: str, container_name: str, fields: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A workload's command and environment as its pod would run them, with ``fields`` for the
    pod's downward-API fields and a generated token for the Secret."""
    docs = _base()
    command, env = _resolve(_container(_one(docs, kind, name), container_name), _config(docs))
    token = os.urandom(24).hex()
    resolved = []
    for arg in command:
        for field, value in fields.items():
            arg = arg.replace(f"<{field}>", value)
        resolved.append(arg)
    env = {k: token if v.startswith("<secret:") else v for k, v in env.items() if not v.startswith("<")
           or v.startswith("<secret:")}
    return resolved, env


async def _peers(etcd: Any, cluster: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "dkv.cli", "peers", *etcd.cli_args(), "--cluster", cluster,
                             "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return {m["node_id"]: m for m in json.loads(result.stdout)}


async def test_the_node_daemonsets_command_starts_a_node_that_joins_the_cluster(etcd: Any, tmp_path: Path) -> None:
    """The DaemonSet's command, with the pod's address and machine name filled in as the kubelet
    would (loopback here) and the test's etcd, starts a node that registers under the machine's name;
    where ``--metrics-listen`` exists, its /readyz (the readiness probe) answers 200."""
    from cluster.local import local_command
    from cluster.process import start_node

    command, env = _pod_command("DaemonSet", "dkv-node", "node",
                                {"status.podIP": "127.0.0.1", "spec.nodeName": "k8s-machine-1"})
    metrics = _has_option("serve", option="--metrics-listen")
    local = local_command(command, etcd.url, metrics_listen="127.0.0.1:0" if metrics else None)
    _, options = _options(local[3:])
    cluster = options["--cluster"]
    extra = [a for flag, value in options.items() if flag not in ("--listen", "--pool") for a in (flag, value)]
    node = start_node(*extra, "--etcd-prefix", etcd.prefix, "--etcd-ttl", "2", pool="64MiB",
                      listen=options["--listen"], workdir=tmp_path / "node", env=env, exit_with_parent=True)
    try:
        assert node.ready["node_id"] == "k8s-machine-1"
        deadline = time.monotonic() + 30
        while "k8s-machine-1" not in await _peers(etcd, cluster):
            assert time.monotonic() < deadline, f"not registered in etcd:\n{node.log_tail()}"
            await asyncio.sleep(0.2)
        if metrics:
            import httpx

            address = str(node.ready["metrics_address"])
            async with httpx.AsyncClient(timeout=5) as http:
                while (await http.get(f"http://{address}/readyz")).status_code != 200:
                    assert time.monotonic() < deadline, "the readiness probe's /readyz never answered 200"
                    await asyncio.sleep(0.2)
                assert (await http.get(f"http://{address}/healthz")).status_code == 200
        else:
            print("dkv serve has no --metrics-listen on this checkout: the probes' endpoint was not exercised")
    finally:
        assert node.stop() == 0, node.log_tail()


async def test_the_router_deployments_command_serves_routes_once_ready(etcd: Any, tmp_path: Path) -> None:
    """The Deployment's command, with loopback for its address and the test's etcd, starts the router
    service; its readiness probe's /readyz answers 200 and /v1/route wants the token."""
    if not _has_option("router", "serve", option="--listen"):
        pytest.skip("`dkv router serve` is not on this checkout yet: its command was checked against topology() only")
    import httpx

    from cluster.local import local_command

    command, env = _pod_command("Deployment", "dkv-router", "router", {})
    local = local_command(command, etcd.url, listen="127.0.0.1:0")
    proc = subprocess.Popen([*local, "--etcd-prefix", etcd.prefix], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, **env})
    try:
        address = None
        deadline = time.monotonic() + 30
        assert proc.stdout is not None
        lines = FdLines(proc.stdout.fileno())  # (not select + readline: a line read ahead would be missed)
        seen: list[str] = []
        while address is None:
            raw = lines.next(max(0.0, deadline - time.monotonic()))
            assert raw, f"the router did not print its ready line; it printed: {seen}"
            line = raw.decode(errors="replace").strip()
            seen.append(line)
            if line.startswith("{"):
                address = json.loads(line)["address"]
        async with httpx.AsyncClient(timeout=5) as http:
            while (await http.get(f"http://{address}/readyz")).status_code != 200:
                assert time.monotonic() < deadline, "the readiness probe's /readyz never answered 200"
                await asyncio.sleep(0.2)
            assert (await http.get(f"http://{address}/healthz")).status_code == 200
            route = {"namespace": "ns", "hashes": ["00" * 32]}
            assert (await http.post(f"http://{address}/v1/route", json=route)).status_code == 401
            authorized = await http.post(f"http://{address}/v1/route", json=route,
                                         headers={"Authorization": f"Bearer {env['DKV_TOKEN']}"})
            assert authorized.status_code == 200 and authorized.json()["peer"] is None
    finally:
        stop_process(proc, 15)
        if proc.stdout is not None:
            proc.stdout.close()
