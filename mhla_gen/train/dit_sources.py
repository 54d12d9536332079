"""The data a DiT trains on, one class per ``data.source`` (:data:`DIT_SOURCES`).

Each source checks its own settings (:meth:`DiTSource.validate`, before any work), says what the model
input is (channels and size), how many items there are, and builds the dataset. A source is built from
what it reads (:func:`dit_source`): the ``data`` settings, the class count and, for teacher data, the start
point and how the run samples a DiT (:class:`DiTSampling`). ``folder``: ImageNet-style
class folders, VAE-encoded on the fly; ``latents``: a cache of ``scripts/extract_latents.py``; ``digits``:
scikit-learn's digits in pixel space; ``shapes``: drawn coloured shapes in pixel space (mhla_gen.data.shapes);
``teacher``: samples of a teacher DiT, drawn at setup into a cache; ``hf``: a ``datasets`` dataset with an
image and an integer class column (:mod:`mhla_gen.data.hf_datasets`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from diffusers import AutoencoderKL, DiTPipeline, DiTTransformer2DModel
from torch import nn
from torch.utils.data import Dataset

from ..data import ClassFolderDataset, LatentCacheDataset, digits_tensors, shapes
from ..data.hf_datasets import HFClassImages
from ..data.images import check_readable, class_folders, require_dir
from ..data.teacher import check_teacher_folder, write_teacher_samples
from ..errors import ConfigError
from ..integration.install import stock_class_name
from ..outputs.folders import check_apart, input_record
from .attention import load_teacher
from .dit_model import IdentityVAE
from .start import StartPoint

logger = logging.getLogger(__name__)

DIGITS_CLASSES, DIGITS_ITEMS = 10, 1797  # scikit-learn's load_digits


def _same_model(a: str, b: str) -> bool:
    """Two model references name the same thing: equal hub ids, or local paths to the same folder."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


@dataclass(frozen=True)
class DiTSampling:
    """How a DiT run samples (its sample grids and teacher data).

    Attributes:
        pipeline: ``pipeline(transformer)`` -> ``DiTPipeline`` around it with the run's VAE (after setup;
            a pixel-space stand-in without one) and its ``diffusion.sampler`` scheduler.
        sampler: that scheduler's name; ``steps``, ``guidance``: the pipeline call's; ``seed``: chunk ``k``
            of teacher samples is drawn with ``seed * 100003 + k``.
    """

    pipeline: Callable[[nn.Module], DiTPipeline]
    sampler: str
    steps: int
    guidance: float
    seed: int


class DiTSource:
    """One ``data.source`` of a DiT run: what the task asks of its data. Subclasses fill in the items and
    the checks.

    Attributes:
        name: the ``data.source`` value.
        pixel_space: trains on pixels whatever ``data.vae`` says (the digits).
        needs_decoder: sample grids need ``data.vae`` to decode (latent caches).
        scores_fid: ``eval.fid_num_samples`` can score it (the digits extractor).
        is_teacher: the data are sampled from a teacher by the run itself (into ``data.path``).
    """

    name: ClassVar[str]
    pixel_space: ClassVar[bool] = False
    needs_decoder: ClassVar[bool] = False
    scores_fid: ClassVar[bool] = False
    is_teacher: ClassVar[bool] = False

    def __init__(self, data, num_classes: int):
        self.data, self.num_classes = data, num_classes

    def validate(self) -> None:
        """This source's own settings; ConfigError naming them."""
        if self.data.path is None:
            raise ConfigError(f"data.path is required for data.source={self.name}")

    def inputs(self) -> dict[str, str | None]:
        """The paths this source reads, setting -> path (the run's output must be apart from each)."""
        return {"data.path": self.data.path, "data.vae": self.data.vae}

    def written_inside(self) -> tuple[str, ...]:
        """Its settings that may lie inside the run's ``output_dir`` (what the run itself writes)."""
        return ()

    def run_settings(self):
        """The ``data`` section as the run resolved it (what ``config.yaml`` records): the resolution of
        the images the model learns (:meth:`resolution`)."""
        return dataclasses.replace(self.data, resolution=self.resolution())

    def vae_config(self) -> dict | None:
        """The data VAE's ``config.json`` (no weights loaded), or None in pixel space."""
        if self.data.vae is None or self.pixel_space:
            return None
        try:
            return dict(AutoencoderKL.load_config(self.data.vae, subfolder=self.data.vae_subfolder))
        except OSError as err:
            raise ConfigError(f"data.vae={self.data.vae!r} cannot be loaded: {err}") from None

    def channels_and_size(self) -> tuple[int, int]:
        """``(in_channels, sample_size)`` of the transformer input: the VAE's latent of
        ``data.resolution`` pixels (or the pixels themselves without a VAE)."""
        vae, resolution = self.vae_config(), self.data.resolution
        if vae is None:
            return 3, resolution
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
        if resolution % factor:
            raise ConfigError(
                f"data.resolution={resolution} is not a multiple of the VAE's downsampling {factor}"
            )
        return vae["latent_channels"], resolution // factor

    def count_items(self) -> int:
        return len(self.dataset())

    def resolution(self) -> int:
        """The pixel size of the images the model learns (what ``config.yaml`` records as
        ``data.resolution``): ``data.resolution`` for sources that resize to it."""
        return self.data.resolution

    def latent_factor(self) -> int:
        """Pixels per model-input cell: the VAE's downsampling (1 in pixel space)."""
        vae = self.vae_config()
        return 1 if vae is None else 2 ** (len(vae["block_out_channels"]) - 1)

    def dataset(self) -> Dataset:
        raise NotImplementedError

    def prepare(self, device) -> None:
        """Work before the dataset is read (after the VAE is loaded); nothing by default."""

    def held_out(self) -> Dataset | None:
        """Items training never reads (stage 1 measures on them), if the source has any."""
        return None


