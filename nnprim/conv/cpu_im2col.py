"""Blocking, thread partitioning and im2col / col2im views for the CPU GEMM
convolution solvers (`cpu_gemm.py`).

The GEMM convolution works on blocks of output positions. A block is a range of
images, or one image and a range along one output spatial dim (the dims before it
fixed to one index, the dims after it whole): the smallest such unit whose column
buffer (output positions x C*prod(filter) values of the GEMM dtype) fits under the cap. That
keeps a thread's column buffer bounded whatever the problem size, like the seed's
`os_block` / `oh_block` blocking.

im2col is one strided copy: the input region a block reads (for problems with
padding, the block's images zero-padded once in a staging buffer: `stage_images`) is
viewed with `as_strided` as (.., filter.., out..) and copied into the column buffer,
converting to the GEMM dtype on the way. col2im is one strided `add_` per filter tap
into an f32 accumulator of the padded input.

Work is split across threads as oneDNN's `balance211` does."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..problems.conv import ConvProblem

F32 = torch.float32
COL_CAP_BYTES = 32 << 20   # hard cap of one thread's column buffer


def balance211(n: int, nthr: int, ithr: int) -> tuple[int, int]:
    """oneDNN's balance211: split n items over nthr threads; the first n % nthr
    threads get one more. Returns thread ithr's [start, end)."""
    if nthr <= 1 or n == 0:
        return 0, n
    n1 = -(-n // nthr)          # ceil
    n2 = n1 - 1
    t1 = n - n2 * nthr          # threads that take n1 items
    if ithr < t1:
        start = n1 * ithr
        return start, start + n1
    start = n1 * t1 + n2 * (ithr - t1)
    return start, start + n2


@dataclass(frozen=True)
class Block:
    """Output positions [n0, n1) x prod over spatial dims of [lo[i], hi[i])."""

    n0: int
    n1: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def nb(self) -> int:
        return self.n1 - self.n0

    @property
    def out(self) -> tuple[int, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi))

    @property
    def positions(self) -> int:
        return self.nb * math.prod(self.out)


