"""SANA / Wan fine-tuning features: aspect-ratio buckets through the loop (sharded over processes, resumed
mid-epoch, one end-to-end run with flips, caption dropout and cosmap weighting resumed bit-identically),
the start-up checks of bucket sizes, flips and caption dropout in a batch, the empty prompt, the flow
loss weighting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import final_weights, max_abs_diff, read_metrics, run_inprocess, tiny_config

from mhla_gen.bases import BASES
from mhla_gen.data.buckets import BucketBatchSampler
from mhla_gen.errors import ConfigError
from mhla_gen.train.config import SanaRunConfig, WanRunConfig, load_config

TINY_SANA = tiny_config("sana")  # SANA's buckets, flips, caption dropout and loss weighting
KEYS = ["a"] * 7 + ["b"] * 4 + ["c"] * 5  # 16 items in 3 buckets


def _index_loader(sampler):
    from torch.utils.data import DataLoader

    return DataLoader(list(range(len(KEYS))), batch_sampler=sampler)


@pytest.mark.parametrize("processes", [1, 2])
def test_bucket_batches_resume_mid_epoch_and_split_over_processes(processes):
    """Through Accelerate's own sharding and ``skip_first_batches`` (the loop's ``_batches``): each process
    gets its rows of the one-process global batches, and a loader started at (epoch 1, batch 1) yields what
    the uninterrupted one yields from there."""
    from accelerate.data_loader import prepare_data_loader

    from mhla_gen.train.loop import _batches

    def batches(process: int, epoch: int, skip: int) -> list[list[int]]:
        sampler = BucketBatchSampler(KEYS, 2, processes, seed=0)
        loader = prepare_data_loader(_index_loader(sampler), num_processes=processes, process_index=process,
                                     put_on_device=False, use_seedable_sampler=True)
        return [b.tolist() for b in _batches(loader, epoch, skip, sampler)]

    one = BucketBatchSampler(KEYS, 2 * processes, 1, seed=0)
    for epoch in (0, 1):
        one.set_epoch(epoch)
        expected = one.global_batches()
        shards = [batches(p, epoch, 0) for p in range(processes)]
        assert [sum((s[i] for s in shards), []) for i in range(len(expected))] == expected
    for process in range(processes):
        assert batches(process, 1, 1) == batches(process, 1, 0)[1:]


@pytest.fixture(scope="module")
def bucket_setup(tmp_path_factory):
    """A tiny SANA checkpoint and 6 images of three aspect ratios (2 each: 32x32, 32x64, 64x32 buckets),
    captioned by .json side files."""
    from mhla_gen.testing import tiny_sana_pipeline

    root = tmp_path_factory.mktemp("buckets")
    tiny_sana_pipeline().save_pretrained(root / "ckpt")
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    for i, (h, w) in enumerate([(40, 48), (30, 70), (70, 30), (36, 80), (50, 50), (80, 34)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "data" / f"{i}.png")
        (root / "data" / f"{i}.json").write_text(json.dumps({"caption": f"a cat number {i}"}))
    return root


def _sana(setup, out, *overrides):
    run_inprocess("finetune_sana.py", "--config", TINY_SANA, f"model.pretrained={setup / 'ckpt'}",
                  f"data.path={setup / 'data'}", f"output_dir={out}", "log.sample_every=0", *overrides)


def test_buckets_flips_caption_dropout_resume_exactly(bucket_setup, tmp_path, monkeypatch):
    """Buckets, flips, caption dropout and cosmap weighting on: 2 steps, then resume=latest to 4 (across an
    epoch: 3 batches each), end with exactly the weights of an uninterrupted 4-step run. Every bucket
    trains; dropped captions see the empty prompt's encoding."""
    from mhla_gen.train.caption_data import CaptionFeatures

    seen, original, encoders, build = [], CaptionFeatures.augmented, [], CaptionFeatures.build

    def build_spy(self, raw, encode_pixels, encode_text, *args):
        encoders.append(encode_text)  # the frozen pipeline's caption encoder
        return build(self, raw, encode_pixels, encode_text, *args)

    def spy(self, batch, rnd):
        out = original(self, batch, rnd)
        empty = self.empty_prompt["prompt_embeds"]
        if not seen:  # the dropped caption is the empty prompt, encoded once
            assert torch.equal(empty, encoders[-1]("")["prompt_embeds"])
        dropped = sum(torch.equal(e, empty) for e in out["prompt_embeds"])
        seen.append((tuple(out["latents"].shape[1:]), dropped))
        return out

    monkeypatch.setattr(CaptionFeatures, "augmented", spy)
    monkeypatch.setattr(CaptionFeatures, "build", build_spy)
    settings = ("data.buckets=[[32,32],[32,64],[64,32]]", "data.hflip=true", "flow.loss_weighting=cosmap",
                "model.caption_dropout_prob=0.5", f"data.cache_dir={tmp_path / 'cache'}")
    _sana(bucket_setup, tmp_path / "run", "train.max_steps=2", *settings)
    _sana(bucket_setup, tmp_path / "run", "train.max_steps=4", *settings)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    _sana(bucket_setup, tmp_path / "ref", "train.max_steps=4", *settings)
    assert max_abs_diff(final_weights(tmp_path / "run"), final_weights(tmp_path / "ref")) == 0.0
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert sorted(map(tuple, meta["shapes"])) == [(4, 16, 16)] * 2 + [(4, 16, 32)] * 2 + [(4, 32, 16)] * 2
    assert {shape for shape, _ in seen} == {(4, 16, 16), (4, 16, 32), (4, 32, 16)}
    assert sum(dropped for _, dropped in seen) > 0
    from safetensors.torch import load_file

    item = load_file(str(tmp_path / "cache" / "items" / "00000000.safetensors"))
    assert item["latents_flipped"].shape == item["latents"].shape
    assert not torch.equal(item["latents_flipped"], item["latents"])  # the mirrored image's encoding


