"""Wan's RoPE (``mhla_gen.ops.rope``): the lean PyTorch path and the Triton kernel against the reference.

Every backend does the reference's arithmetic (fp32 products, one fp32 sum, one rounding to the input
dtype; the inverse rotation of the gradient backward), so forward and backward are compared for
equality, not closeness; float64 gradchecks check the backward against finite differences. Tables are
random at every position (not Wan's repeated pairs), so reading cos or sin from the wrong half of a pair
shows.

The kernel runs in Triton's interpreter, switched on (``TRITON_INTERPRET=1``) before ``triton`` is first
imported: :func:`test_kernel_in_interpreter` runs this file's interpreter tests in one child pytest (as
``tests/test_triton_mhla.py`` does); run them directly with ``TRITON_INTERPRET=1 pytest tests/test_rope.py``.
The interpreter handles fp32, fp16 and float64; bf16 runs in the ``gpu``-marked test.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch
from kernel_helpers import LAYOUTS, ROOT, interpreter_only, laid_out, main_process_only, run_in_interpreter

from mhla_gen import install_mhla, mhla_parameters
from mhla_gen.bases import BASES
from mhla_gen.ops import rope
from mhla_gen.ops.rope import apply_wan_rotary, rope_backend, wan_rotary_pair

# (B, H, N, d): odd N, one head, batch 1, d not a power of two, the smallest d
SHAPES = [(2, 3, 7, 8), (1, 1, 5, 6), (2, 2, 9, 10), (1, 3, 1, 2)]
# q's and k's memory: kernel_helpers.LAYOUTS (contiguous, heads-interleaved as the processors pass them, a
# slice of a fused projection)


def _tables(n, d, dtype, gen, strided=False):
    """Random ``(1, N, 1, d)`` cos / sin tables; ``strided``: every other token of a longer table."""
    tokens = 2 * n if strided else n
    cos, sin = (torch.randn(1, tokens, 1, d, generator=gen).to(dtype) for _ in range(2))
    return (cos[:, ::2], sin[:, ::2]) if strided else (cos, sin)


def _case(shape, q_layout, k_layout, dtype, table_dtype=torch.float32, strided_tables=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = laid_out(shape, q_layout, gen, dtype), laid_out(shape, k_layout, gen, dtype)
    cos, sin = _tables(shape[2], shape[3], table_dtype, gen, strided_tables)
    grads = tuple(laid_out(shape, "interleaved", gen, dtype) for _ in range(2))
    return q, k, cos, sin, grads


def _forward_backward(backend, q, k, cos, sin, grads):
    """``(rq, rk, dq, dk)`` of :func:`wan_rotary_pair` on ``backend`` for output gradients ``grads``."""
    q, k = (x.detach().requires_grad_() for x in (q, k))
    rq, rk = wan_rotary_pair(q, k, cos, sin, backend=backend)
    dq, dk = torch.autograd.grad((rq, rk), (q, k), grads)
    return rq, rk, dq, dk


def _assert_same_as_reference(backend, case):
    got = _forward_backward(backend, *case)
    expected = _forward_backward("reference", *case)
    for name, a, b in zip(("rq", "rk", "dq", "dk"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, (a.double() - b.double()).abs().max().item())


# --------------------------------------------------------------------------------------------------
# the lean PyTorch path and the dispatch (main process)


@main_process_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_pytorch_path_equals_reference(shape, dtype):
    _assert_same_as_reference("pytorch", _case(shape, "contiguous", "interleaved", dtype))
    _assert_same_as_reference("pytorch", _case(shape, "fused", "contiguous", dtype, torch.bfloat16, True))


@main_process_only
def test_pytorch_path_gradcheck_and_output_layout():
    q, k, cos, sin, _ = _case((2, 2, 5, 6), "interleaved", "fused", torch.float64, torch.float64)
    q, k = q.requires_grad_(), k.requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k: wan_rotary_pair(q, k, cos, sin, backend="pytorch"), (q, k))
    rq, rk = wan_rotary_pair(q, k, cos, sin, backend="pytorch")
    # outputs keep the inputs' dimension order (torch.empty_like): the fused slice's is heads-interleaved
    assert rq.stride() == q.stride() and rk.transpose(1, 2).is_contiguous()


@main_process_only
def test_auto_runs_the_reference_on_cpu_and_bad_settings_raise(monkeypatch):
    calls = []
    monkeypatch.setattr(rope, "apply_wan_rotary", lambda x, *t: calls.append(x) or apply_wan_rotary(x, *t))
    q, k, cos, sin, _ = _case((1, 2, 3, 4), "contiguous", "contiguous", torch.float32)
    wan_rotary_pair(q, k, cos, sin)
    assert len(calls) == 2
    with rope_backend("pytorch"):
        wan_rotary_pair(q, k, cos, sin)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="unknown RoPE backend 'cuda'"):
        rope_backend("cuda").__enter__()
    with pytest.raises(ValueError, match="RoPE backend 'pytorch' needs .* d even"):
        wan_rotary_pair(q[..., :3], k[..., :3], cos[..., :3], sin[..., :3], backend="pytorch")
    with pytest.raises(ValueError, match=r"tables \(1, 3, 1, 4\)"):
        wan_rotary_pair(q, k[:, :, :2], cos, sin, backend="triton")


class _Spy:
    """Counts calls of a rotate function and runs ``run`` (the real kernel, or the PyTorch path)."""

    def __init__(self, run):
        self.run, self.calls = run, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.run(*args, **kwargs)


@main_process_only
def test_auto_picks_the_kernel_on_cuda_but_traces_the_reference_under_compile(monkeypatch):
    """With the device taken for CUDA and Triton importable, eager ``"auto"`` calls the kernel (a spy
    that runs the PyTorch path here); ``torch.compile(fullgraph=True)`` traces the reference instead (for
    inductor to fuse), without a graph break."""
    pytest.importorskip("triton")
    triton_rope = importlib.import_module("mhla_gen.ops.triton_rope")
    spy = _Spy(rope.rotate_pair_torch)
    monkeypatch.setattr(triton_rope, "rope_pair", spy)
    monkeypatch.setattr(rope, "_on_cuda", lambda x: True)
    monkeypatch.setattr(rope, "_triton_importable", lambda: True)
    q, k, cos, sin, _ = _case((2, 2, 5, 6), "interleaved", "interleaved", torch.float32)
    expected = wan_rotary_pair(q, k, cos, sin, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(wan_rotary_pair(q, k, cos, sin), expected))
    assert spy.calls == 1
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k: wan_rotary_pair(q, k, cos, sin), fullgraph=True, backend="eager")
    assert all(torch.equal(a, b) for a, b in zip(compiled(q, k), expected))
    assert spy.calls == 1
    monkeypatch.setattr(rope, "_triton_allowed", False)  # MHLA_TRITON=0: the PyTorch path on CUDA
    monkeypatch.setattr(rope, "rotate_pair_torch", _Spy(rope.rotate_pair_torch))
    wan_rotary_pair(q, k, cos, sin)
    assert rope.rotate_pair_torch.calls == 1 and spy.calls == 1


@main_process_only
def test_bench_rope_plumbing(capsys):
    """The benchmark's tiny CPU run: every backend row, the kernel's marked missing without CUDA."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        bench = importlib.import_module("bench_rope")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    argv = ["--device", "cpu", "--tokens", "33", "--heads", "2", "--dim", "8", "--repeats", "1"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "| reference |" in out and "| triton | - |" in out
    assert [line.endswith("| yes |") for line in out.splitlines() if line.startswith("| pytorch |")] == [True]