class ClassFolderSource(DiTSource):
    """``data.path/<class>/<image>``: images resized to ``data.resolution``, encoded on the fly."""

    name = "folder"

    def __init__(self, data, num_classes: int):
        super().__init__(data, num_classes)
        self._dataset = None

    def validate(self) -> None:
        super().validate()
        root, want = require_dir(self.data.path, "data.path"), self.num_classes
        found = len(class_folders(root, "data.path"))
        if found != want:
            raise ConfigError(
                f"model.num_classes={want} but data.path={self.data.path!r} has {found} class folders "
                f"with images"
            )
        self.check_readable()

    def check_readable(self) -> None:
        """At least one image of the class folders opens (before anything is written): a folder of
        unreadable files would otherwise stop the run at its first batch."""
        check_readable(self.dataset(), "data.path", self.data.path, "image files")

    def dataset(self) -> Dataset:
        """The class-folder dataset (listed once: validation counts it, training reads it)."""
        if self._dataset is None:
            self._dataset = ClassFolderDataset(self.data.path, self.data.resolution, "data.path")
        return self._dataset


class HFClassSource(DiTSource):
    """A ``datasets`` dataset (``data.path``: a save_to_disk folder, a load_dataset folder or a hub name;
    ``data.split``) with ``data.image_column`` and ``data.label_column``: cropped like class folders,
    encoded on the fly; the label column's class count must be ``model.num_classes``."""

    name = "hf"

    def __init__(self, data, num_classes: int):
        super().__init__(data, num_classes)
        self._dataset = None

    def validate(self) -> None:
        super().validate()
        found, want = self.dataset().num_classes, self.num_classes
        if found != want:
            raise ConfigError(f"model.num_classes={want} but data.path={self.data.path!r} has {found} "
                              f"classes (its {self.data.label_column!r} column)")
        check_readable(self.dataset(), "data.path", self.data.path, f"{self.data.image_column!r} images")

    def dataset(self) -> Dataset:
        """Loaded (and its columns checked) once: validation counts it, training reads it."""
        if self._dataset is None:
            d = self.data
            self._dataset = HFClassImages(d.path, d.split, d.image_column, d.label_column, d.resolution)
        return self._dataset


