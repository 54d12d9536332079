"""The data SANA and Wan fine-tune on, one class per ``data.source`` (:data:`CAPTION_SOURCES`).

``folder``: images or videos with captions in ``data.path`` (``metadata.jsonl`` or a ``.txt`` per item);
``teacher``: ``data.teacher_samples`` samples of the prompts in ``data.prompts_file`` drawn from
``model.pretrained`` at setup into ``data.path``, then read as a folder; ``hf``: a ``datasets`` dataset
(:mod:`mhla_gen.data.hf_datasets`); ``shards``: webdataset-style tar shards (:mod:`mhla_gen.data.shards`);
``moving_shapes`` (video models): ``data.clips`` clips drawn in code (:mod:`mhla_gen.data.moving_shapes`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.utils.data import Dataset

from ..data.hf_datasets import HFCaptionedImages, HFCaptionedVideos
from ..data.images import check_readable, require_dir
from ..data.moving_shapes import MovingShapesVideos, check_moving_shapes_data
from ..data.shards import TarShardDataset, input_folder, list_shards
from ..data.teacher import check_teacher_folder, read_prompts, write_teacher_captioned
from ..errors import ConfigError
from .loop import TrainTask


class CaptionSource:
    """One ``data.source`` of a fine-tuning run."""

    name: ClassVar[str]

    def __init__(self, task: TrainTask):
        self.task, self.data = task, task.cfg.data

    def validate(self) -> None:
        """This source's own settings, before any work; ConfigError / FileNotFoundError naming them."""
        raise NotImplementedError

    def count_items(self) -> int:
        return len(self.task.listed_dataset())

    def check_readable(self) -> None:
        """At least one listed item reads (:func:`~mhla_gen.data.images.check_readable`), at start-up."""
        what = f"captioned {'videos' if self.task.base.video else 'images'}"
        check_readable(self.task.listed_dataset(), "data.path", self.data.path, what)

    def prepare(self, device) -> None:
        """Work at setup, once the frozen pipeline is loaded; nothing by default."""

    def raw_dataset(self) -> Dataset | None:
        """The captioned items, listed; None: the task reads ``data.path`` as a folder."""
        return None

    def input_path(self) -> str | None:
        """The folder this source reads (outputs and caches must lie apart from it)."""
        return self.data.path


class CaptionedFolderSource(CaptionSource):
    """``data.path`` holds the captioned images / videos."""

    name = "folder"

    def validate(self) -> None:
        require_dir(self.data.path, "data.path")


class CaptionTeacherSource(CaptionSource):
    """Samples of ``model.pretrained`` itself, drawn into ``data.path`` at setup (resumable)."""

    name = "teacher"

    def validate(self) -> None:  # data.path is sampled at setup: it must be ours to write
        check_teacher_folder(self.data.path, "data.path")
        read_prompts(self.data.prompts_file)

    def count_items(self) -> int:  # not sampled yet
        return self.data.teacher_samples

    def check_readable(self) -> None:  # sampled by the run itself, at setup
        pass

    def prepare(self, device) -> None:
        """``data.teacher_samples`` samples of the prompts from ``model.pretrained`` (its own stock pipeline,
        sampled by the task's ``teacher_sample``) into ``data.path``, resumable
        (:func:`write_teacher_captioned`).

        A Wan2.2 A14B run of one expert (``model.expert``) samples with the whole two-expert pipeline too:
        the data are clean videos ``x0``, and an expert's flow-matching targets on its own noise range are
        built from ``x0`` of the distribution the pipeline models, which only both experts together sample
        (one expert alone never learnt the other noise range). The run's own expert is loaded from its own
        subfolder into its own slot; the frozen pipeline holds the other (stock). So both experts' runs
        draw the same data, and may share one ``data.path``."""
        task, d, m = self.task, self.data, self.task.cfg.model
        teacher = task.transformer_cls.from_pretrained(
            m.pretrained, subfolder=m.expert, revision=m.revision, dtype=getattr(torch, m.dtype)
        )
        pipe = task.pipeline(teacher.to(device))
        fingerprint = {
            "pretrained": m.pretrained, "prompts": read_prompts(d.prompts_file), "count": d.teacher_samples,
            "size": [d.height, d.width, d.num_frames if task.base.video else 1],
            "steps": task.cfg.log.sample_steps, "guidance": task.cfg.log.guidance_scale,
            "seed": task.cfg.seed,
        }
        if pipe.config.get("boundary_ratio") is not None:  # folders of before the fix: a transformer_2 run
            fingerprint["experts"] = "both, stock"  # sampled with the high-noise expert in both slots
        sample = lambda prompt, i: task.teacher_sample(pipe, prompt, task.cfg.seed * 100_003 + i)
        write_teacher_captioned(sample, task.save_sample, d.path, fingerprint["prompts"], d.teacher_samples,
                                task.suffix, fingerprint)
        task.forget_listing()  # listed again, with the samples


class CaptionedHFSource(CaptionSource):
    """A ``datasets`` dataset: ``data.path`` a save_to_disk folder, a load_dataset folder or a hub name,
    ``data.split``, ``data.image_column`` (SANA) / ``data.video_column`` (Wan) and ``data.caption_column``;
    loaded and its columns checked when the task lists it (count_items, before any work)."""

    name = "hf"

    def validate(self) -> None:
        if not self.data.path:
            raise FileNotFoundError("data.source=hf needs data.path: a saved dataset, a folder or a hub name")

    def raw_dataset(self) -> Dataset:
        d, buckets = self.data, self.task.features.bucket_sizes()
        if self.task.base.video:
            columns = d.video_column, d.caption_column
            return HFCaptionedVideos(d.path, d.split, *columns, d.num_frames, d.height, d.width,
                                     frames=self.task.features.frame_sampling(), buckets=buckets)
        return HFCaptionedImages(d.path, d.split, d.image_column, d.caption_column, d.height, d.width,
                                 buckets=buckets)


class TarShardSource(CaptionSource):
    """webdataset-style tar shards: ``data.path`` a folder of ``.tar`` files or a glob; ``key.jpg|png|mp4``
    + ``key.txt`` per item."""

    name = "shards"

    def validate(self) -> None:
        list_shards(self.data.path or "", "data.path")

    def raw_dataset(self) -> Dataset:
        d = self.data
        frames = d.num_frames if self.task.base.video else None
        features = self.task.features
        return TarShardDataset(d.path, d.height, d.width, num_frames=frames,
                               frames=features.frame_sampling(), buckets=features.bucket_sizes())

    def input_path(self) -> str | None:
        return input_folder(self.data.path)


class MovingShapesSource(CaptionSource):
    """Moving shapes drawn in code, captioned with their class (``"two orange shapes moving"``): the
    training set (seed 0) of ``data.clips`` clips of ``data.num_frames`` x ``data.height`` x ``data.width``.
    Video models only; no files are read."""

    name = "moving_shapes"

    def validate(self) -> None:
        if not self.task.base.video:
            raise ConfigError(
                f"data.source=moving_shapes draws videos; the {self.task.name} model makes images"
            )
        try:
            check_moving_shapes_data(self.data.num_frames, self.data.height, self.data.width)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def count_items(self) -> int:
        return self.data.clips

    def raw_dataset(self) -> Dataset:
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
