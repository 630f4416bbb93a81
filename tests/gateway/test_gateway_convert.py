"""gateway.convert: output messages -> responses, reasons -> status codes."""

from __future__ import annotations

import grpc
import pytest

from gateway.convert import (
    OutputStream,
    TaskEnded,
    merge_responses,
    stats_to_proto,
    status_for_reason,
)
from lemix._proto.lemix.v1 import gateway_pb2
from lemix.infra.store.heartbeat import node_state_from_heartbeat
from lemix.model.tokenizer import BPETokenizer, corpus_fingerprint, train_bpe
from lemix.outputs import format_token_ids, parse_token_ids
from lemix.tokenizer import ApproxTokenizer, emulated_token_id


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.parametrize(
    ("reason", "code", "details"),
    [
        ("RESOURCE_EXHAUSTED: KV never fits", grpc.StatusCode.RESOURCE_EXHAUSTED, "KV never fits"),
        ("UNAVAILABLE: no live executor", grpc.StatusCode.UNAVAILABLE, "no live executor"),
        ("CANCELLED: client went away", grpc.StatusCode.CANCELLED, "client went away"),
        ("DEADLINE_EXCEEDED: too slow", grpc.StatusCode.DEADLINE_EXCEEDED, "too slow"),
        ("INVALID_ARGUMENT: bad", grpc.StatusCode.INVALID_ARGUMENT, "bad"),
        ("NOT_A_CODE: x", grpc.StatusCode.INTERNAL, "NOT_A_CODE: x"),
        ("segfault in stage 2", grpc.StatusCode.INTERNAL, "segfault in stage 2"),
        ("", grpc.StatusCode.INTERNAL, "the task failed without a reason"),
    ],
)
def test_status_for_reason(reason: str, code: grpc.StatusCode, details: str) -> None:
    assert status_for_reason(reason) == (code, details)


def test_stream_turns_counts_into_tokens_and_times_from_receipt() -> None:
    clock = FakeClock()
    stream = OutputStream("inf-1", max_tokens=5, received_s=99.5, clock=clock)
    first = stream.on_message(
        {"type": "token", "n": "1", "first": "1", "node": "4", "version": "9", "t": "1.0"}
    )
    assert first is not None and first.ttft_s == 0.5 and first.node_id == 4
    assert list(first.token_ids) == [emulated_token_id(0)]
    clock.now_s = 101.0
    batch = stream.on_message({"type": "token", "n": "3", "node": "4"})  # two tokens at once
    assert batch is not None and list(batch.token_ids) == [
        emulated_token_id(1),
        emulated_token_id(2),
    ]
    assert batch.ttft_s == 0 and batch.num_output_tokens == 3
    assert stream.on_message({"type": "token", "n": "3"}) is None  # redelivered: nothing new
    assert stream.on_message({"type": "progress"}) is None  # unknown type: skipped
    clock.now_s = 102.0
    final = stream.on_message(
        {
            "type": "end",
            "status": "completed",
            "reason": "",
            "n": "5",
            "node": "4",
            "is_final": "1",
            "inference_loss": "1.25",
            "reference_accuracy": "0.375",
        }
    )
    assert final is not None and stream.is_ended
    assert list(final.token_ids) == [emulated_token_id(3), emulated_token_id(4)]
    assert final.is_finished and final.finish_reason == "length" and final.e2e_s == 2.5
    assert (final.num_output_tokens, final.node_id, final.weight_version) == (5, 4, 9)
    assert final.inference_loss == 1.25 and final.reference_accuracy == 0.375


def test_completed_short_of_max_tokens_is_stop() -> None:
    stream = OutputStream("inf-1", max_tokens=5, received_s=0.0, clock=FakeClock())
    final = stream.on_message({"type": "end", "status": "completed", "n": "2", "is_final": "1"})
    assert final is not None and final.finish_reason == "stop" and final.num_output_tokens == 2


def test_failed_end_raises_task_ended() -> None:
    stream = OutputStream("inf-1", max_tokens=5, received_s=0.0, clock=FakeClock())
    with pytest.raises(TaskEnded) as info:
        stream.on_message(
            {
                "type": "end",
                "status": "rejected",
                "is_final": "1",
                "reason": "RESOURCE_EXHAUSTED: KV never fits",
            }
        )
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details == "KV never fits" and stream.is_ended


def test_node_state_and_stats() -> None:
    node = node_state_from_heartbeat(
        3,
        {
            "address": "h:1",
            "num_running": "2",
            "is_healthy": "0",
            "busy_fraction": "0.5",
            "unknown": "x",
        },
    )
    assert (node.node_id, node.address, node.num_running, node.is_healthy) == (3, "h:1", 2, False)
    with pytest.raises(ValueError):
        node_state_from_heartbeat(3, {"num_running": "many"})
    stats = stats_to_proto({"num_inference": 4, "num_failed": 1, "other": 9}, [node], 2)
    assert (stats.num_inference, stats.num_failed, stats.num_in_flight) == (4, 1, 2)
    assert stats.num_training == 0 and len(stats.nodes) == 1


