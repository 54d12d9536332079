"""Where MHLA's time goes on CUDA: per-kernel GPU time, host time per call, and one Wan block split.

    python benchmarks/profile_mhla.py                      # CUDA, bf16: every part below
    python benchmarks/profile_mhla.py --shapes dit256 --no-wan-block

Printed as Markdown, for ``scripts/gpu_check.py``'s report:

1. **kernels**: at each model shape (``bench_attention.MODEL_SHAPES`` plus SANA 1024 px), the op's
   forward (no grad) and forward + backward under ``torch.profiler``: every CUDA kernel with its launches
   per call and GPU microseconds per call, sorted by time; TF32 off, then on (matters only for the fp32
   GEMMs outside the kernels).
2. **host vs GPU**: per call, the eager wall time of back-to-back calls, the GPU time of the same
   forward replayed from a CUDA graph, and the host time to enqueue one call (GPU idle before it): at
   small N the eager time is the host's, at large N the GPU's. FlashAttention (SDPA) beside MHLA.
3. **Wan block**: one ``WanTransformerBlock`` of Wan2.1-1.3B at 480p (B=2, 32,760 tokens, bf16) with the
   MHLA processor, forward (inference) and forward + backward, the CUDA time grouped by PyTorch op
   (projections, norms, RoPE's elementwise ops, the MHLA kernels, the feed-forward), stock beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_attention beside this file

from bench_attention import MODEL_SHAPES, ModelShape, build_model_methods, graph_ms, time_ms  # noqa: E402

SHAPES = {**MODEL_SHAPES, "sana1024": ModelShape(2, 70, 32, (32, 32), (4, 4))}  # SANA-1.6B, 1024 px


def _device_us(event) -> float:
    """Self device time (µs) of a profiler event, across torch versions' attribute names."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profiled(fn, calls: int) -> list:
    """``torch.profiler``'s averaged events (CPU and CUDA) of ``calls`` calls of ``fn``, after one untimed."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_table(fn, calls: int = 5, rows: int = 14) -> str:
    """Markdown: the CUDA kernels ``fn`` launches, launches and GPU µs per call, longest first."""
    kernels = [e for e in profiled(fn, calls) if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=_device_us, reverse=True)
    total = sum(_device_us(e) for e in kernels) / calls
    launches = sum(e.count for e in kernels) / calls
    lines = [f"GPU {total:.1f} µs per call in {launches:.0f} launches", "",
             "| kernel | launches / call | µs / call | share |", "|---|---:|---:|---:|"]
    for e in kernels[:rows]:
        us = _device_us(e) / calls
        lines.append(f"| `{e.key[:90]}` | {e.count / calls:.0f} | {us:.1f} | {us / max(total, 1e-9):.0%} |")
    return "\n".join(lines)


def profile_shapes(names, dtype) -> None:
    for name in names:
        methods, inputs, grad_out = build_model_methods(SHAPES[name], torch.device("cuda"), dtype)
        op = methods["mhla_op"]

        def forward(op=op, inputs=inputs):
            with torch.no_grad():
                op(*inputs)

        def forward_backward(op=op, inputs=inputs, grad_out=grad_out):
            torch.autograd.grad(op(*inputs), inputs, grad_out)

        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            for label, fn in (("forward", forward), ("forward + backward", forward_backward)):
                print(f"\n### {name} {SHAPES[name]}: {label}, TF32 {'on' if tf32 else 'off'}\n", flush=True)
                print(kernel_table(fn))
        torch.backends.cuda.matmul.allow_tf32 = False


def enqueue_us(fn, calls: int = 50) -> float:
    """Host µs to launch one call, the GPU idle before each (median of ``calls``)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_vs_gpu(names, dtype) -> None:
    print("\n## host vs GPU per forward call (no grad)\n")
    print("| shape | method | eager ms | CUDA-graph ms | host µs to launch |")
    print("|---|---|---:|---:|---:|")
    for name in names:
        methods, inputs, _ = build_model_methods(SHAPES[name], torch.device("cuda"), dtype)
        for method in ("sdpa", "la", "mhla_op"):
            fn = methods[method]

            def call(fn=fn, inputs=inputs):
                with torch.no_grad():
                    return fn(*inputs)

            eager = statistics.median(time_ms(call, torch.device("cuda")) for _ in range(5))
            try:
                graph = f"{graph_ms(call, torch.device('cuda')):.4f}"
            except Exception as err:  # noqa: BLE001 - a capture failure is a finding to report
                graph = f"failed ({type(err).__name__})"
            print(f"| {name} | {method} | {eager:.4f} | {graph} | {enqueue_us(call):.0f} |", flush=True)


def wan_block(dtype) -> None:
    """One Wan2.1-1.3B block at 480p, stock and MHLA, CUDA time grouped by op."""
    from bench_wan_step import WAN_1_3B_CONFIG, latent_shape, make_inputs, token_grid
    from diffusers import WanTransformer3DModel

    from mhla_gen import MHLAConfig, install_mhla

    config = {**WAN_1_3B_CONFIG, "num_layers": 1}
    shape = latent_shape(81, 480, 832, 2)
    torch.manual_seed(0)
    stock = WanTransformer3DModel(**config).to("cuda", dtype)
    mhla = WanTransformer3DModel(**config).to("cuda", dtype)
    install_mhla(mhla, MHLAConfig.preset("wan2.1-1.3b-480p"))
    inputs = make_inputs(config, shape, 512, "cuda", dtype)
    print(f"\n## Wan2.1-1.3B, one block, 480p, token grid {token_grid(config, shape)}, {dtype}\n")
    for label, model in (("stock", stock), ("mhla", mhla)):
        def forward(model=model):
            with torch.inference_mode():
                model(**inputs)

        def forward_backward(model=model):
            model(**inputs)[0].float().square().mean().backward()

        for mode, fn in (("forward", forward), ("forward + backward", forward_backward)):
            print(f"\n### {label}: {mode}\n", flush=True)
            print(op_table(fn))


def op_table(fn, calls: int = 3, rows: int = 25) -> str:
    """Markdown: PyTorch ops by self CUDA time per call (what runs inside each op is charged to it)."""
    events = [e for e in profiled(fn, calls) if e.device_type != torch.autograd.DeviceType.CUDA]
    events = [e for e in events if _device_us(e) > 0]
    events.sort(key=_device_us, reverse=True)
    total = sum(_device_us(e) for e in events) / calls
    lines = [f"GPU {total / 1e3:.2f} ms per call", "", "| op | calls | ms / call | share |",
             "|---|---:|---:|---:|"]
    for e in events[:rows]:
        ms = _device_us(e) / calls / 1e3
        share = ms * 1e3 / max(total, 1e-9)
        lines.append(f"| `{e.key[:80]}` | {e.count / calls:.0f} | {ms:.3f} | {share:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES),
                        default=["wan480", "sana4096", "sana1024", "dit256"])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--no-wan-block", action="store_true", help="skip the Wan block split")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_mhla: no CUDA device; it profiles CUDA kernels", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    host_vs_gpu(args.shapes, dtype)
    print("\n## kernels per call")
    profile_shapes(args.shapes, dtype)
    if not args.no_wan_block:
        wan_block(dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