class LatentCacheSource(DiTSource):
    """A latent cache (``scripts/extract_latents.py``): ``[image, flipped image]`` latents and labels."""

    name = "latents"
    needs_decoder = True

    def validate(self) -> None:
        super().validate()
        data, want = self.data, self.num_classes
        cache = LatentCacheDataset(require_dir(data.path, "data.path"))
        found = int(cache.meta.get("num_classes", int(cache.labels.max()) + 1))
        if len(cache.labels) and int(cache.labels.max()) >= want:
            raise ConfigError(
                f"model.num_classes={want} but the latent cache data.path={data.path!r} holds label "
                f"{int(cache.labels.max())}"
            )
        if found != want:
            raise ConfigError(
                f"model.num_classes={want} but data.path={data.path!r} has {found} classes (its meta.json)"
            )
        self.check_vae(cache.meta)

    def check_vae(self, meta: dict) -> None:
        """A latent cache records the VAE and scaling factor it was encoded with; ``data.vae`` (which
        decodes the samples) must be that VAE, with that scaling factor."""
        data = self.data
        if data.vae is None:
            return  # no decoder: sample grids are skipped (logged)
        scale = self.vae_config().get("scaling_factor")  # the VAE must load, before any work
        recorded, subfolder = meta.get("vae"), meta.get("vae_subfolder", data.vae_subfolder)
        if recorded is None or (_same_model(data.vae, recorded) and data.vae_subfolder == subfolder):
            if meta.get("scaling_factor") in (None, scale):
                return
            raise ConfigError(
                f"the latent cache data.path={data.path!r} was scaled by {meta['scaling_factor']}, but "
                f"data.vae={data.vae!r} has scaling_factor {scale}"
            )
        raise ConfigError(
            f"the latent cache data.path={data.path!r} was encoded with vae={recorded!r}"
            + (f" (subfolder {meta['vae_subfolder']!r})" if meta.get("vae_subfolder") else "")
            + f", but data.vae={data.vae!r}: set data.vae={recorded!r} (samples are decoded with data.vae)"
        )

    def channels_and_size(self) -> tuple[int, int]:
        shape = LatentCacheDataset(self.data.path).latents.shape  # (N, 2, C, h, w)
        return shape[2], shape[3]

    def resolution(self) -> int:
        """The cache's: what its ``meta.json`` records, else its latent size times the VAE's factor;
        ``data.resolution`` does not apply (the images were resized when the cache was written)."""
        recorded = LatentCacheDataset(self.data.path).meta.get("resolution")
        found = int(recorded) if recorded else self.channels_and_size()[1] * self.latent_factor()
        if found != self.data.resolution:
            logger.warning("data.resolution=%d does not apply: the latent cache data.path=%s holds %d px "
                           "images (recorded as the run's data.resolution)", self.data.resolution,
                           self.data.path, found)
        return found

    def dataset(self) -> Dataset:
        return LatentCacheDataset(self.data.path)


class _DigitsDataset(Dataset):
    def __init__(self, resolution: int):
        images, self.labels = digits_tensors(resolution)
        self.pixels = images * 2.0 - 1.0  # [-1, 1] as DiTPipeline's output mapping expects

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pixels": self.pixels[i], "class_labels": self.labels[i]}


class DigitsSource(DiTSource):
    """scikit-learn's 8x8 digits (embedded), upsampled to ``data.resolution``, 1 channel, pixel space."""

    name = "digits"
    pixel_space = True
    scores_fid = True

    def inputs(self) -> dict[str, str | None]:
        return {}  # embedded in scikit-learn

    def validate(self) -> None:
        if self.num_classes != DIGITS_CLASSES:
            raise ConfigError(
                f"model.num_classes={self.num_classes} but data.source=digits has {DIGITS_CLASSES} "
                f"classes"
            )

    def channels_and_size(self) -> tuple[int, int]:
        return 1, self.data.resolution

    def count_items(self) -> int:
        return DIGITS_ITEMS

    def dataset(self) -> Dataset:
        return _DigitsDataset(self.data.resolution)


class ShapesSource(DiTSource):
    """Mirror-symmetric coloured shapes drawn in code (:mod:`mhla_gen.data.shapes`), RGB, pixel space; a
    held-out draw for stage 1's measurements."""

    name = "shapes"
    pixel_space = True

    def inputs(self) -> dict[str, str | None]:
        return {}  # drawn in code

    def validate(self) -> None:
        try:
            shapes.check_shapes_data(self.data.resolution, self.num_classes)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def channels_and_size(self) -> tuple[int, int]:
        return 3, self.data.resolution

    def count_items(self) -> int:
        return shapes.TRAIN_ITEMS

    def dataset(self) -> Dataset:
        return shapes.ShapesDataset(self.data.resolution)

    def held_out(self) -> Dataset:
        return shapes.ShapesDataset(self.data.resolution, 256, seed=shapes.HELD_OUT_SEED)