# --------------------------------------------------------------------------------------------------
# the kernel in Triton's interpreter


@main_process_only
def test_kernel_in_interpreter():
    """All interpreter tests of this file in one child pytest with ``TRITON_INTERPRET=1`` (CPU tensors)."""
    run_in_interpreter(__file__, timeout=900)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_reference(shape, dtype):
    """q and k of different layouts in one launch; tables of another dtype and strided."""
    for q_layout, k_layout in zip(LAYOUTS, LAYOUTS[1:] + LAYOUTS[:1]):
        _assert_same_as_reference("triton", _case(shape, q_layout, k_layout, dtype))
    strided_tables = _case(shape, "interleaved", "interleaved", dtype, torch.float16, strided_tables=True)
    _assert_same_as_reference("triton", strided_tables)


@interpreter_only
@pytest.mark.parametrize("block_n", [1, 2, 4])
def test_kernel_token_tiles(block_n):
    """Several token tiles per batch entry, the last one partial (N = 9)."""
    from mhla_gen.ops.triton_rope import rope_pair

    q, k, cos, sin, _ = _case((2, 2, 9, 6), "interleaved", "contiguous", torch.float32)
    rq, rk = rope_pair(q, k, cos[0, :, 0, 0::2], sin[0, :, 0, 1::2], block_n=block_n)
    assert torch.equal(rq, apply_wan_rotary(q, cos, sin)) and torch.equal(rk, apply_wan_rotary(k, cos, sin))


