"""Sampling and the lossless acceptance rules.

Every draw at absolute sequence position ``pos`` uses a generator seeded by (seed, pos), so a
speculative run and a plain run with the same seed draw the same token at every position.
For point-mass drafts (retrieval drafters) the engine samples the target token first and
accepts the draft iff it matches: accept-with-probability p(x) and, on rejection, a sample from
the normalised residual max(0, p - 1[x]) — exactly the speculative-sampling rule, and
token-for-token equal to plain sampling. Drafters with real distributions q use min(1, p/q).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """Target distribution after temperature, top-k and top-p (float64, sums to 1)."""
        x = logits.astype(np.float64)
        if self.greedy:
            p = np.zeros_like(x)
            p[int(np.argmax(x))] = 1.0
            return p
        with np.errstate(over="ignore"):
            scaled = x / self.temperature
            if not np.isfinite(scaled).all():
                # a tiny temperature (down to subnormal) overflows x / t; shifted first, the top logit is
                # 0 and the others saturate to -inf (exp 0) instead of becoming inf - inf = NaN
                scaled = (x - x.max()) / self.temperature
        x = scaled
        if self.top_k and self.top_k < x.size:
            kth = np.partition(x, -self.top_k)[-self.top_k]
            x = np.where(x < kth, -np.inf, x)
        x = x - x.max()
        p = np.exp(x)
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            cut = int(np.searchsorted(cum, self.top_p) + 1)
            keep = np.zeros_like(p, dtype=bool)
            keep[order[:cut]] = True
            p = np.where(keep, p, 0.0)
            p /= p.sum()
        return p

    def rng(self, pos: int, salt: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed, pos, salt])

    def draw(self, p: np.ndarray, pos: int, salt: int = 0) -> int:
        """Inverse-CDF draw from p, seeded by the absolute position (reproducible)."""
        u = self.rng(pos, salt).random()
        cum = np.cumsum(p)
        return int(min(np.searchsorted(cum, u * cum[-1], side="right"), p.size - 1))

    def pick(self, logits: np.ndarray, pos: int) -> int:
        """The target's token at ``pos``: argmax when greedy, else a seeded draw."""
        if self.greedy:
            return int(np.argmax(logits))
        return self.draw(self.probs(logits), pos)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Normalised max(0, p - q): where to sample after rejecting a draft drawn from q."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p


def accept_ratio(
    p: np.ndarray, q: np.ndarray, token: int, sampler: Sampler, pos: int, residual_fn=residual
) -> tuple[bool, int]:
    """Speculative sampling with a real draft distribution: accept ``token`` with min(1, p/q),
    else draw from the residual. Returns (accepted, token_to_commit)."""
    qx = float(q[token])
    ratio = 1.0 if qx <= 0 else min(1.0, float(p[token]) / qx)
    if sampler.rng(pos, 1).random() < ratio:
        return True, token
    return False, sampler.draw(residual_fn(p, q), pos, salt=2)
