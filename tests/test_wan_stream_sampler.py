"""The streaming sampler (mhla_gen/pipelines/wan_stream.py) and ``mhla-gen sample --stream`` on a tiny Wan
pipeline: videos of any length, the factorised cache's size flat in the length, MP4s with the right frame
count, and bad requests refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.commands import sample
from mhla_gen.errors import ConfigError
from mhla_gen.metrics.video import read_video
from mhla_gen.pipelines.wan_stream import stream_video
from mhla_gen.testing.wan import tiny_wan_pipeline

FACTORISED = MHLAConfig(blocks=(1, 2, 2), chunk_frames=1, stream_mixing="factorised")


@pytest.fixture(scope="module")
def stream_pipe():
    pipe = tiny_wan_pipeline()
    install_mhla(pipe.transformer, FACTORISED)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """Saved pipelines: a streaming one (factorised, chunks of 2) and a bidirectional MHLA one."""
    root = tmp_path_factory.mktemp("stream_pipes")
    for name, cfg in (("stream", MHLAConfig(blocks=(1, 2, 2), chunk_frames=2, stream_mixing="factorised")),
                      ("bidirectional", MHLAConfig(blocks=(1, 2, 2)))):
        pipe = tiny_wan_pipeline()
        install_mhla(pipe.transformer, cfg)
        pipe.save_pretrained(root / name)
    return root


def _stream(pipe, frames, **kwargs):
    options = dict(height=32, width=32, num_inference_steps=1, guidance_scale=2.0, max_sequence_length=8,
                   generator=torch.Generator().manual_seed(0))
    return stream_video(pipe, "a cat runs", "", num_frames=frames, **{**options, **kwargs})


def test_factorised_memory_is_flat_from_one_to_eight_times_the_length(stream_pipe):
    """Trained length here: 5 frames = 2 latent frames = 2 chunks. The cache after each chunk is written
    holds the same bytes at 8x the length (16 chunks), for both guidance branches."""
    short = _stream(stream_pipe, 5, output_type="latent")
    long = _stream(stream_pipe, 61, output_type="latent")  # 16 latent frames
    assert long.latents.shape[2] == 16 and short.latents.shape[2] == 2
    assert len(long.cache_bytes) == 15 and set(long.cache_bytes) == set(short.cache_bytes)
    layers, heads, state = 3, 2, 4 * 12 * 13  # (m=4 blocks) x d x (e + 1) fp32 per head
    assert short.cache_bytes[0] == 2 * layers * heads * state * 4  # two caches (cond, uncond), batch 1


def test_general_memory_grows_with_the_video():
    pipe = tiny_wan_pipeline()
    install_mhla(pipe.transformer, MHLAConfig(blocks=(4, 2, 2), chunk_frames=1))
    pipe.set_progress_bar_config(disable=True)
    out = _stream(pipe, 13, output_type="latent", guidance_scale=1.0)  # 4 latent frames, one cache
    assert out.cache_bytes == [out.cache_bytes[0] * (c + 1) for c in range(3)]


def _recomputed(pipe, frames, steps, seed):
    """The streaming sampler written without a cache: each denoising step runs the whole video so far, the
    finished chunks clean (timestep 0, per token) and the current one noisy, and keeps the last chunk."""
    from diffusers.utils.torch_utils import randn_tensor

    text = pipe.encode_prompt("a cat runs", do_classifier_free_guidance=False, max_sequence_length=8)[0]
    generator, done = torch.Generator().manual_seed(seed), []
    tokens = 2 * 2  # per latent frame: (32 / 8 / 2)^2
    for _ in range((frames - 1) // 4 + 1):
        x = randn_tensor((1, 16, 1, 4, 4), generator=generator, dtype=torch.float32)
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(steps)
        for t in scheduler.timesteps:
            timestep = torch.cat([torch.zeros(len(done) * tokens), t.float().expand(tokens)])[None]
            with torch.no_grad():
                velocity = pipe.transformer(torch.cat([*done, x], dim=2), timestep, text).sample[:, :, -1:]
            x = scheduler.step(velocity, t, x).prev_sample
        done.append(x)
    return torch.cat(done, dim=2)


def test_streaming_equals_recomputing_the_clean_past_at_every_step(stream_pipe):
    """The cache is the clean past: chunk c from the cache equals chunk c from the whole video so far (the
    rollout equality, through 2 UniPC steps a chunk; fp32 paths ~1e-6 apart)."""
    streamed = _stream(stream_pipe, 13, output_type="latent", guidance_scale=1.0, num_inference_steps=2)
    torch.testing.assert_close(streamed.latents, _recomputed(stream_pipe, 13, 2, 0), rtol=1e-4, atol=1e-4)


def test_softmax_streaming_equals_recomputing_and_its_kv_cache_grows():
    """Block-causal softmax (``layers=[]``) through the same sampler: the KV cache is the clean past (the
    rollout equality through 2 UniPC steps a chunk), and it holds one more chunk's keys and values after
    every chunk."""
    pipe = tiny_wan_pipeline()
    install_mhla(pipe.transformer, MHLAConfig(blocks=(1, 2, 2), chunk_frames=1, layers=[]))
    pipe.set_progress_bar_config(disable=True)
    streamed = _stream(pipe, 13, output_type="latent", guidance_scale=1.0, num_inference_steps=2)
    torch.testing.assert_close(streamed.latents, _recomputed(pipe, 13, 2, 0), rtol=1e-4, atol=1e-4)
    per_chunk = 3 * 2 * 4 * (12 + 12) * 4  # layers x heads x tokens x (d + e) fp32, batch 1
    assert streamed.cache_bytes == [per_chunk * (c + 1) for c in range(3)]


def test_streamed_video_is_decoded_whole(stream_pipe):
    video = _stream(stream_pipe, 9).frames  # 3 latent frames -> 9 frames
    assert video.shape == (1, 9, 32, 32, 3) and video.min() >= 0 and video.max() <= 1


def _sample(pipelines, out, *extra):
    sample.main(["--base", "wan", "--model", str(pipelines / "stream"), "--prompt", "a cat runs", "--stream",
                 "--height", "32", "--width", "32", "--steps", "1", "--guidance", "1", "--device", "cpu",
                 "--out", str(out), *extra])


def test_sample_stream_writes_an_mp4_of_the_requested_length(pipelines, tmp_path):
    _sample(pipelines, tmp_path / "out", "--frames", "29")  # 8 latent frames = 4 chunks of 2, past 5 frames
    frames, fps = read_video(tmp_path / "out" / "wan_seed0_00.mp4")
    assert frames.shape == (29, 32, 32, 3) and fps == 16


@pytest.mark.parametrize("extra, message", [
    (["--frames", "9"], r"--frames 9: its 3 latent frames are not a whole number of chunks of chunk_frames"),
    (["--frames", "8"], r"--frames 8 must be 4k \+ 1"),
    (["--frames", "5", "--height", "40"], r"--height 40 is not a multiple of 16 \(VAE 8x, patch 2\)"),
])
def test_sample_stream_refuses_lengths_the_chunks_do_not_divide(pipelines, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _sample(pipelines, tmp_path / "out", *extra)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["--frames", "5", "--height", "40"], r"--height 40 is not a multiple of 16"),
    (["--frames", "8", "--height", "32"], r"--frames 8 must be 4k \+ 1"),
])
def test_sample_refuses_sizes_the_model_cannot_take_before_claiming_out(pipelines, tmp_path, extra, message):
    """Without --stream too: the size and length are checked from the configs, not after --out is marked."""
    with pytest.raises(ConfigError, match=message):
        sample.main(["--base", "wan", "--model", str(pipelines / "bidirectional"), "--prompt", "a cat",
                     "--width", "32", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "out"),
                     *extra])
    assert not (tmp_path / "out").exists()


def test_stream_video_refuses_a_size_the_vae_and_patch_do_not_tile_or_no_steps(stream_pipe):
    with pytest.raises(ConfigError, match=r"--height 40 is not a multiple of 16"):
        _stream(stream_pipe, 5, height=40)
    for steps in (0, 1.0, True, np.int64(0)):
        with pytest.raises(ValueError, match=r"num_inference_steps must be an int >= 1 .*, got "):
            _stream(stream_pipe, 5, num_inference_steps=steps)


def test_stream_video_takes_a_numpy_step_count(stream_pipe):
    """A step count from a numpy sweep (np.arange) is an integer: streamed as the same int would be."""
    expected = _stream(stream_pipe, 5, output_type="latent", num_inference_steps=2)
    streamed = _stream(stream_pipe, 5, output_type="latent", num_inference_steps=np.int64(2))
    assert torch.equal(streamed.latents, expected.latents)


def test_sample_stream_refuses_a_bidirectional_checkpoint_before_writing(pipelines, tmp_path):
    with pytest.raises(ConfigError, match=r"--stream needs a block-causal model .* bidirectional MHLA"):
        _sample(pipelines, tmp_path / "out", "--frames", "5", "--transformer",
                str(pipelines / "bidirectional" / "transformer"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--base", "dit", "--labels", "1"], "--stream is built for --base wan, not --base dit"),
    (["--base", "wan", "--prompt", "a cat", "--blocks", "1", "2", "2"], "--blocks installs untrained MHLA"),
])
def test_sample_stream_flag_is_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        sample.parse_args(["--model", "x/y", "--stream", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("stream", [["--stream"], []])
def test_sample_refuses_a_transformer_folder_without_config_before_claiming_out(pipelines, tmp_path, stream,
                                                                                capsys):
    """A pipeline folder given as --transformer: one line naming it, not a bare file error (--stream) or a
    load error after --out was marked."""
    with pytest.raises(SystemExit):
        sample.main(["--base", "wan", "--model", str(pipelines / "stream"), "--transformer",
                     str(pipelines / "stream"), "--prompt", "a cat", "--height", "32", "--width", "32",
                     "--frames", "5", "--device", "cpu", "--out", str(tmp_path / "out"), *stream])
    message = "is not a saved transformer folder (no config.json) (a pipeline folder: pass its transformer/)"
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
