"""Shared by the infra tests: paths, YAML/JSON loading, the JSON Schemas of tests/infra/schemas,
the metric names the code exports, and a small PromQL reader for the Grafana dashboard."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
COMPOSE_DIR = INFRA / "compose"
MONITORING = INFRA / "monitoring"
GRAFANA = MONITORING / "grafana"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
MODERATION = ROOT / "topology" / "examples" / "moderation.yaml"


def yaml_files() -> list[Path]:
    """Every YAML file this part of infra/ owns."""
    out: list[Path] = []
    for d in (K8S, COMPOSE_DIR, MONITORING):
        out += sorted(p for p in d.rglob("*") if p.suffix in (".yaml", ".yml"))
    return out


def load_docs(path: Path) -> list[dict[str, Any]]:
    """The documents of a (multi-document) YAML file; empty documents are skipped."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            raise AssertionError(f"{path}: document {i} is a {type(d).__name__}, not a mapping")
    return docs


def k8s_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load_docs(path):
            yield path, doc


def only(kind: str, api_version: str | None = None) -> list[dict[str, Any]]:
    return [
        d
        for _, d in k8s_docs()
        if d.get("kind") == kind and (api_version is None or d.get("apiVersion") == api_version)
    ]


def schema(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return data


def schema_errors(instance: Any, sch: dict[str, Any]) -> list[str]:
    """All violations, each with the path of the bad field."""
    cls = jsonschema.validators.validator_for(sch)
    cls.check_schema(sch)
    errors = sorted(cls(sch).iter_errors(instance), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}" for e in errors]


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Exported:
    name: str  # as the code names it (dgstream_group_lag)
    kind: str  # counter | gauge | histogram
    tags: tuple[str, ...]

    def series(self) -> set[str]:
        """The Prometheus series names Ray exports for it: Ray prefixes every application
        metric with `ray_` (ray/_private/telemetry/open_telemetry_metric_recorder.py,
        NAMESPACE = "ray"); OpenTelemetry's Prometheus exporter adds `_total` to counters and
        `_bucket`/`_sum`/`_count` to histograms. tests/infra/test_infra_metrics_export.py
        checks this rule against a real Ray exporter."""
        base = f"ray_{self.name}"
        if self.kind == "counter":
            return {f"{base}_total"}
        if self.kind == "histogram":
            return {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
        return {base}


def _truthy(annotation: str) -> Any:
    """A value that takes every branch of publish(): True for flags, one cause for lists
    of causes, 1 for counts and rates."""
    if "bool" in annotation:
        return True
    return ["cause"] if "Sequence" in annotation else 1


def exported_metrics(monkeypatch: Any) -> dict[str, Exported]:
    """Every metric that workers/hosting/metrics.py and topology/metrics.py create, read by running
    their code with recording stand-ins for ray.util.metrics' classes (the real signatures
    bind the arguments, so positional and keyword calls both resolve)."""
    import ray
    import ray.util.metrics as ray_metrics

    import dgstream.topology.metrics as controller_metrics
    from dgstream.workers.hosting.metrics import WorkerMetrics

    found: dict[str, Exported] = {}

    def stand_in(real: type, kind: str) -> type:
        sig = inspect.signature(real.__init__)

        class Recorder:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                bound = sig.bind(None, *args, **kwargs)
                bound.apply_defaults()
                name = bound.arguments["name"]
                tags = tuple(bound.arguments.get("tag_keys") or ())
                found[name] = Exported(name, kind, tags)

            def set_default_tags(self, tags: dict[str, str]) -> Recorder:
                return self

            def inc(self, *args: Any, **kwargs: Any) -> None:
                pass

            def set(self, *args: Any, **kwargs: Any) -> None:
                pass

            def observe(self, *args: Any, **kwargs: Any) -> None:
                pass

        return Recorder

    monkeypatch.setattr(ray_metrics, "Counter", stand_in(ray_metrics.Counter, "counter"))
    monkeypatch.setattr(ray_metrics, "Gauge", stand_in(ray_metrics.Gauge, "gauge"))
    monkeypatch.setattr(ray_metrics, "Histogram", stand_in(ray_metrics.Histogram, "histogram"))
    monkeypatch.setattr(controller_metrics, "_METRICS", {})
    monkeypatch.setattr(ray, "is_initialized", lambda: True)

    WorkerMetrics("p", "w", use_ray=True)
    # publish() with every optional figure given (truthy), so that every branch that
    # creates a metric runs.
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(controller_metrics.publish).parameters.items():
        if param.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = _truthy(str(param.annotation))
    controller_metrics.publish("p", **kwargs)
    return found


# Ray's own node metrics that the dashboard reads (ray/dashboard/modules/reporter/
# reporter_agent.py METRICS_GAUGES; tags: ray/dashboard/consts.py GPU_TAG_KEYS). The test
# checks these names are still in the installed Ray's source.
RAY_BUILTIN_GPU_METRICS = ("node_gram_used", "node_gram_available", "node_gpus_utilization")

# Labels that Ray's exporter or Prometheus put on every series.
COMMON_LABELS = frozenset(
    {
        "instance",
        "job",
        "cluster",  # infra/monitoring/prometheus.yml relabel
        "ray_io_cluster",  # infra/k8s/podmonitor.yaml relabel
        "ray_io_node_type",
        "Component",
        "NodeAddress",
        "SessionName",
        "Version",
        "WorkerId",
    }
)


# --------------------------------------------------------------------------- PromQL

_TOKEN = re.compile(
    r"""
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[[^\]]*\])
  | (?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^(){},=<>])
  | (?P<ws>\s+)
    """,
    re.VERBOSE,
)
AGGREGATIONS = frozenset({"sum", "max", "min", "avg", "count", "topk", "bottomk", "quantile"})
FUNCTIONS = frozenset(
    {"rate", "irate", "increase", "histogram_quantile", "clamp_min", "clamp_max", "abs"}
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})


@dataclass
class Query:
    metrics: set[str]
    labels: set[str]
    functions: set[str]


def read_promql(expr: str) -> Query:
    """The metric names, label names (matchers and groupings) and functions of a PromQL
    expression. Enough PromQL for dashboards; anything it does not know is an error."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"unexpected {expr[pos : pos + 10]!r} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup or ""
        if kind != "ws":
            tokens.append((kind, m.group()))
    q = Query(set(), set(), set())
    depth_brace = 0
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "{":
            depth_brace += 1
        elif text == "}":
            depth_brace -= 1
        elif kind == "ident" and depth_brace:
            if nxt not in ("=", "!=", "=~", "!~"):
                raise ValueError(f"label matcher without operator after {text!r} in {expr!r}")
            q.labels.add(text)
        elif kind == "ident" and text in GROUPING:
            if nxt == "(":
                j = i + 2
                while tokens[j][1] != ")":
                    if tokens[j][0] == "ident":
                        q.labels.add(tokens[j][1])
                    j += 1
                i = j
        elif kind == "ident" and (text in AGGREGATIONS or nxt == "("):
            if text not in AGGREGATIONS and text not in FUNCTIONS:
                raise ValueError(f"unknown function {text!r} in {expr!r}")
            q.functions.add(text)
        elif kind == "ident" and text not in KEYWORDS:
            q.metrics.add(text)
        i += 1
    if depth_brace:
        raise ValueError(f"unbalanced braces in {expr!r}")
    return q


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", query)
        if not m:
            raise ValueError(f"variable {var['name']}: unsupported query {query!r}")
        # The label is read through a by() so that it is checked like any other label.
        yield f"variable {var['name']!r}", f"count by ({m.group(2)}) ({m.group(1)})"


# --------------------------------------------------------------------------- compose


def published_ports(service: dict[str, Any]) -> list[tuple[str | None, str]]:
    """(host_ip, text) for each published port, short or long syntax."""
    out: list[tuple[str | None, str]] = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip"), json.dumps(p)))
            continue
        text = str(p)
        # HOST_IP:HOST:CONTAINER[/proto]; IPv6 host ips are bracketed.
        m = re.fullmatch(r"(\[[^\]]+\]|[0-9.]+):[^:]+:[^:]+", text)
        out.append((m.group(1) if m else None, text))
    return out


def env_map(env: Any) -> dict[str, Any]:
    if isinstance(env, dict):
        return dict(env)
    out: dict[str, Any] = {}
    for item in env or []:
        k, _, v = str(item).partition("=")
        out[k] = v
    return out
