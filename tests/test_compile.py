"""MHLA models under torch.compile and torch.export, as diffusers users run them.

Every base model, with the extras on, traces to the stock model's graph count with zero graph breaks,
and the compiled / exported model matches eager within fp32 round-off, forward and backward. The
models run in eval mode: DiT's class-label dropout draws random numbers in train mode, so compiled and
eager runs would see different labels.
"""

from __future__ import annotations

import pytest
import torch

from mhla_gen import MHLAConfig, install_mhla, mhla_parameters
from mhla_gen.bases import BASES
from mhla_gen.integration.install import mhla_processors

EXTRAS = dict(cpe_kernel=3, gate=True)
# every base record through its test reference (tiny model, inputs on an uneven token grid, test MHLA
# config), and two feature variants on a record: another feature map and gate, the Wan release preset
VARIANTS = {
    "dit-elu": ("dit", MHLAConfig(blocks=(2, 2), feature_map="elu+1", gate_activation="silu", gate=True)),
    "wan-release": ("wan", MHLAConfig.preset("wan-release", blocks=(2, 2, 3), layers=[1, 2], **EXTRAS)),
}
CASES = sorted([*BASES, *VARIANTS])
# one record per transformer class (records sharing a class, Wan and Wan I2V, compile alike): for the
# slowest test, dynamic-shape compilation of two models at three sizes
ONE_PER_CLASS = sorted({base.class_name: name for name, base in BASES.items()}.values())


def case_base(case: str):
    """``(record, test reference, MHLA config)`` of a case."""
    name, cfg = VARIANTS.get(case, (case, None))
    tiny = BASES[name].tiny.load()
    return BASES[name], tiny, cfg or tiny.mhla


def build(case: str, mhla: bool = True):
    """The case's tiny model in eval mode with MHLA installed (parameters moved off their init, so a
    wrong mixing or extra shows in the output) and its inputs."""
    _, tiny, cfg = case_base(case)
    model = tiny.model().eval()
    if mhla:
        install_mhla(model, cfg)
        with torch.no_grad():
            for p in mhla_parameters(model).values():
                p.add_(0.1 * torch.rand_like(p))
    return model, tiny.inputs(model)


def forward_backward(model, inputs):
    """The output and the gradients of every parameter for a fixed random probe of the output."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)[0]
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * probe).sum().backward()
    grads = {
        name.removeprefix("_orig_mod."): p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return out.detach(), grads


def assert_close_grads(grads, expected_grads, rtol=2e-5):
    """Each gradient within ``rtol`` of the expected one in norm (fp32 round-off: compiled kernels sum
    in another order), plus a floor of ``rtol`` times the largest gradient norm for gradients that are
    zero in exact arithmetic (a key bias under softmax) and round-off only; the MHLA parameters among
    them."""
    assert grads.keys() == expected_grads.keys()
    assert any("processor" in name for name in grads)  # the MHLA parameters are trained too
    floor = rtol * max(g.norm() for g in expected_grads.values())
    for name, grad in grads.items():
        expected = expected_grads[name]
        error = (grad - expected).norm()
        assert error <= rtol * expected.norm() + floor, (name, error.item(), expected.norm().item())


def assert_same_results(actual, expected):
    (out, grads), (out_ref, grads_ref) = actual, expected
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    assert_close_grads(grads, grads_ref)


@pytest.mark.parametrize("case", CASES)
def test_one_graph_no_breaks_like_the_stock_model(case):
    counts = {}
    for mhla in (False, True):
        model, inputs = build(case, mhla)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(**inputs)
        counts[mhla] = (explained.graph_count, explained.graph_break_count)
    assert counts[True] == counts[False] == (1, 0), counts


@pytest.mark.parametrize("case", CASES)
def test_fullgraph_compile_matches_eager_forward_and_backward(case):
    """aot_eager runs the compiled forward and backward graphs (AOTAutograd, the op's fake shapes
    included) with eager kernels, so this checks tracing, not inductor's codegen (below)."""
    model, inputs = build(case)
    expected = forward_backward(model, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same_results(forward_backward(compiled, inputs), expected)


def test_inductor_compile_matches_eager():
    model, inputs = build("sana")
    expected = forward_backward(model, inputs)
    torch._dynamo.reset()
    assert_same_results(forward_backward(torch.compile(model, fullgraph=True), inputs), expected)


def test_backend_switch_is_read_when_tracing():
    """``with mhla_backend(..)`` around a compiled call: the backend is read while tracing, passed to the
    op as an argument, and the graph is guarded on it, so a switch retraces (never a stale backend)."""
    from mhla_gen import BlockLayout
    from mhla_gen.ops import mhla_attention, mhla_backend

    layout, mixing = BlockLayout((6, 10), (2, 3)), torch.rand(6, 6)
    q, k, v = (torch.randn(1, 2, 60, 4) for _ in range(3))
    traced = []  # the backend argument of the op in each traced graph

    def record(gm, example_inputs):
        traced.extend(n.args[-1] for n in gm.graph.nodes if "mhla_gen.mhla" in str(n.target))
        return gm

    torch._dynamo.reset()
    attend = lambda *qkv: mhla_attention(*qkv, layout, mixing)  # noqa: E731
    compiled = torch.compile(attend, backend=record, fullgraph=True)
    expected = mhla_attention(q, k, v, layout, mixing)
    for name in ("auto", "pytorch", "auto"):
        with mhla_backend(name):
            torch.testing.assert_close(compiled(q, k, v), expected, rtol=0, atol=0)
    assert traced == ["pytorch", "pytorch"]  # CPU: "auto" resolves to PyTorch; the third call reuses a graph


def test_compile_repeated_blocks():
    """diffusers' regional compilation (Wan declares ``_repeated_blocks``), with inductor."""
    model, inputs = build("wan")
    expected = forward_backward(model, inputs)
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True)
    assert_same_results(forward_backward(model, inputs), expected)


