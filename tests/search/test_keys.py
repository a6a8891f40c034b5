"""problem_from_key: conv and attention keys round-trip; anything else gives None."""
import pytest
import torch

from nnprim.problems.attention import AttentionProblem
from nnprim.problems.conv import ConvProblem
from nnprim.search.keys import problem_from_key

_CONV = [
    dict(direction="fwd", x_shape=(2, 3, 17), w_shape=(5, 3, 3), dtype=torch.float32, padding=1),
    dict(direction="bwd_data", x_shape=(1, 8, 9, 11), w_shape=(4, 2, 3, 5), dtype=torch.bfloat16, groups=4,
         stride=(2, 1), dilation=(1, 2), padding=((1, 0), (2, 3)), layout="nhwc", device="cuda"),
    dict(direction="bwd_weights", x_shape=(2, 4, 5, 6, 7), w_shape=(6, 4, 1, 3, 3), dtype=torch.float16,
         stride=(1, 2, 2), padding="valid", out_dtype=torch.float32),
    dict(direction="fwd", x_shape=(1, 16, 8, 8), w_shape=(16, 1, 3, 3), dtype=torch.float64, groups=16,
         padding="same", has_bias=True,
         post_ops=(("eltwise", "clip", -1.0, 6.0), ("sum", 0.5), ("binary", "add", (1, 16, 1, 1)))),
    dict(direction="fwd", x_shape=(1, 4, 8, 8), w_shape=(4, 4, 3, 3), dtype=torch.float32,
         out_dtype=torch.bfloat16),
]


@pytest.mark.parametrize("kw", _CONV, ids=lambda kw: f"conv{len(kw['x_shape']) - 2}d-{kw['direction']}")
def test_conv_keys_round_trip(kw):
    kw = dict(kw)
    p = ConvProblem.create(kw.pop("direction"), kw.pop("x_shape"), kw.pop("w_shape"), **kw)
    q = problem_from_key(p.key())
    assert q == p
    assert problem_from_key(p.key() + "|deterministic") == p


_ATTN = [
    dict(direction="fwd", B=2, Hq=8, Hkv=2, Sq=128, Sk=256, D=64, Dv=64, dtype=torch.float16, device="cuda",
         causal="bottom_right", return_lse=True),
    dict(direction="bwd", B=1, Hq=4, Hkv=4, Sq=33, Sk=17, D=96, Dv=40, dtype=torch.bfloat16, device="cpu",
         causal="top_left", mask="additive", mask_shape=(1, 4, 33, 17), scale="float", invert_scale=True,
         dropout_p=1e-5, return_lse=True),
    dict(direction="fwd", B=3, Hq=32, Hkv=8, Sq=1, Sk=4000, D=128, Dv=128, dtype=torch.float32, device="cuda",
         mask="bool", mask_shape=(3, 1, 1, 4000), scale="tensor", has_kv_lens=True, inf_as_zero=True,
         dropout_p=0.25),
    dict(direction="fwd", B=2, Hq=8, Hkv=2, Sq=1, Sk=512, D=64, Dv=64, dtype=torch.float16, device="cuda",
         has_kv_lens=True, k_quant=("s8", 64, "g", "float16", None), v_quant=("s4", 32, "g", "float16", "g", 1),
         page_size=16),
    dict(direction="fwd", B=1, Hq=2, Hkv=1, Sq=64, Sk=64, D=64, Dv=64, dtype=torch.float8_e4m3fn,
         device="cuda", out_dtype=torch.bfloat16, descale="tth"),
    dict(direction="fwd", B=4, Hq=8, Hkv=2, Sq=1, Sk=300, D=64, Dv=64, dtype=torch.bfloat16, device="cuda",
         k_quant=("s8", 32, "g", "bfloat16", None, "keys"), v_quant=("u4", 64, "g", "bfloat16", "g", 1, "keys")),
]


@pytest.mark.parametrize("kw", _ATTN, ids=lambda kw: f"attn-{kw['direction']}-{kw['dtype']}")
def test_attention_keys_round_trip(kw):
    p = AttentionProblem(**kw)
    assert problem_from_key(p.key()) == p


@pytest.mark.parametrize("key", [
    "", "nonsense", "conv2d-fwd-garbage", "conv4d-fwd-n1c1i1x1-k1f1x1-o1x1-s1x1-p0x0_0x0-d1x1-g1-nchw-f32f32-cpu",
    "conv2d-fwd-n1c4i8x8-k4f3x3-o8x8-s1x1-p1x1_1x1-d1x1-g3-nchw-f32f32-cpu",      # groups do not divide C
    "conv2d-fwd-n1c4i8x8-k4f3x3-o9x9-s1x1-p1x1_1x1-d1x1-g1-nchw-f32f32-cpu",      # wrong output size
    "conv2d-fwd-n1c4i8x8-k4f3x3-o8x8-s1x1-p1x1_1x1-d1x1-g1-nchw-f32f32-cpu-eltwise:relu",
    "conv2d-sideways-n1c4i8x8-k4f3x3-o8x8-s1x1-p1x1_1x1-d1x1-g1-nchw-f32f32-cpu",
    "conv2d-fwd-n1c4i8-k4f3x3-o8x8-s1x1-p1x1_1x1-d1x1-g1-nchw-f32f32-cpu",         # dims disagree
    "attn-fwd-b2hq8hkv3-sq1sk8-d64dv64-f16-cuda-cnone-scdefault",                   # Hq % Hkv
    "attn-fwd-b2hq8hkv2-sq1sk8-d64dv64-f16-cuda-cnone-scdefault-zzz",
    "attn-fwd-b2hq8hkv2-sq1sk8-d64dv64-i8-cuda-cnone-scdefault",
    "attn-bwd-b2hq8hkv2-sq1sk8-d64dv64-f16-cuda-cnone-scdefault-lse-kqs8:64:g:float16:None",  # bwd + quant
    "attn-fwd-b2hq8hkv2-sq1sk8-d64dv64-f16-cuda-cnone",                             # scale part missing
    "attn-fwd-b2hq8hkv2-sq1sk8-d64dv64-f16-cuda-cnone-scdefault-kqs8:64:g:float16:None:rows",  # not "keys"
])
def test_unparseable_keys_give_none(key):
    assert problem_from_key(key) is None


def test_non_string_gives_none():
    assert problem_from_key(None) is None and problem_from_key(42) is None
