"""The Triton backend's dense path (``mhla_gen.ops.triton_dense``) against the float64 dense oracle.

Like ``tests/test_triton_mhla.py`` (whose input, oracle and tolerance helpers this file reuses), the kernel
tests run in Triton's interpreter in one child pytest (:func:`test_dense_kernels_in_interpreter`), fp32
and fp16 (the interpreter loads bf16 wrongly: bf16 runs in the ``gpu``-marked test). Shapes are small and
awkward: uneven 2D and 3D grids, one block, one token per block, token counts that are not a multiple of
the tile, head dims that are not powers of two (72, 40, 24), strided q/k/v/grad, normaliser on and off,
every feature map. Tiles of 16 tokens (``tl.dot``'s minimum) make every key and query loop run several
times. The blocked path's oracle cases also run on the dense path (``test_triton_mhla.py``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_triton_mhla import (
    EPS,
    NEEDS_ALL,
    _assert_close,
    _assert_matches_oracle,
    _cast,
    _mixing,
    _oracle,
    _run,
    _strided_inputs,
    tolerance,
)

from mhla_gen import BlockLayout
from mhla_gen.ops.naive import mhla_dense_weights

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETED, reason="interpreter test: runs in the child pytest of test_dense_kernels_in_interpreter"
)
DENSE_KERNELS = ["_dense_fwd_kernel", "_dense_dq_kernel", "_dense_dkv_kernel"]


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run itself")
def test_dense_kernels_in_interpreter():
    """All interpreter tests of this file in one child pytest with ``TRITON_INTERPRET=1`` (CPU tensors)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-x",
         str(Path(__file__).resolve())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-5000:]


@pytest.fixture(scope="module")
def tm():
    """The Triton backend (``triton_backend``), which runs the dense path or the blocked one."""
    pytest.importorskip("triton")
    return importlib.import_module("mhla_gen.ops.triton_backend")


@pytest.fixture(scope="module")
def td():
    pytest.importorskip("triton")
    return importlib.import_module("mhla_gen.ops.triton_dense")


@pytest.fixture
def dense(td):
    """The dense path forced for the test (the crossover would pick it for these shapes anyway)."""
    with td.triton_path("dense"):
        yield


@pytest.fixture
def launches(monkeypatch):
    """Names of the Triton kernels launched from now on, in order: a spy on ``kernel[grid]``, the launch
    entry of every ``@triton.jit`` kernel (compiled and interpreted alike)."""
    from triton.runtime.jit import KernelInterface

    calls, original = [], KernelInterface.__getitem__

    def spy(self, grid):
        calls.append(self.fn.__name__)
        return original(self, grid)

    monkeypatch.setattr(KernelInterface, "__getitem__", spy)
    return calls


def dense_tolerance(dtype, b: int, h: int, n: int, d: int) -> float:
    """``tolerance`` of ``test_triton_mhla.py`` for the dense path, whose longest fp32 sum is ∂W's:
    ``b·h·n²`` products ``dA[t, s]·P[t, s]`` (each a dot over d), so n² stands for n."""
    return tolerance(dtype, b, h, n * n, d)


# --------------------------------------------------------------------------------------------------
# interpreter: forward and all gradients vs the float64 oracle

# (grid, blocks, d, feature_map, normalize, block_t, (batch, heads))
CASES = [
    ((7, 5), (3, 2), 72, "relu", True, 16, (2, 2)),  # uneven on both axes, d = 72 (tiles of 128), N = 35
    ((5, 7, 3), (2, 3, 2), 24, "elu+1", False, 16, (1, 2)),  # uneven on all three axes, N = 105
    ((4, 6), (1, 1), 8, "relu", False, 16, (2, 1)),  # one block
    ((4, 5), (4, 5), 16, "elu+1", True, 16, (1, 2)),  # one token per block, M = 20 (one-hot tiles of 32)
    ((37,), (5,), 40, "relu+1e-6", True, 16, (2, 1)),  # 1D uneven, d = 40
    ((5, 7), (2, 3), 8, "identity", False, 16, (1, 2)),
    ((11, 9), (3, 4), 32, "relu", True, None, (1, 1)),  # default tiles (64 tokens, two of them)
]
CASE_IDS = [
    f"{'x'.join(map(str, grid))}-{'x'.join(map(str, blocks))}-d{d}-{feature_map}-norm{int(normalize)}"
    for grid, blocks, d, feature_map, normalize, *_ in CASES
]
FP16_CASES = [0, 3, 4]


