"""Shared test setup: deterministic seeds, GPU-test skipping and small random attention inputs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# the study harness (eval/studies) is imported as `studies`, as `python eval/study.py` finds it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` runs one worker per core: one intra-op thread each (and in the subprocesses the
    # tests start) avoids oversubscription, which made small CPU ops 7-100x slower here.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:  # the marker, not the keyword: a checkout in a folder named gpu skips nothing more
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def make_qkv():
    """``make_qkv(n, batch=2, heads=3, dim=4, value_dim=None, dtype=float64, grad=False) -> (q, k, v)``."""

    def make(n, batch=2, heads=3, dim=4, value_dim=None, dtype=torch.float64, grad=False):
        value_dim = value_dim or dim
        q = torch.randn(batch, heads, n, dim, dtype=torch.float64).to(dtype)
        k = torch.randn(batch, heads, n, dim, dtype=torch.float64).to(dtype)
        v = torch.randn(batch, heads, n, value_dim, dtype=torch.float64).to(dtype)
        return tuple(t.requires_grad_(grad) for t in (q, k, v))

    return make


@pytest.fixture
def used_grids(monkeypatch):
    """The token grid of every MHLA layer call from now on, in call order (a spy on the processors)."""
    from mhla_gen.processors.base import MHLAProcessor

    seen, original = [], MHLAProcessor.layout

    def spy(self, grid, num_tokens):
        seen.append(tuple(grid))
        return original(self, grid, num_tokens)

    monkeypatch.setattr(MHLAProcessor, "layout", spy)
    return seen


@pytest.fixture
def random_mixing():
    """``random_mixing(layout, grad=True)``: a positive, non-symmetric float64 ``(M, M)`` leaf tensor."""

    def make(layout, grad=True):
        m = layout.num_blocks
        return (0.1 + torch.rand(m, m, dtype=torch.float64)).requires_grad_(grad)

    return make
