"""Where a run starts: ``model.init_from``, resolved once into a :class:`StartPoint`.

``model.init_from`` names the transformer a run starts from, for every base: a transformer folder (a
trained model, the ``final/`` of a stage-1 conversion), a pipeline folder (its ``transformer/``) or, for
DiT, a hub id. The task resolves it once, when it is built; every later question (its config, depth,
saved MHLA, the teacher it converts, the attention the run trains, the transformer itself) asks the
resolved value instead of looking at the path again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..errors import ConfigError
from ..integration.install import stock_class_name
from ..integration.loading import check_weight_files
from ..outputs.folders import check_recorded, read_marker
from ..processors.config import MHLAConfig
from .attention import install_attention, load_start_transformer, saved_mhla, start_attention

SETTING = "model.init_from"


@dataclass(frozen=True)
class StartPoint:
    """``model.init_from`` resolved.

    Attributes:
        ref: as configured (a local folder or a hub id); None: the run starts from its base's own weights.
        folder: the local folder holding the transformer (a pipeline folder's ``transformer/``); None for
            a hub id or no start point.
        saved: the MHLA config the folder was saved with (None: stock attention, hub id or no start).
        recorded_teacher: the teacher its marker records (a stage-1 folder), else None.
        teacher_record: that teacher's resolved path and fingerprint (:func:`outputs.folders.input_record`).
    """

    ref: str | None = None
    folder: Path | None = None
    saved: MHLAConfig | None = None
    recorded_teacher: str | None = None
    teacher_record: dict | None = None

    @classmethod
    def resolve(cls, ref: str | None) -> StartPoint:
        """Look at ``ref`` once: local folder or hub id, saved MHLA, recorded teacher."""
        if not ref:
            return cls()
        path = Path(ref)
        folder = None
        if path.is_dir():
            folder = path / "transformer" if (path / "transformer").is_dir() else path
            check_weight_files(folder, f"{SETTING}={ref!r}")  # a cut download: one line, before any write
        marker = (read_marker(folder) or {}) if folder is not None else {}
        return cls(ref=ref, folder=folder, saved=saved_mhla(folder), recorded_teacher=marker.get("teacher"),
                   teacher_record=marker.get("teacher_record"))

    def __bool__(self) -> bool:
        return self.ref is not None

    def teacher(self, setting: str = "train.distill.teacher") -> str | None:
        """The model this start point converts: the teacher a stage-1 folder records (checked: still there,
        unchanged, with its own attention), or the start point itself when it is a stock model (no saved
        MHLA); None without one. ``setting``: where the user can name a teacher instead."""
        if self.recorded_teacher is None:
            return self.ref if self.saved is None else None
        what = f"the teacher that {SETTING}={self.ref!r} records"
        fix = f"nothing was changed: name the teacher explicitly with {setting}=PATH"
        path = check_recorded(self.teacher_record, what, fix)
        local = Path(path)
        if saved_mhla(local / "transformer" if (local / "transformer").is_dir() else local) is not None:
            raise ConfigError(f"{what} ({path!r}) runs MHLA; a teacher keeps its own attention; {fix}")
        return path

    def attention(self, attention: str, mhla: MHLAConfig, init_attention: str) -> tuple[str, MHLAConfig]:
        """``(model.attention, mhla)`` the run trains (:func:`~mhla_gen.train.attention.start_attention`)."""
        return start_attention(attention, mhla, self.folder, init_attention, SETTING)

    def config(self, cls: type, what: str = "transformer") -> dict:
        """The transformer's ``config.json`` (hub ids and pipeline folders: their ``transformer/``); a
        ConfigError naming the setting when it cannot be read or is not a ``cls`` (``what`` names it)."""
        path = Path(self.ref)
        sub = "transformer" if (path / "transformer").is_dir() or not path.exists() else None
        try:
            config = cls.load_config(self.ref, subfolder=sub)
        except OSError as err:
            raise ConfigError(f"{SETTING}={self.ref!r} cannot be loaded: {err}") from None
        if stock_class_name(config.get("_class_name")) != cls.__name__:
            raise ConfigError(f"{SETTING}={self.ref!r} is a {config.get('_class_name')}, not a {what}")
        return config

    def load(self, cls: type, attention: str, mhla: MHLAConfig, init_attention: str) -> nn.Module:
        """The start transformer with the attention :meth:`attention` chose (a hub id: stock weights with
        ``attention`` installed)."""
        if self.folder is not None:
            return load_start_transformer(cls, self.folder, attention, mhla, init_attention)
        return install_attention(cls.from_pretrained(self.ref, subfolder="transformer"), attention, mhla)

