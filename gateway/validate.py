"""Pure validation of the public requests: protobuf in, domain tasks out.

Every check raises `lemix.infra.rpc.errors.InvalidArgument` with a message that says
what to change; the servicer's `@handle_errors` turns it into
INVALID_ARGUMENT. No I/O here: the tokenizer and the limits are arguments.

Ids: a task is named by the client's `request_id` (its idempotency key) or
``inf-<12 hex>`` / ``trn-<12 hex>`` (docs/protocol.md). Training tasks whose samples
all carry a `sample_id` get an id derived from them, so resubmitting the same
batch is idempotent too.

proto3 cannot tell unset from zero: `max_tokens` 0 means "the rest of the
context" (the context limit less the prompt, as OpenAI's and vLLM's default),
`batch_size` 0 means 1, `sampling.top_p` 0 means off (1.0), as in
`lemix.infra.rpc.convert`, and `sampling.seed` 0 means "none given".

Unseeded sampling is not deterministic: a sampled request (temperature > 0)
without a seed gets one of 63 bits, recorded in its payload (so the task's
record says which seed produced its text). A task named by a `request_id` gets
its seed from a hash of its task id, not the RNG: the idempotency check
(`lemix.infra.store.intake.request_hash`) covers the seed, so a retry must carry
the same one. A client that wants one text every time passes its own seed.
Greedy requests (temperature 0) ignore the seed and keep 0.

Degenerate sampling values are refused here, not in the middle of a batch:
`temperature` is 0 (greedy) or in [`MIN_TEMPERATURE`, `MAX_TEMPERATURE`]
(sampling divides the logits by it: below 0.01 a logit of 100 becomes 1e4 and
past it fp16 overflows to inf, so the softmax turns to NaN; vLLM clamps at the
same 0.01); `top_p` is in (0, 1]; every number is finite.

Client scope: two clients' `request_id`s must not meet. `client_scope` names
the caller (a hash of its API key, and of the client id it sends); a scoped
request's task id is ``<request_id>@<scope>`` (`scoped_task_id`), an
anonymous one's is the `request_id` itself. Without authentication the
scope is only as good as what clients send: it keeps honest clients apart,
it does not stop one from naming another's scope.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from lemix._proto.lemix.v1 import common_pb2, gateway_pb2
from lemix.infra.rpc.errors import InvalidArgument
from lemix.outputs import MAX_TOP_LOGPROBS
from lemix.tokenizer import Tokenizer, encode_prompt
from lemix.types import Task, TaskKind, TaskPayload

INFERENCE_ID_PREFIX = "inf-"
TRAINING_ID_PREFIX = "trn-"
MAX_REQUEST_ID_CHARS = 128
_ID_HEX_CHARS = 12
MIN_TEMPERATURE = 0.01  # below it (and above 0) logits/temperature overflow; see above
MAX_TEMPERATURE = 100.0  # past it sampling is uniform noise: surely a mistake
# Limits of one Train call (`GatewayConfig.max_train_samples`, `max_train_batch_size`).
DEFAULT_MAX_TRAIN_SAMPLES = 1024
DEFAULT_MAX_TRAIN_BATCH_SIZE = 256
ANONYMOUS_SCOPE = ""  # a caller that sent neither an API key nor a client id
SCOPE_SEPARATOR = "@"
AUTHORIZATION_HEADER = "authorization"
CLIENT_ID_HEADER = "x-client-id"
SEED_BITS = 63  # a drawn seed fits a signed 64-bit int too (torch's manual_seed)


def client_scope(*, api_key: str = "", client_id: str = "") -> str:
    """The caller's scope: `ANONYMOUS_SCOPE`, or 12 hex chars of a hash of its
    API key (never the key itself) and client id."""
    if not api_key and not client_id:
        return ANONYMOUS_SCOPE
    if client_id:
        _check_id("the x-client-id header", client_id)
    text = f"key:{api_key}\nclient:{client_id}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:_ID_HEX_CHARS]


def scope_from_headers(headers: Mapping[str, str]) -> str:
    """`client_scope` from request headers / gRPC metadata (lower-case names,
    or a case-insensitive mapping): ``authorization: Bearer <key>`` and
    ``x-client-id``."""
    scheme, _, api_key = (headers.get(AUTHORIZATION_HEADER) or "").partition(" ")
    return client_scope(
        api_key=api_key.strip() if scheme.lower() == "bearer" else "",
        client_id=(headers.get(CLIENT_ID_HEADER) or "").strip(),
    )


def scoped_task_id(request_id: str, scope: str) -> str:
    """The task id of a client's `request_id` within its `scope`."""
    return f"{request_id}{SCOPE_SEPARATOR}{scope}" if scope else request_id


