"""The scheduler's planner events as Redis fields (strings), both ways (a task's
fields: `lemix.infra.store.task_fields`).

* Planner events in the events stream. An entry holds either one event, in
  the field ``json`` (the RecordingPlanner's event dict: it nests dicts, so a
  flat hash will not do), or several consecutive ones, in the field
  ``jsonl`` (one JSON object per line): the scheduler packs what one drain
  of its sink holds into one entry, so a request costs a fraction of an
  ``XADD`` instead of one per event. Snapshot events always stand alone
  (compaction trims the log before a snapshot's entry, recovery looks for it
  without parsing). `events_from_fields` reads both kinds.

A node's heartbeat hash has its own codec (`lemix.infra.store.heartbeat`),
shared with the gateway; the fields other services add to a task's state hash
are named in `lemix.infra.store.task_hash`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lemix.infra.store.codec import Entry, FieldValue
from lemix.planner.recording import Event

EVENT_FIELD = "json"  # an entry with one event
EVENTS_FIELD = "jsonl"  # an entry with several, one JSON object per line


# ------------------------------------------------------------------ events


def event_to_fields(event: Event) -> dict[str, FieldValue]:
    """A RecordingPlanner event as one stream entry. JSON floats round-trip
    exactly (repr), so a replay sees the very `now_s` the live planner saw."""
    return {EVENT_FIELD: json.dumps(event, separators=(",", ":"))}


def events_to_fields(events: Sequence[Event]) -> dict[str, FieldValue]:
    """Consecutive events as one stream entry (one event: `event_to_fields`).
    JSON text never holds a raw newline (json.dumps escapes it), so lines
    split back exactly."""
    if len(events) == 1:
        return event_to_fields(events[0])
    return {EVENTS_FIELD: "\n".join(json.dumps(e, separators=(",", ":")) for e in events)}


def event_from_fields(fields: Mapping[str, str]) -> Event:
    """The one event of an entry written by `event_to_fields`."""
    return _as_event(json.loads(fields[EVENT_FIELD]), fields[EVENT_FIELD])


def events_from_fields(fields: Mapping[str, str]) -> list[Event]:
    """The events of an entry of either kind, in order."""
    if EVENT_FIELD in fields:
        return [event_from_fields(fields)]
    if EVENTS_FIELD not in fields:
        raise ValueError(f"not an event entry: fields {sorted(fields)}")
    return [_as_event(json.loads(line), line) for line in fields[EVENTS_FIELD].split("\n")]


def events_from_entries(entries: Iterable[Entry]) -> list[Event]:
    """Every event of `entries` (the event log, oldest first), in order."""
    return [event for _, fields in entries for event in events_from_fields(fields)]


def _as_event(event: Any, text: str) -> Event:
    if not isinstance(event, dict):
        raise ValueError(f"event is not a JSON object: {text[:80]!r}")
    return event


def event_has_key(fields: Mapping[str, str], key: str) -> bool:
    """Whether the entry holds one event whose first key is `key`, without
    parsing it (a snapshot event is large; recovery looks for the last one;
    snapshots are never packed with other events)."""
    prefix = json.dumps({key: 0}, separators=(",", ":"))[:-2]  # '{"key":'
    return fields.get(EVENT_FIELD, "").startswith(prefix)
