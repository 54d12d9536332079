"""The Triton MHLA kernels (``mhla_gen.ops.triton_mhla``) against the float64 dense oracle.

Without a GPU the kernels run in Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before ``triton`` itself is first imported (parts of ``triton.language`` are ``@triton.jit`` functions,
built at import). So :func:`test_kernels_in_interpreter` runs this file's interpreter tests in one child
``pytest`` with the variable set; nothing leaks into this process. Run them directly with
``TRITON_INTERPRET=1 pytest tests/test_triton_mhla.py``. The interpreter is faithful for fp32 and fp16
(its dots accumulate fp16 products in fp32, like tensor cores) but loads bf16 wrongly, so bf16 runs only
in the ``gpu``-marked tests.

The Triton backend has two paths (blocked kernels, and the dense kernels of ``triton_dense.py`` for small
N); the autouse fixture ``kernel_path`` pins the blocked one here unless a test asks for both
(``tests/test_triton_dense.py`` has the dense path's own tests).

Errors are ``max |got - ref| / max |ref|`` per tensor (output and each gradient). Tiny tiles
(``block_t`` 2-8, d- and e-tiles of 8) make blocks span several token tiles, so every kernel loop
runs more than once on these small grids.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_helpers import (
    EPS,
    INTERPRETED,
    NEEDS_ALL,
    ROOT,
    UNIT_ROUNDOFF,
    assert_all_close,
    assert_matches_oracle,
    cast_strided,
    dense_oracle,
    interpreter_only,
    main_process_only,
    mixing_matrix,
    rel_errors,
    run_in_interpreter,
    run_kernels,
    strided_inputs,
    tolerance,
)
from script_helpers import load_script

from mhla_gen import BlockLayout


@main_process_only
def test_kernels_in_interpreter():
    """All interpreter tests of this file in one child pytest with ``TRITON_INTERPRET=1`` (CPU tensors)."""
    run_in_interpreter(__file__)


@pytest.fixture(autouse=True)
def kernel_path(request):
    """The Triton backend's path every test here runs: ``"blocked"`` (the four-kernel path these tests were
    written for; the small shapes here would otherwise take the dense path, ``triton_dense.py``), or the
    test's indirect ``kernel_path`` parameter. Without Triton there is nothing to force."""
    path = getattr(request, "param", "blocked")
    try:
        from mhla_gen.ops.triton_dense import triton_path
    except ImportError:
        yield path
        return
    with triton_path(path):
        yield path


@pytest.fixture(scope="module")
def tm():
    """The Triton backend (``triton_backend``: the blocked kernels of ``triton_mhla`` unless a test forces the
    dense path), built for the interpreter in the child run, for the GPU otherwise."""
    pytest.importorskip("triton")
    return importlib.import_module("mhla_gen.ops.triton_backend")


# --------------------------------------------------------------------------------------------------
# interpreter: forward and all gradients vs the float64 oracle

# (grid, blocks, d, feature_map, normalize, tile config, (batch, heads)): uneven 2D / 3D, 1D, one block,
# one token per block, non-power-of-two head dims (72 -> tiles of 128, 24 -> 32), several d- and e-tiles,
# blocks split over programs
CASES = [
    ((7, 5), (3, 2), 24, "relu", True, dict(block_t=4, split=2), (2, 2)),
    ((3, 5, 6), (2, 2, 3), 16, "elu+1", False, dict(block_t=4, block_d=8, block_e=8), (1, 2)),
    ((3, 4, 5), (2, 1, 3), 16, "relu", True, dict(block_t=4, block_d=8, block_e=8, split=3), (1, 2)),
    ((13,), (5,), 72, "elu+1", True, dict(block_t=2), (2, 2)),
    ((4, 6), (1, 1), 8, "relu", False, dict(block_t=8, split=2), (2, 2)),  # one block, three tiles
    ((4, 3), (4, 3), 8, "elu+1", True, dict(block_t=4), (1, 2)),  # one token per block
    ((5, 7), (2, 3), 8, "relu+1e-6", True, dict(block_t=4), (1, 2)),
    ((5, 7), (2, 3), 8, "identity", False, dict(block_t=4), (1, 2)),
    ((9,), (4,), 32, "relu", False, {}, (2, 2)),  # default tiles
]
CASE_IDS = [
    f"{'x'.join(map(str, grid))}-{'x'.join(map(str, blocks))}-d{d}-{feature_map}-norm{int(normalize)}"
    for grid, blocks, d, feature_map, normalize, *_ in CASES
]
FP16_CASES = [2, 3, 5]  # and test_fp16_large_states_and_clipping (2D, relu, normaliser on and off)

def _check_case(tm, case, dtype, path):
    grid, blocks, d, feature_map, normalize, config, (b, h) = CASES[case]
    layout = BlockLayout(grid, blocks)
    q, k, v, g = strided_inputs(b, h, layout.num_tokens, d, dtype)
    mixing = mixing_matrix(layout)
    got, (state, *_) = run_kernels(tm, q, k, v, g, mixing, layout, feature_map, normalize, dtype,
                            tm.TileConfig(**config))
    assert (state.numel() == 0) == (path == "dense")  # the dense path saves no state
    assert [x.dtype for x in got] == [dtype] * 4 + [torch.float32]
    n = layout.num_tokens
    sums = n * n if path == "dense" else n  # the dense path's ∂W sums b·h·n² products dA[t, s]·P[t, s]
    assert_matches_oracle(got, tolerance(dtype, b, h, sums, d),
                           q, k, v, g, layout, mixing, feature_map, normalize)


