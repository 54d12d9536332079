"""The softmax / linear / MHLA study's runs (``eval/study.py``): the base config and model, the grids
(data, budget, blocks), the main arms, the ablations and the arms run only when named, every run's config
overrides, and the throughput of the three attentions timed side by side. ``eval/adaptation.py`` converts
models of this size (:data:`MODEL`) with the same base config (:data:`CONFIG`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from mhla_gen.configs import CONFIG_DIR
from mhla_gen.errors import ConfigError
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask

from .experiments import SHAPES_RECIPE, Arm

CONFIG = str(CONFIG_DIR / "dit_digits.yaml")  # the main job's config (mhla_gen.configs)

MODEL = dict(hidden_size=64, depth=4, heads=4, patch_size=2)
GRIDS = {  # grid -> data and budget (the digits: about an hour of 2 CPU cores per grid, see README)
    "64": dict(resolution=16, blocks=(2, 2), steps=1500, batch=32, fid_samples=1000, sample_steps=20),
    "256": dict(resolution=32, blocks=(4, 4), steps=1200, batch=32, fid_samples=500, sample_steps=10),
    # shapes at 256 tokens: 4800 steps, since MHLA with 4x4 blocks draws the mirror symmetry only after
    # 2400 (symmetric 0 at 2400, 0.17-0.29 at 4800 in 3 seeds: docs/results/mhla_vs_softmax.md, 2026-11-27)
    "shapes-256": dict(data="shapes", resolution=32, blocks=(4, 4), steps=4800, batch=32, fid_samples=500,
                       sample_steps=10, recipe=SHAPES_RECIPE),
    "shapes-1024": dict(data="shapes", resolution=64, blocks=(4, 4), steps=2400, batch=16, fid_samples=300,
                        sample_steps=10, recipe=SHAPES_RECIPE),
    # --quick: CI-sized (about 10 min of 2 cores): the main arms, 2 seeds, no ablations
    "quick": dict(resolution=16, blocks=(2, 2), steps=300, batch=32, fid_samples=300, sample_steps=10),
    "shapes-quick": dict(data="shapes", resolution=32, blocks=(4, 4), steps=200, batch=32, fid_samples=200,
                         sample_steps=10, recipe=SHAPES_RECIPE),
    # --smoke: seconds, a tiny model (the tests)
    "smoke": dict(resolution=8, blocks=(2, 2), steps=4, batch=8, fid_samples=20, sample_steps=2, tiny=True,
                  val_triples=32),
    "shapes-smoke": dict(data="shapes", resolution=32, blocks=(2, 2), steps=4, batch=8, fid_samples=20,
                         sample_steps=2, tiny=True, patch=8, val_triples=32, recipe=SHAPES_RECIPE),
}
TINY_MODEL = dict(hidden_size=16, depth=1, heads=2, patch_size=2)
MAIN_ARMS = [Arm("softmax", ("model.attention=softmax",)), Arm("linear", ("model.attention=linear",)),
             Arm("mhla", ("model.attention=mhla",))]
ABLATIONS = [  # each against plain MHLA, same seeds
    Arm("mhla-uniform-init", ("model.attention=mhla", "mhla.mixing_init=uniform"), "ablation"),
    Arm("mhla-fixed-mixing", ("model.attention=mhla", "mhla.mixing_learnable=false"), "ablation"),
    Arm("mhla+cpe", ("model.attention=mhla", "mhla.cpe_kernel=3"), "ablation"),
    Arm("mhla+gate", ("model.attention=mhla", "mhla.gate=true"), "ablation"),
]
# MHLA keeping one softmax layer, layer L (layer 0 is the release's pattern; mhla.layers is filled in per
# model depth): run only when named (--ablations mhla+softmax@1)
HYBRIDS = [Arm(f"mhla+softmax@{i}", ("model.attention=mhla", f"mhla.layers=@keep{i}"), "ablation")
           for i in range(MODEL["depth"])]
# MHLA with more, smaller blocks (the paper's M) at 256 tokens, [rows, columns] of blocks: 8x8 blocks of 2x2
# tokens (M^2 = 4096 > N); 16x16 blocks of one token (the learned mixing alone can place every token);
# and blocks of two tokens one column wide (8x16) or one row tall (16x8), which tell whether the shapes'
# left-right mirror needs blocks one column wide: run only when named
BLOCK_ARMS = [Arm(f"mhla-blocks{a}x{b}", ("model.attention=mhla", f"mhla.blocks=[{a},{b}]"), "ablation")
              for a, b in ((8, 8), (16, 16), (8, 16), (16, 8))]
NAMED_ONLY = [*HYBRIDS, *BLOCK_ARMS]


def with_layers(arm: Arm, depth: int) -> Arm:
    """``arm`` with ``mhla.layers=@keepL`` made the MHLA layers of a depth-``depth`` model that keeps
    layer ``L`` as softmax."""
    keep = [o for o in arm.overrides if o.startswith("mhla.layers=@keep")]
    if not keep:
        return arm
    layer = int(keep[0].removeprefix("mhla.layers=@keep"))
    if depth < 2 or layer >= depth:
        raise ConfigError(f"--ablations {arm.name}: the model has {depth} layer(s); keeping layer {layer} "
                          "as softmax needs it to exist and at least one MHLA layer beside it")
    layers = f"mhla.layers=[{','.join(str(i) for i in range(depth) if i != layer)}]"
    return Arm(arm.name, tuple(layers if o == keep[0] else o for o in arm.overrides), arm.group)


def check_blocks(arm: Arm, side: int) -> Arm:
    """``arm``, refused when its own ``mhla.blocks=[a,b]`` asks for more blocks per axis than the
    ``side`` x ``side`` token grid has tokens."""
    for o in arm.overrides:
        if o.startswith("mhla.blocks="):
            blocks = [int(b) for b in o.removeprefix("mhla.blocks=").strip("[]").split(",")]
            if max(blocks) > side:
                raise ConfigError(f"--ablations {arm.name}: {blocks} blocks do not fit a {side}x{side} "
                                  "token grid (at most one block per token)")
    return arm


def grid_key(data: str, name: str) -> str:
    """The GRIDS key (and folder under --out) of grid ``name`` of ``data``: digits keep the bare name."""
    return name if data == "digits" else f"{data}-{name}"


def grid_model(grid: dict) -> dict:
    return dict(TINY_MODEL, patch_size=grid.get("patch", 2)) if grid.get("tiny") else MODEL


def base_overrides(grid: dict, model: dict) -> list[str]:
    steps = grid["steps"]
    return [
        f"data.source={grid.get('data', 'digits')}", f"data.resolution={grid['resolution']}",
        f"mhla.blocks=[{grid['blocks'][0]},{grid['blocks'][1]}]",
        *(f"model.{k}={v}" for k, v in model.items()),
        f"train.global_batch_size={grid['batch']}", f"train.lr_warmup_steps={min(50, steps // 10)}",
        f"log.every={max(1, steps // 30)}", "log.trackers=[]", "log.num_samples=1",
        f"log.sample_steps={grid['sample_steps']}", *grid.get("recipe", ()),
    ]



def throughput(tokens: int, repeats: int = 5) -> dict[str, dict]:
    """Training (forward + backward + AdamW) and inference images/s of the study's model for each
    attention at ``tokens`` tokens (batch 8192 / tokens, at least 2), timed interleaved in this process
    (medians over ``repeats``)."""
    batch = max(2, 8192 // tokens)
    resolution = 2 * int(round(tokens**0.5))
    grid = dict(GRIDS["64" if tokens <= 64 else "256"], resolution=resolution)  # 2x2 or 4x4 blocks
    models, times = {}, {arm.name: {"train": [], "infer": []} for arm in MAIN_ARMS}
    for arm in MAIN_ARMS:
        cfg = load_config(DiTRunConfig, CONFIG, [*base_overrides(grid, MODEL), *arm.overrides])
        model = DiTTask(cfg).build_transformer()
        models[arm.name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(batch, 1, resolution, resolution)
    t, y = torch.randint(0, 1000, (batch,)), torch.randint(0, 10, (batch,))
    for _ in range(repeats + 1):  # the first round warms up
        for name, (model, opt) in models.items():
            start = time.perf_counter()
            model(x, timestep=t, class_labels=y).sample.square().mean().backward()
            opt.step()
            opt.zero_grad()
            middle = time.perf_counter()
            with torch.no_grad():
                model(x, timestep=t, class_labels=y)
            times[name]["train"].append(middle - start)
            times[name]["infer"].append(time.perf_counter() - middle)
    return {name: {k: batch / float(np.median(v[1:])) for k, v in d.items()} for name, d in times.items()}