def test_bucket_and_size_errors_come_before_any_work(bucket_setup, tmp_path):
    message = r"data.buckets entry \[32, 48\]: data.width=48 must be a multiple of 32"
    with pytest.raises(ConfigError, match=message):
        _sana(bucket_setup, tmp_path / "run", "data.buckets=[[32,32],[32,48]]")
    message = r"mhla.blocks=\[17, 2\] does not fit the token grid \(16, 64\) of data.buckets entry \[32, 128"
    with pytest.raises(ConfigError, match=message):  # it fits data.height x data.width (64 x 64: 32 x 32)
        _sana(bucket_setup, tmp_path / "run", "data.buckets=[[64,64],[32,128]]", "mhla.blocks=[17,2]",
              "data.height=64", "data.width=64")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------- augmentation, empty prompt
def test_flips_and_caption_dropout_replace_the_drawn_rows():
    from mhla_gen.train.finetune import SanaTask
    from mhla_gen.train.randomness import StepRandom

    cfg = load_config(SanaRunConfig, TINY_SANA, ["model.pretrained=x", "data.hflip=true",
                                                 "model.caption_dropout_prob=0.5"])
    features = SanaTask(cfg).features
    features.empty_prompt = {"prompt_embeds": torch.full((8, 16), -7.0),
                             "prompt_attention_mask": torch.ones(8)}
    batch = {"latents": torch.zeros(64, 4, 2, 2), "latents_flipped": torch.ones(64, 4, 2, 2),
             "prompt_embeds": torch.randn(64, 8, 16), "prompt_attention_mask": torch.zeros(64, 8)}
    rnd = StepRandom(seed=1, micro_step=5, local_batch=64)
    out = features.augmented(batch, rnd)
    rnd = StepRandom(seed=1, micro_step=5, local_batch=64)
    flip, drop = rnd.rand() < 0.5, rnd.rand() < 0.5  # the same draws, in the same order
    assert 0 < flip.sum() < 64 and 0 < drop.sum() < 64 and "latents_flipped" not in out
    assert torch.equal(out["latents"][:, 0, 0, 0], flip.float())
    assert (out["prompt_embeds"][drop] == -7).all() and torch.equal(out["prompt_embeds"][~drop],
                                                                    batch["prompt_embeds"][~drop])
    assert torch.equal(out["prompt_attention_mask"][:, 0], drop.float())
    off = SanaTask(load_config(SanaRunConfig, TINY_SANA, ["model.pretrained=x"])).features
    rnd = StepRandom(seed=1, micro_step=5, local_batch=64)
    state = rnd.generator.get_state()
    assert off.augmented({"latents": batch["latents"]}, rnd)["latents"] is batch["latents"]
    assert torch.equal(rnd.generator.get_state(), state)  # off: no draw, a run draws what it always drew