def _check_case(tm, case, dtype):
    grid, blocks, d, feature_map, normalize, block_t, (b, h) = CASES[case]
    layout = BlockLayout(grid, blocks)
    q, k, v, g = _strided_inputs(b, h, layout.num_tokens, d, dtype)
    mixing = _mixing(layout)
    config = tm.TileConfig(block_t=block_t)
    got, (state, norm, den) = _run(tm, q, k, v, g, mixing, layout, feature_map, normalize, dtype, config)
    assert state.numel() == norm.numel() == 0  # the dense path ran: it saves only den
    assert den.shape == ((b, h, layout.num_tokens) if normalize else (0,))
    assert [x.dtype for x in got] == [dtype] * 4 + [torch.float32]
    _assert_matches_oracle(got, dense_tolerance(dtype, b, h, layout.num_tokens, d),
                           q, k, v, g, layout, mixing, feature_map, normalize)


@interpreter_only
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_dense_matches_oracle_fp32(tm, dense, case):
    _check_case(tm, case, torch.float32)


@interpreter_only
@pytest.mark.parametrize("case", FP16_CASES, ids=[CASE_IDS[i] for i in FP16_CASES])
def test_dense_matches_oracle_fp16(tm, dense, case):
    _check_case(tm, case, torch.float16)


@interpreter_only
@pytest.mark.parametrize("normalize", [True, False])
def test_dense_saved_tensors_and_fakes(tm, dense, normalize):
    """den = Σ_s A[t, s] + eps against float64; out on heads-interleaved memory; every output's shape, dtype
    and strides as ``forward_outputs_like`` promises (the op's fake implementation)."""
    layout = BlockLayout((5, 7), (2, 3))
    b, h, n, d = 2, 2, layout.num_tokens, 8
    q, k, v, _ = _strided_inputs(b, h, n, d, torch.float32)
    mixing = _mixing(layout)
    got = tm.forward(*(_cast(x, torch.float32) for x in (q, k, v)), layout.grid, layout.blocks,
                     mixing.float(), "elu+1", normalize, EPS, config=tm.TileConfig(block_t=16))
    for x, y in zip(got, tm.forward_outputs_like(q.float(), v.float(), layout.blocks, normalize)):
        assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
    out, state, norm, den = got
    assert out.transpose(1, 2).is_contiguous()  # (B, N, H, e) memory
    assert state.numel() == norm.numel() == 0
    if normalize:
        expected = mhla_dense_weights(q, k, layout, mixing, "elu+1").sum(-1) + EPS
        tol = dense_tolerance(torch.float32, b, h, n, d)
        torch.testing.assert_close(den.double(), expected, rtol=tol, atol=0)
    else:
        assert den.numel() == 0


# needs (q, k, v, mixing) -> the kernels the dense backward launches, with and without the normaliser:
# kernel 1 (query tiles) for dq, dW, or g_den when dk/dv need it; kernel 2 (key tiles) for dk, dv
SUBSETS = {
    (1, 0, 0, 0): (["_dense_dq_kernel"], ["_dense_dq_kernel"]),
    (0, 1, 0, 0): (["_dense_dq_kernel", "_dense_dkv_kernel"], ["_dense_dkv_kernel"]),
    (0, 0, 1, 0): (["_dense_dq_kernel", "_dense_dkv_kernel"], ["_dense_dkv_kernel"]),
    (0, 0, 0, 1): (["_dense_dq_kernel"], ["_dense_dq_kernel"]),
    (1, 0, 1, 1): (["_dense_dq_kernel", "_dense_dkv_kernel"], ["_dense_dq_kernel", "_dense_dkv_kernel"]),
    (0, 0, 0, 0): ([], []),
}


