"""The fast path against the references (flash-linear-attention style): forward, gradients, dtypes."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mhla_gen import BlockLayout, locality_init
from mhla_gen.ops import (
    Saved,
    get_mhla_backend,
    linear_attention,
    mhla_attention,
    mhla_attention_autograd,
    mhla_backend,
    mhla_block_loop,
    mhla_dense,
)

ROOT = Path(__file__).resolve().parents[1]
FAST_PATHS = {"fused": mhla_attention, "autograd": mhla_attention_autograd}

LAYOUTS = [
    ((16,), (4,)),
    ((13,), (5,)),
    ((6, 8), (2, 4)),
    ((7, 5), (3, 2)),
    ((3, 5, 6), (2, 2, 3)),
    ((4, 6), (1, 1)),  # one block
    ((4, 3), (4, 3)),  # one token per block
    # uneven with M² <= N: the op saves the summaries (above, only (16,) / (4,) and the one-block layout
    # do; the rest save them mixed)
    ((9, 10), (2, 3)),
    ((5, 6, 7), (2, 2, 2)),
]
CAUSAL_LAYOUTS = [((16,), (4,)), ((13,), (5,)), ((23,), (9,)), ((6,), (6,)), ((7,), (1,))]


def _outputs_and_grads(fn, q, k, v, mixing, **kwargs):
    out = fn(q, k, v, mixing=mixing, **kwargs)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * probe).sum(), (q, k, v, mixing))
    return (out, *grads)


def _assert_all_close(got, expected, atol, rtol=0.0):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmixing"), got, expected):
        msg = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=msg)


@pytest.mark.parametrize("path", sorted(FAST_PATHS))
@pytest.mark.parametrize("grid, blocks", LAYOUTS)
@pytest.mark.parametrize("feature_map", ["relu", "elu+1"])
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_references(path, grid, blocks, feature_map, normalize, make_qkv, random_mixing):
    layout = BlockLayout(grid, blocks)
    q, k, v = make_qkv(layout.num_tokens, value_dim=5, grad=True)  # value dim != key dim
    mixing = random_mixing(layout)
    kwargs = dict(layout=layout, feature_map=feature_map, normalize=normalize)
    got = _outputs_and_grads(FAST_PATHS[path], q, k, v, mixing, **kwargs)
    assert got[0].shape == v.shape
    _assert_all_close(got, _outputs_and_grads(mhla_dense, q, k, v, mixing, **kwargs), atol=1e-10)
    _assert_all_close(got, _outputs_and_grads(mhla_block_loop, q, k, v, mixing, **kwargs), atol=1e-10)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode", "inputs_without_grad"])
@pytest.mark.parametrize("grid, blocks", LAYOUTS)
@pytest.mark.parametrize("feature_map", ["relu", "elu+1"])
@pytest.mark.parametrize("normalize", [True, False])
def test_inference_path_matches_references(
    grad_mode, grid, blocks, feature_map, normalize, make_qkv, random_mixing
):
    """Without autograd (no_grad, inference_mode, or inputs that need no gradient): same forward."""
    layout = BlockLayout(grid, blocks)
    q, k, v = make_qkv(layout.num_tokens, value_dim=5, grad=grad_mode != "inputs_without_grad")
    mixing = random_mixing(layout, grad=False)
    kwargs = dict(layout=layout, mixing=mixing, feature_map=feature_map, normalize=normalize)
    expected = mhla_dense(q, k, v, **kwargs)
    contexts = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    context = contexts.get(grad_mode, torch.enable_grad)
    with context():
        got = mhla_attention(q, k, v, **kwargs)
    assert got.grad_fn is None
    torch.testing.assert_close(got, expected.detach(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("grid, blocks", [((6, 8), (2, 4)), ((7, 5), (3, 2))])
def test_callable_feature_map(grid, blocks, make_qkv, random_mixing):
    """Any callable φ works; the fused backward differentiates it with autograd."""
    layout = BlockLayout(grid, blocks)
    q, k, v = make_qkv(layout.num_tokens, grad=True)
    mixing = random_mixing(layout)
    kwargs = dict(layout=layout, feature_map=F.softplus)
    got = _outputs_and_grads(mhla_attention, q, k, v, mixing, **kwargs)
    _assert_all_close(got, _outputs_and_grads(mhla_dense, q, k, v, mixing, **kwargs), atol=1e-10)


@pytest.mark.parametrize("dim", [4, 16])
@pytest.mark.parametrize("trainable", ["q k v", "k v mixing", "v", "mixing", "q mixing"])
def test_gradients_of_any_input_subset_twice(dim, trainable, make_qkv, random_mixing):
    """Backward when only some inputs need a gradient (frozen mixing, frozen projections), run twice on
    one graph: the second pass must see the saved tensors untouched (backward reuses its own buffers)."""
    layout = BlockLayout((6, 8), (2, 4))
    q, k, v = make_qkv(layout.num_tokens, dim=dim, value_dim=3)
    inputs = dict(q=q, k=k, v=v, mixing=random_mixing(layout, grad=False))
    wanted = [inputs[name].requires_grad_() for name in trainable.split()]
    probe = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss = (mhla_attention(q, k, v, layout, inputs["mixing"]) * probe).sum()
    first = torch.autograd.grad(loss, wanted, retain_graph=True)
    second = torch.autograd.grad(loss, wanted)
    expected = torch.autograd.grad((mhla_dense(q, k, v, layout, inputs["mixing"]) * probe).sum(), wanted)
    for name, a, b, ref in zip(trainable.split(), first, second, expected):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"{name}: second backward differs")
        torch.testing.assert_close(a, ref, rtol=0, atol=1e-10, msg=f"{name}: wrong gradient")


@pytest.mark.parametrize("grid, blocks", CAUSAL_LAYOUTS)
@pytest.mark.parametrize("normalize", [True, False])
def test_causal_matches_references(grid, blocks, normalize, make_qkv, random_mixing):
    layout = BlockLayout(grid, blocks)
    q, k, v = make_qkv(layout.num_tokens, value_dim=3, grad=True)
    mixing = random_mixing(layout)
    kwargs = dict(layout=layout, normalize=normalize, causal=True)
    got = _outputs_and_grads(mhla_attention, q, k, v, mixing, **kwargs)
    _assert_all_close(got, _outputs_and_grads(mhla_dense, q, k, v, mixing, **kwargs), atol=1e-10)
    _assert_all_close(got, _outputs_and_grads(mhla_block_loop, q, k, v, mixing, **kwargs), atol=1e-10)


def test_causal_first_token_sees_only_itself(make_qkv, random_mixing):
    layout = BlockLayout((10,), (3,))
    q, k, v = make_qkv(10)
    mixing = random_mixing(layout, grad=False)
    out = mhla_attention(q, k, v, layout, mixing, feature_map="elu+1", causal=True, eps=0.0)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])  # one key: the normalised weight is 1


@pytest.mark.parametrize("path, causal", [("fused", False), ("autograd", False), ("autograd", True)])
def test_gradcheck(path, causal, make_qkv, random_mixing):
    layout = BlockLayout((5,), (2,)) if causal else BlockLayout((3, 4), (2, 2))
    q, k, v = make_qkv(layout.num_tokens, batch=1, heads=2, dim=3, value_dim=2, grad=True)
    mixing = random_mixing(layout)
    fn = lambda q, k, v, w: FAST_PATHS[path](q, k, v, layout, w, "elu+1", causal=causal)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, mixing))


@pytest.mark.parametrize("grid, blocks", [((6, 8), (2, 4)), ((7, 5), (3, 2))])
def test_identity_mixing_is_independent_linear_attention_per_block(grid, blocks, make_qkv):
    layout = BlockLayout(grid, blocks)
    q, k, v = make_qkv(layout.num_tokens, value_dim=5)
    out = mhla_attention(q, k, v, layout, locality_init(layout, "identity").double())
    for block in range(layout.num_blocks):
        idx = (layout.block_index == block).nonzero().squeeze(-1)
        expected = linear_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx])
        torch.testing.assert_close(out[:, :, idx], expected)


@pytest.mark.parametrize("grid", [(20,), (4, 5), (2, 3, 4)])
@pytest.mark.parametrize("feature_map", ["relu", "elu+1"])
def test_one_block_is_global_linear_attention(grid, feature_map, make_qkv):
    layout = BlockLayout(grid, (1,) * len(grid))
    q, k, v = make_qkv(layout.num_tokens)
    mixing = torch.ones(1, 1, dtype=torch.float64)
    out = mhla_attention(q, k, v, layout, mixing, feature_map=feature_map)
    torch.testing.assert_close(out, linear_attention(q, k, v, feature_map=feature_map))


@pytest.mark.parametrize(
    "dtype, atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3), (torch.float32, 1e-5)]
)
@pytest.mark.parametrize("path", sorted(FAST_PATHS))
@pytest.mark.parametrize("grid, blocks", [((7, 5), (3, 2)), ((6, 8), (2, 4))])
def test_low_precision_within_tolerance_of_float64(dtype, atol, path, grid, blocks, make_qkv, random_mixing):
    layout = BlockLayout(grid, blocks)
    q64, k64, v64 = make_qkv(layout.num_tokens, dim=8, value_dim=6)
    mixing = random_mixing(layout, grad=False)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
    out = FAST_PATHS[path](q, k, v, layout, mixing.float())
    assert out.dtype == dtype
    rounded = [t.detach().double().requires_grad_() for t in (q, k, v)]  # the same rounded inputs
    expected = mhla_dense(*rounded, layout, mixing)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)
    probe = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * probe).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * probe).sum(), rounded)
    for g, g_ref in zip(grads, expected_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), g_ref, atol=atol * g_ref.abs().max().item(), rtol=atol)


@pytest.mark.parametrize("causal", [False, True])
def test_autocast_runs_the_op_in_its_own_precision(causal, make_qkv, random_mixing):
    """Under autocast (mixed-precision training) the op gives what it gives on the same bf16 inputs."""
    layout = BlockLayout((12,), (3,)) if causal else BlockLayout((6, 8), (2, 4))
    q, k, v = (t.bfloat16().requires_grad_() for t in make_qkv(layout.num_tokens, dim=8))
    mixing = random_mixing(layout).float()
    expected = mhla_attention(q, k, v, layout, mixing, causal=causal)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mhla_attention(q, k, v, layout, mixing, causal=causal)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, mixing))
    expected_grads = torch.autograd.grad(expected.float().sum(), (q, k, v, mixing))
    for g, g_ref in zip(grads, expected_grads):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


def test_float64_keeps_float64(make_qkv, random_mixing):
    layout = BlockLayout((4, 4), (2, 2))
    q, k, v = make_qkv(16)
    assert mhla_attention(q, k, v, layout, random_mixing(layout, grad=False)).dtype == torch.float64


@pytest.mark.parametrize("path", sorted(FAST_PATHS))
def test_fp16_output_is_clipped_not_inf(path):
    layout = BlockLayout((4, 4), (2, 2))
    q = k = torch.full((1, 1, 16, 4), 8.0, dtype=torch.float16)
    v = torch.full((1, 1, 16, 4), 60000.0, dtype=torch.float16)
    out = FAST_PATHS[path](q, k, v, layout, torch.ones(4, 4), normalize=False)  # 16·256·60000 ≫ fp16 max
    assert out.dtype == torch.float16
    assert torch.all(out == 65504)


@pytest.mark.parametrize("path", sorted(FAST_PATHS))
def test_keys_all_zero_under_phi_give_zero_output(path, make_qkv, random_mixing):
    layout = BlockLayout((7, 5), (3, 2))
    q, k, v = make_qkv(layout.num_tokens, grad=True)
    k_neg = (-k.detach().abs() - 0.1).requires_grad_()  # relu(k) == 0 everywhere
    out = FAST_PATHS[path](q, k_neg, v, layout, random_mixing(layout, grad=False), normalize=True)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out.sum(), (q, k_neg, v))
    assert all(torch.isfinite(g).all() for g in grads)


def _poisoned(allocate):
    return lambda *args, **kwargs: allocate(*args, **kwargs).fill_(float("nan"))


@pytest.mark.parametrize("feature_map", ["relu", "elu+1"])
@pytest.mark.parametrize("normalize", [True, False])
def test_uninitialised_buffers_never_leak(monkeypatch, feature_map, normalize, make_qkv, random_mixing):
    """NaN-fill every uninitialised buffer the fast path makes: results must not change."""
    for grid, blocks in [((6, 8), (2, 4)), ((7, 5), (3, 2)), ((3, 5, 6), (2, 2, 3))]:
        layout = BlockLayout(grid, blocks)
        q, k, v = make_qkv(layout.num_tokens, value_dim=5, grad=True)
        mixing = random_mixing(layout)
        kwargs = dict(layout=layout, feature_map=feature_map, normalize=normalize)
        clean = _outputs_and_grads(mhla_attention, q, k, v, mixing, **kwargs)
        for owner, name in [(torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")]:
            monkeypatch.setattr(owner, name, _poisoned(getattr(owner, name)))
        poisoned = _outputs_and_grads(mhla_attention, q, k, v, mixing, **kwargs)
        monkeypatch.undo()
        for a, b in zip(clean, poisoned):
            assert torch.isfinite(b).all()
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def _heads_interleaved(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, c)`` with ``(B, N, H, c)`` memory, as diffusers processors hand q, k, v over."""
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(t.requires_grad)


