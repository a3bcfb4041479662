"""Writes docs/configuration.md from the topology models, so the page lists every field with
its type, default and meaning, and cannot drift (a test compares it with the models).

    python -m dgstream.topology.docs          # rewrite docs/configuration.md
    python -m dgstream.topology.docs --check  # exit 1 when it differs
"""

from __future__ import annotations

import argparse
import sys
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

INTRO = """# Configuration: the topology file

A deployment is described by one YAML file (`dgstream run TOPOLOGY`). Examples:
`topology/examples/moderation.yaml` (the production sample: one GPU pipeline on vLLM, a
SASL_SSL cluster; it does not run on one machine),
`topology/examples/two-pipelines.yaml` (two CPU pipelines on a local broker, on a model
with random weights: plumbing only), and `topology/examples/jev-routes.yaml` (Jev's
bodies in, Jev's answers out, routed; on the demo model, the README's walk-through:
`docs/jev.md`, `docs/routes.md`).
Errors name the path of the bad field, e.g. `pipelines[0].replicas: min (3) must not
exceed max (2)`. Secrets never go in the file: name an environment variable instead
(`sasl_password_env`, `ssl_password_env`), set on every Ray node (docs/operations.md).

This page is generated from the models (`python -m dgstream.topology.docs`); a test fails when it is
out of date.
"""


def _type(annotation: Any) -> str:
    import re

    if isinstance(annotation, type) and not getattr(annotation, "__args__", None):
        return annotation.__name__
    text = str(annotation)
    if "discriminator='type'" in text:
        text = re.sub(r"Annotated\[[^\]]*?discriminator='type'\)\]", "Question", text)
    text = re.sub(r"\b(?:[a-z_]+\.)+([A-Za-z_]+)", r"\1", text)
    return text.replace("NoneType", "None").replace("|", "\\|")


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(see below)"
        return f"`{value!r}`"
    default = info.default.value if isinstance(info.default, Enum) else info.default
    return f"`{default!r}`"


def _doc_of(model: type[BaseModel], name: str) -> str:
    """The comment above the field in the source (of the class that declares it), else the
    field's description (fields built from a registry have no source line)."""
    for cls in model.__mro__:
        if isinstance(cls, type) and issubclass(cls, BaseModel) and name in cls.__annotations__:
            return _comment(cls, name) or (model.model_fields[name].description or "")
    return ""


def _comment(model: type, name: str) -> str:
    import inspect

    try:
        lines = inspect.getsource(model).splitlines()
    except OSError:
        return ""
    for i, line in enumerate(lines):
        if line.strip().startswith(f"{name}:"):
            notes: list[str] = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("#"):
                notes.insert(0, lines[j].strip().lstrip("# "))
                j -= 1
            tail = line.split("#", 1)[1].strip() if "#" in line and "=" in line else ""
            return " ".join([*notes, tail]).strip()
    return ""


def _section(title: str, model: type[BaseModel], seen: set[str]) -> list[str]:
    out = [f"## `{title}`", ""]
    if model.__doc__:
        out += [" ".join(model.__doc__.split()), ""]
    out += ["| field | type | default | notes |", "|---|---|---|---|"]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        out.append(f"| `{name}` | `{_type(ann)}` | {_default(info)} | {_doc_of(model, name)} |")
        if isinstance(ann, type) and issubclass(ann, BaseModel) and ann.__name__ not in seen:
            nested.append((f"{title}.{name}", ann))
    out.append("")
    for sub_title, sub in nested:
        seen.add(sub.__name__)
        out += _section(sub_title, sub, seen)
    return out


def backend_rows() -> list[str]:
    """The "Engine backends" table: one row per registered backend (its module's
    docstring, its settings key, GPUs by default and audit fields)."""
    import sys as _sys

    from dgstream.workers.engine.backends import backends
    from dgstream.workers.engine.factory import EngineSettings

    out = [
        "## Engine backends",
        "",
        "What `pipelines[].engine.backend` names: one module each of `workers/engine/backends/`",
        "(a new backend is one module there; its row here is generated). A backend's settings",
        "are under its key in `engine:` (a backend without one reads the engine's common",
        "fields); GPUs: what a worker asks Ray for when its settings name none (a pipeline",
        "of this file asks for `resources.gpus`, 1 unless set); `audit.engine` carries its",
        "audit fields beside `backend`, `seed`, `canvas_length`, `auto_threshold`, `auto_max`.",
        "",
        "| backend | settings | GPUs | audit fields | notes |",
        "|---|---|---|---|---|",
    ]
    defaults = EngineSettings()
    for b in backends():
        module = _sys.modules[type(b).__module__]
        notes = " ".join((module.__doc__ or type(b).__doc__ or "").split())
        key = f"`engine.{b.settings_key}`" if b.settings_key else "the common fields"
        fields = ", ".join(f"`{f}`" for f in b.audit_fields(defaults)) or "none"
        out.append(f"| `{b.name}` | {key} | {b.gpus:g} | {fields} | {notes} |")
    out.append("")
    return out


def kind_rows() -> list[str]:
    """The "Question kinds" table: one row per registered kind (its wire types, its route
    fields, its Jev type and its module's docstring)."""
    import sys as _sys

    from dgstream.schemas.kinds import kinds
    from dgstream.workers.routes.fields import COMMON_FIELDS

    common = ", ".join(f"`{f}`" for f in COMMON_FIELDS)
    out = [
        "## Question kinds",
        "",
        "What a question's `type` names: one module each of `schemas/kinds/` (a new kind is one",
        "module there; its row here is generated). A kind owns its question and answer models,",
        "the labels the model writes and its lines of the prompt, its answer, its calibration,",
        "its answer in Jev's shape and its route fields, beside those every kind has:",
        f"{common}.",
        "",
        "| kind | `type` | route fields | Jev's `type` | notes |",
        "|---|---|---|---|---|",
    ]
    for k in kinds():
        module = _sys.modules[type(k).__module__]
        notes = " ".join((module.__doc__ or type(k).__doc__ or "").split())
        types = ", ".join(f"`{t}`" for t in k.types)
        fields = ", ".join(f"`{f}`" for f in k.fields) or "none"
        out.append(f"| `{k.name}` | {types} | {fields} | `{k.jev_type}` | {notes} |")
    out.append("")
    return out


def render() -> str:
    from dgstream.topology.spec import KafkaSpec, PipelineSpec, RaySpec, Topology
    from dgstream.workers.routes import Route

    lines = [INTRO]
    seen = {"Topology", "KafkaSpec", "PipelineSpec", "RaySpec"}
    lines += _section("(top level)", Topology, seen)
    lines += _section("kafka", KafkaSpec, seen)
    lines += _section("ray", RaySpec, seen)
    lines += _section("pipelines[]", PipelineSpec, seen)
    lines += _section("pipelines[].routes[]", Route, seen)
    lines += backend_rows()
    lines += [
        "## `question_sets`",
        "",
        "A map of name -> questions, in the shape of a request's `questions` (see",
        "`schemas/json/request.schema.json`). Pipelines list the names they answer; a request",
        "names one with `question_set`.",
        "",
    ]
    lines += kind_rows()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python -m dgstream.topology.docs", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
