"""Block-causal softmax with a KV cache (``ops/kv_cache.py``, ``processors/wan_softmax.py``): the op against
the dense masked reference (forward and backward), the cache's rollout, the Wan layer against diffusers'
``WanAttnProcessor`` and the formulas, a streamed model (softmax throughout, and a hybrid) equal to its
whole-video forward, save / load of the setting, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from stream_helpers import assert_later_frames_leave_earlier_outputs, rollout

from mhla_gen import MHLAConfig, load_transformer, uninstall_mhla
from mhla_gen.integration.streaming import WanStreamCache, stream_step
from mhla_gen.models import MHLAWanTransformer3DModel
from mhla_gen.ops.kv_cache import KVStreamCache, block_causal_softmax
from mhla_gen.ops.rope import apply_wan_rotary
from mhla_gen.ops.streaming_naive import block_causal_softmax_dense
from mhla_gen.processors.wan_softmax import WanBlockCausalSoftmaxProcessor
from mhla_gen.testing.wan import tiny_wan_inputs, tiny_wan_mhla, tiny_wan_transformer
from mhla_gen.train.attention import attention_mhla_config

LATENT = (2, 16, 4, 6, 10)  # (B, C, F, H, W), patch (1, 2, 2) -> token grid (4, 3, 5): 15 tokens a frame
GRID = (4, 3, 5)
SOFTMAX = MHLAConfig(blocks=(1, 2, 2), chunk_frames=1, layers=[])


def _qkv(batch=2, heads=3, tokens=12, d=5, e=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, tokens, d, generator=g).to(dtype) for _ in range(2))
    return q, k, torch.randn(batch, heads, tokens, e, generator=g).to(dtype)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 4, 12])  # one token a chunk ... one chunk (bidirectional)
def test_block_causal_softmax_matches_the_masked_dense_reference(chunk_tokens):
    """float64, softmax over at most 12 keys: ~1e-15 of the terms either way; a chunk seeing one chunk too
    many or too few changes the output by O(0.1)."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    got = block_causal_softmax(q, k, v, chunk_tokens)
    want = block_causal_softmax_dense(q, k, v, chunk_tokens)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_kv_cache_rolls_out_the_whole_sequence_and_grows_by_a_chunk():
    q, k, v = _qkv(tokens=12)
    whole = block_causal_softmax(q, k, v, 4)
    cache = KVStreamCache.empty(2, 3, 5, 7, 4, dtype=torch.float64)
    outs, sizes, first = [], [], None
    for qc, kc, vc in zip(q.split(4, 2), k.split(4, 2), v.split(4, 2)):
        out, after = cache.step(qc, kc, vc)
        first = first or after
        outs.append(out)
        sizes.append(after.nbytes)
        cache = after
    torch.testing.assert_close(torch.cat(outs, 2), whole, rtol=1e-12, atol=1e-12)
    assert sizes == [2 * 3 * 4 * (5 + 7) * 8 * (c + 1) for c in range(3)] and cache.chunks_done == 3
    assert first.keys.shape[2] == 4  # the step made a new cache; the one it started from is unchanged
    with pytest.raises(ValueError, match=r"KV cache made for q of shape \(2, 3, 4, 5\)"):
        cache.step(q[:, :, :3], k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="holds torch.float64 keys and values, got q in torch.float32"):
        cache.step(*(t[:, :, :4].float() for t in (q, k, v)))
    with pytest.raises(ValueError, match="chunks of 5 tokens do not tile a sequence of 12 tokens"):
        block_causal_softmax(q, k, v, 5)


def _model(cfg, dtype=torch.float64):
    return tiny_wan_mhla(cfg, dtype)  # MHLA layers away from their inits (every block pair and decay matters)


def _inputs(dtype=torch.float64, seed=0):
    return tiny_wan_inputs(LATENT, dtype, seed)


def test_one_chunk_of_the_whole_video_is_diffusers_wan_attention():
    """chunk_frames = F: one chunk, every token sees every token: the stock processor's numbers (float64;
    the two differ in the attention kernel's summation order only)."""
    model = _model(MHLAConfig(blocks=(1, 2, 2), chunk_frames=4, layers=[]))
    latent, _ = _inputs()
    rotary, attn = model.rope(latent), model.blocks[1].attn1
    assert isinstance(attn.processor, WanBlockCausalSoftmaxProcessor)
    x = torch.randn(LATENT[0], 60, attn.to_q.in_features, dtype=torch.float64)
    stock = WanAttnProcessor()(attn, x, None, None, tuple(rotary))
    torch.testing.assert_close(attn(x, None, None, rotary), stock, rtol=1e-12, atol=1e-12)


