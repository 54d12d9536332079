"""Generate an evaluation sample set: files + manifest, sharded over Accelerate processes, resumable.

    mhla-gen generate --config eval/dit_digits
    accelerate launch --num_processes 8 -m mhla_gen generate --config eval/dit_xl2_imagenet256
    mhla-gen generate --config eval/wan_prompts output_dir=samples/wan steps=30
    mhla-gen generate base=wan-i2v model=WAN_I2V_DIR prompts_file=pairs.jsonl max_sequence_length=512

Output (``output_dir``): ``{index:06d}.png`` (images) or ``.mp4`` (video), ``manifest.jsonl`` (one line per
sample: index, file, label or prompt (and image), seed, config hash), ``config.yaml`` and, for images,
``samples.npz`` with ADM's layout (``arr_0`` uint8 NHWC, ``arr_1`` labels for class-conditional models).
Sample ``i`` always uses seed ``seed + i`` (its own generator), so a run killed half-way and started again
generates only the missing files and gives the same set as an uninterrupted run, on any process count.
Scoring is a separate program: eval/fid.py or eval/vbench.py on ``output_dir``. Image-to-video bases sample
``(prompt, image)`` pairs: ``prompts`` with ``images`` (one per prompt, or one for all), or a ``prompts_file``
in JSONL / CSV with ``prompt`` and ``image`` fields (``mhla_gen.pipelines.conditions``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from mhla_gen.bases import BASES, Base, base_for
from mhla_gen.bases.dit import BASE as DIT
from mhla_gen.commands.cli import run
from mhla_gen.configs import resolve_config
from mhla_gen.data.teacher import read_prompts
from mhla_gen.errors import ConfigError
from mhla_gen.integration.loading import check_weight_files
from mhla_gen.metrics.video import write_video
from mhla_gen.outputs.folders import check_apart, claim, listed, owned, record_files
from mhla_gen.outputs.locks import die_with_launcher, release
from mhla_gen.pipelines import SampleSettings
from mhla_gen.pipelines.checks import check_sampling
from mhla_gen.pipelines.conditions import check_images, pair_images, read_image_prompts
from mhla_gen.processors.config import MHLAConfig
from mhla_gen.train.config import load_config
from mhla_gen.train.distributed import check_world_size
from mhla_gen.train.runs import rebuilds_pipeline, run_classes, run_pipeline

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerateConfig:
    """What to sample. ``base``: a base record's name (``mhla_gen.bases``); ``model``: pipeline folder or
    hub id; ``transformer``: a saved (MHLA) transformer folder used in place of the pipeline's;
    ``run_config``: DiT without ``model`` — a training run's ``config.yaml``, whose own sampler (pixel space
    or VAE) is rebuilt; ``mhla``: MHLAConfig fields to install fresh on a stock transformer."""

    base: str = DIT.name  # a record of mhla_gen.bases.BASES: dit, sana, wan, ...
    output_dir: str = "samples/run"
    model: str | None = None
    transformer: str | None = None
    run_config: str | None = None
    mhla: dict | None = None
    labels: list[int] | None = None  # class-conditional bases: class ids (each repeated num_per_item times)
    num_classes: int | None = None  # labels = 0..num_classes-1 when `labels` is not given
    prompts: list[str] | None = None  # text-conditional bases
    prompts_file: str | None = None  # one prompt per line (added after `prompts`); image-to-video: JSONL, CSV
    images: list[str] | None = None  # image-to-video bases: first frame of each of `prompts` (or one for all)
    num_per_item: int = 1
    seed: int = 0
    steps: int = 50
    guidance_scale: float = 4.0
    height: int = 512  # pixels (DiT: the model's sample size)
    width: int = 512
    num_frames: int = 81  # video bases
    fps: int = 16
    negative_prompt: str | None = None
    max_sequence_length: int = 300
    batch_size: int = 8
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)  # passed to the pipeline call as-is

    def __post_init__(self):
        if self.base not in BASES:
            raise ValueError(f"base must be one of {sorted(BASES)}, got {self.base!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        labels = self.record.class_conditional
        if labels and not (self.labels or self.num_classes):
            raise ValueError(f"base={self.base} needs `labels` (a list of class ids) or `num_classes`")
        if not labels and not (self.prompts or self.prompts_file):
            raise ValueError(f"base={self.base} needs `prompts` or `prompts_file`")
        if self.images and not self.record.image_conditioned:
            raise ValueError(f"base={self.base} takes no `images` (not an image-to-video base)")
        if self.images and not self.prompts:
            raise ValueError("`images` pair with `prompts` (one per prompt, or one for all); the pairs of a "
                             "prompts_file name their own images")
        if self.record.image_conditioned and self.prompts and not self.images:
            raise ValueError(f"base={self.base} needs `images` next to `prompts` (one per prompt, or one for "
                             "all), or a prompts_file of (prompt, image) pairs")
        if not self.model and not rebuilds_pipeline(self.record):
            raise ValueError(f"base={self.base} needs `model` (a pipeline folder or hub id)")
        if not (self.model or self.run_config):
            raise ValueError(f"base={self.base} needs `model` (a pipeline) or `run_config` (a training run's "
                             "config.yaml)")
        for name in ("num_per_item", "steps", "batch_size", "height", "width", "num_frames", "fps",
                     "max_sequence_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_classes is not None and self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.labels and min(self.labels) < 0:
            raise ValueError(f"labels must be class ids >= 0, got {self.labels}")
        if self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0, got {self.guidance_scale}")
        if not 0 <= self.seed < 2**32:  # as training's: sample i's file and record name seed + i
            raise ValueError(f"seed must be in 0..2**32-1, got {self.seed}")

    @property
    def record(self) -> Base:
        return base_for(self.base)


def load_generate_config(path: str | None, overrides: list[str]) -> GenerateConfig:
    """Defaults -> YAML -> ``key=value`` overrides, strict (``mhla_gen.train.config.load_config``)."""
    return load_config(GenerateConfig, path, overrides)


SAMPLES_FOLDER = "samples"  # the kind of folder output_dir is (mhla_gen.outputs.folders.KINDS)


def check_labels(cfg: GenerateConfig, num_classes: int) -> None:
    """DiT labels must be classes the model was trained on (``num_classes``)."""
    labels = cfg.labels or range(cfg.num_classes)
    bad = sorted({int(c) for c in labels if not 0 <= int(c) < num_classes})
    if bad:
        raise ConfigError(f"labels {bad} are outside the model's classes 0..{num_classes - 1}")


def trained_classes(cfg: GenerateConfig) -> int | None:
    """The classes a class-conditional model was trained on, where a record says (the training run's
    config, or the record in its ``final/``); None otherwise (the pipeline then checks its label table)."""
    if cfg.run_config:
        return run_classes(cfg.record, cfg.run_config)
    folder = cfg.transformer or (Path(cfg.model) / "transformer" if cfg.model else None)
    return cfg.record.sampler.load().trained_classes(folder)


def config_hash(cfg: GenerateConfig) -> str:
    """Hash of every setting that changes the samples (not output_dir, batch_size)."""
    d = {k: v for k, v in asdict(cfg).items() if k not in ("output_dir", "batch_size")}
    if d["images"] is None:  # added later: the hash of a folder generated before it stays the same
        del d["images"]
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def image_prompts(cfg: GenerateConfig) -> list[tuple[str, str]]:
    """``(prompt, image)`` pairs of an image-to-video base: ``prompts`` x ``images``, then the file's."""
    images = [str(Path(image).expanduser()) for image in cfg.images or []]
    pairs = pair_images(list(cfg.prompts), images, "images") if cfg.prompts else []
    return pairs + (read_image_prompts(cfg.prompts_file, "prompts_file") if cfg.prompts_file else [])


