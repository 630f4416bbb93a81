"""The LeMix node score: idleness profit, length consistency, response time.

`paper_score` is the prototype's exact form; `normalized_score` is ours. With
IP ≤ −τ < 0 the paper's f = (IP + λ2·LC)/(λ1·R) *rises* as R grows, so it
prefers the node that answers slowest; ours keeps every term's sign meaning
what it says and puts the terms on comparable scales.
"""

from __future__ import annotations

import math

import numpy as np

_SQRT_2PI = math.sqrt(2.0 * math.pi)
_MIN_RESPONSE_S = 1e-9  # guards the paper form's division


def idleness_profit(
    idleness_increase_s: float, num_stages: int, arrival_gap_s: float, tau_s: float
) -> float:
    """IP = −max(II/S − Δa, τ)."""
    return -max(idleness_increase_s / num_stages - arrival_gap_s, tau_s)


def length_consistency(length: float, mean: float, std: float) -> float:
    """LC = N(ℓ; μ, σ), the Gaussian density; 0 when σ is undefined or 0."""
    if std <= 0.0:
        return 0.0
    z = (length - mean) / std
    return math.exp(-0.5 * z * z) / (std * _SQRT_2PI)


def length_consistency_normalized(length: float, mean: float, std: float) -> float:
    """LC scaled to [0, 1] (1 at the node's mean length): exp(−z²/2)."""
    if std <= 0.0:
        return 0.0
    z = (length - mean) / std
    return math.exp(-0.5 * z * z)


def length_consistency_normalized_array(
    length: float, mean: np.ndarray, std: np.ndarray
) -> np.ndarray:
    """`length_consistency_normalized` per element (numpy's `exp`, which may
    differ from `math.exp` in the last bit)."""
    safe_std = np.where(std > 0.0, std, 1.0)
    z = (length - mean) / safe_std
    return np.where(std > 0.0, np.exp(-0.5 * z * z), 0.0)


def paper_score(
    ip: float, lc: float, response_s: float, lambda_response: float, lambda_length: float
) -> float:
    """f = (IP + λ2·LC) / (λ1·R), exactly as the prototype computes it."""
    return (ip + lambda_length * lc) / (lambda_response * max(response_s, _MIN_RESPONSE_S))


def normalized_score(
    ip: float,
    lc_normalized: float,
    response_s: float,
    tau_s: float,
    slo_s: float,
    lambda_response: float,
    lambda_length: float,
    tbt_s: float = 0.0,
    slo_tbt_s: float = 1.0,
    lambda_tbt: float = 0.0,
) -> float:
    """Ours: f = IP/τ − λ1·R/τ_R − λ3·TBT/τ_TBT + λ2·LC_norm (higher is better).

    IP/τ ≤ −1 and is −1 unless the task opens idle time beyond the arrival gap;
    R/τ_R and TBT/τ_TBT are 1 at their SLOs; LC_norm is in [0, 1]. The TBT term
    (decode-aware estimators only) steers requests away from nodes whose
    batches, or pending training, would slow their tokens.
    """
    return (
        ip / tau_s
        - lambda_response * response_s / slo_s
        - lambda_tbt * tbt_s / slo_tbt_s
        + lambda_length * lc_normalized
    )
