"""MHLA in diffusers' WanTransformer3DModel: processor math, install/uninstall, save/load, pipeline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from diffusers.utils import export_to_video

from mhla_gen.integration.install import install_mhla, mhla_processors, uninstall_mhla
from mhla_gen.integration.loading import load_transformer
from mhla_gen.ops.layout import BlockLayout
from mhla_gen.processors.config import MHLAConfig
from mhla_gen.processors.wan import WanMHLAProcessor, wan_token_grid
from mhla_gen.testing.wan import TEXT_DIM, tiny_wan_pipeline, tiny_wan_transformer

GRID, BLOCKS = (3, 3, 5), (2, 2, 3)  # every axis splits unevenly
LATENT_SHAPE = (2, 16, 3, 6, 10)  # (B, C, F, H, W) with patch (1, 2, 2) -> token grid (3, 3, 5)


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(LATENT_SHAPE, generator=g).to(dtype)
    text = torch.randn(LATENT_SHAPE[0], 7, TEXT_DIM, generator=g).to(dtype)
    return latent, torch.tensor([300, 700]), text


def _randomize_mhla_(model, seed=1):
    """Move MHLA parameters away from their identity-like inits so every term is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for proc in mhla_processors(model).values():
            for p in proc.parameters():
                p.copy_(
                    torch.rand(p.shape, generator=g) * 0.5 + 0.1
                    if p.dim() == 2
                    else torch.randn(p.shape, generator=g)
                )


def _rotate(x, cos, sin):
    """Reference RoPE with complex numbers: pairs (2i, 2i+1) are one complex coordinate. x (B, H, N, d)."""
    rotation = torch.complex(cos[..., 0::2], sin[..., 1::2]).transpose(1, 2)  # e^{iθ}: (1, 1, N, d / 2)
    return torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * rotation
    ).flatten(-2)


def _reference_self_attention(attn, proc: WanMHLAProcessor, x, rotary, grid):
    """Dense MHLA of one Wan self-attention layer, written from the formulas (float64 in, float64 out)."""
    cfg = proc.cfg
    heads = attn.heads
    q = attn.norm_q(attn.to_q(x)).unflatten(-1, (heads, -1)).transpose(1, 2)  # (B, H, N, d)
    k = attn.norm_k(attn.to_k(x)).unflatten(-1, (heads, -1)).transpose(1, 2)
    v_merged = attn.to_v(x)
    v = v_merged.unflatten(-1, (heads, -1)).transpose(1, 2)
    cos, sin = (r.double() for r in rotary)
    layout = BlockLayout(grid, cfg.blocks)
    blocks = layout.block_index
    w = proc.mixing.weight[blocks][:, blocks]  # W[b(t), b(s)]: (N, N)
    if cfg.wan_rope == "before_phi":
        fq, fk = F.relu(_rotate(q, cos, sin)), F.relu(_rotate(k, cos, sin))
        scores_num = scores_den = w * (fq @ fk.transpose(-1, -2))
    else:
        fq, fk = F.relu(q), F.relu(k)
        scores_num = w * (_rotate(fq, cos, sin) @ _rotate(fk, cos, sin).transpose(-1, -2))
        scores_den = w * (fq @ fk.transpose(-1, -2))
    out = scores_num @ v
    if cfg.normalize:
        out = out / (scores_den.sum(-1, keepdim=True) + cfg.eps)
    if cfg.wan_head_norm:
        out = (
            out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + proc.head_norm.eps) * proc.head_norm.weight
        )
    out = out.transpose(1, 2).flatten(2)  # (B, N, H * d)
    if cfg.cpe_kernel:
        b, n, c = v_merged.shape
        out = out + proc.cpe.conv(v_merged.transpose(1, 2).reshape(b, c, *grid)).reshape(b, c, n).transpose(
            1, 2
        )
    if cfg.gate:
        out = out * torch.sigmoid(proc.gate.proj(x))
    return attn.to_out[0](out)


