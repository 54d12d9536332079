"""The data side of SANA / Wan fine-tuning (:class:`~mhla_gen.train.finetune.FlowFinetuneTask`) beyond
listing the items: the sizes and frames each item is cropped to, what the feature cache holds for it, how
batches are drawn from the cache, and what each micro-step changes in a batch.

- sizes: ``data.height x data.width``, or with ``data.buckets`` the bucket nearest each item's aspect ratio
  (:mod:`mhla_gen.data.buckets`); every size must tile the VAE, patch and pipeline and fit the MHLA blocks;
- frames (video): ``data.frame_sampling`` / ``data.frame_stride``
  (:class:`~mhla_gen.data.videos.FrameSampling`);
- the cache: each item's latents (and, with ``data.hflip``, the latents of the mirrored item, as DiT's latent
  cache keeps both) and text encoding; its fingerprint names every setting the items depend on;
- batches: one bucket per batch (:class:`~mhla_gen.data.buckets.BucketBatchSampler`);
- per micro-step: flips and caption dropout (the empty prompt's encoding, made once per run), drawn from the
  step's :class:`~mhla_gen.train.randomness.StepRandom` after the noise, so resume stays exact.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.data import Dataset

from ..data import FeatureCacheDataset, build_feature_cache
from ..data.buckets import AUTO, BucketBatchSampler, auto_buckets
from ..data.videos import FrameSampling
from .attention import attention_mhla_config
from .config import ConfigError

logger = logging.getLogger(__name__)

FLIPPED = "_flipped"  # cache key suffix: "latents_flipped" holds the latents of the mirrored item


def _where(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` in the batch rows where ``mask`` (B,) holds, else ``b``."""
    return torch.where(mask.view(-1, *([1] * (b.ndim - 1))).to(b.device), a, b)


