"""bench/images_host.py at a tiny size: it runs, prints its two tables (a row for every
variant, the command to reproduce), and every variant's every request was parsed, passed
by the image gate with its images and answered. No timing is asserted.

The script runs in a process of its own (`python -m bench.images_host`): a test may import
bench's library code, never a script (tests/repo/test_layers.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bench_scripts import run_bench

ARGS = [
    *("--requests", "3", "--batch", "2", "--repeat", "2", "--sample-s", "0.001"),
    *("--image-kb", "6", "--multi", "2", "--multi-kb", "5"),
]
VARIANTS = ["text only", "1 JPEG", "2 JPEG", "1 PNG"]


@pytest.mark.unit
def test_images_host_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    text = run_bench("-m", "bench.images_host", *ARGS, "--json", str(out), timeout_s=300)

    # Two tables (wall, CPU), each a header, a rule and one row per variant, in order.
    tables = [block for block in text.split("\n\n") if block.startswith("| variant |")]
    assert len(tables) == 2
    for block in tables:
        lines = block.splitlines()
        assert lines[1].startswith("|---")
        rows = lines[2:]
        assert [r.split(" | ")[0].lstrip("| ") for r in rows] == VARIANTS
        assert all(r.count("|") == lines[0].count("|") for r in rows)
        assert rows[0].endswith("| 1.0x |")  # text only against itself
    assert "Reproduce: `.venv/bin/python -m bench.images_host " + " ".join(ARGS) + "`" in text

    doc = json.loads(out.read_text())
    assert list(doc["variants"]) == VARIANTS
    for name, counts in doc["counts"].items():
        assert counts["requests"] > 0
        assert counts["requests"] == counts["parsed"] == counts["passed"] == counts["answered"], (
            name,
            counts,
        )
    images = {name: v["images"] for name, v in doc["variants"].items()}
    assert images["text only"] == []
    assert [i["media_type"] for i in images["1 JPEG"]] == ["image/jpeg"]
    assert [i["media_type"] for i in images["2 JPEG"]] == ["image/jpeg"] * 2
    assert [i["media_type"] for i in images["1 PNG"]] == ["image/png"]
    for name, v in doc["variants"].items():
        med = v["median_us"]
        for key in ("parse", "gate", "front", "parse_gate", "all", "parse_cpu", "all_cpu"):
            assert med[key] >= 0, (name, key)
        assert len(v["samples_us"]["all"]) == 2
