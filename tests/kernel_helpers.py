"""Inputs, oracles and tolerances shared by the kernel tests (``test_triton_mhla.py``,
``test_triton_dense.py``, ``test_rope.py``), and the child pytest that runs a file's tests in Triton's
interpreter.

Importing this module imports no Triton: the interpreter must be switched on (``TRITON_INTERPRET=1``)
before ``triton`` is first imported, which :func:`run_in_interpreter`'s child process does.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhla_gen.ops.naive import mhla_dense

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6
NEEDS_ALL = (True, True, True, True)


interpreter_only = pytest.mark.skipif(
    not INTERPRETED, reason="interpreter test: runs in the child pytest of the file's *_in_interpreter test"
)
main_process_only = pytest.mark.skipif(INTERPRETED, reason="runs in the main test process")


def run_in_interpreter(test_file: str, timeout: int = 600) -> None:
    """All tests of ``test_file`` in one child pytest with ``TRITON_INTERPRET=1`` (CPU tensors); asserts
    that it passed (its interpreter-only tests run there; nothing leaks into this process)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-x",
         str(Path(test_file).resolve())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-5000:]


# --------------------------------------------------------------------------------------------------
# inputs and the oracle

LAYOUTS = ("contiguous", "interleaved", "fused")
"""Memory of a ``(B, H, N, d)`` tensor: contiguous; heads-interleaved ``(B, N, H, d).transpose(1, 2)`` (what
the processors pass); a slice of a fused ``(B, N, 3, H, d)`` projection (not dense)."""


def laid_out(shape, layout, gen, dtype=torch.float32, draw=torch.float32, storage=None, device="cpu"):
    """``(B, H, N, d)`` random values (drawn in ``draw``) exact in ``dtype``, stored in ``storage`` (default
    ``dtype``) on ``device``, in the memory ``layout`` names (:data:`LAYOUTS`)."""
    b, h, n, d = shape
    memory = {"contiguous": (b, h, n, d), "interleaved": (b, n, h, d), "fused": (b, n, 3, h, d)}[layout]
    x = torch.randn(memory, generator=gen, dtype=draw).to(dtype).to(device, storage or dtype)
    if layout == "contiguous":
        return x
    return (x if layout == "interleaved" else x[:, :, 1]).transpose(1, 2)


def strided_inputs(b, h, n, d, dtype, device="cpu", seed=0):
    """q contiguous (B, H, N, d); k heads-interleaved (B, N, H, d) memory; v a slice of a fused
    (B, N, 3, H, d) projection (token stride 3·H·d); grad_out heads-interleaved. float64 values that
    are exact in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    layouts = ("contiguous", "interleaved", "fused", "interleaved")
    return tuple(laid_out((b, h, n, d), layout, gen, dtype, draw=torch.float64, storage=torch.float64,
                          device=device) for layout in layouts)


def cast_strided(x, dtype):
    """``x`` in ``dtype`` with x's strides (``.to`` would make a non-dense view such as v contiguous)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device).copy_(x)


def dense_oracle(q, k, v, g, layout, mixing, feature_map, normalize):
    """float64 ``(out, dq, dk, dv, dmixing)`` of the dense form."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, mixing)]
    out = mhla_dense(*leaves[:3], layout, leaves[3], feature_map, normalize, eps=EPS)
    return (out.detach(), *torch.autograd.grad(out, leaves, g))


def mixing_matrix(layout, seed=1):
    """Positive, non-symmetric (M, M), rows not summing to one."""
    m = layout.num_blocks
    mixing = 0.1 + torch.rand(m, m, generator=torch.Generator().manual_seed(seed))
    return mixing.double()  # exact in fp32, the kernels' mixing dtype here


def run_kernels(tm, q, k, v, g, mixing, layout, feature_map, normalize, dtype, config=None, needs=NEEDS_ALL):
    """``((out, dq, dk, dv, dmixing), (state, norm, den))`` from the kernels' forward and backward (which
    gets ``out`` only where it reads it, an empty tensor otherwise, as the op passes it)."""
    qx, kx, vx, gx = (cast_strided(x, dtype) for x in (q, k, v, g))
    args = (qx, kx, vx, layout.grid, layout.blocks, mixing.float(), feature_map, normalize, EPS)
    out, *saved = tm.forward(*args, config=config)
    kept = out if tm.backward_reads_out(saved[0]) else out.new_empty(0)
    grads = tm.backward(gx, *args, kept, *saved, needs, config=config)
    return (out, *grads), tuple(saved)


def term_scale(q, k, v, g, layout, mixing, feature_map, normalize):
    """float64 ``(out, dq, dk, dv, dmixing)`` of the oracle on ``|v|`` and ``|g|``: with a nonnegative feature
    map and no normaliser every product summed is then nonnegative, so each entry is the sum of the
    magnitudes of the terms its reduction adds (what rounding error scales with), not the sum itself,
    which can cancel (one block, M = 1: dmixing is one scalar summed over B·H·N·d·e products)."""
    return dense_oracle(q, k, v.abs(), g.abs(), layout, mixing, feature_map, normalize)


def rel_errors(got, expected, scale=None) -> dict[str, float]:
    """``max |got - ref|`` over the larger of ``max |ref|`` and ``max`` of the term magnitudes ``scale``."""
    names = ("out", "dq", "dk", "dv", "dmixing")
    scale = scale or expected
    return {
        name: ((a.double() - b).abs().max() / max(b.abs().max(), s.abs().max())).item()
        for name, a, b, s in zip(names, got, expected, scale)
        if a is not None
    }


def assert_all_close(got, expected, tol, scale=None):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmixing"), got, expected):
        assert a is not None and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
    errors = rel_errors(got, expected, scale)
    assert max(errors.values()) <= tol, errors


def assert_matches_oracle(got, tol, *oracle):
    """:func:`assert_all_close` against the float64 oracle of ``oracle`` (``dense_oracle``'s arguments),
    errors relative to its terms' magnitudes (:func:`term_scale`): what :func:`tolerance` bounds."""
    assert_all_close(got, dense_oracle(*oracle), tol, term_scale(*oracle))


# --------------------------------------------------------------------------------------------------
# tolerances

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def tolerance(dtype, b: int, h: int, n: int, d: int) -> float:
    """The largest relative error (:func:`rel_errors`) the kernels may have, from the arithmetic
    rather than from one machine's measurement: every tensor is a fp32 sum of at most ``b·h·n·(d+1)``
    products (dmixing's, the longest reduction), whose rounding error relative to the sum of the terms'
    magnitudes (:func:`term_scale`; the sum itself can cancel) stays below λ·√n·u with high
    probability (Higham & Mary, SIAM J. Sci. Comput. 2019; λ = 4); 16-bit inputs, state operands and
    results add a few roundings of their own unit roundoff (4 u). Measured (interpreter, 2026-11-28, torch
    2.14, triton 3.8, relative to max |ref| alone): fp32 at most 5.8e-7 against bounds of 3.5e-6..1.5e-5;
    fp16 at most 1.0e-3 against 2e-3."""
    fp32 = 4 * math.sqrt(b * h * n * (d + 1)) * UNIT_ROUNDOFF[torch.float32]
    return fp32 if dtype == torch.float32 else fp32 + 4 * UNIT_ROUNDOFF[dtype]
