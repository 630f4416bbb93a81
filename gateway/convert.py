"""What leaves the gateway: output-stream messages and Redis state -> protobuf.

Requests coming in are converted by `gateway.validate`; this module builds the
responses. `OutputStream` follows one task's output stream (docs/protocol.md, step 3)
and turns each message into a `GenerateResponse`, or raises `TaskEnded` for an
end with status failed/rejected; `status_for_reason` maps a
failure reason's prefix to the status the client gets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import grpc

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2
from lemix.infra.store.codec import get_bool, get_int, get_optional_float
from lemix.infra.store.messages import (
    ACCURACY_FIELD,
    LOSS_FIELD,
    NODE_FIELD,
    NUM_TOKENS_FIELD,
    TYPE_FIELD,
    VERSION_FIELD,
    OutputType,
)
from lemix.infra.store.task_hash import (
    IS_FINAL_FIELD,
    REASON_FIELD,
    STATUS_FIELD,
    StoredStatus,
)
from lemix.model.tokenizer import detokenize_new
from lemix.outputs import (
    FINISH_LENGTH,
    FINISH_REASON_FIELD,
    FINISH_REASONS,
    FINISH_STOP,
    LOGPROBS_FIELD,
    PROMPT_LOGPROBS_FIELD,
    TOKEN_IDS_FIELD,
    parse_logprobs,
    parse_token_ids,
)
from lemix.reasons import ReasonCode, reason_code
from lemix.tokenizer import Tokenizer, emulated_token_id

# Output-stream message fields: `lemix.infra.store.messages` (docs/protocol.md,
# "Flow of one inference request"). Optional, from a real model (lemix.outputs):
# TOKEN_IDS_FIELD on token/end messages, FINISH_REASON_FIELD (FINISH_LENGTH |
# FINISH_STOP) on the end message.

# Failure-reason codes a client may see as their status (docs/protocol.md,
# "Task ids and reasons"); any other reason, FAILED_PRECONDITION included, is
# INTERNAL.
_CLIENT_CODES: dict[ReasonCode, grpc.StatusCode] = {
    code: grpc.StatusCode[code.value]
    for code in (
        ReasonCode.INVALID_ARGUMENT,
        ReasonCode.RESOURCE_EXHAUSTED,
        ReasonCode.UNAVAILABLE,
        ReasonCode.CANCELLED,
        ReasonCode.DEADLINE_EXCEEDED,
    )
}


class TaskEnded(Exception):
    """A task ended failed or rejected; abort the client's call with `code`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def status_for_reason(reason: str) -> tuple[grpc.StatusCode, str]:
    """(status, details) for a failure reason ``"<STATUS_NAME>: text"``.

    A known prefix gives its status and the text after it; no (or an unknown)
    prefix gives INTERNAL and the whole reason.
    """
    found = reason_code(reason)
    code = None if found is None else _CLIENT_CODES.get(found)
    if code is None:
        return grpc.StatusCode.INTERNAL, reason or "the task failed without a reason"
    return code, reason.partition(":")[2].strip() or code.name


