"""scripts/train_dit.py on tiny configs: checkpoints, exact resume (also after SIGKILL), attention types,
data sources, 2-process equality, the DiT loss, clear errors."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch
from PIL import Image
from train_helpers import (
    REPO,
    final_weights,
    max_abs_diff,
    read_metrics,
    run_inprocess,
    run_killed,
    run_subprocess,
    run_torchrun,
)

from mhla_gen.errors import ConfigError

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "dit.yaml")


def train(out, *overrides):
    run_inprocess("train_dit.py", "--config", TINY, f"output_dir={out}", *overrides)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """Uninterrupted 5-step run (checkpoints at 2 and 4)."""
    out = tmp_path_factory.mktemp("dit_ref")
    train(out, "train.max_steps=5")
    return out


def test_run_writes_everything(reference_run):
    from mhla_gen import MHLAConfig
    from mhla_gen.integration.loading import load_transformer
    from mhla_gen.train.config import DiTRunConfig, load_config

    out = reference_run
    assert load_config(DiTRunConfig, out / "config.yaml").train.max_steps == 5  # resolved config round-trips
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "checkpoint_4",
        "checkpoint_5",
    ]  # limit 2
    assert json.loads((out / "checkpoints" / "checkpoint_5" / "trainer_state.json").read_text())["step"] == 5
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all({"loss", "lr", "grad_norm", "steps_per_s"} <= r.keys() for r in records)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert (out / "samples" / "step_0000005.png").is_file()
    model = load_transformer(out / "final")
    assert model.mhla_config == MHLAConfig(blocks=(2, 2))
    mixing = [m.weight for n, m in model.named_modules() if n.endswith("mixing")]
    assert mixing and all((w >= 0).all() and (w <= 1).all() for w in mixing)  # clamped after each step


def test_resume_continues_step_count_and_matches(reference_run, tmp_path):
    train(tmp_path, "train.max_steps=3")
    train(tmp_path, "train.max_steps=5")  # resume=latest from checkpoint_3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert max_abs_diff(final_weights(tmp_path), final_weights(reference_run)) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["kill_after_step=3", "kill_during_checkpoint=4"])
def test_sigkill_then_resume_equals_uninterrupted(reference_run, tmp_path, kill):
    """A SIGKILLed run (after step 3, or halfway through saving checkpoint 4) resumed from its last
    complete checkpoint ends with exactly the uninterrupted weights."""
    killed = run_killed(
        kill,
        "--config",
        TINY,
        f"output_dir={tmp_path}",
        "train.max_steps=5",
        "log.trackers=[tensorboard]",
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # console: the checkpoint line stands on its own line, not inside the progress bar's
    lines = [line.split("\r")[-1] for line in killed.stderr.split("\n") if "checkpoint_2" in line]
    assert (
        len(lines) == 1
        and lines[0].endswith(
            "INFO mhla_gen.train.checkpoint: saved " + str(tmp_path / "checkpoints" / "checkpoint_2")
        )
        and lines[0][:2] == "20"
    ), lines
    assert not (tmp_path / "final").exists()
    assert (tmp_path / "checkpoints" / "checkpoint_2").is_dir()
    if "during" in kill:
        assert (tmp_path / "checkpoints" / ".tmp-checkpoint_4").is_dir()  # the torn save...
        assert not (tmp_path / "checkpoints" / "checkpoint_4").exists()  # ...never became a checkpoint
    train(tmp_path, "train.max_steps=5")
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert max_abs_diff(final_weights(tmp_path), final_weights(reference_run)) == 0.0


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """Two real gloo processes (torchrun, ACCELERATE_USE_CPU), same global batch: same losses and weights.
    The world size is asserted from inside the run (each metrics record holds Accelerate's count)."""
    args = ("--config", TINY, "train.max_steps=2", "train.ema_decay=0", "log.sample_every=0")
    run_inprocess("train_dit.py", *args, f"output_dir={tmp_path / 'one'}")
    two = run_torchrun("train_dit.py", *args, f"output_dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr[-3000:]
    one_records, two_records = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["num_processes"] for r in one_records] == [1, 1]
    assert [r["num_processes"] for r in two_records] == [2, 2]
    loss_one = torch.tensor([r["loss"] for r in one_records])
    loss_two = torch.tensor([r["loss"] for r in two_records])
    torch.testing.assert_close(loss_two, loss_one, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(final_weights(tmp_path / "one"), final_weights(tmp_path / "two")) < 1e-5


def test_launcher_processes_that_accelerate_does_not_join_fail_fast(tmp_path, monkeypatch):
    """E.g. an FSDP/DDP launch config on a CPU machine: WORLD_SIZE=2, but each process is alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 but Accelerate sees a single process"):
        train(tmp_path, "train.max_steps=1")
    assert not (tmp_path / "config.yaml").exists()  # nothing written


@pytest.mark.parametrize("attention, blocks", [("softmax", None), ("linear", (1, 1)), ("mhla", (2, 2))])
def test_attention_types_share_everything_else(attention, blocks):
    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask

    cfg = load_config(DiTRunConfig, TINY, [f"model.attention={attention}"])
    model = DiTTask(cfg).build_transformer()
    assert (getattr(model, "mhla_config", None) and model.mhla_config.blocks) == blocks
    assert model.config.num_layers == 2 and model.config.num_embeds_ada_norm == 1000


def test_folder_with_vae_and_latent_cache(tmp_path):
    """Class folder encoded on the fly by a (tiny) AutoencoderKL, then the same via extract_latents."""
    import numpy as np
    from PIL import Image

    from mhla_gen.testing import tiny_autoencoder_kl

    tiny_autoencoder_kl().save_pretrained(tmp_path / "vae")
    for i in range(4):
        (tmp_path / "data" / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        arr = np.random.default_rng(i).integers(0, 255, (20, 24, 3), dtype=np.uint8)
        Image.fromarray(arr).save(tmp_path / "data" / f"class{i % 2}" / f"{i}.png")
    common = (
        "data.resolution=16",
        "data.hflip=true",
        "model.num_classes=2",
        "train.global_batch_size=2",
        "train.max_steps=2",
        "log.sample_every=0",
    )
    train(
        tmp_path / "run_folder",
        "data.source=folder",
        f"data.path={tmp_path / 'data'}",
        f"data.vae={tmp_path / 'vae'}",
        *common,
    )
    assert (tmp_path / "run_folder" / "samples" / "step_0000002.png").is_file()  # decoded by the VAE

    run_inprocess(
        "extract_latents.py",
        "--data",
        str(tmp_path / "data"),
        "--out",
        str(tmp_path / "latents"),
        "--vae",
        str(tmp_path / "vae"),
        "--resolution",
        "16",
        "--device",
        "cpu",
    )
    train(
        tmp_path / "run_latents",
        "data.source=latents",
        f"data.path={tmp_path / 'latents'}",
        f"data.vae={tmp_path / 'vae'}",
        *common,
    )
    assert [r["step"] for r in read_metrics(tmp_path / "run_latents")] == [1, 2]


def test_missing_data_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        train(tmp_path, "data.source=folder", f"data.path={tmp_path / 'no_such_folder'}", "data.vae=null")


def test_checkpoint_not_matching_config(reference_run, tmp_path):
    shutil.copytree(reference_run / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(ValueError, match="mhla"):
        train(tmp_path, "train.max_steps=6", "mhla.blocks=[1,2]")
    with pytest.raises(ValueError, match="architecture"):
        train(tmp_path, "train.max_steps=6", "model.depth=3")


def test_ddpm_loss_is_zero_for_the_true_posterior():
    """Perfect ε and the variance head at β̃_t (v = -1): MSE = 0 and KL = 0 for t > 0; v = +1 costs bits."""
    from diffusers import DDPMScheduler

    from mhla_gen.train.objectives import DDPMLoss

    sched = DDPMScheduler(num_train_timesteps=1000, variance_type="learned_range", clip_sample=False)
    loss = DDPMLoss(sched)
    x0, noise = torch.rand(3, 2, 4, 4) * 2 - 1, torch.randn(3, 2, 4, 4)
    t = torch.tensor([1, 500, 999])
    xt = sched.add_noise(x0, noise, t)
    perfect = torch.cat([noise, -torch.ones_like(noise)], dim=1)
    assert loss(perfect, x0, xt, noise, t).item() == pytest.approx(0.0, abs=1e-4)
    wrong_var = torch.cat([noise, torch.ones_like(noise)], dim=1)
    assert loss(wrong_var, x0, xt, noise, t).item() > 1e-3


def test_ddpm_loss_min_snr_weighting():
    """diffusion.snr_gamma: the ε term of each sample weighted by min(SNR_t, γ) / SNR_t (Min-SNR-γ, as
    diffusers' training examples' --snr_gamma for ε prediction); off it is the plain mean, bit for bit;
    the variance term is not weighted."""
    from diffusers import DDPMScheduler

    from mhla_gen.train.objectives import DDPMLoss

    sched = DDPMScheduler(num_train_timesteps=1000, variance_type="learned_range", clip_sample=False)
    x0, noise = torch.rand(3, 2, 4, 4) * 2 - 1, torch.randn(3, 2, 4, 4)
    t = torch.tensor([3, 200, 900])  # SNR above γ, near it, far below
    xt = sched.add_noise(x0, noise, t)
    eps = noise + 0.1 * torch.randn_like(noise)
    per_sample = ((eps - noise) ** 2).mean(dim=(1, 2, 3))
    snr = (sched.alphas_cumprod / (1 - sched.alphas_cumprod))[t].double()
    weight = (snr.clamp(max=5.0) / snr).float()
    assert weight[0] < 0.1 and weight[2] == 1.0
    torch.testing.assert_close(DDPMLoss(sched, learn_sigma=False, snr_gamma=5.0)(eps, x0, xt, noise, t),
                               (weight * per_sample).mean(), rtol=1e-6, atol=0)
    assert torch.equal(DDPMLoss(sched, learn_sigma=False)(eps, x0, xt, noise, t), per_sample.mean())
    with_var = torch.cat([eps, torch.zeros_like(eps)], dim=1)
    vb = DDPMLoss(sched)(with_var, x0, xt, noise, t) - per_sample.mean()
    torch.testing.assert_close(DDPMLoss(sched, snr_gamma=5.0)(with_var, x0, xt, noise, t),
                               (weight * per_sample).mean() + vb, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="diffusion.snr_gamma"):
        from mhla_gen.train.config import DiffusionConfig

        DiffusionConfig(snr_gamma=0.0)


def test_ddpm_learned_range_matches_diffusers_scheduler():
    """Our interpolated log-variance is the one DDPMScheduler uses when sampling (t > 0)."""
    from diffusers import DDPMScheduler

    from mhla_gen.train.objectives import DDPMLoss

    sched = DDPMScheduler(num_train_timesteps=1000, variance_type="learned_range", clip_sample=False)
    sched.set_timesteps(1000)
    loss = DDPMLoss(sched)
    for t in (5, 300, 999):
        v = torch.tensor([0.3])
        frac = (v + 1) / 2
        ours = frac * loss.tables["log_betas"][t] + (1 - frac) * loss.tables["post_log_var"][t]
        theirs = sched._get_variance(t, predicted_variance=v)  # diffusers returns the log-variance here
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-5)


def test_resume_from_explicit_checkpoint_path(reference_run, tmp_path):
    shutil.copytree(reference_run / "checkpoints" / "checkpoint_4", tmp_path / "ckpt4")
    train(tmp_path / "run", "train.max_steps=5", f"resume={tmp_path / 'ckpt4'}")
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [5]
    assert max_abs_diff(final_weights(tmp_path / "run"), final_weights(reference_run)) == 0.0
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        train(tmp_path / "run2", f"resume={tmp_path}")


def save_pretrained_dit(folder):
    """A pretrained softmax DiT for the tiny config's data (default init, not adaLN-zero), saved as a
    pipeline's ``transformer/`` under ``folder``; returns the model."""
    from diffusers import DiTTransformer2DModel

    pretrained = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=1,
                                       out_channels=2, num_layers=2, sample_size=8, patch_size=2)
    pretrained.save_pretrained(folder / "transformer")
    return pretrained


def test_init_from_pretrained_softmax_dit(tmp_path):
    """The paper's fast adaptation: a pretrained (softmax) DiT's weights, MHLA installed on top."""

    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask

    pretrained = save_pretrained_dit(tmp_path / "dit")
    cfg = load_config(DiTRunConfig, TINY, [f"model.init_from={tmp_path / 'dit'}"])
    model = DiTTask(cfg).build_transformer()
    assert model.mhla_config.blocks == (2, 2)
    for name, p in pretrained.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], p, rtol=0, atol=0)
    cfg = load_config(DiTRunConfig, TINY, [f"model.init_from={tmp_path / 'dit'}", "data.resolution=16"])
    with pytest.raises(ValueError, match="init_from"):
        DiTTask(cfg).build_transformer()