@interpreter_only
@pytest.mark.parametrize("normalize", [True, False])
def test_dense_gradient_subsets(tm, dense, launches, normalize):
    """Each subset of gradients: the same values as with all four, None elsewhere, the shapes, dtypes and
    strides ``backward_outputs_like`` promises, and only the kernels the subset needs."""
    layout = BlockLayout((5, 7), (2, 3))
    q, k, v, g = (_cast(x, torch.float32) for x in _strided_inputs(1, 2, layout.num_tokens, 8, torch.float32))
    mixing = _mixing(layout).float()
    args = (q, k, v, layout.grid, layout.blocks, mixing, "relu", normalize, EPS)
    cfg = tm.TileConfig(block_t=16)
    out, *saved = tm.forward(*args, config=cfg)
    backward = lambda needs: tm.backward(g, *args, out, *saved, needs, config=cfg)  # noqa: E731
    full = backward(NEEDS_ALL)
    for needs, kernels in SUBSETS.items():
        launches.clear()
        grads = backward(needs)
        assert launches == kernels[0 if normalize else 1], needs
        like = tm.backward_outputs_like(q, k, v, mixing, needs)
        for need, a, b, fake in zip(needs, grads, full, like):
            assert (a is None and fake is None) if not need else torch.equal(a, b), needs
            if need:
                assert (a.shape, a.stride(), a.dtype) == (fake.shape, fake.stride(), fake.dtype)


@interpreter_only
@pytest.mark.parametrize("path", ["dense", "blocked"])
def test_launches_per_call(td, launches, path):
    """Through ``mhla_attention``: the dense path is one launch forward and two backward (so that "one
    launch" cannot quietly become four); the blocked path runs its own kernels and none of the dense ones."""
    from mhla_gen.ops import mhla_attention, mhla_backend

    layout = BlockLayout((5, 7), (2, 3))
    q, k, v, g = _strided_inputs(1, 2, layout.num_tokens, 8, torch.float32)
    leaves = [x.float().requires_grad_() for x in (q, k, v)] + [_mixing(layout).float().requires_grad_()]
    with mhla_backend("triton"), td.triton_path(path):
        out = mhla_attention(*leaves[:3], layout, leaves[3], "relu", True, eps=EPS)
        forward = list(launches)
        launches.clear()
        torch.autograd.grad(out, leaves, g.float())
    if path == "dense":
        assert forward == ["_dense_fwd_kernel"]
        assert launches == ["_dense_dq_kernel", "_dense_dkv_kernel"]
    else:
        # exact blocked counts are pinned in tests/test_triton_mhla.py (test_launches_per_call)
        assert "_summary_kernel" in forward and "_dq_dstate_kernel" in launches, (forward, launches)
        assert not set(DENSE_KERNELS) & set(forward + launches)


