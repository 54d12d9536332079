"""Feature extractors for the FID family and the video consistency metrics.

Every extractor is an ``nn.Module`` with a ``name`` (recorded in every metrics JSON) that maps images
``(B, C, H, W)`` float in [0, 1] to a dict of float32 tensors:

    "pool"     (B, F)  global features (FID, KID, precision/recall, consistency)
    "logits"   (B, K)  class logits, or log-probabilities (Inception Score); absent if the model has none
    "spatial"  (B, S)  flattened intermediate conv features (sFID); absent if the model has none

* :func:`digits_extractor` — a small CNN trained in seconds on scikit-learn's embedded digits: the
  offline extractor used by the tests and the digits study. Numbers computed with it are only
  comparable to numbers computed with the same extractor (same seed), never to published FIDs.
* :func:`inception_extractor` — clean-fid's Inception-V3 (the StyleGAN2-ADA TorchScript port of the
  TF-FID network) loaded from a local file, with clean-fid's "clean" resize. This is the real thing.
* :func:`pixel_extractor` — no network at all: mean-centred pixels at a fixed size, so cosine
  similarity is pixel correlation. The offline default for the video consistency dimensions (the
  digits CNN maps every natural frame, and noise, to near-identical features).
* :func:`hf_image_extractor` — a DINO / CLIP / ViT image model from a local transformers folder
  (VBench uses DINO for subject consistency and CLIP for background consistency).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.digits import digits_tensors


def default_cache_dir() -> Path:
    """``$MHLA_GEN_CACHE`` or ``~/.cache/mhla_gen``."""
    return Path(os.environ.get("MHLA_GEN_CACHE", Path.home() / ".cache" / "mhla_gen"))

INCEPTION_FILE = "inception-2015-12-05.pt"
INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"


def to_grayscale(images: torch.Tensor) -> torch.Tensor:
    """``(B, 1|3, H, W)`` -> ``(B, 1, H, W)`` (ITU-R 601 luma for RGB)."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected images (B, 1 or 3, H, W), got shape {tuple(images.shape)}")
    if images.shape[1] == 3:
        weights = images.new_tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
        images = (images * weights).sum(dim=1, keepdim=True)
    return images


class DigitsCNN(nn.Module):
    """Two conv layers and two linear layers on 16×16 grayscale digits.

    Shapes: input (B, 1, 16, 16) -> conv1+pool (B, 16, 8, 8) -> conv2+pool (B, 32, 4, 4)
    -> fc (B, 64) "pool" features -> head (B, 10) "logits". "spatial" is the first 4 channels of the
    conv1 map (B, 4·8·8 = 256), mirroring ADM's sFID, which takes the first 7 channels of an
    intermediate Inception map.
    """

    resolution = 16
    feature_dim = 64
    spatial_channels = 4

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, self.feature_dim)
        self.head = nn.Linear(self.feature_dim, 10)
        self.name = "digits-cnn"

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Any ``(B, 1|3, H, W)`` in [0, 1] -> ``(B, 1, 16, 16)`` (antialiased bilinear, as the dataset)."""
        x = to_grayscale(images.float())
        if x.shape[-2:] != (self.resolution, self.resolution):
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear",
                              align_corners=False, antialias=True)
        return x

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.preprocess(images)
        h1 = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (B, 16, 8, 8)
        h2 = F.max_pool2d(F.relu(self.conv2(h1)), 2)  # (B, 32, 4, 4)
        pool = F.relu(self.fc(h2.flatten(1)))  # (B, 64)
        return {"pool": pool, "logits": self.head(pool), "spatial": h1[:, : self.spatial_channels].flatten(1)}


def train_digits_cnn(seed: int = 0, epochs: int = 12, test_fraction: float = 0.2) -> tuple[DigitsCNN, float]:
    """Train :class:`DigitsCNN` on a seeded train split of the 1797 digits; returns (model, test accuracy)."""
    images, labels = digits_tensors(DigitsCNN.resolution)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=gen)
    n_test = int(len(images) * test_fraction)
    test_idx, train_idx = order[:n_test], order[n_test:]

    torch.manual_seed(seed)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        perm = train_idx[torch.randperm(len(train_idx), generator=gen)]
        for batch in perm.split(64):
            # one-pixel random shifts: a little augmentation so features are not brittle to sample jitter
            shift = torch.randint(-1, 2, (2,), generator=gen).tolist()
            x = torch.roll(images[batch], shifts=shift, dims=(2, 3))
            loss = F.cross_entropy(model(x)["logits"], labels[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(images[test_idx])["logits"].argmax(-1)
    accuracy = (pred == labels[test_idx]).float().mean().item()
    return model, accuracy


def digits_extractor(cache_path: str | os.PathLike | None = None, seed: int = 0) -> DigitsCNN:
    """The digits CNN (eval mode, no grad), trained on first use and cached as safetensors.

    Args:
        cache_path: safetensors file; default ``~/.cache/mhla_gen/digits_cnn_seed{seed}.safetensors``
            (``$MHLA_GEN_CACHE`` overrides the folder).
        seed: split and init seed; a different seed is a different extractor (its name says so).

    The held-out test accuracy is stored in the file's metadata and exposed as ``.test_accuracy``.
    """
    return cached_cnn(DigitsCNN, train_digits_cnn, "digits", cache_path, seed)


def train_on_one_thread(trainer, seed: int) -> tuple[nn.Module, float]:
    """``trainer(seed)`` with gradients on (callers may hold ``no_grad``) and one torch thread: CPU kernels
    split their sums by thread count, so a CNN trained on 2 threads ends with other weights than one trained
    on 1 (0.3 points of digits accuracy, an FID 1 % apart, measured 2026-11-29); on one thread the extractor
    is the same function whatever the machine's cores. The caller's thread count is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.enable_grad():
            return trainer(seed)
    finally:
        torch.set_num_threads(threads)


