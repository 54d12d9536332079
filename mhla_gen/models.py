"""MHLA transformer classes that diffusers' own loaders find: one subclass of each stock transformer.

``install_mhla`` turns a ``DiTTransformer2DModel`` into a :class:`MHLADiTTransformer2DModel` (same instance,
``__class__`` swapped; ``uninstall_mhla`` swaps it back), so what ``save_pretrained`` writes names the MHLA
class: ``config.json["_class_name"]`` is ``MHLADiTTransformer2DModel`` and a pipeline's ``model_index.json``
entry is ``["mhla_gen.models", "MHLADiTTransformer2DModel"]``. diffusers resolves such an entry from the
module (already imported: diffusers 0.42 imports no library a repository names, so ``import mhla_gen``
first), and the class's ``from_pretrained`` / ``from_config`` build the model with the MHLA of
``config["mhla"]`` installed before the weights load. So these load a saved MHLA model exactly as
:func:`mhla_gen.load_transformer` does::

    import mhla_gen  # registers the classes below with diffusers' loaders
    pipe = DiffusionPipeline.from_pretrained(folder)                     # or DiTPipeline.from_pretrained
    transformer = AutoModel.from_pretrained(folder, subfolder="transformer")
    transformer = MHLADiTTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    transformer = AutoModel.from_pretrained(lone_model_folder, trust_remote_code=True)

A lone model folder has no ``model_index.json`` to name ``mhla_gen.models``: ``save_pretrained`` writes
diffusers' custom-code entry ``config.json["auto_map"]`` and a one-line module beside it that imports the
class from ``mhla_gen`` (:mod:`mhla_gen.integration.auto_model`).

The MHLA classes add to the stock behaviour:

- ``from_pretrained`` refuses a folder whose config records MHLA but whose weights lack it (a folder re-saved
  by the stock class: :func:`mhla_gen.integration.serialization.check_mhla_weights`) instead of leaving meta
  tensors;
- ``save_pretrained`` refuses a model whose processors no longer match ``config["mhla"]``
  (:func:`mhla_gen.integration.install.check_mhla_consistent`), whoever replaced them module by module;
- ``set_attn_processor`` (diffusers' ``AttentionMixin``: SANA, SANA-Video, Wan) sets what it is given, as in
  diffusers, and the MHLA record follows (:func:`mhla_gen.integration.install.record_mhla_layers`): replaced
  layers leave MHLA, none left makes the model stock;
- ``load_lora_adapter`` (``PeftAdapterMixin``: SANA, SANA-Video, Wan) also loads the MHLA parameters that a
  LoRA + MHLA adapter file carries (:class:`mhla_gen.integration.lora.MHLALoraMixin`), so
  ``pipe.load_lora_weights(folder)`` works; ``save_lora_adapter`` warns that it writes the adapter only;
- ``from_single_file`` (``FromOriginalModelMixin``: SANA, SANA-Video, Wan) converts a release MHLA checkpoint
  (the released Wan-MHLA) and refuses other MHLA single files (:mod:`mhla_gen.integration.single_file`).

A new base is one line at the end of this file: ``MHLAFooModel = mhla_model_class(FooModel)`` (Wan2.2's
``transformer_2`` and Wan I2V are ``WanTransformer3DModel`` too: nothing to add).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from typing import ClassVar

from diffusers import (
    DiTTransformer2DModel,
    SanaTransformer2DModel,
    SanaVideoTransformer3DModel,
    WanTransformer3DModel,
)
from diffusers.loaders import FromOriginalModelMixin
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.attention import AttentionMixin
from diffusers.models.modeling_utils import ModelMixin

from .integration.auto_model import AUTO_MAP_KEY, auto_map, without_auto_map, write_auto_model_module
from .integration.install import (
    check_mhla_consistent,
    check_mhla_placement,
    follow_in_pipeline,
    install_mhla,
    is_mhla_installed,
    mhla_parameters,
    record_mhla_layers,
    register_mhla_class,
)
from .integration.lora import MHLALoraMixin
from .integration.serialization import check_mhla_weights
from .integration.single_file import MHLASingleFileMixin
from .processors.config import MHLAConfig


class MHLAModelMixin:
    """What every MHLA transformer class adds to its stock class (``stock_cls``): MHLA from the config, a
    ``from_pretrained`` that refuses a folder whose MHLA weights are missing, and a ``save_pretrained`` that
    refuses processors which disagree with the config."""

    stock_cls: ClassVar[type]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' ``from_pretrained``; a folder whose config records MHLA must hold its MHLA weights
        (a folder re-saved by the stock class does not:
        :func:`mhla_gen.integration.serialization.check_mhla_weights`).

        Raises:
            ValueError: MHLA parameters missing from the weights (diffusers would leave them on the meta
                device or at random init, with a warning).
        """
        wants_info = kwargs.pop("output_loading_info", False)
        loaded = super().from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
        model, info = loaded if isinstance(loaded, tuple) else (loaded, None)
        if info is not None and is_mhla_installed(model):
            subfolder = kwargs.get("subfolder")
            source = f"{pretrained_model_name_or_path}" + (f" (subfolder {subfolder})" if subfolder else "")
            found = set(mhla_parameters(model)) - set(info["missing_keys"])
            missing = check_mhla_weights(model, found, source)  # none found: a stock re-save, refused
            if missing:
                raise ValueError(f"{source}: the weights lack MHLA parameters {missing} its config needs")
        return (model, info) if wants_info else model

    @functools.wraps(ModelMixin.save_pretrained)  # keeps the signature: DiffusionPipeline inspects it
    def save_pretrained(self, *args, **kwargs):
        """diffusers' ``save_pretrained``, after the MHLA checks, with the module file ``AutoModel`` reads
        (:mod:`mhla_gen.integration.auto_model`) written first, so that ``push_to_hub`` uploads it too."""
        check_mhla_consistent(self, "save_pretrained")
        _follow_in_saving_pipeline(self)
        given = inspect.signature(ModelMixin.save_pretrained).bind(self, *args, **kwargs).arguments
        folder = given["save_directory"]
        if given.get("is_main_process", True) and not os.path.isfile(folder):  # a file: diffusers says so
            write_auto_model_module(folder)
        return super().save_pretrained(*args, **kwargs)

    def to_json_string(self) -> str:
        """diffusers' ``config.json`` text, with the ``auto_map`` entry that lets ``AutoModel`` find this
        class in a lone model folder (:mod:`mhla_gen.integration.auto_model`)."""
        config = {**json.loads(super().to_json_string()), AUTO_MAP_KEY: auto_map(type(self).__name__)}
        return json.dumps(config, indent=2, sort_keys=True) + "\n"

    @classmethod
    def extract_init_dict(cls, config_dict, **kwargs):
        """diffusers' ``extract_init_dict`` without ``auto_map``, which is no init argument."""
        return super().extract_init_dict(without_auto_map(config_dict), **kwargs)