@pytest.mark.parametrize("grid, blocks", [((6, 8), (2, 4)), ((7, 5), (3, 2))])
@pytest.mark.parametrize("normalize", [True, False])
def test_heads_interleaved_inputs(grid, blocks, normalize, make_qkv, random_mixing):
    """(B, N, H, d).transpose(1, 2) views: exact values and gradients; the gradients keep the inputs'
    memory layout and the output is heads-interleaved too, so merging heads is a view."""
    layout = BlockLayout(grid, blocks)
    q, k, v = (_heads_interleaved(t) for t in make_qkv(layout.num_tokens, value_dim=5, grad=True))
    assert not q.is_contiguous()
    mixing = random_mixing(layout)
    kwargs = dict(layout=layout, normalize=normalize)
    got = _outputs_and_grads(mhla_attention, q, k, v, mixing, **kwargs)
    _assert_all_close(got, _outputs_and_grads(mhla_dense, q, k, v, mixing, **kwargs), atol=1e-10)
    for result, like in zip(got[1:], (q, k, v)):
        assert result.stride() == like.stride()
    batch, heads, tokens, width = got[0].shape
    assert got[0].transpose(1, 2).is_contiguous()  # (B, N, H, e) memory
    merged = got[0].transpose(1, 2).reshape(batch, tokens, heads * width)
    assert merged._base is got[0] or merged._base is got[0]._base  # a view


