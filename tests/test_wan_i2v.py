"""Wan image-to-video through its base record (``mhla_gen/bases/wan_i2v.py``): the record tells an I2V
transformer from a T2V one; MHLA on the video self-attention of both layouts (Wan2.1: CLIP image features in
the cross-attention, ``image_dim``; Wan2.2 I2V-A14B: two experts on 36 channels, no CLIP) matches the dense
oracle, compiles to one graph, offloads and checkpoints exactly, saves and loads through diffusers' own
loaders, and samples through ``WanImageToVideoPipeline`` with the record's sampler."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, WanImageToVideoPipeline
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from PIL import Image
from test_compile import assert_same_results, forward_backward
from test_wan import _randomize_mhla_, _reference_self_attention

from mhla_gen import MHLAConfig, install_mhla, mhla_parameters
from mhla_gen.bases import base_for, base_for_class_name, base_for_model
from mhla_gen.integration.install import mhla_processors
from mhla_gen.models import MHLAWanTransformer3DModel
from mhla_gen.pipelines import SampleSettings
from mhla_gen.pipelines.wan import WanI2VSampler
from mhla_gen.processors.wan import WanMHLAProcessor, wan_token_grid
from mhla_gen.testing import OFFLOAD_MODES, offload
from mhla_gen.testing.video import (
    REAL_CONFIGS,
    WAN22_I2V_BOUNDARY,
    tiny_ti2v_pipeline,
    tiny_wan22_i2v_pipeline,
    tiny_wan_expert,
    tiny_wan_i2v_pipeline,
)
from mhla_gen.testing.wan import TEXT_DIM

IMAGE_DIM = 8  # tiny_wan_i2v_pipeline's CLIP width
VARIANTS = {  # transformer overrides of tiny_wan_expert
    "wan21": dict(in_channels=36, image_dim=IMAGE_DIM, added_kv_proj_dim=24),
    "wan22": dict(in_channels=36),
}
CFG = MHLAConfig(blocks=(2, 2, 3), layers=[1, 2], cpe_kernel=3, gate=True)  # hybrid: layer 0 softmax


def _model(variant: str, cfg: MHLAConfig | None = CFG, seed: int = 0):
    model = tiny_wan_expert(seed, **VARIANTS[variant])
    if cfg is not None:
        install_mhla(model, cfg)
        _randomize_mhla_(model)
    return model


def _inputs(variant: str, dtype=torch.float32) -> dict:
    """Latent (2, 36, 3, 6, 10): token grid (3, 3, 5); Wan2.1 I2V: 512 text tokens (diffusers' cross-attention
    splits the image tokens off at 512) and 5 CLIP tokens."""
    g = torch.Generator().manual_seed(0)
    text_tokens = 512 if variant == "wan21" else 7
    inputs = dict(
        hidden_states=torch.randn(2, 36, 3, 6, 10, generator=g).to(dtype),
        timestep=torch.tensor([300, 700]),
        encoder_hidden_states=torch.randn(2, text_tokens, TEXT_DIM, generator=g).to(dtype),
    )
    if variant == "wan21":
        inputs["encoder_hidden_states_image"] = torch.randn(2, 5, IMAGE_DIM, generator=g).to(dtype)
    return inputs


@torch.no_grad()
def _run(model, inputs) -> torch.Tensor:
    return model(**inputs).sample


# ------------------------------------------------------------------------------------------------ record
def test_record_tells_image_to_video_from_text_to_video():
    """First match wins: ``wan-i2v`` before ``wan``. Wan2.1 I2V (``image_dim``) and Wan2.2 I2V-A14B (36 in,
    16 out) are I2V; T2V and TI2V-5B (48 in and out) are ``wan``; a config-less class name is ``wan``."""
    i2v, t2v = base_for("wan-i2v"), base_for("wan")
    assert base_for_model(_model("wan21", None)) is i2v and base_for_model(_model("wan22", None)) is i2v
    assert base_for_model(tiny_wan_expert()) is t2v
    assert base_for_model(tiny_wan_expert(in_channels=48, out_channels=48)) is t2v
    name = "WanTransformer3DModel"
    assert base_for_class_name(name, REAL_CONFIGS["Wan2.1-I2V-14B-480P"][1]) is i2v
    assert base_for_class_name(name, REAL_CONFIGS["Wan2.2-T2V-A14B"][1]) is t2v
    assert base_for_class_name(name, REAL_CONFIGS["Wan2.2-TI2V-5B"][1]) is t2v
    wan22_i2v = {**REAL_CONFIGS["Wan2.2-T2V-A14B"][1], "in_channels": 36}  # Wan2.2-I2V-A14B's experts
    assert base_for_class_name(name, wan22_i2v) is i2v
    assert base_for_class_name("MHLAWanTransformer3DModel", wan22_i2v) is i2v
    assert base_for_class_name(name) is t2v
    assert i2v.image_conditioned and not t2v.image_conditioned and i2v.trains
    assert i2v.processor is WanMHLAProcessor and i2v.sampler.load() is WanI2VSampler
    assert i2v.video and i2v.context_parallel


def test_a_base_without_a_training_task_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """A record with ``task=None`` (it samples, installs, saves and loads only): ``scripts/linearize.py
    --base NAME`` stops in one line (exit 2), nothing written; ``train_main`` refuses it the same way."""
    import dataclasses

    from test_cli_errors import fails_in_one_line

    from mhla_gen.bases import BASES
    from mhla_gen.commands.cli import train_main
    from mhla_gen.errors import ConfigError

    untrained = dataclasses.replace(base_for("wan-i2v"), name="sampling-only", task=None, run_config=None)
    monkeypatch.setitem(BASES, "sampling-only", untrained)
    out = tmp_path / "run"
    line = fails_in_one_line(
        "scripts/linearize.py", ["--base", "sampling-only", f"output_dir={out}"], capsys, monkeypatch
    )
    assert re.search(
        r"--base sampling-only: this base has no training task yet .* bases that train: "
        r"\['dit', 'sana', 'sana-video', 'wan', 'wan-i2v'\]",
        line,
    ), line
    assert not out.exists()
    with pytest.raises(ConfigError, match="base sampling-only: this base has no training task yet"):
        train_main("sampling-only", "fine-tune", argv=[])


# ------------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_processor_matches_dense_oracle_and_cross_attention_stays_stock(variant):
    """MHLA on ``attn1`` equals the dense formula; ``attn2`` (with the image K/V for Wan2.1) stays stock."""
    model = _model(variant, MHLAConfig(blocks=(2, 2, 3), cpe_kernel=3, gate=True)).double()
    latent = _inputs(variant, torch.float64)["hidden_states"]
    rotary = model.rope(latent)
    assert rotary.grid == wan_token_grid(model, latent) == (3, 3, 5)
    attn = model.blocks[0].attn1
    x = torch.randn(2, 45, attn.to_q.in_features, dtype=torch.float64)
    expected = _reference_self_attention(attn, attn.processor, x, rotary, (3, 3, 5))
    torch.testing.assert_close(attn(x, None, None, rotary), expected, rtol=1e-9, atol=1e-9)
    assert all(type(b.attn2.processor) is WanAttnProcessor for b in model.blocks)
    assert all((b.attn2.add_k_proj is not None) == (variant == "wan21") for b in model.blocks)
    assert set(mhla_processors(model)) == {f"blocks.{i}.attn1.processor" for i in range(3)}


def test_compiles_to_one_graph_without_breaks_and_matches_eager():
    """Wan2.1 I2V (the image path through the cross-attention; Wan2.2 I2V differs from T2V, compiled in
    tests/test_compile.py, only in its input channels): one graph, no breaks, as the stock model; the
    compiled forward and backward match eager."""
    model, inputs = _model("wan21"), _inputs("wan21")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**inputs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    expected = forward_backward(model, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same_results(forward_backward(compiled, inputs), expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradient_checkpointing_gives_the_same_gradients(variant):
    model, inputs = _model(variant).train(), _inputs(variant)
    plain = forward_backward(model, inputs)
    for name in mhla_parameters(model):
        assert plain[1][name].abs().sum() > 0, name
    model.enable_gradient_checkpointing()
    out, grads = forward_backward(model, inputs)
    torch.testing.assert_close(out, plain[0], rtol=0, atol=0)
    assert grads.keys() == plain[1].keys()
    for name, grad in plain[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", OFFLOAD_MODES)
def test_offloading_is_exact(mode, tmp_path):
    """accelerate's cpu_offload and diffusers' group offloading of the Wan2.1 I2V model (its image
    embedder and added K/V projections included) give the same output bit for bit."""
    model, inputs = _model("wan21"), _inputs("wan21")
    reference = _run(model, inputs)
    offload(model, mode, tmp_path)
    if mode == "cpu_offload":
        assert next(iter(mhla_processors(model).values())).mixing.weight.device.type == "meta"
    assert torch.equal(_run(model, inputs), reference)
    assert torch.equal(_run(model, inputs), reference)


# ---------------------------------------------------------------------------------------------- pipelines
def _pipeline(variant: str):
    """The tiny I2V pipeline of ``variant`` with trained-like MHLA in every transformer (Wan2.2: each expert
    its own hybrid layers)."""
    if variant == "wan21":
        return tiny_wan_i2v_pipeline(transformer=_model("wan21"))
    low = _model("wan22", MHLAConfig(blocks=(2, 2, 2), layers=[0, 2]), seed=1)
    return tiny_wan22_i2v_pipeline(transformer=_model("wan22"), transformer_2=low)


def _sample(pipe, variant: str, steps: int = 3) -> np.ndarray:
    """One video through the record's sampler (48 x 64 px, 5 frames: token grid (2, 3, 4))."""
    settings = SampleSettings(
        steps=steps,
        guidance=2.0,
        height=48,
        width=64,
        frames=5,
        negative_prompt="blue",
        output_type="np",
        max_sequence_length=512 if variant == "wan21" else 16,
    )
    settings = WanI2VSampler.fit_size(pipe, settings)
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    pipe.set_progress_bar_config(disable=True)
    return WanI2VSampler.sample(pipe, [("a red car", image)], torch.Generator().manual_seed(0), settings)[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_saved_pipeline_loads_through_diffusers_and_samples_the_same_video(variant, tmp_path, used_grids):
    """``save_pretrained`` of the MHLA pipeline, then ``DiffusionPipeline.from_pretrained`` (the MHLA class
    from ``model_index.json``) and the record's loader: same classes, same MHLA, the same video."""
    pipe = _pipeline(variant)
    calls = {name: [] for name in ("transformer", "transformer_2")}
    for name, seen in calls.items():
        if getattr(pipe, name, None) is not None:
            getattr(pipe, name).register_forward_pre_hook(
                lambda m, a, kw, seen=seen: seen.append(float(kw["timestep"].flatten()[0])), with_kwargs=True
            )
    reference = _sample(pipe, variant)
    assert reference.shape == (5, 48, 64, 3) and np.isfinite(reference).all()
    assert set(used_grids) == {(2, 3, 4)}
    if variant == "wan22":  # each expert on its own side of the boundary
        assert min(calls["transformer"]) >= WAN22_I2V_BOUNDARY * 1000 > max(calls["transformer_2"])
    pipe.save_pretrained(tmp_path / "pipe")
    experts = ["transformer"] + (["transformer_2"] if variant == "wan22" else [])
    for loaded in (
        DiffusionPipeline.from_pretrained(tmp_path / "pipe"),
        WanI2VSampler.load(tmp_path / "pipe", None, torch.float32, None, None),
    ):
        assert type(loaded) is WanImageToVideoPipeline
        for name in experts:
            transformer = getattr(loaded, name)
            assert type(transformer) is MHLAWanTransformer3DModel
            assert transformer.mhla_config == getattr(pipe, name).mhla_config
        # same weights (checked by the loaders' tests); a reloaded text / image encoder may pick another
        # attention kernel: fp32 round-off of frames in [0, 1] (1e-6: 8 ulps of 1.0; 1 ulp measured)
        np.testing.assert_allclose(_sample(loaded, variant), reference, rtol=0, atol=1e-6)


def test_sequential_cpu_offload_samples_the_same_video():
    """Wan2.1 I2V pipeline (CLIP image encoder included) under accelerate's ``cpu_offload`` of every component
    (weights on ``meta`` between calls, as ``enable_sequential_cpu_offload``): the same video."""
    from test_offload import _sequential_cpu_offload

    reference = _sample(_pipeline("wan21"), "wan21", steps=2)
    pipe = _pipeline("wan21")
    _sequential_cpu_offload(pipe)
    assert next(iter(mhla_processors(pipe.transformer).values())).mixing.weight.device.type == "meta"
    np.testing.assert_array_equal(_sample(pipe, "wan21", steps=2), reference)


def test_sampler_pairs_prompts_with_images_and_checks_text_length():
    """One video per (prompt, image) pair, each from its own generator; a Wan2.1 I2V model refuses a text
    length other than 512 (its cross-attention splits image from text tokens there)."""
    pipe = _pipeline("wan21")
    pipe.set_progress_bar_config(disable=True)
    settings = WanI2VSampler.fit_size(
        pipe, SampleSettings(steps=2, height=48, width=64, frames=5, output_type="np")
    )
    assert settings.max_sequence_length is None  # the pipeline's 512
    red, green = Image.new("RGB", (64, 48), (200, 30, 30)), Image.new("RGB", (64, 48), (30, 200, 30))
    gens = [torch.Generator().manual_seed(s) for s in (0, 0)]
    videos = WanI2VSampler.sample(pipe, [("a cat", red), ("a cat", green)], gens, settings)
    assert len(videos) == 2 and not np.array_equal(videos[0], videos[1])  # the image reaches the video
    with pytest.raises(ValueError, match="max_sequence_length=300: this Wan I2V model .* exactly 512"):
        WanI2VSampler.fit_size(pipe, SampleSettings(height=48, width=64, frames=5, max_sequence_length=300))


def test_ti2v_reads_as_the_wan_record_and_samples_from_an_image():
    """TI2V-5B's one transformer serves its text and image pipelines: the ``wan`` record answers for it, and
    the I2V sampler samples it from an image (``expand_timesteps``: first latent frame kept clean)."""
    pipe = tiny_ti2v_pipeline(image_to_video=True)
    install_mhla(pipe.transformer, MHLAConfig(blocks=(2, 2, 2)))
    assert base_for_model(pipe.transformer) is base_for("wan")
    pipe.set_progress_bar_config(disable=True)
    settings = WanI2VSampler.fit_size(
        pipe, SampleSettings(steps=2, height=64, width=96, frames=5, output_type="np", max_sequence_length=16)
    )
    video = WanI2VSampler.sample(pipe, [("a red car", Image.new("RGB", (96, 64)))], None, settings)[0]
    assert video.shape == (5, 64, 96, 3) and np.isfinite(video).all()


# ------------------------------------------------------------------------------------------- entry points
@pytest.fixture(scope="module")
def i2v_folder(tmp_path_factory):
    """A saved Wan2.2 I2V-A14B-layout pipeline with MHLA in both experts, and two first-frame images."""
    root = tmp_path_factory.mktemp("wan_i2v")
    _pipeline("wan22").save_pretrained(root / "pipe")
    _pipeline("wan21").save_pretrained(root / "pipe21")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "red.png")
    Image.new("RGB", (64, 48), (30, 200, 30)).save(root / "green.png")
    (root / "broken.png").write_text("not an image")
    return root


