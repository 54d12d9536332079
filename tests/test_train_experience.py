"""What a run shows people (tiny DiT, in-process): the start-of-run summary, metrics and sample grids in
TensorBoard, the LR schedule setting, and tracker / schedule mistakes refused at start-up."""

from __future__ import annotations

import logging

import pytest
from train_helpers import REPO, read_metrics, run_inprocess

from mhla_gen.errors import ConfigError

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "dit.yaml")


def _tensorboard(folder) -> dict:
    """``{"scalars": {tag: [(step, value)]}, "images": {tag: [step]}}`` of every event file under folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {"scalars": {}, "images": {}}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found["scalars"].setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        for tag in acc.Tags()["images"]:
            found["images"].setdefault(tag, []).extend(e.step for e in acc.Images(tag))
    return found


def test_summary_tensorboard_grids_and_lr_schedule(tmp_path, caplog):
    """3 steps, linear schedule with 1 warm-up step: lr after steps 1..3 = 1, 0.5, 0 x learning_rate
    (diffusers' linear: warm-up s/w, then (T - s) / (T - w)); loss and lr scalars and the sample grids of
    steps 2 and 3 reach TensorBoard; the summary names the parameter counts and batch sizes."""
    caplog.set_level(logging.INFO, logger="mhla_gen.train.loop")
    run_inprocess(
        "train_dit.py", "--config", TINY, f"output_dir={tmp_path}", "train.max_steps=3", "log.sample_every=2",
        "log.trackers=[tensorboard]", "train.lr_scheduler=linear", "train.lr_warmup_steps=1",
    )
    lrs = [r["lr"] for r in read_metrics(tmp_path)]
    assert lrs == pytest.approx([1e-3, 5e-4, 0.0], abs=1e-12)

    from mhla_gen import load_transformer

    total = sum(p.numel() for p in load_transformer(tmp_path / "final").parameters())
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary"))
    assert f"{total:,} total, {total:,} trainable" in summary
    assert "8 per device x 1 processes x 1 accumulation = 8 global" in summary
    assert "1,797 items" in summary and "linear schedule" in summary and str(tmp_path) in summary

    board = _tensorboard(tmp_path / "logs")
    assert [step for step, _ in board["scalars"]["loss"]] == [1, 2, 3]
    assert [v for _, v in board["scalars"]["lr"]] == pytest.approx(lrs, abs=1e-9)
    assert sorted(board["images"]["samples"]) == [2, 3]


def test_wandb_offline_gets_metrics_and_sample_grids(tmp_path, monkeypatch):
    """log.trackers=[wandb] with WANDB_MODE=offline (the [wandb] extra; skipped where it is not installed):
    the offline run lives under output_dir/logs and holds the sample grid of the last step."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_inprocess("train_dit.py", "--config", TINY, f"output_dir={tmp_path}", "train.max_steps=2",
                  "log.trackers=[wandb]")
    (run,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb"))
    images = (run / "files" / "media" / "images").iterdir()
    assert [p.name.split("_")[:2] for p in images] == [["samples", "2"]]


def test_missing_tracker_package_is_a_startup_error(tmp_path, monkeypatch):
    """Accelerate would warn and train untracked: here the run stops before anything is written."""
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    with pytest.raises(ConfigError, match=r"wandb is not installed \(pip install wandb\)"):
        run_inprocess("train_dit.py", "--config", TINY, f"output_dir={tmp_path}", "log.trackers=[wandb]")
    assert not tmp_path.joinpath("config.yaml").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("log.trackers=[tensorbord]", "log.trackers: unknown"),
        ("train.lr_scheduler=cosine_annealing", "train.lr_scheduler must be one of"),
        ("train.lr_scheduler=piecewise_constant", "train.lr_scheduler must be one of"),
        ("train.lr_num_cycles=0", "train.lr_num_cycles must be >= 1"),
    ],
)
def test_tracker_and_schedule_settings_are_checked(override, message):
    from mhla_gen.train.config import DiTRunConfig, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(DiTRunConfig, TINY, [override])