class OutputStream:
    """Turns one task's output messages into `GenerateResponse`s.

    `received_s` is when the gateway received the request, on `clock`
    (monotonic): TTFT and E2E are measured from it. Token messages carry the
    count so far, so a message may stand for several tokens (or none, if
    redelivered). A message from a real model lists the ids it adds (`ids`);
    without them each new token gets `emulated_token_id(position)`, because the
    emulated backend produces counts, not ids. With a real `tokenizer` (not
    `is_emulated`) responses carry the new text, detokenized as it streams.
    """

    def __init__(
        self,
        task_id: str,
        max_tokens: int,
        received_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.task_id = task_id
        self.max_tokens = max_tokens
        self.received_s = received_s
        self._clock = clock
        self._tokenizer = None if tokenizer is None or tokenizer.is_emulated else tokenizer
        self._ids: list[int] = []  # every output id so far, for detokenizing (real only)
        self._num_detokenized = 0  # leading ids of _ids whose text was sent
        self.num_tokens = 0
        self.node_id = 0
        self.weight_version = 0
        self.is_ended = False

    def on_message(self, fields: Mapping[str, str]) -> gateway_pb2.GenerateResponse | None:
        """The response for one message; None when it adds nothing to send.

        Raises `TaskEnded` for an end message with a status other than completed.
        """
        if fields.get(TYPE_FIELD) == OutputType.END or get_bool(fields, IS_FINAL_FIELD):
            return self._on_end(fields)
        if fields.get(TYPE_FIELD) != OutputType.TOKEN:
            return None  # a message type this gateway does not know: skip it
        response = self._new_tokens(fields)
        return response if response.token_ids else None

    def _new_tokens(self, fields: Mapping[str, str]) -> gateway_pb2.GenerateResponse:
        num_tokens = get_int(fields, NUM_TOKENS_FIELD)
        response = gateway_pb2.GenerateResponse(request_id=self.task_id)
        if num_tokens <= self.num_tokens:
            return response
        if NODE_FIELD in fields:
            self.node_id = get_int(fields, NODE_FIELD)
        if VERSION_FIELD in fields:
            self.weight_version = get_int(fields, VERSION_FIELD)
        if self.num_tokens == 0:
            response.ttft_s = self._clock() - self.received_s
        new_ids = self._new_ids(fields, num_tokens - self.num_tokens)
        response.token_ids.extend(new_ids)
        if LOGPROBS_FIELD in fields:
            response.logprobs.extend(self._new_logprobs(fields[LOGPROBS_FIELD], len(new_ids)))
        if self.num_tokens == 0 and PROMPT_LOGPROBS_FIELD in fields:
            entries = self._new_logprobs(fields[PROMPT_LOGPROBS_FIELD], 0, take_all=True)
            response.prompt_logprobs.extend(entries)
        if self._tokenizer is not None:
            self._ids.extend(new_ids)
            response.text = self._new_text(self._tokenizer, is_final=False)
        response.num_output_tokens = num_tokens
        response.node_id = self.node_id
        self.num_tokens = num_tokens
        return response

    def _new_ids(self, fields: Mapping[str, str], num_new: int) -> list[int]:
        """Ids of the last `num_new` tokens: the message's `ids` (which cover its
        last positions up to `n`, possibly some already sent), else emulated."""
        if TOKEN_IDS_FIELD not in fields:
            return [emulated_token_id(i) for i in range(self.num_tokens, self.num_tokens + num_new)]
        try:
            ids = parse_token_ids(fields[TOKEN_IDS_FIELD])
        except ValueError as e:
            raise TaskEnded(grpc.StatusCode.INTERNAL, f"output of {self.task_id}: {e}") from e
        if len(ids) < num_new:  # the stream lost a message: the text would have a hole
            raise TaskEnded(
                grpc.StatusCode.INTERNAL,
                f"output of {self.task_id} skipped tokens: a message adds {num_new} "
                f"tokens but carries {len(ids)} ids",
            )
        return list(ids[len(ids) - num_new :])

    def _new_logprobs(
        self, text: str, num_new: int, *, take_all: bool = False
    ) -> list[gateway_pb2.TokenLogprob]:
        """The last `num_new` entries of a `LOGPROBS_FIELD` (aligned with `ids`),
        or all of them (`take_all`: the prompt's)."""
        try:
            entries = parse_logprobs(text)
        except ValueError as e:
            raise TaskEnded(grpc.StatusCode.INTERNAL, f"output of {self.task_id}: {e}") from e
        if len(entries) < num_new:
            raise TaskEnded(
                grpc.StatusCode.INTERNAL,
                f"output of {self.task_id}: {num_new} new tokens but {len(entries)} logprobs",
            )
        return [
            gateway_pb2.TokenLogprob(
                logprob=e.logprob,
                top=[gateway_pb2.TopLogprob(token_id=i, logprob=lp) for i, lp in e.top],
            )
            for e in (entries if take_all else entries[len(entries) - num_new :])
        ]

    def _new_text(self, tokenizer: Tokenizer, *, is_final: bool) -> str:
        text, self._num_detokenized = detokenize_new(
            tokenizer, self._ids, self._num_detokenized, is_final=is_final
        )
        return text

    def _on_end(self, fields: Mapping[str, str]) -> gateway_pb2.GenerateResponse:
        self.is_ended = True
        status = fields.get(STATUS_FIELD, "")
        if status != StoredStatus.COMPLETED:
            reason = fields.get(REASON_FIELD, "") or f"task ended with status {status!r}"
            raise TaskEnded(*status_for_reason(reason))
        response = self._new_tokens(fields)  # tokens the end carries beyond the last message
        if self._tokenizer is not None:  # flush text held back for an unfinished character
            response.text += self._new_text(self._tokenizer, is_final=True)
        response.is_finished = True
        finish_reason = fields.get(FINISH_REASON_FIELD, "")
        if finish_reason not in FINISH_REASONS:  # not sent (emulated): infer it
            is_full = self.num_tokens >= self.max_tokens
            finish_reason = FINISH_LENGTH if is_full else FINISH_STOP
        response.finish_reason = finish_reason
        response.e2e_s = self._clock() - self.received_s
        response.num_output_tokens = self.num_tokens
        response.node_id = self.node_id
        response.weight_version = self.weight_version
        loss = get_optional_float(fields, LOSS_FIELD)
        if loss is not None:
            response.inference_loss = loss
        accuracy = get_optional_float(fields, ACCURACY_FIELD)
        if accuracy is not None:
            response.reference_accuracy = accuracy
        return response


# -------------------------------------------------------------------- stats

# Stats fields read from the Redis counter of the same name (`Store.get_stats`).
# The gateway increments num_inference/num_training when Submit acks; the
# others are counted by whoever ends tasks (the scheduler, from completions).
COUNTER_FIELDS = (
    "num_inference",
    "num_training",
    "num_completed_inference",
    "num_completed_training",
    "num_rejected",
    "num_failed",
    "num_deferred_training",
)


def merge_responses(
    first: gateway_pb2.GenerateResponse, then: gateway_pb2.GenerateResponse
) -> gateway_pb2.GenerateResponse:
    """One response for two consecutive ones of a stream (`first` updated):
    tokens, logprobs and text appended; counts, the node and the end's
    fields from `then`; `first`'s TTFT kept (a later message has none)."""
    text = first.text + then.text
    first.MergeFrom(then)  # repeated fields append; set scalars of `then` win
    first.text = text
    return first


def stats_to_proto(
    counters: Mapping[str, int],
    nodes: Sequence[common_pb2.NodeState],
    num_in_flight: int,
) -> gateway_pb2.Stats:
    """`Stats` from the Redis counters, the live nodes and this gateway's streams."""
    stats = gateway_pb2.Stats(num_in_flight=num_in_flight, nodes=list(nodes))
    for name in COUNTER_FIELDS:
        setattr(stats, name, max(0, counters.get(name, 0)))
    return stats
