"""Statistics of the evaluation protocol (pure Python): intervals for accuracies and their differences, the power
of the pre-registered test, and Kendall's rank correlation between two orderings of the same methods.

- Wilson score interval of a proportion p = h / n: (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n).
- Newcombe's hybrid score interval of a difference p1 - p2 (R. G. Newcombe, "Interval estimation for the
  difference between independent proportions: comparison of eleven methods", Statistics in Medicine 17, 1998,
  method 10): with (l_i, u_i) the Wilson intervals, d - sqrt((p1 - l1)^2 + (u2 - p2)^2) ..
  d + sqrt((u1 - p1)^2 + (p2 - l2)^2). Unlike the Wald interval it stays inside [-1, 1] and keeps its coverage
  at accuracies near 0 or 1 with 10-30 trials, which is where passkey accuracies live.
- Kendall's tau-b of two score lists over the same items: (C - D) / sqrt((C + D + T_x)(C + D + T_y)), C and D
  the concordant and discordant pairs, T_x (T_y) the pairs tied only in x (y).
"""

from __future__ import annotations

import math
from itertools import combinations

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


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


__all__ = ["Z95", "difference_interval", "kendall_tau", "power", "verdict", "wilson"]