@interpreter_only
@pytest.mark.parametrize("kernel_path", ["blocked", "dense"], indirect=True)
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_matches_oracle_fp32(tm, case, kernel_path):
    """Both paths of the Triton backend (the dense one takes tiles of 16 tokens: ``tl.dot``'s minimum)."""
    _check_case(tm, case, torch.float32, kernel_path)


@interpreter_only
@pytest.mark.parametrize("kernel_path", ["blocked", "dense"], indirect=True)
@pytest.mark.parametrize("case", FP16_CASES, ids=[CASE_IDS[i] for i in FP16_CASES])
def test_matches_oracle_fp16(tm, case, kernel_path):
    _check_case(tm, case, torch.float16, kernel_path)


@interpreter_only
def test_one_block_normalized(tm):
    """One block with the normaliser: out does not depend on W's scale, so dW = <dS~, S> + <dz~, z> cancels
    to ~0 (the relative error is meaningless there); the rest matches the oracle."""
    layout = BlockLayout((4, 6), (1, 1))
    q, k, v, g = strided_inputs(2, 2, layout.num_tokens, 8, torch.float32)
    mixing = mixing_matrix(layout)
    cfg = tm.TileConfig(block_t=8, split=2)
    got, _ = run_kernels(tm, q, k, v, g, mixing, layout, "relu", True, torch.float32, cfg)
    expected = dense_oracle(q, k, v, g, layout, mixing, "relu", True)
    errors = rel_errors(got[:4], expected[:4])
    assert max(errors.values()) <= tolerance(torch.float32, 2, 2, layout.num_tokens, 8), errors
    # the oracle's dW is 1.1e-6 (from eps), a difference of two sums of ~20: its fp32 error is bounded by
    # n·u times the sum of the absolute terms (n: the longest chain of additions), whatever the machine
    # (measured 1.5e-7 on one CPU, 3.0e-6 on an AMD EPYC)
    chain = layout.num_tokens + 8 + 8 + 2 * 2  # tokens, d, e, then batch x heads
    bound = chain * UNIT_ROUNDOFF[torch.float32] * _one_block_dw_terms(q, k, v, g, mixing.item())
    assert abs(got[4].item() - expected[4].item()) <= bound


def _one_block_dw_terms(q, k, v, g, w: float) -> float:
    """Σ|terms| of dW for one block with the normaliser (relu), in float64:
    dW = Σ_t [g_t·(φ(q_t)ᵀS) - (g_t·o_t)(φ(q_t)ᵀz)] / den_t, every sum (S = Σ φ(k) vᵀ, the dot products)
    taken over absolute values."""
    fq, fk = q.clamp_min(0), k.clamp_min(0)  # (B, H, N, d)
    s_abs = torch.einsum("bhnd,bhne->bhde", fk, v.abs())
    z = fk.sum(2)  # (B, H, d)
    qz = torch.einsum("bhnd,bhd->bhn", fq, z)
    den = w * qz + EPS
    out = w * torch.einsum("bhnd,bhde->bhne", fq, torch.einsum("bhnd,bhne->bhde", fk, v)) / den[..., None]
    first = torch.einsum("bhne,bhne->bhn", g.abs(), torch.einsum("bhnd,bhde->bhne", fq, s_abs))
    second = torch.einsum("bhne,bhne->bhn", g.abs(), out.abs()) * qz
    return ((first + second) / den).sum().item()


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("normalize", [True, False])
def test_forward_states_and_layouts(tm, normalize, dtype):
    """The saved states are the UNMIXED S and z (the backward mixes them again) in the state dtype (fp32
    for fp32 and fp16 inputs; bf16 ones: ``test_saved_state_dtypes``), den = φ(q)·z̃ + eps against float64
    sums over the layout's blocks; out on heads-interleaved memory; shapes, dtypes and strides as
    ``forward_outputs_like`` promises (what a fake implementation returns)."""
    layout = BlockLayout((5, 7), (2, 3))
    b, h, n, d, m = 2, 2, layout.num_tokens, 8, layout.num_blocks
    q, k, v, _ = strided_inputs(b, h, n, d, dtype)
    mixing = mixing_matrix(layout)
    got = tm.forward(*(cast_strided(x, dtype) for x in (q, k, v)), layout.grid, layout.blocks,
                     mixing.float(), "elu+1", normalize, EPS, config=tm.TileConfig(block_t=4))
    for x, y in zip(got, tm.forward_outputs_like(q.to(dtype), v.to(dtype), layout.blocks, normalize)):
        assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
    out, state, norm, den = got  # the op's contract (mhla.Saved): state = S, norm = z
    assert out.transpose(1, 2).is_contiguous()  # (B, N, H, e) memory
    assert state.dtype == torch.float32 and state.permute(2, 0, 1, 3, 4).is_contiguous()  # (M, B, H, d, e)

    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    onehot = torch.nn.functional.one_hot(layout.block_index, m).double()  # (N, M)
    s = torch.einsum("nm,bhnd,bhne->bhmde", onehot, fk, v)  # S_j
    tol = tolerance(dtype, b, h, n, d)  # fp16: its φ(k) dot operands
    torch.testing.assert_close(state.double(), s, rtol=tol, atol=tol * s.abs().max().item())
    if normalize:
        z = torch.einsum("nm,bhnd->bhmd", onehot, fk)
        torch.testing.assert_close(norm.double(), z, rtol=tolerance(torch.float32, b, h, n, d), atol=0)
        z_mix = torch.einsum("ij,bhjd->bhid", mixing, z)
        expected_den = torch.einsum("bhnd,bhnd->bhn", fq, z_mix[:, :, layout.block_index]) + EPS
        torch.testing.assert_close(den.double(), expected_den, rtol=tol, atol=0)
    else:
        assert norm.numel() == den.numel() == 0


