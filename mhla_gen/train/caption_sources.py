"""The data a captioned fine-tuning run trains on, one class per ``data.source`` (:data:`CAPTION_SOURCES`).

``folder``: images or videos with captions in ``data.path`` (``metadata.jsonl`` or a ``.txt`` per item);
``teacher``: ``data.teacher_samples`` samples of the prompts in ``data.prompts_file`` drawn from
``model.pretrained`` at setup into ``data.path``, then read as a folder; ``hf``: a ``datasets`` dataset
(:mod:`mhla_gen.data.hf_datasets`); ``shards``: webdataset-style tar shards (:mod:`mhla_gen.data.shards`);
``moving_shapes`` (video models): ``data.clips`` clips drawn in code (:mod:`mhla_gen.data.moving_shapes`).

A source is built from what it reads (:func:`caption_source`): the ``data`` settings, what each item is
(:class:`~mhla_gen.train.caption_data.Items`: images or videos, buckets, frames) and, for teacher data, how
the teacher is sampled (:class:`TeacherSampling`). The task asks it only what :class:`CaptionSource` lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset

from ..data import CaptionedImageFolder, CaptionedVideoFolder
from ..data.hf_datasets import HFCaptionedImages, HFCaptionedVideos
from ..data.images import check_readable, require_dir
from ..data.moving_shapes import MovingShapesVideos, check_moving_shapes_data
from ..data.shards import TarShardDataset, input_folder, list_shards
from ..data.teacher import check_teacher_folder, read_prompts, write_teacher_captioned
from ..errors import ConfigError
from ..metrics.video import write_video
from .caption_data import Items


@dataclass(frozen=True)
class TeacherSampling:
    """How a run draws its teacher data, and what those samples depend on.

    Attributes:
        pipeline: ``pipeline(device)`` -> the stock pipeline that samples ``model.pretrained`` (called at
            setup, once the frozen pipeline is loaded).
        sample: ``sample(pipe, prompt, seed)`` -> one image (PIL) or video (``(F, H, W, 3)`` uint8): the
            base's pipeline call.
        pretrained: the sampled checkpoint; ``steps``, ``guidance``: the pipeline call's; ``seed``: sample
            ``i`` is drawn with ``seed * 100003 + i``.
    """

    pipeline: Callable[[torch.device], Any]
    sample: Callable[[Any, str, int], Any]
    pretrained: str
    steps: int
    guidance: float
    seed: int


class CaptionSource:
    """One ``data.source`` of a captioned run: what the task asks of its data.

    Attributes:
        name: the ``data.source`` value.
        is_teacher: the data are sampled from the teacher by the run itself (into ``data.path``).
    """

    name: ClassVar[str]
    is_teacher: ClassVar[bool] = False

    def __init__(self, data, items: Items):
        self.data, self.items = data, items
        self._listed: Dataset | None = None

    def validate(self) -> None:
        """This source's own settings, before any work; ConfigError / FileNotFoundError naming them."""
        raise NotImplementedError

    def input_path(self) -> str | None:
        """The folder this source reads (outputs and caches must lie apart from it)."""
        return self.data.path

    def written_inside(self) -> tuple[str, ...]:
        """Its settings that may lie inside the run's ``output_dir`` (what the run itself writes)."""
        return ()

    def count_items(self) -> int:
        return len(self.dataset())

    def check_readable(self) -> None:
        """At least one listed item reads (:func:`~mhla_gen.data.images.check_readable`), at start-up."""
        what = f"captioned {'videos' if self.items.video else 'images'}"
        check_readable(self.dataset(), "data.path", self.data.path, what)

    def prepare(self, device) -> None:
        """Work at setup, once the frozen pipeline is loaded; nothing by default."""

    def dataset(self) -> Dataset:
        """The captioned items (``{"pixels", "caption"}``), listed once: validation counts them, the
        feature cache reads them."""
        if self._listed is None:
            self._listed = self.listing()
        return self._listed

    def listing(self) -> Dataset:
        """The items of ``data.path`` read as a folder of captioned images or videos."""
        d, items = self.data, self.items
        if items.video:
            return CaptionedVideoFolder(d.path, d.num_frames, d.height, d.width, frames=items.frames,
                                        buckets=items.buckets)
        return CaptionedImageFolder(d.path, d.height, d.width, buckets=items.buckets)


class CaptionedFolderSource(CaptionSource):
    """``data.path`` holds the captioned images / videos."""

    name = "folder"

    def validate(self) -> None:
        require_dir(self.data.path, "data.path")


