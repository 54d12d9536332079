"""Per-step randomness that does not depend on the number of processes or on resuming.

Every optimizer micro-step draws its noise, timesteps, flips and label drops from a generator seeded by
``(seed, micro_step)``, for the *global* batch, and each process keeps its own rows. So one process with
global batch 8 and two processes with 4 each see the same numbers, and a resumed run draws exactly what
an uninterrupted one would have drawn (no dependence on saved global RNG states).

The draws happen on the training device, from a generator of that device that the loop re-seeds every
micro-step: no host-to-device copy per draw. (CPU and CUDA generators give different numbers, so a run
resumed on another device type is not bit-identical; on the same device type it is.)
"""

from __future__ import annotations

import torch


class StepRandom:
    """Draws ``(global_batch, *shape)`` tensors on ``device`` and returns this process's ``(local_batch,
    *shape)`` rows (a view).

    Args:
        seed: run seed.
        micro_step: index of the micro-batch since step 0 (optimizer step * accumulation + micro index).
        local_batch: rows this process holds; ``rank``: this process's index; ``world``: process count.
        device: where the numbers are drawn and returned.
        generator: a ``torch.Generator`` on ``device`` to re-seed and use (the loop keeps one); None makes
            a new one.
    """

    def __init__(
        self,
        seed: int,
        micro_step: int,
        local_batch: int,
        rank: int = 0,
        world: int = 1,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ):
        self.device = torch.device(device)
        if generator is None:
            generator = torch.Generator(self.device)
        elif generator.device.type != self.device.type:
            raise ValueError(f"generator is on {generator.device}, the draws are on {self.device}")
        self.generator = generator.manual_seed(seed * 1_000_003 + micro_step)
        self.local_batch, self.rank, self.world = local_batch, rank, world

    def _local(self, full: torch.Tensor) -> torch.Tensor:
        start = self.rank * self.local_batch
        return full[start : start + self.local_batch]

    def _shape(self, *shape: int) -> tuple[int, ...]:
        return (self.local_batch * self.world, *shape)

    def randn(self, *shape: int, dtype=torch.float32) -> torch.Tensor:
        full = torch.randn(self._shape(*shape), generator=self.generator, dtype=dtype, device=self.device)
        return self._local(full)

    def rand(self, *shape: int) -> torch.Tensor:
        return self._local(torch.rand(self._shape(*shape), generator=self.generator, device=self.device))

    def randint(self, high: int) -> torch.Tensor:
        full = torch.randint(0, high, self._shape(), generator=self.generator, device=self.device)
        return self._local(full)

    def normal(self, mean: float, std: float) -> torch.Tensor:
        full = torch.randn(self._shape(), generator=self.generator, device=self.device)
        return self._local(full * std + mean)