def test_large_uneven_grid_in_slabs_matches_block_loop():
    """9360 tokens: the op cuts its sub-grids into slabs (``BlockLayout.chunks``); forward and all
    gradients equal the float64 block loop."""
    layout = BlockLayout((130, 72), (4, 2))
    assert len(layout.chunks) > len(layout.subgrids)
    q, k, v = (
        t.requires_grad_()
        for t in (torch.randn(1, 2, layout.num_tokens, 4, dtype=torch.float64) for _ in range(3))
    )
    mixing = (0.1 + torch.rand(8, 8, dtype=torch.float64)).requires_grad_()
    got = _outputs_and_grads(mhla_attention, q, k, v, mixing, layout=layout)
    _assert_all_close(got, _outputs_and_grads(mhla_block_loop, q, k, v, mixing, layout=layout), atol=1e-10)


# the registered op, as torch.compile / torch.export see it

OPCHECK_LAYOUTS = [((7, 5), (3, 2)), ((3, 5, 6), (2, 2, 3)), ((4, 6), (1, 1)), ((4, 3), (4, 3))]


@pytest.mark.parametrize("grid, blocks", OPCHECK_LAYOUTS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(grid, blocks, normalize, dtype, make_qkv):
    """``torch.library.opcheck``: schema, fake tensors (shapes, dtypes and strides of all outputs equal
    the real ones, so compiled graphs agree with eager), autograd registration and AOT dispatch
    (forward + backward through AOTAutograd), on the heads-interleaved inputs processors pass."""
    layout = BlockLayout(grid, blocks)
    q, k, v = (_heads_interleaved(t.to(dtype)) for t in make_qkv(layout.num_tokens, dim=8, grad=True))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, requires_grad=True)
    args = (q, k, v, list(grid), list(blocks), mixing, "relu", normalize, 1e-6, "pytorch")
    torch.library.opcheck(torch.ops.mhla_gen.mhla.default, args)


