"""Whether ``import triton`` works, found out once, on first need: the op's and RoPE's dispatchers ask
before they choose a kernel (the package imports without triton; the reference paths need none)."""

from __future__ import annotations

_importable: bool | None = None


def triton_importable() -> bool:
    # a module global rather than functools.cache: torch.compile traces this without a warning
    global _importable
    if _importable is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            _importable = False
        else:
            _importable = True
    return _importable
