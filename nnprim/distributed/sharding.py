"""How a sequence is cut across the ranks of a context-parallel group.

`load_balance="zigzag"`: the sequence is cut into 2·world equal chunks and rank r holds
chunks r and 2·world−1−r, in that order (so every rank holds one early and one late chunk,
which balances causal attention). `"none"`: rank r holds the r-th of world equal chunks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import BadParameterError

LOAD_BALANCE = ("zigzag", "none")


def check_load_balance(load_balance: object) -> str:
    if load_balance not in LOAD_BALANCE:
        raise BadParameterError(f"load_balance={load_balance!r} must be one of {LOAD_BALANCE}")
    return load_balance  # type: ignore[return-value]


def num_chunks(world_size: int, load_balance: str) -> int:
    """Equal chunks the full sequence is cut into."""
    return 2 * world_size if check_load_balance(load_balance) == "zigzag" else world_size


def rank_chunks(rank: int, world_size: int, load_balance: str) -> tuple[int, ...]:
    """Indices of the chunks rank `rank` holds, in the order they are concatenated."""
    if check_load_balance(load_balance) == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def _check_rank(rank: int, world_size: int) -> None:
    if not (isinstance(world_size, int) and world_size >= 1):
        raise BadParameterError(f"world_size={world_size!r} must be a positive int")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise BadParameterError(f"rank={rank!r} must be an int in [0, world_size={world_size})")


def chunk_len(seq_len: int, world_size: int, load_balance: str, name: str = "seq_len") -> int:
    n = num_chunks(world_size, load_balance)
    if seq_len < n or seq_len % n:
        raise BadParameterError(
            f"{name}={seq_len} must be a positive multiple of {n} (load_balance={load_balance!r} cuts the "
            f"sequence into {'2*world_size' if load_balance == 'zigzag' else 'world_size'}={n} equal chunks)")
    return seq_len // n


def shard_positions(seq_len: int, rank: int, world_size: int, load_balance: str = "zigzag",
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (int64, in shard order) of the tokens rank `rank` holds: the position
    ids a rank needs for rotary embeddings or masks of its shard."""
    _check_rank(rank, world_size)
    c = chunk_len(seq_len, world_size, load_balance)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in rank_chunks(rank, world_size, load_balance)])


def _group_rank_world(group, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size) from the arguments, else from the process group."""
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise BadParameterError("group: torch.distributed is not initialised; call init_process_group "
                                    "or pass rank= and world_size=")
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    _check_rank(rank, world_size)
    return rank, world_size


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise BadParameterError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not (isinstance(dim, int) and -x.dim() <= dim < x.dim()):
        raise BadParameterError(f"dim={dim!r} is out of range for x of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, dim: int = 2, *, group=None, load_balance: str = "zigzag",
                   rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    """This rank's shard (a new contiguous tensor) of the full sequence `x` along `dim`
    (2 for (B, H, S, D)). rank/world_size default to the group's (group=None: the world)."""
    dim = _check_dim(x, dim)
    rank, world_size = _group_rank_world(group, rank, world_size)
    c = chunk_len(x.shape[dim], world_size, load_balance, name=f"x.shape[{dim}]")
    return torch.cat([x.narrow(dim, i * c, c) for i in rank_chunks(rank, world_size, load_balance)], dim=dim)


def assemble_shards(shards: list[torch.Tensor], dim: int = 2, load_balance: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard (shards[r] of rank r), the inverse of
    shard_sequence."""
    world_size = len(shards)
    if world_size == 0:
        raise BadParameterError("shards must hold one tensor per rank, got none")
    dim = _check_dim(shards[0], dim)
    per = num_chunks(world_size, load_balance) // world_size
    sizes = {tuple(s.shape) for s in shards}
    if len(sizes) != 1 or shards[0].shape[dim] % per:
        raise BadParameterError(f"shards must have one shape with shape[{dim}] divisible by {per}, got {sorted(sizes)}")
    c = shards[0].shape[dim] // per
    chunks: dict[int, torch.Tensor] = {}
    for r, s in enumerate(shards):
        for j, i in enumerate(rank_chunks(r, world_size, load_balance)):
            chunks[i] = s.narrow(dim, j * c, c)
    return torch.cat([chunks[i] for i in range(len(chunks))], dim=dim)


def unshard_sequence(x: torch.Tensor, dim: int = 2, *, group=None, load_balance: str = "zigzag") -> torch.Tensor:
    """The full sequence on every rank from each rank's shard `x` (an all-gather over the
    group, then the chunks put back in order). Not differentiable."""
    dim = _check_dim(x, dim)
    _, world_size = _group_rank_world(group, None, None)
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return assemble_shards(parts, dim, load_balance)