@pytest.mark.parametrize(
    "needs", [[True, True, True, True], [False, True, False, True], [True, False, True, False]]
)
def test_opcheck_backward(needs, make_qkv):
    """The backward op's fake gradients (what compiled backward graphs allocate) match the real ones,
    for any subset of needed gradients."""
    grid, blocks = (3, 5, 6), (2, 2, 3)
    q, k, v = (_heads_interleaved(t.float()) for t in make_qkv(90, dim=8))
    mixing = torch.rand(12, 12)
    forward_args = (q, k, v, list(grid), list(blocks), mixing, "relu", True, 1e-6, "pytorch")
    out, *saved = torch.ops.mhla_gen.mhla(*forward_args)
    args = (torch.randn_like(out), *forward_args, out, *saved, needs)
    torch.library.opcheck(
        torch.ops.mhla_gen.mhla_backward.default, args, test_utils=("test_schema", "test_faketensor")
    )


def test_backward_redoes_the_cheaper_of_summaries_and_mixing():
    """The forward saves the summaries where redoing the mixing (2 M² c d flops per head) is cheaper than
    rebuilding them (2 N c d), else the mixed summaries; both paths are in LAYOUTS above."""
    from mhla_gen.ops.blocked import saves_summaries

    assert saves_summaries(BlockLayout((16, 16), (4, 4)))  # DiT at 256 tokens: M² = N
    assert saves_summaries(BlockLayout((21, 30, 52), (3, 5, 10)))  # Wan 480p: 22,500 <= 32,760
    assert not saves_summaries(BlockLayout((32, 32), (16, 16)))  # 256 blocks of 4 tokens
    kinds = {saves_summaries(BlockLayout(grid, blocks)) for grid, blocks in LAYOUTS if math.prod(blocks) > 1}
    assert kinds == {True, False}


