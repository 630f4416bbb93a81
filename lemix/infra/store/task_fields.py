"""A task as Redis fields (strings), both ways: the intake's and the task
state hash's wire format.

`task_to_fields` is what a submitter writes (the gateway, or the scheduler's
own Submit RPC), `task_from_fields` what the scheduler's intake loop and its
restart recovery read. One pair in one module below both, so the two sides
cannot drift.

Task fields (all strings, numbers via `lemix.infra.store.codec.encode_value`):

=====================  ===========================================================
field                  value
=====================  ===========================================================
``task_id``            the id (gateway-chosen; the dedupe key)
``kind``               ``inference`` | ``training``
``arrival_s``          as submitted (the intake replaces it with scheduler time)
``num_prompt_tokens``  int
``max_output_tokens``  int
``batch_size``         int
``seq``                int, arrival order
``prompt_token_ids``   comma-separated ints ("" for the emulated backend)
``reference_token_ids`` comma-separated ints
``sample_lengths``     comma-separated ints (multi-sample training; "" otherwise)
``reference_lengths``  comma-separated ints
``temperature``        float (repr, exact)
``top_p``              float
``ignore_eos``         ``1`` | ``0``
``seed``               int
``top_logprobs``       int, only when the request asked for logprobs (absent: -1, none)
``prompt_logprobs``    int, only when it asked for the prompt's (absent: -1, none)
``top_k`` ... ``min_tokens``  vLLM's filters/penalties (``top_k``, ``min_p``,
                       ``presence_penalty``, ``frequency_penalty``,
                       ``repetition_penalty``, ``min_tokens``), each only when
                       not off (absent: the TaskPayload default)
``stop_token_ids``     comma-separated ints, only when given
``submit_t``           wall-clock epoch seconds when Submit stored it
=====================  ===========================================================
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from lemix.infra.store.codec import FieldValue, get_bool, get_float, get_int
from lemix.infra.store.task_hash import SUBMIT_T_FIELD, TASK_ID_FIELD
from lemix.types import Task, TaskKind, TaskPayload


def _ids_to_text(ids: tuple[int, ...]) -> str:
    return ",".join(str(i) for i in ids)


def _ids_from_text(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",")) if text else ()


def task_to_fields(
    task: Task, payload: TaskPayload, *, submit_t: float | None = None
) -> dict[str, FieldValue]:
    """A task and its payload as intake/state-hash fields (see the module table)."""
    fields: dict[str, FieldValue] = {
        TASK_ID_FIELD: task.task_id,
        "kind": task.kind.value,
        "arrival_s": task.arrival_s,
        "num_prompt_tokens": task.num_prompt_tokens,
        "max_output_tokens": task.max_output_tokens,
        "batch_size": task.batch_size,
        "seq": task.seq,
        "prompt_token_ids": _ids_to_text(payload.prompt_token_ids),
        "reference_token_ids": _ids_to_text(payload.reference_token_ids),
        "sample_lengths": _ids_to_text(payload.sample_lengths),
        "reference_lengths": _ids_to_text(payload.reference_lengths),
        "temperature": payload.temperature,
        "top_p": payload.top_p,
        "ignore_eos": payload.ignore_eos,
        "seed": payload.seed,
        SUBMIT_T_FIELD: time.time() if submit_t is None else submit_t,
    }
    if payload.top_logprobs >= 0:  # absent otherwise: older records stay as they were
        fields["top_logprobs"] = payload.top_logprobs
    if payload.prompt_logprobs >= 0:
        fields["prompt_logprobs"] = payload.prompt_logprobs
    for name, off in _PENALTY_DEFAULTS.items():
        if getattr(payload, name) != off:
            fields[name] = getattr(payload, name)
    if payload.stop_token_ids:
        fields["stop_token_ids"] = _ids_to_text(payload.stop_token_ids)
    return fields


# Sampling fields written only when not off (older records stay as they were).
_PENALTY_DEFAULTS: dict[str, int | float] = {
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
}


def task_from_fields(
    fields: Mapping[str, str], *, arrival_s: float | None = None
) -> tuple[Task, TaskPayload]:
    """Fields -> (task, payload); `arrival_s` replaces the stored arrival.

    Raises `ValueError` (or `KeyError` for a missing ``task_id``/``kind``) on
    fields no Submit could have written.
    """
    task = Task(
        task_id=fields[TASK_ID_FIELD],
        kind=TaskKind(fields["kind"]),
        arrival_s=get_float(fields, "arrival_s") if arrival_s is None else arrival_s,
        num_prompt_tokens=get_int(fields, "num_prompt_tokens"),
        max_output_tokens=get_int(fields, "max_output_tokens"),
        batch_size=get_int(fields, "batch_size", 1),
        seq=get_int(fields, "seq"),
    )
    payload = TaskPayload(
        prompt_token_ids=_ids_from_text(fields.get("prompt_token_ids", "")),
        reference_token_ids=_ids_from_text(fields.get("reference_token_ids", "")),
        sample_lengths=_ids_from_text(fields.get("sample_lengths", "")),
        reference_lengths=_ids_from_text(fields.get("reference_lengths", "")),
        temperature=get_float(fields, "temperature"),
        top_p=get_float(fields, "top_p", 1.0),
        ignore_eos=get_bool(fields, "ignore_eos"),
        seed=get_int(fields, "seed"),
        top_logprobs=get_int(fields, "top_logprobs", -1),
        prompt_logprobs=get_int(fields, "prompt_logprobs", -1),
        top_k=get_int(fields, "top_k", 0),
        min_p=get_float(fields, "min_p", 0.0),
        presence_penalty=get_float(fields, "presence_penalty", 0.0),
        frequency_penalty=get_float(fields, "frequency_penalty", 0.0),
        repetition_penalty=get_float(fields, "repetition_penalty", 1.0),
        min_tokens=get_int(fields, "min_tokens", 0),
        stop_token_ids=_ids_from_text(fields.get("stop_token_ids", "")),
    )
    return task, payload
