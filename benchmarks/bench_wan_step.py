"""One Wan2.1-T2V-1.3B denoising step with stock attention, the MHLA hybrid and MHLA in every layer.

    python benchmarks/bench_wan_step.py --device cuda --dtype bf16      # 480p, 81 frames
    python benchmarks/bench_wan_step.py --device cuda --dtype bf16 --compile
    python benchmarks/bench_wan_step.py --tiny --frames 5 --height 32 --width 48 --batch 1   # CPU smoke run

The goal: a whole Wan-1.3B 480p denoising step (random weights, bf16, on CUDA) at least ``GOAL`` (2.3x) faster
with MHLA (``mhla`` below) than with stock attention (eager). On one H200 (2026-11-28, commit d47c25e): 2.52x,
498.7 against 1255.7 ms (docs/results/gpu_check_h200_2026-11-28.md); ``--compile`` has not run on a GPU.
On CPU it runs at tiny sizes in tests/test_bench_wan_step.py.

What is measured: one forward of ``diffusers.WanTransformer3DModel`` under ``torch.inference_mode()``
(``return_dict=False``): one denoising step of a sampler, without the text encoder, VAE or scheduler.
With classifier-free guidance a pipeline runs the conditional and unconditional branches, hence
``--batch 2`` by default. The model has the Wan2.1-T2V-1.3B architecture with random weights; its
config (``WAN_1_3B_CONFIG``) is the ``"Wan-T2V-1.3B"`` entry of diffusers' own conversion script
(huggingface/diffusers ``scripts/convert_wan_to_diffusers.py``, ``get_transformer_config``): 30 layers,
12 heads x 128, FFN 8960, text dim 4096, freq dim 256, patch (1, 2, 2), 16 latent channels, RMSNorm across
heads, cross-attention norm, eps 1e-6 (the same widths as Wan's own ``wan/configs/wan_t2v_1_3B.py``:
dim 1536 = 12 x 128). ``rope_max_seq_len`` is not set there, so it is diffusers' default, 1024.
``--tiny`` uses ``mhla_gen.testing.wan.TINY_WAN_CONFIG`` instead (tests).

Inputs: ``--frames 81 --height 480 --width 832`` are video pixels; Wan's VAE compresses time 4x (plus the
first frame) and space 8x, so the latent is (B, 16, 21, 60, 104) and the transformer's token grid
(21, 30, 52) = 32760 tokens. Text: (B, ``--text-len`` 512, text_dim) random UMT5-like features.
Timestep 500 for every sample. In bf16 / fp16 the modules diffusers keeps in fp32 when loading with
``torch_dtype`` (``WanTransformer3DModel._keep_in_fp32_modules``) stay fp32 here too, so the step is the
one a ``WanPipeline.from_pretrained(..., torch_dtype=torch.bfloat16)`` runs.

Variants, three copies of one random model (deepcopies) that differ only in the self-attention processors:

- ``stock``: diffusers' ``WanAttnProcessor`` (SDPA);
- ``mhla-hybrid``: ``install_mhla(m, MHLAConfig.preset("wan2.1-1.3b-480p-hybrid"))``: MHLA in the 20 layers
  with ``i % 3 != 0``, softmax kept in layers 0, 3, ..., 27 (the released checkpoint's pattern);
- ``mhla``: ``MHLAConfig.preset("wan2.1-1.3b-480p")``: MHLA in all 30 layers.

Both presets use blocks (3, 5, 10) on the (21, 30, 52) grid. On a smaller grid (``--tiny``, other
``--frames/--height/--width``) each axis's block count is capped at that axis's token count, and hybrid
layers beyond the model's depth are dropped; the table prints the blocks and layer counts actually used.

Timing (``step_timing.interleaved_seconds``): ``--warmup`` untimed calls per variant (with ``--compile``
these compile; compile time is not counted), then ``--reps`` repetitions; in each, every variant runs one
timed step, interleaved, starting at a rotating variant, so drift of the machine (clocks, temperature) hits
all alike. On CUDA the device is synchronised before and after each timed call. Reported: median ms per
step per variant and the median of the per-repetition ratios stock / variant (speed-up). Prints a Markdown
table; ``--out FILE.json`` also writes every sample.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path

import diffusers
import torch
from diffusers import WanTransformer3DModel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_timing beside this file

from step_timing import interleaved_seconds, median_ratio  # noqa: E402

from mhla_gen import MHLAConfig, install_mhla  # noqa: E402
from mhla_gen.commands.cli import device_setting, expand_path  # noqa: E402
from mhla_gen.commands.cli import run as run_cli  # noqa: E402
from mhla_gen.integration.install import is_mhla_installed, mhla_processors  # noqa: E402
from mhla_gen.integration.serialization import cast_like_diffusers  # noqa: E402
from mhla_gen.outputs.folders import check_file_target, file_record  # noqa: E402
from mhla_gen.outputs.locks import writing_files  # noqa: E402
from mhla_gen.testing.video import REAL_CONFIGS  # noqa: E402
from mhla_gen.train.io import atomic_write_text  # noqa: E402

BENCH_KIND = "benchmark"  # the record in the --out JSON (mhla_gen.outputs.folders.file_record)

WAN_1_3B_CONFIG = REAL_CONFIGS["Wan2.1-T2V-1.3B"][1]  # diffusers' conversion script's "Wan-T2V-1.3B"

VARIANTS = ("stock", "mhla-hybrid", "mhla")
PRESETS = {"mhla-hybrid": "wan2.1-1.3b-480p-hybrid", "mhla": "wan2.1-1.3b-480p"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GOAL = 2.3  # mhla vs stock, full size, bf16, CUDA, eager (docs/benchmarks.md, GPU targets)
VAE_TIME, VAE_SPACE = 4, 8  # Wan VAE: frames 4k+1 -> k+1 latent frames; 8x8 pixels per latent pixel


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=81, help="video frames, 4k+1 (default 81)")
    parser.add_argument("--height", type=int, default=480, help="pixels, a multiple of 16 (default 480)")
    parser.add_argument("--width", type=int, default=832, help="pixels, a multiple of 16 (default 832)")
    parser.add_argument("--batch", type=int, default=2, help="latents per step (2: CFG's two branches)")
    parser.add_argument("--text-len", type=int, default=512, help="text tokens (Wan pads prompts to 512)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (all variants in each)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bf16 on CUDA, fp32 otherwise")
    parser.add_argument("--compile", action="store_true", help="torch.compile each variant (inductor)")
    parser.add_argument("--tiny", action="store_true", help="mhla_gen.testing.wan.TINY_WAN_CONFIG (tests)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=expand_path, default=None, help="also write the results as JSON here")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if this script did "
                        "not write it")
    args = parser.parse_args(argv)
    if args.out is not None:  # before any timing (mhla_gen.outputs.folders)
        args.out = check_file_target(args.out, "--out", BENCH_KIND, args.overwrite)  # ~ expanded

    if args.frames < 1 or (args.frames - 1) % VAE_TIME:
        parser.error(f"--frames must be 4k+1 (Wan's VAE keeps the first frame, then 4 per latent frame), "
                     f"e.g. 81; got {args.frames}")
    for name in ("height", "width"):
        value = getattr(args, name)
        if value < 16 or value % 16:
            parser.error(f"--{name} must be a positive multiple of 16 (VAE 8x, patch 2x), got {value}")
    for name in ("batch", "reps", "text_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must not be negative, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    device = device_setting(args.device)
    args.device = str(device)
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    return args


def latent_shape(frames: int, height: int, width: int, batch: int, channels: int = 16) -> tuple[int, ...]:
    """Wan VAE latent of a video: (B, C, (frames - 1) / 4 + 1, height / 8, width / 8)."""
    return batch, channels, (frames - 1) // VAE_TIME + 1, height // VAE_SPACE, width // VAE_SPACE


def token_grid(config: dict, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The transformer's token grid for a latent shape: each axis floored by the patch size."""
    return tuple(n // p for n, p in zip(shape[2:], config["patch_size"]))


def variant_configs(grid: tuple[int, int, int], num_layers: int) -> dict[str, MHLAConfig]:
    """The two presets, blocks capped at the token grid and layers at the model's depth (no-ops at 480p)."""
    configs = {}
    for variant, name in PRESETS.items():
        preset = MHLAConfig.preset(name)
        blocks = tuple(min(b, g) for b, g in zip(preset.blocks, grid))
        layers = None if preset.layers is None else [i for i in preset.layers if i < num_layers]
        configs[variant] = MHLAConfig.preset(name, blocks=blocks, layers=layers)
    return configs


def build_variants(
    config: dict, grid: tuple[int, int, int], device, dtype, seed: int = 0
) -> dict[str, WanTransformer3DModel]:
    """``{variant: model}``: one random model (built on the CPU in fp32, then moved and cast with
    ``mhla_gen.integration.serialization.cast_like_diffusers``: as ``from_pretrained(..., dtype=...)`` loads
    it), deep-copied per variant, MHLA installed in the copies
    (``variant_configs``; MHLA's parameters take the dtype of each layer's q projection)."""
    torch.manual_seed(seed)
    base = cast_like_diffusers(WanTransformer3DModel(**config).eval().to(device), dtype)
    models = {"stock": base}
    for variant, cfg in variant_configs(grid, config["num_layers"]).items():
        models[variant] = install_mhla(copy.deepcopy(base), cfg)
    return models


def layer_counts(model: WanTransformer3DModel) -> tuple[int, int]:
    """(MHLA self-attention layers, all self-attention layers)."""
    return len(mhla_processors(model)), len(model.blocks)


def make_inputs(config: dict, shape: tuple[int, ...], text_len: int, device, dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = shape[0]
    return dict(
        hidden_states=torch.randn(shape, generator=g).to(device, dtype),
        timestep=torch.full((batch,), 500.0).to(device),
        encoder_hidden_states=torch.randn(batch, text_len, config["text_dim"], generator=g).to(device, dtype),
        return_dict=False,
    )


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run(args) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.tiny:  # mhla_gen.testing.wan builds tiny text encoders: transformers' UMT5 is imported only here
        from mhla_gen.testing.wan import TINY_WAN_CONFIG

        config = dict(TINY_WAN_CONFIG)
    else:
        config = dict(WAN_1_3B_CONFIG)
    shape = latent_shape(args.frames, args.height, args.width, args.batch, config["in_channels"])
    grid = token_grid(config, shape)
    models = build_variants(config, grid, device, dtype, seed=args.seed)
    runners = {name: torch.compile(model) if args.compile else model for name, model in models.items()}
    inputs = make_inputs(config, shape, args.text_len, device, dtype, seed=args.seed)

    steps = {name: (lambda r=runners[name]: r(**inputs)) for name in VARIANTS}
    with torch.inference_mode():  # every repetition times each variant once, in rotating order
        seconds, peak_gib = interleaved_seconds(steps, args.reps, args.warmup, device)
    samples = {name: [s * 1e3 for s in seconds[name]] for name in VARIANTS}

    results = {}
    for name in VARIANTS:
        model = models[name]
        mhla_layers, all_layers = layer_counts(model)
        cfg = getattr(model, "mhla_config", None)
        results[name] = dict(
            mhla_installed=is_mhla_installed(model),
            mhla_layers=mhla_layers,
            softmax_layers=all_layers - mhla_layers,
            blocks=list(cfg.blocks) if cfg is not None else None,
            ms_per_step=samples[name],
            median_ms=statistics.median(samples[name]),
            min_ms=min(samples[name]),
            speedup=median_ratio(seconds["stock"], seconds[name]),
            peak_gib=peak_gib[name],
        )
    return dict(
        model="tiny Wan (mhla_gen.testing.wan.TINY_WAN_CONFIG)" if args.tiny else "Wan2.1-T2V-1.3B",
        config={k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        device=device_name(device),
        dtype=args.dtype,
        torch=torch.__version__,
        diffusers=diffusers.__version__,
        latent=list(shape),
        token_grid=list(grid),
        text=[args.batch, args.text_len, config["text_dim"]],
        batch=args.batch,
        reps=args.reps,
        warmup=args.warmup,
        compile=args.compile,
        variants=results,
    )


def markdown(report: dict, command: str) -> str:
    grid = report["token_grid"]
    tokens = grid[0] * grid[1] * grid[2]
    lines = [
        f"{report['model']} denoising step (random weights): device {report['device']}, dtype "
        f"{report['dtype']}, torch {report['torch']}, diffusers {report['diffusers']}; latent "
        f"{tuple(report['latent'])} -> token grid {tuple(grid)} = {tokens} tokens, text "
        f"{tuple(report['text'])}, batch {report['batch']}, {report['reps']} reps after {report['warmup']} "
        f"warm-up, compile {'on' if report['compile'] else 'off'}.",
        f"Command: `{command}`",
        "",
        "| variant | self-attention (MHLA / softmax layers) | blocks | median ms/step | min ms/step "
        "| speed-up vs stock | peak GiB (warm-up) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, r in report["variants"].items():
        blocks = "x".join(str(b) for b in r["blocks"]) if r["blocks"] else "-"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        lines.append(
            f"| {name} | {r['mhla_layers']} / {r['softmax_layers']} | {blocks} | {r['median_ms']:.2f} "
            f"| {r['min_ms']:.2f} | {r['speedup']:.2f}x | {peak} |"
        )
    speedups = ", ".join(f"{name} {r['speedup']:.2f}x" for name, r in report["variants"].items()
                         if name != "stock")
    lines += ["", f"The target: `mhla` >= {GOAL}x stock for the full model at 480p, 81 frames, bf16 on "
                  f"CUDA. This run: {speedups}."]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "benchmarks/bench_wan_step.py", *given])
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        with writing_files((args.out, "--out")):  # one writer per file (a second one stops, naming this pid)
            report = run(args)
            report["command"] = command
            print(markdown(report, command))
            if args.out is not None:
                record = {**report, **file_record(BENCH_KIND)}
                atomic_write_text(args.out, json.dumps(record, indent=2) + "\n")
    finally:
        torch.set_num_threads(threads)
    return report


if __name__ == "__main__":
    run_cli(main)