def sample_items(cfg: GenerateConfig) -> list[dict]:
    """Every sample to generate: ``{"index", "seed", "label" | "prompt" [, "image"]}``, in a fixed order."""
    if cfg.record.class_conditional:
        labels = cfg.labels or range(cfg.num_classes)
        conditions = [{"label": int(c)} for c in labels]
    elif cfg.record.image_conditioned:
        conditions = [{"prompt": prompt, "image": image} for prompt, image in image_prompts(cfg)]
    else:
        from_file = read_prompts(cfg.prompts_file, "prompts_file") if cfg.prompts_file else []
        prompts = [*(cfg.prompts or []), *from_file]
        conditions = [{"prompt": p} for p in prompts]
    items = [dict(c) for c in conditions for _ in range(cfg.num_per_item)]
    return [{"index": i, "seed": cfg.seed + i, **item} for i, item in enumerate(items)]


def condition(item: dict):
    """What the base's sampler takes for one item: its label, its prompt, or its ``(prompt, image)``."""
    if "label" in item:
        return item["label"]
    return (item["prompt"], item["image"]) if "image" in item else item["prompt"]


def sample_settings(cfg: GenerateConfig) -> SampleSettings:
    return SampleSettings(
        steps=cfg.steps, guidance=cfg.guidance_scale, height=cfg.height, width=cfg.width,
        frames=cfg.num_frames, negative_prompt=cfg.negative_prompt, output_type="np",
        max_sequence_length=cfg.max_sequence_length, extra=dict(cfg.extra),
    )