@interpreter_only
@pytest.mark.parametrize("normalize", [True, False])
def test_gradient_subsets(tm, normalize):
    """Every single input, two of them, and none: the same values as with all four (and None elsewhere);
    shapes, dtypes and strides as ``backward_outputs_like`` promises."""
    layout = BlockLayout((5, 7), (2, 3))
    q, k, v, g = strided_inputs(1, 2, layout.num_tokens, 8, torch.float32)
    mixing = mixing_matrix(layout)
    q, k, v, g = (cast_strided(x, torch.float32) for x in (q, k, v, g))
    args = (q, k, v, layout.grid, layout.blocks, mixing.float(), "relu", normalize, EPS)
    cfg = tm.TileConfig(block_t=8)
    out, *saved = tm.forward(*args, config=cfg)
    backward = lambda needs: tm.backward(g, *args, out.new_empty(0), *saved, needs, config=cfg)  # noqa: E731
    full = backward(NEEDS_ALL)
    singles = [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)]
    for needs in [*singles, (1, 0, 0, 1), (0, 1, 1, 0), (0, 0, 0, 0)]:
        like = tm.backward_outputs_like(q, k, v, mixing.float(), needs)
        for need, a, b, fake in zip(needs, backward(needs), full, like):
            assert (a is None and fake is None) if not need else torch.equal(a, b), needs
            if need:  # what a fake implementation returns
                assert (a.shape, a.stride(), a.dtype) == (fake.shape, fake.stride(), fake.dtype)


@interpreter_only
def test_fp16_large_states_and_clipping(tm):
    """fp16 with states beyond fp16's range (|S~|, |dS| ~ 1.3e5): the power-of-two scaled dot operands keep
    the normalised output and all gradients accurate (forward: large v; backward: large G); without the
    normaliser the output saturates at ±65504 (clipped, not inf)."""
    layout = BlockLayout((8, 8), (2, 1))  # 32 tokens per block
    q, k, v, g = strided_inputs(1, 2, layout.num_tokens, 16, torch.float16)
    mixing, cfg = mixing_matrix(layout), tm.TileConfig(block_t=8)
    half = lambda x: x.half().double()  # noqa: E731
    # a per-channel sign shared by all tokens, so that sums over a block's tokens grow linearly
    common = torch.randn(16, generator=torch.Generator().manual_seed(5), dtype=torch.float64).sign()

    big_v = half((v + common) * 4000)  # |v| < 2e4, |S|, |S~| ~ 1e5
    got, (state, _, _) = run_kernels(tm, q, k, big_v, g, mixing, layout, "relu", True, torch.float16, cfg)
    assert state.abs().max() > 1e5  # the saved unmixed S (fp32 for fp16 inputs); S~ is larger still
    # G·o comes from the fp32 state product φ(q)·(S~ G), not from the fp16-rounded output: the usual fp16
    # bound holds (measured 1.1e-3 in dq against 2.0e-3; 1.7e-3 when G·o read the fp16 output)
    fp16_tol = tolerance(torch.float16, 1, 2, layout.num_tokens, 16)
    assert_all_close(got, dense_oracle(q, k, big_v, g, layout, mixing, "relu", True), fp16_tol)

    out, *_ = tm.forward(*(cast_strided(x, torch.float16) for x in (q, k, big_v)), layout.grid, layout.blocks,
                         mixing.float(), "relu", False, EPS, config=cfg)
    expected = dense_oracle(q, k, big_v, g, layout, mixing, "relu", False)[0]
    big = expected.abs() > 65504
    assert big.any() and (~big).any() and torch.isfinite(out).all()
    assert torch.equal(out[big].double(), expected[big].sign() * 65504)
    torch.testing.assert_close(out[~big].double(), expected[~big], rtol=fp16_tol, atol=0.0)

    # backward: dS = W^T Σ φ(q) Gᵀ ~ 1.3e5 for a large G; small k, v keep dk, dv and the output in range
    small_k, small_v, big_g = half(k * 1e-3), half(v * 1e-3), half((g + common) * 4000)
    got, _ = run_kernels(tm, q, small_k, small_v, big_g, mixing, layout, "relu", False, torch.float16, cfg)
    assert_all_close(got, dense_oracle(q, small_k, small_v, big_g, layout, mixing, "relu", False), fp16_tol)


