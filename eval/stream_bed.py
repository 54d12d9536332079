"""The streaming measurement's test bed (``eval/stream_study.py`` runs it, ``docs/results/streaming.md``):
a tiny block-causal Wan trained on moving shapes, streamed past its training length, scored frame by frame.

Four arms differ only in the self-attention's memory (:data:`ARMS`, every other setting equal):

* ``softmax-kv``: block-causal softmax with a KV cache (``layers=[]``, ``processors/wan_softmax.py``);
* ``global-state``: factorised MHLA with ONE block per chunk: one running state per head, the memory of
  SANA-Video-style block-causal linear attention (its decay is learned, as the factorised arm's);
* ``mhla-general``: block-causal MHLA with the learned ``M x M`` mixing over the whole video's blocks
  (2 x 2 spatial blocks per chunk): its ``W`` covers the training length only, so it streams that length
  and no further;
* ``mhla-factorised``: MHLA with 2 x 2 spatial blocks per chunk, ``W_s`` and a per-head decay: one state per
  block, constant in the length.

The model works on pixels: the tiny Wan VAE of the tests has random weights (no pretrained VAE offline), and
its decoder would not return the shapes, so the transformer reads and writes 32 x 32 RGB frames directly
(3 channels, patch ``(1, p, p)``; a latent frame is a video frame), and the scorer reads exactly what the
model made. The class is the condition: one fixed random "text" embedding per class (:func:`class_text`).

Each arm trains from scratch with diffusion forcing (:class:`~mhla_gen.train.chunk_noise.FlowNoise`: a σ
per chunk, per-token timesteps) from the same initial weights (the same seed builds the same transformer;
the MHLA parameters start at their deterministic inits), on the same clips in the same order with the same
noise: only the attention differs. From scratch rather than from a bidirectional softmax model: converting
a softmax model hands the softmax arm its own trained attention while the MHLA arms start theirs fresh, a
head start that a CPU-sized fine-tune cannot erase and that would be read as a difference of memories.

Generation streams with :func:`~mhla_gen.pipelines.wan_stream.stream_chunks` (the sampler of
``mhla-gen sample --stream``), all arms and seeds from the same noise (:data:`SAMPLE_SEED`) and classes:
common random numbers. A streamed video's first ``k`` chunks do not depend on the chunks after them, so one
video of the longest length gives every shorter one as its prefix (exactly: the rollout tests).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler, WanTransformer3DModel
from studies import sibling

from mhla_gen.data.moving_shapes import MOVING_CLASSES, moving_shapes_tensors
from mhla_gen.errors import ConfigError
from mhla_gen.integration.install import install_mhla
from mhla_gen.metrics.moving_shapes import clip_scores
from mhla_gen.pipelines.wan_stream import stream_chunks
from mhla_gen.processors.config import MHLAConfig
from mhla_gen.train.chunk_noise import FlowNoise
from mhla_gen.train.config import FlowMatchingConfig
from mhla_gen.train.objectives import flow_matching_mse
from mhla_gen.train.randomness import StepRandom

results = sibling("results")  # its atomic writes (write_bytes)
ARMS = ("softmax-kv", "global-state", "mhla-general", "mhla-factorised")
TEXT_DIM, TEXT_TOKENS, TEXT_SEED = 32, 4, 1234  # the class embeddings (one fixed draw for every run)
KIND = "stream_study"  # the record our .npz / .json files carry (mhla_gen.outputs.folders.file_is_ours)
SAMPLE_SEED = 0  # every arm and seed streams from this noise (common random numbers)
SHIFT = 1.0  # σ shift of training and sampling (pixels at 32 x 32: no shift)
CHECKS = ("count", "colour", "motion", "all")


@dataclass(frozen=True)
class Size:
    """One scale of the study.

    Attributes:
        frames, chunk: training length and chunk, in frames (= latent frames; chunk 1: frame by frame).
        size, patch: frame side in pixels and the transformer's spatial patch.
        layers, heads, head_dim, ffn: the tiny Wan.
        clips: training clips (moving shapes, seed 0); steps, batch, lr, warmup: training.
        eval_clips: streamed videos per (arm, seed), classes ``i % 10``; sample_steps: UniPC steps a chunk.
        lengths: streamed lengths in multiples of ``frames`` (the longest is generated, the rest are its
            prefixes).
    """

    frames: int = 4
    chunk: int = 1
    size: int = 32
    patch: int = 4
    layers: int = 4
    heads: int = 4
    head_dim: int = 16
    ffn: int = 128
    clips: int = 2000
    steps: int = 300
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 30
    eval_clips: int = 30
    sample_steps: int = 6
    lengths: tuple[int, ...] = (1, 2, 4, 8)

    @property
    def longest(self) -> int:
        """Frames of the longest streamed video."""
        return max(self.lengths) * self.frames


SIZES = {
    # main: 4 arms x 3 seeds on one CPU core in about 70 min (measured 2026-11-28 on a shared 2-core machine:
    # 0.43-0.73 s a training step at batch 16, about 1 min to stream and score 30 videos of 32 frames)
    "main": Size(),
    "smoke": Size(frames=2, patch=8, layers=1, heads=2, head_dim=12, ffn=16, clips=8, steps=2, batch=2,
                  warmup=1, eval_clips=4, sample_steps=1, lengths=(1, 2)),
}


def arm_config(arm: str, frames: int, chunk: int) -> MHLAConfig:
    """The attention of ``arm`` for videos of ``frames`` frames in chunks of ``chunk`` (the general mixing's
    ``W`` is sized for ``frames``; the others do not depend on it)."""
    if arm == "softmax-kv":
        return MHLAConfig(blocks=(1, 1, 1), chunk_frames=chunk, layers=[])
    if arm == "global-state":
        return MHLAConfig(blocks=(1, 1, 1), chunk_frames=chunk, stream_mixing="factorised")
    if arm == "mhla-general":
        return MHLAConfig(blocks=(frames // chunk, 2, 2), chunk_frames=chunk)  # one time block a chunk
    if arm == "mhla-factorised":
        return MHLAConfig(blocks=(1, 2, 2), chunk_frames=chunk, stream_mixing="factorised")
    raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")


def build_model(size: Size, arm: str, seed: int, frames: int | None = None,
                device: str = "cpu") -> WanTransformer3DModel:
    """The tiny pixel-space Wan of ``seed`` with ``arm``'s attention (``frames``: the general mixing's
    length, default the training length), on ``device`` (built on the CPU: the same weights anywhere)."""
    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, size.patch, size.patch), num_attention_heads=size.heads,
        attention_head_dim=size.head_dim, in_channels=3, out_channels=3, text_dim=TEXT_DIM, freq_dim=32,
        ffn_dim=size.ffn, num_layers=size.layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64,
    )
    return install_mhla(model, arm_config(arm, frames or size.frames, size.chunk)).to(device)


def record_path(out: Path, arm: str, seed: int) -> Path:
    """Where the record of ``(arm, seed)`` lives in the study folder ``out``."""
    return out / "records" / f"{arm}_seed{seed}.npz"


def state_path(out: Path, arm: str, seed: int) -> Path:
    """Where the training state of an unfinished ``(arm, seed)`` is kept (:class:`Resume`)."""
    return out / "training" / f"{arm}_seed{seed}.pt"


def class_text() -> torch.Tensor:
    """``(10, TEXT_TOKENS, TEXT_DIM)``: the condition of each class, a fixed random draw."""
    generator = torch.Generator().manual_seed(TEXT_SEED)
    return torch.randn(MOVING_CLASSES, TEXT_TOKENS, TEXT_DIM, generator=generator)


def training_clips(size: Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The training set: ``(clips, 3, frames, size, size)`` in [-1, 1] and the classes ``(clips,)``."""
    clips, labels = moving_shapes_tensors(size.frames, size.size, size.size, size.clips, seed=0)
    return clips * 2 - 1, labels


