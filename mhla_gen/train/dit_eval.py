"""DiT's end-of-run evaluation (``eval.fid_num_samples``, digits runs): FID between generated and real digits
in the digits feature extractor's space, and how often the extractor reads the class a sample was drawn for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..data import digits_tensors
from ..metrics.extractors import digits_extractor, extract_features
from ..metrics.fid import fid_from_features


def digits_fid(generate: Callable[[list[int], int], torch.Tensor], num_classes: int, resolution: int,
               num_samples: int, batch_size: int, seed: int) -> dict:
    """``num_samples`` samples (classes in turn) from ``generate(labels, seed)`` -> ``(b, 1, R, R)`` in
    [0, 1], the batch from item ``i`` on with seed ``seed + 1 + i``: ``fid_digits``, ``label_accuracy``."""
    labels = [i % num_classes for i in range(num_samples)]
    fake = torch.cat(
        [
            generate(labels[i : i + batch_size], seed + 1 + i).cpu()
            for i in tqdm(range(0, len(labels), batch_size), desc="FID samples", unit="batch")
        ]
    )  # (N, 1, R, R) in [0, 1]
    real, _ = digits_tensors(resolution)
    extractor = digits_extractor()
    fake_f, real_f = extract_features(extractor, fake), extract_features(extractor, real)
    accuracy = (torch.from_numpy(fake_f["logits"]).argmax(-1) == torch.tensor(labels)).float().mean().item()
    return {
        "fid_digits": fid_from_features(real_f["pool"], fake_f["pool"]),
        "label_accuracy": accuracy,
        "fid_num_samples": num_samples,
    }