def plan_blocks(n0: int, n1: int, out_size: tuple[int, ...], bytes_per_pos: int,
                cap: int, min_blocks: int = 1) -> list[Block]:
    """Blocks covering images [n0, n1) x the whole output, each at most `cap` bytes of
    column buffer (at least one position per block), in image-major order.
    `min_blocks` asks for at least that many blocks where the sizes allow."""
    dims = (n1 - n0, *out_size)
    j = 0
    while j < len(dims) - 1 and math.prod(dims[j + 1:]) * bytes_per_pos > cap:
        j += 1
    inner = math.prod(dims[j + 1:])
    chunk = max(1, min(dims[j], cap // max(1, inner * bytes_per_pos)))
    outer = math.prod(dims[:j])
    nblk = -(-dims[j] // chunk)
    if outer * nblk < min_blocks:
        nblk = min(dims[j], -(-min_blocks // outer))
    chunk = -(-dims[j] // nblk)
    blocks = []
    for prefix in itertools.product(*(range(d) for d in dims[:j])):
        for a in range(0, dims[j], chunk):
            b = min(dims[j], a + chunk)
            rng = [(i, i + 1) for i in prefix] + [(a, b)] + [(0, d) for d in dims[j + 1:]]
            (na, nb_), *sp = rng
            blocks.append(Block(n0 + na, n0 + nb_, tuple(s[0] for s in sp), tuple(s[1] for s in sp)))
    return blocks


# ---- input regions --------------------------------------------------------------
def in_region(p: ConvProblem, blk: Block) -> tuple[tuple[int, int], ...]:
    """Per spatial dim, the input range [start, stop) (padded coordinates may be
    negative or past the input) that block `blk` reads."""
    return tuple((lo * s - pb, (hi - 1) * s - pb + (f - 1) * d + 1)
                 for lo, hi, s, d, f, pb in zip(blk.lo, blk.hi, p.stride, p.dilation, p.filter,
                                                p.pad_before))


def touches_padding(p: ConvProblem, blk: Block) -> bool:
    return any(a < 0 or b > n for (a, b), n in zip(in_region(p, blk), p.in_size))


def has_padding(p: ConvProblem) -> bool:
    return any(p.pad_before) or any(p.pad_after)


def padded_size(p: ConvProblem) -> tuple[int, ...]:
    return tuple(i + a + b for i, a, b in zip(p.in_size, p.pad_before, p.pad_after))


def stage_numel(p: ConvProblem, nb: int) -> int:
    """Elements of the staging buffer holding nb zero-padded images."""
    return nb * p.C * math.prod(padded_size(p))


def physical(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Logical N,C,*sp tensor -> its physical view (N,C,*sp or N,*sp,C)."""
    if layout == "nchw":
        return t
    return t.permute(0, *range(2, t.dim()), 1)


def logical(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Physical view -> logical N,C,*sp view."""
    if layout == "nchw":
        return t
    nd = t.dim()
    return t.permute(0, nd - 1, *range(1, nd - 1))


def stage_images(p: ConvProblem, x: torch.Tensor, n0: int, n1: int, stage: torch.Tensor,
                 zero_halo: bool = True) -> torch.Tensor:
    """Images [n0, n1) of x, zero-padded, in `stage` (physical layout, input dtype),
    laid out as the first n1-n0 of as many images as `stage` holds, so the halo sits
    at the same places for every call: it is zeroed only when `zero_halo` (a worker's
    first call), and each image's interior is copied once however many blocks then
    read it (the seed pads each image once, not each block)."""
    nb = n1 - n0
    pz = padded_size(p)
    cap = max(nb, stage.numel() // stage_numel(p, 1))
    shape = (cap, p.C, *pz) if p.layout == "nchw" else (cap, *pz, p.C)
    st = stage[:math.prod(shape)].view(shape)
    stl = logical(st, p.layout)
    if zero_halo:
        stage[math.prod(shape):].zero_()        # slack past the images (read by junk columns)
        for i, (pb, n, pa) in enumerate(zip(p.pad_before, p.in_size, p.pad_after)):
            if pb:
                stl.narrow(2 + i, 0, pb).zero_()
            if pa:
                stl.narrow(2 + i, pb + n, pa).zero_()
    inner = (slice(0, nb), slice(None), *(slice(pb, pb + n) for pb, n in zip(p.pad_before, p.in_size)))
    stl[inner].copy_(x[n0:n1])
    return st[:nb]


def block_source(p: ConvProblem, src: torch.Tensor, blk: Block, n_base: int, padded: bool) -> torch.Tensor:
    """The physical view of the region block `blk` reads, starting at its first image
    and first input position: `src` is the physical view of images from n_base on,
    zero-padded (a `stage_images` result) or not (x itself, for problems without
    padding)."""
    starts = [lo * s - (0 if padded else pb) for lo, s, pb in zip(blk.lo, p.stride, p.pad_before)]
    sp = tuple(slice(a, None) for a in starts)
    nsl = slice(blk.n0 - n_base, blk.n1 - n_base)
    if p.layout == "nchw":
        return src[(nsl, slice(None), *sp)]
    return src[(nsl, *sp, slice(None))]


def _axes(p: ConvProblem, t: torch.Tensor, blk: Block, order: str, fstep: bool = True):
    """Shape and strides of the axes in `order` over physical tensor t (its n axis at
    blk.n0 - offset already applied by the caller): n, g, c, f.. (filter taps, stride
    dilation * spatial stride), o.. (block outputs, stride conv-stride * spatial stride)."""
    G, Cg = p.groups, p.C // p.groups
    st = t.stride()
    if p.layout == "nchw":
        sn, sc, ssp = st[0], st[1], st[2:]
    else:
        sn, sc, ssp = st[0], st[-1], st[1:-1]
    axes = {
        "n": ([blk.nb], [sn]),
        "g": ([G], [Cg * sc]),
        "c": ([Cg], [sc]),
        "f": (list(p.filter), [d * s for d, s in zip(p.dilation, ssp)]),
        "o": (list(blk.out), [s * t_ for s, t_ in zip(p.stride, ssp)]),
    }
    shape: list[int] = []
    strides: list[int] = []
    for a in order:
        shape += axes[a][0]
        strides += axes[a][1]
    return shape, strides, sn, ssp


def col_view(p: ConvProblem, src: torch.Tensor, blk: Block, order: str) -> torch.Tensor:
    """as_strided view of a physical source region (starting at the block's first
    image and first input position): element (n, g, c, f.., o..) is
    src[n, g*Cg + c, o*s + f*d ..] (nchw) / src[n, o*s + f*d .., g*Cg + c] (nhwc).
    `order` names the axes' order, e.g. "gcfno" (f and o expand to one axis per
    spatial dim)."""
    shape, strides, _, _ = _axes(p, src, blk, order)
    return src.as_strided(shape, strides, src.storage_offset())


def axes_shape(p: ConvProblem, blk: Block, order: str) -> list[int]:
    sizes = {"n": [blk.nb], "g": [p.groups], "c": [p.C // p.groups], "f": list(p.filter),
             "o": list(blk.out)}
    return [v for a in order for v in sizes[a]]


def scatter_taps(p: ConvProblem, col: torch.Tensor, order: str, acc: torch.Tensor, blk: Block,
                 nb_base: int) -> None:
    """col2im: add the column tile `col` (f32, laid out in `order`, contiguous) into
    `acc`, the f32 physical accumulator of the zero-padded input of the images from
    `nb_base` on, one strided add_ per filter tap."""
    col = col.view(axes_shape(p, blk, order))
    rest = order.replace("f", "")
    shape, strides, sn, ssp = _axes(p, acc, blk, rest)
    base = acc.storage_offset() + (blk.n0 - nb_base) * sn + sum(
        lo * s * t for lo, s, t in zip(blk.lo, p.stride, ssp))
    nd = p.ndim
    fpos = sum(nd if a == "o" else 1 for a in order[:order.index("f")])
    for f in itertools.product(*(range(k) for k in p.filter)):
        off = base + sum(fi * d * t for fi, d, t in zip(f, p.dilation, ssp))
        dst = acc.as_strided(shape, strides, off)
        dst.add_(col[(slice(None),) * fpos + f])