class CaptionFeatures:
    """What a fine-tuning ``task`` (its ``cfg``, ``size_multiple``, ``token_grid``, ``encode_pixels``,
    ``encode_text``) encodes and draws; see the module docstring."""

    def __init__(self, task):
        self.task, self.cfg, self.data = task, task.cfg, task.cfg.data
        self.empty_prompt: dict[str, torch.Tensor] = {}  # the empty prompt's encoding (caption dropout)

    # ---------------------------------------------------------------------------------- sizes
    def check_sizes(self, transformer: dict, vae: dict) -> None:
        """``data.height x data.width`` and every bucket tile the model and fit the MHLA blocks."""
        d = self.data
        self.check_size(transformer, vae, d.height, d.width, f"data.height={d.height}, data.width={d.width}")
        for h, w in self.bucket_sizes() or ():
            self.check_size(transformer, vae, h, w, f"data.buckets entry [{h}, {w}]")

    def check_size(self, transformer: dict, vae: dict, height: int, width: int, where: str) -> None:
        """ConfigError naming ``where`` when ``height x width`` is not a multiple of what the VAE, patch and
        pipeline tile, or the MHLA blocks do not fit its token grid."""
        multiple, why = self.task.size_multiple(transformer, vae)
        for name, value in (("height", height), ("width", width)):
            if value % multiple:
                prefix = "" if where.startswith("data.height") else f"{where}: "
                raise ConfigError(f"{prefix}data.{name}={value} must be a multiple of {multiple} ({why})")
        grid = self.task.token_grid(transformer, vae, height, width)
        mhla = attention_mhla_config(*self.task.attention())
        frames = f", data.num_frames={self.data.num_frames}" if len(grid) == 3 else ""
        if mhla is not None and (len(mhla.blocks) != len(grid) or any(map(int.__gt__, mhla.blocks, grid))):
            raise ConfigError(f"mhla.blocks={list(mhla.blocks)} does not fit the token grid {grid} of {where}"
                              + frames)
        if mhla is not None and mhla.chunk_frames is not None:  # the chunks tile the frames (block-causal)
            try:
                self.task.base.processor.check_token_grid(mhla, grid)
            except ValueError as err:
                raise ConfigError(f"mhla.chunk_frames={mhla.chunk_frames}, {where}{frames}: {err}") from None

    def bucket_sizes(self) -> list[tuple[int, int]] | None:
        """``data.buckets`` resolved: ``[(height, width), ...]`` (``auto``: :func:`auto_buckets` around
        data.height x data.width in the multiples the model tiles), or None without buckets."""
        d = self.data
        if d.buckets is None:
            return None
        if d.buckets == AUTO:
            multiple, _ = self.task.size_multiple(*self.task.model_configs())
            return auto_buckets(d.height, d.width, multiple)
        return [(h, w) for h, w in d.buckets]

    def frame_sampling(self) -> FrameSampling:
        """Which frames of each video (random starts drawn from the run's seed)."""
        return FrameSampling(self.data.frame_sampling, self.data.frame_stride, self.cfg.seed)

    # ---------------------------------------------------------------------------------- cache
    def encode(self, item: dict) -> dict[str, torch.Tensor]:
        """One raw item -> what the cache holds: the task's ``encode_pixels`` (with ``data.hflip`` also of
        the mirrored pixels, keys ``<key>_flipped``) and ``encode_text``."""
        encoded = self.task.encode_pixels(item["pixels"])
        if self.data.hflip:
            flipped = self.task.encode_pixels(item["pixels"].flip(-1))
            encoded |= {key + FLIPPED: value for key, value in flipped.items()}
        return encoded | self.task.encode_text(item["caption"])

    def fingerprint(self, raw: Dataset) -> dict:
        """What the cached items depend on (another fingerprint rebuilds the cache). Settings added after
        the first caches (flips, buckets, frame choice) enter only when not at their default, so an
        earlier cache stays valid."""
        task, d = self.task, self.data
        fingerprint = {
            "task": task.name, "pretrained": self.cfg.model.pretrained, "dtype": self.cfg.model.dtype,
            "files": [str(p) for p in raw.paths], "height": d.height, "width": d.width,
            "num_frames": d.num_frames if task.base.video else None,
            "max_sequence_length": d.max_sequence_length,
        }
        if d.hflip:
            fingerprint["hflip"] = True
        if d.buckets is not None:
            fingerprint["buckets"] = [list(b) for b in self.bucket_sizes()]
        if task.base.video and (d.frame_sampling, d.frame_stride) != ("first", 1):
            frames = self.frame_sampling()
            seed = frames.seed if frames.mode == "random" else None
            fingerprint["frames"] = [frames.mode, frames.stride, seed]
        return fingerprint

    def build(self, raw: Dataset, cache_dir, inputs: dict, device) -> FeatureCacheDataset:
        """The feature cache of ``raw`` in ``cache_dir`` (reused when its fingerprint matches), and with
        caption dropout the empty prompt's encoding on ``device``, once."""
        build_feature_cache(raw, self.encode, cache_dir, self.fingerprint(raw), "data.cache_dir", inputs,
                            inside_ok=("output_dir",))
        if self.cfg.model.caption_dropout_prob > 0:
            with torch.no_grad():
                empty = self.task.encode_text("")
            self.empty_prompt = {key: value.to(device) for key, value in empty.items()}
        return FeatureCacheDataset(cache_dir)

    # -------------------------------------------------------------------------------- batches
    def batch_sampler(self, dataset, batch_size: int, processes: int, seed: int):
        """With ``data.buckets``: batches of one latent shape each; the bucket counts are logged, and the
        items each epoch leaves out (a bucket's remainder) warned about."""
        if self.data.buckets is None:
            return None
        if dataset.shapes is None:  # (the buckets are in the fingerprint: a cache without them is rebuilt)
            raise ConfigError("the feature cache records no latent shapes; data.buckets needs a cache built "
                              "by this version: set another data.cache_dir")
        sampler = BucketBatchSampler(dataset.shapes, batch_size, processes, seed)
        shown = lambda counts: ", ".join(f"{list(k)}: {n}" for k, n in sorted(counts.items()))
        counts = {key: len(items) for key, items in sampler.groups.items()}
        logger.info("buckets (latent shape: items): %s", shown(counts))
        if sampler.left_out():
            logger.warning("data.buckets: %d items are left out each epoch (what a bucket holds beyond whole "
                           "global batches): %s", sum(sampler.left_out().values()), shown(sampler.left_out()))
        return sampler

    def augmented(self, batch: dict, rnd) -> dict:
        """The batch with this micro-step's flips (``data.hflip``: each item's mirrored encoding with
        probability 1/2) and caption dropout (``model.caption_dropout_prob``: the empty prompt's encoding).
        Drawn only when on: runs without them draw what they always drew."""
        batch = dict(batch)
        flipped = [key for key in batch if key.endswith(FLIPPED)]
        if self.data.hflip:
            flip = rnd.rand() < 0.5  # (B,)
            for key in flipped:
                plain = key.removesuffix(FLIPPED)
                batch[plain] = _where(flip, batch[key], batch[plain])
        for key in flipped:
            del batch[key]
        if self.cfg.model.caption_dropout_prob > 0:
            drop = rnd.rand() < self.cfg.model.caption_dropout_prob  # (B,)
            for key, empty in self.empty_prompt.items():
                batch[key] = _where(drop, empty.to(batch[key]).expand_as(batch[key]), batch[key])
        return batch
