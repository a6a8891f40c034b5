"""Attention across GPUs: context-parallel (ring) attention over torch.distributed.

    o = context_parallel_sdpa(q, k, v, group=None, causal=None, load_balance="zigzag",
                              return_lse=False, scale=None)

Each of the W ranks of `group` holds a shard of the sequence (dim 2 of q, k, v); the result
is this rank's shard of the exact attention over the whole sequence. NCCL on GPUs, gloo on
CPUs. Helpers cut and join sequences the same way: `shard_sequence`, `unshard_sequence`,
`assemble_shards`, and `shard_positions` (the global positions of a rank's tokens, e.g. for
rotary embeddings).

LSE merge. For a query row i and a partition of the keys into blocks b, with
o_b = softmax(s_i,b) V_b and lse_b = log sum_{j in b} exp(s_ij) from nnprim.sdpa on each
block, the full row is
    lse = log sum_b exp(lse_b),      o = sum_b exp(lse_b - lse) o_b,
folded in one block at a time in f32 as o += sigmoid(lse_b - lse) (o_b - o),
lse = logaddexp(lse, lse_b) (stable: no exp of a large number).

Ring. At step i = 0..W-1 rank r holds the K/V block of rank (r - i) mod W: it posts the
send of that block to r + 1 and the receive of the next from r - 1 (batch_isend_irecv),
then attends its queries to the block it holds, so the transfer overlaps the attention
(on CUDA the P2P ops are issued from a side stream and the compute stream waits for them
only before the next step). K and V travel as one buffer.

Causal load balance ("zigzag"). The sequence is cut into 2W chunks of c tokens; rank r holds
chunks r and 2W-1-r. Against the block of rank s the local queries do:
    s == r: the diagonal, causal (top-left) over the whole 2c x 2c shard;
    s <  r: every query row, the first c keys (chunk s; chunk 2W-1-s lies in the future);
    s >  r: the last c query rows (chunk 2W-1-r), all 2c keys (chunk r sees neither);
so every rank does about 2c^2 scores at every step (W steps, 2W^2 c^2 = the causal total
(2Wc)^2 / 2 spread evenly). With load_balance="none" (rank r holds chunk r of W) rank r
attends fully to blocks s < r, causally to its own and skips s > r: correct, but the last
rank does W times the first one's work.

Backward. With the merged (global) o and lse saved by the forward, dS = P (dP - D) with
P = exp(S - lse) and D = rowsum(dO o) splits over key blocks exactly: nnprim.sdpa_backward on
each block (same schedule) gives dq's share of that block and the block's dk, dv shares.
dq accumulates locally in f32; each block's dK/dV partial sums (f32) travel round the ring
one step behind it (received during the next step's compute) and reach their owner after
the last rank has added its share. The backward is collective: every rank runs it.

Supported: f32, f16, bf16; GQA/MQA (Hq % Hkv == 0); D != Dv; causal None / top-left
(needs equal total query and key lengths, where top-left == bottom-right); cross attention
(Sq != Sk) without causal; a float scale. Not supported: masks, dropout, kv_lens, quantized
or paged K/V, unequal shards.
"""
from .comm import NullRing, P2PRing
from .context_parallel import BlockWork, RingPlan, block_work, context_parallel_sdpa, make_plan, ring_attention
from .sharding import assemble_shards, shard_positions, shard_sequence, unshard_sequence

__all__ = [
    "context_parallel_sdpa", "shard_sequence", "unshard_sequence", "assemble_shards", "shard_positions",
    # lower level: the schedule and the ring (benchmarks time the compute alone with NullRing)
    "BlockWork", "RingPlan", "block_work", "make_plan", "ring_attention", "P2PRing", "NullRing",
]
