"""Install MHLA into a diffusers transformer in place, and take it out again.

``install_mhla(transformer, cfg)`` swaps the processor of the selected self-attention layers for the
base model's MHLA processor (an ``nn.Module``, so its parameters live in ``transformer.state_dict()``
and ``save_pretrained`` writes them; its class, from the model's base record (``bases.base_for_model``),
says which layers those are and how each call's grid reaches it), adds the hooks that hand each layer
the token grid of its own call (``processors/grid.py``) plus a forward pre-hook that checks the latent
against the blocks before any work, and records the config in two places:

- ``transformer.mhla_config``: the :class:`MHLAConfig` object;
- ``transformer.config["mhla"]``: its dict, registered with diffusers' ``register_to_config`` so that
  ``transformer.save_pretrained(d)`` writes it into ``d/config.json`` (read back by ``load_transformer``).

``install_mhla`` also turns the model into the MHLA subclass of its class (``DiTTransformer2DModel`` ->
``mhla_gen.models.MHLADiTTransformer2DModel``, registered here by :mod:`mhla_gen.models`), so
``save_pretrained`` writes that class name and diffusers' own loaders (``DiffusionPipeline.from_pretrained``,
``AutoModel``) rebuild the model with its MHLA; ``uninstall_mhla`` turns it back into the stock class. A
bare stock class's ``from_pretrained`` on such a folder drops the MHLA weights (docs/diffusers.md).
"""

from __future__ import annotations

import dataclasses
import gc

import torch
from diffusers.configuration_utils import FrozenDict
from torch import nn

from ..bases import base_for_model
from ..processors import MHLAProcessor
from ..processors.config import MHLAConfig
from ..processors.grid import latent_from_call

CONFIG_KEY = "mhla"

MHLA_MODEL_CLASSES: dict[type, type] = {}
"""``{stock diffusers class: its MHLA subclass}``, filled by :mod:`mhla_gen.models` (one line per base)."""


def register_mhla_class(stock_cls: type, mhla_cls: type) -> None:
    """Make ``install_mhla`` turn instances of exactly ``stock_cls`` into ``mhla_cls`` (and back)."""
    MHLA_MODEL_CLASSES[stock_cls] = mhla_cls


def stock_class_name(class_name: str | None) -> str | None:
    """The stock diffusers class name for a ``config.json["_class_name"]``: ``MHLADiTTransformer2DModel``
    -> ``DiTTransformer2DModel``; any other name unchanged."""
    for stock_cls, mhla_cls in MHLA_MODEL_CLASSES.items():
        if class_name == mhla_cls.__name__:
            return stock_cls.__name__
    return class_name


def _set_model_class(transformer: nn.Module, mhla: bool) -> None:
    """Swap ``transformer``'s class between the stock class and its MHLA subclass (same instance state).

    Only exact registered classes are swapped: a class wrapped around the model by someone else (e.g.
    FSDP2's ``fully_shard`` subclass) is left alone, and such a model saves under that class's name.
    """
    if mhla and type(transformer) in MHLA_MODEL_CLASSES:
        transformer.__class__ = MHLA_MODEL_CLASSES[type(transformer)]
    elif not mhla:
        stock = {m: s for s, m in MHLA_MODEL_CLASSES.items()}.get(type(transformer))
        if stock is not None:
            transformer.__class__ = stock


def is_mhla_installed(transformer: nn.Module) -> bool:
    return getattr(transformer, "mhla_config", None) is not None


def mhla_processors(transformer: nn.Module) -> dict[str, MHLAProcessor]:
    """``{module name: processor}`` of every installed MHLA processor, in depth order."""
    return {name: m for name, m in transformer.named_modules() if isinstance(m, MHLAProcessor)}


def mhla_parameters(transformer: nn.Module) -> dict[str, nn.Parameter]:
    """``{state-dict name: parameter}`` of the MHLA parameters only (mixing, CPE, gate).

    Useful for a separate optimizer group, or to fine-tune only MHLA.
    """
    return {
        f"{name}.{pname}": p
        for name, proc in mhla_processors(transformer).items()
        for pname, p in proc.named_parameters()
    }


