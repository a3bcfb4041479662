"""Write the JSON Schema files in schemas/json/ from the models.

python -m dgstream.schemas.export            # (re)write them
python -m dgstream.schemas.export --check    # exit 1 when the committed files differ
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from dgstream.schemas.dead_letter import DeadLetter
from dgstream.schemas.formats import formats
from dgstream.schemas.request import ClassificationRequest

JSON_DIR = Path(__file__).resolve().parent / "json"
_DIALECT = "https://json-schema.org/draft/2020-12/schema"

Mode = Literal["validation", "serialization"]


def _files() -> dict[str, tuple[type[BaseModel], Mode]]:
    """Requests are read by us (validation mode); results and dead letters are written by
    us, so their schema says what is always present (serialization mode). Each output
    format names its own file (`schemas.formats`)."""
    out: dict[str, tuple[type[BaseModel], Mode]] = {
        "request.schema.json": (ClassificationRequest, "validation"),
        "dead_letter.schema.json": (DeadLetter, "serialization"),
    }
    for fmt in formats():
        out[fmt.schema_file] = (fmt.response, "serialization")
    return out


def render() -> dict[str, str]:
    """File name -> file text, deterministic (sorted keys, indent 2, trailing newline)."""
    out = {}
    for name, (model, mode) in _files().items():
        schema = {"$schema": _DIALECT, **model.model_json_schema(mode=mode)}
        out[name] = json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgstream.schemas.export", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ")
    parser.add_argument("--dir", type=Path, default=JSON_DIR, help="where the files live")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path: Path = args.dir / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(
            f"out of date in {args.dir}: {', '.join(stale)}; "
            "run `python -m dgstream.schemas.export`",
            file=sys.stderr,
        )
        return 1
    for name in stale:
        print(f"wrote {args.dir / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
