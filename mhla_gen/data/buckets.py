"""Aspect-ratio buckets: items of several sizes, one size per batch (``data.buckets``).

MHLA and the transformers take any token grid, so only the data side changes: each item is resized to
cover the bucket nearest its aspect ratio and centre-cropped to it (:func:`nearest_bucket`), the feature
cache records the latent shape of every item, and :class:`BucketBatchSampler` groups items of one shape into
each batch. Its order is a function of the run's seed and the epoch only, so Accelerate's
``skip_first_batches`` resumes a run on the same batch (exact resume), and each global batch is the same on
1 or N processes.

``data.buckets``: ``null`` (no buckets), ``auto`` (:func:`auto_buckets`) or a list of ``[height, width]``.
Why not a library's: diffusers' examples crop to one size; SimpleTuner's and musubi-tuner's bucket managers
are tied to their own caches and loaders, and none of them keeps Accelerate's seeded, resumable order.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

AUTO = "auto"
AUTO_MAX_RATIO = 2.0  # data.buckets=auto: aspect ratios from 1:2 to 2:1


def check_buckets(value) -> None | str | list[list[int]]:
    """``data.buckets`` as given: ``None``, ``"auto"`` or a list of ``[height, width]`` pairs of positive
    ints (returned as lists, duplicates removed); ValueError naming the setting otherwise."""
    if value is None or value == AUTO:
        return value
    pairs = value if isinstance(value, (list, tuple)) else None
    ok = pairs and all(
        isinstance(p, (list, tuple)) and len(p) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in p)
        for p in pairs
    )
    if not ok:
        raise ValueError(f"data.buckets must be null, auto or a list of [height, width] pairs, got {value!r}")
    unique = []
    for h, w in pairs:
        if [h, w] not in unique:
            unique.append([int(h), int(w)])
    return unique


def auto_buckets(height: int, width: int, multiple: int, max_ratio: float = AUTO_MAX_RATIO):
    """Sizes ``[(h, w), ...]`` of about ``height x width`` pixels (never more), sides multiples of
    ``multiple``, aspect ratios within ``1 / max_ratio .. max_ratio``, sorted by aspect ratio h / w.
    The configured ``(height, width)`` is always among them (it must tile: the caller checked it)."""
    area = height * width
    found = {(height, width)}
    for w in range(multiple, int(math.sqrt(area * max_ratio)) + multiple, multiple):
        h = (area // w) // multiple * multiple
        if h >= multiple and 1 / max_ratio <= h / w <= max_ratio:
            found.add((h, w))
    return sorted(found, key=lambda hw: (hw[0] / hw[1], hw[0]))


def nearest_bucket(width: int, height: int, buckets: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The ``(height, width)`` of the bucket whose aspect ratio is nearest (in log scale) to an item of
    ``width x height`` pixels; the first of equally near ones."""
    ratio = math.log(height / width)
    best = min(buckets, key=lambda hw: abs(math.log(hw[0] / hw[1]) - ratio))
    return int(best[0]), int(best[1])


class BucketBatchSampler(Sampler[list[int]]):
    """Batches whose items share a bucket key (e.g. their latent shape), for ``DataLoader(batch_sampler=)``.

    Each epoch: the items of every bucket are shuffled and cut into global batches of ``batch_size x
    processes`` items (a bucket's remainder is left out that epoch, as ``drop_last`` does), and the global
    batches are shuffled; all from ``torch.Generator().manual_seed(seed + epoch)``, so the order depends on
    the seed and :meth:`set_epoch` only. Each global batch is yielded as ``processes`` consecutive chunks of
    ``batch_size``: Accelerate's ``BatchSamplerShard`` gives process ``p`` every ``p``-th batch, i.e. chunk
    ``p``, the rows :class:`~mhla_gen.train.randomness.StepRandom` assigns to process ``p``. So one process
    and N processes train on the same global batches.

    Args:
        keys: the bucket key of every item (hashable and sortable, e.g. a shape tuple).
        batch_size: items per process per micro-step.
        processes: the number of data-parallel processes.
        seed: the run's seed.
    """

    drop_last = True  # read by BatchSamplerShard: never pad with items from the start

    def __init__(self, keys: Sequence[Hashable], batch_size: int, processes: int = 1, seed: int = 0):
        super().__init__()
        if batch_size < 1 or processes < 1:
            raise ValueError(f"batch_size and processes must be >= 1, got {batch_size} and {processes}")
        self.batch_size, self.processes, self.seed, self.epoch = batch_size, processes, seed, 0
        self.groups: dict[Hashable, list[int]] = {}
        for index, key in enumerate(keys):
            self.groups.setdefault(key, []).append(index)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.processes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches (item indices), in order."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        batches = []
        for key in sorted(self.groups):
            items = self.groups[key]
            shuffled = [items[i] for i in torch.randperm(len(items), generator=generator).tolist()]
            full = len(shuffled) - len(shuffled) % self.global_batch
            batches += [shuffled[i : i + self.global_batch] for i in range(0, full, self.global_batch)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            for p in range(self.processes):
                yield batch[p * self.batch_size : (p + 1) * self.batch_size]

    def __len__(self) -> int:
        return sum(len(items) // self.global_batch for items in self.groups.values()) * self.processes

    def left_out(self) -> dict[Hashable, int]:
        """Items of each bucket that no batch of an epoch holds (the remainder of its last batch)."""
        return {key: len(items) % self.global_batch for key, items in self.groups.items()
                if len(items) % self.global_batch}