def test_lora_stage2_merges_into_final_keeps_the_base_and_resumes_exactly(tmp_path):
    """train.trainable=lora on a pretrained DiT: the adapter (q/k/v/out) and MHLA train, every other weight
    stays the pretrained one; final/ is a plain MHLA DiT folder with the adapter merged in; a split run
    ends bit-identical to a whole one; a full-parameter run refuses the LoRA checkpoint."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import load_file

    from mhla_gen import load_transformer
    from mhla_gen.integration.install import is_mhla_installed

    pretrained = save_pretrained_dit(tmp_path / "dit")
    lora = (f"model.init_from={tmp_path / 'dit'}", "train.trainable=lora", "train.lora_rank=2",
            "train.lora_alpha=4", "log.sample_every=0")
    train(tmp_path / "whole", *lora, "train.max_steps=3")
    train(tmp_path / "split", *lora, "train.max_steps=2")
    train(tmp_path / "split", *lora, "train.max_steps=3")  # resume=latest: step 3 only
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == [1, 2, 3]
    assert max_abs_diff(final_weights(tmp_path / "split"), final_weights(tmp_path / "whole")) == 0.0

    final, base = final_weights(tmp_path / "whole"), pretrained.state_dict()
    assert not any("lora" in k or "base_layer" in k for k in final)
    adapted = [k for k in base if any(f".{p}.weight" in k for p in ("to_q", "to_k", "to_v", "to_out.0"))]
    assert len(adapted) == 4 * 2 and all(not torch.equal(final[k], base[k]) for k in adapted)
    assert all(torch.equal(final[k], base[k]) for k in base if k not in adapted)  # the rest frozen
    model = load_transformer(tmp_path / "whole" / "final")
    assert is_mhla_installed(model) and not any(isinstance(m, BaseTunerLayer) for m in model.modules())
    state = load_file(tmp_path / "whole" / "checkpoints" / "checkpoint_3" / "model.safetensors")
    assert any("lora_B" in k for k in state)

    with pytest.raises(ValueError, match="lora"):
        train(tmp_path / "split", f"model.init_from={tmp_path / 'dit'}", "train.max_steps=4")


@pytest.mark.parametrize("attention", ["softmax", "mhla"])
def test_bf16_mixed_precision_with_gradient_checkpointing(tmp_path, attention):
    train(
        tmp_path,
        "train.max_steps=1",
        "train.mixed_precision=bf16",
        "train.gradient_checkpointing=true",
        f"model.attention={attention}",
        "log.sample_every=0",
    )
    assert torch.isfinite(torch.tensor(read_metrics(tmp_path)[0]["loss"]))


# ----------------------------------------------------------------- output folders and where a run starts
def test_output_dir_with_other_files_is_refused(tmp_path):
    from mhla_gen.errors import ConfigError

    (tmp_path / "metrics.jsonl").write_text("my own notes\n")  # a name we write, but this is not our folder:
    (tmp_path / "photo.png").write_bytes(b"mine")  # the unrelated file says so
    with pytest.raises(ConfigError, match=r"output_dir=.* not empty .*photo\.png"):
        train(tmp_path, "train.max_steps=1")
    assert (tmp_path / "metrics.jsonl").read_text() == "my own notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "photo.png"]


def test_restart_without_checkpoint_drops_the_interrupted_runs_records(reference_run, tmp_path):
    """resume=latest, no checkpoint yet (killed before the first one): the run starts at step 0 and its
    records replace the interrupted run's, instead of being appended after them (1..5 then 1..3)."""
    from mhla_gen.outputs.folders import write_marker

    write_marker(tmp_path, "run")
    stale = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(stale)
    train(tmp_path, "train.max_steps=3")
    records = read_metrics(tmp_path)
    reference = read_metrics(reference_run)[:3]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]


