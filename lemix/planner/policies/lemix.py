"""LeMix placement: Algorithm 1 on every node, then the node score, argmax."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lemix.planner.base import PolicyContext, Ranked
from lemix.planner.score import (
    idleness_profit,
    length_consistency,
    length_consistency_normalized,
    length_consistency_normalized_array,
    normalized_score,
    paper_score,
)
from lemix.planner.trace import NodeView, Prediction
from lemix.types import Task


@dataclass(frozen=True)
class LemixPolicy:
    """`form="paper"`: f = (IP + λ2·LC)/(λ1·R); `form="normalized"`: ours."""

    name: str = "lemix"
    form: str = "normalized"
    lambda_response: float = 1.0
    lambda_length: float = 0.05
    lambda_tbt: float = 1.0  # normalized form only
    is_length_consistency_enabled: bool = True
    needs_prediction: bool = True

    def __post_init__(self) -> None:
        if self.form not in ("paper", "normalized"):
            raise ValueError(f"unknown score form {self.form!r}")

    def score(self, task: Task, view: NodeView, pred: Prediction, context: PolicyContext) -> float:
        config = context.config
        ip = idleness_profit(
            pred.idleness_increase_s, view.num_stages, pred.arrival_gap_s, config.tau_idle_s
        )
        lam_length = self.lambda_length if self.is_length_consistency_enabled else 0.0
        length = float(task.num_prompt_tokens)
        if self.form == "paper":
            lc = length_consistency(length, view.length_mean, view.length_std)
            return paper_score(ip, lc, pred.response_s, self.lambda_response, lam_length)
        lc_norm = length_consistency_normalized(length, view.length_mean, view.length_std)
        return normalized_score(
            ip,
            lc_norm,
            pred.response_s,
            config.tau_idle_s,
            config.slo_ttft_s,
            self.lambda_response,
            lam_length,
            pred.time_between_tokens_s,
            config.slo_tbt_s,
            self.lambda_tbt,
        )

    def score_upper_bound(
        self,
        task: Task,
        view: NodeView,
        response_lower_s: float,
        time_between_tokens_s: float,
        context: PolicyContext,
    ) -> float | None:
        """`score` with IP at its ceiling −τ and R at its floor, the other
        terms exact. The normalized form is the same float operations as
        `score`, each monotone in IP (up) and R (down) when τ > 0 and λ1 ≥ 0,
        so the bound holds after rounding. The paper form divides by R, which
        is not monotone in it: no bound."""
        config = context.config
        if self.form != "normalized" or not config.tau_idle_s > 0 or self.lambda_response < 0:
            return None
        lam_length = self.lambda_length if self.is_length_consistency_enabled else 0.0
        lc_norm = length_consistency_normalized(
            float(task.num_prompt_tokens), view.length_mean, view.length_std
        )
        return normalized_score(
            -config.tau_idle_s,  # IP = −max(II/S − Δa, τ) ≤ −τ
            lc_norm,
            response_lower_s,
            config.tau_idle_s,
            config.slo_ttft_s,
            self.lambda_response,
            lam_length,
            time_between_tokens_s,
            config.slo_tbt_s,
            self.lambda_tbt,
        )

    def score_upper_bounds(
        self,
        task: Task,
        length_mean: np.ndarray,
        length_std: np.ndarray,
        response_lower_s: np.ndarray,
        time_between_tokens_s: np.ndarray,
        context: PolicyContext,
    ) -> np.ndarray | None:
        """`score_upper_bound` for many nodes at once (their length statistics,
        response floors and TBTs as arrays; `lemix.planner.bounds`): the same
        float operations per element, except `exp`'s last bit."""
        config = context.config
        if self.form != "normalized" or not config.tau_idle_s > 0 or self.lambda_response < 0:
            return None
        lam_length = self.lambda_length if self.is_length_consistency_enabled else 0.0
        lc_norm = length_consistency_normalized_array(
            float(task.num_prompt_tokens), length_mean, length_std
        )
        bounds: np.ndarray = normalized_score(  # type: ignore[assignment]
            -config.tau_idle_s,
            lc_norm,  # type: ignore[arg-type]
            response_lower_s,  # type: ignore[arg-type]
            config.tau_idle_s,
            config.slo_ttft_s,
            self.lambda_response,
            lam_length,
            time_between_tokens_s,  # type: ignore[arg-type]
            config.slo_tbt_s,
            self.lambda_tbt,
        )
        return bounds

    def rank(
        self,
        task: Task,
        views: Sequence[NodeView],
        predictions: Mapping[int, Prediction],
        context: PolicyContext,
    ) -> list[Ranked]:
        ranked = [
            Ranked(
                view.node_id,
                self.score(task, view, predictions[view.node_id], context),
                predictions[view.node_id],
            )
            for view in views
            if view.node_id in predictions
        ]
        # Stable: ties go to the lower node id, deterministically.
        ranked.sort(key=lambda r: (-r.score, r.node_id))
        return ranked

    def serving_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...]:
        return tuple(range(num_nodes))

    def training_nodes(self, num_nodes: int, context: PolicyContext) -> tuple[int, ...] | None:
        return None  # co-located: the planner's training nodes

    def snapshot_state(self) -> dict[str, Any]:
        return {}  # stateless: every decision comes from the planner's views

    def restore_state(self, state: Mapping[str, Any]) -> None:
        pass
