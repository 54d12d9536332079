"""Datasets: embedded digits, class folders, captioned image / video folders, latent caches."""

from .digits import digits_tensors
from .images import CaptionedImageFolder, ClassFolderDataset, center_crop_arr
from .latents import FeatureCacheDataset, LatentCacheDataset, build_feature_cache, write_class_latents
from .videos import CaptionedVideoFolder, read_frames

__all__ = [
    "CaptionedImageFolder",
    "CaptionedVideoFolder",
    "ClassFolderDataset",
    "FeatureCacheDataset",
    "LatentCacheDataset",
    "build_feature_cache",
    "center_crop_arr",
    "digits_tensors",
    "read_frames",
    "write_class_latents",
]
