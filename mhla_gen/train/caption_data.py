"""The data side of captioned fine-tuning (:class:`~mhla_gen.train.captioned.CaptionedTask`) beyond listing
the items: the sizes and frames each item is cropped to (:class:`Items`), what the feature cache holds for
it, how batches are drawn from the cache, and what each micro-step changes in a batch
(:class:`CaptionFeatures`).

- sizes: ``data.height x data.width``, or with ``data.buckets`` the bucket nearest each item's aspect ratio
  (:mod:`mhla_gen.data.buckets`); every size must tile the VAE, patch and pipeline and fit the MHLA blocks
  (:func:`check_sizes`);
- frames (video): ``data.frame_sampling`` / ``data.frame_stride``
  (:class:`~mhla_gen.data.videos.FrameSampling`);
- the cache: each item's latents (and, with ``data.hflip``, the latents of the mirrored item, as DiT's latent
  cache keeps both) and text encoding; its fingerprint names every setting the items depend on;
- batches: one bucket per batch (:class:`~mhla_gen.data.buckets.BucketBatchSampler`);
- per micro-step: flips and caption dropout (the empty prompt's encoding, made once per run), drawn from the
  step's :class:`~mhla_gen.train.randomness.StepRandom` after the objective's draws, so resume stays exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from ..data import FeatureCacheDataset, build_feature_cache
from ..data.buckets import AUTO, BucketBatchSampler, auto_buckets
from ..data.videos import FrameSampling
from .config import ConfigError

logger = logging.getLogger(__name__)

FLIPPED = "_flipped"  # cache key suffix: "latents_flipped" holds the latents of the mirrored item

Encoder = Callable[..., dict]  # pixels (3, H, W) / (3, F, H, W) or a caption -> {name: tensor}


def _where(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` in the batch rows where ``mask`` (B,) holds, else ``b``."""
    return torch.where(mask.view(-1, *([1] * (b.ndim - 1))).to(b.device), a, b)


@dataclass(frozen=True)
class Items:
    """What each item of a captioned run is, for the data sources that list it and the cache.

    Attributes:
        model: the model it trains (its task's name: error messages, the cache fingerprint).
        video: videos of ``data.num_frames`` frames, else images.
        buckets: ``data.buckets`` resolved (``[(height, width), ...]``), or None: every item is cropped to
            ``data.height x data.width``.
        frames: which frames of each video (random starts drawn from the run's seed).
    """

    model: str
    video: bool
    buckets: list[tuple[int, int]] | None
    frames: FrameSampling

    @classmethod
    def of(cls, model: str, video: bool, data, seed: int, size_multiple: Callable[[], int]) -> Items:
        """From the data settings; ``data.buckets=auto`` asks ``size_multiple()`` (what heights and widths
        must be multiples of) for :func:`~mhla_gen.data.buckets.auto_buckets` around
        ``data.height x data.width``."""
        if data.buckets is None:
            buckets = None
        elif data.buckets == AUTO:
            buckets = auto_buckets(data.height, data.width, size_multiple())
        else:
            buckets = [(h, w) for h, w in data.buckets]
        return cls(model, video, buckets, FrameSampling(data.frame_sampling, data.frame_stride, seed))


def check_sizes(data, buckets, multiple: tuple[int, str], token_grid: Callable[[int, int], tuple],
                mhla, processor) -> None:
    """``data.height x data.width`` and every bucket are multiples of ``multiple`` (``(multiple, why)``:
    what the VAE, patch and pipeline tile) and their token grids (``token_grid(height, width)``) fit the
    MHLA blocks and, block-causal, ``processor``'s chunks; ConfigError naming the size otherwise."""
    sizes = [(data.height, data.width, f"data.height={data.height}, data.width={data.width}")]
    sizes += [(h, w, f"data.buckets entry [{h}, {w}]") for h, w in buckets or ()]
    for height, width, where in sizes:
        for name, value in (("height", height), ("width", width)):
            if value % multiple[0]:
                prefix = "" if where.startswith("data.height") else f"{where}: "
                raise ConfigError(f"{prefix}data.{name}={value} must be a multiple of {multiple[0]} "
                                  f"({multiple[1]})")
        grid = token_grid(height, width)
        frames = f", data.num_frames={data.num_frames}" if len(grid) == 3 else ""
        if mhla is not None and (len(mhla.blocks) != len(grid) or any(map(int.__gt__, mhla.blocks, grid))):
            raise ConfigError(f"mhla.blocks={list(mhla.blocks)} does not fit the token grid {grid} of {where}"
                              + frames)
        if mhla is not None and mhla.chunk_frames is not None:  # the chunks tile the frames (block-causal)
            try:
                processor.check_token_grid(mhla, grid)
            except ValueError as err:
                raise ConfigError(f"mhla.chunk_frames={mhla.chunk_frames}, {where}{frames}: {err}") from None


