"""The adaptation study's runs (``eval/adaptation.py``): the grids (teacher, stage-1 and stage-2 budgets),
the conversion arms of each grid, every run's config overrides, the teachers' configs and training, the
arms with their teachers' folders filled in, and the softmax-layer sweep's measured latency. The model and
base config are eval/study.py's (:mod:`.study_preset`)."""

from __future__ import annotations

import os
from pathlib import Path

from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.loop import train

from .experiments import SHAPES_RECIPE, Arm
from .softmax_layers import fixed_layers, latency, sweep_ks
from .study_preset import CONFIG, MODEL
from .teachers import Teacher, training_flops

TINY_MODEL = dict(hidden_size=16, depth=2, heads=2, patch_size=2)
GRIDS = {  # teacher budget, stage-1 and stage-2 budgets, FID samples / sampler steps
    "64": dict(resolution=16, blocks=(2, 2), teacher_steps=1500, stage1_steps=200, steps=400, batch=32,
               fid_samples=500, sample_steps=20),
    "256": dict(resolution=32, blocks=(4, 4), teacher_steps=1200, stage1_steps=150, steps=300, batch=32,
                fid_samples=300, sample_steps=10),
    "shapes-256": dict(data="shapes", resolution=32, blocks=(4, 4), teacher_steps=2400, stage1_steps=150,
                       steps=600, batch=32, fid_samples=300, sample_steps=10, recipe=SHAPES_RECIPE),
    "shapes-1024": dict(data="shapes", resolution=64, blocks=(4, 4), teacher_steps=2400, stage1_steps=150,
                        steps=600, batch=16, fid_samples=200, sample_steps=10, recipe=SHAPES_RECIPE),
    # --quick: CI-sized (about 10 min of 2 cores)
    "quick": dict(resolution=16, blocks=(2, 2), teacher_steps=200, stage1_steps=50, steps=100, batch=32,
                  fid_samples=200, sample_steps=10),
    "shapes-quick": dict(data="shapes", resolution=32, blocks=(4, 4), teacher_steps=200, stage1_steps=40,
                         steps=80, batch=32, fid_samples=200, sample_steps=10, recipe=SHAPES_RECIPE),
    # --smoke: seconds (the tests)
    "smoke": dict(resolution=8, blocks=(2, 2), teacher_steps=4, stage1_steps=2, steps=4, batch=8,
                  fid_samples=20, sample_steps=2, tiny=True, val_triples=32),
    "shapes-smoke": dict(data="shapes", resolution=32, blocks=(2, 2), teacher_steps=4, stage1_steps=2,
                         steps=4, batch=8, fid_samples=20, sample_steps=2, tiny=True, patch=8,
                         val_triples=32, recipe=SHAPES_RECIPE),
}
# stage 1 of mhla-stage1 and the schedule arms: MHLA's own parameters (the default trains every parameter of
# the converted layers: mhla-stage1-all); ema 0: final/ and its errors are the trained weights
STAGE1 = ("model.attention=mhla", "transfer.trainable=mhla", "train.ema_decay=0")
STAGE1_ALL = (*STAGE1, "transfer.trainable=all")  # the default stage 1: every parameter of converted layers
# LoRA-style stage 2 as the LLM converters run it (LoLCATs: rank 8, alpha 16 on q/k/v/out), MHLA trained too
LORA = ("train.trainable=lora", "train.lora_rank=8", "train.lora_alpha=16")
SWEEP_K0 = "mhla-stage1-all"  # the softmax-layer sweep's K = 0: its stage 1 with no softmax layer kept


