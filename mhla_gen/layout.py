"""Block partition of a 1D / 2D / 3D token grid (DESIGN §1, "Partition").

Tokens are numbered row-major over the grid, the order diffusers produces after patchify:
``(n)``, ``(h w)`` or ``(f h w)``. Each grid axis of length ``L`` cut into ``b`` blocks is split into
``b`` contiguous ranges whose lengths differ by at most one (the first ``L % b`` ranges are one
longer, as ``torch.tensor_split`` does). Block ids are row-major over the block grid.

The fast path works in *block-major* order: a ``(..., N, d)`` tensor becomes ``(..., M, L_max, d)``
where ``L_max`` is the largest block. When every axis divides evenly this is a pure
view + permute; otherwise tokens are scattered into a zero-padded buffer (zero rows contribute
nothing to the summaries) and gathered back.
"""

from __future__ import annotations

import math
from functools import cached_property

import torch


def split_sizes(length: int, parts: int) -> list[int]:
    """Lengths of ``parts`` contiguous ranges covering ``length`` that differ by at most one."""
    base, extra = divmod(length, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def _as_tuple(value, name: str) -> tuple[int, ...]:
    if isinstance(value, int):
        value = (value,)
    try:
        out = tuple(int(v) for v in value)
    except TypeError as err:
        raise ValueError(f"{name} must be an int or a sequence of ints, got {value!r}") from err
    if any(int(v) != v for v in value):
        raise ValueError(f"{name} must contain integers, got {value!r}")
    return out


class BlockLayout:
    """Tiles of a token grid.

    Args:
        grid: token grid shape, ``(N,)``, ``(H, W)`` or ``(F, H, W)``.
        blocks: number of blocks per axis, same rank as ``grid``; ``1 <= blocks[a] <= grid[a]``.

    Attributes:
        num_tokens: ``N = prod(grid)``.
        num_blocks: ``M = prod(blocks)``.
        block_index: LongTensor ``(N,)``, the block id of every token (row-major token order).
        max_block_len: ``L_max``, the number of tokens in the largest block.
        is_even: every axis divides exactly (block-major order is a pure permute, no padding).
    """

    def __init__(self, grid, blocks):
        grid = _as_tuple(grid, "grid")
        blocks = _as_tuple(blocks, "blocks")
        if not 1 <= len(grid) <= 3:
            raise ValueError(f"grid must be 1D, 2D or 3D, got grid={grid}")
        if len(blocks) != len(grid):
            raise ValueError(f"grid {grid} and blocks {blocks} have different ranks")
        for axis, (g, b) in enumerate(zip(grid, blocks)):
            if g < 1:
                raise ValueError(f"grid axis {axis} has length {g}; grid={grid}")
            if not 1 <= b <= g:
                raise ValueError(
                    f"blocks[{axis}]={b} must be between 1 and grid[{axis}]={g} "
                    f"(grid={grid}, blocks={blocks})"
                )
        self.grid = grid
        self.blocks = blocks
        self.ndim = len(grid)
        self.num_tokens = math.prod(grid)
        self.num_blocks = math.prod(blocks)
        self.axis_sizes = [split_sizes(g, b) for g, b in zip(grid, blocks)]
        self.is_even = all(g % b == 0 for g, b in zip(grid, blocks))
        self.max_block_len = math.prod(max(s) for s in self.axis_sizes)
        self._device_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._view_cache: dict[tuple, tuple[torch.Size, tuple[int, ...]]] = {}

    def __repr__(self) -> str:
        return f"BlockLayout(grid={self.grid}, blocks={self.blocks})"

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockLayout) and (self.grid, self.blocks) == (other.grid, other.blocks)

    def __hash__(self) -> int:
        return hash((self.grid, self.blocks))

    # ----------------------------------------------------------------------------------------------
    # index tensors (built once on CPU, copied per device on demand)

    def _axis_block_ids(self, axis: int) -> torch.Tensor:
        sizes = self.axis_sizes[axis]
        return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))

    def _axis_offsets(self, axis: int) -> torch.Tensor:
        """Position of each coordinate inside its block along ``axis``."""
        sizes = self.axis_sizes[axis]
        return torch.cat([torch.arange(s) for s in sizes])

    @cached_property
    def block_index(self) -> torch.Tensor:
        """LongTensor ``(N,)``: block id of each token in row-major token order."""
        ids = torch.zeros((), dtype=torch.long)
        for axis in range(self.ndim):
            axis_ids = self._axis_block_ids(axis)
            ids = ids.unsqueeze(-1) * self.blocks[axis] + axis_ids
        return ids.reshape(-1)

    @cached_property
    def block_lengths(self) -> torch.Tensor:
        """LongTensor ``(M,)``: number of tokens in each block."""
        return torch.bincount(self.block_index, minlength=self.num_blocks)

    @cached_property
    def slot_index(self) -> torch.Tensor:
        """LongTensor ``(N,)``: position of each token in the flat ``(M * L_max)`` block-major buffer.

        Inside a block, tokens keep their row-major order over the block's own sub-grid.
        """
        max_sizes = [max(s) for s in self.axis_sizes]
        within = torch.zeros((), dtype=torch.long)
        for axis in range(self.ndim):
            within = within.unsqueeze(-1) * max_sizes[axis] + self._axis_offsets(axis)
        return self.block_index * self.max_block_len + within.reshape(-1)

    @cached_property
    def block_centers(self) -> torch.Tensor:
        """Float tensor ``(M, ndim)``: block coordinates in block units (row-major block ids)."""
        axes = [torch.arange(b, dtype=torch.float64) for b in self.blocks]
        return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, self.ndim)

    def slot_index_on(self, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._device_cache:
            self._device_cache[device] = self.slot_index.to(device)
        return self._device_cache[device]

    # ----------------------------------------------------------------------------------------------
    # token order <-> block-major order

    def check_tokens(self, n: int, what: str = "sequence length") -> None:
        if n != self.num_tokens:
            raise ValueError(
                f"{what} {n} does not match grid {self.grid} (expected {self.num_tokens} tokens)"
            )

    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``(*batch, N, d)`` in token order -> ``(*batch, M, L_max, d)`` block-major, zero-padded."""
        *batch, n, d = x.shape
        self.check_tokens(n)
        if self.is_even:
            sub = [g // b for g, b in zip(self.grid, self.blocks)]
            # (*batch, b0, s0, b1, s1, ..., d) -> (*batch, b0, b1, ..., s0, s1, ..., d)
            split = [v for pair in zip(self.blocks, sub) for v in pair]
            x = x.reshape(*batch, *split, d)
            nb = len(batch)
            block_axes = [nb + 2 * a for a in range(self.ndim)]
            sub_axes = [nb + 2 * a + 1 for a in range(self.ndim)]
            x = x.permute(*range(nb), *block_axes, *sub_axes, x.dim() - 1)
            return x.reshape(*batch, self.num_blocks, self.max_block_len, d)
        slots = self.slot_index_on(x.device)
        out = x.new_zeros(*batch, self.num_blocks * self.max_block_len, d)
        out = out.index_copy(len(batch), slots, x)
        return out.reshape(*batch, self.num_blocks, self.max_block_len, d)

    def from_blocks(self, xb: torch.Tensor) -> torch.Tensor:
        """``(*batch, M, L_max, d)`` block-major -> ``(*batch, N, d)`` token order (padding dropped)."""
        *batch, m, lmax, d = xb.shape
        if (m, lmax) != (self.num_blocks, self.max_block_len):
            raise ValueError(
                f"block tensor has (M, L_max)=({m}, {lmax}); layout {self} needs "
                f"({self.num_blocks}, {self.max_block_len})"
            )
        if self.is_even:
            sub = [g // b for g, b in zip(self.grid, self.blocks)]
            x = xb.reshape(*batch, *self.blocks, *sub, d)
            nb = len(batch)
            # (*batch, b0, b1, .., s0, s1, .., d) -> (*batch, b0, s0, b1, s1, .., d)
            order = [v for a in range(self.ndim) for v in (nb + a, nb + self.ndim + a)]
            x = x.permute(*range(nb), *order, x.dim() - 1)
            return x.reshape(*batch, self.num_tokens, d)
        flat = xb.reshape(*batch, m * lmax, d)
        return flat.index_select(len(batch), self.slot_index_on(xb.device))

    def copy_to_blocks(self, x: torch.Tensor, dtype: torch.dtype | None = None, out=None) -> torch.Tensor:
        """Like :meth:`to_blocks` but one fused copy (with dtype cast) into a fresh buffer; no autograd.

        For even layouts the block-major buffer is written through a permuted view of ``x``, so a
        half-precision input is cast and reordered in a single pass. ``out``: a ``(*batch, M, L_max, d)``
        buffer (any strides, e.g. a column slice of a wider buffer) to write into instead.
        """
        dtype = out.dtype if out is not None else dtype or x.dtype
        if not self.is_even:
            blocks = self.to_blocks(x.to(dtype))
            return blocks if out is None else out.copy_(blocks)
        *batch, n, d = x.shape
        self.check_tokens(n)
        if out is None:
            out = torch.empty(*batch, self.num_blocks, self.max_block_len, d, dtype=dtype, device=x.device)
        self.block_split_view(out).copy_(self.token_split_view(x))
        return out

    def copy_from_blocks(self, xb: torch.Tensor, dtype: torch.dtype | None = None, out=None) -> torch.Tensor:
        """Like :meth:`from_blocks` but one fused copy (with dtype cast); no autograd.

        ``out``: a ``(*batch, N, d)`` buffer (any strides) to write into instead of a fresh one.
        """
        dtype = out.dtype if out is not None else dtype or xb.dtype
        if not self.is_even:
            tokens = self.from_blocks(xb).to(dtype)
            return tokens if out is None else out.copy_(tokens)
        *batch, _, _, d = xb.shape
        if out is None:
            out = torch.empty(*batch, self.num_tokens, d, dtype=dtype, device=xb.device)
        self.token_split_view(out).copy_(self.block_split_view(xb))
        return out

    # Even layouts only: a token-order tensor and a block-major tensor seen as the same logical
    # ``(*batch, b0, b1, .., s0, s1, .., d)`` array (``b`` blocks, ``s`` tokens per block, per axis),
    # so an elementwise op with ``out=`` reorders while it computes: the fast path fuses φ, the
    # normaliser and φ' into the reordering copies. Both accept any strides (``view`` only splits the
    # token / block axes), e.g. heads-interleaved ``(B, N, H, d)`` memory seen as ``(B, H, N, d)``.
    # The fast path takes several such views per call on the same few shapes, so each view's geometry
    # (sizes, strides) is computed once per input geometry and then replayed with ``as_strided``:
    # one dispatch instead of a view plus a permute (the views cost more than the small kernels
    # around them at 256 tokens).

    def block_split_view(self, xb: torch.Tensor) -> torch.Tensor:
        """Block-major ``(*batch, M, L, d)`` viewed as ``(*batch, b0, b1, .., s0, s1, .., d)``."""
        return self._cached_view(xb, self._block_split_view)

    def token_split_view(self, x: torch.Tensor) -> torch.Tensor:
        """Token-order ``(*batch, N, d)`` viewed as ``(*batch, b0, b1, .., s0, s1, .., d)``."""
        return self._cached_view(x, self._token_split_view)

    def _block_split_view(self, xb: torch.Tensor) -> torch.Tensor:
        return xb.view(*xb.shape[:-3], *self._split_shapes[0], xb.shape[-1])

    def _token_split_view(self, x: torch.Tensor) -> torch.Tensor:
        _, token_split, order = self._split_shapes
        split = x.view(*x.shape[:-2], *token_split, x.shape[-1])
        nb = x.dim() - 2  # (*batch, b0, s0, b1, s1, .., d) -> (*batch, b0, b1, .., s0, s1, .., d)
        return split.permute(*range(nb), *(nb + a for a in order), split.dim() - 1)

    def _cached_view(self, x: torch.Tensor, make_view) -> torch.Tensor:
        """``make_view(x)``, replayed from a cache keyed by the view kind and x's sizes and strides."""
        if x.requires_grad and torch.is_grad_enabled():  # autograd: plain views (cheaper backward)
            return make_view(x)
        key = (make_view.__name__, x.shape, x.stride())
        geometry = self._view_cache.get(key)
        if geometry is None:
            view = make_view(x)  # also validates (even layout, token count) on first use
            if len(self._view_cache) >= 64:  # a few shapes per run; bound it anyway
                self._view_cache.clear()
            self._view_cache[key] = (view.shape, view.stride())
            return view
        return x.as_strided(*geometry, x.storage_offset())

    @cached_property
    def _split_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(b0, b1, .., s0, s1, ..)``, ``(b0, s0, b1, s1, ..)`` and the permutation between them."""
        if not self.is_even:
            raise ValueError(f"split views need an evenly divisible layout, got {self}")
        sub = [g // b for g, b in zip(self.grid, self.blocks)]
        token_split = tuple(v for pair in zip(self.blocks, sub) for v in pair)
        order = tuple(2 * a for a in range(self.ndim)) + tuple(2 * a + 1 for a in range(self.ndim))
        return (*self.blocks, *sub), token_split, order

    def block_mask(self, device=None) -> torch.Tensor:
        """Bool ``(M, L_max)``: True where a block-major slot holds a real token."""
        mask = torch.zeros(self.num_blocks * self.max_block_len, dtype=torch.bool)
        mask[self.slot_index] = True
        return mask.reshape(self.num_blocks, self.max_block_len).to(device or "cpu")