def test_backward_allocates_no_gradients_for_the_saved_outputs(make_qkv):
    """The op's extra outputs only carry what backward reads: they are non-differentiable, and autograd
    passes no zero gradients for them (each would be an (M, B, H, c, d) allocation and fill per call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    layout = BlockLayout((6, 8), (2, 4))
    q, k, v = make_qkv(layout.num_tokens, dim=8, grad=True)
    mixing = torch.rand(8, 8, requires_grad=True)
    out, *saved = torch.ops.mhla_gen.mhla(q, k, v, [6, 8], [2, 4], mixing, "relu", True, 1e-6, "pytorch")
    assert out.requires_grad and not any(t.requires_grad for t in saved)
    with RecordOps() as record:
        out.sum().backward()
    assert torch.ops.mhla_gen.mhla_backward.default in record.ops
    fills = ("zeros", "zeros_like", "new_zeros", "fill_")
    created = [op for op in record.ops if op.__name__.split(".")[0] in fills]
    assert created == [], f"backward materialised gradients: {created}"


@pytest.mark.parametrize("normalize", [True, False])
def test_meta_device_gives_shapes_only(normalize):
    """Shape-only forward and backward on ``meta`` (diffusers' low-memory init and shape checks)."""
    layout = BlockLayout((7, 5), (3, 2))
    q, k, v = (torch.empty(2, 35, 3, 8, device="meta").transpose(1, 2).requires_grad_() for _ in range(3))
    mixing = torch.empty(6, 6, device="meta", requires_grad=True)
    for path in FAST_PATHS.values():
        out = path(q, k, v, layout, mixing, normalize=normalize)
        assert (out.device.type, out.shape, out.dtype) == ("meta", (2, 3, 35, 8), torch.float32)
        grads = torch.autograd.grad(out.sum(), (q, k, v, mixing))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, mixing.shape]


