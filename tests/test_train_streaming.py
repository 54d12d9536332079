"""Training a streaming (block-causal) Wan: diffusion forcing's per-chunk noise (``flow.per_chunk_noise``),
``finetune_wan.py`` on moving shapes with checkpoint + exact resume and the streaming sampler on the result,
stage 1 (``linearize.py``) to a block-causal student, and the settings refused before any work."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import REPO, final_weights, max_abs_diff, read_metrics, run_inprocess

from mhla_gen.errors import ConfigError
from mhla_gen.train.chunk_noise import FlowNoise
from mhla_gen.train.config import FlowMatchingConfig
from mhla_gen.train.objectives import flow_matching_loss_weights, per_chunk_flow_inputs
from mhla_gen.train.randomness import StepRandom

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "wan.yaml")
STREAM = ("data.source=moving_shapes", "data.clips=4", "data.num_frames=9", "mhla.layers=null",
          "mhla.chunk_frames=1", "mhla.stream_mixing=factorised", "flow.per_chunk_noise=true")


def test_each_chunk_is_noised_at_its_own_sigma_with_per_token_timesteps():
    x0, noise = torch.randn(2, 16, 4, 6, 8), torch.randn(2, 16, 4, 6, 8)
    sigmas = torch.tensor([[0.1, 0.9], [0.5, 0.3]])  # (B, chunks of 2 latent frames)
    inputs = per_chunk_flow_inputs(x0, noise, sigmas, 1000, 2, (1, 2, 2))
    tokens = 3 * 4  # per latent frame
    assert inputs["timestep"].shape == (2, 4 * tokens)
    for b in range(2):
        for frame in range(4):
            sigma = sigmas[b, frame // 2]
            torch.testing.assert_close(inputs["hidden_states"][b, :, frame],
                                       (1 - sigma) * x0[b, :, frame] + sigma * noise[b, :, frame])
            assert (inputs["timestep"][b, frame * tokens : (frame + 1) * tokens] == sigma * 1000).all()
    with pytest.raises(ValueError, match="do not fit 4 latent frames in chunks of 3"):
        per_chunk_flow_inputs(x0, noise, sigmas, 1000, 3, (1, 2, 2))


def test_chunks_draw_independent_sigmas_and_weigh_their_own_loss():
    flow = FlowMatchingConfig(per_chunk_noise=True, loss_weighting="cosmap")
    noising = FlowNoise(flow, 3.0, None, "transformer", 1000, chunk_frames=2, patch_size=(1, 2, 2))
    single = FlowNoise(flow, 3.0, None, "transformer", 1000)
    latents = torch.zeros(4, 16, 6, 2, 2)
    sigmas = noising.sigmas(StepRandom(0, 5, 4), latents)
    assert sigmas.shape == (4, 3) and len(set(sigmas.flatten().tolist())) == 12
    torch.testing.assert_close(sigmas[:, 0], single.sigmas(StepRandom(0, 5, 4), latents))  # same first draw
    weights = noising.loss_weights(sigmas)
    assert weights.shape == (4, 1, 6, 1, 1)
    torch.testing.assert_close(weights[:, 0, 2:4, 0, 0], flow_matching_loss_weights("cosmap", sigmas[:, 1:2])
                               .expand(4, 2))


@pytest.fixture(scope="module")
def wan_checkpoint(tmp_path_factory):
    from mhla_gen.testing.wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan_stream_train")
    tiny_wan_pipeline().save_pretrained(root / "ckpt")
    return root / "ckpt"


def _finetune(checkpoint, out, *overrides):
    run_inprocess("finetune_wan.py", "--config", TINY, f"model.pretrained={checkpoint}", f"output_dir={out}",
                  *STREAM, *overrides)


def test_block_causal_finetune_resumes_exactly_and_streams(wan_checkpoint, tmp_path):
    """Diffusion forcing on moving shapes, accumulation 2: 2 steps, then resume to 3, equals an uninterrupted
    3-step run exactly; the final model loads block-causal and the streaming sampler runs it."""
    from mhla_gen.pipelines.wan import load_wan_pipeline
    from mhla_gen.pipelines.wan_stream import stream_video

    run, common = tmp_path / "run", ("train.gradient_accumulation_steps=2", "flow.loss_weighting=cosmap")
    _finetune(wan_checkpoint, run, "train.max_steps=2", *common)
    assert (run / "samples" / "step_0000002.png").is_file()  # sampled by streaming (3 chunks)
    _finetune(wan_checkpoint, run, "train.max_steps=3", *common)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    _finetune(wan_checkpoint, tmp_path / "ref", "train.max_steps=3", *common, "log.sample_every=0")
    assert max_abs_diff(final_weights(run), final_weights(tmp_path / "ref")) == 0.0
    pipe = load_wan_pipeline(wan_checkpoint, transformer_path=run / "final", torch_dtype=torch.float32)
    assert pipe.transformer.mhla_config.chunk_frames == 1
    video = stream_video(pipe, "a red square", num_frames=13, height=32, width=32, num_inference_steps=1,
                         max_sequence_length=8).frames
    assert video.shape == (1, 13, 32, 32, 3)


def test_softmax_block_causal_trains_and_streams(wan_checkpoint, tmp_path):
    """``model.attention=softmax`` with ``mhla.chunk_frames``: diffusion forcing on block-causal softmax (no
    MHLA layer); the saved model records ``layers=[]`` and streams through its KV caches."""
    from mhla_gen.pipelines.wan import load_wan_pipeline
    from mhla_gen.pipelines.wan_stream import stream_video

    _finetune(wan_checkpoint, tmp_path / "run", "model.attention=softmax", "train.max_steps=1",
              "log.sample_every=0")
    recorded = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["mhla"]
    assert (recorded["layers"], recorded["chunk_frames"]) == ([], 1)
    pipe = load_wan_pipeline(wan_checkpoint, transformer_path=tmp_path / "run" / "final",
                             torch_dtype=torch.float32)
    out = stream_video(pipe, "a red square", num_frames=13, height=32, width=32, num_inference_steps=1,
                       max_sequence_length=8, output_type="latent")
    assert out.latents.shape[2] == 4 and out.cache_bytes == [out.cache_bytes[0] * (c + 1) for c in range(3)]


def test_per_chunk_noise_changes_what_the_model_sees(wan_checkpoint, tmp_path):
    """The same run with one σ per video trains to other weights (the per-chunk draws reach the model)."""
    _finetune(wan_checkpoint, tmp_path / "a", "train.max_steps=1", "log.sample_every=0")
    _finetune(wan_checkpoint, tmp_path / "b", "train.max_steps=1", "log.sample_every=0",
              "flow.per_chunk_noise=false")
    assert max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) > 0


@pytest.mark.parametrize("overrides, message", [
    (["flow.per_chunk_noise=true", "mhla.chunk_frames=null", "mhla.stream_mixing=general"],
     "flow.per_chunk_noise=true .* needs block-causal attention"),
    (["mhla.chunk_frames=2"], r"mhla.chunk_frames=2, data.height=32.*does not divide the 3 latent frames"),
    (["mhla.stream_mixing=general", "mhla.blocks=[1,2,2]"], r"time block 0 .* across a boundary"),
])
def test_streaming_settings_are_refused_before_any_work(wan_checkpoint, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _finetune(wan_checkpoint, tmp_path / "run", *overrides)
    assert not (tmp_path / "run").exists()


def test_stage1_to_a_block_causal_student(wan_checkpoint, tmp_path):
    """Stage 1 against the bidirectional softmax teacher, the student block-causal; a hybrid is refused."""
    from mhla_gen.integration.loading import load_transformer

    common = ("--base", "wan", "--config", TINY, f"model.pretrained={wan_checkpoint}", *STREAM[:-1],
              "train.max_steps=2", "transfer.eval_batches=1")
    with pytest.raises(ConfigError, match="hybrid.softmax_layers='auto:1' with mhla.chunk_frames=1"):
        run_inprocess("linearize.py", *common, f"output_dir={tmp_path / 'hybrid'}",
                      "hybrid.softmax_layers=auto:1")
    run_inprocess("linearize.py", *common, f"output_dir={tmp_path / 's1'}")
    report = json.loads((tmp_path / "s1" / "transfer.json").read_text())
    assert report["softmax_layers"] == [] and len(report["mhla_layers"]) == 3
    assert load_transformer(tmp_path / "s1" / "final").mhla_config.chunk_frames == 1


def test_image_models_refuse_per_chunk_noise():
    from mhla_gen.train.objectives import FlowMatching, ModelFacts

    with pytest.raises(ConfigError, match="needs block-causal attention"):  # an image model has no chunks
        FlowMatching.check(FlowMatchingConfig(per_chunk_noise=True), ModelFacts(chunk_frames=None))


def test_a_bidirectional_mhla_checkpoint_continues_block_causal(tmp_path):
    """``model.init_from`` saved with bidirectional MHLA plus ``mhla.chunk_frames``: the run trains its config
    with the chunks added and starts from its trained W (general mixing); factorised is refused."""
    from mhla_gen import MHLAConfig, install_mhla
    from mhla_gen.integration.install import mhla_processors
    from mhla_gen.testing.wan import tiny_wan_transformer
    from mhla_gen.train.attention import load_start_transformer, start_attention

    saved = tiny_wan_transformer()
    install_mhla(saved, MHLAConfig(blocks=(3, 2, 2)))
    with torch.no_grad():
        for proc in mhla_processors(saved).values():
            proc.mixing.weight.uniform_(0.1, 0.9)
    saved.save_pretrained(tmp_path / "bidirectional")
    wanted = MHLAConfig(blocks=(1, 2, 2), chunk_frames=1)
    attention, mhla = start_attention("mhla", wanted, tmp_path / "bidirectional", "saved", "model.init_from")
    assert (attention, mhla) == ("mhla", MHLAConfig(blocks=(3, 2, 2), chunk_frames=1))
    model = load_start_transformer(type(saved), tmp_path / "bidirectional", attention, mhla, "saved")
    assert model.mhla_config == mhla
    for before, after in zip(mhla_processors(saved).values(), mhla_processors(model).values()):
        assert torch.equal(before.mixing.weight, after.mixing.weight)
    factorised = MHLAConfig(blocks=(1, 2, 2), chunk_frames=1, stream_mixing="factorised")
    with pytest.raises(ConfigError, match="stream_mixing=general, or set model.init_attention=fresh"):
        start_attention("mhla", factorised, tmp_path / "bidirectional", "saved", "model.init_from")


def test_a_block_causal_checkpoint_refuses_other_chunks_or_mixing(tmp_path):
    """A saved block-causal model keeps its chunks and mixing form (unset: followed); another
    mhla.chunk_frames or stream_mixing is refused in one line, not dropped for the saved one."""
    from mhla_gen import MHLAConfig, install_mhla
    from mhla_gen.testing.wan import tiny_wan_transformer
    from mhla_gen.train.attention import start_attention

    saved = MHLAConfig(blocks=(1, 2, 2), chunk_frames=2, stream_mixing="factorised")
    install_mhla(tiny_wan_transformer(), saved).save_pretrained(tmp_path / "stream")
    folder, setting = tmp_path / "stream", "model.init_from"
    for wanted in (MHLAConfig(blocks=(1, 2, 2)), saved):
        assert start_attention("mhla", wanted, folder, "saved", setting) == ("mhla", saved)
    for other in (dict(chunk_frames=1, stream_mixing="factorised"), dict(chunk_frames=2)):
        with pytest.raises(ConfigError, match="block-causal with chunk_frames=2, stream_mixing=factorised"):
            start_attention("mhla", MHLAConfig(blocks=(1, 2, 2), **other), folder, "saved", setting)
