"""Held-out problems (nnprim.testing.heldout) and a CPU smoke run of benchmarks/regret.py."""
import importlib.util
import json
import os

import pytest
import torch

import nnprim
from nnprim.cli.problem_args import attn_problem, conv_problem
from nnprim.testing import heldout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generator_is_seeded_valid_and_held_out():
    a = heldout.generate(40, seed=3)
    assert [h.to_json() for h in a] == [h.to_json() for h in heldout.generate(40, seed=3)]
    assert [h.spec for h in a] != [h.spec for h in heldout.generate(40, seed=4)]
    assert {h.family for h in a} == set(heldout.FAMILIES)
    suites = heldout._suite_specs()
    assert suites and not any(heldout._ident(h.spec) in suites for h in a)
    for scale in ("full", "tiny"):
        for h in heldout.generate(27, seed=5, scale=scale):
            make = conv_problem if h.kind == "conv" else attn_problem
            p = make(h.spec, dtype=torch.bfloat16, device="cpu", direction=h.direction)  # validates
            if scale == "tiny":
                assert p.flops() < 5e6, h
    dw = [h for h in heldout.generate(60, seed=1, families=["convnext"]) if h.spec["groups"] > 1]
    assert dw and all(h.spec["filter"] == [7, 7] for h in dw)
    llama = heldout.generate(5, seed=1, families=["llama"])
    assert all(h.spec["D"] == 128 and h.spec["causal"] == "top_left" for h in llama)
    assert all(h.spec["Sq"] <= 8 for h in heldout.generate(5, seed=1, families=["decode"]))
    with pytest.raises(nnprim.BadParameterError):
        heldout.generate(2, families=["nope"])


def test_regret_benchmark_smoke_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NNPRIM_CACHE_DIR", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("regret", os.path.join(ROOT, "benchmarks", "regret.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "regret.json"
    assert mod.main(["--device", "cpu", "--count", "3", "--families", "resnet,decode", "--reps", "3",
                     "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 3 and data["scale"] == "tiny"
    for r in data["rows"]:
        assert "<default>" in r["times_ms"] and r["best"] in r["times_ms"], r
        assert set(r["regret"]) == {"hybrid", "hybrid_choice", "fast", "heuristic"}
        assert r["regret"]["fast"] >= 0.0
    assert data["summary"]["hybrid"]["problems"] == 3
    assert "geomean" in capsys.readouterr().out
    assert os.environ["NNPRIM_CACHE_DIR"] == str(tmp_path / "cache")  # restored


def test_regret_replay_reprices_a_stored_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NNPRIM_CACHE_DIR", str(tmp_path / "cache"))

    def load(name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    run, out = tmp_path / "regret.json", tmp_path / "replay.json"
    assert load("regret").main(["--device", "cpu", "--count", "2", "--families", "resnet", "--reps", "2",
                                "--out", str(run)]) == 0
    assert load("regret_replay").main([str(run), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    stored = {r["name"]: r for r in json.loads(run.read_text())["rows"]}
    assert len(data["rows"]) == 2
    for r in data["rows"]:
        times = stored[r["name"]]["times_ms"]
        assert r["fast"] in times and r["heuristic"] in times
        best = min(t for n, t in times.items() if n != "<default>")
        assert r["regret"]["fast"] == pytest.approx(times[r["fast"]] / best - 1.0)
    assert "fast" in data["summary"] and "geomean" in capsys.readouterr().out


def test_regret_replay_reports_choices_it_cannot_price(tmp_path, monkeypatch, capsys):
    """A choice the stored run did not time (a solver added since) is not silently replaced:
    the row lists it and the summary counts it as unpriced."""
    monkeypatch.setenv("NNPRIM_CACHE_DIR", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("regret_replay", os.path.join(ROOT, "benchmarks", "regret_replay.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    p = conv_problem(dict(N=1, C=8, K=8, spatial=[8, 8], filter=[3, 3], padding=[1, 1]), dtype=torch.float32,
                     device="cpu", direction="fwd")
    sols = mod.heuristic_choice.__globals__["immediate"].heuristic_solutions(p)
    assert len(sols) >= 2
    first, second = sols[0].solver, sols[1].solver
    run = dict(fingerprint="cpu:test", rows=[dict(name="only_second", key=p.key(), times_ms={second: 1.0})])
    path, out = tmp_path / "run.json", tmp_path / "out.json"
    path.write_text(json.dumps(run))
    assert mod.main([str(path), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["heuristic"] == second and row["unpriced"]["heuristic"] == [first]
    assert json.loads(out.read_text())["summary"]["heuristic"]["unpriced"] == 1
    assert "not timed in this run" in capsys.readouterr().out