def arms(grid: str, eps: float, blocks: int) -> list[Arm]:
    """The arms of one grid (the hybrid and linear-teacher arms at 64 tokens only, see the docstring;
    the stage-2 schedules on every grid)."""
    soft, lin = "model.init_from=@softmax", "model.init_from=@linear"
    distill = ("train.distill.output_weight=1", "train.distill.attention_weight=1")
    e2e = "transfer.output_weight=1"  # stage 1's end-to-end term beside the per-layer errors
    main = [
        Arm("softmax-continued", (soft, "model.attention=softmax")),
        Arm("linear-plain", (soft, "model.attention=linear")),
        Arm("mhla-plain", (soft, "model.attention=mhla")),
        Arm("mhla-stage1", (), stage1=(soft, *STAGE1)),
        Arm("mhla-stage1-distill", distill, stage1=(soft, *STAGE1)),
        Arm("mhla-stage1-all", (), stage1=(soft, *STAGE1_ALL)),
        Arm("mhla-stage1-qk", (), stage1=(soft, *STAGE1, "transfer.trainable=mhla+qk")),
        Arm("mhla-stage1-e2e", (), stage1=(soft, *STAGE1, e2e)),
        Arm("mhla-stage1-all-e2e", (), stage1=(soft, *STAGE1_ALL, e2e)),
    ]
    schedules = [  # stage 2 from the same stage 1 as mhla-stage1 (and plain conversion without warm-up)
        Arm("mhla-plain-no-warmup", (soft, "model.attention=mhla", "train.lr_warmup_steps=0"), "schedule"),
        Arm("stage2-no-warmup", ("train.lr_warmup_steps=0",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-low-lr", ("train.learning_rate=3e-4",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-from-stage1-ema", (), "schedule", stage1=(soft, *STAGE1[:-1], "train.ema_decay=0.99")),
        Arm("stage2-output-distill", ("train.distill.output_weight=1",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-mhla-only", ("train.trainable=mhla",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-lora", LORA, "schedule", stage1=(soft, *STAGE1)),
        # LoRA is usually run at a higher peak LR than full fine-tuning
        Arm("stage2-lora-high-lr", (*LORA, "train.learning_rate=1e-2"), "schedule", stage1=(soft, *STAGE1)),
        # after the default stage 1 (every parameter; LoLCATs' order: attention transfer, then LoRA)
        Arm("stage2-lora-after-all", LORA, "schedule", stage1=(soft, *STAGE1_ALL)),
        Arm("stage2-no-warmup-after-all", ("train.lr_warmup_steps=0",), "schedule",
            stage1=(soft, *STAGE1_ALL)),
    ]
    main += schedules
    if grid.split("-")[-1] != "64" and grid not in ("smoke", "quick"):
        return main
    fresh = (lin, "model.init_attention=fresh", "model.attention=mhla")
    return main + [
        Arm("hybrid-auto", (), "hybrid", stage1=(soft, *STAGE1, "hybrid.softmax_layers=auto:1")),
        Arm("hybrid-fixed", (), "hybrid", stage1=(soft, *STAGE1, "hybrid.softmax_layers=[0]")),
        Arm("linear-continued", (lin,), "linear teacher"),
        Arm("mhla-from-linear-uniform", (*fresh, "mhla.mixing_init=uniform", f"mhla.eps={eps / blocks}"),
            "linear teacher"),
        Arm("mhla-from-linear-locality", (*fresh, "mhla.mixing_init=linear"), "linear teacher"),
    ]


def base_overrides(grid: dict, model: dict) -> list[str]:
    """The grid's data, model and batch; the schedule is the config's (configs/dit_digits.yaml: 50 warm-up
    steps, as the documented stage-2 command runs) unless an arm says otherwise. On the shapes the
    training runs (teachers, stage 2, from scratch; not stage 1, whose transfer loss has its own schedule)
    add the grid's ``recipe`` (:data:`SHAPES_RECIPE`, as the study's) before the arm's own overrides."""
    return [
        f"data.source={grid.get('data', 'digits')}", f"data.resolution={grid['resolution']}",
        f"mhla.blocks=[{grid['blocks'][0]},{grid['blocks'][1]}]",
        *(f"model.{k}={v}" for k, v in model.items()), f"train.global_batch_size={grid['batch']}",
        f"log.every={max(1, grid['steps'] // 20)}", "log.trackers=[]",
        "log.num_samples=1", f"log.sample_steps={grid['sample_steps']}",
    ]


def grid_model(grid: dict) -> dict:
    return dict(TINY_MODEL, patch_size=grid.get("patch", 2)) if grid.get("tiny") else MODEL


def teacher_config(out: Path, name: str, attention: str, grid: dict, model: dict, seed: int) -> DiTRunConfig:
    """The run config of seed ``seed``'s ``attention`` teacher of ``grid`` (its folder under ``out``: seed 0
    keeps the folder of the single teacher of before 2026-11-28)."""
    folder = out / "teachers" / (f"{name}-{attention}" + (f"-seed{seed}" if seed else ""))
    return load_config(DiTRunConfig, CONFIG, [
        *base_overrides(grid, model), f"model.attention={attention}", f"output_dir={folder}",
        f"seed={seed}", f"train.max_steps={grid['teacher_steps']}", "eval.fid_num_samples=0",
        f"train.lr_warmup_steps={min(50, grid['teacher_steps'] // 10)}", *grid.get("recipe", ()),
    ])


def teacher(out: Path, name: str, attention: str, grid: dict, model: dict, seed: int = 0,
            train_it: bool = True) -> Teacher:
    """Seed ``seed``'s ``attention`` teacher of ``grid``, trained under ``out`` unless finished (or
    ``train_it`` is false: ``--report-only``)."""
    cfg = teacher_config(out, name, attention, grid, model, seed)
    folder = Path(cfg.output_dir)
    if train_it and not (folder / "final").is_dir():
        train(cfg, DiTTask(cfg))
    return Teacher(attention, seed, str(folder.resolve()), folder / "final", cfg.train.max_steps,
                   training_flops(cfg))


SMOKE_ARMS = ("softmax-continued", "mhla-plain", "mhla-stage1-distill", "hybrid-auto",
              "mhla-from-linear-uniform")
QUICK_ARMS = ("softmax-continued", "mhla-plain", "mhla-stage1", "mhla-stage1-qk", "stage2-no-warmup")


def with_teachers(arm: Arm, teachers: dict[str, Path], stage1_steps: int) -> Arm:
    """``arm`` with ``@softmax`` / ``@linear`` replaced by the teachers' folders (absolute: a stage-1 run is
    found by its settings, which must not depend on how ``--out`` was spelled), and the stage-1 budget."""
    def resolve(items):
        for attention, path in teachers.items():
            items = tuple(i.replace(f"@{attention}", os.path.abspath(path)) for i in items)
        return items

    stage1 = (*resolve(arm.stage1), f"train.max_steps={stage1_steps}") if arm.stage1 else None
    return Arm(arm.name, resolve(arm.overrides), arm.group, stage1)


def softmax_layer_latency(grid: str) -> dict[int, float]:
    """Each K's inference milliseconds per image (K = 0 .. depth / 2), timed here side by side on models of
    the grid's size (K softmax layers from the release's pattern: only K matters); for the K sweep's
    table (:func:`studies.softmax_layers.sweep_table`)."""
    config, model = dict(GRIDS[grid]), grid_model(GRIDS[grid])
    depth = model["depth"]

    def build(k):
        kept = set(fixed_layers(k, depth))
        layers = f"[{','.join(str(i) for i in range(depth) if i not in kept)}]"
        cfg = load_config(DiTRunConfig, CONFIG, [*base_overrides(config, model), "model.attention=mhla",
                                                 f"mhla.layers={layers}"])
        return DiTTask(cfg).build_transformer()

    return latency(build, [0, *sweep_ks(depth)], config["resolution"], max(2, 8192 // (
        (config["resolution"] // model["patch_size"]) ** 2)))

