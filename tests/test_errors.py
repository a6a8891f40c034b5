"""Bad input: each invalid call raises the right error type with a message naming the
argument and value."""
import math

import pytest
import torch

import nnprim
from nnprim import BadParameterError, NotSupportedError

x = torch.randn(2, 4, 8, 8)
w = torch.randn(6, 4, 3, 3)
q = torch.randn(1, 4, 5, 16)
k = torch.randn(1, 2, 7, 16)
v = torch.randn(1, 2, 7, 16)

CONV_BAD = [
    ("x rank", lambda: nnprim.conv_forward(torch.randn(4, 8, 8), w), "x has"),
    ("x rank 6", lambda: nnprim.conv_forward(torch.randn(1, 1, 2, 2, 2, 2), torch.randn(1, 1, 1, 1, 1, 1)), "dims"),
    ("w rank", lambda: nnprim.conv_forward(x, torch.randn(6, 4, 3)), "w has"),
    ("channels", lambda: nnprim.conv_forward(x, torch.randn(6, 3, 3, 3)), "w.shape[1]=3"),
    ("groups C", lambda: nnprim.conv_forward(x, torch.randn(6, 4, 3, 3), groups=3), "groups=3"),
    ("groups K", lambda: nnprim.conv_forward(x, torch.randn(5, 2, 3, 3), groups=2), "groups=2"),
    ("groups 0", lambda: nnprim.conv_forward(x, w, groups=0), "groups=0"),
    ("stride 0", lambda: nnprim.conv_forward(x, w, stride=0), "stride"),
    ("stride len", lambda: nnprim.conv_forward(x, w, stride=(1, 1, 1)), "stride"),
    ("dilation 0", lambda: nnprim.conv_forward(x, w, dilation=0), "dilation"),
    ("negative pad", lambda: nnprim.conv_forward(x, w, padding=-1), "padding"),
    ("bad pad entry", lambda: nnprim.conv_forward(x, w, padding=((1, 2, 3), 1)), "padding"),
    ("output size", lambda: nnprim.conv_forward(x, torch.randn(6, 4, 9, 9)), "output size"),
    ("dtype mismatch", lambda: nnprim.conv_forward(x, w.double()), "w.dtype"),
    ("int dtype", lambda: nnprim.conv_forward(x.int(), w.int()), "x.dtype"),
    ("not a tensor", lambda: nnprim.conv_forward([1, 2], w), "x must be"),
    ("bias shape", lambda: nnprim.conv_forward(x, w, torch.randn(5)), "bias shape"),
    ("out_dtype", lambda: nnprim.conv_forward(x.bfloat16(), w.bfloat16(), out_dtype=torch.int8), "out_dtype"),
    ("sum shape", lambda: nnprim.conv_forward(x, w, post_ops=[nnprim.Sum(torch.randn(2, 6, 3, 3))]), "Sum tensor"),
    ("binary shape", lambda: nnprim.conv_forward(x, w, post_ops=[nnprim.Binary("add", torch.randn(7))]), "Binary tensor"),
    ("eltwise kind", lambda: nnprim.Eltwise("swish2"), "swish2"),
    ("binary op", lambda: nnprim.Binary("pow", torch.randn(1)), "pow"),
    ("post op type", lambda: nnprim.conv_forward(x, w, post_ops=["relu"]), "post_ops[0]"),
    ("bwd dy shape", lambda: nnprim.conv_backward_data(torch.randn(2, 6, 5, 5), w, x.shape), "dy shape"),
    ("bwd x_shape", lambda: nnprim.conv_backward_data(torch.randn(2, 6, 6, 6), w, "abc"), "x_shape"),
    ("bwd x_shape rank", lambda: nnprim.conv_backward_data(torch.randn(2, 6, 6, 6), w, (2, 4, 8)), "x_shape=(2, 4, 8)"),
    ("bwdw w_shape rank", lambda: nnprim.conv_backward_weights(torch.randn(2, 6, 6, 6), x, (6, 4, 3)), "w_shape=(6, 4, 3)"),
    ("bwdw dy shape", lambda: nnprim.conv_backward_weights(torch.randn(2, 6, 5, 5), x, w.shape), "dy shape"),
    ("bias grad rank", lambda: nnprim.conv_backward_bias(torch.randn(3, 3)), "dy has"),
    ("unknown solver", lambda: nnprim.conv_forward(x, w, solver="NoSuchSolver"), "NoSuchSolver"),
]

