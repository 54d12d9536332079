"""The data SANA and Wan fine-tune on, one class per ``data.source`` (:data:`CAPTION_SOURCES`).

``folder``: images or videos with captions in ``data.path`` (``metadata.jsonl`` or a ``.txt`` per item);
``teacher``: ``data.teacher_samples`` samples of the prompts in ``data.prompts_file`` drawn from
``model.pretrained`` at setup into ``data.path``, then read as a folder.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..data.images import require_dir
from ..data.teacher import check_teacher_folder, read_prompts, write_teacher_captioned
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

    def prepare(self, device) -> None:
        """Work at setup, once the frozen pipeline is loaded; nothing by default."""


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

    def prepare(self, device) -> None:
        """``data.teacher_samples`` samples of the prompts from ``model.pretrained`` (its own transformer and
        stock pipeline, sampled by the task's ``teacher_sample``) into ``data.path``, resumable
        (:func:`write_teacher_captioned`)."""
        task, d, m = self.task, self.data, self.task.cfg.model
        teacher = task.transformer_cls.from_pretrained(
            m.pretrained, subfolder="transformer", revision=m.revision, dtype=getattr(torch, m.dtype)
        )
        pipe = task.pipeline(teacher.to(device))
        fingerprint = {
            "pretrained": m.pretrained, "prompts": read_prompts(d.prompts_file), "count": d.teacher_samples,
            "size": [d.height, d.width, d.num_frames if task.base.video else 1],
            "steps": task.cfg.log.sample_steps, "guidance": task.cfg.log.guidance_scale,
            "seed": task.cfg.seed,
        }
        sample = lambda prompt, i: task.teacher_sample(pipe, prompt, task.cfg.seed * 100_003 + i)
        write_teacher_captioned(sample, task.save_sample, d.path, fingerprint["prompts"], d.teacher_samples,
                                task.suffix, fingerprint)
        task.forget_listing()  # listed again, with the samples


CAPTION_SOURCES: dict[str, type[CaptionSource]] = {
    source.name: source for source in (CaptionedFolderSource, CaptionTeacherSource)
}
"""``data.source`` -> its class."""