@interpreter_only
def test_op_takes_the_dense_path_by_its_crossover(launches):
    """``mhla_attention`` on the Triton backend without a forced path: a small N runs the dense kernels
    (the crossover), the backward runs the dense backward even when the blocked path is forced in between,
    forward and all gradients match the oracle, and ``opcheck`` confirms the fake outputs match the dense
    path's (empty state and norm)."""
    from mhla_gen.ops import mhla_attention, mhla_backend
    from mhla_gen.ops.triton_dense import triton_path

    layout = BlockLayout((3, 5, 6), (2, 2, 3))
    q, k, v, g = _strided_inputs(1, 2, layout.num_tokens, 16, torch.float32)
    mixing = _mixing(layout)
    leaves = [x.float().requires_grad_() for x in (q, k, v)] + [mixing.float().requires_grad_()]
    with mhla_backend("triton"):
        out = mhla_attention(*leaves[:3], layout, leaves[3], "elu+1", True, eps=EPS)
        with triton_path("blocked"):
            got = (out.detach(), *torch.autograd.grad(out, leaves, g.float()))
    assert launches == DENSE_KERNELS
    _assert_matches_oracle(got, dense_tolerance(torch.float32, 1, 2, layout.num_tokens, 16),
                           q, k, v, g, layout, mixing, "elu+1", True)
    args = (*leaves[:3], list(layout.grid), list(layout.blocks), leaves[3], "relu", True, EPS, "triton")
    torch.library.opcheck(torch.ops.mhla_gen.mhla.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@interpreter_only
@pytest.mark.parametrize("negative", ["q", "k"])
def test_dense_zero_features(tm, dense, negative):
    """ReLU features all zero (every q, or every k, negative): output 0, den = eps exactly, all gradients 0
    (no NaN from 0 / eps, nor from dA = G·v / eps ~ 1e6 when k is negative)."""
    layout = BlockLayout((4, 5), (2, 2))
    q, k, v, g = _strided_inputs(1, 2, layout.num_tokens, 8, torch.float32)
    q, k = (-x.abs() if name == negative else x for name, x in (("q", q), ("k", k)))
    got, (_, _, den) = _run(tm, q, k, v, g, _mixing(layout), layout, "relu", True, torch.float32,
                            tm.TileConfig(block_t=16))
    assert (den == EPS).all()
    assert all((x == 0).all() for x in got)


@interpreter_only
def test_dense_fp16_weights_beyond_range(tm, dense):
    """fp16 with attention weights beyond fp16's range: A[t, s] ~ 1e5 (large q, k; forward, normaliser
    on) and dP = W ∘ (G·v) ~ 1e5 (large G and v; backward, normaliser off). The power-of-two scaled dot
    operands keep the output and all gradients accurate (unscaled, A and dP would be inf)."""
    layout = BlockLayout((8, 6), (2, 3))
    n, d = layout.num_tokens, 16
    q, k, v, g = _strided_inputs(1, 2, n, d, torch.float16)
    mixing, cfg = _mixing(layout), tm.TileConfig(block_t=16)
    half = lambda x: x.half().double()  # noqa: E731
    tol = dense_tolerance(torch.float16, 1, 2, n, d)

    big_q, big_k = half((q.abs() + 1) * 60), half((k.abs() + 1) * 60)
    assert mhla_dense_weights(big_q, big_k, layout, mixing).max() > 4 * 65504
    got, _ = _run(tm, big_q, big_k, v, g, mixing, layout, "relu", True, torch.float16, cfg)
    # G·o with o rounded to fp16 on top of the usual fp16 roundings: twice the bound (as in the blocked test)
    _assert_close(got, _oracle(big_q, big_k, v, g, layout, mixing, "relu", True), 2 * tol)

    # a per-channel sign shared by all tokens, so that G_t·v_s adds d terms of one sign: ~1e5
    common = torch.randn(d, generator=torch.Generator().manual_seed(5), dtype=torch.float64).sign()
    small_q, small_k = half(q * 1e-3), half(k * 1e-3)
    big_v, big_g = half(v + common), half((g + common) * 4000)
    d_p = (big_g @ big_v.transpose(-1, -2)) * mixing[layout.block_index][:, layout.block_index]
    assert d_p.abs().max() > 65504
    got, _ = _run(tm, small_q, small_k, big_v, big_g, mixing, layout, "relu", False, torch.float16, cfg)
    _assert_matches_oracle(got, tol, small_q, small_k, big_v, big_g, layout, mixing, "relu", False)


# --------------------------------------------------------------------------------------------------
# the choice of path (no kernels run)


@pytest.mark.skipif(INTERPRETED, reason="not a kernel test")
def test_uses_dense_path(td):
    """The crossover, the override, the forced path and the limits, in one function."""
    assert td.uses_dense_path(256, 16, 72)  # DiT-XL/2 at 256 px
    assert td.uses_dense_path(td.DENSE_MAX_TOKENS, td.DENSE_MAX_BLOCKS, td.DENSE_MAX_HEAD_DIM)
    assert not td.uses_dense_path(td.DENSE_MAX_TOKENS + 1, 16, 72)
    assert not td.uses_dense_path(256, td.DENSE_MAX_BLOCKS + 1, 72)
    assert not td.uses_dense_path(256, 16, td.DENSE_MAX_HEAD_DIM + 1)
    assert td.uses_dense_path(4096, 16, 72, max_tokens=4096)  # a tuning table's crossover
    assert not td.uses_dense_path(256, td.DENSE_BLOCK_LIMIT + 1, 72, max_blocks=10**6)
    assert not td.uses_dense_path(256, 16, 72, False) and td.uses_dense_path(32760, 100, 128, True)
    with td.triton_path("blocked"):
        assert not td.uses_dense_path(256, 16, 72)
        assert td.uses_dense_path(256, 16, 72, override=True)  # the argument wins
        with td.triton_path("dense"):
            assert td.uses_dense_path(32760, 16, 128)
        assert not td.uses_dense_path(256, 16, 72)
    assert td.uses_dense_path(256, 16, 72)  # back to the crossover
    with pytest.raises(ValueError, match="at most 128 blocks"):
        td.uses_dense_path(1024, td.DENSE_BLOCK_LIMIT + 1, 64, override=True)
    with pytest.raises(ValueError, match="unknown Triton MHLA path"), td.triton_path("flash"):
        pass
    assert td.dense_tiles(72, 72) == td.DenseTiles(32, 32, 8)
    assert td.dense_tiles(64, 64, td.TileConfig(block_t=2, num_warps=2)) == td.DenseTiles(16, 16, 2)


@pytest.mark.skipif(INTERPRETED, reason="not a kernel test")
def test_fake_outputs_follow_the_crossover(tm):
    """The op's fake implementation saves what the path its shapes choose saves: nothing but den below the
    crossover, the blocked path's S̃ and z̃ above it (meta tensors: no memory, no kernels)."""
    def saved_shapes(n, m_blocks):
        q = torch.empty(2, 16, n, 72, device="meta")
        return [tuple(x.shape) for x in tm.forward_outputs_like(q, q, m_blocks, True)[1:]]

    assert saved_shapes(256, (4, 4)) == [(0,), (0,), (2, 16, 256)]
    assert saved_shapes(4096, (4, 4)) == [(2, 16, 16, 72, 72), (2, 16, 16, 72), (2, 16, 4096)]


# --------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)

GPU_SHAPES = [
    ((16, 16), (4, 4), 72, 2, 16),  # DiT-XL/2 at 256 px
    ((7, 9, 5), (2, 4, 3), 64, 2, 3),  # uneven 3D, N = 315
    ((33,), (4,), 128, 1, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("grid, blocks, d, b, h", GPU_SHAPES)
def test_cuda_dense_vs_blocked_vs_oracle(tm, td, dtype, grid, blocks, d, b, h):
    """Default launch configuration on CUDA: dense and blocked paths against the float64 oracle, forward and
    every gradient, both within the dtype's tolerance; dense results identical run to run (∂W from
    per-program partials, no atomics)."""
    layout = BlockLayout(grid, blocks)
    q, k, v, g = _strided_inputs(b, h, layout.num_tokens, d, dtype, "cuda")
    mixing = _mixing(layout).cuda()
    results = {}
    for path in ("dense", "blocked"):
        with td.triton_path(path):
            results[path], (state, *_) = _run(tm, q, k, v, g, mixing, layout, "relu", True, dtype)
        assert (state.numel() == 0) == (path == "dense")
    tol = dense_tolerance(dtype, b, h, layout.num_tokens, d)
    for got in results.values():
        _assert_matches_oracle(got, tol, q, k, v, g, layout, mixing, "relu", True)
    with td.triton_path("dense"):
        again, _ = _run(tm, q, k, v, g, mixing, layout, "relu", True, dtype)
    assert all(torch.equal(a, b) for a, b in zip(again, results["dense"]))