# Mean relative output error against float64 on the same rounded inputs, bounded by the arithmetic: with
# fp32 summaries (512 keys each: √512·u_fp32 ~ 1e-6) the error is the rounding of the output to the half
# dtype, at most its unit roundoff u (bf16 2^-8, fp16 2^-11) per element, so the mean stays below u.
# Summaries accumulated in the half dtype add the rounding of 512-term half sums (about 1.5 u measured:
# bf16 5.9e-3, fp16 7-8e-4; the correct code measured 0.36 u: 1.39e-3, 1.7e-4): the bound separates them.
@pytest.mark.parametrize("dtype, unit_roundoff", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
@pytest.mark.parametrize("path", sorted(FAST_PATHS))
def test_half_precision_accumulates_in_fp32(dtype, unit_roundoff, path):
    layout = BlockLayout((64, 32), (2, 2))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 2048, 16, generator=generator).to(dtype) for _ in range(3))
    mixing = torch.rand(4, 4, generator=generator)
    out = FAST_PATHS[path](q, k, v, layout, mixing)
    expected = mhla_block_loop(q.double(), k.double(), v.double(), layout, mixing.double())
    error = ((out.double() - expected).abs() / expected.abs().clamp_min(1e-3)).mean().item()
    assert error <= unit_roundoff
    # what the op keeps for backward is fp32: the (mixed) summaries and the normaliser
    _, *saved = torch.ops.mhla_gen.mhla(q, k, v, [64, 32], [2, 2], mixing, "relu", True, 1e-6, "pytorch")
    saved = Saved(*saved)
    assert (saved.state.dtype, saved.den.dtype) == (torch.float32, torch.float32)


