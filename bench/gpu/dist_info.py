"""Make the project's entry points visible to Python without installing it.

The GPU machine runs the project from its work tree (`PYTHONPATH=$PWD`), where no package
metadata exists, and vLLM finds its plugins only through metadata (entry points of the group
`vllm.general_plugins`, in every process it starts). This writes a minimal
`dgstream-<version>.dist-info` (METADATA and entry_points.txt, from pyproject.toml) into a
directory that is then put on PYTHONPATH:

    python3 bench/gpu/dist_info.py /root/dgdist && export PYTHONPATH=/root/dgdist:$PYTHONPATH
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write(target: Path) -> Path:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = target / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return info


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