@pytest.mark.parametrize("base", [name for name, base in BASES.items() if base.trains and base.text_dim])
def test_the_empty_caption_is_the_pipelines_unconditional_prompt(base):
    """What caption dropout trains with is what the stock pipeline's CFG branch feeds (negative prompt "")."""
    import inspect

    record = BASES[base]
    cfg = load_config(record.run_config.load(), tiny_config(record), ["model.pretrained=x"])
    task = record.task.load()(cfg)
    task.frozen = pipe = record.tiny.load().pipeline()
    empty = task.encode_text("")
    extra = {"complex_human_instruction": None} if "complex_human_instruction" in \
        inspect.signature(pipe.encode_prompt).parameters else {}  # SANA's: off, as the task encodes
    got = pipe.encode_prompt("a cat", negative_prompt="", do_classifier_free_guidance=True, device="cpu",
                             max_sequence_length=cfg.data.max_sequence_length, **extra)
    # embeds and negative embeds (Wan), or embeds, mask, negative embeds, negative mask (SANA)
    negative = got[len(got) // 2]
    torch.testing.assert_close(empty["prompt_embeds"], negative[0].float(), rtol=0, atol=0)
    if len(got) == 4:
        assert torch.equal(empty["prompt_attention_mask"], got[3][0])


# ------------------------------------------------------------------------------------------- loss
def test_flow_loss_weighting_is_diffusers_sd3_weighting_and_weighs_the_task_loss():
    from mhla_gen.train.objectives import flow_matching_loss_weights, flow_matching_mse

    sigmas = torch.tensor([0.1, 0.5, 0.9])
    torch.testing.assert_close(flow_matching_loss_weights("sigma_sqrt", sigmas), sigmas**-2)
    cosmap = 2 / (torch.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    torch.testing.assert_close(flow_matching_loss_weights("cosmap", sigmas), cosmap)
    assert torch.equal(flow_matching_loss_weights("none", sigmas), torch.ones(3))
    pred, x0, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    per_item = ((pred - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
    weights = torch.tensor([1.0, 2.0, 0.5])
    torch.testing.assert_close(flow_matching_mse(pred, x0, noise, weights), (weights * per_item).mean())
    torch.testing.assert_close(flow_matching_mse(pred, x0, noise), per_item.mean())
    with pytest.raises(ConfigError, match="flow.loss_weighting must be one of none, sigma_sqrt, cosmap"):
        load_config(SanaRunConfig, None, ["flow.loss_weighting=snr"])

    from mhla_gen.testing import tiny_sana_pipeline
    from mhla_gen.train.finetune import SanaTask
    from mhla_gen.train.randomness import StepRandom

    cfg = load_config(SanaRunConfig, TINY_SANA, ["model.pretrained=x", "flow.loss_weighting=cosmap"])
    task = SanaTask(cfg)
    task.frozen = tiny_sana_pipeline()
    batch = {"latents": torch.randn(4, 4, 2, 2), "prompt_embeds": torch.randn(4, 8, 16),
             "prompt_attention_mask": torch.ones(4, 8)}
    zero = lambda hidden_states, **_: (torch.zeros_like(hidden_states),)  # the model predicts 0
    loss = task.loss(zero, batch, StepRandom(0, 3, 4))
    _, (x0, noise, sigmas) = task.model_inputs(batch, StepRandom(0, 3, 4))
    expected = (flow_matching_loss_weights("cosmap", sigmas) * ((noise - x0) ** 2).mean(dim=(1, 2, 3))).mean()
    torch.testing.assert_close(loss, expected)




def test_frame_settings_are_checked():
    with pytest.raises(ConfigError, match="data.frame_stride=2 does not apply to data.frame_sampling=unif"):
        load_config(WanRunConfig, None, ["data.frame_sampling=uniform", "data.frame_stride=2"])
    with pytest.raises(ConfigError, match="data.frame_sampling must be one of first, uniform, random"):
        load_config(WanRunConfig, None, ["data.frame_sampling=last"])