def _script(path: str):
    from test_ownership import load_script

    return load_script(path)


def test_sample_script_writes_one_video_per_prompt_and_image(i2v_folder, tmp_path, monkeypatch):
    """scripts/sample.py --base wan-i2v: prompt i goes to the pipeline with image i (a spy on the call)."""
    from mhla_gen.metrics.video import read_video

    calls, original = [], WanImageToVideoPipeline.__call__

    def spy(self, *args, **kwargs):
        calls.append((kwargs["prompt"], kwargs["image"].getpixel((0, 0))))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(WanImageToVideoPipeline, "__call__", spy)
    out = tmp_path / "samples"
    sizes = "--steps 2 --height 48 --width 64 --frames 5 --fps 8 --device cpu".split()
    images = [str(i2v_folder / "red.png"), str(i2v_folder / "green.png")]
    prompts = ["--prompt", "a cat", "a dog"]
    _script("scripts/sample.py").main(
        ["--base", "wan-i2v", "--model", str(i2v_folder / "pipe"), *prompts, "--image", *images, *sizes]
        + ["--out", str(out)]
    )
    assert calls == [(["a cat"], (200, 30, 30)), (["a dog"], (30, 200, 30))]
    videos = sorted(out.glob("*.mp4"))
    assert [v.name for v in videos] == ["wan-i2v_seed0_00.mp4", "wan-i2v_seed1_01.mp4"]
    assert read_video(videos[1])[0].shape == (5, 48, 64, 3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--image", "{root}/missing.png"], r"--image: image '.*missing.png' does not exist"),
        (["--image", "{root}/broken.png"], r"--image: image '.*broken.png' cannot be read as an image"),
        (
            ["--image", "{root}/red.png", "{root}/red.png", "{root}/red.png"],
            r"--image: 3 images for 2 prompts",
        ),
    ],
)
def test_sample_script_refuses_bad_images_in_one_line_before_writing(
    i2v_folder, tmp_path, capsys, monkeypatch, argv, message
):
    from test_cli_errors import fails_in_one_line

    out = tmp_path / "samples"
    args = [
        "--base",
        "wan-i2v",
        "--model",
        str(i2v_folder / "pipe"),
        "--prompt",
        "a cat",
        "a dog",
        "--out",
        str(out),
        "--device",
        "cpu",
        *[a.format(root=i2v_folder) for a in argv],
    ]
    line = fails_in_one_line("scripts/sample.py", args, capsys, monkeypatch)
    assert re.search(message, line), line
    assert not out.exists()