def new_task_id(kind: TaskKind) -> str:
    """A fresh ``inf-<12 hex>`` / ``trn-<12 hex>`` id."""
    prefix = INFERENCE_ID_PREFIX if kind is TaskKind.INFERENCE else TRAINING_ID_PREFIX
    return prefix + uuid.uuid4().hex[:_ID_HEX_CHARS]


def _check_id(what: str, value: str) -> str:
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"{what} is {len(value)} characters; the limit is {MAX_REQUEST_ID_CHARS}"
        )
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise InvalidArgument(
            f"{what} must not contain whitespace or control characters: {value!r}"
        )
    return value


def _sampling(msg: common_pb2.SamplingParams) -> tuple[float, float]:
    """(temperature, top_p) of a request, checked."""
    temperature = msg.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(
            f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(
            f"sampling.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
            f"{MAX_TEMPERATURE:g}], got {temperature:g}: for near-greedy output use 0"
        )
    top_p = msg.top_p
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1] (0 or 1 = off), got {top_p}")
    return temperature, top_p or 1.0


# vLLM's ranges for the penalties; repetition_penalty has no upper bound there
# (a huge one forbids repeats), only this sanity cap.
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 1e6
MAX_STOP_TOKEN_IDS = 16


def _penalties(msg: common_pb2.SamplingParams, max_tokens: int) -> dict[str, Any]:
    """The filters/penalties of a request as TaskPayload fields, checked
    (ranges: protos/lemix/v1/common.proto SamplingParams)."""
    min_p = msg.min_p
    if not math.isfinite(min_p) or not 0 <= min_p <= 1:
        raise InvalidArgument(f"sampling.min_p must be in [0, 1] (0 = off), got {min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(msg, name)
        if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidArgument(
                f"sampling.{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), "
                f"got {value}"
            )
    repetition = msg.repetition_penalty
    if not math.isfinite(repetition) or not 0 <= repetition <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(
            f"sampling.repetition_penalty must be > 0 and <= {MAX_REPETITION_PENALTY:g} "
            f"(1 = off; 0 = unset, read as 1), got {repetition}"
        )
    if msg.min_tokens > max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens ({msg.min_tokens}) must be <= max_tokens ({max_tokens})"
        )
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            f"sampling.stop_token_ids may list at most {MAX_STOP_TOKEN_IDS} ids, "
            f"got {len(msg.stop_token_ids)}"
        )
    return {
        "top_k": msg.top_k,
        "min_p": min_p,
        "presence_penalty": msg.presence_penalty,
        "frequency_penalty": msg.frequency_penalty,
        "repetition_penalty": repetition or 1.0,
        "min_tokens": msg.min_tokens,
        "stop_token_ids": tuple(msg.stop_token_ids),
    }


def draw_seed(task_id: str, *, is_named: bool) -> int:
    """A seed for an unseeded sampled request (module doc): random, or derived
    from `task_id` when the client named the task (`is_named`). Never 0 ("none")."""
    if is_named:
        digest = hashlib.sha256(f"seed:{task_id}".encode()).digest()
        seed = int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
    else:
        seed = secrets.randbits(SEED_BITS)
    return seed or 1


def check_token_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
    """InvalidArgument naming the first id of `ids` outside [0, `vocab_size`)
    (0 = the vocabulary is unknown: nothing to check)."""
    if not vocab_size:
        return
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise InvalidArgument(
                f"{where}[{i}] = {token_id} is not a token of the served model: its "
                f"vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1}); "
                "tokenize with the model's tokenizer (POST /tokenize)"
            )


def _text_ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """Ids to send with a task: none for the emulated backend (they mean nothing)."""
    return () if tokenizer.is_emulated or not text else tuple(tokenizer.encode(text))


# ---------------------------------------------------------------- inference


