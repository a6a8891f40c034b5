"""The `nnprim` driver through subprocess: exit codes and output."""
import json
import os
import subprocess
import sys

import pytest

ENV = dict(os.environ)


def run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "nnprim", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_conv_verify_ok(tmp_path):
    out = tmp_path / "r.json"
    r = run("conv", "-n", "2", "-c", "4", "-k", "6", "--spatial", "9,7", "--filter", "3,3", "--pad", "1,0,2,1",
            "--stride", "2", "--bias", "--post", "sum,relu", "--time", "--reps", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "solver=" in r.stdout and "OK" in r.stdout
    res = json.loads(out.read_text())
    assert res["verified"] and res["time_ms"] > 0


def test_attn_verify_ok():
    r = run("attn", "-b", "1", "--hq", "4", "--hkv", "2", "--sq", "5", "--sk", "9", "-d", "8", "--causal",
            "bottom_right", "--mask", "bool")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "OK" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("conv", "-c", "3", "-k", "4", "--spatial", "9,9", "--filter", "3,3", "-g", "2"), "groups=2"),
    (("conv", "-c", "3", "-k", "4", "--spatial", "9,9"), "required"),
    (("conv", "-c", "3", "-k", "4", "--spatial", "9,a", "--filter", "3,3"), "ints"),
    (("attn", "--hq", "3", "--hkv", "2", "--sq", "4", "-d", "8"), "Hq=3"),
    (("bench", "--suite", "no_such_suite"), "no_such_suite"),
    (("frobnicate",), "invalid choice"),
])
def test_bad_arguments_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_values_and_paths_exit_2_in_one_line(tmp_path, capsys):
    """Found by fuzzing: these ended in a traceback (or ran with a default in place of 0)."""
    from nnprim.cli import main
    conv = ["conv", "-c", "3", "-k", "4", "--spatial", "8,8", "--filter", "3,3"]
    cases = [(["conv", "-c", "-3", "-k", "4", "--spatial", "8,8", "--filter", "3,3"], "positive int"),
             ([*conv, "-g", "0"], "positive int"), ([*conv, "--time", "--reps", "0"], "positive int"),
             ([*conv, "--json", str(tmp_path / "no" / "r.json")], "No such file"),
             (["attn", "--hq", "2", "--sq", "4", "-d", "8", "--sk", "0"], "positive int"),
             ([*conv, "--direction", "bwd_data", "--post", "relu"], "--post relu applies to --direction fwd"),
             (["warmup", "--suite", "conv_cpu", "--scale", "tiny"], "--models only"),
             (["bench", "--suite", str(tmp_path)], "Is a directory"),
             (["bench", "--suite", "conv_cpu", "--only", "nosuch"], "nosuch"),
             (["db", "import", str(tmp_path)], "Is a directory")]
    for args, needle in cases:
        try:
            rc = main(args)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and "Traceback" not in err, (args, rc, err)


