"""The deployment files of infra/ (KubeRay, Strimzi, the controller Job, the one-host compose
file, Prometheus and Grafana): each parses, matches a schema, and agrees with the project's
own code: the topology spec, the controller's topic rules, the CLI, and the metric names the
workers and the controller export.

Schemas: tests/infra/schemas/*.schema.json, written for the fields we rely on. Stronger
validators too: kubernetes-validate (the Kubernetes API's own JSON Schemas, for core objects
and the pod templates inside the RayCluster) and check-jsonschema's vendored Compose
Specification schema (both dev extras), and `promtool check config` (CI unpacks Debian's
prometheus package for it; elsewhere it is skipped without promtool).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from infra_helpers import (
    COMMON_LABELS,
    COMPOSE_DIR,
    GRAFANA,
    K8S,
    MODERATION,
    MONITORING,
    RAY_BUILTIN_GPU_METRICS,
    dashboard_queries,
    env_map,
    exported_metrics,
    k8s_docs,
    load_docs,
    only,
    published_ports,
    read_promql,
    schema,
    schema_errors,
    yaml_files,
)

from dgstream.topology.spec import Topology, load_topology, parse_topology

pytestmark = pytest.mark.unit

COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
COMPOSE_TOPOLOGY = COMPOSE_DIR / "topology.yaml"
PROMETHEUS_YML = MONITORING / "prometheus.yml"
DASHBOARD = GRAFANA / "dgstream-dashboard.json"
PROVISIONING = GRAFANA / "provisioning"
IMAGE = "ghcr.io/example/dgstream:0.1.0"

# (apiVersion, kind) -> schema file; every Kubernetes document must have one.
K8S_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "raycluster",
    ("kafka.strimzi.io/v1beta2", "KafkaTopic"): "kafkatopic",
    ("batch/v1", "Job"): "job",
    ("v1", "ConfigMap"): "configmap",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaim",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor",
}
# Core kinds that kubernetes-validate knows.
CORE_KINDS = {"Job", "ConfigMap", "PersistentVolumeClaim"}


# --------------------------------------------------------------------------- helpers


def raycluster() -> dict[str, Any]:
    (rc,) = only("RayCluster")
    return rc


def controller_job() -> dict[str, Any]:
    (job,) = only("Job")
    return job


def topology_configmap() -> dict[str, Any]:
    (cm,) = load_docs(K8S / "topology-configmap.yaml")
    return cm


def k8s_topology() -> Topology:
    return parse_topology(yaml.safe_load(topology_configmap()["data"]["topology.yaml"]))


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return list(template["spec"]["containers"])


def ray_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, container, pod spec) of every Ray container of the RayCluster."""
    spec = raycluster()["spec"]
    out = [
        ("head", c, spec["headGroupSpec"]["template"]["spec"])
        for c in containers(spec["headGroupSpec"]["template"])
    ]
    for g in spec["workerGroupSpecs"]:
        out += [(g["groupName"], c, g["template"]["spec"]) for c in containers(g["template"])]
    return out


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_ref(entry: dict[str, Any] | None) -> tuple[str, str] | None:
    if not entry or "valueFrom" not in entry:
        return None
    ref = entry["valueFrom"].get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