def resolutions(case: str) -> tuple[tuple[int, ...], ...]:
    """Latent sizes whose token grids are even on some axes and uneven on others for the blocks of the
    record's test config (its test reference's ``sizes``)."""
    return case_base(case)[1].sizes


@pytest.mark.parametrize("case", ONE_PER_CLASS)
def test_dynamic_shapes_compile_like_the_stock_model(case):
    """``torch.compile(dynamic=True)``: a new resolution, whether its grid divides by the blocks or not,
    compiles a new graph only where the stock model does (DiT's position embedding specialises once;
    SANA and Wan never do), and every resolution matches eager, forward and backward."""
    counts = {}
    for mhla in (False, True):
        model, inputs = build(case, mhla)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="aot_eager")
        counts[mhla] = []
        for size in resolutions(case):
            batch, channels = inputs["hidden_states"].shape[:2]
            inputs["hidden_states"] = torch.randn(batch, channels, *size)
            actual = forward_backward(compiled, inputs)
            counts[mhla].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            if mhla:
                assert_same_results(actual, forward_backward(model, inputs))
    new_graphs = {mhla: [b - a for a, b in zip(c, c[1:])] for mhla, c in counts.items()}
    assert new_graphs[True] == new_graphs[False], counts


@pytest.mark.parametrize("case", sorted(BASES))
def test_export_and_decompositions(case):
    """``torch.export`` of an MHLA model matches eager, forward and backward; ``run_decompositions``
    keeps the op as one node per layer and matches too."""
    model, inputs = build(case)
    expected = forward_backward(model, inputs)
    program = torch.export.export(model, (), inputs)
    # the exported module (training IR) is differentiable: the op's registered autograd formula
    exported = program.module()
    out = exported(**inputs)[0]
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    names, params = zip(*exported.named_parameters())
    grads = torch.autograd.grad((out * probe).sum(), params, allow_unused=True)
    assert_close_grads({n: g for n, g in zip(names, grads) if g is not None}, expected[1])
    # the inference IR (ATen ops) keeps one opaque mhla_gen.mhla node per MHLA layer
    decomposed = program.run_decompositions()
    mhla_nodes = [n for n in decomposed.graph.nodes if n.target is torch.ops.mhla_gen.mhla.default]
    assert len(mhla_nodes) == op_calls(model, inputs) >= len(mhla_processors(model))
    with torch.no_grad():
        torch.testing.assert_close(decomposed.module()(**inputs)[0], expected[0], rtol=1e-5, atol=1e-5)