@pytest.mark.parametrize("wan_rope", ["before_phi", "after_phi_numerator"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("head_norm", [True, False])
def test_processor_matches_dense_reference(wan_rope, normalize, head_norm):
    model = tiny_wan_transformer().double()
    cfg = MHLAConfig(
        blocks=BLOCKS,
        wan_rope=wan_rope,
        normalize=normalize,
        wan_head_norm=head_norm,
        cpe_kernel=3,
        gate=True,
    )
    install_mhla(model, cfg)
    _randomize_mhla_(model)
    latent, _, _ = _inputs(dtype=torch.float64)
    rotary = model.rope(latent)  # carries the token grid (install_mhla hooks the rope)
    assert rotary.grid == wan_token_grid(model, latent)
    attn = model.blocks[0].attn1
    x = torch.randn(latent.shape[0], 45, attn.to_q.in_features, dtype=torch.float64)
    out = attn(x, None, None, rotary)
    expected = _reference_self_attention(attn, attn.processor, x, rotary, GRID)
    # float64 against a float64 re-implementation: other summation orders over 45 tokens and d channels
    # differ by a few hundred eps64 (2.2e-16) x the sums' magnitudes; 1e-9 is 1e4 x that, and far below
    # any difference in the function (a wrong block, RoPE or norm changes O(1e-2) of the output)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_release_preset_runs_in_bf16():
    model = tiny_wan_transformer()
    # the release's hybrid pattern (softmax where i % 3 == 0) on the tiny model's 3 layers
    install_mhla(model, MHLAConfig.preset("wan-release", blocks=BLOCKS, layers=[1, 2]))
    _randomize_mhla_(model)
    latent, t, text = _inputs()
    with torch.no_grad():
        full = model(latent, t, text).sample
        half = model.to(torch.bfloat16)(latent.bfloat16(), t, text.bfloat16()).sample
    assert full.shape == latent.shape and half.dtype == torch.bfloat16
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), full, rtol=0.1, atol=0.1)


def test_token_grid_any_size_and_clear_error_when_blocks_do_not_fit():
    model = tiny_wan_transformer(rope_max_seq_len=64)
    assert wan_token_grid(model, torch.zeros(1, 16, 21, 60, 104)) == (21, 30, 52)  # the paper's 480x832
    assert wan_token_grid(model, torch.zeros(1, 16, 3, 7, 11)) == (3, 3, 5)  # floored like the patch conv
    install_mhla(model, MHLAConfig(blocks=(4, 2, 2)))
    latent, t, text = _inputs()
    with pytest.raises(ValueError, match=r"blocks \(4, 2, 2\) do not fit the token grid \(3, 3, 5\)"):
        model(latent, t, text)
    with pytest.raises(ValueError, match="5D|frames"):
        wan_token_grid(model, torch.zeros(1, 16, 6, 10))
    with pytest.raises(ValueError, match="3D token grid"):
        install_mhla(model, MHLAConfig(blocks=(2, 2)))


def test_cross_attention_untouched_and_hybrid_layers():
    model = tiny_wan_transformer()
    cfg = MHLAConfig(
        blocks=BLOCKS, layers=[i for i in range(3) if i % 3 != 0]
    )  # release hybrid: layer 0 softmax
    x = torch.randn(1, 45, 24)
    context = torch.randn(1, 7, 24)
    with torch.no_grad():
        before = [block.attn2(x, context) for block in model.blocks]
    install_mhla(model, cfg)
    with torch.no_grad():
        after = [block.attn2(x, context) for block in model.blocks]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(type(block.attn2.processor) is WanAttnProcessor for block in model.blocks)
    kinds = [type(block.attn1.processor) for block in model.blocks]
    assert kinds == [WanAttnProcessor, WanMHLAProcessor, WanMHLAProcessor]


def test_i2v_model_runs_with_image_context():
    model = tiny_wan_transformer(image_dim=8, added_kv_proj_dim=24)
    install_mhla(model, MHLAConfig(blocks=BLOCKS))
    latent, t, _ = _inputs()
    text = torch.randn(2, 512, TEXT_DIM)  # diffusers' I2V cross-attention assumes 512 text tokens
    with torch.no_grad():
        out = model(latent, t, text, encoder_hidden_states_image=torch.randn(2, 5, 8)).sample
    assert out.shape == latent.shape and torch.isfinite(out).all()


