"""Load the released Wan-MHLA checkpoint (original Wan key names) into diffusers' ``WanTransformer3DModel``.

The release (DAGroup-PKU/MHLA, ``mhla_videogen``) fine-tuned Wan2.1-T2V-1.3B in the original Wan code
layout: ``blocks.{i}.self_attn.q/k/v/o``, ``norm_q/norm_k``, ``cross_attn.*``, ``ffn.0/ffn.2``,
``modulation``, ``patch_embedding``, ``text_embedding.*``, ``time_embedding.*``, ``time_projection.*``,
``head.head``, ``head.modulation``; its MHLA layers add

* ``blocks.{i}.self_attn.block_attn.conv.weight``: the mixing matrix as a 1×1 ``Conv2d`` over the block
  axis, shape ``(M, M, 1, 1)`` with ``conv.weight[i, j] = W[i, j]`` (query block i reads key block j);
* ``blocks.{i}.self_attn.g_norm.weight``: an RMSNorm over each head's output, ``(head_dim,)``;
* optionally ``self_attn.g.*`` (SiLU output gate) and ``self_attn.lepe.*`` (3×3×3 depthwise conv of V).

Softmax layers (every third, ``i % 3 == 0`` in the released hybrid) carry no MHLA keys, so the MHLA
layer list is read from the checkpoint. The result uses the ``wan-release`` preset: no normaliser, RoPE on
φ(q), φ(k) for the numerator only, per-head RMSNorm. How the release differs from this library's
defaults (see also the README, "The released Wan-MHLA checkpoint"):

1. No normaliser: outputs scale with the number of tokens and ``g_norm`` rescales each head.
2. RoPE after φ, numerator only (``wan_rope="after_phi_numerator"``).
3. Its φ is ``relu(x) + 1e-6`` (the preset's ``feature_map="relu+1e-6"``); this library's default is
   ``relu(x)``, which would change the numerator by about 4e-6 relative (median, measured on the tiny
   test model).
4. Mixing matrix initialised with column normalisation; never clamped during training (it may hold
   values outside [0, 1]; :func:`mhla_gen.clamp_mixing_` would change a converted model: don't call it
   unless you fine-tune further and want the paper's constraint).
5. Latents were cropped so the token grid divides the (3, 5, 10) blocks exactly (480x832 inputs were
   cut to 480x800, latent grid 21x30x50). This converter does not crop: at 480x832 the grid is 21x30x52
   and the 52 columns split into blocks of 6,6,5,...,5 tokens. The weights load unchanged; outputs on
   uneven grids are the natural extension, not what the release computed. For release-identical
   numerics generate at sizes whose latent grid divides (3, 5, 10) (e.g. 480x800, 81 frames).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch
from accelerate import init_empty_weights
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file

from ..bases import base_for_model
from ..processors.config import MHLAConfig
from .cards import CardFacts, Snippet, base_license, base_line, load_folder, public_ref
from .install import install_mhla, stock_class_name

# module paths outside the blocks: original -> diffusers (each followed by ".weight" / ".bias")
TOP_MODULES = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",  # I2V / FLF2V image embedding
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
# bare parameters outside the blocks
TOP_PARAMS = {
    "head.modulation": "scale_shift_table",
    "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed",
}
# module paths inside ``blocks.{i}``
BLOCK_MODULES = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "norm3": "norm2",  # Wan's cross-attention norm is norm3, diffusers' norm2 (the FFN norms have no params)
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
    # MHLA extras -> the WanMHLAProcessor of attn1
    "self_attn.block_attn.conv": "attn1.processor.mixing",
    "self_attn.g_norm": "attn1.processor.head_norm",
    "self_attn.g": "attn1.processor.gate.proj",
    "self_attn.lepe": "attn1.processor.cpe.conv",
}
BLOCK_PARAMS = {"modulation": "scale_shift_table"}
IGNORED_KEYS = ("freqs",)  # RoPE table some Wan versions store; diffusers recomputes it
MIXING_KEY = "self_attn.block_attn.conv.weight"

_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")
_WRAPPER_KEYS = ("state_dict", "model", "module")
_PREFIXES = ("model.diffusion_model.", "module.", "_orig_mod.", "model.")


def _rename(
    key: str, top_modules: dict, top_params: dict, block_modules: dict, block_params: dict
) -> str | None:
    """Rename one key with the given tables; None when no table knows it."""
    if key in top_params:
        return top_params[key]
    match = _BLOCK_KEY.fullmatch(key)
    prefix, rest = (f"blocks.{match.group(1)}.", match.group(2)) if match else ("", key)
    modules, params = (block_modules, block_params) if match else (top_modules, {})
    if rest in params:
        return prefix + params[rest]
    if "." not in rest:
        return None
    module, param = rest.rsplit(".", 1)
    return prefix + modules[module] + "." + param if module in modules else None


def original_to_diffusers_key(key: str) -> str | None:
    """``blocks.3.self_attn.q.weight`` -> ``blocks.3.attn1.to_q.weight``; None for an unknown key."""
    return _rename(key, TOP_MODULES, TOP_PARAMS, BLOCK_MODULES, BLOCK_PARAMS)


_INVERSE_TABLES = [
    {v: k for k, v in t.items()} for t in (TOP_MODULES, TOP_PARAMS, BLOCK_MODULES, BLOCK_PARAMS)
]


def diffusers_to_original_key(key: str) -> str | None:
    """The inverse of :func:`original_to_diffusers_key`."""
    return _rename(key, *_INVERSE_TABLES)


def _mixing_matrix(weight: torch.Tensor, key: str) -> torch.Tensor:
    """The release's 1×1-conv weight ``(M, M, 1, 1)`` (or ``(M, M, 1)``, ``(M, M)``) -> ``(M, M)``."""
    m = weight.shape[0] if weight.dim() else 0
    if weight.dim() < 2 or weight.shape[:2] != (m, m) or any(s != 1 for s in weight.shape[2:]):
        raise ValueError(
            f"{key} must have shape (M, M), (M, M, 1) or (M, M, 1, 1), got {tuple(weight.shape)}"
        )
    return weight.reshape(m, m)