@interpreter_only
@pytest.mark.parametrize("negative", ["q", "k"])
def test_zero_features(tm, negative):
    """ReLU features all zero (every q, or every k, negative): output 0 and den = eps exactly, and all
    gradients 0 (no NaN from 0 / eps or from the 1e6-sized dS~ = φ(q)ᵀG / eps when k is negative)."""
    layout = BlockLayout((4, 5), (2, 2))
    q, k, v, g = strided_inputs(1, 2, layout.num_tokens, 8, torch.float32)
    q, k = (-x.abs() if name == negative else x for name, x in (("q", q), ("k", k)))
    got, (_, _, den) = run_kernels(tm, q, k, v, g, mixing_matrix(layout), layout, "relu", True, torch.float32)
    assert (den == EPS).all()
    assert all((x == 0).all() for x in got)
    assert all((x == 0).all() for x in dense_oracle(q, k, v, g, layout, mixing_matrix(layout), "relu", True))


def test_rejects_bad_inputs(tm):
    """Shape, dtype and layout mistakes raise ValueError before any launch (no GPU needed)."""
    layout = BlockLayout((4, 5), (2, 2))
    q = torch.zeros(1, 2, 20, 8)
    w = torch.ones(4, 4)
    args = ("relu", True, EPS)
    bad = {
        "value dim": (q, q, torch.zeros(1, 2, 20, 4), layout.grid, layout.blocks, w, *args),
        "dtype": (q, q, q.double(), layout.grid, layout.blocks, w, *args),
        "tokens": (q, q, q, (4, 6), layout.blocks, w, *args),
        "mixing": (q, q, q, layout.grid, layout.blocks, torch.ones(3, 3), *args),
        "blocks": (q, q, q, layout.grid, (5, 1), w, *args),
        "feature map": (q, q, q, layout.grid, layout.blocks, w, "softmax", True, EPS),
    }
    for what, call_args in bad.items():
        with pytest.raises(ValueError):
            tm.forward(*call_args)
        assert what


# --------------------------------------------------------------------------------------------------
# interpreter: the mixing kernels against the plain GEMMs, launches per call, what the op keeps


def _gemm_bound(w, x, length: int):
    """Elementwise bound on an fp32 sum of ``length`` products, |Σ - fl(Σ)| <= γ_n Σ|w||x| (+1 u for the
    stored result), for ``w @ x``."""
    return (length + 1) * UNIT_ROUNDOFF[torch.float32] * (w.abs() @ x.abs())


# (M, state shape after the block axis, normaliser shape or None, mix_block_c): M = 70 is two row tiles
# of 64 and three dot steps of 32; no column tile divides the column counts
MIX_CASES = [(70, (2, 3, 40), (2, 3, 5), None), (5, (1, 2, 8, 8), None, 32), (16, (2, 7), (2, 3), 64)]


@interpreter_only
@pytest.mark.parametrize("m, shape, zshape, block_c", MIX_CASES)
def test_mixing_kernel_matches_mix_blocks(m, shape, zshape, block_c):
    """S~ = W S and z~ = W z in one launch (``triton_mixing.mix``) against ``checks.mix_blocks`` in
    float64, with W and with the strided Wᵀ of the backward, within the fp32 GEMM bound elementwise."""
    from mhla_gen.ops import triton_mixing
    from mhla_gen.ops.checks import mix_blocks

    gen = torch.Generator().manual_seed(3)
    w = 0.1 + torch.rand(m, m, generator=gen)
    x = torch.randn(m, *shape, generator=gen)
    xz = None if zshape is None else torch.randn(m, *zshape, generator=gen)
    for weights in (w, w.T):
        y, yz = triton_mixing.mix(weights, x, xz, torch.float32, "ieee", triton_mixing.mix_tiles(m, block_c))
        assert y.shape == x.shape and y.dtype == torch.float32 and y.is_contiguous()
        for got, src in ((y, x), (yz, xz)):
            if src is None:
                assert got is None
                continue
            expected = mix_blocks(weights.double(), src.double())
            bound = _gemm_bound(weights.double(), src.double().view(m, -1), m).view_as(src)
            assert ((got.double() - expected).abs() <= bound).all(), (got.double() - expected).abs().max()


@interpreter_only
def test_mixing_kernel_tiles_and_wide_offsets(monkeypatch):
    """Other mixing tiles (``triton_mixing.MixTiles``: row tiles of 16 over M = 70, dot steps of 16,
    columns of 32, 2 warps, 2 stages) stay within the fp32 GEMM bound of float64; int64 offsets (``_wide``,
    taken where M·C passes int32) give the int32 offsets' bits."""
    from mhla_gen.ops import triton_mixing
    from mhla_gen.ops.checks import mix_blocks

    m, gen = 70, torch.Generator().manual_seed(4)
    w = 0.1 + torch.rand(m, m, generator=gen)
    x, xz = torch.randn(m, 2, 40, generator=gen), torch.randn(m, 6, generator=gen)
    other = triton_mixing.MixTiles(block_m=16, block_k=16, block_c=32, num_warps=2, num_stages=2)
    for got, src in zip(triton_mixing.mix(w, x, xz, torch.float32, "ieee", other), (x, xz)):
        bound = _gemm_bound(w.double(), src.double().view(m, -1), m).view_as(src)
        assert ((got.double() - mix_blocks(w.double(), src.double())).abs() <= bound).all()
    narrow = triton_mixing.mix(w, x, xz, torch.float32, "ieee")
    monkeypatch.setattr(triton_mixing, "_wide", lambda m, c: True)
    wide = triton_mixing.mix(w, x, xz, torch.float32, "ieee")
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])


