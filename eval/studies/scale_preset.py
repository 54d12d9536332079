"""The scale study's runs and budgets (``eval/scale_study.py``): the model, the grids (resolution, blocks,
batch), the arms, every run's config overrides, and a grid's plan: the reference arm's budget in images,
its log-spaced evaluation steps (equal images) and each arm's steps at the reference's compute."""

from __future__ import annotations

from mhla_gen.configs import CONFIG_DIR
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit_flops import train_flops_per_image

from .experiments import SHAPES_RECIPE, VAL_TRIPLES, Arm

CONFIG = str(CONFIG_DIR / "dit_digits.yaml")  # eval/study.py's base config
MODEL = dict(hidden_size=256, depth=8, heads=4, patch_size=2)
TINY_MODEL = dict(hidden_size=16, depth=1, heads=2, patch_size=8)
GRIDS = {  # batch 16 at 4096 tokens: nine runs' activations fit one 141 GB H200 with room to spare
    "1024": dict(resolution=64, blocks=(4, 4), batch=32, fid_samples=100, sample_steps=10),
    "4096": dict(resolution=128, blocks=(4, 4), batch=16, fid_samples=100, sample_steps=10),
    "smoke": dict(resolution=32, blocks=(2, 2), batch=4, fid_samples=20, sample_steps=2, tiny=True,
                  val_triples=32, images=32),
}
ARMS = [Arm("softmax", ("model.attention=softmax",)), Arm("mhla", ("model.attention=mhla",)),
        Arm("linear", ("model.attention=linear",))]
REFERENCE = "softmax"  # the arm whose budget the others match


# ------------------------------------------------------------------------------------------ configs
def grid_model(grid: dict) -> dict:
    return TINY_MODEL if grid.get("tiny") else MODEL


def base_overrides(grid: dict, precision: str, warmup: int = 50) -> list[str]:
    """The data, model and schedule of every run of ``grid`` (eval/study.py's, with ``precision``): the
    shapes' recipe with its learning rate scaled to the width (:data:`RECIPE`)."""
    return [
        "data.source=shapes", f"data.resolution={grid['resolution']}",
        f"mhla.blocks=[{grid['blocks'][0]},{grid['blocks'][1]}]",
        *(f"model.{k}={v}" for k, v in grid_model(grid).items()),
        f"train.global_batch_size={grid['batch']}", f"train.lr_warmup_steps={warmup}", "log.every=10",
        "log.trackers=[]", "log.num_samples=1", f"log.sample_steps={grid['sample_steps']}",
        f"train.mixed_precision={precision}", *RECIPE,
    ]


# The shapes' recipe (studies.experiments.SHAPES_RECIPE: lr 3e-3, Min-SNR-5, clipping at 1), its learning
# rate scaled for a model 4x wider than the CPU studies' (hidden 256 against 64; Adam's update of a hidden
# layer's output grows with its fan-in, so the rate goes about 1 / width: 3e-3 x 64/256 ~ 1e-3). Chosen
# 2026-11-28 before any run at this width, not tuned.
RECIPE = (*SHAPES_RECIPE, "train.learning_rate=1e-3")


def arm_config(grid: dict, arm: Arm, precision: str = "no") -> DiTRunConfig:
    return load_config(DiTRunConfig, CONFIG, [*base_overrides(grid, precision), *arm.overrides])


