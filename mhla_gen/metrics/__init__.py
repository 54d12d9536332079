"""Evaluation metrics: the FID family, VBench-style video dimensions, attention statistics."""

from .extractors import (
    digits_extractor,
    extract_features,
    hf_image_extractor,
    inception_extractor,
    pixel_extractor,
)
from .fid import (
    feature_statistics,
    fid_from_features,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    load_reference_stats,
    precision_recall,
    save_reference_stats,
)

__all__ = [
    "digits_extractor",
    "extract_features",
    "feature_statistics",
    "fid_from_features",
    "frechet_distance",
    "hf_image_extractor",
    "inception_extractor",
    "inception_score",
    "kernel_inception_distance",
    "load_reference_stats",
    "pixel_extractor",
    "precision_recall",
    "save_reference_stats",
]