def test_bench_small_suite(tmp_path):
    out = tmp_path / "b.json"
    r = run("bench", "--suite", "conv_cpu", "--scale", "8", "--limit", "2", "--reps", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(row["ok"] for row in rows)


def test_bench_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    from nnprim.cli import main
    rows = [dict(name="a", direction="fwd", ms=1.0, tflops=10.0, tbps=0.5, peer_ms=1.5, peer_tflops=6.7,
                 speedup=1.5),
            dict(name="b", direction="bwd", ms=2.0, tflops=5.0, tbps=1.0, peer_ms=1.0, peer_tflops=10.0,
                 speedup=0.5)]
    src = tmp_path / "r.json"
    src.write_text(json.dumps(dict(suite="s", rows=rows)))
    assert main(["bench", "--suite", "conv_cpu", "--plot", str(tmp_path / "p.png"), "--from-json", str(src)]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_warmup_models_progress_and_triton_cache(tmp_path):
    env = dict(ENV, NNPRIM_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-m", "nnprim", "warmup", "--models", "resnet,decode", "--count", "2",
                        "--scale", "tiny", "--device", "cpu", "--workers", "1"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert "compile 2/2 [" in r.stderr and "find    2/2 [" in r.stderr and "'problems': 2" in r.stderr
    code = "import os, nnprim; print(os.environ['TRITON_CACHE_DIR'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert r.stdout.strip() == str(tmp_path / "cache" / "triton")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       env=dict(env, TRITON_CACHE_DIR=str(tmp_path / "mine")))
    assert r.stdout.strip() == str(tmp_path / "mine")  # the user's choice stays


def test_db_text_export_and_model_check(tmp_path):
    env = dict(ENV, NNPRIM_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / "sys.tsv"
    r = subprocess.run([sys.executable, "-m", "nnprim", "db", "export", str(out), "--system"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("device\tsolver_set\tproblem_key")
    r = subprocess.run([sys.executable, "-m", "nnprim", "db", "model-check", "--system"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert '"rank_accuracy"' in r.stdout


def test_quantized_decode_suite_keys_match_user_calls():
    """Every problem of the shipped decode_quant_gpu suite (at a small size) has the key of the
    public call a user makes with quantize_kv's arguments, so the system db's records serve it."""
    import torch

    from nnprim.cli.problem_args import attn_problem
    from nnprim.cli.suites import load_suite
    from nnprim.paged import to_pages
    from nnprim.problems.attention import AttentionProblem
    from nnprim.quant import quantize_kv
    _, specs = load_suite("decode_quant_gpu")
    sdt = {"bf16": torch.bfloat16, None: None}
    for spec in specs:
        spec = dict(spec, B=2, Hq=4, Hkv=2, Sk=128)
        p = attn_problem(spec, dtype=torch.bfloat16, device="cpu")
        q = torch.randn(2, 4, spec["Sq"], 128, dtype=torch.bfloat16)
        kw = dict(symmetric=spec.get("symmetric", True), scale_dtype=sdt[spec.get("scale_dtype")],
                  scale_per=spec.get("scale_per"))
        k, v = (quantize_kv(torch.randn(2, 2, 128, 128, dtype=torch.bfloat16), spec["kv_quant"],
                            spec.get("group_size") or 128, **kw) for _ in range(2))
        lens = bt = None
        if spec.get("page_size"):
            bt = torch.arange(2 * 128 // spec["page_size"], dtype=torch.int32).reshape(2, -1)
            k, v, lens = to_pages(k, bt), to_pages(v, bt), torch.full((2,), 128, dtype=torch.int32)
        causal = "bottom_right" if spec["causal"] else None      # the suites' causal on Sq < Sk
        user = AttentionProblem.from_tensors(q, k, v, causal=causal, kv_lens=lens, block_table=bt)
        assert p.key() == user.key(), spec["name"]


@pytest.mark.parametrize("fmt", [dict(kv_quant="s4", group_size=32, scale_dtype="bf16"),
                                 dict(kv_quant="u4", group_size=64, symmetric=False, page_size=16),
                                 dict(kv_quant="fp8_e4m3", scale_per="tensor", page_size=32),
                                 dict(page_size=16)])
def test_bench_case_of_a_quantized_or_paged_spec(fmt):
    """`nnprim bench` runs a decode_quant_gpu-style spec in its format (the suite's key), checks it
    against the reference and times torch's SDPA on the bf16 cache as the peer."""
    import torch

    from nnprim.cli.cases import attn_case
    from nnprim.cli.problem_args import attn_problem
    spec = dict(name="t", B=2, Hq=4, Hkv=2, Sq=1, Sk=64, D=64, causal=False, **fmt)
    case = attn_case(spec, dtype=torch.bfloat16, device="cpu")
    assert case.problem.key() == attn_problem(spec, dtype=torch.bfloat16, device="cpu").key()
    assert case.problem.page_size == fmt.get("page_size", 0)
    assert case.check() < 2e-2 and case.peer is not None
    ours, peer = case.call(), case.peer()
    assert ours.shape == peer.shape