def test_restart_refused_where_it_would_mix_runs(reference_run, tmp_path):
    from mhla_gen.errors import ConfigError

    shutil.copytree(reference_run, tmp_path / "done")
    shutil.rmtree(tmp_path / "done" / "checkpoints")  # a finished run whose checkpoints were deleted
    with pytest.raises(ConfigError, match="finished run .*choose another output_dir"):
        train(tmp_path / "done", "train.max_steps=6")
    shutil.copytree(reference_run, tmp_path / "old")  # checkpoints 4 and 5 would outlive a fresh start
    with pytest.raises(ConfigError, match=r"later checkpoints \['checkpoint_4', 'checkpoint_5'\]"):
        train(tmp_path / "old", "train.max_steps=3", "resume=none")
    assert read_metrics(tmp_path / "old") == read_metrics(reference_run)  # untouched


def _snapshot(folder):
    """{relative path: (bytes, mtime)} of every file under ``folder``."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_below_the_checkpoints_step_is_refused(reference_run, tmp_path):
    """train.max_steps=4 on a folder whose latest checkpoint is step 5: refused (it would otherwise write
    final/ at step 5 under a config.yaml that says 4), nothing written."""
    shutil.copytree(reference_run, tmp_path / "run")
    before = _snapshot(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"train\.max_steps=4 is below step 5 of the checkpoint"):
        train(tmp_path / "run", "train.max_steps=4")
    assert _snapshot(tmp_path / "run") == before


@pytest.mark.parametrize("damage", ["truncate", "delete", "garble_state", "cut_archive_listed",
                                    "cut_safetensors_listed"])
def test_damaged_checkpoint_is_named_in_one_error_and_kept(reference_run, tmp_path, damage):
    """A checkpoint damaged by hand (a truncated or missing file, a trainer_state.json that does not
    parse): a ConfigError naming the file, before anything is written; nothing is deleted."""
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    latest = out / "checkpoints" / "checkpoint_5"
    if damage == "truncate":
        name, message = "model.safetensors", "has 1000 bytes"
        with open(latest / name, "r+b") as f:
            f.truncate(1000)
    elif damage == "delete":
        name, message = "optimizer.bin", "is missing"
        (latest / name).unlink()
    elif damage in ("cut_archive_listed", "cut_safetensors_listed"):  # listed at the cut size (as an
        from mhla_gen.outputs.folders import seal  # adoption did): the file itself shows the damage

        name, message = (("optimizer.bin", "is cut short") if damage == "cut_archive_listed"
                         else ("model.safetensors", "does not read"))
        with open(latest / name, "r+b") as f:
            f.truncate(1000)
        seal(latest)
    else:
        name, message = "trainer_state.json", "does not read"
        text = (latest / name).read_text()
        (latest / name).write_text("{" + text[1:-1] + " ")  # same size, not JSON
    before = _snapshot(out)
    pattern = rf"resume=latest: checkpoint file .*checkpoint_5/{name}' {message}"
    with pytest.raises(ConfigError, match=pattern):
        train(out, "train.max_steps=6")
    assert _snapshot(out) == before


@pytest.mark.parametrize("record", ["checkpoint", "config_yaml"])
@pytest.mark.parametrize(
    "override",
    ["train.optimizer=adafactor", "train.trainable=mhla", "train.ema_decay=0", "train.ema_decay=0.5"],
)
def test_resume_with_another_optimizer_trainable_or_ema_is_refused(reference_run, tmp_path, override, record):
    """The checkpoint holds the optimizer state of its trainable parameters and the EMA with its decay
    (diffusers' EMAModel keeps the saved decay): resuming with other settings crashed while loading
    (optimizer, trainable, EMA off) or silently kept the old decay; now refused, nothing written. A checkpoint
    saved before checkpoints recorded these settings is checked against its run's config.yaml."""
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    if record == "config_yaml":  # as an earlier version saved it
        state_file = out / "checkpoints" / "checkpoint_5" / "trainer_state.json"
        state = json.loads(state_file.read_text())
        del state["training"]
        state_file.write_text(json.dumps(state, indent=1))
        from mhla_gen.outputs.folders import seal

        seal(state_file.parent)
    before = _snapshot(out)
    setting, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"resume=latest: {setting}=.*{value}.* \(the checkpoint's: "):
        train(out, "train.max_steps=6", override)
    assert _snapshot(out) == before


