"""Statistics of the evaluation protocol: intervals for accuracies and their differences, the power of the
pre-registered test, the equivalence test that amends it and its power, and Kendall's rank correlation between two
orderings of the same methods.

- Wilson score interval of a proportion p = h / n: (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n).
- Newcombe's hybrid score interval of a difference p1 - p2 (R. G. Newcombe, "Interval estimation for the
  difference between independent proportions: comparison of eleven methods", Statistics in Medicine 17, 1998,
  method 10): with (l_i, u_i) the Wilson intervals, d - sqrt((p1 - l1)^2 + (u2 - p2)^2) ..
  d + sqrt((u1 - p1)^2 + (p2 - l2)^2). Unlike the Wald interval it stays inside [-1, 1] and keeps its coverage
  at accuracies near 0 or 1 with 10-30 trials, which is where passkey accuracies live.
- Equivalence by two one-sided tests (TOST) at level alpha each: p1 - p2 is equivalent to 0 within a margin m when
  the 1 - 2 alpha Newcombe interval lies inside (-m, +m) (Schuirmann's interval inclusion; D. J. Schuirmann,
  "A comparison of the two one-sided tests procedure and the power approach for assessing the equivalence of
  average bioavailability", Journal of Pharmacokinetics and Biopharmaceutics 15, 1987). Its power is exact, summed
  over every outcome of two independent binomials (NumPy over the outcome grid).
- Kendall's tau-b of two score lists over the same items: (C - D) / sqrt((C + D + T_x)(C + D + T_y)), C and D
  the concordant and discordant pairs, T_x (T_y) the pairs tied only in x (y).
"""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
Z90 = 1.6448536269514722  # its 95% quantile: the 90% interval of two one-sided tests at 0.05 each


def wilson(hits: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (low, high) of the proportion hits / n."""
    if n <= 0 or not 0 <= hits <= n:
        raise ValueError(f"need 0 <= hits <= n and n > 0, got hits={hits}, n={n}")
    p = hits / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def difference_interval(hits1: int, n1: int, hits2: int, n2: int, z: float = Z95) -> tuple[float, float, float]:
    """(d, low, high): d = hits1/n1 - hits2/n2 and Newcombe's hybrid score interval around it."""
    p1, p2 = hits1 / n1, hits2 / n2
    (l1, u1), (l2, u2) = wilson(hits1, n1, z), wilson(hits2, n2, z)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def verdict(low: float, high: float) -> str:
    """The protocol's reading of a difference interval: 'better' (all above 0), 'worse' (all below) or
    'not distinguishable'."""
    return "better" if low > 0 else "worse" if high < 0 else "not distinguishable"


def _binomial(n: int, p: float) -> list[float]:
    return [math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)]


def power(p1: float, n1: int, p2: float, n2: int, z: float = Z95) -> float:
    """Probability that the difference interval lies above 0 when the true accuracies are p1 and p2 (independent
    binomial trials), summed exactly over every outcome (h1, h2)."""
    b1, b2 = _binomial(n1, p1), _binomial(n2, p2)
    return sum(b1[h1] * b2[h2] for h1 in range(n1 + 1) for h2 in range(n2 + 1)
               if difference_interval(h1, n1, h2, n2, z)[1] > 0)


def equivalence(hits1: int, n1: int, hits2: int, n2: int, margin: float,
                z: float = Z90) -> tuple[float, float, float, str]:
    """(d, low, high, verdict): d = hits1/n1 - hits2/n2, Newcombe's interval at `z` (90% by default: two one-sided
    tests at 0.05) and 'equivalent' when it lies inside (-margin, +margin), else 'not shown equivalent'."""
    d, low, high = difference_interval(hits1, n1, hits2, n2, z)
    return d, low, high, "equivalent" if -margin < low and high < margin else "not shown equivalent"


def _wilson_grid(n: int, z: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, low, high) of the Wilson interval for every outcome 0..n (`wilson`, vectorised)."""
    p = np.arange(n + 1) / n
    centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return p, np.maximum(0.0, (centre - half) / (1 + z * z / n)), np.minimum(1.0, (centre + half) / (1 + z * z / n))


def equivalence_power(p1: float, n1: int, p2: float, n2: int, margin: float, z: float = Z90) -> float:
    """Probability that `equivalence` says 'equivalent' when the true accuracies are p1 and p2 (independent binomial
    trials), summed exactly over every outcome (h1, h2)."""
    (a, l1, u1), (b, l2, u2) = _wilson_grid(n1, z), _wilson_grid(n2, z)
    d = a[:, None] - b[None, :]
    low = d - np.sqrt((a - l1)[:, None] ** 2 + (u2 - b)[None, :] ** 2)
    high = d + np.sqrt((u1 - a)[:, None] ** 2 + (b - l2)[None, :] ** 2)
    weights = np.outer(_binomial(n1, p1), _binomial(n2, p2))
    return float(weights[(low > -margin) & (high < margin)].sum())


def equivalence_trials(p: float, margin: float, target: float, z: float = Z90, limit: int = 5000) -> int:
    """The fewest trials n per run (the same for both) whose `equivalence_power` at true accuracies p and p reaches
    `target` (the power of a discrete test is not monotone in n: this is the first n that reaches it)."""
    for n in range(2, limit + 1):
        if equivalence_power(p, n, p, n, margin, z) >= target:
            return n
    raise ValueError(f"no n <= {limit} reaches power {target} at p = {p}, margin {margin}")


def kendall_tau(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b between the scores x and y of the same items (ties allowed); NaN when either is constant."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two score lists of the same length >= 2, got {len(x)} and {len(y)}")
    concordant = discordant = tied_x = tied_y = 0
    for i, j in combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            tied_x += 1
        elif dy == 0:
            tied_y += 1
        elif (dx > 0) == (dy > 0):
            concordant += 1
        else:
            discordant += 1
    denominator = math.sqrt((concordant + discordant + tied_x) * (concordant + discordant + tied_y))
    return (concordant - discordant) / denominator if denominator else float("nan")


__all__ = ["Z90", "Z95", "difference_interval", "equivalence", "equivalence_power", "equivalence_trials", "kendall_tau",
           "power", "verdict", "wilson"]
