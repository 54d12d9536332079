"""VBench-style video dimensions on uint8 frames ``(T, H, W, 3)``.

Exact VBench formulas (Huang et al., 2024; github.com/Vchitect/VBench):

* ``temporal_flickering``: ``(255 − mean_t MAE(f_t, f_{t+1})) / 255``. VBench scores it on videos
  generated from *static-scene* prompts only; on other videos it mixes flicker with motion.
* ``subject_consistency`` / ``background_consistency``: mean over frames t ≥ 1 of
  ``(max(0, cos(x_{t−1}, x_t)) + max(0, cos(x_0, x_t))) / 2`` on L2-normalised per-frame features
  (VBench: DINO ViT-B/16 for subjects, CLIP ViT-B/32 for backgrounds). The extractor is pluggable and
  its name is recorded; offline, both dimensions use the same training-free pixel features
  (mean-centred 32×32 RGB, i.e. pixel correlation), so they coincide.
* ``dynamic_degree``: frames subsampled to ~8 fps; per consecutive pair, the mean of the top 5 % of
  optical-flow magnitudes; the video is dynamic if at least ``round(4·T/16)`` pairs exceed
  ``max(1, 8/fps) · 6 · min(H, W)/256`` pixels. Score = fraction of dynamic videos.

Documented proxies (named as such in every JSON) where VBench needs a network we cannot load:

* ``dynamic_degree_phasecorr_proxy`` — VBench's decision rule on a *coarse* flow field: one integer
  translation per tile from phase correlation instead of RAFT's dense flow. Pass local torchvision RAFT
  weights (:func:`raft_flow`) to get the real ``dynamic_degree``.
* ``motion_smoothness_linear_interp_proxy`` — VBench interpolates the odd frames from the even ones
  with the AMT network and scores ``(255 − MAE(interpolated, real)) / 255``; the proxy interpolates
  linearly ``(f_{2i} + f_{2i+2}) / 2``, which rewards slow or static motion more than AMT does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

FlowFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (1,3,H,W) x2 in [0,255] -> (1,2,H,W)


def read_video(path: str | os.PathLike) -> tuple[np.ndarray, float]:
    """Decode all frames with PyAV: uint8 ``(T, H, W, 3)`` RGB and the stream's frame rate."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate) if stream.average_rate else 8.0
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise ValueError(f"no video frames decoded from {str(path)!r}")
    return np.stack(frames), fps


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float = 8.0,
                lossless: bool = False) -> None:
    """Write uint8 ``(T, H, W, 3)`` frames as H.264 MP4 with PyAV: yuv420p at crf 17 (visually lossless,
    plays everywhere) or, with ``lossless``, libx264rgb at qp 0 (bit-exact, for tests and metrics).

    The default yuv420p encoding needs even H and W; odd sizes are padded by one edge pixel.
    """
    import av

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    if not lossless:
        pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264rgb" if lossless else "libx264", rate=round(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "rgb24" if lossless else "yuv420p"
        stream.options = {"qp": "0"} if lossless else {"crf": "17"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _check_frames(frames: np.ndarray, min_frames: int = 2) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) < min_frames:
        raise ValueError(f"expected uint8 frames (T >= {min_frames}, H, W, 3), got shape {frames.shape}")
    return frames.astype(np.float32)


def temporal_flickering(frames: np.ndarray) -> float:
    """VBench: ``(255 − mean over consecutive pairs of the mean absolute difference) / 255``."""
    f = _check_frames(frames)
    mae = np.abs(f[1:] - f[:-1]).mean(axis=(1, 2, 3))  # (T-1,)
    return float((255.0 - mae.mean()) / 255.0)


def motion_smoothness_linear_interp_proxy(frames: np.ndarray) -> float:
    """VBench's motion-smoothness score with linear interpolation in place of AMT (see module doc)."""
    f = _check_frames(frames, min_frames=3)
    even, odd = f[0::2], f[1::2]
    n = min(len(even) - 1, len(odd))
    interpolated = 0.5 * (even[:n] + even[1 : n + 1])
    mae = np.abs(interpolated - odd[:n]).mean()
    return float((255.0 - mae) / 255.0)