def cached_cnn(model_cls: type[nn.Module], trainer, name: str, cache_path, seed: int) -> nn.Module:
    """``model_cls()`` with the weights cached at ``cache_path`` (default
    ``<cache>/<name>_cnn_seed<seed>.safetensors``), or trained by ``trainer(seed) -> (model, accuracy)``
    and written there atomically (parallel workers may race: each writes its own temp file, the last
    rename wins, all with the same weights). Eval mode, no grad; ``.name``, ``.test_accuracy`` set."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    default = default_cache_dir() / f"{name}_cnn_seed{seed}.safetensors"
    path = Path(cache_path) if cache_path is not None else default
    model = model_cls()
    if path.exists():
        model.load_state_dict(load_file(str(path)))
        with safe_open(str(path), "pt") as f:
            accuracy = float((f.metadata() or {}).get("test_accuracy", "nan"))
    else:
        model, accuracy = train_on_one_thread(trainer, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        metadata = {"test_accuracy": f"{accuracy:.6f}", "seed": str(seed), "threads": "1"}
        save_file(model.state_dict(), str(tmp), metadata=metadata)
        os.replace(tmp, path)
    model.name = f"{name}-cnn-seed{seed}"
    model.test_accuracy = accuracy
    return model.eval().requires_grad_(False)


class InceptionExtractor(nn.Module):
    """clean-fid's Inception-V3 features with clean-fid's "clean" resize (PIL bicubic to 299 on uint8).

    "pool" is the 2048-d pool3 feature used by FID/KID; "logits" are log-probabilities of the 1008-way
    head without its output bias (StyleGAN2-ADA / TF Inception Score convention). No "spatial" output:
    the TorchScript model does not expose ``mixed_6/conv``, so sFID needs ADM's TensorFlow evaluator.
    """

    def __init__(self, weights_path: str | os.PathLike):
        super().__init__()
        from cleanfid.resize import build_resizer

        self.base = torch.jit.load(str(weights_path), map_location="cpu").eval()
        self.resize = build_resizer("clean")  # np.uint8 (H, W, 3) -> float32 (299, 299, 3) in [0, 255]
        self.name = "inception-v3-cleanfid"

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        uint8 = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        resized = np.stack([self.resize(img) for img in uint8])  # (B, 299, 299, 3)
        x = torch.from_numpy(resized).permute(0, 3, 1, 2).to(next(self.base.parameters()).device)
        pool = self.base.layers.forward((x - 128) / 128).view(x.shape[0], 2048)  # as cleanfid.InceptionV3W
        probs = self.base(x, no_output_bias=True)
        return {"pool": pool.float(), "logits": probs.float().clamp_min(1e-30).log()}


def cleanfid_cache_dir() -> Path:
    """Where clean-fid keeps its Inception download (``cleanfid.features.feature_extractor``'s folder)."""
    return Path("./" if platform.system() == "Windows" else "/tmp")


def inception_extractor(weights_path: str | os.PathLike | None = None) -> InceptionExtractor:
    """clean-fid / StyleGAN2-ADA Inception-V3 TorchScript.

    ``weights_path``: a local ``inception-2015-12-05.pt``. None: clean-fid's standard file, downloaded on
    first use into clean-fid's cache folder (:func:`cleanfid_cache_dir`) by clean-fid itself. Without
    network access that fails with a ``FileNotFoundError`` saying to pass a local file.
    """
    if weights_path is None:
        from cleanfid.downloads_helper import check_download_inception

        try:
            weights_path = check_download_inception(fpath=str(cleanfid_cache_dir()))
        except OSError as err:  # urllib's URLError is an OSError
            raise FileNotFoundError(
                f"could not download clean-fid's Inception weights ({INCEPTION_URL}) into "
                f"{str(cleanfid_cache_dir())!r}: {err}. Offline, download {INCEPTION_FILE} on a machine "
                f"with network access and pass its path with --inception-weights, or use --extractor digits"
            ) from None
    path = Path(weights_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Inception weights not found at {str(path)!r}. Download {INCEPTION_FILE} on a machine with "
            f"network access ({INCEPTION_URL}; it is also what clean-fid fetches) and pass its path. "
            "Offline, use the digits extractor (--extractor digits) instead."
        )
    return InceptionExtractor(path).eval().requires_grad_(False)


class PixelExtractor(nn.Module):
    """``(B, C, H, W)`` -> "pool" ``(B, 3·size²)``: RGB resized to ``size`` (antialiased), minus its mean."""

    def __init__(self, size: int = 32):
        super().__init__()
        self.size = size
        self.name = f"pixels-{size}x{size}-centred"

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        x = F.interpolate(images.float(), size=(self.size, self.size), mode="bilinear", align_corners=False,
                          antialias=True).flatten(1)
        return {"pool": x - x.mean(dim=1, keepdim=True)}


def pixel_extractor(size: int = 32) -> PixelExtractor:
    """Training-free pixel features (see :class:`PixelExtractor`)."""
    return PixelExtractor(size)


class HFImageExtractor(nn.Module):
    """A transformers image model from a local folder: CLIP (image embeddings) or DINO/ViT (CLS token)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        from transformers import AutoConfig, AutoImageProcessor, AutoModel, CLIPModel

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        self.is_clip = config.model_type == "clip"
        model_cls = CLIPModel if self.is_clip else AutoModel
        self.model = model_cls.from_pretrained(path, local_files_only=True).eval()
        self.processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.name = f"hf:{config.model_type}:{Path(path).name}"

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        inputs = self.processor(images=list(images.clamp(0, 1).cpu()), return_tensors="pt", do_rescale=False)
        pixels = inputs["pixel_values"].to(next(self.model.parameters()).device)
        if self.is_clip:
            out = self.model.get_image_features(pixel_values=pixels)
            pool = out if torch.is_tensor(out) else out.pooler_output
        else:
            pool = self.model(pixel_values=pixels).last_hidden_state[:, 0]
        return {"pool": pool.float()}


def hf_image_extractor(path: str | os.PathLike) -> HFImageExtractor:
    """DINO / CLIP / ViT image features from a LOCAL transformers folder (``save_pretrained`` layout)."""
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"no transformers model folder (config.json) at {str(path)!r}")
    return HFImageExtractor(path).requires_grad_(False)


@torch.no_grad()
def extract_features(extractor: nn.Module, images: torch.Tensor, batch_size: int = 256
                     ) -> dict[str, np.ndarray]:
    """Run ``extractor`` over ``images`` (N, C, H, W) in batches -> float64 (N, ·) arrays.

    ``images`` is float in [0, 1] or uint8 (converted batch by batch, so a large uint8 sample set never
    exists as float in memory)."""
    if images.ndim != 4:
        raise ValueError(f"expected images (N, C, H, W), got shape {tuple(images.shape)}")
    chunks: dict[str, list[np.ndarray]] = {}
    for batch in images.split(batch_size):
        if batch.dtype == torch.uint8:
            batch = batch.float() / 255.0
        for key, value in extractor(batch).items():
            chunks.setdefault(key, []).append(value.double().cpu().numpy())
    return {key: np.concatenate(value) for key, value in chunks.items()}