def _follow_in_saving_pipeline(model) -> None:
    """Re-register ``model`` in the pipeline whose ``save_pretrained`` is saving it, so that the
    ``model_index.json`` it writes after its components names the MHLA class.

    diffusers records a component's class when the component is registered, so a pipeline built before an
    in-place ``install_mhla(pipe.transformer, cfg)`` still holds ``["diffusers", "DiTTransformer2DModel"]``,
    and its saved folder would load stock attention (two warnings, MHLA weights dropped). A model does not
    know its pipelines (``install_mhla`` does not search for them: a scan of every live object, too slow for
    every install), but the pipeline's ``save_pretrained`` is the caller here: found on this thread's call
    stack by its code object (O(stack depth); a subclass's override that calls it is found too), and each
    component it holds as this model, itself or ``torch.compile``-wrapped, is re-registered
    (:func:`~mhla_gen.integration.install.follow_in_pipeline`). diffusers has no hook of its own here: its
    ``save_pretrained`` writes ``self.config``, filled only by ``register_modules`` / ``__setattr__``.
    """
    from diffusers import DiffusionPipeline

    code, frame = DiffusionPipeline.save_pretrained.__code__, sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    pipe = frame.f_locals.get("self") if frame is not None else None
    if isinstance(pipe, DiffusionPipeline):
        follow_in_pipeline(pipe, model)


