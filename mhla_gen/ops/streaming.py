"""Block-causal MHLA for streaming video: the chunk structure and the two full-sequence (training) paths.

A streaming model makes a video ``chunk_frames`` latent frames at a time, each chunk conditioned on the
chunks before it. Its attention is *block-causal*: a token sees every token of its own chunk (both ways)
and every token of earlier chunks, none of later ones. On a 3D layout ``(F, H, W)`` cut into blocks
``(bf, bh, bw)`` a block lies inside one chunk when the time blocks respect the chunk boundaries
(:class:`BlockCausal` checks it), so block-causal MHLA is MHLA whose mixing matrix is zero where the key
block's chunk comes after the query block's::

    A[t, s] = W[b(t), b(s)] · φ(q_t)·φ(k_s),    W[i, j] = 0 when chunk(j) > chunk(i)

Two mixings (``docs/streaming.md``):

* **general**: any learned ``W`` (M x M, tied to the number of chunks), masked before the registered op
  (:func:`block_causal_mhla`): the op's forward and backward unchanged, the masked entries get zero
  gradient. Streaming it keeps every past block's summary (``streaming_cache.GeneralStreamCache``).
* **factorised**: ``W[i, j] = W_s[s(i), s(j)] · γ_h^(t(i) - t(j))`` for ``t(j) <= t(i)``, where ``t`` is the
  chunk and ``s`` the block's place inside its chunk (``m`` blocks per chunk): a spatial mixing ``W_s``
  (m x m) and a per-head decay ``γ_h`` in (0, 1] over chunks. It does not depend on the video's length,
  and streaming it keeps one running state per block of a chunk, ``R_s <- γ R_s + S_s``
  (``streaming_cache.FactorisedStreamCache``). ``W`` now depends on the head, which the op's ``(M, M)``
  mixing does not express; :func:`factorised_block_causal_mhla` computes the factorised form directly
  (block summaries, a decayed sum over chunks, the spatial mixing, the read-out) in plain differentiable
  torch ops: ``O(N d e)`` for summaries and read-out plus ``O(n² m d e + n m² d e)`` per head for ``n``
  chunks, never a token-by-token score.

Shapes: ``B`` batch, ``H`` heads, ``N`` tokens, ``M`` blocks, ``n`` chunks, ``m`` blocks per chunk, ``d``
key dim, ``e`` value dim, ``c = e + 1`` with the normaliser (the values carry a column of ones, so one
GEMM gives summary and normaliser, as ``blocked.py`` does), else ``c = e``.
"""

from __future__ import annotations

import math

import torch

from .checks import accumulation_dtype, autocast_off, cast_output, check_inputs
from .feature_maps import get_feature_map
from .layout import BlockLayout
from .mhla import mhla_attention


