"""The registered op's ``"triton"`` backend (``mhla.py`` has the contract): two paths behind one contract.

* dense (``triton_dense.py``): MHLA as attention without softmax, one kernel forward and two backward;
  ``O(N² d)``, so for small N.
* blocked (``triton_mhla.py``): block summaries, mixing kernel, output; three launches forward, up to six
  backward; ``O(N d²)``.

The forward and its fake choose the path from static shapes (:func:`triton_dense.uses_dense_path`: token
count, blocks, head dim), so the fake implementation returns what the real forward saves. The backward
runs the path its forward ran, read off the saved tensors (:func:`triton_dense.ran_dense`: the dense path
saves no state), whatever the shapes or a forced path say by then. Both paths return gradients with the
same shapes, dtypes and strides, so :func:`backward_outputs_like` is the blocked path's.

This module, not ``triton_mhla.py``, holds the choice: the dense path reuses ``triton_mhla``'s device
helpers, so ``triton_mhla`` cannot import it back (``tests/test_structure.py`` forbids import cycles).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

from . import triton_dense, triton_mhla
from .triton_mhla import FEATURE_IDS, TileConfig, backward_outputs_like


def _path(q, blocks: Sequence[int]) -> ModuleType:
    """The module that runs a forward on q ``(B, H, N, d)`` with these blocks."""
    dense = triton_dense.uses_dense_path(q.shape[2], math.prod(blocks), q.shape[-1])
    return triton_dense if dense else triton_mhla


def forward(q, k, v, grid: Sequence[int], blocks: Sequence[int], mixing, feature_map: str, normalize: bool,
            eps: float, *, config: TileConfig | None = None):
    """``(out, state, norm, den)`` of the chosen path (arguments and returns as ``triton_mhla.forward``;
    the dense path's state and norm are empty). ``config``: launch parameters for either path."""
    path = _path(q, blocks)
    return path.forward(q, k, v, grid, blocks, mixing, feature_map, normalize, eps, config=config)


def forward_outputs_like(q, v, blocks: Sequence[int], normalize: bool):
    """Empty ``(out, state, norm, den)`` as :func:`forward` returns them for these shapes (the op's fake)."""
    return _path(q, blocks).forward_outputs_like(q, v, blocks, normalize)


def backward_reads_out(state) -> bool:
    """Whether the backward of the forward that saved ``state`` reads ``out``: the dense path's does (its
    query kernel computes G·o), the blocked path's gets G·o from the states."""
    return triton_dense.ran_dense(state)


def backward(grad_out, q, k, v, grid: Sequence[int], blocks: Sequence[int], mixing, feature_map: str,
             normalize: bool, eps: float, out, state, norm, den, needs: Sequence[bool], *,
             config: TileConfig | None = None):
    """``(dq, dk, dv, dmixing)`` from the path the forward ran (arguments as ``triton_mhla.backward``)."""
    path = triton_dense if triton_dense.ran_dense(state) else triton_mhla
    return path.backward(grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, out, state,
                         norm, den, needs, config=config)


__all__ = [
    "FEATURE_IDS",
    "TileConfig",
    "backward",
    "backward_outputs_like",
    "backward_reads_out",
    "forward",
    "forward_outputs_like",
]