ATTN_BAD = [
    ("q rank", lambda: nnprim.sdpa(torch.randn(4, 5, 16), k, v), "q must be 4-D"),
    ("GQA", lambda: nnprim.sdpa(torch.randn(1, 3, 5, 16), k, v), "Hq=3"),
    ("head dim", lambda: nnprim.sdpa(q, torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)), "head dim"),
    ("Sk mismatch", lambda: nnprim.sdpa(q, k, torch.randn(1, 2, 6, 16)), "Sk=7"),
    ("batch", lambda: nnprim.sdpa(q, torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)), "batch"),
    ("kv heads", lambda: nnprim.sdpa(q, k, torch.randn(1, 1, 7, 16)), "heads"),
    ("dtype", lambda: nnprim.sdpa(q, k.half(), v), "k.dtype"),
    ("mask shape", lambda: nnprim.sdpa(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool)), "attn_mask shape"),
    ("mask dtype", lambda: nnprim.sdpa(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.int32)), "attn_mask.dtype"),
    ("causal", lambda: nnprim.sdpa(q, k, v, causal="upper"), "causal='upper'"),
    ("scale zero", lambda: nnprim.sdpa(q, k, v, scale=0.0), "scale=0.0"),
    ("scale tensor", lambda: nnprim.sdpa(q, k, v, scale=torch.ones(2)), "scale tensor"),
    ("dropout", lambda: nnprim.sdpa(q, k, v, dropout_p=1.0), "dropout_p=1.0"),
    ("seed", lambda: nnprim.sdpa(q, k, v, seed=-1), "seed=-1"),
    ("kv_lens shape", lambda: nnprim.sdpa(q, k, v, kv_lens=torch.tensor([3, 4])), "kv_lens shape"),
    ("kv_lens value", lambda: nnprim.sdpa(q, k, v, kv_lens=torch.tensor([8])), "kv_lens values"),
    ("kv_lens dtype", lambda: nnprim.sdpa(q, k, v, kv_lens=torch.tensor([3.0])), "kv_lens"),
    ("kv_lens list", lambda: nnprim.sdpa(q, k, v, kv_lens=[3]), "kv_lens must be a torch.Tensor"),
    ("mask list", lambda: nnprim.sdpa(q, k, v, attn_mask=[[0.0] * 7] * 5), "attn_mask must be a torch.Tensor"),
    ("bwd kv_lens list", lambda: nnprim.sdpa_backward(q, q, k, v, q, torch.zeros(1, 4, 5), kv_lens=[3]), "kv_lens must"),
    ("Conv2d groups", lambda: nnprim.nn.Conv2d(3, 4, 3, groups=2), "in_channels=3 must be divisible by groups=2"),
    ("Conv2d kernel", lambda: nnprim.nn.Conv2d(3, 4, 0), "kernel_size=0"),
    ("Conv3d kernel len", lambda: nnprim.nn.Conv3d(3, 4, (3, 3)), "kernel_size=(3, 3)"),
    ("Conv1d channels", lambda: nnprim.nn.Conv1d(0, 4, 3), "in_channels=0"),
    ("Attention heads", lambda: nnprim.nn.Attention(10, 3), "embed_dim=10"),
    ("Attention kv heads", lambda: nnprim.nn.Attention(16, 4, num_kv_heads=3), "num_kv_heads=3"),
    ("Attention dropout", lambda: nnprim.nn.Attention(16, 4, dropout=1.0), "dropout=1.0"),
    ("Attention causal", lambda: nnprim.nn.Attention(16, 4, causal="upper"), "causal='upper'"),
    ("Attention input", lambda: nnprim.nn.Attention(16, 4)(torch.randn(2, 5, 12)), "embed_dim=16"),
    ("Attention memory", lambda: nnprim.nn.Attention(16, 4)(torch.randn(2, 5, 16), torch.randn(3, 6, 16)), "memory"),
    ("quant group", lambda: nnprim.quantize_kv(k, "s8", group_size=5), "group_size=5"),
    ("quant dtype", lambda: nnprim.quantize_kv(k, "s3"), "s3"),
    ("bwd lse shape", lambda: nnprim.sdpa_backward(q, q, k, v, q, torch.zeros(1, 4)), "lse shape"),
    ("bwd do shape", lambda: nnprim.sdpa_backward(torch.randn(1, 4, 5, 8), q, k, v, q, torch.zeros(1, 4, 5)), "do shape"),
]


