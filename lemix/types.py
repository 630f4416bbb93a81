"""Domain types shared by the planner, the simulator and the services.

Plain frozen dataclasses: protobuf appears only at service edges, converted in
one module per service. Times are seconds on whatever clock the caller uses
(virtual time in the simulator, a monotonic clock in the services).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from lemix.outputs import MAX_TOP_LOGPROBS


class TaskKind(StrEnum):
    INFERENCE = "inference"
    TRAINING = "training"


class TaskStatus(StrEnum):
    COMPLETED = "completed"
    REJECTED = "rejected"  # refused with a reason before it ran (bad input, no room ever)
    FAILED = "failed"  # started but could not finish, with a reason


@dataclass(frozen=True, slots=True)
class Task:
    """One unit the planner places: an inference request or a training batch.

    `num_prompt_tokens` is the prompt length for inference and the per-sample
    sequence length (query + reference) for training. `max_output_tokens` caps
    decoding (inference only); load generators that replay traces set it to the
    trace's generated length, as serving benchmarks do with ignore-EOS.
    """

    task_id: str
    kind: TaskKind
    arrival_s: float
    num_prompt_tokens: int
    max_output_tokens: int = 0
    batch_size: int = 1
    seq: int = 0  # arrival order; ties on time are broken by it

    def __post_init__(self) -> None:
        if self.num_prompt_tokens <= 0:
            raise ValueError(f"task {self.task_id}: num_prompt_tokens must be > 0")
        if self.batch_size <= 0:
            raise ValueError(f"task {self.task_id}: batch_size must be > 0")
        if self.kind is TaskKind.INFERENCE and self.max_output_tokens <= 0:
            raise ValueError(f"task {self.task_id}: inference needs max_output_tokens > 0")

    @property
    def is_training(self) -> bool:
        return self.kind is TaskKind.TRAINING

    @property
    def num_total_tokens(self) -> int:
        """Tokens whose KV a request holds at its end (prompt + generated)."""
        return self.num_prompt_tokens + self.max_output_tokens


@dataclass(frozen=True, slots=True)
class TaskPayload:
    """What a model needs to run a task beyond the sizes the planner sees.

    Kept apart from `Task` so the planner and the simulator never carry token
    ids; it travels beside the task to executors. Token id tuples are empty for
    the emulated backend.
    """

    prompt_token_ids: tuple[int, ...] = ()  # inference: the prompt; training: query+reference
    reference_token_ids: tuple[int, ...] = ()  # training labels / inference-loss reference
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    ignore_eos: bool = False  # decode exactly max_output_tokens (load tests)
    seed: int = 0  # sampling RNG seed
    # Log-probabilities of the output tokens: -1 = none, k = each token's and
    # the k most likely tokens' (`lemix.outputs.TokenLogprob`).
    top_logprobs: int = -1
    # The same for the prompt's tokens (from the second on), computed in the prefill.
    prompt_logprobs: int = -1
    # Training tasks of several samples: prompt_token_ids is the samples one
    # after another, sample i has sample_lengths[i] tokens of which the last
    # reference_lengths[i] are its reference (reference_token_ids stays empty).
    sample_lengths: tuple[int, ...] = ()
    reference_lengths: tuple[int, ...] = ()
    # vLLM's filters and penalties (SamplingParams in protos/lemix/v1/common.proto).
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    presence_penalty: float = 0.0  # in [-2, 2], over the output so far
    frequency_penalty: float = 0.0  # in [-2, 2], per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, over prompt + output; 1 = off
    min_tokens: int = 0  # EOS and stop_token_ids masked until this many are out
    stop_token_ids: tuple[int, ...] = ()  # end the sequence like EOS

    def __post_init__(self) -> None:
        if self.sample_lengths or self.reference_lengths:
            self._check_samples()
        self._check_penalties()
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        for name in ("top_logprobs", "prompt_logprobs"):
            if not -1 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise ValueError(
                    f"{name} must be -1 (none) or in [0, {MAX_TOP_LOGPROBS}], "
                    f"got {getattr(self, name)}"
                )
        for name in ("prompt_token_ids", "reference_token_ids"):
            ids = getattr(self, name)
            if any(i < 0 for i in ids):
                raise ValueError(f"{name} must be >= 0, got {min(ids)}")

    def _check_penalties(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(
                "repetition_penalty must be finite and > 0 (1 = off), "
                f"got {self.repetition_penalty}"
            )
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(i < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {min(self.stop_token_ids)}")

    def _check_samples(self) -> None:
        if len(self.sample_lengths) != len(self.reference_lengths):
            raise ValueError("sample_lengths and reference_lengths must have one entry per sample")
        if sum(self.sample_lengths) != len(self.prompt_token_ids):
            raise ValueError(
                f"sample_lengths add up to {sum(self.sample_lengths)} but there "
                f"are {len(self.prompt_token_ids)} prompt_token_ids"
            )
        if any(
            not 0 <= r <= n
            for n, r in zip(self.sample_lengths, self.reference_lengths, strict=True)
        ):
            raise ValueError("each reference length must be within its sample's length")
        if self.reference_token_ids:
            raise ValueError("a multi-sample payload carries references as reference_lengths")

    def samples(self) -> list[tuple[tuple[int, ...], int]]:
        """(token ids, number of reference tokens at the end) per sample."""
        if not self.sample_lengths:
            return [(self.prompt_token_ids, len(self.reference_token_ids))]
        out, start = [], 0
        for n, num_ref in zip(self.sample_lengths, self.reference_lengths, strict=True):
            out.append((self.prompt_token_ids[start : start + n], num_ref))
            start += n
        return out


# ---------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class Placement:
    """Run `task_id` on `node_id`. Prediction fields are for logs and metrics."""

    task_id: str
    node_id: int
    predicted_response_s: float
    score: float


@dataclass(frozen=True, slots=True)
class Deferral:
    """A training task held back in the planner's deferred queue (never dropped)."""

    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Rejection:
    """A task refused with a reason a user can act on."""

    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class WeightSync:
    """Copy weights from a training node to serving nodes (SEPARATE baselines)."""

    source_node_id: int
    target_node_ids: tuple[int, ...]
    num_training_updates: int  # updates on the source when the sync was decided