@interpreter_only
def test_kernel_gradcheck():
    q, k, cos, sin, _ = _case((1, 2, 3, 4), "interleaved", "fused", torch.float64, torch.float64)
    q, k = q.requires_grad_(), k.requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k: wan_rotary_pair(q, k, cos, sin, backend="triton"), (q, k))


# one base per processor class whose self-attention takes rotary positions (the RoPE path is the
# processor's; BASES lists the more specific records first, so the plainer one of a class stays), with its
# tiny test MHLA on every layer; Wan's second RoPE placement (mhla.wan_rope) on top, as Wan's own case
ROPE_BASES = {base.processor: name for name, base in BASES.items() if base.grid.rope != "none"}.values()
ROPE_CASES = [(name, {}) for name in ROPE_BASES]
ROPE_CASES.append((BASES["wan"].name, {"wan_rope": "after_phi_numerator"}))


def _video_case(base: str, overrides: dict):
    """The base's tiny model with its test MHLA (``overrides`` applied) on every layer, and its inputs
    (its test latents: token grid (3, 3, 5))."""
    tiny = BASES[base].tiny.load()
    model = install_mhla(tiny.model(), dataclasses.replace(tiny.mhla, layers=None, **overrides))
    return model, tiny.inputs(model)


def _model_forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, return_dict=False)[0]
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in mhla_parameters(model).items()}


@interpreter_only
@pytest.mark.parametrize(("base", "overrides"), ROPE_CASES, ids=[f"{b}-{'-'.join(o.values()) or 'default'}"
                                                                for b, o in ROPE_CASES])
def test_processors_launch_the_kernel_under_auto(monkeypatch, base, overrides):
    """With the (interpreted) kernel taken for a CUDA one, the processors of every base with RoPE (Wan: on
    q, k before φ, or on φ(q), φ(k) of the numerator; SANA-Video: after φ) run RoPE through it, once per
    MHLA layer forward and once backward, and match the reference backend: the
    outputs and the MHLA parameters' gradients within fp32 round-off (the kernel keeps the inputs'
    heads-interleaved memory, the reference writes contiguous tensors, and the CPU's matmuls may sum
    in another order on either)."""
    triton_rope = importlib.import_module("mhla_gen.ops.triton_rope")
    spy = _Spy(triton_rope.rope_pair)
    monkeypatch.setattr(triton_rope, "rope_pair", spy)
    monkeypatch.setattr(rope, "_on_cuda", lambda x: True)
    model, inputs = _video_case(base, overrides)
    with rope_backend("reference"):
        out_ref, grads_ref = _model_forward_backward(model, inputs)
    assert spy.calls == 0
    out, grads = _model_forward_backward(model, inputs)
    assert spy.calls == 2 * model.config.num_layers  # one launch per MHLA layer, forward and backward
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-4, atol=1e-6 * grads_ref[name].abs().max())


# --------------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu  # skipped without CUDA by conftest
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_and_pytorch_path_equal_reference(dtype):
    """Wan2.1-1.3B's heads (12 x 128) at an odd token count, heads-interleaved, fp32 and bf16 tables:
    the kernel (FMA contraction off) and the PyTorch path give the reference's bits, forward and
    backward; "auto" picks the kernel."""
    pytest.importorskip("triton")
    for table_dtype in (torch.float32, torch.bfloat16):
        case = _case((2, 12, 4099, 128), "interleaved", "interleaved", dtype, table_dtype)
        case = tuple(x.cuda() if torch.is_tensor(x) else tuple(g.cuda() for g in x) for x in case)
        _assert_same_as_reference("triton", case)
        _assert_same_as_reference("pytorch", case)
        assert rope._resolve_backend(None, *case[:4]) == "triton"