def _bad_call(**override):
    layout = BlockLayout((4, 4), (2, 2))
    args = dict(
        q=torch.zeros(1, 2, 16, 4),
        k=torch.zeros(1, 2, 16, 4),
        v=torch.zeros(1, 2, 16, 3),
        layout=layout,
        mixing=torch.eye(4),
    )
    args.update(override)
    return lambda: mhla_attention(**args)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(q=torch.zeros(1, 2, 15, 4), k=torch.zeros(1, 2, 15, 4), v=torch.zeros(1, 2, 15, 3)), "15"),
        (dict(k=torch.zeros(1, 2, 16, 5)), r"\(1, 2, 16, 5\)"),
        (dict(v=torch.zeros(1, 3, 16, 3)), r"\(1, 3, 16, 3\)"),
        (dict(q=torch.zeros(2, 16, 4)), r"\(2, 16, 4\)"),
        (dict(mixing=torch.eye(5)), r"\(5, 5\)"),
        (dict(causal=True), r"\(4, 4\)"),
        (dict(feature_map="softplus"), "softplus"),
        (dict(layout=(4, 4)), "tuple"),
    ],
)
def test_bad_input_raises_value_error(override, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(**override)()


# the eager path: mhla_attention skips the op's dispatcher in plain eager calls (ops/mhla.py)


def _through_the_op(q, k, v, layout, mixing, feature_map="relu", normalize=True, eps=1e-6):
    """The registered op and its registered autograd formula, called directly (what compiled code runs)."""
    out, *_ = torch.ops.mhla_gen.mhla(q, k, v, list(layout.grid), list(layout.blocks), mixing, feature_map,
                                      normalize, eps, "pytorch")
    return out


EAGER_CASES = [  # uneven, one block, one token per block, 3D, the summaries saved and not
    ((7, 5), (3, 2), "relu", True),
    ((9, 10), (2, 3), "elu+1", True),
    ((3, 5, 6), (2, 2, 3), "relu+1e-6", False),
    ((4, 6), (1, 1), "identity", True),
    ((4, 3), (4, 3), "relu", False),
    ((13,), (5,), "elu+1", False),
]


@pytest.mark.parametrize("grid, blocks, feature_map, normalize", EAGER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("trainable", ["q k v mixing", "k v", "q mixing"])
def test_eager_path_equals_the_registered_op_bit_for_bit(
    grid, blocks, feature_map, normalize, dtype, trainable, make_qkv
):
    """The eager path runs the backend's forward and backward with the op's arguments: the output and
    every gradient equal the op's exactly, on heads-interleaved inputs, for any subset of trainable
    inputs; without grad too."""
    layout = BlockLayout(grid, blocks)
    q, k, v = (_heads_interleaved(t.to(dtype)) for t in make_qkv(layout.num_tokens, dim=8))
    mixing = 0.1 + torch.rand(layout.num_blocks, layout.num_blocks)
    inputs = dict(q=q, k=k, v=v, mixing=mixing)
    wanted = [inputs[name].requires_grad_() for name in trainable.split()]
    probe = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for path in (mhla_attention, _through_the_op):
        out = path(q, k, v, layout, mixing, feature_map=feature_map, normalize=normalize)
        results.append((out.detach(), *torch.autograd.grad(out, wanted, probe)))
        with torch.no_grad():
            results.append((path(q, k, v, layout, mixing, feature_map=feature_map, normalize=normalize),))
    eager, eager_no_grad, op, op_no_grad = results
    for name, a, b in zip(["out", *trainable.split()], eager, op):
        assert a.dtype == b.dtype and a.stride() == b.stride(), name
        assert torch.equal(a, b), f"{name}: eager path differs from the op by {(a - b).abs().max()}"
    assert torch.equal(eager_no_grad[0], op_no_grad[0]) and torch.equal(eager_no_grad[0], op[0])


def _op_calls(fn) -> list[str]:
    """Names of the ``mhla_gen::`` ops the dispatcher ran during ``fn()`` (the CPU profiler records every
    dispatched op; the eager path's Python calls are not ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("mhla_gen::")})


def test_eager_calls_skip_the_dispatcher_and_modes_keep_the_op(make_qkv, random_mixing):
    """Plain eager calls, forward and backward, never enter ``mhla_gen::mhla`` / ``mhla_backward``; under a
    dispatch mode (FlopCounterMode, which counts the op by name) the op runs."""
    from torch.utils.flop_counter import FlopCounterMode

    import mhla_gen.metrics.flops  # noqa: F401 - registers the op's FLOP formulas

    layout = BlockLayout((7, 5), (3, 2))
    q, k, v = make_qkv(layout.num_tokens, grad=True)
    mixing = random_mixing(layout)

    def forward_backward():
        out = mhla_attention(q, k, v, layout, mixing)
        out.sum().backward()
        return out

    assert _op_calls(forward_backward) == []
    with torch.no_grad():
        assert _op_calls(lambda: mhla_attention(q, k, v, layout, mixing)) == []
    assert type(mhla_attention(q, k, v, layout, mixing).grad_fn).__name__ == "_EagerMHLABackward"
    with FlopCounterMode(display=False) as counter:
        assert _op_calls(forward_backward) == ["mhla_gen::mhla", "mhla_gen::mhla_backward"]
    assert counter.get_total_flops() > 0


def test_eager_path_keeps_every_value_error_and_the_double_backward_refusal(make_qkv, random_mixing):
    """Checks run before any work on the eager path too; with ``create_graph=True`` the first backward
    works and a second one fails, as through the op (whose backward op has no autograd formula)."""
    layout = BlockLayout((4, 4), (2, 2))
    q, k, v = make_qkv(16, grad=True)
    with pytest.raises(ValueError, match="float64"):
        mhla_attention(q, k, v, layout, torch.eye(4), backend="triton")
    with pytest.raises(ValueError, match=r"\(5, 5\)"):
        mhla_attention(q, k, v, layout, torch.eye(5))
    mixing = random_mixing(layout)
    grads = []
    for path in (mhla_attention, _through_the_op):
        (grad_q,) = torch.autograd.grad(path(q, k, v, layout, mixing).sum(), q, create_graph=True)
        grads.append(grad_q)
        with pytest.raises(RuntimeError, match="mhla_backward"):
            grad_q.sum().backward()
    assert torch.equal(*grads)


# the backend switch (ops/mhla.py)


def test_backend_argument_and_context_manager(make_qkv, random_mixing):
    """``backend=`` and ``with mhla_backend(..)`` pick the implementation; on CPU "auto" and "pytorch" both
    run blocked.py (the same numbers). Blocks nest and restore the previous backend, also on an error."""
    layout = BlockLayout((7, 5), (3, 2))
    q, k, v = make_qkv(layout.num_tokens)
    mixing = random_mixing(layout, grad=False)
    expected = mhla_attention(q, k, v, layout, mixing)
    default = get_mhla_backend()
    with mhla_backend("pytorch"):
        with mhla_backend("auto"):
            assert get_mhla_backend() == "auto"
        assert get_mhla_backend() == "pytorch"
        got = mhla_attention(q, k, v, layout, mixing)
    assert get_mhla_backend() == default
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got = mhla_attention(q, k, v, layout, mixing, backend="pytorch")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(KeyError), mhla_backend("pytorch"):
        raise KeyError
    assert get_mhla_backend() == default


def test_bad_backend_raises_value_error(make_qkv):
    layout = BlockLayout((4, 4), (2, 2))
    q, k, v = make_qkv(16)  # float64: outside the kernels' dtypes
    with pytest.raises(ValueError, match="'cuda'"):
        mhla_attention(q, k, v, layout, torch.eye(4), backend="cuda")
    with pytest.raises(ValueError, match="'fast'"), mhla_backend("fast"):
        pass
    with pytest.raises(ValueError, match="float64"):
        mhla_attention(q, k, v, layout, torch.eye(4), backend="triton")


@pytest.mark.parametrize("env, default", [("0", "pytorch"), (None, "auto")])
def test_mhla_triton_is_a_default_read_at_import(env, default):
    """``MHLA_TRITON=0`` at import makes "pytorch" the default; setting it later changes nothing. A CPU
    forward and backward never import the Triton backend (``ops/triton_mhla.py``)."""
    code = (
        "import os, sys, torch\n"
        "from mhla_gen import BlockLayout\n"
        "from mhla_gen.ops import get_mhla_backend, mhla_attention\n"
        "os.environ['MHLA_TRITON'] = '0' if os.environ.get('MHLA_TRITON') is None else '1'\n"
        "q, k, v = (torch.randn(1, 2, 12, 4, requires_grad=True) for _ in range(3))\n"
        "mhla_attention(q, k, v, BlockLayout((3, 4), (2, 2)), torch.rand(4, 4)).sum().backward()\n"
        "print(get_mhla_backend(), 'mhla_gen.ops.triton_mhla' in sys.modules)\n"
    )
    environ = {key: value for key, value in os.environ.items() if key != "MHLA_TRITON"}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])  # this checkout
    if env is not None:
        environ["MHLA_TRITON"] = env
    result = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [default, "False"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_float64_oracle(dtype, make_qkv, random_mixing):
    layout = BlockLayout((8, 12), (4, 3))
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in make_qkv(96, dim=16, value_dim=8))
    mixing = random_mixing(layout, grad=False).float().cuda()
    out = mhla_attention(q, k, v, layout, mixing)
    expected = mhla_dense(*(t.detach().double().cpu() for t in (q, k, v)), layout, mixing.double().cpu())
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double().cpu(), expected, atol=atol, rtol=atol)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().sum(), (q, k, v)))


def test_a_machine_without_triton_hears_once_that_mhla_runs_pytorch(monkeypatch, caplog):
    """The probe the op's and RoPE's dispatchers ask at their first CUDA call: without triton it says
    once, as a warning, that MHLA runs its PyTorch paths (before, the fallback was silent)."""
    import logging
    import sys

    from mhla_gen.ops import triton_probe

    monkeypatch.setattr(triton_probe, "_importable", None)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with caplog.at_level(logging.WARNING, logger="mhla_gen.ops.triton_probe"):
        assert triton_probe.triton_importable() is False
        assert triton_probe.triton_importable() is False
    warned = [r.getMessage() for r in caplog.records if "triton does not import" in r.getMessage()]
    assert len(warned) == 1 and "PyTorch paths on CUDA" in warned[0]