class MHLAAttentionMixin:
    """``set_attn_processor`` that keeps the MHLA record true (diffusers' ``AttentionMixin``)."""

    def set_attn_processor(self, processor):
        """diffusers' ``set_attn_processor``: the processors given replace the installed ones, MHLA layers
        included, and the layers that no longer hold an MHLA processor leave MHLA (``mhla_config.layers``
        and ``config["mhla"]`` name the rest; with none left the model is stock, as after
        ``uninstall_mhla``). A dict of the wrong size gets diffusers' own ValueError.

        Raises:
            ValueError: before any change, an MHLA processor set where this model's MHLA cannot run (a
                layer that is not self-attention, another MHLA config, one processor in two layers).
        """
        if not isinstance(processor, dict) or len(processor) == len(self.attn_processors):
            check_mhla_placement(self, processor)
        try:
            super().set_attn_processor(processor)
        finally:  # diffusers sets layer by layer: the record follows whatever it set, even on an error
            record_mhla_layers(self)


def _init_with_mhla(stock_cls: type):
    """``__init__`` of the MHLA subclass: the stock ``__init__``, then ``install_mhla`` from ``mhla`` (without
    ``mhla`` the instance becomes the stock class). Its signature is the stock one plus ``mhla``
    (diffusers' ``from_config`` reads the init keys from it)."""

    def __init__(self, *args, mhla: dict | MHLAConfig | None = None, **kwargs):
        stock_cls.__init__(self, *args, **kwargs)
        if mhla is None:  # a stock config (e.g. MHLA class.from_pretrained(stock folder)): a stock model,
            self.__class__ = stock_cls  # as the class always says whether MHLA runs
        else:
            install_mhla(self, mhla if isinstance(mhla, MHLAConfig) else MHLAConfig.from_dict(dict(mhla)))

    signature = inspect.signature(stock_cls.__init__)
    params = list(signature.parameters.values())
    keyword = inspect.Parameter("mhla", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    __init__.__signature__ = signature.replace(parameters=[*params[:at], keyword, *params[at:]])
    return __init__


def mhla_model_class(stock_cls: type) -> type:
    """``MHLA<stock name>``: the MHLA subclass of a stock diffusers transformer class, registered with
    ``install_mhla`` (which swaps a model's class to it) and living in this module (where diffusers'
    ``model_index.json`` entry ``["mhla_gen.models", name]`` finds it)."""
    mixins = [MHLAModelMixin]
    if issubclass(stock_cls, AttentionMixin):
        mixins.append(MHLAAttentionMixin)
    if issubclass(stock_cls, PeftAdapterMixin):
        mixins.append(MHLALoraMixin)
    if issubclass(stock_cls, FromOriginalModelMixin):
        mixins.append(MHLASingleFileMixin)
    name = f"MHLA{stock_cls.__name__}"
    doc = (f"diffusers' ``{stock_cls.__name__}`` with MHLA self-attention from ``config['mhla']`` "
           "(see :mod:`mhla_gen.models`).")
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": doc, "stock_cls": stock_cls,
                 "__init__": _init_with_mhla(stock_cls)}
    cls = type(name, (*mixins, stock_cls), namespace)
    register_mhla_class(stock_cls, cls)
    return cls


MHLADiTTransformer2DModel = mhla_model_class(DiTTransformer2DModel)
MHLASanaTransformer2DModel = mhla_model_class(SanaTransformer2DModel)
MHLAWanTransformer3DModel = mhla_model_class(WanTransformer3DModel)
MHLASanaVideoTransformer3DModel = mhla_model_class(SanaVideoTransformer3DModel)

__all__ = [
    "MHLADiTTransformer2DModel",
    "MHLAModelMixin",
    "MHLASanaTransformer2DModel",
    "MHLASanaVideoTransformer3DModel",
    "MHLAWanTransformer3DModel",
    "mhla_model_class",
]
