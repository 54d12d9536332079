"""MHLA in diffusers' SanaVideoTransformer3DModel (SANA-Video): the exact start from the stock linear
attention, the dense oracle, install / save / load, compile, offloading, checkpointing and the pipeline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_sana_video import (
    SanaAttnProcessor2_0,
    SanaLinearAttnProcessor3_0,
)

from mhla_gen import BlockLayout, MHLAConfig, install_mhla, load_transformer, mhla_parameters, uninstall_mhla
from mhla_gen.integration.install import mhla_processors
from mhla_gen.integration.serialization import load_mhla_parameters, save_mhla_parameters
from mhla_gen.processors.sana_video import SANA_VIDEO_EPS, SanaVideoMHLAProcessor, video_token_grid
from mhla_gen.testing import OFFLOAD_MODES, offload
from mhla_gen.testing.video import tiny_sana_video, tiny_sana_video_pipeline

BLOCKS = (2, 2, 3)  # on the token grid (3, 3, 5): every axis splits unevenly
M = 12


def _inputs(seed=0, dtype=torch.float32, frames=3):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(2, 16, frames, 6, 10, generator=g).to(dtype),  # token grid (3, 3, 5)
        encoder_hidden_states=torch.randn(2, 5, 16, generator=g).to(dtype),
        timestep=torch.tensor([10.0, 700.0]),
    )


def _randomize_norms_(model, seed=0):
    """q/k RMSNorm weights of both signs (all ones would hide a dropped norm: the normalised output
    ignores a per-token scale of q)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.transformer_blocks:
            for norm in (block.attn1.norm_q, block.attn1.norm_k):
                norm.weight.copy_(torch.randn(norm.weight.shape, generator=g))
    return model