def _check_latent(transformer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the latent's token grid must fit the MHLA blocks (a clear error before any work).

    A module-level function that looks everything up on ``transformer`` (no closure), so a
    ``copy.deepcopy`` of the model (e.g. an EMA copy) keeps working hooks.
    """
    processor = base_for_model(transformer).processor
    processor.check_call(transformer, processor.latent_grid(transformer, latent_from_call(args, kwargs)))


def _share_parallel_config(transformer: nn.Module, processor) -> None:
    """A processor swapped in after ``enable_parallelism`` gets the context-parallel config that call gave
    the processors it found (diffusers sets ``processor._parallel_config`` only there)."""
    parallel = getattr(transformer, "_parallel_config", None)
    if getattr(parallel, "context_parallel_config", None) is not None and hasattr(
        processor, "_parallel_config"
    ):
        processor._parallel_config = parallel


def _selected_layers(cfg: MHLAConfig, num_layers: int) -> list[int]:
    if cfg.layers is None:
        return list(range(num_layers))
    bad = [i for i in cfg.layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"MHLA layers {bad} out of range: the model has {num_layers} self-attention layers")
    repeated = sorted({i for i in cfg.layers if cfg.layers.count(i) > 1})
    if repeated:
        raise ValueError(f"MHLA layers listed more than once: {repeated}")
    return sorted(cfg.layers)


def install_mhla(transformer: nn.Module, cfg: MHLAConfig) -> nn.Module:
    """Replace the self-attention of ``transformer`` with MHLA, in place; returns ``transformer``.

    The pretrained q/k/v/out projections are kept; each selected layer gets fresh MHLA parameters
    (mixing matrix at its locality init, CPE and gate at their identity inits) on the device and dtype of
    that layer's weights. With ``cfg.chunk_frames`` (Wan) every other self-attention layer gets block-causal
    softmax (``processors/wan_softmax.py``; ``layers=[]``: softmax throughout), which has no parameters.
    Installing again first uninstalls the previous MHLA (its parameters are lost).

    Raises:
        ValueError: unsupported model class, ``cfg.blocks`` of the wrong rank (2 for DiT/SANA, 3 for Wan),
            ``cfg.layers`` indices out of range or repeated, settings the base cannot run
            (``processor.check_config``: e.g. ``chunk_frames`` outside Wan).
    """
    if not isinstance(cfg, MHLAConfig):
        raise ValueError(f"cfg must be an MHLAConfig, got {type(cfg).__name__}")
    processor_cls = base_for_model(transformer).processor
    if len(cfg.blocks) != processor_cls.grid_ndim:
        raise ValueError(
            f"{type(transformer).__name__} has a {processor_cls.grid_ndim}D token grid but MHLA blocks "
            f"{cfg.blocks} have {len(cfg.blocks)} entries"
        )
    attention_layers = processor_cls.self_attention(transformer)
    selected = _selected_layers(cfg, len(attention_layers))
    processor_cls.check_config(cfg, dict(transformer.config))
    if is_mhla_installed(transformer):
        _put_stock_processors(transformer)
        _forget_mhla(transformer)  # the class comes back below: pipelines holding the model stay right

    for index, attn in enumerate(attention_layers):
        if index in selected:
            weight = attn.to_q.weight
            processor = processor_cls.for_layer(attn, cfg).to(device=weight.device, dtype=weight.dtype)
        else:  # block-causal softmax in a streaming model (Wan), else None: the layer stays as it is
            processor = processor_cls.softmax_processor(attn, cfg)
        if processor is not None:
            _share_parallel_config(transformer, processor)
            attn.set_processor(processor)
            _keep_under_attention_switches(attn, True)

    transformer.mhla_config = cfg
    _register_hooks(transformer)
    transformer.register_to_config(**{CONFIG_KEY: cfg.to_dict()})
    _set_model_class(transformer, mhla=True)
    return transformer


def uninstall_mhla(transformer: nn.Module) -> nn.Module:
    """Put the stock diffusers processors back and remove the hook and the config; returns ``transformer``.

    The result computes exactly what a never-touched model computes (the MHLA parameters are dropped), and
    a diffusers pipeline holding ``transformer`` records the stock class again (its ``model_index.json``
    names diffusers' class, as for a never-touched model).
    """
    if not is_mhla_installed(transformer):
        raise ValueError(f"no MHLA installed in this {type(transformer).__name__}")
    _put_stock_processors(transformer)
    _forget_mhla(transformer)
    _follow_in_pipelines(transformer)
    return transformer


def _installed(processor, processor_cls) -> bool:
    """Whether ``install_mhla`` put ``processor`` there: MHLA, or a streaming model's block-causal softmax."""
    softmax = processor_cls.softmax_processor_cls
    return isinstance(processor, MHLAProcessor) or (softmax is not None and isinstance(processor, softmax))


def _put_stock_processors(transformer: nn.Module) -> None:
    processor_cls = base_for_model(transformer).processor
    for attn in processor_cls.self_attention(transformer):
        if _installed(attn.processor, processor_cls):
            processor = processor_cls.stock_processor()
            _share_parallel_config(transformer, processor)
            attn.set_processor(processor)
        _keep_under_attention_switches(attn, False)


# diffusers' per-module switches that put a softmax processor of their own in an attention module
ATTENTION_SWITCHES = ("set_use_memory_efficient_attention_xformers", "set_use_npu_flash_attention",
                      "set_use_xla_flash_attention", "set_attention_slice")


def _keep_installed_processor(*args, **kwargs) -> None:
    """One of diffusers' attention switches, answered by a layer holding a processor ``install_mhla`` put
    there: it keeps it (:func:`_keep_under_attention_switches`)."""


def _keep_under_attention_switches(attn: nn.Module, keep: bool) -> None:
    """Make the attention module ``attn`` keep its processor under diffusers' attention switches
    (``keep``), or answer them as diffusers does again.

    ``enable_/disable_xformers_memory_efficient_attention``, ``enable_/disable_npu_flash_attention`` and
    ``enable_/disable_xla_flash_attention`` (of a model or a pipeline) call the switches of
    :data:`ATTENTION_SWITCHES` on every attention module (and a module's ``set_attention_slice`` does the
    same); diffusers' ``Attention`` (DiT, SANA, SANA-Video) answers by setting its own softmax processor
    (xformers', NPU's, XLA's, sliced, or to disable, its default one) in its place, so an MHLA layer would
    run softmax attention while ``config["mhla"]`` records MHLA. An MHLA layer needs none of them (its
    memory is linear in the tokens), so it keeps its processor and the stock layers switch as in diffusers.
    Instance attributes (a plain function: the module stays copyable and picklable) shadow the class's
    methods; diffusers has no per-processor hook for these."""
    for switch in ATTENTION_SWITCHES:
        if keep:
            setattr(attn, switch, _keep_installed_processor)
        else:
            attn.__dict__.pop(switch, None)


def _register_hooks(transformer: nn.Module) -> None:
    """(Re-)register the latent check and the grid hooks of the layers that run MHLA now."""
    for hook in getattr(transformer, "_mhla_hooks", []):
        hook.remove()
    transformer._mhla_hooks = [
        transformer.register_forward_pre_hook(_check_latent, with_kwargs=True),
        *base_for_model(transformer).processor.grid_hooks(transformer),
    ]


def _forget_mhla(transformer: nn.Module) -> None:
    """Drop the MHLA record (hooks, ``mhla_config``, ``config["mhla"]``, the MHLA class), processors as
    they are: the model is stock from here on, for every loader and saver."""
    for hook in transformer._mhla_hooks:
        hook.remove()
    for name in ("_mhla_hooks", "mhla_config"):
        delattr(transformer, name)
    transformer._internal_dict = FrozenDict({k: v for k, v in transformer.config.items() if k != CONFIG_KEY})
    _set_model_class(transformer, mhla=False)


def record_mhla_layers(transformer: nn.Module) -> None:
    """Make the MHLA record name the self-attention layers that run MHLA now, after processors were set
    through diffusers (``set_attn_processor``): ``mhla_config.layers`` and ``config["mhla"]`` list the
    layers still holding an MHLA processor, and without any the model is stock (as after
    :func:`uninstall_mhla`, the processors diffusers set left in place). A no-op without MHLA."""
    if not is_mhla_installed(transformer) or transformer.mhla_config.chunk_frames is not None:
        return  # a block-causal model's self-attention processors cannot change (check_mhla_placement)
    cfg = transformer.mhla_config
    layers = base_for_model(transformer).processor.self_attention(transformer)
    running = [i for i, attn in enumerate(layers) if isinstance(attn.processor, MHLAProcessor)]
    for attn in layers:
        _keep_under_attention_switches(attn, isinstance(attn.processor, MHLAProcessor))
    if not running:
        _forget_mhla(transformer)
        _follow_in_pipelines(transformer)
        return
    if running != _selected_layers(cfg, len(layers)):
        cfg = dataclasses.replace(cfg, layers=None if len(running) == len(layers) else running)
        transformer.mhla_config = cfg
        transformer.register_to_config(**{CONFIG_KEY: cfg.to_dict()})
    for i in running:
        layers[i].processor.cfg = cfg  # differs at most in `layers` (check_mhla_placement)
    _register_hooks(transformer)


def check_mhla_placement(transformer: nn.Module, processor) -> None:
    """ValueError, before anything changes, when ``set_attn_processor(processor)`` would put an MHLA
    processor where this model's MHLA cannot run: an attention that is not self-attention, a processor of
    another base or another MHLA config (one model runs one config), or one processor in two layers; and
    any new self-attention processor in a block-causal model (``chunk_frames``: its softmax layers too).
    ``processor``: one processor for every layer, or ``{"<module>.processor": processor}``."""
    processor_cls = base_for_model(transformer).processor
    names = {id(m): name for name, m in transformer.named_modules()}
    self_attention = {f"{names[id(attn)]}.processor" for attn in processor_cls.self_attention(transformer)}
    given = processor if isinstance(processor, dict) else {k: processor for k in transformer.attn_processors}
    layerless = dataclasses.replace(transformer.mhla_config, layers=None)
    chunk_frames, current = transformer.mhla_config.chunk_frames, transformer.attn_processors
    bad, seen = [], {}
    for key, proc in given.items():
        if chunk_frames is not None and key in self_attention and proc is not current[key]:
            bad.append(f"{key}: a block-causal model (chunk_frames={chunk_frames}) keeps its self-attention "
                       "processors (another would see later chunks)")
            continue
        if not isinstance(proc, MHLAProcessor):
            continue
        if key not in self_attention or not isinstance(proc, processor_cls):
            bad.append(f"{key}: {type(proc).__name__} cannot run there")
        elif dataclasses.replace(proc.cfg, layers=None) != layerless:
            bad.append(f"{key}: its MHLA config differs from this model's {layerless.to_dict()}")
        if id(proc) in seen:
            bad.append(f"{key}: the processor of {seen[id(proc)]} again")
        seen.setdefault(id(proc), key)
    if bad:
        raise ValueError(
            f"set_attn_processor refused (nothing changed) for this {type(transformer).__name__}: "
            + "; ".join(bad) + ". MHLA processors stay in self-attention layers with the installed config; "
            "use install_mhla to install another MHLA"
        )


def recorded_module(module):
    """The module whose class a diffusers pipeline records for the component ``module``: ``module``
    without its ``torch.compile`` (``_orig_mod``) or peft wrapper, unwrapped as diffusers'
    ``_fetch_class_library_tuple`` does (pyproject pins diffusers to 0.42.x, where it is this function)."""
    from diffusers.pipelines.pipeline_loading_utils import _unwrap_model

    return _unwrap_model(module)


def names_holding(pipe, component: nn.Module) -> list[str]:
    """The registered components of ``pipe`` that are ``component``, as it is or wrapped
    (:func:`recorded_module`): ``transformer``, Wan2.2's ``transformer_2``, any other name."""
    return [name for name, entry in pipe.config.items()
            if isinstance(entry, (tuple, list)) and isinstance(held := pipe.__dict__.get(name), nn.Module)
            and recorded_module(held) is component]


def follow_in_pipeline(pipe, component: nn.Module) -> None:
    """Re-register every component of ``pipe`` that holds ``component`` (:func:`names_holding`), so that
    ``pipe.config`` (its ``model_index.json``) names the class ``component`` has now; the held object
    (a ``torch.compile`` wrapper, say) stays what it is."""
    for name in names_holding(pipe, component):
        pipe.register_modules(**{name: pipe.__dict__[name]})


def _live_pipelines() -> list:
    """Every live diffusers pipeline of this process.

    A model does not know the pipelines it sits in; the garbage collector knows every pipeline (an
    instance refers to its class, so ``gc.get_referrers`` of every pipeline class finds them in one pass
    over the live objects), so this looks there instead of asking callers for the pipeline.
    """
    from diffusers import DiffusionPipeline

    classes = [DiffusionPipeline]
    for cls in classes:  # every pipeline class imported so far (a live pipeline's class is one of them)
        classes += [sub for sub in cls.__subclasses__() if sub not in classes]
    return [o for o in gc.get_referrers(*classes) if isinstance(o, DiffusionPipeline)]


def _follow_in_pipelines(transformer: nn.Module) -> None:
    """Re-register ``transformer`` in the pipelines holding it, itself or inside a ``torch.compile`` / peft
    wrapper (:func:`follow_in_pipeline`), so that their ``model_index.json`` names its class as it is now
    (diffusers records a component's class when it is registered). Called when a model goes back to stock;
    ``install_mhla`` does not look (a pass over every live object: about a tenth of a second in a process
    with torch and diffusers loaded, too slow for every install): a pipeline built before an in-place
    install is re-registered when it saves the model (``mhla_gen.models``)."""
    for pipe in _live_pipelines():
        follow_in_pipeline(pipe, transformer)


def check_mhla_consistent(transformer: nn.Module, action: str = "saving") -> None:
    """ValueError naming ``uninstall_mhla`` unless the processors that run are the ones ``config["mhla"]``
    describes: an MHLA processor of that config in exactly the configured layers, stock elsewhere.

    A processor replaced behind ``install_mhla``'s back (diffusers' per-module ``attn.set_processor``; the
    model-level ``set_attn_processor`` of the MHLA classes updates the record instead) would otherwise be
    saved as a folder that claims MHLA and does not load.
    """
    cfg = transformer.mhla_config
    processor_cls = base_for_model(transformer).processor
    layers = processor_cls.self_attention(transformer)
    wanted = set(_selected_layers(cfg, len(layers)))
    softmax = processor_cls.softmax_processor_cls if cfg.chunk_frames is not None else None
    wrong = [
        i for i, attn in enumerate(layers)
        if isinstance(attn.processor, MHLAProcessor) != (i in wanted)
        or (i in wanted and attn.processor.cfg != cfg)
        or (i not in wanted and softmax is not None
            and not (isinstance(attn.processor, softmax) and attn.processor.cfg == cfg))
    ]
    if wrong:
        raise ValueError(
            f"{action} refused: self-attention layers {wrong} of this {type(transformer).__name__} do "
            f"not run the MHLA its config records (blocks {list(cfg.blocks)}, layers {cfg.layers}); their "
            "processors were replaced outside install_mhla. Call mhla_gen.uninstall_mhla(transformer) to go "
            "back to stock attention (then set processors freely), or install_mhla again"
        )


@torch.no_grad()
def mhla_state_dict(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of :func:`mhla_parameters` (what ``save_mhla_parameters`` writes)."""
    return {name: p.detach().cpu().contiguous() for name, p in mhla_parameters(transformer).items()}