def original_to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Wan(-MHLA) state dict to diffusers names. Raises ValueError listing every unknown key."""
    out, unknown = {}, []
    for key, tensor in state.items():
        if key in IGNORED_KEYS:
            continue
        new_key = original_to_diffusers_key(key)
        if new_key is None:
            unknown.append(key)
            continue
        out[new_key] = _mixing_matrix(tensor, key) if key.endswith(MIXING_KEY) else tensor
    if unknown:
        raise ValueError(f"unknown keys in the Wan checkpoint (no diffusers name): {sorted(unknown)}")
    return out


def diffusers_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Wan(+MHLA) state dict in the original release layout (the mixing matrix as a 1×1 conv)."""
    out, unknown = {}, []
    for key, tensor in state.items():
        old_key = diffusers_to_original_key(key)
        if old_key is None:
            unknown.append(key)
            continue
        out[old_key] = tensor[:, :, None, None] if old_key.endswith(MIXING_KEY) else tensor
    if unknown:
        raise ValueError(f"diffusers keys without an original Wan name: {sorted(unknown)}")
    return out


def read_checkpoint(path, state_dict_key: str | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: a ``.safetensors`` file, a folder of shards (with or without a
    ``*.safetensors.index.json``), or a ``.pth`` / ``.pt`` / ``.bin`` / ``.ckpt`` file.

    ``.pth`` files may wrap the tensors (``{"state_dict": ...}``, ``{"model": ...}``); ``state_dict_key``
    picks the entry (e.g. ``"state_dict_ema"``), otherwise the first of ``state_dict``, ``model``,
    ``module`` found is used. Common prefixes (``model.diffusion_model.``, ``module.``) are stripped.
    """
    path = Path(path)
    if path.is_dir():
        state = _read_folder(path)
    elif not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    elif path.suffix == ".safetensors":
        state = _load(load_file, path)
    elif path.suffix in (".pth", ".pt", ".bin", ".ckpt"):
        torch_load = lambda file: torch.load(file, map_location="cpu", weights_only=True)  # noqa: E731
        state = _unwrap(_load(torch_load, path), state_dict_key, path)
    else:
        raise ValueError(
            f"unsupported checkpoint file {path}: expected .safetensors, .pth, .pt, .bin or .ckpt"
        )
    return _strip_prefixes(state)


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(
            f"{folder} holds several index files {[p.name for p in indexes]}; pass one shard set"
        )
    if indexes:
        shards = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"shards {missing} listed in {indexes[0]} do not exist")
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no .safetensors files in {folder}")
    state = {}
    for shard in shards:
        state.update(_load(load_file, folder / shard))
    return state


def _load(reader, path: Path):
    """``reader(path)``; a file that does not read (truncated, not a checkpoint: safetensors and torch raise
    their own error types) becomes one ``ValueError`` naming it. A whole ``torch.save`` file holding
    objects besides tensors, which ``torch.load(weights_only=True)`` refuses, is said as such (with
    torch's reason)."""
    try:
        return reader(path)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - SafetensorError, RuntimeError, pickle.UnpicklingError, ...
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        reason = next((line for line in lines if line.startswith("WeightsUnpickler error:")), None)
        if reason is not None:
            reason = reason.removeprefix("WeightsUnpickler error: ")
            raise ValueError(
                f"checkpoint file {str(path)!r} holds objects besides tensors, which the converter does not "
                f"unpickle (torch.load(weights_only=True): {reason}); "
                f"if you trust it, save its state dict alone (torch.save or safetensors) and convert that"
            ) from None
        first = lines[0] if lines else type(err).__name__
        raise ValueError(f"checkpoint file {str(path)!r} does not read ({first}); is it complete?") from None


def _unwrap(obj, state_dict_key: str | None, path: Path) -> dict[str, torch.Tensor]:
    if state_dict_key is not None:
        if not isinstance(obj, dict) or state_dict_key not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{path} has no entry {state_dict_key!r}; top-level entries: {keys}")
        obj = obj[state_dict_key]
    while isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        wrapper = next((k for k in _WRAPPER_KEYS if k in obj), None)
        if wrapper is None:
            raise ValueError(
                f"cannot find the tensors in {path}: top-level entries {sorted(obj)}; pass state_dict_key"
            )
        obj = obj[wrapper]
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return obj


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in _PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def read_transformer_config(config) -> dict:
    """A ``WanTransformer3DModel`` config: a dict, a ``config.json``, a model or pipeline folder, a hub id."""
    if isinstance(config, dict):
        cfg = dict(config)
    elif not Path(config).exists() and str(config).count("/") == 1:  # a hub id: fetch only the config
        cfg = dict(WanTransformer3DModel.load_config(str(config), subfolder="transformer"))
    else:
        path = Path(config)
        candidates = [path, path / "config.json", path / "transformer" / "config.json"]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"no Wan transformer config at {path} (tried {[str(p) for p in candidates]})"
            )
        cfg = json.loads(found.read_text())
    class_name = stock_class_name(cfg.get("_class_name", WanTransformer3DModel.__name__))
    if class_name != WanTransformer3DModel.__name__:
        raise ValueError(f"config is for {class_name}, not {WanTransformer3DModel.__name__}")
    cfg.pop("mhla", None)  # a config taken from an MHLA folder: the checkpoint decides MHLA here
    return cfg


def infer_mhla_config(
    state: dict[str, torch.Tensor], num_layers: int, base: MHLAConfig | None = None
) -> MHLAConfig:
    """The MHLA config a release-format state dict was trained with (``base``: ``wan-release`` preset).

    Reads the MHLA layers (those with ``block_attn``), the head norm, gate and LePE from the keys, and
    checks the number of blocks against the mixing matrices.
    """
    base = base or MHLAConfig.preset("wan-release")
    layers = sorted(
        int(m.group(1)) for k in state if (m := _BLOCK_KEY.fullmatch(k)) and m.group(2) == MIXING_KEY
    )
    if not layers:
        raise ValueError(
            f"no MHLA layers in the checkpoint (no blocks.*.{MIXING_KEY}): not a Wan-MHLA checkpoint"
        )
    sizes = {state[f"blocks.{i}.{MIXING_KEY}"].shape[0] for i in layers}
    if sizes != {math.prod(base.blocks)}:
        raise ValueError(
            f"the checkpoint's mixing matrices have {sorted(sizes)} blocks but MHLA blocks {base.blocks} "
            f"give {math.prod(base.blocks)}; pass an MHLAConfig with matching blocks"
        )

    def has(name: str) -> bool:
        return any(f"blocks.{i}.self_attn.{name}" in state for i in layers)

    gate, lepe = has("g.weight"), has("lepe.weight")
    if gate and lepe:
        raise ValueError(
            "checkpoint has both an output gate (self_attn.g) and LePE (self_attn.lepe): the release applies "
            "the gate before adding LePE, this library adds CPE before gating, so the outputs would differ"
        )
    cpe_kernel = state[f"blocks.{layers[0]}.self_attn.lepe.weight"].shape[-1] if lepe else 0
    return dataclasses.replace(
        base,
        layers=None if layers == list(range(num_layers)) else layers,
        wan_head_norm=has("g_norm.weight"),
        gate=gate,
        gate_activation="silu" if gate else base.gate_activation,
        cpe_kernel=cpe_kernel,
    )


def convert_wan_checkpoint(
    checkpoint,
    config,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype | None = torch.float32,
    state_dict_key: str | None = None,
) -> WanTransformer3DModel:
    """A ``WanTransformer3DModel`` with MHLA installed and the release weights loaded.

    Args:
        checkpoint: path (see :func:`read_checkpoint`) or an already loaded original-format state dict.
        config: the diffusers transformer config (dict, ``config.json``, model folder or pipeline folder),
            e.g. the one of ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``.
        mhla: base MHLA settings (default: ``wan-release``); layers, head norm, gate and CPE are read
            from the checkpoint.
        torch_dtype: cast every tensor (None keeps the checkpoint's dtypes); every tensor is copied.
    Returns:
        the model in eval mode; ``save_pretrained`` it and reload with :func:`mhla_gen.load_transformer`.
    Raises:
        ValueError: unknown keys, missing keys or wrong shapes (each listed with its original name).
    """
    state = checkpoint if isinstance(checkpoint, dict) else read_checkpoint(checkpoint, state_dict_key)
    converted = original_to_diffusers(state)
    # The model owns its parameters: each is copied into freshly allocated memory. Read from a shard, a
    # tensor sits at whatever 8-byte offset the file gives it, and CPU GEMM kernels sum in another order
    # for such unaligned operands: the same weights would then compute different last bits (and a
    # caller's state dict would alias the model).
    converted = {k: v.to(dtype=torch_dtype or v.dtype, copy=True) for k, v in converted.items()}

    with init_empty_weights(include_buffers=False):  # parameters on meta, filled by assignment below
        model = WanTransformer3DModel.from_config(read_transformer_config(config))
    install_mhla(model, infer_mhla_config(state, len(model.blocks), mhla))  # processors follow onto meta
    _check_against_model(model, converted)
    model.load_state_dict(converted, strict=True, assign=True)
    return model.eval()


def is_release_checkpoint(state: dict[str, torch.Tensor]) -> bool:
    """Whether an original-layout state dict carries the release's MHLA (a mixing matrix in some block)."""
    return any((m := _BLOCK_KEY.fullmatch(k)) and m.group(2) == MIXING_KEY for k in _strip_prefixes(state))


def release_checkpoint_model(checkpoint: dict[str, torch.Tensor], load_config):
    """``MHLAWanTransformer3DModel.from_single_file``'s converter (:mod:`mhla_gen.integration.single_file`):
    the model (a ``WanTransformer3DModel`` with MHLA) of a release-format checkpoint (the tensors as diffusers
    reads the file, dtypes kept), or None when ``checkpoint`` carries no release MHLA. ``load_config()`` gives
    the diffusers transformer config; it is called only for a release checkpoint."""
    if not is_release_checkpoint(checkpoint):
        return None
    return convert_wan_checkpoint(_strip_prefixes(checkpoint), load_config(), torch_dtype=None)


def _check_against_model(model: WanTransformer3DModel, converted: dict[str, torch.Tensor]) -> None:
    """Missing / unexpected / mis-shaped keys, named as in the original checkpoint, in one ValueError."""
    expected = model.state_dict()
    missing = sorted(diffusers_to_original_key(k) or k for k in set(expected) - set(converted))
    unexpected = sorted(diffusers_to_original_key(k) or k for k in set(converted) - set(expected))
    shapes = sorted(
        f"{diffusers_to_original_key(k) or k}: checkpoint {tuple(v.shape)}, model {tuple(expected[k].shape)}"
        for k, v in converted.items()
        if k in expected and v.shape != expected[k].shape
    )
    if missing or unexpected or shapes:
        raise ValueError(
            f"the checkpoint does not match the Wan config: missing keys {missing}, "
            f"unexpected keys {unexpected}, shape mismatches {shapes}"
        )


def converted_card_facts(transformer: WanTransformer3DModel, out: Path, checkpoint, config_from,
                         base_model: str | None = None, license: str | None = None,
                         repo_id: str | None = None):
    """What the model card of a converted release checkpoint says (:mod:`mhla_gen.integration.cards`): the Wan
    pipeline it plugs into (``config_from``, or ``base_model``'s hub id), the MHLA it runs, how to load it."""
    base = public_ref(config_from, base_model)
    where = Path(str(config_from)).expanduser()
    pipeline_folder = where.parent if where.is_file() or where.name == "transformer" else where
    snippet = load_folder(Snippet(), repo_id, out.name).add(["from diffusers import WanPipeline"], [
        base_line(base, "the Wan pipeline whose config it was converted with (VAE, text encoder)"),
        "transformer = mhla_gen.load_transformer(folder)  # MHLA installed, weights loaded",
        "pipe = WanPipeline.from_pretrained(base, transformer=transformer)",
        "# then call pipe(prompt=..., height=..., width=..., num_frames=...) as the stock WanPipeline"])
    return CardFacts(
        title=f"{out.name}: the released Wan-MHLA checkpoint for diffusers",
        summary=f"The released Wan-MHLA checkpoint (`{Path(str(checkpoint)).name}`) converted into a "
                "diffusers `WanTransformer3DModel` with MHLA self-attention by mhla_gen's converter "
                "(`scripts/convert_wan_mhla.py`); its `wan-release` MHLA settings reproduce the release.",
        base=base_for_model(transformer), base_model=base,
        license=license or base_license(pipeline_folder if where.exists() else None),
        mhla=[("transformer", transformer.mhla_config)], usage=snippet,
    )
