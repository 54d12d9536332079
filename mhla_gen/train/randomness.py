"""Per-step randomness that does not depend on the number of processes or on resuming.

Every optimizer micro-step draws its noise, timesteps, flips and label drops from a generator seeded by
``(seed, micro_step)``, for the *global* batch, and each process keeps its own rows. So one process with
global batch 8 and two processes with 4 each see the same numbers, and a resumed run draws exactly what
an uninterrupted one would have drawn (no dependence on saved global RNG states).
"""

from __future__ import annotations

import torch


class StepRandom:
    """Draws ``(global_batch, *shape)`` tensors and returns this process's ``(local_batch, *shape)`` rows.

    Args:
        seed: run seed.
        micro_step: index of the micro-batch since step 0 (optimizer step * accumulation + micro index).
        local_batch: rows this process holds; ``rank``: this process's index; ``world``: process count.
        device: where the returned tensors go (drawn on CPU so every device gives the same numbers).
    """

    def __init__(
        self,
        seed: int,
        micro_step: int,
        local_batch: int,
        rank: int = 0,
        world: int = 1,
        device: torch.device | str = "cpu",
    ):
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + micro_step)
        self.local_batch, self.rank, self.world, self.device = local_batch, rank, world, device

    def _local(self, full: torch.Tensor) -> torch.Tensor:
        start = self.rank * self.local_batch
        return full[start : start + self.local_batch].to(self.device)

    def randn(self, *shape: int, dtype=torch.float32) -> torch.Tensor:
        full = torch.randn(self.local_batch * self.world, *shape, generator=self.generator, dtype=dtype)
        return self._local(full)

    def rand(self, *shape: int) -> torch.Tensor:
        return self._local(torch.rand(self.local_batch * self.world, *shape, generator=self.generator))

    def randint(self, high: int) -> torch.Tensor:
        return self._local(torch.randint(0, high, (self.local_batch * self.world,), generator=self.generator))

    def normal(self, mean: float, std: float) -> torch.Tensor:
        return self._local(torch.randn(self.local_batch * self.world, generator=self.generator) * std + mean)
