"""Recurrent decoding equals the chunkwise causal operator token by token."""

import pytest
import torch

from mhla_gen import BlockLayout, MHLADecodeState, mhla_attention, mhla_decode_step


def _decode_all(q, k, v, layout, mixing, token_axis=False, **kwargs):
    batch, heads, n, dim = q.shape
    state = MHLADecodeState.empty(layout, batch, heads, dim, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(n):
        if token_axis:  # (B, H, 1, d) form
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(mhla_decode_step(*step, state, layout, mixing, **kwargs)[:, :, 0])
        else:
            outs.append(mhla_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state, layout, mixing, **kwargs))
    return torch.stack(outs, dim=2), state


@pytest.mark.parametrize("n, chunks", [(23, 5), (16, 4), (9, 9), (7, 1)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature_map", ["relu", "elu+1"])
def test_decode_equals_chunkwise_causal(n, chunks, normalize, feature_map, make_qkv, random_mixing):
    layout = BlockLayout((n,), (chunks,))
    q, k, v = make_qkv(n, batch=2, heads=3, value_dim=5)
    mixing = random_mixing(layout, grad=False)
    kwargs = dict(feature_map=feature_map, normalize=normalize)
    expected = mhla_attention(q, k, v, layout, mixing, causal=True, **kwargs)
    got, state = _decode_all(q, k, v, layout, mixing, token_axis=n % 2 == 0, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    assert state.position == n


def test_decode_bf16_matches_chunkwise(make_qkv, random_mixing):
    layout = BlockLayout((29,), (6,))
    q, k, v = (t.bfloat16() for t in make_qkv(29, batch=2, heads=2, dim=8))
    mixing = random_mixing(layout, grad=False).float()
    got, state = _decode_all(q, k, v, layout, mixing)
    assert got.dtype == torch.bfloat16 and state.running_kv.dtype == torch.float32
    expected = mhla_attention(q, k, v, layout, mixing, causal=True)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_decode_past_the_end_raises(make_qkv):
    layout = BlockLayout((3,), (2,))
    q, k, v = make_qkv(3)
    _, state = _decode_all(q, k, v, layout, torch.eye(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="position 3"):
        mhla_decode_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state, layout, torch.eye(2, dtype=torch.float64))


def test_decode_rejects_2d_layouts_and_multi_token_steps(make_qkv):
    with pytest.raises(ValueError, match=r"\(4, 4\)"):
        MHLADecodeState.empty(BlockLayout((4, 4), (2, 2)), 1, 1, 4, 4)
    layout = BlockLayout((8,), (2,))
    state = MHLADecodeState.empty(layout, 2, 3, 4, 4, dtype=torch.float64)
    q, k, v = make_qkv(8)
    with pytest.raises(ValueError, match="8 tokens"):
        mhla_decode_step(q, k, v, state, layout, torch.eye(2, dtype=torch.float64))
