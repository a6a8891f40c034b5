"""The tree carries no unresolved merge: no conflict markers in tracked text files."""
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKERS = ("<<<<<<< ", ">>>>>>> ")


def _tracked() -> list[pathlib.Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.splitlines() if f.endswith((".py", ".md", ".sh", ".toml", ".json", ".cfg", ".txt"))]


def test_no_conflict_markers():
    bad = []
    for path in _tracked():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        bad += [f"{path.relative_to(ROOT)}:{i + 1}" for i, ln in enumerate(lines) if ln.startswith(MARKERS)]
    assert not bad, "unresolved merge markers: " + ", ".join(bad[:10])