@interpreter_only
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("split", [1, 3])
def test_gram_kernel_matches_gemm(split, with_z):
    """dW = dS~ Sᵀ + dz~ zᵀ (``triton_mixing.gram``: split reductions, their sum in a second launch)
    against the float64 GEMMs, within the fp32 bound elementwise; M = 70 spans two row tiles."""
    from mhla_gen.ops import triton_mixing

    m, gen = 70, torch.Generator().manual_seed(4)
    a, b = (torch.randn(m, 2, 3, 20, generator=gen) for _ in range(2))
    az, bz = (torch.randn(m, 2, 7, generator=gen) if with_z else None for _ in range(2))
    got = triton_mixing.gram(a, b, az, bz, "ieee", torch.float32, split)
    pairs = [(a.double().view(m, -1), b.double().view(m, -1))]
    if with_z:
        pairs.append((az.double().view(m, -1), bz.double().view(m, -1)))
    expected = sum(x @ y.T for x, y in pairs)
    length = sum(x.shape[1] for x, _ in pairs)
    bound = sum(_gemm_bound(x, y.T, length) for x, y in pairs)
    assert got.shape == (m, m) and got.dtype == torch.float32
    assert ((got.double() - expected).abs() <= bound).all(), (got.double() - expected).abs().max()


@pytest.fixture
def launches(monkeypatch):
    """The names of the kernels the Triton backend launches from now on, in order (a spy on
    ``triton_mixing.launch``, the one launch entry)."""
    from mhla_gen.ops import triton_mixing

    names, original = [], triton_mixing.launch

    def spy(kernel, grid, *args, **kwargs):
        names.append(getattr(kernel, "fn", kernel).__name__)
        return original(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(triton_mixing, "launch", spy)
    return names


FORWARD_LAUNCHES = ["_summary_kernel", "_mix_kernel", "_output_kernel"]
ALL_GRADIENTS = [
    "_mix_kernel", "_dq_dstate_kernel", "_gram_kernel", "_sum_kernel", "_mix_kernel", "_dkv_kernel"
]
# (normalize, needs) -> the backward's launches: S~ is mixed again only for dq or for G·o (normaliser)
BACKWARD_LAUNCHES = {
    (True, (1, 1, 1, 1)): ALL_GRADIENTS,
    (False, (1, 1, 1, 1)): ALL_GRADIENTS,
    (True, (0, 1, 1, 0)): ["_mix_kernel", "_dq_dstate_kernel", "_mix_kernel", "_dkv_kernel"],
    (False, (0, 1, 1, 0)): ["_dq_dstate_kernel", "_mix_kernel", "_dkv_kernel"],
    (False, (1, 0, 0, 0)): ["_mix_kernel", "_dq_dstate_kernel"],
    (True, (0, 0, 0, 1)): ["_mix_kernel", "_dq_dstate_kernel", "_gram_kernel", "_sum_kernel"],
    (True, (0, 0, 0, 0)): [],
}


@interpreter_only
@pytest.mark.parametrize("normalize, needs", list(BACKWARD_LAUNCHES), ids=str)
def test_launches_per_call(tm, launches, normalize, needs):
    """Forward: 3 launches; backward: 6 with every gradient, fewer for subsets (a count that grows fails
    here). Every launch goes through ``triton_mixing.launch``."""
    layout = BlockLayout((5, 7), (2, 3))
    inputs = strided_inputs(1, 2, layout.num_tokens, 8, torch.float32)
    q, k, v, g = (cast_strided(x, torch.float32) for x in inputs)
    args = (q, k, v, layout.grid, layout.blocks, mixing_matrix(layout).float(), "relu", normalize, EPS)
    out, *saved = tm.forward(*args, config=tm.TileConfig(block_t=8))
    assert launches == FORWARD_LAUNCHES
    launches.clear()
    tm.backward(g, *args, out.new_empty(0), *saved, needs, config=tm.TileConfig(block_t=8))
    assert launches == BACKWARD_LAUNCHES[normalize, needs]


@interpreter_only
@pytest.mark.parametrize("backend", ["triton", "pytorch"])
def test_op_saves_out_only_where_backward_reads_it(backend):
    """The op keeps ``out`` for the PyTorch backend's backward (G·o) and an empty tensor in its place for
    the Triton backend's, whose dq kernel gets G·o from the states."""
    from mhla_gen.ops import mhla_attention

    layout = BlockLayout((4, 6), (2, 2))
    inputs = strided_inputs(1, 2, layout.num_tokens, 8, torch.float32)[:3]
    q, k, v = (x.float().requires_grad_() for x in inputs)
    mixing = mixing_matrix(layout).float().requires_grad_()
    out = mhla_attention(q, k, v, layout, mixing, backend=backend)
    saved_out = out.grad_fn.saved_tensors[4]  # (q, k, v, mixing, out, *Saved)
    assert saved_out.shape == ((0,) if backend == "triton" else out.shape)


def test_saved_state_dtypes(tm):
    """What the forward keeps (the fake outputs the op allocates under compile): the unmixed S in the state
    dtype, bf16 for bf16 inputs and fp32 for fp16 and fp32 (fp16 cannot hold summaries over thousands of
    tokens); z and den fp32; S a permuted view of (M, B, H, d, e) memory (no GPU needed: the real forward's
    dtypes and strides are compared with these in ``test_forward_states_and_layouts`` and on CUDA)."""
    for dtype, state in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                         (torch.float32, torch.float32)):
        q = torch.empty(2, 3, 35, 8, dtype=dtype)
        out, s, z, den = tm.forward_outputs_like(q, q, (2, 3), True)
        assert tm.triton_mhla.state_dtype(dtype) == s.dtype == state
        assert (s.shape, s.permute(2, 0, 1, 3, 4).is_contiguous()) == ((2, 3, 6, 8, 8), True)
        assert z.dtype == den.dtype == torch.float32 and z.shape == (2, 3, 6, 8) and den.shape == (2, 3, 35)
        assert out.dtype == dtype
    assert tm.triton_mhla.state_dtype(torch.bfloat16, fp32_state_dots=True) == torch.float32


