"""Block partition of a 1D / 2D / 3D token grid.

Tokens are numbered row-major over the grid, the order diffusers produces after patchify:
``(n)``, ``(h w)`` or ``(f h w)``. Each grid axis of length ``L`` cut into ``b`` blocks is split into
``b`` contiguous ranges whose lengths differ by at most one: the first ``L % b`` ranges have
``L // b + 1`` tokens, the rest ``L // b`` (as ``torch.tensor_split``). Block ids are row-major over
the block grid.

The fast paths work on **sub-grids**: per axis the blocks form at most two runs of equal
blocks (the long ones, then the short ones), so a 2D / 3D grid is the union of at most 4 / 8 evenly
tiled boxes. Inside one box every block has the same shape, so reordering its tokens block-major is a
view, a permute and (at most) one copy — no padding, no index scatter. An evenly divisible grid is a
single sub-grid. Everything here is plain integer arithmetic, so ``torch.compile`` traces it.

A :class:`BlockLayout` checks its grid when built and works out its sub-grids on first use. The
processors only check the grid and hand it to the op (which tiles with concrete sizes when it runs), so
a model compiled with ``dynamic=True`` serves every resolution from one graph: nothing traced asks
whether an axis divides.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch

# The PyTorch backend loops over slabs of at most max(N // 4, CHUNK_MIN_TOKENS) tokens (Tiling.chunks):
# its block-major temporaries then stay a fraction of one (B, H, N, d) tensor on large grids, while grids
# of up to this many tokens run as whole sub-grids (fewer, larger GEMMs).
CHUNK_MIN_TOKENS = 4096


def split_sizes(length: int, parts: int) -> list[int]:
    """Lengths of ``parts`` contiguous ranges covering ``length`` that differ by at most one."""
    base, extra = length // parts, length % parts
    return [base + 1 if i < extra else base for i in range(parts)]


def _axis_runs(length: int, parts: int) -> list[tuple[int, int, int, int]]:
    """Runs of equal blocks along one axis: ``(first token, first block, blocks, tokens per block)``."""
    base, extra = length // parts, length % parts
    runs = [(0, 0, extra, base + 1)] if extra else []
    runs.append((extra * (base + 1), extra, parts - extra, base))
    return runs


def _as_tuple(value, name: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints. Sizes traced symbolically (``torch.SymInt``) stay symbolic: ``int()``
    would pin a ``torch.export`` with dynamic shapes to the example's resolution."""
    if isinstance(value, (int, torch.SymInt)):
        value = (value,)
    try:
        out = tuple(v if isinstance(v, torch.SymInt) else int(v) for v in value)
    except TypeError as err:
        raise ValueError(f"{name} must be an int or a sequence of ints, got {value!r}") from err
    if any(o != v for o, v in zip(out, value) if not isinstance(v, torch.SymInt)):
        raise ValueError(f"{name} must contain integers, got {value!r}")
    return out


