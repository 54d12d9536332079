"""Block-causal (streaming) MHLA in Wan: the settings, each layer against the dense float64 oracle, RoPE at a
chunk's absolute frames, a chunk-by-chunk rollout equal to one forward of the whole video for both memories,
what the stream refuses, and save / load of the streaming settings."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from stream_helpers import assert_later_frames_leave_earlier_outputs, rollout

from mhla_gen import MHLAConfig, install_mhla, load_transformer
from mhla_gen.integration.streaming import WanStreamCache, stream_step
from mhla_gen.models import MHLAWanTransformer3DModel
from mhla_gen.ops.layout import BlockLayout
from mhla_gen.ops.streaming_naive import block_causal_dense, factorised_dense
from mhla_gen.processors.grid import rotary_at_frames
from mhla_gen.testing.wan import tiny_wan_inputs, tiny_wan_mhla, tiny_wan_transformer

LATENT = (2, 16, 4, 6, 10)  # (B, C, F, H, W), patch (1, 2, 2) -> token grid (4, 3, 5): uneven in H and W
GRID = (4, 3, 5)
# (mixing, blocks, chunk_frames): general blocks cut the video, factorised blocks one chunk
CASES = [
    ("general", (4, 2, 3), 1),
    ("general", (2, 2, 2), 2),
    ("factorised", (1, 2, 3), 1),
    ("factorised", (2, 2, 2), 2),  # two time blocks per chunk
]


def _model(mixing, blocks, chunk, dtype=torch.float64, **overrides):
    cfg = MHLAConfig(blocks=blocks, chunk_frames=chunk, stream_mixing=mixing, **overrides)
    return tiny_wan_mhla(cfg, dtype)  # away from the inits: every block pair and every head's decay matters


def _inputs(dtype=torch.float64, seed=0):
    return tiny_wan_inputs(LATENT, dtype, seed)


def _rotate(x, cos, sin):
    """RoPE with complex numbers: pairs (2i, 2i+1) are one complex coordinate. x (B, H, N, d)."""
    rotation = torch.complex(cos[..., 0::2], sin[..., 1::2]).transpose(1, 2)  # (1, 1, N, d / 2)
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2)


def _reference_layer(attn, x, rotary, grid):
    """One block-causal Wan self-attention layer from the formulas (float64): RoPE, then the dense oracle
    with W (general, masked by the oracle) or W_s · γ^lag (factorised), head norm, gate, output."""
    proc, cfg, heads = attn.processor, attn.processor.cfg, attn.heads
    q, k, v = (norm(lin(x)).unflatten(-1, (heads, -1)).transpose(1, 2) for lin, norm in
               ((attn.to_q, attn.norm_q), (attn.to_k, attn.norm_k), (attn.to_v, torch.nn.Identity())))
    cos, sin = (r.double() for r in rotary)
    chunk = cfg.chunk_frames
    if cfg.stream_mixing == "factorised":
        layout = BlockLayout(grid, (grid[0] // chunk * cfg.blocks[0], *cfg.blocks[1:]))
        mixing = factorised_dense(layout, chunk, *proc.mixing())  # (H, M, M)
    else:
        layout, mixing = BlockLayout(grid, cfg.blocks), proc.mixing.weight
    out = block_causal_dense(_rotate(q, cos, sin), _rotate(k, cos, sin), v, layout, chunk, mixing,
                             normalize=cfg.normalize, eps=cfg.eps)
    if cfg.wan_head_norm:
        rms = torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + proc.head_norm.eps)
        out = out * rms * proc.head_norm.weight
    out = out.transpose(1, 2).flatten(2)
    if cfg.gate:
        out = out * torch.sigmoid(proc.gate.proj(x))
    return attn.to_out[0](out)


@pytest.mark.parametrize("mixing, blocks, chunk", CASES)
@pytest.mark.parametrize("normalize, head_norm", [(True, False), (False, True)])
def test_layer_matches_the_dense_block_causal_oracle(mixing, blocks, chunk, normalize, head_norm):
    model = _model(mixing, blocks, chunk, normalize=normalize, wan_head_norm=head_norm, gate=True)
    latent, _ = _inputs()
    rotary = model.rope(latent)
    attn = model.blocks[1].attn1
    x = torch.randn(LATENT[0], 60, attn.to_q.in_features, dtype=torch.float64)
    # float64 both ways, other summation orders over 60 tokens: ~1e-14 of the terms; a wrong mask, block,
    # decay power or RoPE angle changes O(1e-2) of the output
    torch.testing.assert_close(attn(x, None, None, rotary), _reference_layer(attn, x, rotary, GRID),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mixing, blocks, chunk", CASES)
def test_chunk_by_chunk_rollout_equals_the_whole_video_forward(mixing, blocks, chunk):
    """Each chunk at its own timestep: the whole video gets them per token ``(B, N)``, the stream one per
    chunk. diffusers' Wan blocks round to fp32 in their norms even in a float64 model, so the two paths,
    ~1e-15 apart before, can round apart at those casts: ~1e-7 relative each; 1e-6 allows a few. A wrong
    RoPE offset, a missing past chunk or a stale cache moves the output by O(1e-2)."""
    model = _model(mixing, blocks, chunk)
    latent, text = _inputs()
    chunks = GRID[0] // chunk
    timesteps = torch.rand(LATENT[0], chunks, dtype=torch.float64) * 1000
    per_token = timesteps.repeat_interleave(chunk * GRID[1] * GRID[2], dim=1)  # (B, N) in (f h w) order
    with torch.no_grad():
        whole = model(latent, per_token, text).sample
        streamed, sizes = rollout(model, latent, text, timesteps, chunk, lambda cache: cache.nbytes, GRID[0])
    torch.testing.assert_close(streamed, whole, rtol=1e-6, atol=1e-6)
    if mixing == "factorised":
        assert len(set(sizes)) == 1  # one state per block of a chunk, whatever the length
    else:
        assert sizes == [sizes[0] * (c + 1) for c in range(chunks)]  # every past block's summary


def test_later_chunks_do_not_change_earlier_outputs():
    model = _model("factorised", (1, 2, 3), 1)
    assert_later_frames_leave_earlier_outputs(model, *_inputs())


def test_a_chunk_gets_the_rotary_angles_of_its_absolute_frames():
    short, long = tiny_wan_transformer(rope_max_seq_len=8), tiny_wan_transformer(rope_max_seq_len=64)
    hw = GRID[1] * GRID[2]
    whole = long.rope(torch.zeros(1, 16, 40, 6, 10))  # frames 0..39
    for offset in (0, 3, 30):  # 30: past the short model's table of 8 frames
        chunk = short.rope(torch.zeros(1, 16, 2, 6, 10))  # frames 0, 1
        moved = rotary_at_frames(short.rope, chunk, (2, *GRID[1:]), offset)
        for got, want in zip(moved, whole):
            assert torch.equal(got, want[:, offset * hw : (offset + 2) * hw])


def test_gradients_reach_the_factorised_mixing_and_decay():
    model = _model("factorised", (1, 2, 3), 1, dtype=torch.float32)
    latent, text = _inputs(torch.float32)
    per_token = torch.rand(2, 60) * 1000  # diffusion forcing: a timestep per token
    model(latent, per_token, text).sample.square().mean().backward()
    mixing = model.blocks[0].attn1.processor.mixing
    assert mixing.spatial_raw.grad.abs().sum() > 0 and mixing.decay_logit.grad.abs().sum() > 0


@pytest.mark.parametrize("settings, message", [
    (dict(chunk_frames=0), "chunk_frames must be a positive int"),
    (dict(stream_mixing="factorised"), "needs chunk_frames"),
    (dict(chunk_frames=1, stream_mixing="window"), "stream_mixing must be one of"),
    (dict(chunk_frames=3, stream_mixing="factorised", blocks=(2, 2, 2)), r"blocks\[0\]=2 must divide"),
    (dict(chunk_frames=1, cpe_kernel=3), "cpe_kernel=3 with chunk_frames=1"),
    (dict(chunk_frames=1, wan_rope="after_phi_numerator"), "built for wan_rope=before_phi"),
    (dict(chunk_frames=1, blocks=(2, 2)), r"needs video blocks \(bf, bh, bw\)"),
])
def test_bad_streaming_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        MHLAConfig(**{"blocks": (1, 2, 2), **settings})


def test_models_that_cannot_stream_are_refused_before_install():
    from mhla_gen.testing.video import tiny_sana_video

    cfg = MHLAConfig(blocks=(1, 2, 2), chunk_frames=1)
    with pytest.raises(ValueError, match="temporal patch of 1"):
        install_mhla(tiny_wan_transformer(patch_size=(2, 2, 2)), cfg)
    with pytest.raises(ValueError, match="built for Wan only, not for sana-video"):
        install_mhla(tiny_sana_video(), cfg)


def test_latents_the_chunks_do_not_fit_are_refused_before_the_forward():
    latent, text = _inputs(torch.float32)
    t = torch.tensor([500.0, 500.0])
    with pytest.raises(ValueError, match=r"chunk_frames=3 does not divide the 4 latent frames"):
        _model("factorised", (1, 2, 3), 3, dtype=torch.float32)(latent, t, text)
    with pytest.raises(ValueError, match=r"time block 0 .* across a boundary of chunk_frames=1"):
        _model("general", (2, 2, 3), 1, dtype=torch.float32)(latent, t, text)


def test_the_stream_refuses_what_is_not_its_own():
    model = _model("general", (4, 2, 3), 1)
    latent, text = _inputs()
    t = torch.tensor([0.0, 0.0], dtype=torch.float64)
    cache = WanStreamCache.empty(model, 2, (6, 10), frames=4)
    bidirectional = tiny_wan_transformer().double()
    install_mhla(bidirectional, MHLAConfig(blocks=(4, 2, 3)))
    for other, message in ((tiny_wan_transformer(), "runs stock attention"),
                           (bidirectional, r"runs bidirectional MHLA \(blocks \[4, 2, 3\]\)")):
        with pytest.raises(ValueError, match=message):
            WanStreamCache.empty(other, 2, (6, 10), frames=4)
        with pytest.raises(ValueError, match=message):
            stream_step(other, cache, latent[:, :, :1], t, text)
    with pytest.raises(ValueError, match="made for another model"):
        stream_step(copy.deepcopy(model), cache, latent[:, :, :1], t, text)  # the same shapes and weights
    with pytest.raises(ValueError, match=r"a chunk of this stream is \(batch=2, channels, chunk_frames=1"):
        stream_step(model, cache, latent[:, :, :2], t, text)
    with pytest.raises(ValueError, match="needs that video's latent frames"):
        WanStreamCache.empty(model, 2, (6, 10))
    for part in latent.split(1, dim=2):
        _, cache = stream_step(model, cache, part, t, text)
    with pytest.raises(ValueError, match="holds all 4 latent frames of the video"):
        stream_step(model, cache, latent[:, :, :1], t, text)


@pytest.mark.parametrize("mixing, blocks, chunk", [CASES[0], CASES[2]])
def test_save_and_load_keep_the_streaming_settings(mixing, blocks, chunk, tmp_path):
    model = _model(mixing, blocks, chunk, dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())["mhla"]
    assert (recorded["chunk_frames"], recorded["stream_mixing"]) == (chunk, mixing)
    latent, text = _inputs(torch.float32)
    t = torch.tensor([300.0, 700.0])
    folder = tmp_path / "m"
    for loaded in (load_transformer(folder), MHLAWanTransformer3DModel.from_pretrained(folder)):
        assert loaded.mhla_config == model.mhla_config
        with torch.no_grad():
            assert torch.equal(loaded(latent, t, text).sample, model(latent, t, text).sample)


def test_bidirectional_records_are_unchanged_by_the_streaming_settings(tmp_path):
    cfg = MHLAConfig(blocks=(1, 2, 2))
    assert "chunk_frames" not in cfg.to_dict() and "stream_mixing" not in cfg.to_dict()
    assert MHLAConfig.from_dict(cfg.to_dict()) == cfg
    streaming = MHLAConfig(blocks=(1, 2, 2), chunk_frames=2, stream_mixing="factorised")
    assert MHLAConfig.from_dict(json.loads(json.dumps(streaming.to_dict()))) == streaming


def test_attention_statistics_refuse_a_block_causal_model():
    from mhla_gen.metrics.attention import attention_statistics

    model = _model("general", (4, 2, 3), 1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"built for bidirectional models; this one is block-causal"):
        attention_statistics(model, lambda: None)