def test_resume_path_with_a_tilde_is_the_home_folders(tmp_path, monkeypatch):
    """resume=~/... from a config file (no shell expands it) names the checkpoint in the home folder, as
    output_dir=~/... names a run there."""
    from mhla_gen.train.checkpoint import resolve_resume

    monkeypatch.setenv("HOME", str(tmp_path))
    checkpoint = tmp_path / "runs" / "checkpoints" / "checkpoint_5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 5, "signature": {}}))
    assert resolve_resume("~/runs/checkpoints/checkpoint_5", tmp_path / "new") == checkpoint


def test_config_yaml_rewritten_after_an_old_checkpoint_is_not_its_record(tmp_path):
    """A checkpoint of an earlier version (no training record) is checked against its run's config.yaml only
    while that file is not newer than it: a later start (e.g. one that crashed loading the checkpoint with
    another optimizer) rewrote config.yaml with its own values, so resuming with the checkpoint's values
    must not be refused (nor the crashing values asked for)."""
    import dataclasses
    import os

    from mhla_gen.train.checkpoint import check_training
    from mhla_gen.train.config import DiTRunConfig, config_to_yaml

    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 5, "signature": {}}))
    cfg = DiTRunConfig(output_dir=str(tmp_path / "run"))  # train.optimizer=adamw, as the checkpoint's run
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer="adafactor"))
    (tmp_path / "run" / "config.yaml").write_text(config_to_yaml(other))
    saved = (checkpoint / "trainer_state.json").stat().st_mtime_ns
    os.utime(tmp_path / "run" / "config.yaml", ns=(saved + 10**9, saved + 10**9))  # the later start's
    check_training(checkpoint, cfg)  # not refused
    os.utime(tmp_path / "run" / "config.yaml", ns=(saved - 10**9, saved - 10**9))  # the run's own start
    with pytest.raises(ConfigError, match=r"train\.optimizer='adamw' \(the checkpoint's: 'adafactor'\)"):
        check_training(checkpoint, cfg)