class CaptionTeacherSource(CaptionSource):
    """Samples of ``model.pretrained`` itself, drawn into ``data.path`` at setup (resumable)."""

    name = "teacher"
    is_teacher = True

    def __init__(self, data, items: Items, teacher: TeacherSampling):
        super().__init__(data, items)
        self.teacher = teacher

    def validate(self) -> None:  # data.path is sampled at setup: it must be ours to write
        check_teacher_folder(self.data.path, "data.path")
        read_prompts(self.data.prompts_file)

    def written_inside(self) -> tuple[str, ...]:
        return ("data.path",)  # sampled by the run: it may lie in the run folder

    def count_items(self) -> int:  # not sampled yet
        return self.data.teacher_samples

    def check_readable(self) -> None:  # sampled by the run itself, at setup
        pass

    def prepare(self, device) -> None:
        """``data.teacher_samples`` samples of the prompts from ``model.pretrained`` (its own stock pipeline,
        :attr:`TeacherSampling.pipeline`) into ``data.path``, resumable (:func:`write_teacher_captioned`).

        A Wan2.2 A14B run of one expert (``model.expert``) samples with the whole two-expert pipeline too:
        the data are clean videos ``x0``, and an expert's flow-matching targets on its own noise range are
        built from ``x0`` of the distribution the pipeline models, which only both experts together sample
        (one expert alone never learnt the other noise range). The run's own expert is loaded from its own
        subfolder into its own slot; the frozen pipeline holds the other (stock). So both experts' runs
        draw the same data, and may share one ``data.path``."""
        d, t = self.data, self.teacher
        pipe = t.pipeline(device)
        fingerprint = {
            "pretrained": t.pretrained, "prompts": read_prompts(d.prompts_file), "count": d.teacher_samples,
            "size": [d.height, d.width, d.num_frames if self.items.video else 1],
            "steps": t.steps, "guidance": t.guidance, "seed": t.seed,
        }
        if pipe.config.get("boundary_ratio") is not None:  # folders of before the fix: a transformer_2 run
            fingerprint["experts"] = "both, stock"  # sampled with the high-noise expert in both slots
        sample = lambda prompt, i: t.sample(pipe, prompt, t.seed * 100_003 + i)
        suffix = ".mp4" if self.items.video else ".png"
        write_teacher_captioned(sample, self.save, d.path, fingerprint["prompts"], d.teacher_samples, suffix,
                                fingerprint)
        self._listed = None  # listed again, with the samples

    def save(self, sample, path: Path) -> None:
        """One sample as a file: a PNG image, or a lossless MP4 of ``(F, H, W, 3)`` uint8 frames."""
        if self.items.video:
            write_video(path, sample, fps=16, lossless=True)
        else:
            sample.save(path)


class CaptionedHFSource(CaptionSource):
    """A ``datasets`` dataset: ``data.path`` a save_to_disk folder, a load_dataset folder or a hub name,
    ``data.split``, ``data.image_column`` (images) / ``data.video_column`` (videos) and
    ``data.caption_column``; loaded and its columns checked when listed (count_items, before any work)."""

    name = "hf"

    def validate(self) -> None:
        if not self.data.path:
            raise FileNotFoundError("data.source=hf needs data.path: a saved dataset, a folder or a hub name")

    def listing(self) -> Dataset:
        d, items = self.data, self.items
        if items.video:
            columns = d.video_column, d.caption_column
            return HFCaptionedVideos(d.path, d.split, *columns, d.num_frames, d.height, d.width,
                                     frames=items.frames, buckets=items.buckets)
        return HFCaptionedImages(d.path, d.split, d.image_column, d.caption_column, d.height, d.width,
                                 buckets=items.buckets)


class TarShardSource(CaptionSource):
    """webdataset-style tar shards: ``data.path`` a folder of ``.tar`` files or a glob; ``key.jpg|png|mp4``
    + ``key.txt`` per item."""

    name = "shards"

    def validate(self) -> None:
        list_shards(self.data.path or "", "data.path")

    def listing(self) -> Dataset:
        d, items = self.data, self.items
        return TarShardDataset(d.path, d.height, d.width, num_frames=d.num_frames if items.video else None,
                               frames=items.frames, buckets=items.buckets)

    def input_path(self) -> str | None:
        return input_folder(self.data.path)


class MovingShapesSource(CaptionSource):
    """Moving shapes drawn in code, captioned with their class (``"two orange shapes moving"``): the
    training set (seed 0) of ``data.clips`` clips of ``data.num_frames`` x ``data.height`` x ``data.width``.
    Video models only; no files are read."""

    name = "moving_shapes"

    def validate(self) -> None:
        if not self.items.video:
            raise ConfigError(
                f"data.source=moving_shapes draws videos; the {self.items.model} model makes images"
            )
        try:
            check_moving_shapes_data(self.data.num_frames, self.data.height, self.data.width)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def count_items(self) -> int:
        return self.data.clips

    def listing(self) -> Dataset:
        d = self.data
        return MovingShapesVideos(d.num_frames, d.height, d.width, count=d.clips)

    def input_path(self) -> str | None:
        return None  # drawn in code


CAPTION_SOURCES: dict[str, type[CaptionSource]] = {
    source.name: source
    for source in (CaptionedFolderSource, CaptionTeacherSource, CaptionedHFSource, TarShardSource,
                   MovingShapesSource)
}
"""``data.source`` -> its class."""


def caption_source(data, items: Items, teacher: TeacherSampling) -> CaptionSource:
    """The source ``data.source`` names, built from the data settings and ``items`` (the teacher's from
    ``teacher`` too)."""
    cls = CAPTION_SOURCES[data.source]
    return cls(data, items, teacher) if cls.is_teacher else cls(data, items)