@dataclass(frozen=True)
class SubGrid:
    """An evenly tiled box of the token grid: ``counts[a]`` blocks of ``sizes[a]`` tokens along axis a.

    Attributes:
        start: first token coordinate per axis.
        first_block: first block coordinate per axis (in the layout's block grid).
        counts: blocks per axis inside the box.
        sizes: tokens per block per axis.
        offset: position of the box's first block in the layout's sub-grid block order.
    """

    start: tuple[int, ...]
    first_block: tuple[int, ...]
    counts: tuple[int, ...]
    sizes: tuple[int, ...]
    offset: int

    @property
    def num_blocks(self) -> int:
        return math.prod(self.counts)

    @property
    def block_len(self) -> int:
        return math.prod(self.sizes)

    def token_view(self, x: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """``(B, H, N, c)`` token-order ``x`` -> the box's tokens as a view
        ``(n0, [n1, n2,] B, H, s0, [s1, s2,] c)`` (block coords first, then coords inside the block)."""
        nd = len(grid)
        split = [v for pair in zip(self.counts, self.sizes) for v in pair]  # n0, s0, n1, s1, ..
        # A box that is the whole grid (an even grid not cut into slabs) is a single view; the general
        # branch builds the same view from ndim + 1 more calls, and the op takes several token views per
        # sub-grid, so on small grids the calls add up.
        if all(n * s == g for n, s, g in zip(self.counts, self.sizes, grid)):
            x = x.view(*x.shape[:2], *split, x.shape[-1])
        else:
            x = x.unflatten(2, grid)  # (B, H, *grid, c)
            for axis in range(nd):
                x = x.narrow(2 + axis, self.start[axis], self.counts[axis] * self.sizes[axis])
            x = x.reshape(*x.shape[:2], *split, x.shape[-1])  # a view: each axis is split, not merged
        # (B, H, n0, s0, n1, s1, .., c) -> (n0, n1, .., B, H, s0, s1, .., c)
        return x.permute(*range(2, 2 + 2 * nd, 2), 0, 1, *range(3, 3 + 2 * nd, 2), 2 + 2 * nd)

    def block_split(self, xb: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
        """Block-major ``(Mg, B, H, Lg, c)`` or ``(Mg·B·H, Lg, c)`` seen with the shape of
        :meth:`token_view`."""
        return xb.view(*self.counts, batch, heads, *self.sizes, xb.shape[-1])

    def slabs(self, max_tokens: int) -> list[SubGrid]:
        """The box cut along axis 0 into pieces of whole block rows, each at most ``max_tokens`` tokens
        (at least one block row). Block rows are the outermost index of the box's block order, so each
        piece is again a sub-grid, and its blocks are consecutive in sub-grid block order."""
        row_blocks = self.num_blocks // self.counts[0]  # blocks in one row along axis 0
        rows = max(1, max_tokens // (row_blocks * self.block_len))
        return [
            SubGrid(
                (self.start[0] + i * self.sizes[0], *self.start[1:]),
                (self.first_block[0] + i, *self.first_block[1:]),
                (min(rows, self.counts[0] - i), *self.counts[1:]),
                self.sizes,
                self.offset + i * row_blocks,
            )
            for i in range(0, self.counts[0], rows)
        ]


@dataclass(frozen=True)
class Tiling:
    """How a layout's blocks tile its grid.

    Attributes:
        axis_sizes: per axis, the length of each block range.
        is_even: every axis divides exactly (a single sub-grid).
        subgrids: the evenly tiled boxes (one when every axis divides), in row-major order of their runs.
        block_order: ``(M,)`` list: the layout's block id of each block in sub-grid order (the order
            the fast paths produce summaries in).
        natural_order: ``block_order`` is the identity (even grids, and every 1D layout).
        chunks: the sub-grids cut along axis 0 into slabs of at most ``max(N // 4, CHUNK_MIN_TOKENS)``
            tokens (whole block rows; a small grid is its sub-grids), in the same block order: what the
            PyTorch op loops over, so its block-major temporaries stay a fraction of one ``(B, H, N, d)``
            tensor.
    """

    axis_sizes: list[list[int]]
    is_even: bool
    subgrids: list[SubGrid]
    block_order: list[int]
    natural_order: bool
    chunks: list[SubGrid]

    @staticmethod
    def of(grid: tuple[int, ...], blocks: tuple[int, ...]) -> Tiling:
        subgrids, offset = [], 0
        for runs in itertools.product(*[_axis_runs(g, b) for g, b in zip(grid, blocks)]):
            start, first, counts, sizes = (tuple(run[i] for run in runs) for i in range(4))
            subgrids.append(SubGrid(start, first, counts, sizes, offset))
            offset += math.prod(counts)
        block_order = [
            _block_id([f + c for f, c in zip(sub.first_block, coords)], blocks)
            for sub in subgrids
            for coords in itertools.product(*[range(n) for n in sub.counts])
        ]
        max_tokens = max(math.prod(grid) // 4, CHUNK_MIN_TOKENS)
        return Tiling(
            axis_sizes=[split_sizes(g, b) for g, b in zip(grid, blocks)],
            is_even=all(g % b == 0 for g, b in zip(grid, blocks)),
            subgrids=subgrids,
            block_order=block_order,
            natural_order=block_order == list(range(len(block_order))),  # even grids, 1D, ..
            chunks=[piece for sub in subgrids for piece in sub.slabs(max_tokens)],
        )


def _block_id(coords, blocks) -> int:
    """Row-major id of the block at ``coords`` in the block grid ``blocks``."""
    block = 0
    for c, b in zip(coords, blocks):
        block = block * b + c
    return block


class BlockLayout:
    """Tiles of a token grid.

    Args:
        grid: token grid shape, ``(N,)``, ``(H, W)`` or ``(F, H, W)``.
        blocks: number of blocks per axis, same rank as ``grid``; ``1 <= blocks[a] <= grid[a]``.

    Attributes:
        num_tokens: ``N = prod(grid)``.
        num_blocks: ``M = prod(blocks)``.

    The tiling (:class:`Tiling`: ``axis_sizes``, ``is_even``, ``subgrids``, ``block_order``,
    ``natural_order``, ``chunks``, read as attributes of the layout) is built on first use.
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
        self._tiling = None  # built on first use: see the module docstring

    @property
    def tiling(self) -> Tiling:
        # not functools.cached_property: on Python 3.11 it takes an RLock, which torch.compile cannot
        # trace (fullgraph fails, "Unsupported context manager"), and the causal path tiles under tracing
        if self._tiling is None:
            self._tiling = Tiling.of(self.grid, self.blocks)
        return self._tiling

    axis_sizes = property(lambda self: self.tiling.axis_sizes)
    is_even = property(lambda self: self.tiling.is_even)
    subgrids = property(lambda self: self.tiling.subgrids)
    block_order = property(lambda self: self.tiling.block_order)
    natural_order = property(lambda self: self.tiling.natural_order)
    chunks = property(lambda self: self.tiling.chunks)

    def __repr__(self) -> str:
        return f"BlockLayout(grid={self.grid}, blocks={self.blocks})"

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockLayout) and (self.grid, self.blocks) == (other.grid, other.blocks)

    def __hash__(self) -> int:
        return hash((self.grid, self.blocks))

    def check_tokens(self, n: int, what: str = "sequence length") -> None:
        if n != self.num_tokens:
            raise ValueError(
                f"{what} {n} does not match grid {self.grid} (expected {self.num_tokens} tokens)"
            )

    # ----------------------------------------------------------------------------------------------
    # index tensors, for the references, tests and analysis (never on a fast path)

    @property
    def block_index(self) -> torch.Tensor:
        """LongTensor ``(N,)``: block id of each token in row-major token order."""
        ids = torch.zeros((), dtype=torch.long)
        for axis, sizes in enumerate(self.axis_sizes):
            axis_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
            ids = ids.unsqueeze(-1) * self.blocks[axis] + axis_ids
        return ids.reshape(-1)

    @property
    def block_lengths(self) -> torch.Tensor:
        """LongTensor ``(M,)``: number of tokens in each block."""
        return torch.bincount(self.block_index, minlength=self.num_blocks)

    @property
    def block_centers(self) -> torch.Tensor:
        """Float tensor ``(M, ndim)``: block coordinates in block units (row-major block ids)."""
        axes = [torch.arange(b, dtype=torch.float64) for b in self.blocks]
        return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, self.ndim)

    # ----------------------------------------------------------------------------------------------
    # token order <-> block-major order, differentiable (the plain-autograd path and the references)

    def to_blocks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``(B, H, N, c)`` token order -> one ``(Mg, B, H, Lg, c)`` tensor per sub-grid."""
        self.check_tokens(x.shape[2])
        return [
            sub.token_view(x, self.grid).reshape(sub.num_blocks, *x.shape[:2], sub.block_len, x.shape[-1])
            for sub in self.subgrids
        ]

    def from_blocks(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_blocks`: ``(Mg, B, H, Lg, c)`` per sub-grid -> ``(B, H, N, c)``."""
        boxes = [self._box(sub, xb) for sub, xb in zip(self.subgrids, parts)]  # (B, H, *box, c) each
        for axis in reversed(range(self.ndim)):  # glue the runs back together, last axis first
            runs = len(_axis_runs(self.grid[axis], self.blocks[axis]))
            boxes = [torch.cat(boxes[i : i + runs], dim=2 + axis) for i in range(0, len(boxes), runs)]
        (tokens,) = boxes
        return tokens.flatten(2, 1 + self.ndim)

    def _box(self, sub: SubGrid, xb: torch.Tensor) -> torch.Tensor:
        """``(Mg, B, H, Lg, c)`` -> the box in grid order ``(B, H, n0 s0, n1 s1, .., c)``."""
        nd = self.ndim
        x = sub.block_split(xb, *xb.shape[1:3])  # (n0, n1, .., B, H, s0, s1, .., c)
        order = [nd, nd + 1] + [v for a in range(nd) for v in (a, nd + 2 + a)]
        x = x.permute(*order, x.dim() - 1)  # (B, H, n0, s0, n1, s1, .., c)
        box = [n * s for n, s in zip(sub.counts, sub.sizes)]
        return x.reshape(*x.shape[:2], *box, x.shape[-1])

    def mixing_in_block_order(self, mixing: torch.Tensor) -> torch.Tensor:
        """``W`` with rows and columns in sub-grid block order (``W[order][:, order]``)."""
        if self.natural_order:
            return mixing
        order = torch.tensor(self.block_order, device=mixing.device)
        return mixing[order][:, order]

    def mixing_from_block_order(self, mixing: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`mixing_in_block_order` (e.g. for the mixing gradient)."""
        if self.natural_order:
            return mixing
        inverse = torch.argsort(torch.tensor(self.block_order, device=mixing.device))
        return mixing[inverse][:, inverse]


@functools.lru_cache(maxsize=64)
def _cached_layout(grid: tuple[int, ...], blocks: tuple[int, ...]) -> BlockLayout:
    return BlockLayout(grid, blocks)


def layout_for(grid: tuple[int, ...], blocks: tuple[int, ...]) -> BlockLayout:
    """``BlockLayout(grid, blocks)``, cached in eager mode (torch.compile traces the constructor)."""
    if torch.compiler.is_compiling():
        return BlockLayout(grid, blocks)
    return _cached_layout(tuple(grid), tuple(blocks))