@dataclass(frozen=True, slots=True)
class ReplicaAverage:
    """Average the weights of the co-located replicas on `node_ids` (replica sync).

    Each node exports its weights, then takes the element-wise mean of all the
    exports (plus what it trained since its own export); optimizer state stays
    local. `round` numbers the averages of one run, from 1.
    """

    node_ids: tuple[int, ...]
    round: int


Decision = Placement | Deferral | Rejection | WeightSync | ReplicaAverage


# ------------------------------------------------------------ node feedback


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What an executor reports about one node (a heartbeat, or the simulator).

    The planner folds these into its per-node view; they correct its
    predictions with what actually happened.
    """

    node_id: int
    now_s: float
    num_running: int = 0  # requests in the running decode batch
    num_waiting: int = 0  # inference requests queued on the node, not yet admitted
    sum_context_tokens: int = 0  # KV tokens held by the running batch
    max_remaining_decode_tokens: int = 0  # longest remaining decode in the batch
    kv_used_bytes: int = 0  # max over stages
    memory_capacity_bytes: int = 0  # usable (threshold) bytes per stage GPU
    busy_fraction: float = 0.0  # recent busy share of stage time, mean over stages
    num_training_updates: int = 0  # optimizer steps applied to this node's weights
    is_healthy: bool = True


@dataclass(slots=True)
class TaskRecord:
    """The outcome of one task, for metrics. Every task ends with exactly one."""

    task_id: str
    kind: TaskKind
    arrival_s: float
    num_prompt_tokens: int
    max_output_tokens: int = 0
    batch_size: int = 1
    status: TaskStatus | None = None
    reason: str = ""
    node_id: int | None = None
    placed_s: float | None = None
    first_token_s: float | None = None  # inference: end of prefill at the last stage
    finish_s: float | None = None
    num_output_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)
    serving_staleness_updates: int | None = None
    inference_loss: float | None = None
    reference_accuracy: float | None = None  # teacher-forced top-1 accuracy on the reference
    predicted_response_s: float | None = None