@dataclass
class Resume:
    """Where :func:`train_arm` keeps its state every ``every`` steps and at the last (``path``; 0: never), so
    that a killed run continues exactly (one killed after training, while streaming, trains no more): the
    model, AdamW's and the warm-up's state, the log and the loss since its last entry (the batches, σ and
    noise come from ``(seed, step)`` alone). Written whole or not at all; a state of another size is
    refused, not resumed."""

    path: Path
    every: int

    def save(self, step: int, size: Size, model, optimizer, warmup, log: list, losses: list,
             seconds: float) -> None:
        if not self.every or (step % self.every and step != size.steps):
            return
        state = {"kind": KIND, "size": repr(size), "step": step, "model": model.state_dict(),
                 "optimizer": optimizer.state_dict(), "warmup": warmup.state_dict(), "log": log,
                 "losses": losses, "seconds": seconds}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        results.write_bytes(self.path, buffer.getvalue())

    def load(self, size: Size, model, optimizer, warmup, device: str) -> tuple[int, list, list, float]:
        """``(step, log, losses, seconds)`` of the kept state, loaded into the three; ``(0, [], [], 0)``
        when there is none."""
        if not self.path.is_file():
            return 0, [], [], 0.0
        state = torch.load(self.path, map_location=device, weights_only=True)
        if state.get("kind") != KIND or state.get("size") != repr(size):
            raise ConfigError(f"{self.path}: a training state of another size or not this study's; "
                              "remove it, or run with the settings that made it")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        warmup.load_state_dict(state["warmup"])
        return state["step"], state["log"], state["losses"], state["seconds"]