class BlockCausal:
    """A block layout cut into chunks of ``chunk_frames`` frames along its first (time) axis.

    Args:
        layout: the block layout of the whole video; axis 0 is time (``(F, H, W)`` for video).
        chunk_frames: latent frames per chunk; must divide ``F``, and every time block must lie inside one
            chunk (e.g. ``F`` cut into a multiple of ``F / chunk_frames`` equal time blocks).

    Attributes:
        num_chunks: ``n = F / chunk_frames``.
        chunk_tokens: tokens of one chunk, ``chunk_frames · H · W``.
        chunk_starts: ``n + 1`` block ids: chunk ``c`` holds the blocks ``chunk_starts[c]`` up to
            ``chunk_starts[c + 1]`` (block ids are row-major with time outermost, so a chunk's blocks are
            consecutive).
    """

    def __init__(self, layout: BlockLayout, chunk_frames: int):
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"layout must be a BlockLayout, got {type(layout).__name__}")
        if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
            raise ValueError(f"chunk_frames must be a positive int, got {chunk_frames!r}")
        frames = layout.grid[0]
        if frames % chunk_frames:
            raise ValueError(
                f"chunk_frames={chunk_frames} does not divide the {frames} latent frames of grid "
                f"{layout.grid}"
            )
        self.layout, self.chunk_frames = layout, chunk_frames
        self.num_chunks = frames // chunk_frames
        self.chunk_tokens = layout.num_tokens // self.num_chunks
        self._time_blocks = self._time_blocks_per_chunk()  # per chunk: its time blocks' frame counts
        per_time_block = math.prod(layout.blocks[1:])  # blocks in one time block (the spatial grid)
        counts = [0] + [len(sizes) * per_time_block for sizes in self._time_blocks]
        self.chunk_starts = [sum(counts[: c + 1]) for c in range(self.num_chunks + 1)]

    def _time_blocks_per_chunk(self) -> list[list[int]]:
        """Frame counts of the time blocks of each chunk; ValueError when a time block crosses a chunk."""
        chunks, start = [[] for _ in range(self.num_chunks)], 0
        for index, size in enumerate(self.layout.axis_sizes[0]):
            first, last = start // self.chunk_frames, (start + size - 1) // self.chunk_frames
            if first != last:
                raise ValueError(
                    f"time block {index} of blocks={self.layout.blocks} covers frames {start}.."
                    f"{start + size - 1}, across a boundary of chunk_frames={self.chunk_frames} (grid "
                    f"{self.layout.grid}): every time block must lie inside one chunk"
                )
            chunks[first].append(size)
            start += size
        return chunks

    def __repr__(self) -> str:
        return f"BlockCausal({self.layout}, chunk_frames={self.chunk_frames})"

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockCausal) and (self.layout, self.chunk_frames) == (
            other.layout, other.chunk_frames)

    def __hash__(self) -> int:
        return hash((self.layout, self.chunk_frames))

    def chunk_blocks(self, chunk: int) -> range:
        """Block ids of ``chunk``."""
        return range(self.chunk_starts[chunk], self.chunk_starts[chunk + 1])

    def chunk_layout(self, chunk: int) -> BlockLayout:
        """The block layout of ``chunk`` alone: grid ``(chunk_frames, H, W)``, its time blocks and the spatial
        blocks. Its row-major block ids are the chunk's block ids minus ``chunk_starts[chunk]``: a time block
        of the whole layout is a run of near-equal sizes, so inside a chunk it is ``split_sizes`` again."""
        time_blocks = len(self._time_blocks[chunk])
        return BlockLayout((self.chunk_frames, *self.layout.grid[1:]), (time_blocks, *self.layout.blocks[1:]))

    @property
    def uniform(self) -> bool:
        """Every chunk is cut into the same blocks (what the factorised mixing needs)."""
        return all(sizes == self._time_blocks[0] for sizes in self._time_blocks)

    @property
    def blocks_per_chunk(self) -> int:
        """``m``, for a uniform layout (ValueError otherwise, naming the chunks' time blocks)."""
        if not self.uniform:
            raise ValueError(
                f"{self} cuts its chunks into different time blocks {self._time_blocks}; the factorised "
                f"mixing needs the same blocks in every chunk (e.g. time blocks that divide the frames)"
            )
        return self.chunk_starts[1]

    @property
    def chunk_of_block(self) -> torch.Tensor:
        """LongTensor ``(M,)``: the chunk of each block."""
        counts = torch.tensor([b - a for a, b in zip(self.chunk_starts, self.chunk_starts[1:])])
        return torch.repeat_interleave(torch.arange(self.num_chunks), counts)

    @property
    def mask(self) -> torch.Tensor:
        """Bool ``(M, M)``: ``mask[i, j]`` is True when block ``j``'s chunk is not after block ``i``'s."""
        chunk = self.chunk_of_block
        return chunk[None, :] <= chunk[:, None]

    def mask_mixing(self, mixing: torch.Tensor) -> torch.Tensor:
        """``W`` with the entries of later chunks zeroed (a product, so their gradient is zero)."""
        return mixing * self.mask.to(device=mixing.device, dtype=mixing.dtype)


