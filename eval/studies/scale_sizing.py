"""The scale study's sizing (``eval/scale_study.py --sizing-only``): the training images/s of every arm at
every grid, measured on the device, written to a file that sizes the study's budget (``--sizing``) and
read back checked against the grids it is used for."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mhla_gen.errors import ConfigError
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.dit_flops import train_flops_per_image

from .scale_preset import ARMS, GRIDS, arm_config, grid_model, tokens

SIZING_FORMAT = "mhla_gen scale-study sizing"


def random_inputs(batch: int, resolution: int, channels: int, device: str) -> dict:
    """Seeded random DiT inputs on ``device``: ``hidden_states`` ``(B, C, R, R)``, ``timestep`` and
    ``class_labels`` ``(B,)``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, resolution, resolution, generator=gen).to(device)  # (B, C, R, R)
    t = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    return {"hidden_states": x, "timestep": t, "class_labels": y}


def timed_calls(call, device: str, seconds: float, warmup: int) -> tuple[int, float]:
    """``(calls, seconds)``: ``call()`` run ``warmup`` times untimed (kernel compilation, allocator), then
    for about ``seconds`` (at least 3 calls), the device synchronised before each clock reading."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call()
    sync()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < seconds:
        call()
        calls += 1
        if calls % 4 == 0:  # the host may not queue far ahead of the device: the clock reads both
            sync()
    sync()
    return calls, time.perf_counter() - start


def measure_training(build, batch: int, resolution: int, channels: int, device: str,
                     dtype: torch.dtype | None = None, seconds: float = 3.0, warmup: int = 3) -> dict:
    """Training images/s of ``build()`` on ``device``: forward (under autocast to ``dtype`` when given),
    the ε-loss backward, gradient clipping and an AdamW step on random pixels, after ``warmup`` steps
    (kernel compilation, allocator), timed for about ``seconds`` (at least 3 steps; CUDA synchronised).
    No data loading, EMA or logging: a bound on what the training loop reaches with the same model."""
    model = build().to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, kind = random_inputs(batch, resolution, channels, device), torch.device(device).type

    def step():
        with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(**inputs).sample
        out.float()[:, :channels].square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps, elapsed = timed_calls(step, device, seconds, warmup)
    peak = torch.cuda.max_memory_allocated() / 2**30 if kind == "cuda" else math.nan
    return {"images_per_s": steps * batch / elapsed, "steps": steps, "seconds": elapsed, "peak_gib": peak}


@torch.no_grad()
def measure_inference(build, batch: int, resolution: int, channels: int, device: str,
                      dtype: torch.dtype | None = None, seconds: float = 1.0, warmup: int = 2) -> float:
    """Forward images/s of ``build()`` in eval mode on ``device`` (under autocast to ``dtype`` when
    given) at ``batch``: what the evaluations (validation loss, sampling steps) cost per image."""
    model = build().to(device).eval()
    inputs, kind = random_inputs(batch, resolution, channels, device), torch.device(device).type

    def forward():
        with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            model(**inputs)

    calls, elapsed = timed_calls(forward, device, seconds, warmup)
    return calls * batch / elapsed


INFER_BATCH = 128  # the validation loss's batch (studies.validation_loss.triple_losses)


def sizing(grids: list[str], device: str, precision: str, seconds: float,
           done: Callable[[dict], None] | None = None) -> dict:
    """Training and forward images/s and FLOPs per image of every arm at every grid
    (:func:`measure_training`, :func:`measure_inference`: the model alone, one process), with the
    achieved training TFLOP/s. ``done(record)`` after every row with the record so far (the rows measured
    until then): a row that fails later leaves the earlier ones written."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    rows = []
    record = {"format": SIZING_FORMAT, "device": device_name(device), "precision": precision,
              "model": {n: grid_model(GRIDS[n]) for n in grids}, "rows": rows}
    for name in grids:
        grid = GRIDS[name]
        for arm in ARMS:
            cfg = arm_config(grid, arm, precision)
            flops = train_flops_per_image(cfg)["train"]
            build = DiTTask(cfg).build_transformer
            speed = measure_training(build, grid["batch"], grid["resolution"], 3, device, dtype, seconds)
            infer = measure_inference(build, INFER_BATCH, grid["resolution"], 3, device, dtype, seconds / 2)
            rows.append({"grid": name, "tokens": tokens(grid), "arm": arm.name, "batch": grid["batch"],
                         "flops_per_image": flops, **speed, "tflops": speed["images_per_s"] * flops / 1e12,
                         "infer_images_per_s": infer})
            logging.info("sizing %s tokens %s: %.1f images/s", tokens(grid), arm.name, speed["images_per_s"])
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            if done is not None:
                done(record)
    return record


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if torch.device(device).type == "cuda" else "cpu"


def load_sizing(path: Path) -> dict:
    """The record of the ``--sizing-only`` file ``path`` (``ConfigError`` naming ``--sizing`` for any other
    file: not JSON, not an object, no sizing format)."""
    try:
        record = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = None
    if not isinstance(record, dict) or record.get("format") != SIZING_FORMAT:
        raise ConfigError(f"--sizing {str(path)!r} is not a sizing file of eval/scale_study.py; nothing "
                          "was changed")
    return record


def read_sizing(path: Path, grids: list[str], column: str = "images_per_s") -> dict[tuple[str, str], float]:
    """``{(grid, arm): images/s}`` from a ``--sizing-only`` file (``column``: ``images_per_s`` training,
    ``infer_images_per_s`` forward), checked against this preset's model and batch (a file measured for
    another model, or without the column, is refused)."""
    if not path.is_file():
        raise FileNotFoundError(f"--sizing {str(path)!r} does not exist (write it with --sizing-only)")
    record = load_sizing(path)
    found = {(r["grid"], r["arm"]): r for r in record["rows"]}
    for name in grids:
        if record["model"].get(name) != grid_model(GRIDS[name]):
            raise ConfigError(f"--sizing {str(path)!r} measured grid {name} with model "
                              f"{record['model'].get(name)}, not {grid_model(GRIDS[name])}")
        for arm in ARMS:
            row = found.get((name, arm.name))
            if row is None or row["batch"] != GRIDS[name]["batch"]:
                raise ConfigError(f"--sizing {str(path)!r} has no {arm.name} row at grid {name} with batch "
                                  f"{GRIDS[name]['batch']}")
            if column not in row:
                raise ConfigError(f"--sizing {str(path)!r} has no {column} (an older file): measure again "
                                  "with --sizing-only")
    return {key: row[column] for key, row in found.items() if column in row}


def sizing_table(measured: dict) -> str:
    """The measurements of :func:`sizing` as a Markdown table, one row per grid and arm."""
    lines = ["| tokens | arm | batch | training images/s | forward images/s | GFLOPs / image | TFLOP/s | "
             "peak GiB |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['arm']} | {r['batch']} | {r['images_per_s']:.1f} | "
              f"{r.get('infer_images_per_s', math.nan):.1f} | {r['flops_per_image'] / 1e9:.4g} | "
              f"{r['tflops']:.3g} | {r['peak_gib']:.1f} |" for r in measured["rows"]]
    return "\n".join(lines)