def validate_generate(
    request: gateway_pb2.GenerateRequest,
    *,
    tokenizer: Tokenizer,
    max_context_tokens: int,
    vocab_size: int = 0,
    scope: str = ANONYMOUS_SCOPE,
) -> tuple[Task, TaskPayload]:
    """A `GenerateRequest` as the inference `Task` (arrival_s 0: the scheduler
    stamps it on intake) and its `TaskPayload`; raises `InvalidArgument`.
    A `request_id` names the task within the caller's `scope`.

    `max_context_tokens` is the served model's context limit (prompt +
    max_tokens), `vocab_size` its vocabulary (0 = unknown), as the gateway
    knows them (`gateway.model_limits`)."""
    has_text, has_ids = bool(request.prompt), bool(request.prompt_token_ids)
    if not has_text and not has_ids:
        raise InvalidArgument("prompt is empty: send prompt text or prompt_token_ids")
    if has_text and has_ids:
        raise InvalidArgument("send prompt text or prompt_token_ids, not both")
    temperature, top_p = _sampling(request.sampling)
    task_id = (
        scoped_task_id(_check_id("request_id", request.request_id), scope)
        if request.request_id
        else new_task_id(TaskKind.INFERENCE)
    )

    if has_ids:
        prompt_ids: tuple[int, ...] = tuple(request.prompt_token_ids)
        num_prompt_tokens = len(prompt_ids)
    else:
        encoded = encode_prompt(tokenizer, request.prompt)  # BOS first for a real model
        num_prompt_tokens = len(encoded)
        prompt_ids = () if tokenizer.is_emulated else tuple(encoded)
    # Text tokenized here is checked too: a gateway tokenizer that is not the
    # model's (a bigger vocabulary) would otherwise fail on the executor.
    check_token_ids(prompt_ids, vocab_size, "prompt_token_ids" if has_ids else "the prompt's ids")
    max_tokens = request.max_tokens or max_context_tokens - num_prompt_tokens
    if max_tokens <= 0:  # only a defaulted max_tokens gets here
        raise InvalidArgument(
            f"the prompt ({num_prompt_tokens} tokens) fills the context limit of "
            f"{max_context_tokens} tokens, leaving no room for output; shorten the prompt"
        )
    num_total = num_prompt_tokens + max_tokens
    if num_total > max_context_tokens:
        raise InvalidArgument(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_total} tokens exceeds the context limit of {max_context_tokens} tokens "
            "(max_model_len: GET /v1/models); shorten the prompt or lower max_tokens"
        )
    top_logprobs = -1  # none asked for
    if request.sampling.HasField("top_logprobs"):
        top_logprobs = request.sampling.top_logprobs
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                f"sampling.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}"
            )
    prompt_logprobs = -1
    if request.sampling.HasField("prompt_logprobs"):
        prompt_logprobs = request.sampling.prompt_logprobs
        if prompt_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                f"sampling.prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                f"got {prompt_logprobs}"
            )
    penalties = _penalties(request.sampling, max_tokens)
    check_token_ids(penalties["stop_token_ids"], vocab_size, "sampling.stop_token_ids")
    seed = request.sampling.seed
    if not seed and temperature:
        seed = draw_seed(task_id, is_named=bool(request.request_id))

    task = Task(
        task_id=task_id,
        kind=TaskKind.INFERENCE,
        arrival_s=0.0,
        num_prompt_tokens=num_prompt_tokens,
        max_output_tokens=max_tokens,
    )
    payload = TaskPayload(
        prompt_token_ids=prompt_ids,
        reference_token_ids=_text_ids(tokenizer, request.reference),
        temperature=temperature,
        top_p=top_p,
        ignore_eos=request.sampling.ignore_eos,
        seed=seed,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        **penalties,
    )
    return task, payload


# ----------------------------------------------------------------- training