def _check_causal(causal) -> None:
    if not isinstance(causal, BlockCausal):
        raise ValueError(f"causal must be a BlockCausal, got {type(causal).__name__}")


def block_causal_mhla(q, k, v, causal: BlockCausal, mixing, feature_map="relu", normalize: bool = True,
                      eps: float = 1e-6, *, backend: str | None = None) -> torch.Tensor:
    """Block-causal MHLA with a general learned mixing: the registered op with ``W`` masked
    (:meth:`BlockCausal.mask_mixing`). q, k ``(B, H, N, d)``, v ``(B, H, N, e)``, mixing ``(M, M)`` ->
    ``(B, H, N, e)`` in q's dtype; arguments as :func:`mhla_attention`."""
    _check_causal(causal)
    check_inputs(q, k, v, causal.layout, mixing, False)
    return mhla_attention(q, k, v, causal.layout, causal.mask_mixing(mixing), feature_map, normalize,
                          eps=eps, backend=backend)


# --------------------------------------------------------------------------------------------------
# plain-torch pieces the factorised path and the streaming caches share


def block_summaries(k, v, layout: BlockLayout, phi, normalize: bool) -> torch.Tensor:
    """``[S_j z_j]`` per block: ``(M, B, H, d, c)`` in row-major block order, in k's dtype (pass the
    accumulation dtype). ``S_j = Σ φ(k_s) v_sᵀ`` and, with the normaliser, ``z_j = Σ φ(k_s)`` as column e."""
    parts = []
    for kx, vx in zip(layout.to_blocks(k), layout.to_blocks(v)):  # (Mg, B, H, Lg, d), (Mg, B, H, Lg, e)
        if normalize:
            vx = torch.cat([vx, vx.new_ones(*vx.shape[:-1], 1)], dim=-1)  # [V 1]
        parts.append(phi(kx).mT @ vx)  # (Mg, B, H, d, c)
    summaries = torch.cat(parts)  # sub-grid block order
    if layout.natural_order:
        return summaries
    return summaries[torch.argsort(torch.tensor(layout.block_order, device=k.device))]


def read_states(q, states, layout: BlockLayout, phi, normalize: bool, eps: float) -> torch.Tensor:
    """Each token's output from its block's mixed state: ``states`` ``(M, B, H, d, c)`` in row-major block
    order, q ``(B, H, N, d)`` -> ``(B, H, N, e)`` in ``states``' dtype: ``φ(q)ᵀ S̃ / (φ(q)ᵀ z̃ + eps)``."""
    if not layout.natural_order:
        states = states[torch.tensor(layout.block_order, device=states.device)]  # sub-grid block order
    parts = []
    for sub, qx in zip(layout.subgrids, layout.to_blocks(q)):  # qx: (Mg, B, H, Lg, d)
        num = phi(qx) @ states[sub.offset : sub.offset + sub.num_blocks]  # (Mg, B, H, Lg, c)
        parts.append(num[..., :-1] / (num[..., -1:] + eps) if normalize else num)
    return layout.from_blocks(parts)