def test_gradients_reach_every_mhla_parameter():
    model = tiny_wan_transformer()
    install_mhla(model, MHLAConfig.preset("wan-release", blocks=BLOCKS, layers=None, cpe_kernel=3, gate=True))
    latent, t, text = _inputs()
    model(latent, t, text).sample.square().mean().backward()
    proc = model.blocks[1].attn1.processor
    for name, param in (
        ("mixing", proc.mixing.weight),
        ("cpe", proc.cpe.conv.weight),
        ("gate", proc.gate.proj.weight),
        ("head_norm", proc.head_norm.weight),
    ):
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert model.blocks[1].attn1.to_q.weight.grad.abs().sum() > 0


def test_uninstall_is_bit_exact():
    model = tiny_wan_transformer()
    latent, t, text = _inputs()
    with torch.no_grad():
        stock = model(latent, t, text).sample
        install_mhla(model, MHLAConfig(blocks=BLOCKS, wan_head_norm=True))
        assert not torch.equal(model(latent, t, text).sample, stock)
        uninstall_mhla(model)
        assert torch.equal(model(latent, t, text).sample, stock)


def test_save_load_round_trip(tmp_path):
    model = tiny_wan_transformer()
    install_mhla(model, MHLAConfig.preset("wan-release", blocks=BLOCKS, layers=[1, 2], cpe_kernel=3))
    _randomize_mhla_(model)
    model.save_pretrained(tmp_path)
    loaded = load_transformer(tmp_path)
    assert loaded.mhla_config == model.mhla_config
    latent, t, text = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(latent, t, text).sample, model(latent, t, text).sample)


def test_grid_carrying_rotary_embedding_is_required():
    proc = WanMHLAProcessor(MHLAConfig(blocks=BLOCKS), inner_dim=24, in_dim=24, heads=2)
    attn = tiny_wan_transformer().blocks[0].attn1
    plain_rotary = attn.processor  # any non-GridRotaryEmb
    with pytest.raises(ValueError, match="carries the token grid"):
        proc(attn, torch.randn(1, 45, 24), rotary_emb=None)
    with pytest.raises(ValueError, match="carries the token grid"):
        proc(attn, torch.randn(1, 45, 24), rotary_emb=(plain_rotary, plain_rotary))
    with pytest.raises(ValueError, match="self-attention only"):
        proc(attn, torch.randn(1, 45, 24), torch.randn(1, 3, 24))


def test_pipeline_generates_video_end_to_end(tmp_path):
    from mhla_gen.pipelines.wan import load_wan_pipeline

    pipe = tiny_wan_pipeline()
    install_mhla(pipe.transformer, MHLAConfig(blocks=(2, 2, 2)))
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = load_wan_pipeline(tmp_path / "pipe", torch_dtype=torch.float32)
    assert isinstance(pipe.transformer.blocks[0].attn1.processor, WanMHLAProcessor)
    video = pipe(
        "a red car on the moon",
        negative_prompt="blue",
        height=48,
        width=64,
        num_frames=5,  # grid (2, 3, 4)
        num_inference_steps=2,
        guidance_scale=2.0,
        max_sequence_length=16,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames[0]
    assert video.shape == (5, 48, 64, 3) and video.min() >= 0 and video.max() <= 1
    path = export_to_video(list(video), str(tmp_path / "tiny.mp4"), fps=8)
    assert (tmp_path / "tiny.mp4").stat().st_size > 0 and path.endswith(".mp4")


@pytest.mark.gpu  # skipped without CUDA by conftest
def test_release_preset_bf16_on_cuda_close_to_fp32_cpu():
    model = tiny_wan_transformer()
    install_mhla(model, MHLAConfig.preset("wan-release", blocks=BLOCKS, layers=None))
    _randomize_mhla_(model)
    latent, t, text = _inputs()
    with torch.no_grad():
        expected = model(latent, t, text).sample
        model = model.to("cuda", torch.bfloat16)
        out = model(latent.cuda().bfloat16(), t.cuda(), text.cuda().bfloat16()).sample
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), expected, rtol=0.1, atol=0.1)
