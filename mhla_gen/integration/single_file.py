"""``from_single_file`` of the MHLA transformer classes (those whose stock class has diffusers'
``FromOriginalModelMixin``: SANA, SANA-Video, Wan).

diffusers' own ``from_single_file`` builds the model from a diffusers config and maps the file's keys with
its converter for the stock architecture: MHLA keys end up unused (a warning) and the model is stock. Here:

- a checkpoint in the format of an original MHLA release (the released Wan-MHLA checkpoint: its base
  records name the reader, ``Base.release_checkpoint``) is converted exactly as
  ``scripts/convert_wan_mhla.py`` converts it
  (:func:`mhla_gen.integration.convert_wan.convert_wan_checkpoint`), with the diffusers config
  ``from_single_file`` would use (``config=`` / ``subfolder=``, or the default repo diffusers infers from the
  keys);
- any other file holding MHLA parameters is refused in one line (a single file has no MHLA config);
- a stock checkpoint gives the stock model, as diffusers' own call does (the MHLA class on a stock folder
  gives the stock model too).
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import fetch_diffusers_config, load_single_file_checkpoint
from torch import nn

from ..bases import BASES

MHLA_KEY_MARKERS = (".processor.", "block_attn")
"""Substrings of the keys of MHLA parameters: diffusers' layout (``attn1.processor.mixing.weight``) and the
release's (``self_attn.block_attn.conv.weight``)."""

_HUB_ARGS = ("force_download", "proxies", "token", "cache_dir", "local_files_only", "revision",
             "disable_mmap")


def _release_readers(stock_cls: type) -> list:
    """The release-checkpoint readers of the base records of ``stock_cls`` (each named once)."""
    refs = {b.release_checkpoint for b in BASES.values() if b.transformer_class is stock_cls}
    return [ref.load() for ref in sorted(refs - {None}, key=lambda ref: ref.path)]


def _diffusers_config(cls: type, checkpoint: dict, kwargs: dict) -> dict:
    """The config diffusers' ``from_single_file`` would build the model from: ``config`` (a repo id or a
    folder, with ``subfolder``) or, without it, the default repo it infers from the keys."""
    config, subfolder = kwargs.get("config"), kwargs.get("subfolder")
    if config is None:  # diffusers' default: the repo its key patterns point at, subfolder "transformer"
        config, subfolder = fetch_diffusers_config(checkpoint)["pretrained_model_name_or_path"], "transformer"
    loaded = cls.load_config(config, subfolder=subfolder, local_files_only=kwargs.get("local_files_only"),
                             token=kwargs.get("token"), revision=kwargs.get("config_revision"))
    return dict(loaded)


class MHLASingleFileMixin:
    """``from_single_file`` that converts a release MHLA checkpoint instead of dropping its MHLA."""

    @classmethod
    def from_single_file(cls, pretrained_model_link_or_path_or_dict=None, **kwargs) -> nn.Module:
        """diffusers' ``from_single_file``; a release MHLA checkpoint loads through the project's converter
        (dtypes as in the file unless ``torch_dtype`` / ``dtype``, then ``device``, as diffusers does).

        Raises:
            ValueError: MHLA parameters in a file that is not a release checkpoint this class reads.
        """
        source = pretrained_model_link_or_path_or_dict
        if isinstance(source, dict):
            checkpoint = source
        else:  # diffusers' own reader (local files, hub links), read once and handed on below
            hub = {k: kwargs[k] for k in _HUB_ARGS if k in kwargs}
            checkpoint = load_single_file_checkpoint(source, **hub)
        for read in _release_readers(cls.stock_cls):
            model = read(checkpoint, lambda: _diffusers_config(cls, checkpoint, kwargs))
            if model is not None:
                dtype = kwargs.get("dtype") or kwargs.get("torch_dtype")
                device = kwargs.get("device")
                return model.to(**{k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None})
        found = sorted(k for k in checkpoint if any(marker in k for marker in MHLA_KEY_MARKERS))
        if found:
            release = (" (not in the layout of the released checkpoint, which it converts as "
                       "scripts/convert_wan_mhla.py does)" if _release_readers(cls.stock_cls) else "")
            what = "this state dict" if isinstance(source, dict) else source
            raise ValueError(
                f"{what} holds MHLA parameters ({found[0]}, ... {len(found)} keys) that "
                f"{cls.__name__}.from_single_file cannot place{release}: a single file carries no MHLA "
                "config; save MHLA models with save_pretrained and load them with from_pretrained or "
                "mhla_gen.load_transformer"
            )
        return super().from_single_file(checkpoint, **kwargs)