@interpreter_only
def test_tuner_writes_a_table_tile_config_reads(monkeypatch, tmp_path, capsys):
    """``benchmarks/tune_mhla_tiles.py`` in the interpreter (a tiny shape, two candidates): each checked
    against the PyTorch backend and timed, the fastest written under the device's name and the shape's
    class, other entries kept; ``tile_config`` then returns it for that class."""
    from mhla_gen.ops import tile_table, triton_mhla

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    from test_tune_mhla_tiles import load_tuner, table_with

    out = tmp_path / "tiles.json"
    other = table_with({"block_t": 32}, device="NVIDIA H200", key="d128-e128-bf16-L256")
    out.write_text(tile_table.dumps(other))
    load_tuner().main(["--device", "cpu", "--shapes", "tiny", "--dtype", "fp32", "--max-candidates", "2",
                       "--repeats", "1", "--out", str(out)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 and all(row.endswith(" ms |") for row in rows)
    table = tile_table.read_table(out)
    assert table["devices"]["NVIDIA H200"]["d128-e128-bf16-L256"]["config"] == {"block_t": 32}
    entry = table["devices"]["cpu"]["d16-e16-fp32-L16"]
    assert entry["config"]["block_t"] in (64, 128) and entry["ms"] <= entry["default_ms"]
    monkeypatch.setattr(tile_table, "TABLE_PATH", out)
    cfg = triton_mhla.tile_config(16, 16, 4, 1, 6, torch.device("cpu"), dtype=torch.float32)
    assert cfg.block_t == entry["config"]["block_t"]


# --------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): compiled kernels, bf16 included, default and tiled launch configs

GPU_CASES = [
    ((7, 5), (3, 2), 64, "relu", True, {}),
    ((3, 5, 6), (2, 2, 3), 72, "elu+1", False, {}),
    ((13,), (5,), 32, "relu", True, dict(split=2)),
    ((4, 6), (1, 1), 128, "relu", False, dict(block_d=32, block_e=64)),
    ((4, 3), (4, 3), 64, "elu+1", True, {}),
    ((9, 11), (4, 4), 128, "relu+1e-6", True, dict(block_t=16, block_d=64, split=3)),
]
# Measured on one H200 (2026-11-27, torch 2.11, triton 3.6; errors as rel_errors): fp32 at most 8.2e-7,
# fp16 6.4e-4, bf16 4.7e-3 (7x fp16; unit roundoff 2^-8 vs 2^-11), each 3x or more under `tolerance`.
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_path", ["blocked", "dense"], indirect=True)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("grid, blocks, d, feature_map, normalize, config", GPU_CASES)
def test_cuda_matches_oracle(tm, dtype, grid, blocks, d, feature_map, normalize, config, kernel_path):
    layout = BlockLayout(grid, blocks)
    q, k, v, g = strided_inputs(2, 3, layout.num_tokens, d, dtype, "cuda")
    tol = tolerance(dtype, 2, 3, layout.num_tokens, d)
    mixing = mixing_matrix(layout).cuda()
    config = tm.TileConfig(**config)
    got, _ = run_kernels(tm, q, k, v, g, mixing, layout, feature_map, normalize, dtype, config)
    assert got[0].is_cuda and [x.dtype for x in got] == [dtype] * 4 + [torch.float32]
    assert_matches_oracle(got, tol, q, k, v, g, layout, mixing, feature_map, normalize)


# eval/scale_study.py's attention (4 heads of 64, bf16 autocast): MHLA's 4x4 blocks at 1024 tokens (64 tokens
# a block, several token tiles each) and linear attention's one block of 4096 tokens (split over programs)
SCALE_STUDY_CASES = [((32, 32), (4, 4)), ((64, 64), (1, 1))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("grid, blocks", SCALE_STUDY_CASES)
def test_cuda_matches_oracle_at_the_scale_study_shapes(tm, dtype, grid, blocks):
    """The blocked kernels (these token counts are past the dense path's) at the shapes the scale study
    trains with, against the float64 oracle; its kernel check (scripts/gpu_check.py) runs these too."""
    layout = BlockLayout(grid, blocks)
    q, k, v, g = strided_inputs(2, 4, layout.num_tokens, 64, dtype, "cuda")
    mixing = mixing_matrix(layout).cuda()
    got, _ = run_kernels(tm, q, k, v, g, mixing, layout, "relu", True, dtype)
    tol = tolerance(dtype, 2, 4, layout.num_tokens, 64)
    assert_matches_oracle(got, tol, q, k, v, g, layout, mixing, "relu", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_cuda_wan_like_shape(tm, dtype):
    """Wan2.1-1.3B's attention shape at a small grid: batch 2 (CFG), 12 heads x 128, 3D blocks (3, 5, 10)
    on an uneven (5, 6, 13) grid; default launch configuration."""
    layout = BlockLayout((5, 6, 13), (3, 5, 10))
    q, k, v, g = strided_inputs(2, 12, layout.num_tokens, 128, dtype, "cuda")
    tol = tolerance(dtype, 2, 12, layout.num_tokens, 128)
    mixing = mixing_matrix(layout).cuda()
    got, _ = run_kernels(tm, q, k, v, g, mixing, layout, "relu", True, dtype)
    assert_all_close(got, dense_oracle(q, k, v, g, layout, mixing, "relu", True), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_cuda_sana_like_shape(tm, dtype):
    """SANA-1.6B's attention shape at 1024 tokens: head dim 32, (32, 32) grid in (4, 4) blocks of 64
    tokens, batch 2 and 6 of its 70 heads; default launch configuration (tile table or heuristic)."""
    layout = BlockLayout((32, 32), (4, 4))
    q, k, v, g = strided_inputs(2, 6, layout.num_tokens, 32, dtype, "cuda")
    tol = tolerance(dtype, 2, 6, layout.num_tokens, 32)
    mixing = mixing_matrix(layout).cuda()
    got, saved = run_kernels(tm, q, k, v, g, mixing, layout, "relu", True, dtype)
    assert_all_close(got, dense_oracle(q, k, v, g, layout, mixing, "relu", True), tol)
    fake = tm.forward_outputs_like(cast_strided(q, dtype), cast_strided(v, dtype), layout.blocks, True)[1:]
    for x, y in zip(saved, fake):  # bf16 states for bf16 inputs, as the fake says
        assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_mixing_kernel(dtype):
    """The mixing kernel on tensor cores (tf32 dots; bf16 states in and out) against ``mix_blocks`` in
    float64: within tf32's rounding of W and the states (2^-11 each) plus the stored result's rounding,
    relative to the terms' magnitudes; M = 150 as at Wan."""
    from mhla_gen.ops import triton_mixing
    from mhla_gen.ops.checks import mix_blocks

    m, gen = 150, torch.Generator().manual_seed(3)
    w = (0.1 + torch.rand(m, m, generator=gen)).cuda()
    x = torch.randn(m, 4, 64, 64, generator=gen).to("cuda", dtype)
    xz = torch.randn(m, 4, 64, generator=gen).cuda()
    y, yz = triton_mixing.mix(w, x, xz, dtype, "tf32")
    for got, src in ((y, x), (yz, xz)):
        expected = mix_blocks(w.double(), src.double())
        scale = mix_blocks(w.double(), src.double().abs())
        rounding = 2 * 2.0**-11 + UNIT_ROUNDOFF[got.dtype] + m * UNIT_ROUNDOFF[torch.float32]
        assert ((got.double() - expected).abs() <= rounding * scale).all()


@pytest.mark.gpu
def test_cuda_real_wan_grid(tm):
    """The real Wan 480p latent grid (21, 30, 52) = 32,760 tokens in (3, 5, 10) blocks (uneven on two axes,
    ~218 tokens per block), bf16, against the float64 block-major PyTorch path (the dense oracle's N x N
    matrix would not fit)."""
    from mhla_gen.ops.mhla import mhla_attention_autograd

    layout = BlockLayout((21, 30, 52), (3, 5, 10))
    q, k, v, g = strided_inputs(1, 2, layout.num_tokens, 64, torch.bfloat16, "cuda")
    tol = tolerance(torch.bfloat16, 1, 2, layout.num_tokens, 64)
    mixing = mixing_matrix(layout).cuda()
    got, _ = run_kernels(tm, q, k, v, g, mixing, layout, "relu", True, torch.bfloat16)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, mixing)]
    out = mhla_attention_autograd(*leaves[:3], layout, leaves[3], "relu", True, eps=EPS)
    expected = (out.detach(), *torch.autograd.grad(out, leaves, g))
    assert_all_close(got, expected, tol)


# --------------------------------------------------------------------------------------------------
# the registered op dispatches to the kernels (CUDA; here: the interpreter, backend "triton" on CPU)


@pytest.fixture
def implementation_calls(monkeypatch):
    """Names of the implementation entry points the op calls, in order (``blocked.forward``,
    ``triton.backward``, ...)."""
    from mhla_gen.ops import blocked, triton_mhla

    calls = []
    for name, module in (("blocked", blocked), ("triton", triton_mhla)):
        for function in ("forward", "backward"):
            original = getattr(module, function)

            def spy(*args, _original=original, _name=f"{name}.{function}", **kwargs):
                calls.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, function, spy)
    return calls


@interpreter_only
@pytest.mark.parametrize("normalize", [True, False])
def test_op_runs_the_kernels(implementation_calls, normalize):
    """Through ``mhla_attention`` (the custom op and its autograd formula): the kernels run, forward and
    all gradients match the oracle, the backward runs what the forward ran even if the backend is
    switched to ``"pytorch"`` in between, ``opcheck`` confirms the op's fake outputs (what compiled graphs
    allocate) match the kernels' shapes, dtypes and strides, and ``mhla_backend("pytorch")`` sends later
    calls to PyTorch."""
    from mhla_gen.ops import mhla_attention, mhla_backend

    layout = BlockLayout((3, 5, 6), (2, 2, 3))
    q, k, v, g = strided_inputs(1, 2, layout.num_tokens, 16, torch.float32)
    mixing = mixing_matrix(layout)
    leaves = [x.float().requires_grad_() for x in (q, k, v)] + [mixing.float().requires_grad_()]
    with mhla_backend("triton"):
        out = mhla_attention(*leaves[:3], layout, leaves[3], "relu", normalize, eps=EPS)
    assert out.transpose(1, 2).is_contiguous()  # (B, N, H, e) memory
    with mhla_backend("pytorch"):
        got = (out.detach(), *torch.autograd.grad(out, leaves, g.float()))
        assert implementation_calls == ["triton.forward", "triton.backward"]
        assert_all_close(got, dense_oracle(q, k, v, g, layout, mixing, "relu", normalize),
                      tolerance(torch.float32, 1, 2, layout.num_tokens, 16))
        mhla_attention(*leaves[:3], layout, leaves[3], "relu", normalize, eps=EPS)
        assert implementation_calls[-1] == "blocked.forward"
    args = (*leaves[:3], list(layout.grid), list(layout.blocks), leaves[3], "relu", normalize, EPS, "triton")
    torch.library.opcheck(
        torch.ops.mhla_gen.mhla.default, args, test_utils=("test_schema", "test_faketensor")
    )


@interpreter_only
@pytest.mark.parametrize("grid, blocks, normalize, trainable", [
    ((3, 5, 6), (2, 2, 3), True, (0, 1, 2, 3)),
    ((7, 9), (3, 2), False, (1, 2)),
    ((13,), (5,), True, (0, 3)),
])
def test_eager_path_equals_the_op_on_the_kernels(grid, blocks, normalize, trainable):
    """``mhla_attention`` in eager mode (the kernels without the op's dispatcher, ``mhla.py``) against the
    registered op on the same kernels: output and gradients bit for bit (fp32, strided inputs)."""
    from mhla_gen.ops import mhla_attention

    layout = BlockLayout(grid, blocks)
    q, k, v, g = strided_inputs(1, 2, layout.num_tokens, 16, torch.float32)
    inputs = [cast_strided(x, torch.float32) for x in (q, k, v)] + [mixing_matrix(layout).float()]
    wanted = [inputs[i].requires_grad_() for i in trainable]
    g = cast_strided(g, torch.float32)
    eager = mhla_attention(*inputs[:3], layout, inputs[3], "relu", normalize, eps=EPS, backend="triton")
    assert type(eager.grad_fn).__name__ == "_EagerMHLABackward"
    op, *_ = torch.ops.mhla_gen.mhla(*inputs[:3], list(grid), list(blocks), inputs[3], "relu", normalize, EPS,
                                      "triton")
    got = (eager, *torch.autograd.grad(eager, wanted, g))
    for a, b in zip(got, (op, *torch.autograd.grad(op, wanted, g))):
        assert a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_cuda_op_dispatch_and_compile(dtype):
    """On CUDA the op runs the kernels; opcheck (fake strides, autograd, AOT dispatch) passes; the
    compiled (inductor) call matches eager; the PyTorch implementation agrees within the dtype's tolerance."""
    from mhla_gen.ops import mhla_attention, mhla_backend

    layout = BlockLayout((5, 6, 13), (3, 5, 10))
    q, k, v, _ = strided_inputs(2, 4, layout.num_tokens, 64, dtype, "cuda")
    tol = tolerance(dtype, 2, 4, layout.num_tokens, 64)
    leaves = [cast_strided(x, dtype).requires_grad_() for x in (q, k, v)]
    mixing = mixing_matrix(layout).float().cuda().requires_grad_()
    out = mhla_attention(*leaves, layout, mixing)
    assert out.transpose(1, 2).is_contiguous()
    args = (*leaves, list(layout.grid), list(layout.blocks), mixing, "relu", True, EPS, "triton")
    torch.library.opcheck(torch.ops.mhla_gen.mhla.default, args)
    compiled = torch.compile(lambda *xs: mhla_attention(*xs, layout, mixing), fullgraph=True)
    torch.testing.assert_close(compiled(*leaves), out, rtol=tol, atol=tol)
    with mhla_backend("pytorch"):
        reference = mhla_attention(*leaves, layout, mixing)  # the PyTorch implementation
    error = (out.double() - reference.double()).abs().max() / reference.double().abs().max()
    assert error <= tol


# --------------------------------------------------------------------------------------------------
# the benchmark's model-shape mode (its CUDA run is the measurement; here: it runs and prints on CPU)


@pytest.mark.skipif(INTERPRETED, reason="not a kernel test")
def test_bench_model_shapes_on_cpu(capsys, tmp_path):
    import json

    path = ROOT / "benchmarks" / "bench_attention.py"
    bench = load_script(path, "bench_attention_for_triton")
    bench.MODEL_SHAPES["tiny"] = bench.ModelShape(1, 2, 8, (3, 5, 4), (2, 2, 3))
    bench.main(["--device", "cpu", "--sizes", "--shapes", "tiny", "--repeats", "1", "--warmup", "0",
                "--out", str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2  # forward, forward + backward
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[4:8])  # SDPA, LA, MHLA torch, MHLA op (no Triton on CPU)
        assert cells[8] == "–"
    (row,) = json.loads((tmp_path / "b.json").read_text())["model_rows"]
    assert row["N"] == 60 and row["M"] == 12 and row["mhla_torch_fwd_bwd_ms"] > 0