def test_teacher_data_folder_that_is_or_holds_the_new_run_folder_is_refused_first(tmp_path):
    """data.source=teacher: data.path (sampled by the run) equal to a new output_dir, or holding it, passed
    the start-up checks (absent paths are not compared) and was refused only when sampling began, after
    the run folder, its marker and config.yaml were written."""
    save_pretrained_dit(tmp_path / "dit")
    teacher = (f"model.init_from={tmp_path / 'dit'}", "data.source=teacher", "data.teacher_samples=8")
    with pytest.raises(ConfigError, match=r"data\.path=.*/new' is output_dir="):
        train(tmp_path / "new", *teacher, f"data.path={tmp_path / 'new'}")
    with pytest.raises(ConfigError, match=r"data\.path=.*/new' contains output_dir="):
        train(tmp_path / "new" / "run", *teacher, f"data.path={tmp_path / 'new'}")
    assert not (tmp_path / "new").exists()


def test_adopt_refuses_a_checkpoint_with_a_cut_archive(reference_run, tmp_path):
    """mhla-gen adopt run on a run folder (markers stripped, as before markers) whose checkpoint's
    optimizer.bin was cut short: refused naming the file, no marker written (it would list the cut size)."""
    from mhla_gen.commands.adopt import adopt
    from mhla_gen.outputs.folders import MARKER

    out = tmp_path / "run"
    shutil.copytree(reference_run, out, ignore=shutil.ignore_patterns(MARKER, ".mhla_gen.*"))
    with open(out / "checkpoints" / "checkpoint_5" / "optimizer.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ConfigError, match=r"first: optimizer\.bin: a torch\.save archive cut short"):
        adopt(out, "run", show=lambda line: None)
    assert not list(out.rglob(MARKER))


def _tensorboard_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_hides_the_events_past_the_checkpoint(tmp_path):
    """A run logged steps 1..3 but its last checkpoint is step 2: the resumed run's events for step 3
    replace the old ones (TensorBoard purge_step), they do not sit next to them."""
    tb = ("log.trackers=[tensorboard]", "log.sample_every=0")
    train(tmp_path, "train.max_steps=3", *tb)
    shutil.rmtree(tmp_path / "checkpoints" / "checkpoint_3")  # as if killed after logging step 3
    train(tmp_path, "train.max_steps=4", "seed=1", *tb)  # another seed: other losses from step 3 on
    records = read_metrics(tmp_path)
    scalars = _tensorboard_scalars(tmp_path / "logs" / "dit", "loss")
    assert [s for s, _ in scalars] == [1, 2, 3, 4]
    assert [v for _, v in scalars] == pytest.approx([r["loss"] for r in records], rel=1e-6)


@pytest.mark.slow
def test_resume_with_gradient_accumulation_matches_uninterrupted(tmp_path):
    """2 micro-batches per step, EMA on: 4 steps == 3 steps, then resume=latest to 4 (final weights)."""
    accumulate = ("train.gradient_accumulation_steps=2", "log.sample_every=0")
    train(tmp_path / "ref", "train.max_steps=4", *accumulate)
    train(tmp_path / "run", "train.max_steps=3", *accumulate)
    train(tmp_path / "run", "train.max_steps=4", *accumulate)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert max_abs_diff(final_weights(tmp_path / "run"), final_weights(tmp_path / "ref")) == 0.0


# ---------------------------------------------------------------------- start-up checks, short errors
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.resolution=9"], r"data\.resolution=9 .* patch size 2 does not tile"),
        (["mhla.blocks=[8,8]"], r"mhla\.blocks=\[8, 8\] does not fit DiT's 4x4 token grid"),
        (["log.every=0"], r"log\.every must be >= 1"),
        (["log.sample_steps=0"], r"log\.sample_steps must be >= 1"),
        (["diffusion.sampler=euler"], r"diffusion\.sampler must be"),
        (["model.num_classes=1001"], r"model\.num_classes must be in 1\.\.1000"),
    ],
)
def test_bad_settings_fail_before_any_work(tmp_path, overrides, message):
    from mhla_gen.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        train(tmp_path / "run", *overrides)
    assert not (tmp_path / "run").exists()


