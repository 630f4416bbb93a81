"""Seeded multiplicative noise on a latency model: the simulator's ground
truth (predictions are not perfect) and the emulated executor's stage times."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lemix.latency import LatencyModel


@dataclass(frozen=True)
class NoisyLatency:
    """Ground truth = model × lognormal(σ) noise with mean 1, from a seeded RNG."""

    base: LatencyModel
    cv: float
    rng: random.Random
    name: str = "noisy"

    @property
    def num_stages(self) -> int:
        return self.base.num_stages

    def _factor(self) -> float:
        if self.cv <= 0:
            return 1.0
        sigma = math.sqrt(math.log1p(self.cv * self.cv))
        return self.rng.lognormvariate(-0.5 * sigma * sigma, sigma)

    def forward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.base.forward_s(stage, batch_size, num_tokens) * self._factor()

    def backward_s(self, stage: int, batch_size: int, num_tokens: int) -> float:
        return self.base.backward_s(stage, batch_size, num_tokens) * self._factor()

    def decode_step_s(self, stage: int, batch_size: int, sum_context_tokens: int) -> float:
        return self.base.decode_step_s(stage, batch_size, sum_context_tokens) * self._factor()

    def chunk_forward_s(self, stage: int, num_new_tokens: int, num_past_tokens: int) -> float:
        base_s = self.base.chunk_forward_s(stage, num_new_tokens, num_past_tokens)
        return base_s * self._factor()