# ------------------------------------------------------- real ids and text


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> BPETokenizer:
    texts = ["Crème brûlée, naïve café. 日本語のテキスト。🎉 Hello world!"] * 10
    return train_bpe(
        lambda: texts,
        vocab_size=300,
        corpus_id=corpus_fingerprint(texts),
        cache_dir=tmp_path_factory.mktemp("tokenizers"),
    )


def _token(n: int, ids: list[int]) -> dict[str, str]:
    return {"type": "token", "n": str(n), "ids": format_token_ids(ids)}


def test_stream_sends_real_ids_and_their_text(bpe: BPETokenizer) -> None:
    text = "café 🎉 日本"
    ids = bpe.encode(text)
    assert len(ids) >= 6
    stream = OutputStream(
        "inf-1", max_tokens=len(ids), received_s=0.0, clock=FakeClock(), tokenizer=bpe
    )
    responses = [stream.on_message(_token(n, ids[n - 1 : n])) for n in range(1, len(ids))]
    # The last message redelivers two ids it already sent, and the end adds nothing.
    responses.append(stream.on_message(_token(len(ids), ids[-3:])))
    assert stream.on_message(_token(len(ids), ids[-1:])) is None  # redelivered
    final = stream.on_message(
        {
            "type": "end",
            "status": "completed",
            "n": str(len(ids)),
            "finish_reason": "stop",
            "inference_loss": "0.5",
        }
    )
    sent = [r for r in responses if r is not None]
    assert [i for r in sent for i in r.token_ids] == ids
    assert "".join(r.text for r in sent) == text  # whole characters only, in order
    assert all("\ufffd" not in r.text for r in sent)
    assert final is not None and final.finish_reason == "stop"  # as sent, though n == max
    assert final.inference_loss == 0.5 and not final.token_ids


def test_end_flushes_held_back_text_and_its_ids(bpe: BPETokenizer) -> None:
    ids = bpe.encode("🎉")
    assert len(ids) > 1
    stream = OutputStream("inf-1", max_tokens=9, received_s=0.0, clock=FakeClock(), tokenizer=bpe)
    first = stream.on_message(_token(1, ids[:1]))
    assert first is not None and first.text == ""  # half a character: held back
    final = stream.on_message(
        {"type": "end", "status": "completed", "n": str(len(ids)), "ids": format_token_ids(ids[1:])}
    )
    assert final is not None and final.text == "🎉" and list(final.token_ids) == ids[1:]
    assert final.finish_reason == "stop"  # inferred: short of max_tokens


def test_ids_without_a_real_tokenizer_have_no_text() -> None:
    stream = OutputStream(
        "inf-1", max_tokens=2, received_s=0.0, clock=FakeClock(), tokenizer=ApproxTokenizer()
    )
    response = stream.on_message(_token(2, [7, 8]))
    assert response is not None and list(response.token_ids) == [7, 8] and response.text == ""
    final = stream.on_message(
        {"type": "end", "status": "completed", "n": "2", "finish_reason": "bogus"}
    )
    assert final is not None and final.finish_reason == "length"  # unknown: inferred


@pytest.mark.parametrize("ids", ["5", "5,x", "5,-1"])
def test_missing_or_malformed_ids_end_the_stream(ids: str) -> None:
    stream = OutputStream("inf-1", max_tokens=5, received_s=0.0, clock=FakeClock())
    with pytest.raises(TaskEnded) as info:
        stream.on_message({"type": "token", "n": "2", "ids": ids})
    assert info.value.code is grpc.StatusCode.INTERNAL and not stream.is_ended


def test_token_ids_field_round_trips() -> None:
    assert format_token_ids([15, 0, 2046]) == "15,0,2046"
    assert parse_token_ids("15,0,2046") == (15, 0, 2046) and parse_token_ids("") == ()


def test_merged_responses_read_as_the_two_in_a_row() -> None:
    first = gateway_pb2.GenerateResponse(
        request_id="r",
        token_ids=[5, 6],
        text="ab",
        ttft_s=0.2,
        node_id=1,
        num_output_tokens=2,
        logprobs=[gateway_pb2.TokenLogprob(logprob=-0.5), gateway_pb2.TokenLogprob(logprob=-1)],
    )
    end = gateway_pb2.GenerateResponse(
        request_id="r",
        token_ids=[7],
        text="c",
        node_id=1,
        num_output_tokens=3,
        logprobs=[gateway_pb2.TokenLogprob(logprob=-2)],
        is_finished=True,
        finish_reason="length",
        e2e_s=0.9,
    )
    merged = merge_responses(first, end)
    assert list(merged.token_ids) == [5, 6, 7] and merged.text == "abc"
    assert [lp.logprob for lp in merged.logprobs] == [-0.5, -1, -2]
    assert (merged.ttft_s, merged.e2e_s, merged.num_output_tokens) == (0.2, 0.9, 3)
    assert merged.is_finished and merged.finish_reason == "length"
