"""Ring communication for context parallelism: each transfer sends a buffer to the next
rank of the group and receives the previous rank's buffer of the same shape.

`P2PRing.start(send, recv)` issues both with `torch.distributed.batch_isend_irecv` and
returns at once; `.wait()` on the result returns `recv`, filled. On CUDA the P2P ops are
issued from a side stream that first waits for the compute stream (so `send` is ready and
`recv` is no longer read by earlier kernels); NCCL runs them on its own stream, and
`wait()` makes the compute stream wait for them, so kernels queued between start and wait
overlap the transfer. On CPU (gloo) the ops are async work handles.

`NullRing` has the same interface and moves nothing (`wait()` returns `send`): with it the
ring runs every step's compute on the local buffers, which measures compute alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# gloo matches messages by (peer, tag): K/V blocks and dK/dV partials travel on their own tags
TAG_KV = 7
TAG_DKV = 8


class _Pending:
    """An in-flight ring transfer."""

    def __init__(self, works: list, recv: torch.Tensor) -> None:
        self._works, self._recv = works, recv

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        return self._recv


class P2PRing:
    """Send to rank (r + 1) % world, receive from rank (r - 1) % world of `group`."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # P2P ops name peers by global rank
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> _Pending:
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        if self.stream is None:
            return _Pending(dist.batch_isend_irecv(ops), recv)
        self.stream.wait_stream(torch.cuda.current_stream(send.device))
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        return _Pending(works, recv)


class NullRing:
    """A ring that moves nothing (for measuring the compute of a ring schedule alone)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> _Pending:
        return _Pending([], send)