def test_class_count_and_pretrained_family_are_checked(tmp_path):
    from diffusers import SanaTransformer2DModel

    from mhla_gen.errors import ConfigError

    for i in range(3):
        (tmp_path / "data" / f"class{i}").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "data" / f"class{i}" / "a.png")
    folder = ("data.source=folder", f"data.path={tmp_path / 'data'}", "data.vae=null")
    with pytest.raises(ConfigError, match=r"model\.num_classes=10 but data\.path=.* has 3 class folders"):
        train(tmp_path / "run", *folder)
    with pytest.raises(ConfigError, match=r"eval\.fid_num_samples=8 is for data\.source=digits"):
        train(tmp_path / "run", *folder, "model.num_classes=3", "eval.fid_num_samples=8")
    SanaTransformer2DModel(
        num_attention_heads=1, attention_head_dim=8, num_layers=1, cross_attention_dim=8, caption_channels=8
    ).save_pretrained(tmp_path / "sana")
    with pytest.raises(ConfigError, match=r"model\.init_from=.* is a SanaTransformer2DModel, not a DiT"):
        train(tmp_path / "run", f"model.init_from={tmp_path / 'sana'}")
    assert not (tmp_path / "run").exists()


def test_a_cut_weight_file_is_refused_in_one_line_before_any_write(tmp_path):
    """model.init_from and a distillation teacher whose safetensors file was cut short (a download that
    stopped) are refused naming the setting and the file, before output_dir exists: the headers are read,
    not the weights."""
    from mhla_gen.errors import ConfigError
    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask

    cfg = load_config(DiTRunConfig, TINY, [f"output_dir={tmp_path / 'x'}"])
    DiTTask(cfg).build_transformer().save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cut = r"diffusion_pytorch_model\.safetensors' is not a readable safetensors file"
    with pytest.raises(ConfigError, match=rf"model\.init_from=.*cut.*: .*{cut}"):
        train(tmp_path / "run", f"model.init_from={tmp_path / 'cut'}")
    with pytest.raises(ConfigError, match=rf"train\.distill teacher .*cut.*: .*{cut}"):
        train(tmp_path / "run", "train.distill.output_weight=1", f"train.distill.teacher={tmp_path / 'cut'}")
    assert not (tmp_path / "run").exists()


