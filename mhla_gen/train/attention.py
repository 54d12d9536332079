"""``model.attention`` of every training task: ``softmax``, ``linear`` (global linear attention) or ``mhla``.

The three differ only in the MHLA config installed (none, one block per axis, the configured blocks), so
runs that compare them share every other setting. DiT, SANA and Wan use these the same way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torch import nn

from ..errors import ConfigError
from ..integration.install import CONFIG_KEY, install_mhla, mhla_processors, uninstall_mhla
from ..integration.loading import check_weight_files, load_transformer
from ..processors.config import MHLAConfig


def attention_mhla_config(attention: str, mhla: MHLAConfig) -> MHLAConfig | None:
    """``softmax`` -> None, or with ``mhla.chunk_frames`` block-causal softmax (``layers=[]``: every
    self-attention layer softmax with a KV cache, ``docs/streaming.md``); ``linear`` -> one block per axis
    (global ReLU linear attention, as SANA); ``mhla`` -> ``mhla`` as configured. Everything else stays
    equal, so the three compare fairly."""
    if attention == "softmax":
        return None if mhla.chunk_frames is None else dataclasses.replace(mhla, layers=[])
    if attention == "linear":
        return dataclasses.replace(mhla, blocks=(1,) * len(mhla.blocks))
    return mhla


def install_attention(transformer: nn.Module, attention: str, mhla: MHLAConfig) -> nn.Module:
    """Install the MHLA of :func:`attention_mhla_config` (nothing for softmax); returns ``transformer``."""
    cfg = attention_mhla_config(attention, mhla)
    if cfg is not None:
        install_mhla(transformer, cfg)
    return transformer


def check_mhla_layers(mhla: MHLAConfig | None, num_layers: int) -> None:
    """``mhla.layers`` must name existing self-attention layers, once each (``install_mhla``'s rule);
    :class:`ConfigError` naming them otherwise."""
    if mhla is None or mhla.layers is None:
        return
    bad = sorted({i for i in mhla.layers if not 0 <= i < num_layers})
    repeated = sorted({i for i in mhla.layers if mhla.layers.count(i) > 1})
    if bad or repeated:
        what = f"{bad} out of range 0..{num_layers - 1}" if bad else f"{repeated} listed twice"
        raise ConfigError(f"mhla.layers={mhla.layers}: layers {what} (the model has {num_layers} layers)")


# ---------------------------------------------------------------------- starting from a saved transformer
INIT_ATTENTION = ("saved", "fresh")


def saved_mhla(folder: str | Path | None) -> MHLAConfig | None:
    """The MHLA config a local transformer folder was saved with (``config.json``'s ``mhla`` entry), or
    None (a stock model, a hub id, or no folder)."""
    if folder is None:
        return None
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    saved = json.loads(config.read_text()).get(CONFIG_KEY)
    return MHLAConfig.from_dict(saved) if saved is not None else None


def start_attention(attention: str, mhla: MHLAConfig, folder, init_attention: str, setting: str):
    """``(attention, mhla)`` a run that starts from the transformer in ``folder`` trains.

    A folder saved with MHLA (a trained MHLA model, a stage-1 folder of scripts/linearize.py) keeps its
    MHLA layers and weights with ``init_attention=saved``: the run's attention is then that MHLA config
    (``model.attention=softmax`` is refused, it would drop them). ``fresh``, or a stock folder: the
    configured attention, installed fresh on the folder's projections."""
    saved = saved_mhla(folder)
    if saved is None or init_attention == "fresh":
        return attention, mhla
    if attention == "softmax":
        raise ConfigError(
            f"{setting}={str(folder)!r} was saved with MHLA, which model.attention=softmax would drop; set "
            f"model.attention=mhla to continue it, or model.init_attention=fresh to start again from its "
            f"projections"
        )
    if mhla.chunk_frames is not None and saved.chunk_frames is None:
        return "mhla", block_causal_continuation(saved, mhla, folder, setting)
    check_saved_chunks(saved, mhla, folder, setting)
    return "mhla", saved


def check_saved_chunks(saved: MHLAConfig, mhla: MHLAConfig, folder, setting: str) -> None:
    """A block-causal start point keeps its chunks and mixing form: ``mhla.chunk_frames`` set with another
    chunking or ``stream_mixing`` is refused (ConfigError), instead of being dropped for the saved one."""
    if mhla.chunk_frames is None or saved.chunk_frames is None:
        return
    if (mhla.chunk_frames, mhla.stream_mixing) != (saved.chunk_frames, saved.stream_mixing):
        raise ConfigError(
            f"{setting}={str(folder)!r} was saved block-causal with chunk_frames={saved.chunk_frames}, "
            f"stream_mixing={saved.stream_mixing}, not mhla.chunk_frames={mhla.chunk_frames}, "
            f"mhla.stream_mixing={mhla.stream_mixing}: set those to the saved values (or leave "
            f"mhla.chunk_frames unset), or set model.init_attention=fresh"
        )


def block_causal_continuation(saved: MHLAConfig, mhla: MHLAConfig, folder, setting: str) -> MHLAConfig:
    """A bidirectional MHLA start point continued block-causal (``mhla.chunk_frames`` set): its config with
    the chunks added, so its trained ``W`` (general mixing: the same ``M x M`` parameter, masked) carries
    over. The factorised mixing has other parameters: ConfigError naming ``model.init_attention=fresh``."""
    if mhla.stream_mixing != "general":
        raise ConfigError(
            f"{setting}={str(folder)!r} holds a bidirectional MHLA W that mhla.stream_mixing="
            f"{mhla.stream_mixing} cannot use; continue it with stream_mixing=general, or set "
            f"model.init_attention=fresh (its projections, a fresh factorised mixing)"
        )
    try:
        return dataclasses.replace(saved, chunk_frames=mhla.chunk_frames, stream_mixing="general")
    except ValueError as err:
        raise ConfigError(f"{setting}={str(folder)!r} continued with mhla.chunk_frames={mhla.chunk_frames}: "
                          f"{err}") from None


def load_start_transformer(cls, folder, attention: str, mhla: MHLAConfig, init_attention: str) -> nn.Module:
    """The transformer of ``folder`` with the attention :func:`start_attention` chose: its saved MHLA kept,
    or the stock attention back and ``attention`` installed fresh."""
    if saved_mhla(folder) is None:
        return install_attention(cls.from_pretrained(str(folder)), attention, mhla)
    transformer = load_transformer(folder)
    if not isinstance(transformer, cls):
        raise ConfigError(f"{str(folder)!r} holds a {type(transformer).__name__}, not a {cls.__name__}")
    if init_attention == "fresh":
        uninstall_mhla(transformer)
        install_attention(transformer, attention, mhla)
    elif transformer.mhla_config != mhla:  # continued block-causal (start_attention): same parameters
        trained = {name: proc.state_dict() for name, proc in mhla_processors(transformer).items()}
        install_mhla(transformer, mhla)
        for name, proc in mhla_processors(transformer).items():
            proc.load_state_dict(trained[name])
    return transformer.train()


def teacher_folder(path: Path, subfolder: str = "transformer") -> Path:
    """A local teacher's transformer folder: a pipeline folder's ``subfolder``, else ``path`` itself."""
    return path / subfolder if (path / subfolder).is_dir() else path


def check_teacher_loads(cls, source: str, subfolder: str = "transformer") -> None:
    """A ``train.distill`` teacher that is not a local path must be a loadable hub id (its ``subfolder``'s
    config); ConfigError naming it otherwise."""
    path = Path(source)
    if path.exists():
        check_weight_files(teacher_folder(path, subfolder), f"train.distill teacher {source!r}")
        return
    try:
        cls.load_config(source, subfolder=subfolder)
    except OSError as err:
        raise ConfigError(f"train.distill teacher {source!r} cannot be loaded: {err}") from None


def load_teacher(cls, source: str, subfolder: str = "transformer") -> nn.Module:
    """A frozen teacher transformer: a local transformer folder (saved with or without MHLA), a pipeline
    folder (its ``subfolder``), or a hub id (its ``subfolder``: ``transformer_2`` for Wan2.2's low-noise
    expert)."""
    path = Path(source)
    if path.is_dir():
        teacher = load_transformer(teacher_folder(path, subfolder))
    else:
        teacher = cls.from_pretrained(source, subfolder=subfolder)
    if not isinstance(teacher, cls):
        raise ConfigError(
            f"train.distill teacher {source!r} is a {type(teacher).__name__}, not a {cls.__name__}"
        )
    return teacher.eval().requires_grad_(False)