class Sampler:
    """``sampler(items) -> list of uint8 arrays``: (H, W, 3) images or (T, H, W, 3) videos, through the base
    record's pipeline sampler."""

    def __init__(self, cfg: GenerateConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.sampler = cfg.record.sampler.load()
        dtype = DTYPES[cfg.dtype]
        mhla = MHLAConfig.from_dict(dict(cfg.mhla)) if cfg.mhla else None
        if cfg.model is None:  # a training run's own pipeline (DiT)
            self.pipe = run_pipeline(cfg.record, cfg.run_config, cfg.transformer, mhla, dtype, device)
        else:
            self.pipe = self.sampler.load(cfg.model, mhla, dtype, device, cfg.transformer)
            conditions = [condition(item) for item in sample_items(cfg)]
            self.sampler.check_conditions(self.pipe, conditions, cfg.guidance_scale, trained_classes(cfg))
        self.pipe.set_progress_bar_config(disable=True)
        self.settings = sample_settings(cfg)

    @torch.no_grad()
    def __call__(self, items: list[dict]) -> list[np.ndarray]:
        gens = [torch.Generator(self.device).manual_seed(item["seed"]) for item in items]
        conditions = [condition(item) for item in items]
        images = self.sampler.sample(self.pipe, conditions, gens, self.settings)  # (B, [T,] H, W, C)
        arrays = (np.clip(np.asarray(images), 0, 1) * 255).round().astype(np.uint8)
        if arrays.shape[-1] == 1:  # grayscale (pixel-space digits) -> RGB, as Inception expects
            arrays = np.repeat(arrays, 3, axis=-1)
        return list(arrays)


def sample_file(out: Path, cfg: GenerateConfig, index: int) -> Path:
    return out / f"{index:06d}{cfg.record.sample_suffix}"


def write_sample(path: Path, array: np.ndarray, fps: int) -> Path:
    """Write to a temporary name next to ``path`` and return it; the caller renames it after recording
    the manifest line, so a finished-looking sample always has its record (a killed run redoes the rest)."""
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    if array.ndim == 4:
        write_video(tmp, array, fps=fps)
    else:
        from PIL import Image

        Image.fromarray(array).save(tmp)
    return tmp


def listed_shards(out: Path) -> list[Path]:
    """The per-process manifest shards in ``out`` that this script listed (never found by pattern)."""
    names = [n for n in listed(out) or {} if n.startswith("manifest.") and n != "manifest.jsonl"]
    return [out / n for n in sorted(set(names)) if (out / n).is_file()]


def assemble(out: Path, cfg: GenerateConfig, items: list[dict], chash: str) -> None:
    """Rank 0: merge the per-rank manifest shards into manifest.jsonl; write samples.npz for images."""
    records = {}
    for shard in listed_shards(out) + [out / "manifest.jsonl"]:
        if shard.exists():
            for line in shard.read_text().splitlines():
                record = json.loads(line)
                records[record["index"]] = record
    missing = [item["index"] for item in items if item["index"] not in records]
    if missing:
        raise RuntimeError(f"samples {missing[:10]}... have no manifest record after generation")
    lines = "".join(json.dumps(records[item["index"]]) + "\n" for item in items)
    (out / "manifest.jsonl").write_text(lines)
    for shard in listed_shards(out):  # the shards the processes listed when they created them
        shard.unlink()
    if not cfg.record.video:
        from PIL import Image

        arr = np.stack([np.asarray(Image.open(sample_file(out, cfg, item["index"])).convert("RGB"))
                        for item in items])
        arrays = {"arr_0": arr}
        if cfg.record.class_conditional:
            arrays["arr_1"] = np.asarray([item["label"] for item in items], dtype=np.int64)
        np.savez(out / "samples.npz", **arrays)


def check_previous_run(out: Path, chash: str) -> None:
    """Refuse to resume into a folder generated with other settings."""
    for manifest in [out / "manifest.jsonl", *listed_shards(out)]:
        if manifest.exists():
            for line in manifest.read_text().splitlines():
                if json.loads(line)["config_hash"] != chash:
                    raise ConfigError(f"{out} holds samples from another config (hash in {manifest.name} "
                                     f"differs from {chash}); use a new output_dir")
                break


def check_images_of(cfg: GenerateConfig, items: list[dict]) -> None:
    """Every condition image of an image-to-video base exists and decodes (before any write)."""
    listed = [str(Path(image).expanduser()) for image in cfg.images or []]
    check_images(listed, "images")
    check_images([item["image"] for item in items if "image" in item and item["image"] not in listed],
                 "prompts_file")


def check_model(cfg: GenerateConfig) -> None:
    """What the sampler will load exists and is the right kind of folder (configs only, no weights), and
    ``output_dir`` is apart from it: before the output folder is marked or its config written."""
    model_setting = "model" if cfg.model else "run_config"
    final = cfg.transformer or (str(Path(cfg.run_config).parent / "final") if cfg.run_config else None)
    inputs = {"model": cfg.model, "transformer": final, "run_config": cfg.run_config,
              "prompts_file": cfg.prompts_file}
    images = dict.fromkeys(item["image"] for item in sample_items(cfg) if "image" in item)
    check_apart(cfg.output_dir, "output_dir", {**inputs, **{f"image {image}": image for image in images}})
    if cfg.run_config and not cfg.model:
        load_config(cfg.record.run_config.load(), cfg.run_config)  # FileNotFoundError / ConfigError naming it
        final = Path(cfg.transformer or Path(cfg.run_config).parent / "final")
        if not (final / "config.json").is_file() and not (final / "mhla_lora.json").is_file():
            setting = "transformer" if cfg.transformer else "run_config"
            raise ConfigError(f"{setting}: {str(final)!r} holds no saved transformer (config.json); has the "
                              f"run finished?")
        if cfg.mhla:
            raise ConfigError("mhla is for stock transformers; a training run's transformer has its own")
        check_weight_files(final, "transformer" if cfg.transformer else "run_config")
        check_sampled_model(cfg, None, str(final))
        return
    local = Path(cfg.model).expanduser()
    if local.exists() or cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") != 1:
        if not (local / "model_index.json").is_file():
            raise ConfigError(f"{model_setting}={cfg.model!r} is not a diffusers pipeline folder (no "
                              f"model_index.json)")
    if cfg.transformer is not None:
        folder = Path(cfg.transformer).expanduser()
        if not (folder / "config.json").is_file() and not (folder / "mhla_lora.json").is_file():
            raise ConfigError(f"transformer={cfg.transformer!r} is not a saved transformer folder")
    config = Path(cfg.transformer or local / "transformer").expanduser() / "config.json"
    if config.is_file():  # a local model: its settings checked before anything is written
        cfg.record.sampler.load().check_settings(json.loads(config.read_text()), sample_settings(cfg))
    if cfg.transformer is not None:
        check_weight_files(Path(cfg.transformer).expanduser(), f"transformer={cfg.transformer!r}")
    elif (local / "transformer").is_dir():
        check_weight_files(local / "transformer", f"{model_setting}={cfg.model!r}")
    check_sampled_model(cfg, cfg.model, cfg.transformer)
    if cfg.prompts_file and not Path(cfg.prompts_file).expanduser().is_file():
        raise FileNotFoundError(f"prompts_file={cfg.prompts_file!r} does not exist")


def check_sampled_model(cfg: GenerateConfig, model: str | None, transformer: str | None) -> None:
    """The pipeline's components, the MHLA and its blocks against the token grid, from the configs alone
    (:func:`mhla_gen.pipelines.checks.check_sampling`)."""
    mhla = MHLAConfig.from_dict(dict(cfg.mhla)) if cfg.mhla else None
    settings = sample_settings(cfg)
    if cfg.record.class_conditional:  # DiTPipeline samples at the model's own size: no size is passed
        settings = dataclasses.replace(settings, height=None, width=None)
    check_sampling(cfg.record.sampler.load(), model, transformer, settings, mhla,
                   {"model": "model", "transformer": "transformer", "mhla": "mhla"})


def generate(cfg: GenerateConfig) -> Path:
    """Generate the missing samples of this process's shard; rank 0 assembles. Returns output_dir."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    die_with_launcher()  # a rank stops with its launcher
    # ACCELERATE_USE_CPU: gloo ranks on CPU, as Accelerator reads it (PartialState alone does not)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    check_world_size(state, script="eval/generate.py")  # ranks each alone would all write every sample
    out = Path(cfg.output_dir).expanduser()
    chash = config_hash(cfg)
    items = sample_items(cfg)
    owned(out, SAMPLES_FOLDER, "output_dir")  # every process: all raise
    if cfg.record.class_conditional and (num_classes := trained_classes(cfg)) is not None:  # before loading
        check_labels(cfg, num_classes)
    check_model(cfg)  # before the folder is marked or its config.yaml written
    check_images_of(cfg, items)
    check_previous_run(out, chash)
    mine = items[state.process_index :: state.num_processes]
    todo = [item for item in mine if not sample_file(out, cfg, item["index"]).exists()]
    # the weights load (and the conditions are checked against the pipeline) before the first write:
    # a transformer that does not load leaves no folder behind
    sampler = Sampler(cfg, state.device) if todo else None
    state.wait_for_everyone()  # every rank loaded: a rank that failed has stopped the launch
    if state.is_main_process:
        claim(out, SAMPLES_FOLDER, "output_dir")
        (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    state.wait_for_everyone()

    shard = out / f"manifest.{state.process_index}.jsonl"
    if todo and not shard.exists():
        record_files(out, shard.name, pending=True)  # listed before it exists: assemble deletes it by name
    if todo:
        bar = tqdm(total=len(todo), desc=f"rank {state.process_index}",
                   disable=not state.is_local_main_process)
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]
            for item, array in zip(batch, sampler(batch)):
                path = sample_file(out, cfg, item["index"])
                tmp = write_sample(path, array, cfg.fps)
                with shard.open("a") as f:
                    f.write(json.dumps({**item, "file": path.name, "config_hash": chash}) + "\n")
                tmp.replace(path)
            bar.update(len(batch))
        bar.close()
    state.wait_for_everyone()
    if state.is_main_process:
        assemble(out, cfg, items, chash)
    state.wait_for_everyone()
    release(out)
    return out


def main(argv=None) -> Path:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML listing deviations from GenerateConfig: a path "
                        "or a shipped config's name, e.g. eval/dit_digits (`mhla-gen configs` lists them)")
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist, e.g. steps=25 output_dir=samples/x")
    args = parser.parse_args(argv)
    config = None if args.config is None else resolve_config(args.config, "--config")
    return generate(load_generate_config(config, args.overrides))


if __name__ == "__main__":
    run(main)