def test_a_weight_file_one_tensor_short_is_refused_before_any_write(tmp_path):
    """model.init_from and a distillation teacher whose whole safetensors file lacks one tensor: diffusers
    would load it with that tensor at random (a logged warning) and the run would train from it; refused
    naming the setting and the tensor, before output_dir exists."""
    from safetensors.torch import load_file, save_file

    from mhla_gen.errors import ConfigError
    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask

    cfg = load_config(DiTRunConfig, TINY, [f"output_dir={tmp_path / 'x'}", "model.attention=softmax"])
    DiTTask(cfg).build_transformer().save_pretrained(tmp_path / "short")  # stock: diffusers loads it
    weights = tmp_path / "short" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if k != "proj_out_2.weight"}, weights)
    short = r"do not fit its config\.json: missing 1 \(proj_out_2\.weight\)"
    with pytest.raises(ConfigError, match=rf"model\.init_from=.*short.*: .*{short}"):
        train(tmp_path / "run", f"model.init_from={tmp_path / 'short'}")
    with pytest.raises(ConfigError, match=rf"train\.distill teacher .*short.*: .*{short}"):
        train(tmp_path / "run", "train.distill.output_weight=1",
              f"train.distill.teacher={tmp_path / 'short'}")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_config_errors_are_one_line_exit_2(tmp_path):
    bad = run_subprocess("train_dit.py", "--config", TINY, f"output_dir={tmp_path}", "train.max_stepz=3")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    assert "train_dit.py: error: invalid config on the command line: Key 'max_stepz'" in bad.stderr
    assert "Did you mean: 'max_steps'?" in bad.stderr