def op_calls(model, inputs) -> int:
    """How many times an eager forward calls the MHLA op (once per MHLA layer; SANA-Video twice: its
    rotary numerator and its plain normaliser)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func is torch.ops.mhla_gen.mhla.default
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        model(**inputs)
    return Count.calls


def export_with_dynamic_latent(case: str, model, inputs) -> torch.export.ExportedProgram:
    """``torch.export`` of the case's model with the latent's spatial sizes dynamic: each token grid
    axis from as many tokens as blocks (the layout checks it) to 32, the latent that axis's patch times it."""
    record, _, cfg = case_base(case)
    patch = model.config[record.grid.patch]
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch,) * record.grid.ndim
    tokens = [torch.export.Dim(f"tokens{a}", min=b, max=32) for a, b in enumerate(cfg.blocks)]
    spatial = {2 + a: dim if p == 1 else p * dim for a, (dim, p) in enumerate(zip(tokens, patch))}
    dynamic = {name: spatial if name == "hidden_states" else None for name in inputs}
    return torch.export.export(model, (), inputs, dynamic_shapes=dynamic)


def assert_matches_eager_at_every_resolution(case: str, run, model, inputs) -> None:
    for size in resolutions(case):
        inputs["hidden_states"] = torch.randn(*inputs["hidden_states"].shape[:2], *size)
        with torch.no_grad():
            torch.testing.assert_close(run(**inputs)[0], model(**inputs)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(BASES))
def test_export_with_dynamic_shapes_serves_every_resolution(case):
    """One ``torch.export`` program with dynamic latent sizes runs even and uneven grids and matches
    eager at each, for every base whose stock model exports so (DiT's own position embedding pins its
    size, MHLA or not)."""
    stock, inputs = build(case, mhla=False)
    try:
        stock_program = export_with_dynamic_latent(case, stock, inputs)
        assert_matches_eager_at_every_resolution(case, stock_program.module(), stock, inputs)
    except (torch._dynamo.exc.UserError, AssertionError) as err:  # a constraint or a guard on a size
        pytest.skip(f"the stock model pins its latent size: {str(err).splitlines()[0]}")
    model, inputs = build(case)
    program = export_with_dynamic_latent(case, model, inputs)
    assert_matches_eager_at_every_resolution(case, program.module(), model, inputs)


def test_aot_inductor_package_serves_every_resolution(tmp_path):
    """AOTInductor (diffusers' ``test_compile_works_with_aot``, here with dynamic sizes): the packaged
    model runs even and uneven grids; the op runs through Python, so ``mhla_gen`` must be imported."""
    from torch._inductor.package import load_package

    model, inputs = build("sana")
    program = export_with_dynamic_latent("sana", model, inputs)
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "sana.pt2"))
    assert_matches_eager_at_every_resolution("sana", load_package(package), model, inputs)


@pytest.mark.gpu
def test_cuda_graph_captures_a_denoising_step():
    """On CUDA (Triton kernels behind the op): a Wan forward in bf16 is captured by a CUDA graph and
    replays to the eager output; ``torch.compile(mode="reduce-overhead")`` (CUDA graphs through
    inductor) matches eager too."""
    model, inputs = build("wan")
    model = model.cuda().to(torch.bfloat16)
    inputs = {k: v.cuda().to(torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    with torch.inference_mode():
        expected = model(**inputs, return_dict=False)[0]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as CUDA graph capture requires
            model(**inputs, return_dict=False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(**inputs, return_dict=False)[0]
        graph.replay()
        torch.testing.assert_close(captured, expected, rtol=0, atol=0)
        torch._dynamo.reset()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # record, then replay
            out = compiled(**inputs, return_dict=False)[0]
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_training_under_accelerates_dynamo_backend_samples_and_saves_the_plain_model(tmp_path, monkeypatch):
    """``accelerate launch --dynamo_backend ...`` (``ACCELERATE_DYNAMO_BACKEND``) makes ``prepare`` wrap the
    transformer in torch.compile's ``OptimizedModule``; sample grids, ``final/`` and its model card use the
    model itself (``train.loop.plain_model``): before, the card failed on the wrapper's class. ``EAGER``:
    dynamo's wrapper and tracing without inductor's compile time."""
    from train_helpers import run_inprocess, tiny_config

    from mhla_gen import load_transformer

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")
    out = tmp_path / "run"
    run_inprocess("train_dit.py", "--config", tiny_config("dit"), f"output_dir={out}", "train.max_steps=2",
                  "log.sample_every=1")
    assert (out / "final" / "README.md").is_file()
    assert sorted(p.name for p in (out / "samples").iterdir())[:2] == ["step_0000001.png", "step_0000002.png"]
    assert load_transformer(out / "final").mhla_config is not None