def test_a_softmax_layer_matches_the_block_causal_formula():
    """Chunks of one frame: RoPE, the dense masked softmax, to_out, in float64. A wrong mask (one frame late)
    or no RoPE moves the output by O(1e-2)."""
    model = _model(SOFTMAX)
    latent, _ = _inputs()
    rotary, attn = model.rope(latent), model.blocks[2].attn1
    x = torch.randn(LATENT[0], 60, attn.to_q.in_features, dtype=torch.float64)
    q, k, v = (norm(lin(x)).unflatten(-1, (attn.heads, -1)).transpose(1, 2) for lin, norm in
               ((attn.to_q, attn.norm_q), (attn.to_k, attn.norm_k), (attn.to_v, torch.nn.Identity())))
    q, k = apply_wan_rotary(q, *rotary), apply_wan_rotary(k, *rotary)
    want = attn.to_out[0](block_causal_softmax_dense(q, k, v, 15).transpose(1, 2).flatten(2))
    torch.testing.assert_close(attn(x, None, None, rotary), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layers, chunk", [([], 1), ([], 2), ([1], 1)])  # softmax throughout; a hybrid
def test_chunk_by_chunk_rollout_equals_the_whole_video_forward(layers, chunk):
    """Each chunk at its own timestep (per token for the whole video). As the MHLA rollout test: diffusers'
    Wan blocks round to fp32 in their norms, ~1e-7 relative per cast, so 1e-6; a missing past chunk, a stale
    cache or a wrong RoPE offset moves the output by O(1e-2). The KV caches grow by a chunk per chunk, the
    hybrid's factorised MHLA layer stays flat."""
    cfg = MHLAConfig(blocks=(1, 2, 2), chunk_frames=chunk, layers=layers, stream_mixing="factorised")
    model = _model(cfg)
    latent, text = _inputs()
    chunks = GRID[0] // chunk
    timesteps = torch.rand(LATENT[0], chunks, dtype=torch.float64) * 1000
    per_token = timesteps.repeat_interleave(chunk * GRID[1] * GRID[2], dim=1)
    with torch.no_grad():
        whole = model(latent, per_token, text).sample
        streamed, sizes = rollout(model, latent, text, timesteps, chunk,
                                  lambda cache: {i: layer.nbytes for i, layer in cache.layers.items()})
    torch.testing.assert_close(streamed, whole, rtol=1e-6, atol=1e-6)
    kv = 2 * 2 * chunk * 15 * (12 + 12) * 8  # batch 2, 2 heads of 12, keys and values, float64
    for layer in range(3):
        grows = [s[layer] for s in sizes]
        assert grows == ([grows[0]] * chunks if layer in layers else [kv * (c + 1) for c in range(chunks)])


def test_later_chunks_do_not_change_earlier_outputs():
    model = _model(SOFTMAX)
    assert_later_frames_leave_earlier_outputs(model, *_inputs())


def test_save_and_load_keep_block_causal_softmax_and_uninstall_restores_stock(tmp_path):
    model = _model(SOFTMAX, dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())["mhla"]
    assert (recorded["layers"], recorded["chunk_frames"]) == ([], 1)
    latent, text = _inputs(torch.float32)
    t = torch.tensor([300.0, 700.0])
    folder = tmp_path / "m"
    for loaded in (load_transformer(folder), MHLAWanTransformer3DModel.from_pretrained(folder)):
        assert loaded.mhla_config == SOFTMAX
        assert all(isinstance(b.attn1.processor, WanBlockCausalSoftmaxProcessor) for b in loaded.blocks)
        with torch.no_grad():
            assert torch.equal(loaded(latent, t, text).sample, model(latent, t, text).sample)
    uninstall_mhla(model)
    with torch.no_grad():
        assert torch.equal(model(latent, t, text).sample, tiny_wan_transformer()(latent, t, text).sample)


def test_the_training_settings_say_softmax_block_causal():
    chunked = MHLAConfig(blocks=(1, 2, 2), chunk_frames=2)
    softmax = MHLAConfig(blocks=(1, 2, 2), chunk_frames=2, layers=[])
    assert attention_mhla_config("softmax", chunked) == softmax
    assert attention_mhla_config("softmax", MHLAConfig(blocks=(1, 2, 2))) is None  # bidirectional: stock


def test_a_block_causal_model_refuses_other_self_attention_processors():
    model = _model(SOFTMAX, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"blocks.0.attn1.processor: a block-causal model \(chunk_frames=1\) "
                                         "keeps its self-attention processors"):
        model.set_attn_processor(WanAttnProcessor())
    assert all(isinstance(b.attn1.processor, WanBlockCausalSoftmaxProcessor) for b in model.blocks)
    model.blocks[0].attn1.set_processor(WanAttnProcessor())  # behind install_mhla's back: not saved
    with pytest.raises(ValueError, match=r"save_pretrained refused: self-attention layers \[0\]"):
        model.save_pretrained("unused")


def test_the_stream_refuses_chunks_that_do_not_fit():
    model = _model(MHLAConfig(blocks=(1, 2, 2), chunk_frames=3, layers=[]), dtype=torch.float32)
    latent, text = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"chunk_frames=3 does not divide the 4 latent frames"):
        model(latent, torch.tensor([500.0, 500.0]), text)
    with pytest.raises(ValueError, match=r"frames=0: a streamed video has at least one latent frame"):
        WanStreamCache.empty(model, 2, (6, 10), frames=0)
    cache = WanStreamCache.empty(model, 2, (6, 10))  # any length: no frames needed
    with pytest.raises(ValueError, match=r"a chunk of this stream is \(batch=2, channels, chunk_frames=3"):
        stream_step(model, cache, latent[:, :, :2], torch.zeros(2), text)