# ------------------------------------------------------------------------- the step on an accelerator
class CrossDeviceCopies:
    """Records every copy between device types (``aten._to_copy`` / ``copy_``) made inside the context."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
                    src = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
                    dst = args[0] if func.overloadpacket is torch.ops.aten.copy_ else out
                    if src.device.type != dst.device.type:
                        seen.append(f"{func}: {src.device} -> {dst.device} {tuple(src.shape)}")
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_cross_device_copy_detector_sees_copies():
    with CrossDeviceCopies() as copies:
        torch.ones(3).to("meta")
        torch.empty(2, device="meta").copy_(torch.zeros(2))
        torch.ones(3).add(1)  # not a copy
    assert len(copies.seen) == 2


def test_step_random_is_the_global_draw_sliced_per_process():
    from mhla_gen.train.randomness import StepRandom

    one = StepRandom(seed=3, micro_step=7, local_batch=4)
    full = (one.rand(), one.randint(10), one.randn(2, 3), one.normal(0.5, 2.0))
    generator = torch.Generator()  # the loop's: re-seeded every micro-step
    for rank in range(2):
        mine = StepRandom(3, 7, 2, rank=rank, world=2, generator=generator)
        part = (mine.rand(), mine.randint(10), mine.randn(2, 3), mine.normal(0.5, 2.0))
        for a, b in zip(part, full):
            assert torch.equal(a, b[2 * rank : 2 * rank + 2])
    assert not torch.equal(StepRandom(3, 8, 4).rand(), full[0])  # another micro-step, other numbers


@pytest.mark.gpu
def test_dit_loss_makes_no_host_to_device_copies():
    """Random draws on the device from a re-seeded device generator, DDPM tables kept on the device:
    after the first micro-step (tables moved once), the loss computation copies nothing to the GPU.
    The model's own forward is left out (its processors are not this test's subject)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask
    from mhla_gen.train.randomness import StepRandom

    task = DiTTask(load_config(DiTRunConfig, TINY))
    model = task.build_transformer().cuda()

    def forward_outside_the_check(*args, **kwargs):
        with _disable_current_modes():
            return model(*args, **kwargs)

    batch = {"pixels": torch.randn(8, 1, 8, 8, device="cuda"), "class_labels": torch.arange(8, device="cuda")}
    generator = torch.Generator("cuda")
    task.loss(forward_outside_the_check, batch, StepRandom(0, 0, 8, device="cuda", generator=generator))
    with CrossDeviceCopies() as copies:
        for micro in (1, 2):
            rnd = StepRandom(0, micro, 8, device="cuda", generator=generator)
            task.loss(forward_outside_the_check, batch, rnd)
    assert copies.seen == []


def test_default_dataloader_workers_fit_the_machine():
    """train.num_workers=-1 (the default) never asks for more workers than CPUs (torch warns then)."""
    import os

    from mhla_gen.train.config import TrainConfig
    from mhla_gen.train.loop import _num_workers

    assert TrainConfig().num_workers == -1
    assert 1 <= _num_workers(-1) <= min(4, len(os.sched_getaffinity(0)))
    assert _num_workers(0) == 0 and _num_workers(3) == 3


def test_final_weights_are_written_before_the_final_sampling(tmp_path, monkeypatch):
    """Whatever start-up checks miss, a failure in the last sample grid keeps the trained weights."""
    from mhla_gen.train.dit import DiTTask

    def broken(self, transformer):
        raise RuntimeError("sampler broke")

    monkeypatch.setattr(DiTTask, "sample_images", broken)
    with pytest.raises(RuntimeError, match="sampler broke"):
        train(tmp_path, "train.max_steps=1")
    assert (tmp_path / "final" / "diffusion_pytorch_model.safetensors").is_file()


def test_validate_leaves_the_config_alone_and_run_config_records_the_saved_mhla(tmp_path):
    """Starting from a folder saved with MHLA: validate() changes nothing in the config; the attention
    the run trains (the saved MHLA) is what run_config() (config.yaml) records."""
    import copy

    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask

    saved = DiTTask(load_config(DiTRunConfig, TINY, ["mhla.blocks=[1,2]", "mhla.layers=[1]"]))
    saved.build_transformer().save_pretrained(tmp_path / "start")
    cfg = load_config(DiTRunConfig, TINY, [f"model.init_from={tmp_path / 'start'}", "model.attention=linear"])
    before = copy.deepcopy(cfg)
    task = DiTTask(cfg)
    task.validate()
    assert cfg == before
    resolved = task.run_config()
    assert resolved.model.attention == "mhla"
    assert resolved.mhla.blocks == (1, 2) and resolved.mhla.layers == [1]
    assert task.start.saved == resolved.mhla and task.start.teacher() is None  # a trained MHLA, no teacher