@pytest.mark.parametrize("name,call,needle", CONV_BAD + ATTN_BAD, ids=[c[0] for c in CONV_BAD + ATTN_BAD])
def test_bad_parameter(name, call, needle):
    with pytest.raises(BadParameterError) as e:
        call()
    assert needle in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


def test_not_supported_quantized_backward():
    kq = nnprim.quantize_kv(k, "s8", 16)
    with pytest.raises(NotSupportedError, match="quantized"):
        nnprim.sdpa_backward(q, q, kq, v, q, torch.zeros(1, 4, 5))


def test_forced_solver_not_applicable_says_why():
    with pytest.raises(NotSupportedError) as e:
        nnprim.sdpa(q, k, v, solver="ConvReference")
    assert "ConvReference" in str(e.value) and "serves conv" in str(e.value)
    dy = torch.randn(2, 6, 6, 6)
    for call in (lambda: nnprim.conv_forward(x, w, solver="flash_fwd"), lambda: nnprim.conv_forward(x, w, solver=110),
                 lambda: nnprim.conv_backward_weights(dy, x, w.shape, solver="decode_split_k"),
                 lambda: nnprim.conv_backward_data(dy, w, x.shape, solver="gluon_flash_fwd")):
        with pytest.raises(NotSupportedError, match="serves attention"):     # not an AttributeError
            call()


@pytest.mark.parametrize("qkv_grad", [True, False])
def test_no_silent_none_gradient_for_mask_or_scale(qkv_grad):
    """sdpa's gradients are q's, k's and v's: a mask or tensor scale asking for one raises,
    whether or not q, k, v ask too (the memoised path as well as the general one)."""
    qg = q.clone().requires_grad_(qkv_grad)
    mask = torch.zeros(5, 7, requires_grad=True)
    for _ in range(2):
        with pytest.raises(NotSupportedError, match="attn_mask requires grad"):
            nnprim.sdpa(qg, k, v, attn_mask=mask)
    with pytest.raises(NotSupportedError, match="scale requires grad"):
        nnprim.sdpa(qg, k, v, scale=torch.tensor(0.5, requires_grad=True))
    with torch.no_grad():
        nnprim.sdpa(qg, k, v, attn_mask=mask)


def test_double_backward_raises():
    qg = q.clone().requires_grad_()
    with pytest.raises(NotSupportedError, match="double backward"):
        torch.autograd.grad(nnprim.sdpa(qg, k, v).sum(), qg, create_graph=True)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_double_backward_right_or_raises(dtype):
    """conv under create_graph=True: a solver built of torch ops gives gradients with a graph,
    and the second derivative must equal torch's; a native kernel's raise instead."""
    g = torch.Generator().manual_seed(0)
    xs, ws = torch.randn(1, 3, 6, 6, generator=g, dtype=dtype), torch.randn(2, 3, 3, 3, generator=g, dtype=dtype)
    second = []
    for conv in (nnprim.conv_forward, torch.nn.functional.conv2d):
        xg, wg = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        try:
            (gx,) = torch.autograd.grad((conv(xg, wg, padding=1) ** 2).sum(), xg, create_graph=True)
        except NotSupportedError as e:
            assert conv is nnprim.conv_forward and "double backward" in str(e)
            return
        second.append(torch.autograd.grad(gx.sum(), wg))
    torch.testing.assert_close(second[0], second[1])


def test_backward_o_and_do_in_q_dtype():
    lse = torch.zeros(1, 4, 5)
    with pytest.raises(BadParameterError, match="o.dtype"):
        nnprim.sdpa_backward(q, q, k, v, q.bfloat16(), lse)
    with pytest.raises(BadParameterError, match="do.dtype"):
        nnprim.sdpa_backward(q.bfloat16(), q, k, v, q, lse)


def test_post_op_fields_checked():
    """A Sum without a tensor, or non-numeric scale / alpha / beta: BadParameterError naming
    the field (they reached AttributeError, a torch schema error or every solver failing)."""
    for op, needle in ((nnprim.Sum(3.0), "post_ops[0].tensor"), (nnprim.Sum(None), "post_ops[0].tensor"),
                       (nnprim.Sum(torch.randn(2, 6, 6, 6), scale="a"), "post_ops[0].scale"),
                       (nnprim.Eltwise("relu", alpha="a"), "post_ops[0].alpha"),
                       (nnprim.Eltwise("clip", beta=None), "post_ops[0].beta")):
        for grad in (False, True):
            with torch.set_grad_enabled(grad), pytest.raises(BadParameterError, match=needle.replace("[", r"\[")):
                nnprim.conv_forward(x.clone().requires_grad_(grad), w, post_ops=[op])


