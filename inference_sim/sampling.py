"""Heavy-tailed output lengths.

Real completion lengths are roughly lognormal: most answers are short, a few
run to thousands of tokens, and those few dominate queueing delay. Sampling is
seeded so a scenario replays the same lengths in the same arrival order.
"""

from __future__ import annotations

import math
import random

# A guard against absurd draws with a large sigma; max_tokens truncates far earlier.
MAX_SAMPLE = 1_000_000


class OutputLengthSampler:
    """Lognormal (median, sigma), or Pareto with the same median and tail
    index ``alpha``: P(X > x) = (x_m / x)^alpha, x_m = median / 2^(1/alpha).
    Pareto's tail is heavier (alpha <= 2: infinite variance), the regime where
    a few huge generations dominate everyone's queueing delay."""

    def __init__(self, seed: int, median: float, sigma: float, dist: str = "lognormal", alpha: float = 1.5) -> None:
        self.seed = seed
        self.median = median
        self.sigma = sigma
        self.dist = dist
        self.alpha = alpha
        self._rng = random.Random(seed)

    def reseed(self) -> None:
        self._rng = random.Random(self.seed)

    def sample(self) -> int:
        """One output length in tokens (>= 1), before any max_tokens truncation."""
        if self.dist == "pareto":
            scale = self.median / 2 ** (1 / self.alpha)
            draw = scale * self._rng.paretovariate(self.alpha)
        else:
            draw = self._rng.lognormvariate(math.log(self.median), self.sigma)
        return max(1, min(MAX_SAMPLE, round(draw)))