class CaptionFeatures:
    """What a captioned run encodes into its feature cache and draws per micro-step; see the module
    docstring.

    Args:
        data: the run's ``data`` section.
        items: what each item is (:class:`Items`).
        model: the run's ``model`` section (the checkpoint and dtype the cache depends on,
            ``caption_dropout_prob``).
    """

    def __init__(self, data, items: Items, model):
        self.data, self.items, self.model = data, items, model
        self.empty_prompt: dict[str, torch.Tensor] = {}  # the empty prompt's encoding (caption dropout)

    # ---------------------------------------------------------------------------------- cache
    def encode(self, item: dict, encode_pixels: Encoder, encode_text: Encoder) -> dict[str, torch.Tensor]:
        """One raw item -> what the cache holds: ``encode_pixels`` of its pixels (with ``data.hflip`` also of
        the mirrored pixels, keys ``<key>_flipped``) and ``encode_text`` of its caption."""
        encoded = encode_pixels(item["pixels"])
        if self.data.hflip:
            flipped = encode_pixels(item["pixels"].flip(-1))
            encoded |= {key + FLIPPED: value for key, value in flipped.items()}
        return encoded | encode_text(item["caption"])

    def fingerprint(self, raw: Dataset) -> dict:
        """What the cached items depend on (another fingerprint rebuilds the cache). Settings added after
        the first caches (flips, buckets, frame choice) enter only when not at their default, so an
        earlier cache stays valid."""
        d, items = self.data, self.items
        fingerprint = {
            "task": items.model, "pretrained": self.model.pretrained, "dtype": self.model.dtype,
            "files": [str(p) for p in raw.paths], "height": d.height, "width": d.width,
            "num_frames": d.num_frames if items.video else None,
            "max_sequence_length": d.max_sequence_length,
        }
        if d.hflip:
            fingerprint["hflip"] = True
        if d.buckets is not None:
            fingerprint["buckets"] = [list(b) for b in items.buckets]
        if items.video and (d.frame_sampling, d.frame_stride) != ("first", 1):
            frames = items.frames
            seed = frames.seed if frames.mode == "random" else None
            fingerprint["frames"] = [frames.mode, frames.stride, seed]
        return fingerprint

    def build(self, raw: Dataset, encode_pixels: Encoder, encode_text: Encoder, cache_dir, inputs: dict,
              device) -> FeatureCacheDataset:
        """The feature cache of ``raw`` in ``cache_dir`` (reused when its fingerprint matches), encoded with
        the encoders of the frozen pipeline, and with caption dropout the empty prompt's encoding on
        ``device``, once."""
        encode = lambda item: self.encode(item, encode_pixels, encode_text)
        build_feature_cache(raw, encode, cache_dir, self.fingerprint(raw), "data.cache_dir", inputs,
                            inside_ok=("output_dir",))
        if self.model.caption_dropout_prob > 0:
            with torch.no_grad():
                empty = encode_text("")
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
        if self.model.caption_dropout_prob > 0:
            drop = rnd.rand() < self.model.caption_dropout_prob  # (B,)
            for key, empty in self.empty_prompt.items():
                batch[key] = _where(drop, empty.to(batch[key]).expand_as(batch[key]), batch[key])
        return batch