def train_arm(size: Size, arm: str, seed: int, clips: torch.Tensor, labels: torch.Tensor,
              log_every: int = 25, device: str = "cpu",
              resume: Resume | None = None) -> tuple[WanTransformer3DModel, list[dict]]:
    """Diffusion forcing from scratch: ``size.steps`` AdamW steps (linear warm-up, gradient clipping at 1),
    batches, σ per chunk and noise drawn from ``(seed, step)`` alone (every arm sees the same). Returns the
    model and the training log ``[{"step", "loss", "seconds"}]`` (the mean loss since the last entry).
    The draws are made on the CPU whatever ``device`` trains: a GPU run sees the same clips, σ and noise.
    ``resume``: keep the state as it goes and continue from a kept one (:class:`Resume`)."""
    model = build_model(size, arm, seed, device=device).train()
    text = class_text().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / size.warmup))
    noising = FlowNoise(FlowMatchingConfig(per_chunk_noise=True), SHIFT, None, "transformer", 1000,
                        size.chunk, (1, size.patch, size.patch))
    first, log, losses, seconds = (0, [], [], 0.0) if resume is None else resume.load(
        size, model, optimizer, warmup, device)
    start = time.perf_counter() - seconds  # the log's seconds count training only, across resumes
    for step in range(first, size.steps):
        rnd = StepRandom(seed, step, size.batch)
        index = torch.randint(len(clips), (size.batch,), generator=rnd.generator)
        x0 = clips[index]
        sigmas = noising.sigmas(rnd, x0)  # (B, chunks)
        noise = rnd.randn(*x0.shape[1:])
        x0, noise, sigmas = x0.to(device), noise.to(device), sigmas.to(device)
        inputs = noising.inputs(x0, noise, sigmas)  # each chunk at its own σ, a timestep per token
        prediction = model(**inputs, encoder_hidden_states=text[labels[index]], return_dict=False)[0]
        loss = flow_matching_mse(prediction, x0, noise, noising.loss_weights(sigmas))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == size.steps:
            log.append({"step": step + 1, "loss": float(np.mean(losses)),
                        "seconds": time.perf_counter() - start})
            losses = []
        if resume is not None:
            resume.save(step + 1, size, model, optimizer, warmup, log, losses, time.perf_counter() - start)
    return model.eval(), log


def scheduler() -> UniPCMultistepScheduler:
    """The sampler's scheduler: UniPC with flow sigmas, as Wan2.1 ships it (shift :data:`SHIFT`)."""
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=SHIFT)