def test_sample_script_needs_images_for_image_to_video_only(i2v_folder):
    sample = _script("scripts/sample.py")
    with pytest.raises(SystemExit):
        sample.parse_args(["--base", "wan-i2v", "--model", str(i2v_folder / "pipe"), "--prompt", "a cat"])
    with pytest.raises(SystemExit):
        sample.parse_args(
            [
                "--base",
                "wan",
                "--model",
                str(i2v_folder / "pipe"),
                "--prompt",
                "a cat",
                "--image",
                str(i2v_folder / "red.png"),
            ]
        )


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_generate_reads_prompt_image_pairs(i2v_folder, tmp_path, kind):
    """eval/generate.py with a prompts file of (prompt, image) pairs, images relative to the file: one MP4 per
    pair, the image recorded in the manifest."""
    from test_eval_generate import load

    pairs = tmp_path / f"pairs.{kind}"
    if kind == "jsonl":
        pairs.write_text(
            f'{{"prompt": "a cat", "image": "red.png"}}\n{{"prompt": "a dog", "image": '
            f'"{i2v_folder / "green.png"}"}}\n'
        )
        (tmp_path / "red.png").write_bytes((i2v_folder / "red.png").read_bytes())
    else:
        pairs.write_text(f"prompt,image\na cat,{i2v_folder / 'red.png'}\na dog,{i2v_folder / 'green.png'}\n")
    out = tmp_path / "videos"
    load("generate").main(
        [
            "base=wan-i2v",
            f"model={i2v_folder / 'pipe'}",
            f"output_dir={out}",
            f"prompts_file={pairs}",
            "height=48",
            "width=64",
            "num_frames=5",
            "steps=2",
            "fps=8",
            "max_sequence_length=16",
        ]
    )
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [(m["prompt"], Path(m["image"]).name, m["file"]) for m in manifest] == [
        ("a cat", "red.png", "000000.mp4"),
        ("a dog", "green.png", "000001.mp4"),
    ]


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["prompts=[a cat]"], ValueError, "base=wan-i2v needs `images` next to `prompts`"),
        (
            ["prompts=[a cat,a dog]", "images=[{root}/red.png,{root}/red.png,{root}/red.png]"],
            ValueError,
            "images: 3 images for 2 prompts",
        ),
        (
            ["prompts=[a cat]", "images=[{root}/missing.png]"],
            FileNotFoundError,
            "images: image .* does not exist",
        ),
        (
            ["prompts_file={root}/pairs.jsonl"],
            FileNotFoundError,
            r"prompts_file: image .*gone.png' does not exist",
        ),
        (
            ["prompts_file={root}/pairs.txt"],
            ValueError,
            r"prompts_file=.*pairs.txt': an image-to-video base reads",
        ),
        (["prompts=[a cat]", "images=[{root}/broken.png]"], ValueError, "images: image .* cannot be read"),
    ],
)
def test_generate_refuses_bad_image_conditions_before_writing(
    i2v_folder, tmp_path, overrides, error, message
):
    from test_eval_generate import load

    (i2v_folder / "pairs.jsonl").write_text('{"prompt": "a cat", "image": "gone.png"}\n')
    (i2v_folder / "pairs.txt").write_text("a cat\n")
    out = tmp_path / "videos"
    with pytest.raises(error, match=message):
        load("generate").main(
            [
                "base=wan-i2v",
                f"model={i2v_folder / 'pipe'}",
                f"output_dir={out}",
                *[o.format(root=i2v_folder) for o in overrides],
            ]
        )
    assert not out.exists()