def consistency(features: torch.Tensor) -> float:
    """VBench subject/background consistency of per-frame features ``(T, F)`` (formula in module doc)."""
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"need per-frame features (T >= 2, F), got shape {tuple(features.shape)}")
    x = F.normalize(features.double(), dim=-1)
    sim_prev = (x[1:] * x[:-1]).sum(-1).clamp_min(0)  # (T-1,)
    sim_first = (x[1:] * x[:1]).sum(-1).clamp_min(0)
    return ((sim_prev + sim_first) / 2).mean().item()


@torch.no_grad()
def frame_features(extractor: torch.nn.Module, frames: np.ndarray, batch_size: int = 64) -> torch.Tensor:
    """``extractor(...)["pool"]`` of every frame: ``(T, F)``."""
    images = torch.from_numpy(np.asarray(frames)).permute(0, 3, 1, 2).float().div(255.0)
    return torch.cat([extractor(chunk)["pool"] for chunk in images.split(batch_size)])


def phase_correlation_flow(frame1: torch.Tensor, frame2: torch.Tensor, tile: int | None = None,
                           min_std: float = 2.0) -> torch.Tensor:
    """Coarse flow: one integer shift per tile from phase correlation, broadcast to the tile's pixels.

    Args:
        frame1, frame2: ``(1, 3, H, W)`` float in [0, 255].
        tile: tile size; default ``max(8, min(H, W) // 4)`` capped at 64. Border pixels that do not fill a
            whole tile get zero flow.
        min_std: tiles flatter than this (grey levels) in both frames carry no motion information -> 0.

    Returns: ``(1, 2, H, W)`` (dx, dy) in pixels.
    """
    _, _, h, w = frame1.shape
    tile = tile or min(64, max(8, min(h, w) // 4))
    gray = lambda f: (f[0] * f.new_tensor([0.299, 0.587, 0.114]).view(3, 1, 1)).sum(0)  # (H, W)
    th, tw = h // tile, w // tile

    def tiles(g):  # (th*tw, tile, tile)
        g = g[: th * tile, : tw * tile].reshape(th, tile, tw, tile)
        return g.permute(0, 2, 1, 3).reshape(-1, tile, tile)

    a, b = tiles(gray(frame1.double())), tiles(gray(frame2.double()))
    informative = (a.std(dim=(1, 2)) > min_std) | (b.std(dim=(1, 2)) > min_std)
    window = torch.hann_window(tile, dtype=torch.float64)
    window = window[:, None] * window[None, :]
    fa = torch.fft.fft2((a - a.mean(dim=(1, 2), keepdim=True)) * window)
    fb = torch.fft.fft2((b - b.mean(dim=(1, 2), keepdim=True)) * window)
    cross = fb * fa.conj()
    corr = torch.fft.ifft2(cross / (cross.abs() + 1e-9)).real  # peak at the shift from a to b
    peak = corr.flatten(1).argmax(dim=1)
    dy, dx = peak // tile, peak % tile
    dy = torch.where(dy >= tile // 2, dy - tile, dy).double()
    dx = torch.where(dx >= tile // 2, dx - tile, dx).double()
    shift = torch.stack([dx, dy], dim=1) * informative[:, None]  # (th*tw, 2)
    flow = torch.zeros(1, 2, h, w, dtype=torch.float64)
    field = shift.T.reshape(2, th, tw).repeat_interleave(tile, 1).repeat_interleave(tile, 2)
    flow[0, :, : th * tile, : tw * tile] = field
    return flow.float()


def raft_flow(weights_path: str | os.PathLike, small: bool = False, device="cpu", iters: int = 20) -> FlowFn:
    """torchvision RAFT (large or small) from a LOCAL state-dict file -> a ``FlowFn`` (VBench's estimator
    is the original RAFT 'raft-things' with 20 refinement iterations; torchvision's C_T_V2 weights are the
    same architecture). Frames smaller than 128 px are upsampled for RAFT and the flow scaled back."""
    from torchvision.models.optical_flow import raft_large, raft_small

    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"RAFT weights not found at {str(weights_path)!r} (a torchvision "
                                "raft_large / raft_small state dict, e.g. raft_large_C_T_V2-1bb1363a.pth)")
    model = (raft_small if small else raft_large)(weights=None)
    model.load_state_dict(torch.load(weights_path, map_location="cpu"))
    model = model.eval().to(device)

    @torch.no_grad()
    def flow(frame1: torch.Tensor, frame2: torch.Tensor) -> torch.Tensor:
        h, w = frame1.shape[-2:]
        scale = max(1, math.ceil(128 / min(h, w)))  # RAFT's correlation pyramid needs >= 128 px
        sh, sw = h * scale, w * scale
        ph, pw = (-sh) % 8, (-sw) % 8  # and sizes divisible by 8

        def prep(f):
            f = F.interpolate(f, scale_factor=scale, mode="bilinear", align_corners=False) if scale > 1 else f
            return F.pad(f / 127.5 - 1.0, (0, pw, 0, ph), mode="replicate").to(device)

        out = model(prep(frame1), prep(frame2), num_flow_updates=iters)[-1][..., :sh, :sw].cpu()
        return F.avg_pool2d(out, scale) / scale if scale > 1 else out

    return flow


def top_flow_magnitude(flow: torch.Tensor) -> float:
    """VBench ``get_score``: mean of the largest 5 % of per-pixel flow magnitudes of ``(1, 2, H, W)``."""
    rad = flow[0].double().norm(dim=0).flatten()
    cut = max(1, int(rad.numel() * 0.05))
    return rad.topk(cut).values.mean().item()


def dynamic_degree(frames: np.ndarray, fps: float, flow_fn: FlowFn | None = None) -> dict:
    """VBench's dynamic-degree decision for one video; ``flow_fn=None`` uses the phase-correlation proxy.

    Returns ``{"dynamic": bool, "pair_scores": [...], "threshold": px, "count_needed": n}``.
    """
    frames = np.asarray(frames)
    interval = max(1, round(fps / 8))
    frames = frames[::interval]
    if len(frames) < 2:
        raise ValueError(f"dynamic degree needs at least 2 frames after subsampling, got {len(frames)}")
    flow_fn = flow_fn or phase_correlation_flow
    threshold = max(1.0, 8.0 / fps) * 6.0 * (min(frames.shape[1:3]) / 256.0)
    count_needed = round(4 * (len(frames) / 16.0))
    tensors = torch.from_numpy(frames).permute(0, 3, 1, 2).float()[:, None]  # (T, 1, 3, H, W)
    scores = [top_flow_magnitude(flow_fn(a, b)) for a, b in zip(tensors[:-1], tensors[1:])]
    moving = sum(score > threshold for score in scores)
    return {"dynamic": bool(moving >= count_needed), "pair_scores": scores, "threshold": threshold,
            "count_needed": count_needed}


def aesthetic_quality(clip_extractor: torch.nn.Module, head: torch.nn.Module, frames: np.ndarray) -> float:
    """VBench aesthetic quality: LAION aesthetic linear head on L2-normalised CLIP ViT-L/14 image features,
    divided by 10, averaged over frames. ``clip_extractor`` from :func:`.extractors.hf_image_extractor`."""
    feats = F.normalize(frame_features(clip_extractor, frames), dim=-1)
    with torch.no_grad():
        return (head(feats.to(next(head.parameters()).dtype)).squeeze(-1) / 10).mean().item()


def evaluate_video(frames: np.ndarray, fps: float, subject_extractor: torch.nn.Module,
                   background_extractor: torch.nn.Module | None = None, flow_fn: FlowFn | None = None,
                   aesthetic: tuple[torch.nn.Module, torch.nn.Module] | None = None) -> dict[str, float]:
    """All dimensions for one video. Keys name proxies as proxies (module doc)."""
    background_extractor = background_extractor or subject_extractor
    subject_feats = frame_features(subject_extractor, frames)
    background_feats = (subject_feats if background_extractor is subject_extractor
                        else frame_features(background_extractor, frames))
    dyn = dynamic_degree(frames, fps, flow_fn)
    dynamic_key = "dynamic_degree" if flow_fn is not None else "dynamic_degree_phasecorr_proxy"
    out = {
        "temporal_flickering": temporal_flickering(frames),
        "motion_smoothness_linear_interp_proxy": motion_smoothness_linear_interp_proxy(frames),
        "subject_consistency": consistency(subject_feats),
        "background_consistency": consistency(background_feats),
        dynamic_key: float(dyn["dynamic"]),
        "mean_top5_flow_px": float(np.mean(dyn["pair_scores"])),
    }
    if aesthetic is not None:
        out["aesthetic_quality"] = aesthetic_quality(*aesthetic, frames)
    return out