def tokens(grid: dict) -> int:
    return (grid["resolution"] // grid_model(grid)["patch_size"]) ** 2


# ------------------------------------------------------------------------------------------ budgets
def log_points(last: int, count: int) -> list[int]:
    """``count`` evaluation steps ``last / 2^(count-1), ..., last / 2, last`` (each at least 1, the
    duplicates of a short budget dropped); ``last`` should be a multiple of ``2^(count-1)``."""
    if last < 1 or count < 1:
        raise ValueError(f"need a budget >= 1 and >= 1 points, got {last} and {count}")
    return sorted({max(1, last >> k) for k in range(count)})


def equal_compute_steps(steps: list[int], ratio: float, unit: int) -> list[int]:
    """The steps at which an arm whose training step costs ``1 / ratio`` of the reference arm's (same
    batch) has spent what the reference spent at each of ``steps``: ``step * ratio``, rounded to a
    multiple of ``unit`` (at least ``unit``). The rounding moves a point by at most ``unit / 2`` steps:
    the tables state each point's own compute."""
    if ratio <= 0 or unit < 1:
        raise ValueError(f"need ratio > 0 and unit >= 1, got {ratio} and {unit}")
    return [max(unit, unit * round(s * ratio / unit)) for s in steps]


def eval_seconds(grid: dict, points: int, seeds: int, infer: dict[str, float]) -> float:
    """Device seconds of the evaluations of every run of ``grid``, from each arm's forward images/s
    (``infer[arm]``): the validation loss at each point (``points`` for the reference arm, up to twice
    that for the others: equal images and equal compute) and samples at the two end points (each of
    ``sample_steps`` steps a forward of ``fid_samples`` images, doubled by guidance). An upper bound: a
    point both readings share is counted twice."""
    triples = grid.get("val_triples", VAL_TRIPLES)
    sampling = 2 * grid["fid_samples"] * grid["sample_steps"] * 2
    return seeds * sum(((points if arm == REFERENCE else 2 * points) * triples + sampling) / speed
                       for arm, speed in infer.items())


def images_for_seconds(seconds: float, seeds: int, cost: dict[str, tuple[float, float]],
                       multiple: int = 1, evaluations: float = 0.0) -> int:
    """The reference arm's training images that fit ``seconds`` of one device when every arm trains
    ``seeds`` runs, arm ``a`` training ``ratio_a`` times the reference's images at ``images_per_s_a``
    (``cost[a] = (ratio_a, images_per_s_a)``; the reference has ratio 1), after ``evaluations`` seconds of
    the runs' evaluations (:func:`eval_seconds`), the runs' times added (runs sharing a device overlap
    their host work, so this errs long); rounded down to ``multiple``."""
    if seconds <= evaluations:
        raise ValueError(f"{seconds:g} s do not cover the runs' evaluations alone ({evaluations:.0f} s)")
    per_image = seeds * sum(ratio / speed for ratio, speed in cost.values())  # device seconds
    training = seconds - evaluations
    images = int(training / per_image) // multiple * multiple
    if images < multiple:
        raise ValueError(f"{seconds:g} s leave {training:.0f} s of training after the evaluations "
                         f"({evaluations:.0f} s): {training / per_image:.0f} reference images, fewer than "
                         f"one budget unit of {multiple}")
    return images


# ------------------------------------------------------------------------------------------ plan
def grid_plan(name: str, args, speed: dict | None, infer: dict | None = None) -> dict:
    """One grid's budget: FLOPs per image and the compute ratio of each arm, the reference's steps
    (equal images) and each arm's equal-compute steps. ``speed`` / ``infer``: ``{(grid, arm): training /
    forward images/s}`` of a sizing file (``--seconds`` budgets training and evaluations together)."""
    grid = GRIDS[name]
    flops = {arm.name: train_flops_per_image(arm_config(grid, arm))["train"] for arm in ARMS}
    if args.compute == "time":
        ratio = {a: speed[(name, a)] / speed[(name, REFERENCE)] for a in flops}
    else:
        ratio = {a: flops[REFERENCE] / flops[a] for a in flops}
    unit = grid["batch"] << (args.points - 1)  # the budget halves evenly
    if args.images or grid.get("images"):
        images = max(unit, (args.images or grid["images"]) // unit * unit)
        evaluations = 0.0
    else:
        cost = {a: (ratio[a], speed[(name, a)]) for a in flops}
        evaluations = eval_seconds(grid, args.points, args.seeds, {a: infer[(name, a)] for a in flops})
        images = images_for_seconds(args.seconds, args.seeds, cost, unit, evaluations)
    steps = log_points(images // grid["batch"], args.points)
    return {"grid": name, "tokens": tokens(grid), "batch": grid["batch"], "flops_per_image": flops,
            "ratio": ratio, "images": images, "eval_seconds": evaluations, "images_steps": steps,
            "compute_steps": {a: equal_compute_steps(steps, ratio[a], 1) for a in flops}}