def test_generate_refuses_a_text_length_the_clip_model_cannot_take_before_writing(i2v_folder, tmp_path):
    """Wan2.1 I2V takes exactly 512 text tokens: generate.py's default 300 is refused from the model's
    config.json, before the output folder exists; 512 passes that check."""
    from test_eval_generate import load

    from mhla_gen.errors import ConfigError

    gen, out = load("generate"), tmp_path / "videos"
    args = [
        "base=wan-i2v",
        f"model={i2v_folder / 'pipe21'}",
        f"output_dir={out}",
        "prompts=[a cat]",
        f"images=[{i2v_folder / 'red.png'}]",
    ]
    with pytest.raises(ConfigError, match="max_sequence_length=300: this Wan I2V model .* exactly 512"):
        gen.main(args)
    assert not out.exists()
    gen.check_model(gen.load_generate_config(None, [*args, "max_sequence_length=512"]))


def test_generate_takes_no_images_for_a_text_to_video_base(i2v_folder):
    from test_eval_generate import load

    with pytest.raises(ValueError, match="base=wan takes no `images`"):
        load("generate").load_generate_config(
            None, ["base=wan", "model=x", "prompts=[a]", f"images=[{i2v_folder / 'red.png'}]"]
        )


def test_attention_statistics_inputs_carry_the_image_features():
    """``example_inputs`` (attention statistics) of a Wan2.1 I2V model: 512 text tokens and CLIP image tokens,
    which reach the output; a Wan2.2 I2V model (no CLIP) gets text only."""
    from mhla_gen.metrics.attention import example_inputs

    model = _model("wan21")
    inputs = example_inputs(model, size=6, frames=3)
    assert inputs["hidden_states"].shape == (2, 36, 3, 6, 6)
    assert inputs["encoder_hidden_states"].shape[1] == 512
    out = _run(model, inputs)
    inputs["encoder_hidden_states_image"] = inputs["encoder_hidden_states_image"] + 1
    assert torch.isfinite(out).all() and not torch.equal(_run(model, inputs), out)
    assert "encoder_hidden_states_image" not in example_inputs(_model("wan22"), size=6)