def eval_labels(size: Size) -> torch.Tensor:
    """The classes of the streamed videos: ``i % 10``."""
    return torch.arange(size.eval_clips) % MOVING_CLASSES


@torch.no_grad()
def stream(model: WanTransformer3DModel, size: Size, labels: torch.Tensor, frames: int,
           seed: int = SAMPLE_SEED) -> torch.Tensor:
    """Videos ``(N, 3, frames, size, size)`` in [0, 1] streamed chunk by chunk, noise from ``seed``."""
    shape = (len(labels), 3, size.chunk, size.size, size.size)
    embeds = {"cond": class_text()[labels].to(model.device)}
    generator = torch.Generator().manual_seed(seed)  # on the CPU: the same noise on any device
    chunks = [chunk for chunk, _ in stream_chunks(model, embeds, frames // size.chunk, shape, scheduler(),
                                                  size.sample_steps, 1.0, generator)]
    return ((torch.cat(chunks, dim=2).cpu() + 1) / 2).clamp(0, 1)


def score_videos(videos: torch.Tensor, labels: torch.Tensor) -> dict[str, np.ndarray]:
    """The scorer's per-frame checks (``metrics/moving_shapes.py``): bool ``(N, F)`` per check in
    :data:`CHECKS`, float ``position_error``."""
    return clip_scores(videos, labels.numpy())


def streamed_frames(size: Size, arm: str) -> int:
    """How far ``arm`` streams: the longest length, or the training length for the general mixing."""
    return size.frames if arm == "mhla-general" else size.longest


# ------------------------------------------------------------------------------- memory and time
def peak_allocated(step, device: torch.device | None = None) -> tuple[object, int]:
    """``step()``'s result and the peak of tensor bytes it had allocated at once on ``device`` (default
    the CPU), above what was held when it started. CUDA: the allocator's peak statistic. CPU: the running
    sum of ``torch.profiler``'s allocator events in time order (an allocation's size, a free's negative
    size); the events' own running total is not used: it drifts across profiler sessions (frees of blocks
    allocated before a session are not subtracted)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        result = step()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - held
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        todo.extend(node.children)
    running = np.cumsum([size for _, size in sorted(events)]) if events else np.zeros(1)
    return result, int(max(running.max(), 0))


def chunk_costs(model: WanTransformer3DModel, size: Size, frames: int, label: int = 0) -> list[dict]:
    """Per streamed chunk of one video (batch 1, ``frames`` frames): ``seconds`` (its denoising steps and
    the clean pass that writes it, timed without the profiler), ``cache_bytes`` (the caches' tensors it
    reads: every chunk before it; none for the first) and ``peak_bytes`` (that cache plus the peak allocated
    while making it: the tensors a chunk needs besides the weights)."""
    shape, embeds = (1, 3, size.chunk, size.size, size.size), {"cond": class_text()[[label]].to(model.device)}
    count, device = frames // size.chunk, model.device
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def chunks():
        return stream_chunks(model, embeds, count, shape, scheduler(), size.sample_steps, 1.0,
                             torch.Generator().manual_seed(SAMPLE_SEED))

    next(chunks())  # one untimed chunk first: the first call's one-time costs are not chunk 0's
    rows, timed = [], chunks()
    for index in range(count):
        synchronize()
        start = time.perf_counter()
        next(timed)
        synchronize()
        seconds = time.perf_counter() - start
        rows.append({"chunk": index, "frames": (index + 1) * size.chunk, "seconds": seconds})
    held, profiled = 0, chunks()
    for row in rows:
        (_, written), peak = peak_allocated(lambda: next(profiled), device)
        row["cache_bytes"], row["peak_bytes"] = held, held + peak
        held = written
    return rows


__all__ = ["ARMS", "CHECKS", "SIZES", "Resume", "Size", "arm_config", "build_model", "chunk_costs",
           "class_text", "eval_labels", "peak_allocated", "record_path", "score_videos", "state_path",
           "stream", "streamed_frames", "train_arm", "training_clips"]
