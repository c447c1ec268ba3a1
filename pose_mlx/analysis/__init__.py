"""NumPy-only analysis of context-window extension (never imports MLX): coverage of relative distances
(PoSE), rotary-angle distributions and DPRoPE factors, PI/ABF granularity, PI's interpolation bounds."""

from ..angles import angle_histograms, disturbances, dprope_factors, floored, kl_divergence
from ..rope import rope_inv_freq
from .bounds import attention_score, extrapolation_sum, interpolation_bound, interpolation_denominator
from .coverage import coverage_monte_carlo, coverage_probability, examples_to_cover, sample_pose_batch
from .granularity import (granularity_constant, granularity_limit, helix, limit_bounds, sine_similarity,
                          theorem1_bounds)

__all__ = [
    "angle_histograms", "attention_score", "coverage_monte_carlo", "coverage_probability", "disturbances",
    "dprope_factors", "examples_to_cover", "floored", "extrapolation_sum", "granularity_constant", "granularity_limit",
    "helix", "interpolation_bound", "interpolation_denominator", "kl_divergence", "limit_bounds",
    "rope_inv_freq", "sample_pose_batch", "sine_similarity", "theorem1_bounds",
]