def _perturb_mhla_(model, seed=5):
    """Every MHLA parameter to seeded values far from its init (CPE / gate start at zero / identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mhla_parameters(model).items():
            scale, shift = (1.0, 0.1) if name.endswith("mixing.weight") else (0.5, 0.0)
            p.copy_(shift + scale * (torch.rand if shift else torch.randn)(p.shape, generator=g))
    return model


def _model(cfg=None, **overrides):
    model = _randomize_norms_(tiny_sana_video(**overrides))
    if cfg is not None:
        install_mhla(model, cfg)
        _perturb_mhla_(model)
    return model


@torch.no_grad()
def _run(model, inputs):
    return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("blocks", [(1, 1, 1), BLOCKS])
def test_uniform_mixing_starts_exactly_at_the_stock_model(blocks):
    """SANA-Video's attention is global ReLU linear attention with RoPE on the numerator; MHLA with
    uniform mixing (rows 1/M) and eps 1e-15 / M is the same function. The two sum the same terms in
    another order (per layer, sums of 45 products in fp32), so outputs agree to a few fp32 ulps of the
    largest output; 8 ulps allowed (measured: under 2)."""
    model = _model()
    inputs = _inputs()
    assert all(isinstance(b.attn1.processor, SanaLinearAttnProcessor3_0) for b in model.transformer_blocks)
    stock = _run(model, inputs)
    m = blocks[0] * blocks[1] * blocks[2]
    install_mhla(model, MHLAConfig(blocks=blocks, mixing_init="uniform", eps=SANA_VIDEO_EPS / m))
    assert all(isinstance(b.attn1.processor, SanaVideoMHLAProcessor) for b in model.transformer_blocks)
    ours = _run(model, inputs)
    ulp = float(torch.finfo(torch.float32).eps * 2 ** stock.abs().max().log2().floor())
    torch.testing.assert_close(ours, stock, rtol=0, atol=8 * ulp)
    install_mhla(model, MHLAConfig(blocks=BLOCKS))  # the paper's locality init is another function
    assert (_run(model, inputs) - stock).abs().max() > 1e3 * ulp


def _rotate(x, cos, sin):
    """Reference RoPE with complex numbers: pairs (2i, 2i+1) are one complex coordinate. x (B, H, N, d)."""
    rotation = torch.complex(cos[..., 0::2], sin[..., 1::2]).transpose(1, 2)  # (1, 1, N, d / 2)
    return torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * rotation
    ).flatten(-2)


def _dense_reference(attn, proc, x, rotary, grid):
    """attn1 written from the formulas (module docstring), dense, in float64."""
    cfg, heads = proc.cfg, attn.heads
    split = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)
    q, k = split(attn.norm_q(attn.to_q(x))), split(attn.norm_k(attn.to_k(x)))
    v_merged = attn.to_v(x)
    cos, sin = (r.double() for r in rotary)
    blocks = BlockLayout(grid, cfg.blocks).block_index
    w = proc.mixing.weight[blocks][:, blocks]  # W[b(t), b(s)]: (N, N)
    fq, fk = F.relu(q), F.relu(k)
    numerator = (w * (_rotate(fq, cos, sin) @ _rotate(fk, cos, sin).transpose(-1, -2))) @ split(v_merged)
    out = numerator / ((w * (fq @ fk.transpose(-1, -2))).sum(-1, keepdim=True) + cfg.eps)
    out = out.transpose(1, 2).flatten(2)  # (B, N, heads * d)
    b, n, c = v_merged.shape
    out = out + proc.cpe.conv(v_merged.transpose(1, 2).reshape(b, c, *grid)).reshape(b, c, n).transpose(1, 2)
    out = out * torch.sigmoid(proc.gate.proj(x))
    return attn.to_out[0](out)


def test_processor_matches_dense_oracle():
    model = _model(MHLAConfig(blocks=BLOCKS, cpe_kernel=3, gate=True)).double()
    latent = _inputs(dtype=torch.float64)["hidden_states"]
    rotary = model.rope(latent)  # carries the token grid (install_mhla hooks the rope)
    assert rotary.grid == video_token_grid(model, latent) == (3, 3, 5)
    attn = model.transformer_blocks[0].attn1
    x = torch.randn(2, 45, attn.to_q.in_features, dtype=torch.float64)
    out = attn(x, rotary_emb=rotary)
    # float64 against the float64 dense form: a few hundred eps64 of reordered sums, 1e-9 is 1e4 x that
    torch.testing.assert_close(
        out, _dense_reference(attn, attn.processor, x, rotary, (3, 3, 5)), rtol=1e-9, atol=1e-9
    )


def test_install_uninstall_hybrid_and_cross_attention_stays_stock():
    model = _model()
    inputs = _inputs()
    stock = _run(model, inputs)
    install_mhla(model, MHLAConfig(blocks=BLOCKS, layers=[1]))
    kinds = [type(b.attn1.processor) for b in model.transformer_blocks]
    assert kinds == [SanaLinearAttnProcessor3_0, SanaVideoMHLAProcessor]
    assert all(type(b.attn2.processor) is SanaAttnProcessor2_0 for b in model.transformer_blocks)
    assert not torch.equal(_run(model, inputs), stock)
    uninstall_mhla(model)
    assert torch.equal(_run(model, inputs), stock)


def test_bad_settings_raise_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="3D token grid"):
        install_mhla(model, MHLAConfig(blocks=(2, 2)))
    with pytest.raises(ValueError, match="wan_head_norm"):
        install_mhla(model, MHLAConfig(blocks=BLOCKS, wan_head_norm=True))
    install_mhla(model, MHLAConfig(blocks=(4, 2, 2)))
    with pytest.raises(ValueError, match=r"blocks \(4, 2, 2\) do not fit the token grid \(3, 3, 5\)"):
        model(**_inputs())
    attn = model.transformer_blocks[0].attn1
    with pytest.raises(ValueError, match="carries the token grid"):
        attn(torch.randn(1, 45, 24))


def test_save_load_round_trip(tmp_path):
    model = _model(MHLAConfig(blocks=BLOCKS, layers=[0], cpe_kernel=3, gate=True))
    inputs = _inputs()
    model.save_pretrained(tmp_path / "full")
    loaded = load_transformer(tmp_path / "full")
    assert loaded.mhla_config == model.mhla_config
    assert torch.equal(_run(loaded, inputs), _run(model, inputs))
    save_mhla_parameters(model, tmp_path / "mhla.safetensors")
    fresh = load_mhla_parameters(_model(), tmp_path / "mhla.safetensors")
    assert torch.equal(_run(fresh, inputs), _run(model, inputs))


def test_gradients_and_gradient_checkpointing():
    """Every MHLA parameter gets a gradient, and a checkpointed model (blocks recomputed in backward,
    the grid carried by the rotary argument) gives the same gradients."""
    model = _model(MHLAConfig(blocks=BLOCKS, cpe_kernel=3, gate=True)).train()
    inputs = _inputs()

    def grads(m):
        m.zero_grad(set_to_none=True)
        m(**inputs).sample.square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = grads(model)
    for name in mhla_parameters(model):
        assert name in plain and plain[name].abs().sum() > 0, name
    model.enable_gradient_checkpointing()
    checkpointed = grads(model)
    assert checkpointed.keys() == plain.keys()
    for name, g in plain.items():
        # the recompute runs the same operations on the same inputs in the same order: exact
        torch.testing.assert_close(checkpointed[name], g, rtol=0, atol=0)


def test_bf16_forward_is_finite_and_close():
    model = _model(MHLAConfig(blocks=BLOCKS, cpe_kernel=3, gate=True))
    full = _run(model, _inputs())
    half = _run(model.to(torch.bfloat16), _inputs(dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), full, rtol=0.1, atol=0.1)


def test_compiles_to_one_graph_without_breaks_and_matches_eager():
    counts = {}
    for mhla in (False, True):
        model = _model(MHLAConfig(blocks=BLOCKS, cpe_kernel=3, gate=True) if mhla else None)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(**_inputs())
        counts[mhla] = (explained.graph_count, explained.graph_break_count)
    assert counts[True] == counts[False] == (1, 0), counts
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    inputs = _inputs()
    out, expected = compiled(**inputs).sample, model(**inputs).sample
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    mixing = model.transformer_blocks[0].attn1.processor.mixing.weight
    (g_compiled,) = torch.autograd.grad(out.square().sum(), mixing)
    (g_eager,) = torch.autograd.grad(expected.square().sum(), mixing)
    torch.testing.assert_close(g_compiled, g_eager, rtol=1e-4, atol=1e-6)


def test_torch_export_matches_eager():
    """``torch.export`` (diffusers' export / AOT path): the numerator and the normaliser are one opaque
    op node each per MHLA layer, and the exported program matches eager."""
    model = _model(MHLAConfig(blocks=BLOCKS, cpe_kernel=3, gate=True))
    inputs = _inputs()
    program = torch.export.export(model, (), inputs)
    with torch.no_grad():
        exported = program.module()(**inputs)[0]
    # program.module() runs the same ATen ops as eager, in the same order: exact
    torch.testing.assert_close(exported, _run(model, inputs), rtol=0, atol=0)
    graph = program.run_decompositions().graph
    nodes = [n for n in graph.nodes if n.target is torch.ops.mhla_gen.mhla.default]
    assert len(nodes) == 2 * len(model.transformer_blocks)


@pytest.mark.parametrize("mode", OFFLOAD_MODES)
def test_offloading_is_exact(mode, tmp_path):
    """accelerate's cpu_offload (weights on meta between calls) and diffusers' group offloading to disk
    (weights replaced by empty tensors between calls): MHLA parameters are read through module calls."""
    model = _model(MHLAConfig(blocks=BLOCKS, cpe_kernel=3, gate=True))
    inputs = _inputs()
    reference = _run(model, inputs)
    offload(model, mode, tmp_path)
    if mode == "cpu_offload":
        assert next(iter(mhla_processors(model).values())).mixing.weight.device.type == "meta"
    assert torch.equal(_run(model, inputs), reference)
    assert torch.equal(_run(model, inputs), reference)


def test_pipeline_samples_with_mhla_from_a_saved_folder(tmp_path):
    """A SanaVideoPipeline saved with MHLA loads back through load_sana_video_pipeline and samples; the
    stock pipeline with uniform mixing at eps / M gives the stock video."""
    from mhla_gen.pipelines.sana_video import load_sana_video_pipeline

    def sample(pipe):
        return pipe(
            "a red cat",
            negative_prompt="blue",
            height=32,
            width=64,
            frames=5,  # token grid (2, 2, 4)
            num_inference_steps=2,
            guidance_scale=2.0,
            max_sequence_length=8,
            output_type="np",
            use_resolution_binning=False,
            complex_human_instruction=None,
            generator=torch.Generator().manual_seed(0),
        ).frames[0]

    pipe = tiny_sana_video_pipeline(_model())
    stock = sample(pipe)
    install_mhla(
        pipe.transformer, MHLAConfig(blocks=(2, 2, 2), mixing_init="uniform", eps=SANA_VIDEO_EPS / 8)
    )
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = load_sana_video_pipeline(tmp_path / "pipe", torch_dtype=torch.float32)
    assert isinstance(loaded.transformer.transformer_blocks[0].attn1.processor, SanaVideoMHLAProcessor)
    video = sample(loaded)
    assert video.shape == (5, 32, 64, 3) and 0 <= video.min() and video.max() <= 1
    torch.testing.assert_close(torch.from_numpy(video), torch.from_numpy(stock), rtol=0, atol=1e-4)
    other = MHLAConfig(blocks=(1, 1, 1))
    with pytest.raises(ValueError, match="refusing to replace its trained MHLA"):
        load_sana_video_pipeline(tmp_path / "pipe", mhla=other, torch_dtype=torch.float32)



@pytest.mark.gpu  # skipped without CUDA by conftest
def test_cuda_exact_start_and_bf16(monkeypatch):
    """On CUDA (the op's Triton kernels for the identity feature map), fp32 with TF32 off in matmuls and in
    cuDNN's convolutions (on by default there: the patch embedding and the feed-forward are convolutions):
    the uniform start equals the stock model on the same device (8 ulps, as on the CPU); bf16 stays
    within bf16 round-off of fp32 on the CPU."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _model().cuda()
    inputs = _inputs()
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    stock = _run(model, cuda_inputs).cpu()
    install_mhla(model, MHLAConfig(blocks=BLOCKS, mixing_init="uniform", eps=SANA_VIDEO_EPS / M))
    out = _run(model, cuda_inputs).cpu()
    ulp = float(torch.finfo(torch.float32).eps * 2 ** stock.abs().max().log2().floor())
    torch.testing.assert_close(out, stock, rtol=0, atol=8 * ulp)
    _perturb_mhla_(model)
    reference = _run(model.cpu(), inputs)
    half_inputs = {k: v.cuda().to(torch.bfloat16) if k != "timestep" else v.cuda() for k, v in inputs.items()}
    half = _run(model.cuda().to(torch.bfloat16), half_inputs)
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float().cpu(), reference, rtol=0.1, atol=0.1)


def test_record_sampler_samples_the_tiny_pipeline(tmp_path):
    """The base record's sampler (what scripts/sample.py and eval/generate.py call): load, size, sample."""
    from mhla_gen.bases import base_for
    from mhla_gen.errors import ConfigError
    from mhla_gen.pipelines import SampleSettings

    tiny_sana_video_pipeline(_model(MHLAConfig(blocks=(1, 2, 2)))).save_pretrained(tmp_path / "pipe")
    sampler = base_for("sana-video").sampler.load()
    pipe = sampler.load(tmp_path / "pipe", None, torch.float32, None, None)
    assert isinstance(pipe.transformer.transformer_blocks[0].attn1.processor, SanaVideoMHLAProcessor)
    with pytest.raises(ConfigError, match="--height 48 is not a multiple of 32"):
        sampler.fit_size(pipe, SampleSettings(height=48, width=64))
    settings = sampler.fit_size(pipe, SampleSettings(steps=2, height=32, width=64, frames=5, output_type="np",
                                                     max_sequence_length=8,
                                                     extra={"complex_human_instruction": None}))
    frames = sampler.sample(pipe, ["a cat runs"], torch.Generator().manual_seed(0), settings)
    assert frames.shape == (1, 5, 32, 64, 3)
