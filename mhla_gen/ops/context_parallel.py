"""Context parallelism for MHLA layers: exact, with no K/V exchange.

diffusers 0.42 splits a Wan transformer's token sequence across the ranks of a context-parallel (CP)
group with ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=..))`` (or
``ring_degree``; its ``_cp_plan``: the rotary embedding and the input of ``blocks.0`` are split along
the sequence, the output of ``proj_out`` is all-gathered). Rank ``r`` of the group then holds the
contiguous token range ``[start, end)`` of the row-major ``(f h w)`` sequence, the ``r``-th piece of
``torch.tensor_split`` (``torch.chunk`` for the even split diffusers requires unless ``*_anything`` is
set: the same pieces).

An MHLA layer needs from the other ranks only the block summaries, never their keys or values: each
rank computes the partial summaries of its own tokens for every block,

    S_j^r = Σ_{s ∈ rank r, s ∈ j} φ(k_s) v_sᵀ,    z_j^r = Σ_{s ∈ rank r, s ∈ j} φ(k_s)   (0 if r misses j)

all-reduces them (sum) over the CP group, ``S_j = Σ_r S_j^r``: ``B x H x M x d x (e+1)`` values per
layer, whatever the sequence length; then mixes ``S̃_i = Σ_j W[i, j] S_j`` for the blocks its queries sit
in and writes its own queries' outputs. The all-reduce is ``funcol.all_reduce``, whose
backward is again an all-reduce (sum) of the summary gradients: each rank's keys and values get the
gradient from every rank's queries, exactly.

Gradients of replicated parameters (``W``, projections, norms, ...) on each rank are the partial
gradients of the loss over that rank's own outputs (diffusers' gather of ``proj_out`` hands each rank
the gradient of its own tokens): the full gradient is their **sum** over the CP group. This is
diffusers' convention for every layer under context parallelism, not something MHLA adds.

The local computation here is plain PyTorch autograd (block-major padded slots + batched GEMMs), not
the registered op: the op works on the full grid, a rank holds a slice of it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from .layout import layout_for, split_sizes


def enable_context_parallelism(transformer: torch.nn.Module, config) -> torch.nn.Module:
    """``transformer.enable_parallelism(config=config)`` (diffusers' ``ContextParallelConfig`` or
    ``ParallelConfig``) for a transformer whose diffusers class has a context-parallel plan; returns
    ``transformer``.

    Raises:
        ValueError: in one line, before diffusers is called, when the class has no plan (``_cp_plan``: what
            a base record's ``context_parallel`` capability reads; diffusers 0.42: DiT, SANA, SANA-Video).
            diffusers itself would first ask for a process group, then fail on the missing plan.
    """
    if getattr(type(transformer), "_cp_plan", None) is None:
        name = next((c.__name__ for c in type(transformer).__mro__ if c.__module__.startswith("diffusers.")),
                    type(transformer).__name__)
        raise ValueError(f"context parallelism: {name} has no diffusers context-parallel plan (_cp_plan), so "
                         f"its tokens cannot be split over ranks; run it on one rank per sample")
    transformer.enable_parallelism(config=config)
    return transformer


@dataclass(frozen=True)
class TokenShard:
    """The tokens one rank of a context-parallel group holds.

    Attributes:
        start, end: the rank's token range ``[start, end)`` in row-major grid order.
        num_tokens: ``N``, the whole sequence.
        sizes: tokens held by each rank of the group, in group-rank order (``torch.tensor_split``).
        group: the ``ProcessGroup`` the sequence is split over (diffusers' flattened CP mesh).
    """

    start: int
    end: int
    num_tokens: int
    sizes: tuple[int, ...]
    group: object

    @property
    def length(self) -> int:
        return self.end - self.start


def context_parallel_shard(parallel_config, num_tokens: int, local_tokens: int) -> TokenShard | None:
    """Which tokens this rank holds under diffusers' context parallelism, or None (whole sequence).

    Args:
        parallel_config: what ``enable_parallelism`` stored on the processor (``ParallelConfig``), or None.
        num_tokens: ``N`` of the whole token grid.
        local_tokens: the sequence length this rank's layer sees.
    Raises:
        ValueError: the local length is not this rank's piece of ``N`` (a split MHLA cannot place).
    """
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        return None
    mesh = cp._flattened_mesh
    if mesh is None:
        raise ValueError("context-parallel config is not set up (call transformer.enable_parallelism)")
    world = mesh.size()
    if world == 1 or local_tokens == num_tokens:
        return None  # nothing was split: every rank computes the whole layer
    group = mesh.get_group()
    rank = dist.get_rank(group)
    sizes = tuple(split_sizes(num_tokens, world))
    if local_tokens != sizes[rank]:
        raise ValueError(
            f"context parallelism: rank {rank} of {world} holds {local_tokens} tokens, but splitting the "
            f"{num_tokens}-token grid gives it {sizes[rank]} (expected torch.tensor_split along the sequence)"
        )
    start = sum(sizes[:rank])
    return TokenShard(start, start + local_tokens, num_tokens, sizes, group)


# --------------------------------------------------------------------------------------------------
# the rank's tokens, block by block


@dataclass(frozen=True)
class ShardBlocks:
    """The blocks a token range touches, and a padded block-major slot for each of its tokens.

    Attributes:
        touched: LongTensor ``(Mr,)``: block ids the range touches, ascending.
        slot: LongTensor ``(n,)``: ``u * max_len + p`` for a token in the ``u``-th touched block at
            position ``p`` among the range's tokens of that block (token order kept).
        max_len: the most tokens the range has in one block.
    """

    touched: torch.Tensor
    slot: torch.Tensor
    max_len: int

    @property
    def num_slots(self) -> int:
        return self.touched.numel() * self.max_len


@functools.lru_cache(maxsize=256)
def shard_blocks(grid: tuple[int, ...], blocks: tuple[int, ...], start: int, end: int, device) -> ShardBlocks:
    """:class:`ShardBlocks` of tokens ``[start, end)`` of ``BlockLayout(grid, blocks)`` (cached)."""
    ids = layout_for(grid, blocks).block_index[start:end]  # (n,)
    touched, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    order = torch.argsort(inverse, stable=True)  # tokens grouped by block, token order inside
    first = torch.cumsum(counts, 0) - counts  # position of each touched block's first token in `order`
    position = torch.empty_like(inverse)
    position[order] = torch.arange(ids.numel()) - first[inverse[order]]
    max_len = int(counts.max())
    return ShardBlocks(touched.to(device), (inverse * max_len + position).to(device), max_len)


def _to_slots(x: torch.Tensor, sb: ShardBlocks) -> torch.Tensor:
    """``(B, H, n, c)`` token order -> ``(Mr, B, H, L, c)`` block-major, zero-padded to ``L`` = max_len."""
    b, h, _, c = x.shape
    slots = x.new_zeros(sb.num_slots, b, h, c).index_copy(0, sb.slot, x.permute(2, 0, 1, 3))
    return slots.view(-1, sb.max_len, b, h, c).permute(0, 2, 3, 1, 4)


def _from_slots(y: torch.Tensor, sb: ShardBlocks) -> torch.Tensor:
    """Inverse of :func:`_to_slots` (padding dropped): ``(Mr, B, H, L, c)`` -> ``(B, H, n, c)``."""
    mr, b, h, length, c = y.shape
    tokens = y.permute(0, 3, 1, 2, 4).reshape(mr * length, b, h, c).index_select(0, sb.slot)
    return tokens.permute(1, 2, 0, 3)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum over ``group`` (backward: the sum of the gradients, again an all-reduce)."""
    return funcol.all_reduce(x.contiguous(), "sum", group)


def mhla_shard(
    q_features: torch.Tensor,
    k_features: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, ...],
    blocks: tuple[int, ...],
    mixing: torch.Tensor,
    normalize: bool = True,
    eps: float = 1e-6,
    *,
    shard: TokenShard,
    q_norm_features: torch.Tensor | None = None,
    k_norm_features: torch.Tensor | None = None,
) -> torch.Tensor:
    """MHLA outputs of one rank's queries from features of one rank's tokens (context parallelism).

    Arguments in :func:`mhla_gen.mhla_attention`'s order (the layout as ``grid, blocks``; no feature map:
    the features come mapped), then this rank's tokens.

    Args:
        q_features, k_features: ``(B, H, n, d)`` φ(q), φ(k) of the rank's tokens ``[shard.start, shard.end)``
            (already mapped: the caller applies φ and any rotation).
        v: ``(B, H, n, e)`` their values.
        grid, blocks: the whole token grid and the MHLA blocks.
        mixing: ``(M, M)``, the same on every rank.
        normalize, eps: as :func:`mhla_gen.mhla_attention`.
        shard: this rank's :class:`TokenShard`.
        q_norm_features, k_norm_features: features of the normaliser when it differs from the numerator's
            (Wan's ``after_phi_numerator``: RoPE in the numerator only); default: the same features.
    Returns:
        ``(B, H, n, e)`` in the features' dtype: exactly what ``mhla_attention`` on the whole sequence gives
        for these queries, once every rank of ``shard.group`` has called this (one all-reduce).
    """
    n, e = v.shape[2], v.shape[3]
    if n != shard.length:
        raise ValueError(f"rank holds tokens [{shard.start}, {shard.end}) but got a sequence of {n}")
    layout = layout_for(tuple(grid), tuple(blocks))
    m = layout.num_blocks
    if mixing.shape != (m, m):
        raise ValueError(f"mixing must have shape ({m}, {m}) for {layout}, got {tuple(mixing.shape)}")
    sb = shard_blocks(tuple(grid), tuple(blocks), shard.start, shard.end, v.device)
    partial = _partial_summaries(k_features, v, sb, normalize, k_norm_features)  # (Mr, B, H, d, c)
    summaries = partial.new_zeros(m, *partial.shape[1:]).index_copy(0, sb.touched, partial)  # (M, B, H, d, c)
    summaries = all_reduce_sum(summaries, shard.group)  # S_j, z_j of the whole sequence
    rows = mixing.to(partial.dtype).index_select(0, sb.touched)  # W[i, :] for the rank's query blocks
    mixed = (rows @ summaries.flatten(1)).view(-1, *summaries.shape[1:])  # S̃_i, z̃_i: (Mr, B, H, d, c)

    qb = _to_slots(q_features, sb)  # (Mr, B, H, L, d)
    if not normalize:
        out = qb @ mixed
    elif q_norm_features is None:
        numden = qb @ mixed  # (Mr, B, H, L, e + 1)
        out = numden[..., :e] / (numden[..., e:] + eps)
    else:
        den = _to_slots(q_norm_features, sb) @ mixed[..., e:]
        out = (qb @ mixed[..., :e]) / (den + eps)
    return _from_slots(out, sb)


def _partial_summaries(k_features, v, sb: ShardBlocks, normalize: bool, k_norm_features=None) -> torch.Tensor:
    """``[S_j^r z_j^r]`` ``(Mr, B, H, d, c)`` of the blocks the rank's tokens touch (``c = e + 1`` with the
    normaliser, else ``e``), from ``(B, H, n, ·)`` features and values."""
    kb = _to_slots(k_features, sb)  # (Mr, B, H, L, d)
    partial = [kb.mT @ _to_slots(v, sb)]  # S_j^r: (Mr, B, H, d, e)
    if normalize:
        kz = kb if k_norm_features is None else _to_slots(k_norm_features, sb)
        partial.append(kz.sum(dim=-2, keepdim=True).mT)  # z_j^r: (Mr, B, H, d, 1)
    return torch.cat(partial, dim=-1)


def gather_sequence(x: torch.Tensor, shard: TokenShard) -> torch.Tensor:
    """All ranks' pieces of a ``(B, n, C)`` sequence -> the whole ``(B, N, C)`` (differentiable: the
    backward sends each rank the gradient of its own tokens). Uneven pieces are padded for the gather."""
    longest = max(shard.sizes)
    padded = F.pad(x, (0, 0, 0, longest - x.shape[1])).transpose(0, 1).contiguous()  # (L, B, C)
    pieces = funcol.all_gather_single(padded, 0, shard.group).view(len(shard.sizes), *padded.shape)
    return torch.cat([piece[:size] for piece, size in zip(pieces, shard.sizes)]).transpose(0, 1)


def shard_cpe(cpe, v: torch.Tensor, grid: tuple[int, int, int], shard: TokenShard) -> torch.Tensor:
    """CPE (depthwise conv of V on the 3D grid) for the rank's own tokens ``(B, n, C)``.

    The conv needs neighbours held by other ranks: V is all-gathered (``B x N x C`` values per layer),
    then the conv runs only over the frames the rank's tokens sit in plus the kernel's halo frames.
    """
    full = gather_sequence(v, shard)  # (B, N, C)
    frames, height, width = grid
    plane = height * width
    halo = cpe.conv.padding[0]
    first = max(0, shard.start // plane - halo)
    last = min(frames, (shard.end - 1) // plane + 1 + halo)
    slab = full[:, first * plane : last * plane]  # frames [first, last): zero padding only at true edges
    out = cpe(slab, (last - first, height, width))
    return out[:, shard.start - first * plane : shard.end - first * plane]


def communication_per_layer(
    batch: int,
    heads: int,
    head_dim: int,
    grid: tuple[int, ...],
    blocks: tuple[int, ...],
    world: int,
    summary_bytes: int = 4,
    activation_bytes: int = 2,
) -> dict[str, float]:
    """Bytes one rank sends in one attention layer's forward, from the formulas (the README's table).

    * ``mhla``: all-reduce of the ``B x H x M x d x (d+1)`` summaries (fp32), counted as a ring
      all-reduce: ``2 (P-1)/P`` of the buffer. Does not depend on the sequence length.
    * ``mhla_cpe``: what CPE adds, the all-gather of V (``(P-1)`` local pieces of ``B x N/P x H d``).
    * ``ulysses``: diffusers' all-to-all of q, k, v and of the output, ``(P-1)/P`` of each local tensor.
    * ``ring``: diffusers' ring (``rotate_method="allgather"``): all-gather of the local k and v.
    The backward pass sends as much again (MHLA: one all-reduce of the summary gradients).
    """
    n, m, p = math.prod(grid), math.prod(blocks), world
    summaries = batch * heads * m * head_dim * (head_dim + 1) * summary_bytes
    local = batch * heads * head_dim * n / p * activation_bytes  # one of q, k, v, out on one rank
    return {
        "summary_buffer": summaries,
        "mhla": 2 * (p - 1) / p * summaries,
        "mhla_cpe": (p - 1) * local,
        "ulysses": 4 * (p - 1) / p * local,
        "ring": 2 * (p - 1) * local,
    }
