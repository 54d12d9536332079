"""``MHLAConfig``: how MHLA replaces a transformer's self-attention, plus paper presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..ops.feature_maps import FEATURE_MAPS
from ..ops.mixing import INIT_RULES

WAN_ROPE_MODES = ("before_phi", "after_phi_numerator")
STREAM_MIXINGS = ("general", "factorised")
STREAM_KEYS = ("chunk_frames", "stream_mixing")  # recorded only when chunk_frames is set (older records)


@dataclass
class MHLAConfig:
    """MHLA settings for one transformer.

    Attributes:
        blocks: blocks per token-grid axis: 2 values for images ``(bh, bw)``, 3 for video ``(bf, bh, bw)``.
        layers: indices of the self-attention layers to replace (None = all). The paper's Wan hybrid keeps
            softmax attention in every third layer, as the release does:
            ``[i for i in range(30) if i % 3 != 0]``.
        feature_map: ``relu``, ``elu+1`` or ``relu+1e-6`` (the original release's).
        normalize: divide by ``φ(q)ᵀ z̃ + eps`` (the released Wan recipe has no normaliser).
        eps: normaliser epsilon.
        mixing_init: locality rule for W (``linear`` is the paper's); see ``mhla_gen.ops.mixing``.
        mixing_normalize: ``row`` (paper) or ``column`` (the original release's init rules, exactly; see
            ``mhla_gen.ops.mixing``).
        mixing_temperature: scale for the ``exp``/``gaussian``/``local`` rules.
        mixing_learnable: train the mixing matrix (the paper); False keeps it at its init (Tab. 7a).
        cpe_kernel: depthwise-conv positional encoding kernel on V (0 = off).
        gate: output gate from the layer input; ``gate_activation`` is ``sigmoid`` or ``silu``.
        wan_rope: Wan only. ``before_phi``: RoPE on q, k, then φ (numerator and normaliser see the same
            features); ``after_phi_numerator``: the release's φ first, RoPE on φ(q), φ(k) for the
            numerator only.
        wan_head_norm: Wan only. RMS-normalise each head's output (the release's ``g_norm``).
        chunk_frames: Wan only. Block-causal (streaming) self-attention in chunks of this many latent
            frames: a token sees its own chunk and every earlier one (``docs/streaming.md``); None:
            bidirectional. Every self-attention layer is block-causal: the MHLA ``layers`` run block-causal
            MHLA, the others block-causal softmax with a KV cache (``layers=[]``: the softmax streaming
            baseline, whose ``blocks`` and ``stream_mixing`` are unused). Needs no CPE and
            ``wan_rope=before_phi``.
        stream_mixing: with ``chunk_frames``: ``general`` (the learned ``W`` over the blocks of the whole
            video, masked; ``blocks`` cut the whole video, every time block inside one chunk; a streaming
            cache grows with the video) or ``factorised`` (``W_s`` over the blocks of one chunk times a
            learned per-head decay over chunks; ``blocks`` cut ONE chunk, ``blocks[0]`` dividing
            ``chunk_frames``; the cache stays the same size for any length).
    """

    blocks: tuple[int, ...] = (4, 4)
    layers: list[int] | None = None
    feature_map: str = "relu"
    normalize: bool = True
    eps: float = 1e-6
    mixing_init: str = "linear"
    mixing_normalize: str = "row"
    mixing_temperature: float = 1.0
    mixing_learnable: bool = True
    cpe_kernel: int = 0
    gate: bool = False
    gate_activation: str = "sigmoid"
    wan_rope: str = "before_phi"
    wan_head_norm: bool = False
    chunk_frames: int | None = None
    stream_mixing: str = "general"
    extra: dict = field(default_factory=dict)  # free-form notes carried through save/load

    def __post_init__(self):
        self.blocks = tuple(int(b) for b in self.blocks)
        if self.layers is not None:
            self.layers = [int(i) for i in self.layers]
        if not 2 <= len(self.blocks) <= 3 or any(b < 1 for b in self.blocks):
            raise ValueError(f"blocks must be 2 or 3 positive ints, got {self.blocks}")
        if self.feature_map not in FEATURE_MAPS or self.feature_map == "identity":
            choices = sorted(set(FEATURE_MAPS) - {"identity"})
            raise ValueError(f"feature_map {self.feature_map!r} not in {choices}")
        if self.mixing_init not in INIT_RULES:
            raise ValueError(f"mixing_init {self.mixing_init!r} not in {INIT_RULES}")
        if self.mixing_normalize not in ("row", "column", "none"):
            raise ValueError(f"mixing_normalize must be row, column or none, got {self.mixing_normalize!r}")
        if self.cpe_kernel < 0 or (self.cpe_kernel and self.cpe_kernel % 2 == 0):
            raise ValueError(f"cpe_kernel must be 0 (off) or a positive odd int, got {self.cpe_kernel}")
        if self.gate_activation not in ("sigmoid", "silu"):
            raise ValueError(f"gate_activation must be sigmoid or silu, got {self.gate_activation!r}")
        if self.wan_rope not in WAN_ROPE_MODES:
            raise ValueError(f"wan_rope must be one of {WAN_ROPE_MODES}, got {self.wan_rope!r}")
        if self.eps <= 0:
            raise ValueError(f"eps must be positive, got {self.eps}")
        self._check_streaming()

    def _check_streaming(self) -> None:
        """``chunk_frames`` / ``stream_mixing``: one ValueError naming the setting that cannot stream."""
        chunk = self.chunk_frames
        if self.stream_mixing not in STREAM_MIXINGS:
            raise ValueError(f"stream_mixing must be one of {STREAM_MIXINGS}, got {self.stream_mixing!r}")
        if chunk is None:
            if self.stream_mixing != "general":
                raise ValueError(f"stream_mixing={self.stream_mixing!r} needs chunk_frames (block-causal "
                                 "attention); set chunk_frames or leave stream_mixing at general")
            return
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_frames must be a positive int (latent frames) or None, got {chunk!r}")
        if len(self.blocks) != 3:
            raise ValueError(f"chunk_frames={chunk} needs video blocks (bf, bh, bw), got {self.blocks}")
        if self.stream_mixing == "factorised" and chunk % self.blocks[0]:
            raise ValueError(f"stream_mixing=factorised: blocks={self.blocks} cut one chunk, and blocks[0]="
                             f"{self.blocks[0]} must divide chunk_frames={chunk}")
        if self.stream_mixing == "factorised" and not self.mixing_learnable:
            raise ValueError("mixing_learnable=False is not built for stream_mixing=factorised")
        if self.cpe_kernel:
            raise ValueError(f"cpe_kernel={self.cpe_kernel} with chunk_frames={chunk}: the convolution "
                             "reaches into later chunks; set cpe_kernel=0 for block-causal attention")
        if self.wan_rope != "before_phi":
            raise ValueError(f"wan_rope={self.wan_rope!r} with chunk_frames={chunk}: block-causal attention "
                             "is built for wan_rope=before_phi")

    def to_dict(self) -> dict:
        """The settings as a plain dict; ``chunk_frames`` and ``stream_mixing`` only when streaming, so the
        records of bidirectional models (``config.json``, run signatures) read as before they existed."""
        d = dataclasses.asdict(self)
        d["blocks"] = list(self.blocks)
        if self.chunk_frames is None:
            for key in STREAM_KEYS:
                d.pop(key)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MHLAConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown MHLAConfig keys {unknown}")
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides) -> MHLAConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown MHLA preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


# The paper's settings. DiT 256/512 (latent 32×32 / 64×64 at patch 2): 16 blocks.
# Wan2.1-1.3B at 480×832, 81 frames: latent grid (21, 30, 52) -> blocks (3, 5, 10).
# The release keeps softmax attention in layers 0, 3, ..., 27 of the 30 Wan2.1-1.3B blocks.
_WAN_HYBRID_LAYERS = [i for i in range(30) if i % 3 != 0]

PRESETS: dict[str, MHLAConfig] = {
    "dit-256": MHLAConfig(blocks=(4, 4)),
    "dit-512": MHLAConfig(blocks=(4, 4)),
    "sana": MHLAConfig(blocks=(4, 4)),
    "wan2.1-1.3b-480p": MHLAConfig(blocks=(3, 5, 10)),
    "wan2.1-1.3b-480p-hybrid": MHLAConfig(blocks=(3, 5, 10), layers=_WAN_HYBRID_LAYERS),
    # what the released Wan-MHLA checkpoint was trained with (load it with this, see convert_wan)
    "wan-release": MHLAConfig(
        blocks=(3, 5, 10), layers=_WAN_HYBRID_LAYERS, feature_map="relu+1e-6", normalize=False,
        mixing_normalize="column", wan_rope="after_phi_numerator", wan_head_norm=True,
    ),
}