def mounted_volume(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The pod volume mounted at `path` in the container (fails if none)."""
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    assert path in mounts, f"{container['name']}: nothing mounted at {path}"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    name = mounts[path]["name"]
    assert name in volumes, f"{container['name']}: volume {name} is not defined"
    return dict(volumes[name])


def expected_topics(topo: Topology, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int]]:
    """topic -> (partitions, replication factor), as the controller creates them: each
    pipeline's `PipelineRunner._setup` (step 0 of its tick) runs with Kafka's admin call
    replaced by a recorder, with no admin client and no actors to adopt. If the controller's
    topic creation moves, move this hook with it (do not copy the rule here)."""
    import dgstream.workers.kafka.admin
    from dgstream.topology.controller import PipelineRunner

    made: dict[str, tuple[int, int]] = {}

    def record(
        target: Any,
        topics: Mapping[str, int] | Iterable[str],
        *,
        partitions: int = 1,
        replication_factor: int = -1,
        **_: Any,
    ) -> dict[str, int]:
        pairs = topics.items() if isinstance(topics, Mapping) else [(t, partitions) for t in topics]
        for name, n in pairs:
            made[name] = (n, replication_factor)
        return {}

    monkeypatch.setattr(dgstream.workers.kafka.admin, "ensure_topics", record)
    for spec in topo.pipelines:
        runner = PipelineRunner(topo, spec, topo.kafka, "infra-test")
        runner._admin = object()  # never connects: the recorder ignores it
        runner._adopted = True  # no Ray actors to look for
        runner._setup()
        assert runner.topics_ready, runner.setup_error
    return made


def compose() -> dict[str, Any]:
    (doc,) = load_docs(COMPOSE_FILE)
    return doc


# --------------------------------------------------------------------------- every file


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(K8S.parents[1])))
def test_infra_yaml_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path}: no YAML document"


def test_infra_every_schema_is_a_valid_json_schema() -> None:
    import jsonschema

    for p in sorted((Path(__file__).parent / "schemas").glob("*.schema.json")):
        sch = schema(p.name.removesuffix(".schema.json"))
        jsonschema.validators.validator_for(sch).check_schema(sch)


# --------------------------------------------------------------------------- Kubernetes


def test_infra_k8s_documents_match_their_schemas() -> None:
    seen = set()
    problems = []
    for path, doc in k8s_docs():
        key = (doc.get("apiVersion"), doc.get("kind"))
        assert key in K8S_SCHEMAS, f"{path.name}: no schema for {key}; add one to K8S_SCHEMAS"
        seen.add(key)
        name = doc.get("metadata", {}).get("name")
        problems += [
            f"{path.name} {key[1]}/{name}: {e}"
            for e in schema_errors(doc, schema(K8S_SCHEMAS[key]))
        ]
    assert not problems, "\n".join(problems)
    assert seen == set(K8S_SCHEMAS), (
        f"expected documents of every kind: missing {set(K8S_SCHEMAS) - seen}"
    )


def test_infra_k8s_core_objects_against_the_kubernetes_api_schemas() -> None:
    """Core objects, and every pod template and the autoscaler's container settings of the
    RayCluster wrapped as core PodTemplates, against the Kubernetes API's JSON Schemas
    (strict: unknown fields fail)."""
    import kubernetes_validate as kv

    version = kv.latest_version()
    objects = [d for _, d in k8s_docs() if d["kind"] in CORE_KINDS]
    spec = raycluster()["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates |= {g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]}
    auto = spec.get("autoscalerOptions", {})
    autoscaler = {"name": "autoscaler", "image": IMAGE}
    autoscaler |= {k: auto[k] for k in ("env", "envFrom", "resources", "volumeMounts") if k in auto}
    templates["autoscaler"] = {"spec": {"containers": [autoscaler]}}
    for name, tpl in templates.items():
        objects.append(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": tpl}
        )
    problems = []
    for obj in objects:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            problems.append(
                f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}"
            )
    assert not problems, "\n".join(problems)


def test_infra_topology_configmap_is_the_rendered_moderation_example() -> None:
    from dgstream.topology.k8s_configmap import render

    text = (K8S / "topology-configmap.yaml").read_text()
    assert text == render(MODERATION), (
        "infra/k8s/topology-configmap.yaml is stale: run "
        "`.venv/bin/python -m dgstream.topology.k8s_configmap"
        " > infra/k8s/topology-configmap.yaml`"
    )
    assert topology_configmap()["data"]["topology.yaml"] == MODERATION.read_text()
    assert k8s_topology() == load_topology(MODERATION)


def test_infra_controller_job_runs_the_topology_against_the_cluster() -> None:
    from dgstream.topology.cli import build_parser

    job = controller_job()
    pod = job["spec"]["template"]["spec"]
    (c,) = containers(job["spec"]["template"])
    assert c["image"] == IMAGE
    cmd = c["command"]
    assert cmd[0] == "dgstream"
    args = build_parser().parse_args(cmd[1:])
    assert (args.command, args.detach) == ("run", True), cmd
    # The topology argument is the ConfigMap's key, mounted from the rendered ConfigMap.
    volume = mounted_volume(pod, c, args.topology)
    cm = topology_configmap()
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == args.topology)
    assert mount.get("subPath") in cm["data"], "the mount must pick the topology key"
    # Ray Client to the head Service KubeRay creates: <cluster name>-head-svc.
    env = env_of(c)
    cluster = raycluster()["metadata"]["name"]
    assert k8s_topology().ray.address is None, "RAY_ADDRESS is ignored when the file sets one"
    assert re.fullmatch(
        rf"ray://{cluster}-head-svc(\.[a-z0-9.-]+)?:10001", env["RAY_ADDRESS"]["value"]
    )
    assert pod["restartPolicy"] in ("OnFailure", "Never")


def test_infra_secrets_reach_every_process_that_needs_them() -> None:
    """Token auth on the Job, every Ray container and the autoscaler, from one Secret. The
    topology's Kafka secrets (`*_env`) on every Ray container, where the controller and the
    workers read them (never sent as actor arguments), and not in the Job, which does not
    need them. The CA file (a path) on every Ray container, where the actors open it."""
    topo = k8s_topology()
    kafka = topo.kafka
    kafka_envs = [v for v in (kafka.sasl_password_env, kafka.ssl_password_env) if v]
    assert kafka_envs, "the moderation topology reads its SASL password from the environment"
    job_c = containers(controller_job()["spec"]["template"])[0]
    auto_env = {e["name"]: e for e in raycluster()["spec"]["autoscalerOptions"].get("env", [])}
    token_refs = set()
    for where, env in [("job", env_of(job_c)), ("autoscaler", auto_env)] + [
        (w, env_of(c)) for w, c, _ in ray_containers()
    ]:
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}: RAY_AUTH_MODE"
        ref = secret_ref(env.get("RAY_AUTH_TOKEN"))
        assert ref, f"{where}: RAY_AUTH_TOKEN must come from a Secret"
        token_refs.add(ref)
    assert len(token_refs) == 1, f"one token for the whole cluster, got {token_refs}"
    for var in kafka_envs:
        assert var not in env_of(job_c), f"job: {var} is not needed there"
        for where, c, _ in ray_containers():
            assert secret_ref(env_of(c).get(var)), f"{where}: {var} must come from a Secret"
    for where, c, pod in ray_containers():
        if kafka.ssl_cafile:
            vol = mounted_volume(pod, c, kafka.ssl_cafile)
            assert "secret" in vol or "configMap" in vol, f"{where}: CA file source"


def test_infra_raycluster_fits_the_topology_and_24gb_gpus() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    rc = raycluster()
    spec = rc["spec"]
    topo = k8s_topology()
    # Autoscaling on: the controller's request_resources adds GPU pods.
    assert spec["enableInTreeAutoscaling"] is True
    # rayVersion: within the project's Ray pin and new enough for token auth (2.52).
    pyproject = (K8S.parents[1] / "pyproject.toml").read_text()
    pin = re.search(r'"ray\[default\]([^"]+)"', pyproject)
    assert pin, "ray pin not found in pyproject.toml"
    ray_version = Version(spec["rayVersion"])
    assert ray_version in SpecifierSet(pin.group(1)) and ray_version >= Version("2.52")

    head = spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for c in containers(head["template"]):
        assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}), "head has no GPU"

    groups = spec["workerGroupSpecs"]
    for p in topo.pipelines:
        if p.resources.gpus <= 0:
            continue
        # A group whose pod has exactly the pipeline's GPUs: one worker actor per pod.
        fits = []
        for g in groups:
            (c,) = containers(g["template"])
            res = c["resources"]
            if float(res["limits"].get("nvidia.com/gpu", 0)) == p.resources.gpus:
                assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
                assert float(res["limits"]["cpu"]) >= p.resources.cpus
                fits.append(g)
        assert fits, f"{p.name}: no worker group with nvidia.com/gpu == {p.resources.gpus}"
        g = fits[0]
        # The pool can reach the size the controller may ask for: at most replicas.max and
        # the input partitions (one consumer per partition).
        reachable = min(p.replicas.max, p.topics.partitions)
        assert g["maxReplicas"] >= reachable, f"{p.name}: maxReplicas < {reachable}"
        assert g["minReplicas"] <= p.replicas.min, f"{p.name}: idle GPUs below replicas.min"
        assert g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"]
        assert p.engine.backend == "vllm"
        # 24 GB GPU class: the node-affinity bounds on GFD's nvidia.com/gpu.memory (MiB)
        # bracket 24576 MiB (RTX 3090/4090) and about 23000 (A10, L4).
        pod = g["template"]["spec"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        for term in terms["nodeSelectorTerms"]:
            mem = [e for e in term["matchExpressions"] if e["key"] == "nvidia.com/gpu.memory"]
            low = max(int(e["values"][0]) for e in mem if e["operator"] == "Gt")
            high = min(int(e["values"][0]) for e in mem if e["operator"] == "Lt")
            assert low < 23000 and 24576 < high < 40960, (low, high)
        assert any(t["key"] == "nvidia.com/gpu" for t in pod.get("tolerations", []))
        # The model cache: HF_HOME on a PVC that is defined in the same file.
        (c,) = containers(g["template"])
        hf_home = env_of(c)["HF_HOME"]["value"]
        claim = mounted_volume(pod, c, hf_home)["persistentVolumeClaim"]["claimName"]
        assert claim in {d["metadata"]["name"] for d in only("PersistentVolumeClaim")}
        shm = mounted_volume(pod, c, "/dev/shm")
        assert shm["emptyDir"]["medium"] == "Memory"

    # Every Ray container: the same image, and Ray's metrics port named `metrics` as the
    # PodMonitor expects, equal to metrics-export-port.
    (pm,) = only("PodMonitor")
    port_names = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert pm["spec"]["selector"]["matchLabels"]["ray.io/cluster"] == rc["metadata"]["name"]
    params = {"head": head["rayStartParams"]} | {
        g["groupName"]: g["rayStartParams"] for g in groups
    }
    for where, c, _ in ray_containers():
        assert c["image"] == IMAGE
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for name in port_names:
            assert name in ports, f"{where}: no container port named {name}"
            assert str(ports[name]) == params[where]["metrics-export-port"]


def test_infra_kafka_topics_match_the_controller_and_topology(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topo = k8s_topology()
    expected = expected_topics(topo, monkeypatch)
    # Input, output and dead-letter topics of every pipeline are all covered.
    for p in topo.pipelines:
        for t in [*p.input_topics, p.output_topic, p.dead_letter_topic]:
            assert t in expected, t
    got = {}
    for kt in only("KafkaTopic", "kafka.strimzi.io/v1beta2"):
        name = kt["spec"].get("topicName", kt["metadata"]["name"])
        assert name not in got, f"two KafkaTopics for {name}"
        got[name] = (kt["spec"]["partitions"], kt["spec"]["replicas"])
        min_isr = int(kt["spec"].get("config", {}).get("min.insync.replicas", 1))
        assert min_isr <= kt["spec"]["replicas"], name
        assert kt["metadata"]["labels"]["strimzi.io/cluster"]
    assert got == expected


# --------------------------------------------------------------------------- compose


def test_infra_compose_services_and_loopback_ports() -> None:
    doc = compose()
    errors = schema_errors(doc, schema("compose"))
    assert not errors, "\n".join(errors)
    services = doc["services"]
    assert {"kafka", "ray-head", "ray-gpu-worker", "controller", "prometheus", "grafana"} <= set(
        services
    )
    for name, svc in services.items():
        assert svc.get("network_mode") != "host", f"{name}: host networking publishes everything"
        for host_ip, text in published_ports(svc):
            assert host_ip == "127.0.0.1", f"{name}: port {text} is not bound to 127.0.0.1"
    assert published_ports(services["kafka"]) and published_ports(services["grafana"])


def test_infra_compose_against_the_compose_specification() -> None:
    from check_jsonschema import builtin_schemas as builtin

    errors = schema_errors(compose(), builtin.get_builtin_schema("vendor.compose-spec"))
    assert not errors, "\n".join(errors)


# Compose's interpolation: ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ...
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?+])?[^}]*\}")


def test_infra_compose_requires_its_secrets() -> None:
    """The secrets are interpolated as required (`${NAME:?message}`): Compose refuses to
    start without them instead of running with an empty password or token."""
    refs = _INTERPOLATION.findall(COMPOSE_FILE.read_text())
    forms = {name: op for name, op in refs}
    assert {"RAY_AUTH_TOKEN", "GRAFANA_ADMIN_PASSWORD"} <= set(forms), forms
    for name, op in refs:
        if name in ("RAY_AUTH_TOKEN", "GRAFANA_ADMIN_PASSWORD"):
            assert op == ":?", f"${{{name}}} must be required (${{{name}:?...}}), not {op!r}"
    # The one optional variable: a Hugging Face token, needed only for gated checkpoints.
    assert {n for n, op in refs if op != ":?"} == {"HF_TOKEN"}


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    """container path -> source (host path or volume name) of a service's short-form mounts."""
    out = {}
    for v in svc.get("volumes", []):
        src, target = str(v).split(":")[:2]
        out[target] = src
    return out


def test_infra_compose_wiring_matches_topology_and_monitoring() -> None:
    doc = compose()
    s = doc["services"]
    topo = load_topology(COMPOSE_TOPOLOGY)
    kenv = env_map(s["kafka"]["environment"])
    # Kafka 4.x in KRaft mode, one broker; CLUSTER_ID is a base64url UUID (16 bytes).
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", s["kafka"]["image"])
    assert "controller" in kenv["KAFKA_PROCESS_ROLES"] and not any("ZOOKEEPER" in k for k in kenv)
    cid = kenv["CLUSTER_ID"]
    assert len(base64.urlsafe_b64decode(cid + "=" * (-len(cid) % 4))) == 16
    # The pipelines reach the broker on the listener advertised to containers.
    advertised = {item.split("://")[1] for item in kenv["KAFKA_ADVERTISED_LISTENERS"].split(",")}
    for server in topo.kafka.bootstrap_servers:
        assert server in advertised and not server.startswith("127."), server
    assert topo.kafka.security_protocol == "PLAINTEXT"
    assert int(kenv["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == 1
    gpus = sum(
        int(d.get("count", 0))
        for d in s["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
        if "gpu" in d["capabilities"]
    )
    head_cmd = " ".join(s["ray-head"]["command"])
    worker_cmd = " ".join(s["ray-gpu-worker"]["command"])
    assert f"--num-gpus={gpus}" in worker_cmd and "--num-gpus=0" in head_cmd
    for p in topo.pipelines:
        assert p.topics.replication_factor == 1, "one broker"
        assert p.replicas.max * p.resources.gpus <= gpus, f"{p.name}: more GPUs than the host has"
    # The controller runs the mounted compose topology against the head's Ray Client port.
    ctl = s["controller"]
    cmd = ctl["command"]
    mounts = _mounts(ctl)
    assert (
        cmd[:2] == ["dgstream", "run"]
        and (COMPOSE_DIR / mounts[cmd[2]]).resolve() == COMPOSE_TOPOLOGY
    )
    client_port = re.search(r"--ray-client-server-port=(\d+)", head_cmd)
    assert (
        client_port
        and env_map(ctl["environment"])["RAY_ADDRESS"] == f"ray://ray-head:{client_port.group(1)}"
    )
    assert ctl.get("stop_signal") == "SIGINT", "SIGINT makes `dgstream run` drain the workers"
    assert topo.ray.auth_token_env in env_map(ctl["environment"])
    for name in ("ray-head", "ray-gpu-worker", "controller"):
        env = env_map(s[name]["environment"])
        assert env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" in env
        assert s[name]["image"] == IMAGE
    # The model cache volume is HF_HOME on the GPU worker.
    wenv = env_map(s["ray-gpu-worker"]["environment"])
    assert _mounts(s["ray-gpu-worker"])[wenv["HF_HOME"]] in doc["volumes"]
    # Prometheus: our config, and the head's /tmp/ray at the SAME path (the discovery file
    # is an absolute symlink into the session dir).
    pm = _mounts(s["prometheus"])
    assert (COMPOSE_DIR / pm["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS_YML
    head_tmp = next(t for t, src in _mounts(s["ray-head"]).items() if src in doc["volumes"])
    assert head_tmp == "/tmp/ray" and pm.get(head_tmp) == _mounts(s["ray-head"])[head_tmp]
    # Grafana: provisioning and the dashboard where the provider looks.
    gm = _mounts(s["grafana"])
    assert (COMPOSE_DIR / gm["/etc/grafana/provisioning"]).resolve() == PROVISIONING
    (provider,) = load_docs(PROVISIONING / "dashboards" / "dgstream.yml")[0]["providers"]
    dash_target = next(t for t, src in gm.items() if src.endswith("dgstream-dashboard.json"))
    assert (COMPOSE_DIR / gm[dash_target]).resolve() == DASHBOARD
    assert Path(dash_target).parent == Path(provider["options"]["path"])
    # Every bind-mounted host path exists.
    for name, svc in s.items():
        for src in _mounts(svc).values():
            if src.startswith("."):
                assert (COMPOSE_DIR / src).exists(), f"{name}: {src} does not exist"


# --------------------------------------------------------------------------- monitoring


def test_infra_prometheus_reads_rays_service_discovery_file() -> None:
    from ray._private import ray_constants

    cfg = load_docs(PROMETHEUS_YML)[0]
    errors = schema_errors(cfg, schema("prometheus"))
    assert not errors, "\n".join(errors)
    files = [
        f
        for sc in cfg["scrape_configs"]
        for sd in sc.get("file_sd_configs", [])
        for f in sd["files"]
    ]
    assert f"/tmp/ray/{ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE}" in files
    # Grafana's data source is this Prometheus, by its compose service name and port.
    (ds,) = load_docs(PROVISIONING / "datasources" / "prometheus.yml")[0]["datasources"]
    assert ds["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in compose()["services"]["prometheus"]["ports"]


def test_infra_prometheus_config_with_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        # CI unpacks it (.ci/run): there its absence is a failure, never a skip.
        if os.environ.get("CI"):
            pytest.fail("promtool is not on PATH: .ci/run should have unpacked it")
        pytest.skip("promtool not on PATH (Debian: the prometheus package)")
    run = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_infra_grafana_provisioning_files() -> None:
    for path, name in [
        (PROVISIONING / "datasources" / "prometheus.yml", "grafana-datasources"),
        (PROVISIONING / "dashboards" / "dgstream.yml", "grafana-dashboard-providers"),
    ]:
        errors = schema_errors(load_docs(path)[0], schema(name))
        assert not errors, f"{path.name}:\n" + "\n".join(errors)


def test_infra_dashboard_queries_only_exported_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import ray.dashboard.consts as dashboard_consts

    dash = json.loads(DASHBOARD.read_text())
    errors = schema_errors(dash, schema("grafana-dashboard"))
    assert not errors, "\n".join(errors)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for p in dash["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]

    # Allowed series: the code's metrics as Ray exports them, and Ray's GPU node metrics.
    code = exported_metrics(monkeypatch)
    assert code, "no metrics found in workers/hosting/metrics.py and topology/metrics.py"
    labels_of: dict[str, frozenset[str]] = {}
    for m in code.values():
        for series in m.series():
            extra = {"le"} if series.endswith("_bucket") else set()
            labels_of[series] = frozenset(m.tags) | extra
    reporter = (
        Path(dashboard_consts.__file__).parent / "modules" / "reporter" / "reporter_agent.py"
    ).read_text()
    for name in RAY_BUILTIN_GPU_METRICS:
        assert f'"{name}"' in reporter, f"Ray no longer defines {name}"
        labels_of[f"ray_{name}"] = frozenset(dashboard_consts.GPU_TAG_KEYS)

    used: set[str] = set()
    problems = []
    for where, expr in dashboard_queries(dash):
        q = read_promql(expr)
        if not q.metrics:
            problems.append(f"{where}: no metric in {expr!r}")
        unknown = q.metrics - set(labels_of)
        if unknown:
            problems.append(f"{where}: not exported: {sorted(unknown)}")
        allowed = set(COMMON_LABELS).union(*(labels_of.get(m, frozenset()) for m in q.metrics))
        if q.labels - allowed:
            problems.append(f"{where}: unknown labels {sorted(q.labels - allowed)}")
        used |= q.metrics
    assert not problems, "\n".join(problems)

    # Every metric the code exports has a panel, and the operators' list is covered.
    for m in code.values():
        assert m.series() & used, f"{m.name} is exported but on no panel"
    for series in [
        "ray_dgstream_group_lag",
        "ray_dgstream_replicas",
        "ray_dgstream_desired_replicas",
        "ray_dgstream_throughput",
        "ray_dgstream_end_to_end_latency_seconds_bucket",
        "ray_dgstream_dead_lettered_total",
        "ray_dgstream_batch_size_bucket",
        "ray_node_gram_used",
    ]:
        assert series in used, series
    assert any(
        "histogram_quantile" in read_promql(e).functions
        and "ray_dgstream_end_to_end_latency_seconds_bucket" in e
        for _, e in dashboard_queries(dash)
    )


def test_infra_promql_reader_catches_mistakes() -> None:
    q = read_promql('sum by (le, pipeline) (rate(ray_x_bucket{pipeline=~"$p"}[$__rate_interval]))')
    assert q.metrics == {"ray_x_bucket"} and q.labels == {"le", "pipeline"}
    assert read_promql("max(ray_a) by (instance) / on() ray_b").metrics == {"ray_a", "ray_b"}
    with pytest.raises(ValueError, match="unknown function"):
        read_promql("rat(ray_a[5m])")
    with pytest.raises(ValueError, match="unbalanced"):
        read_promql('ray_a{pipeline="x"')
