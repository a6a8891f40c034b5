"""The benchmark suites (the shared problems, shipped as package data in nnprim/data/suites)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import BadParameterError

SUITE_DIR = Path(__file__).resolve().parents[1] / "data" / "suites"


def load_suite(name: str) -> tuple[str, list[dict]]:
    """(kind "conv" | "attention", problem specs) of a suite name or JSON file."""
    path = Path(name)
    if not path.exists():
        path = SUITE_DIR / (name if name.endswith(".json") else name + ".json")
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in SUITE_DIR.glob("*.json"))) if SUITE_DIR.exists() else "none"
        raise BadParameterError(f"suite={name!r} is neither a file nor a known suite ({known})")
    try:
        data = json.loads(path.read_text())
        probs = data["problems"]
    except (ValueError, KeyError, TypeError) as e:
        raise BadParameterError(f"suite file {path} is not a suite JSON ({e})") from None
    kind = "attention" if probs and "Hq" in probs[0] else "conv"
    return kind, probs