def _sample_tokens(
    index: int,
    sample: gateway_pb2.TrainSample,
    tokenizer: Tokenizer,
    max_context_tokens: int,
    vocab_size: int,
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(tokens in the sample, ids to send, reference ids to send) of one sample."""
    where = f"samples[{index}]"
    has_text = bool(sample.query or sample.reference)
    if sample.token_ids:
        if has_text:
            raise InvalidArgument(f"{where}: send query/reference text or token_ids, not both")
        num_tokens = len(sample.token_ids)
        if sample.num_reference_tokens > num_tokens:
            raise InvalidArgument(
                f"{where}: num_reference_tokens ({sample.num_reference_tokens}) exceeds "
                f"the sample's {num_tokens} token_ids"
            )
        ids = tuple(sample.token_ids)
        reference = ids[num_tokens - sample.num_reference_tokens :]
    elif has_text:
        query_ids = encode_prompt(tokenizer, sample.query)  # BOS first, as in inference
        reference_ids = tokenizer.encode(sample.reference)
        num_tokens = len(query_ids) + len(reference_ids)
        ids = () if tokenizer.is_emulated else (*query_ids, *reference_ids)
        reference = () if tokenizer.is_emulated else tuple(reference_ids)
    else:
        raise InvalidArgument(f"{where} is empty: send query and/or reference text, or token_ids")
    if num_tokens > max_context_tokens:
        raise InvalidArgument(
            f"{where} has {num_tokens} tokens; the context limit is {max_context_tokens} "
            "tokens: shorten or split it"
        )
    check_token_ids(ids, vocab_size, f"{where}.token_ids")
    return num_tokens, ids, reference


def _training_task_id(sample_ids: Sequence[str], scope: str) -> str:
    if all(sample_ids):
        # Anonymous ids hash the sample ids alone (as before scopes existed).
        text = "\n".join(sample_ids if not scope else (f"scope:{scope}", *sample_ids))
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return TRAINING_ID_PREFIX + digest[:_ID_HEX_CHARS]
    return new_task_id(TaskKind.TRAINING)


def _check_sample_ids(samples: Sequence[gateway_pb2.TrainSample]) -> None:
    seen: dict[str, int] = {}
    for i, sample in enumerate(samples):
        if not sample.sample_id:
            continue
        _check_id(f"samples[{i}].sample_id", sample.sample_id)
        if sample.sample_id in seen:
            raise InvalidArgument(
                f"samples[{i}].sample_id {sample.sample_id!r} repeats "
                f"samples[{seen[sample.sample_id]}]; sample ids must be unique"
            )
        seen[sample.sample_id] = i


def validate_train(
    request: gateway_pb2.TrainRequest,
    *,
    tokenizer: Tokenizer,
    max_context_tokens: int,
    max_samples: int = DEFAULT_MAX_TRAIN_SAMPLES,
    max_train_batch_size: int = DEFAULT_MAX_TRAIN_BATCH_SIZE,
    vocab_size: int = 0,
    scope: str = ANONYMOUS_SCOPE,
) -> list[tuple[Task, TaskPayload]]:
    """A `TrainRequest` as training tasks of `batch_size` samples each (the last
    may be smaller); raises `InvalidArgument`. At most `max_samples` samples
    per call and `max_train_batch_size` per task; sample-id-derived task ids are
    derived within the caller's `scope`.

    A task's `num_prompt_tokens` is its longest sample (the planner books
    memory as if samples were padded to it). A multi-sample task's ids travel
    back to back with per-sample lengths (`TaskPayload.sample_lengths`).
    """
    num_samples = len(request.samples)
    if not num_samples:
        raise InvalidArgument("no samples: send at least one TrainSample")
    if num_samples > max_samples:
        raise InvalidArgument(
            f"{num_samples} samples in one Train call; the limit (max_train_samples) is "
            f"{max_samples}: split them over several calls"
        )
    batch_size = request.batch_size or 1
    if batch_size > max_train_batch_size:
        raise InvalidArgument(
            f"batch_size {batch_size} exceeds the limit (max_train_batch_size) of "
            f"{max_train_batch_size} samples per training task: lower it"
        )
    samples = list(request.samples)
    _check_sample_ids(samples)
    sizes = [
        _sample_tokens(i, s, tokenizer, max_context_tokens, vocab_size)
        for i, s in enumerate(samples)
    ]

    tasks: list[tuple[Task, TaskPayload]] = []
    for start in range(0, len(samples), batch_size):
        batch = sizes[start : start + batch_size]
        task = Task(
            task_id=_training_task_id(
                [s.sample_id for s in samples[start : start + batch_size]], scope
            ),
            kind=TaskKind.TRAINING,
            arrival_s=0.0,
            num_prompt_tokens=max(num_tokens for num_tokens, _, _ in batch),
            batch_size=len(batch),
        )
        if len(batch) == 1:
            _, ids, reference = batch[0]
            payload = TaskPayload(prompt_token_ids=ids, reference_token_ids=reference)
        elif tokenizer.is_emulated:
            payload = TaskPayload()  # sizes are all the emulated backend needs
        else:  # samples back to back, each with its reference length
            payload = TaskPayload(
                prompt_token_ids=tuple(i for _, ids, _ in batch for i in ids),
                sample_lengths=tuple(len(ids) for _, ids, _ in batch),
                reference_lengths=tuple(len(reference) for _, _, reference in batch),
            )
        tasks.append((task, payload))
    return tasks