def mix(weights: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``Σ_j weights[i, j] states[j]``: ``(P, Q)`` with ``(Q, ...)`` -> ``(P, ...)``."""
    return (weights @ states.flatten(1)).view(weights.shape[0], *states.shape[1:])


def check_decay(decay: torch.Tensor, heads: int | None = None) -> None:
    """``decay`` must be ``(heads,)`` (any length when None) with every value in (0, 1]: one ValueError
    naming the shape or the values. Reads the values (a device sync on GPU), once per call."""
    if not isinstance(decay, torch.Tensor) or decay.dim() != 1 or decay.shape[0] != (heads or decay.shape[0]):
        shape = tuple(decay.shape) if isinstance(decay, torch.Tensor) else type(decay).__name__
        raise ValueError(f"decay must be a tensor of shape ({heads or 'heads'},) (one per head), got {shape}")
    if not bool(((decay > 0) & (decay <= 1)).all()):
        raise ValueError(f"decay must lie in (0, 1] for every head, got {decay.detach().cpu().tolist()}")


def check_spatial_mixing(spatial_mixing: torch.Tensor, blocks: int) -> None:
    if spatial_mixing.shape != (blocks, blocks):
        raise ValueError(f"spatial_mixing must have shape ({blocks}, {blocks}) (blocks of one chunk), got "
                         f"{tuple(spatial_mixing.shape)}")


def decay_matrix(decay: torch.Tensor, chunks: int) -> torch.Tensor:
    """``D[h, x, y] = γ_h^(x - y)`` for ``y <= x``, else 0: ``(H, n, n)`` in decay's dtype."""
    steps = torch.arange(chunks, device=decay.device)
    lag = (steps[:, None] - steps[None, :]).to(decay.dtype)  # (n, n)
    lower = lag >= 0
    return torch.exp(lag.clamp_min(0) * decay.log()[:, None, None]) * lower


def factorised_block_causal_mhla(q, k, v, causal: BlockCausal, spatial_mixing, decay, feature_map="relu",
                                 normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Block-causal MHLA with the factorised mixing ``W[i, j] = W_s[s(i), s(j)] · γ_h^(t(i) - t(j))``.

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, e)``; tokens in row-major ``(f h w)`` order.
        causal: a uniform :class:`BlockCausal` (the same ``m`` blocks in every chunk).
        spatial_mixing: ``W_s`` ``(m, m)`` over the blocks of one chunk (row-major inside the chunk).
        decay: ``γ`` ``(H,)``, each in (0, 1].
    Returns:
        ``(B, H, N, e)`` in q's dtype; sums accumulate in fp32 for half inputs. Differentiable (autograd)
        in q, k, v, ``W_s`` and ``γ``.
    """
    _check_causal(causal)
    blocks = causal.layout.num_blocks
    check_inputs(q, k, v, causal.layout, torch.empty(blocks, blocks, device="meta"), False)  # shapes only
    m, n = causal.blocks_per_chunk, causal.num_chunks
    check_spatial_mixing(spatial_mixing, m)
    check_decay(decay, q.shape[1])
    phi = get_feature_map(feature_map)
    acc = accumulation_dtype(q.dtype)
    layout = causal.layout
    with autocast_off(q.device.type):
        summaries = block_summaries(k.to(acc), v.to(acc), layout, phi, normalize)  # (M, B, H, d, c)
        per_chunk = summaries.unflatten(0, (n, m))  # (n, m, B, H, d, c)
        running = torch.einsum("hxy,ymbhdc->xmbhdc", decay_matrix(decay.to(acc), n), per_chunk)  # R per chunk
        mixed = torch.einsum("is,xsbhdc->xibhdc", spatial_mixing.to(acc), running).flatten(0, 1)  # (M, ...)
        out = read_states(q.to(acc), mixed, layout, phi, normalize, eps)
    return cast_output(out, q.dtype)


def factorised_mixing_dense(causal: BlockCausal, spatial_mixing, decay) -> torch.Tensor:
    """The factorised mixing as dense per-head matrices ``(H, M, M)`` (zero above the chunk diagonal), for
    analysis and for running it through the general path one head at a time."""
    _check_causal(causal)
    m = causal.blocks_per_chunk
    check_spatial_mixing(spatial_mixing, m)
    check_decay(decay)
    d = decay_matrix(decay, causal.num_chunks)  # (H, n, n)
    w = d[:, :, None, :, None] * spatial_mixing.to(d.dtype)[None, None, :, None, :]  # (H, n, m, n, m)
    return w.flatten(1, 2).flatten(2, 3)


__all__ = [
    "BlockCausal",
    "block_causal_mhla",
    "factorised_block_causal_mhla",
    "factorised_mixing_dense",
]