class TeacherSource(DiTSource):
    """``data.teacher_samples`` samples of a teacher DiT (``data.teacher``, else what ``model.init_from``
    converts), drawn through ``DiTPipeline`` into ``data.path`` at setup and read like a latent cache."""

    name = "teacher"
    is_teacher = True

    def __init__(self, data, num_classes: int, start: StartPoint, sampling: DiTSampling):
        super().__init__(data, num_classes)
        self.start, self.sampling = start, sampling

    def teacher(self) -> str:
        """``data.teacher``, else the model ``model.init_from`` converts (a stage-1 folder's teacher)."""
        source = self.data.teacher or self.start.teacher("data.teacher")
        if source is None:
            raise ConfigError(
                "data.source=teacher needs data.teacher (or model.init_from): the DiT to sample"
            )
        return source

    def teacher_config(self) -> dict:
        source = self.teacher()
        path = Path(source)
        sub = "transformer" if (path / "transformer").is_dir() or not path.exists() else None
        try:
            config = DiTTransformer2DModel.load_config(source, subfolder=sub)
        except OSError as err:
            raise ConfigError(f"data.teacher={source!r} cannot be loaded: {err}") from None
        if stock_class_name(config.get("_class_name")) != DiTTransformer2DModel.__name__:
            raise ConfigError(f"data.teacher={source!r} is a {config.get('_class_name')}, not a DiT")
        return config

    def labels(self) -> list[int]:
        data, classes = self.data, self.num_classes
        chosen = data.teacher_labels or list(range(classes))
        return [chosen[i % len(chosen)] for i in range(data.teacher_samples)]

    def validate(self) -> None:
        """The teacher loads, its labels are the model's classes, and data.path may be written."""
        super().validate()
        self.teacher_config()
        classes = self.num_classes
        bad = sorted({c for c in self.labels() if not 0 <= c < classes})
        if bad:
            raise ConfigError(f"data.teacher_labels {bad} are outside model.num_classes={classes}")
        check_teacher_folder(self.data.path, "data.path")
        check_apart(self.data.path, "data.path",
                    {"data.teacher": self.teacher(), "model.init_from": self.start.ref})
        logger.info("data teacher: %s", self.teacher())

    def inputs(self) -> dict[str, str | None]:
        return {**super().inputs(), "data.teacher": self.teacher()}

    def written_inside(self) -> tuple[str, ...]:
        return ("data.path",)  # sampled by the run: it may lie in the run folder

    def run_settings(self):
        """The resolution of the teacher's samples, and the teacher resolved."""
        return dataclasses.replace(super().run_settings(), teacher=self.teacher())

    def channels_and_size(self) -> tuple[int, int]:  # samples of the teacher's own input size
        config = self.teacher_config()
        return config["in_channels"], config["sample_size"]

    def resolution(self) -> int:  # the teacher's samples: its input size in pixels
        return self.channels_and_size()[1] * self.latent_factor()

    def count_items(self) -> int:  # not sampled yet
        return self.data.teacher_samples

    def dataset(self) -> Dataset:
        return LatentCacheDataset(self.data.path)

    @torch.no_grad()
    def prepare(self, device) -> None:
        """The samples into ``data.path`` (resumable), in the space the model trains in: pixels in
        [-1, 1], or VAE latents (encoded as extract_latents.py does)."""
        data, s = self.data, self.sampling
        source = self.teacher()
        pipe = s.pipeline(load_teacher(DiTTransformer2DModel, source).to(device)).to(device)
        pipe.set_progress_bar_config(disable=True)
        vae = None if isinstance(pipe.vae, IdentityVAE) else pipe.vae  # pixel space: no encoding
        scale = pipe.vae.config.scaling_factor

        def generate(labels: list[int], chunk: int) -> torch.Tensor:
            g = torch.Generator(device).manual_seed(s.seed * 100_003 + chunk)
            images = pipe(class_labels=labels, guidance_scale=s.guidance, generator=g,
                          num_inference_steps=s.steps, output_type="pt").images
            x = images.to(device) * 2 - 1  # (B, C, H, W) in [-1, 1]
            if vae is None:
                return x
            return vae.encode(x.to(vae.dtype)).latent_dist.sample(g) * scale

        fingerprint = {
            "teacher": input_record(source), "labels": self.labels(), "seed": s.seed,
            "steps": s.steps, "guidance": s.guidance, "sampler": s.sampler, "vae": data.vae,
        }
        meta = {"vae": data.vae, "vae_subfolder": data.vae_subfolder, "scaling_factor": scale,
                "teacher": source}
        write_teacher_samples(generate, data.path, self.labels(), fingerprint, meta)


DIT_SOURCES: dict[str, type[DiTSource]] = {
    source.name: source
    for source in (ClassFolderSource, LatentCacheSource, DigitsSource, ShapesSource, TeacherSource,
                   HFClassSource)
}
"""``data.source`` -> its class (a new source: a class above and a line here)."""


def dit_source(data, num_classes: int, start: StartPoint, sampling: DiTSampling) -> DiTSource:
    """The source ``data.source`` names, built from the data settings and the class count (the teacher's
    from the start point and the run's sampling too)."""
    cls = DIT_SOURCES[data.source]
    return cls(data, num_classes, start, sampling) if cls.is_teacher else cls(data, num_classes)
