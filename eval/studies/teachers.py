"""The teachers a conversion study starts from, one per seed, and the FLOPs each took to train.

A conversion verdict that rests on one teacher says something about that teacher. ``eval/adaptation.py``
therefore pairs stage-2 seed ``k`` with teacher ``k`` (the teacher is part of the seed unit: seed k's
stage 1, stage 2 and evaluation all start from it), and the teachers come from

* finished ``eval/study.py`` folders (:func:`from_studies`): every ``seed<k>`` run of the attention in
  each folder, the folders in the order given (e.g. one study at 2400 steps and one at 4800: teachers of
  different seeds and budgets), or
* the study's own training (one teacher per seed, ``eval/adaptation.py``).

Each :class:`Teacher` carries its training FLOPs (:func:`training_flops`: the steps its ``config.yaml``
records x batch x :func:`mhla_gen.train.dit_flops.train_flops_per_image`), which the result records keep as
``teacher_flops`` (:class:`mhla_gen.metrics.flops.Conversion`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mhla_gen.errors import ConfigError
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit_flops import train_flops_per_image

from .evidence_stats import MIN_SEEDS


@dataclass(frozen=True)
class Teacher:
    """One trained teacher: ``final`` (its weights), ``run`` (its run folder: the label records keep),
    ``index`` (the stage-2 seed it is paired with), ``steps`` and ``flops`` (its training)."""

    attention: str
    index: int
    run: str
    final: Path
    steps: int
    flops: float

    def extra(self) -> dict:
        """What each result record of a run from this teacher keeps (``Job.extra``)."""
        return {"teacher": self.run, "teacher_index": self.index, "teacher_steps": self.steps,
                "teacher_flops": self.flops}


def training_flops(cfg: DiTRunConfig) -> float:
    """A run's training FLOPs: ``train.max_steps`` x batch x gradient accumulation x one training step
    per image (forward and backward; the optimizer and elementwise work not counted)."""
    per_image = train_flops_per_image(cfg)["train"]
    images = cfg.train.max_steps * cfg.train.global_batch_size * cfg.train.gradient_accumulation_steps
    return float(images * per_image)


def setting(cfg, key: str):
    """``cfg``'s value of a dotted ``key`` (``model.depth``)."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_fits(cfg, expected: dict, where: str) -> None:
    """``ConfigError`` naming every setting of ``expected`` (``{"model.depth": 4, ...}``) the teacher's
    config differs in."""
    wrong = [f"{k}={setting(cfg, k)} (the grid's: {v})" for k, v in expected.items() if setting(cfg, k) != v]
    if wrong:
        raise ConfigError(f"{where}: a teacher of another grid or model: {', '.join(wrong)}")


def seed_folders(runs: Path) -> list[Path]:
    """The ``seed<k>`` folders under ``runs`` by k."""
    found = [(int(m.group(1)), p) for p in runs.iterdir() if (m := re.fullmatch(r"seed(\d+)", p.name))]
    return [p for _, p in sorted(found)]


def from_studies(folders: list[Path], grid: str, attention: str, expected: dict) -> list[Teacher]:
    """The ``attention`` teachers of grid ``grid`` in the finished ``eval/study.py`` ``folders`` (each
    folder's ``<grid>/runs/<attention>/seed<k>`` runs by k, the folders in order), indexed 0, 1, ...
    Refuses (``ConfigError``, one line, before any work) a folder without such runs, a run without its
    ``config.yaml`` or ``final/``, and a run whose model or data differ from ``expected``."""
    teachers = []
    for folder in folders:
        runs = Path(folder) / grid / "runs" / attention
        if not runs.is_dir() or not seed_folders(runs):
            raise ConfigError(f"--teachers-from {folder}: no {attention} runs in {runs} (run eval/study.py "
                              "first)")
        for run in seed_folders(runs):
            record, final = run / "config.yaml", run / "final"
            if not record.is_file() or not final.is_dir():
                missing = "config.yaml (its record)" if not record.is_file() else "final/ (not finished)"
                raise ConfigError(f"--teachers-from {folder}: the teacher {run} has no {missing}")
            cfg = load_config(DiTRunConfig, record)
            check_fits(cfg, expected, f"--teachers-from {folder}: {run}")
            teachers.append(Teacher(attention, len(teachers), str(run.resolve()), final,
                                    cfg.train.max_steps, training_flops(cfg)))
    return teachers


def paired(teachers: list[Teacher], seeds: int, source: str) -> list[Teacher]:
    """The first ``seeds`` teachers (seed k gets teacher k); ``ConfigError`` when there are fewer."""
    if len(teachers) < seeds:
        raise ConfigError(f"--seeds {seeds} needs {seeds} {teachers[0].attention if teachers else ''} "
                          f"teachers (one per seed); {source} has {len(teachers)}")
    return teachers[:seeds]


TEACHER_RULE = (f"too few teachers = under {MIN_SEEDS} distinct teachers among the paired seeds (the "
                "teacher is part of the seed unit: seed k starts from teacher k; records of before "
                "2026-11-28 name none, one teacher)")


def teacher_rule(cells: list[dict], recs: list[dict], arm: str, step: int) -> list[dict]:
    """``cells`` (comparisons of ``arm`` at ``step``) with the verdict "too few teachers" where ``arm``'s
    paired seeds start from fewer than :data:`MIN_SEEDS` distinct teachers (:data:`TEACHER_RULE`)."""
    for c in cells:
        teachers = {r.get("teacher") for r in recs
                    if r["arm"] == arm and r["step"] == step and r["seed"] in c["per_seed"]}
        if c["n"] >= MIN_SEEDS and len(teachers) < MIN_SEEDS:
            c["verdict"] = "too few teachers"
    return cells