def test_memoised_calls_validate_what_differs():
    """The hot path's memo keys its raw arguments: a call equal to a validated one but with
    other types (True == 1 == 1.0) or a non-int shape entry is validated, not served."""
    dy = torch.randn(2, 6, 6, 6)
    nnprim.conv_forward(x, w)
    nnprim.conv_backward_data(dy, w, (2, 4, 8, 8))
    for kw in (dict(groups=1.0), dict(groups=True), dict(stride=True), dict(padding=0.0)):
        with pytest.raises(BadParameterError):
            nnprim.conv_forward(x, w, **kw)
    for shape in ((2, 4, 8.5, 8), "2488"):
        with pytest.raises(BadParameterError, match="x_shape"):
            nnprim.conv_backward_data(dy, w, shape)
    with pytest.raises(BadParameterError, match="w_shape"):
        nnprim.conv_backward_weights(dy, x, (6, 4, 3.0, 3))


def test_search_entry_points_check_the_problem():
    p = nnprim.ConvProblem.from_tensors(x, w, direction="fwd", padding=1)
    for call in (lambda: nnprim.find("junk"), lambda: nnprim.get_solutions(42), lambda: nnprim.explain(42),
                 lambda: nnprim.workspace_size(42, "CpuGemmFwd"), lambda: nnprim.compile(None, "CpuGemmFwd")):
        with pytest.raises(BadParameterError, match="ConvProblem or an AttentionProblem"):
            call()
    with pytest.raises(BadParameterError, match="tensors=42"):
        nnprim.find(p, tensors=42)


def test_post_ops_validated_on_the_gradient_path():
    """With a gradient needed the chain runs in torch on the f32 accumulator: its tensors and
    out_dtype are still checked as the fused call checks them (a (1, 6, 1, 1) Sum, an N=2
    Binary, an int tensor and out_dtype=int32 were accepted)."""
    bad = (dict(post_ops=[nnprim.Sum(torch.randn(1, 6, 1, 1))]),
           dict(post_ops=[nnprim.Binary("add", torch.randn(4, 6, 6, 6))]),
           dict(post_ops=[nnprim.Binary("add", torch.ones(6, dtype=torch.int64))]),
           dict(post_ops=[nnprim.Sum(torch.randn(2, 6, 6, 6, device="meta"))]),
           dict(post_ops=[nnprim.Eltwise("relu")], out_dtype=torch.int32),
           dict(post_ops=[nnprim.Eltwise("relu")], out_dtype=torch.float64))
    for kw in bad:
        for grad in (False, True):
            with pytest.raises(BadParameterError):
                nnprim.conv_forward(x.clone().requires_grad_(grad), w, **kw)


def test_check_numerics_on_the_gradient_path(monkeypatch):
    from nnprim.errors import NumericsError
    from nnprim.search.modes import SETTINGS
    monkeypatch.setattr(SETTINGS, "check_numerics", True)
    res = torch.randn(2, 6, 6, 6)
    res[0, 0, 0, 0] = math.nan
    xg = x.clone().requires_grad_()
    with pytest.raises(NumericsError, match=r"post_ops\[0\].tensor"):
        nnprim.conv_forward(xg, w, post_ops=[nnprim.Sum(res)])
    with pytest.raises(NumericsError, match="'out'"):
        nnprim.conv_forward(xg, w, post_ops=[nnprim.Eltwise("log")])
    with pytest.raises(NumericsError, match="'dy'"):
        nnprim.conv_backward_bias(res)


@pytest.mark.parametrize("padding", [((1.5, 1), (0, 0)), ((True, 0), (0, 0)), ((1, "2"), (0, 0))])
def test_padding_pairs_are_ints(padding):
    with pytest.raises(BadParameterError, match="padding"):
        nnprim.conv_forward(x, w, padding=padding)


def test_tensor_scale_value_checked():
    q = torch.randn(1, 2, 5, 8)
    for s in (torch.tensor(0.0), torch.tensor([0.0]), torch.tensor(math.nan), torch.tensor(math.inf)):
        for invert in (False, True):
            with pytest.raises(BadParameterError, match="scale"):
                nnprim.sdpa(q, q, q, scale=s, invert_scale=invert)
