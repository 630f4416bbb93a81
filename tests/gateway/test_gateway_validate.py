"""lemix.tokenizer and gateway.validate: pure functions, no servers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.service import load_tokenizer
from gateway.validate import (
    ANONYMOUS_SCOPE,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SEED_BITS,
    client_scope,
    draw_seed,
    scope_from_headers,
    scoped_task_id,
    validate_generate,
    validate_train,
)
from lemix._proto.lemix.v1 import common_pb2, gateway_pb2
from lemix.infra.rpc.errors import InvalidArgument
from lemix.model.tokenizer import train_bpe
from lemix.tokenizer import (
    APPROX_EOS_ID,
    APPROX_VOCAB_SIZE,
    ApproxTokenizer,
    emulated_token_id,
)
from lemix.types import Task, TaskKind, TaskPayload

TOKENIZER = ApproxTokenizer()

# ---------------------------------------------------------------- tokenizer


def test_approx_tokenizer_is_deterministic_about_four_bytes_per_token() -> None:
    assert TOKENIZER.encode("") == []
    assert len(TOKENIZER.encode("abcd")) == 1 and len(TOKENIZER.encode("abcde")) == 2
    assert len(TOKENIZER.encode("é" * 4)) == 2  # 8 UTF-8 bytes
    text = "The quick brown fox jumps over the lazy dog"
    ids = TOKENIZER.encode(text)
    assert ids == ApproxTokenizer().encode(text) and len(ids) == 11
    assert all(0 < i < APPROX_VOCAB_SIZE and i != APPROX_EOS_ID for i in ids)


def test_approx_decode_returns_placeholders() -> None:
    assert TOKENIZER.decode([5, 17]) == "<t5><t17>"
    assert TOKENIZER.eos_id == APPROX_EOS_ID and TOKENIZER.is_emulated


def test_emulated_token_ids_are_stable_per_position() -> None:
    ids = [emulated_token_id(i) for i in range(100)]
    assert ids == [emulated_token_id(i) for i in range(100)]
    assert len(set(ids)) > 90 and all(0 < i < APPROX_VOCAB_SIZE for i in ids)


def test_unknown_tokenizer_is_a_clear_error() -> None:
    assert isinstance(load_tokenizer("approx"), ApproxTokenizer)
    with pytest.raises(ValueError, match="expected 'approx'"):
        load_tokenizer("/models/llama")  # no such directory


# ---------------------------------------------------------------- inference


def _validate(request: gateway_pb2.GenerateRequest, limit: int = 4096) -> tuple[Task, TaskPayload]:
    return validate_generate(request, tokenizer=TOKENIZER, max_context_tokens=limit)


def test_generate_becomes_an_inference_task() -> None:
    task, payload = _validate(gateway_pb2.GenerateRequest(prompt="x" * 40, max_tokens=8))
    assert task.kind is TaskKind.INFERENCE and re.fullmatch(r"inf-[0-9a-f]{12}", task.task_id)
    assert (task.num_prompt_tokens, task.max_output_tokens) == (10, 8)
    assert payload.prompt_token_ids == () and payload.top_p == 1.0  # unset top_p = off


def test_context_limit_counts_prompt_plus_max_tokens() -> None:
    fits = gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 90, max_tokens=10)
    assert _validate(fits, limit=100)[0].num_total_tokens == 100
    over = gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 90, max_tokens=11)
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            "prompt (90 tokens) + max_tokens (11) = 101 tokens exceeds the context limit of 100"
        ),
    ):
        _validate(over, limit=100)


def test_max_tokens_0_means_the_rest_of_the_context() -> None:
    task, _ = _validate(gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 90), limit=100)
    assert (task.num_prompt_tokens, task.max_output_tokens) == (90, 10)
    task, _ = _validate(gateway_pb2.GenerateRequest(prompt="x" * 40))  # 10 approx tokens
    assert task.max_output_tokens == 4096 - 10
    task, _ = _validate(gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 99), limit=100)
    assert task.max_output_tokens == 1


def _sampled(seed: int = 0, request_id: str = "", temperature: float = 1.0) -> TaskPayload:
    request = gateway_pb2.GenerateRequest(
        prompt="hello",
        max_tokens=4,
        request_id=request_id,
        sampling=common_pb2.SamplingParams(temperature=temperature, seed=seed),
    )
    return _validate(request)[1]


def test_unseeded_sampling_gets_a_random_seed_per_request() -> None:
    seeds = {_sampled().seed for _ in range(5)}
    assert len(seeds) == 5 and all(0 < s < 1 << SEED_BITS for s in seeds)
    assert _sampled(seed=7).seed == 7  # the client's seed is kept
    assert _sampled(temperature=0).seed == 0  # greedy ignores the seed: none drawn
    assert _sampled(seed=7, temperature=0).seed == 7


def test_a_named_unseeded_request_gets_the_same_seed_on_a_retry() -> None:
    # The idempotency check hashes the payload: a retry must carry the same seed.
    first = _sampled(request_id="job-1").seed
    assert first != 0 and _sampled(request_id="job-1").seed == first
    assert _sampled(request_id="job-2").seed != first
    assert draw_seed("job-1@abc", is_named=True) != draw_seed("job-1", is_named=True)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (gateway_pb2.GenerateRequest(max_tokens=1), "prompt is empty"),
        (gateway_pb2.GenerateRequest(prompt="a", prompt_token_ids=[1], max_tokens=1), "not both"),
        (
            gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 4096),
            re.escape("the prompt (4096 tokens) fills the context limit of 4096 tokens"),
        ),
        (
            gateway_pb2.GenerateRequest(
                prompt="a", max_tokens=1, sampling=common_pb2.SamplingParams(top_p=-0.1)
            ),
            "top_p",
        ),
        (
            gateway_pb2.GenerateRequest(
                prompt="a",
                max_tokens=1,
                sampling=common_pb2.SamplingParams(temperature=float("nan")),
            ),
            "temperature",
        ),
        (
            gateway_pb2.GenerateRequest(prompt="a", max_tokens=1, request_id="x" * 129),
            "the limit is 128",
        ),
    ],
)
def test_generate_invalid(request_: gateway_pb2.GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        _validate(request_)


# ----------------------------------------------------------------- training


def _train(
    samples: list[gateway_pb2.TrainSample], batch_size: int = 0, limit: int = 4096
) -> list[tuple[Task, TaskPayload]]:
    request = gateway_pb2.TrainRequest(samples=samples, batch_size=batch_size)
    return validate_train(request, tokenizer=TOKENIZER, max_context_tokens=limit)


def test_train_batches_samples_and_sizes_by_the_longest() -> None:
    samples = [
        gateway_pb2.TrainSample(query="q" * 8, reference="r" * 4),
        gateway_pb2.TrainSample(token_ids=[1, 2, 3, 4, 5], num_reference_tokens=2),
        gateway_pb2.TrainSample(reference="r" * 4),
    ]
    one_each = _train(samples)  # batch_size 0 -> 1
    assert [(t.batch_size, t.num_prompt_tokens) for t, _ in one_each] == [(1, 3), (1, 5), (1, 1)]
    assert one_each[1][1].prompt_token_ids == (1, 2, 3, 4, 5)
    assert one_each[1][1].reference_token_ids == (4, 5)
    assert all(t.kind is TaskKind.TRAINING and t.task_id.startswith("trn-") for t, _ in one_each)
    batched = _train(samples, batch_size=2)
    assert [(t.batch_size, t.num_prompt_tokens) for t, _ in batched] == [(2, 5), (1, 1)]


def test_train_batch_carries_each_samples_ids_for_a_real_tokenizer(tmp_path: Path) -> None:
    from lemix.model.tokenizer import train_bpe

    real = train_bpe(
        lambda: ["hello world, how are you today?"] * 50,
        vocab_size=300,
        corpus_id="tiny",
        cache_dir=tmp_path,
    )
    samples = [
        gateway_pb2.TrainSample(query="hello", reference="world"),
        gateway_pb2.TrainSample(token_ids=[7, 8, 9], num_reference_tokens=1),
    ]
    request = gateway_pb2.TrainRequest(samples=samples, batch_size=2)
    [(task, payload)] = validate_train(request, tokenizer=real, max_context_tokens=64)
    first = (real.bos_id, *real.encode("hello"), *real.encode("world"))
    assert payload.samples() == [(first, len(real.encode("world"))), ((7, 8, 9), 1)]
    assert task.batch_size == 2 and task.num_prompt_tokens == max(len(first), 3)


def test_train_ids_derive_from_sample_ids() -> None:
    samples = [gateway_pb2.TrainSample(sample_id=f"s{i}", query="q") for i in range(3)]
    first = [t.task_id for t, _ in _train(samples, batch_size=2)]
    assert first == [t.task_id for t, _ in _train(samples, batch_size=2)]
    assert len(set(first)) == 2


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([], "no samples"),
        ([gateway_pb2.TrainSample(query="q"), gateway_pb2.TrainSample()], r"samples\[1\] is empty"),
        ([gateway_pb2.TrainSample(query="q", token_ids=[1])], "not both"),
        ([gateway_pb2.TrainSample(token_ids=[1], num_reference_tokens=2)], "num_reference_tokens"),
        ([gateway_pb2.TrainSample(token_ids=[1] * 11)], "has 11 tokens; the context limit is 10"),
        (
            [
                gateway_pb2.TrainSample(sample_id="a", query="q"),
                gateway_pb2.TrainSample(sample_id="a", query="q"),
            ],
            "repeats samples",
        ),
    ],
)
def test_train_invalid(samples: list[gateway_pb2.TrainSample], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        _train(samples, limit=10)


# ------------------------------------------------------- a real tokenizer


def test_real_tokenizer_prompts_start_with_bos(tmp_path: Path) -> None:
    texts = ["hello world, a small corpus for a small vocabulary"] * 5
    bpe = train_bpe(lambda: texts, vocab_size=270, corpus_id="t", cache_dir=tmp_path)
    assert bpe.bos_id is not None
    request = gateway_pb2.GenerateRequest(prompt="hello", max_tokens=4, reference="world")
    task, payload = validate_generate(request, tokenizer=bpe, max_context_tokens=64)
    assert payload.prompt_token_ids == (bpe.bos_id, *bpe.encode("hello"))
    assert task.num_prompt_tokens == len(payload.prompt_token_ids)
    assert payload.reference_token_ids == tuple(bpe.encode("world"))  # continues: no BOS
    sample = gateway_pb2.TrainSample(query="hello", reference="world")
    [(train_task, train_payload)] = validate_train(
        gateway_pb2.TrainRequest(samples=[sample]), tokenizer=bpe, max_context_tokens=64
    )
    ids = (bpe.bos_id, *bpe.encode("hello"), *bpe.encode("world"))
    assert train_payload.prompt_token_ids == ids
    assert train_task.num_prompt_tokens == len(train_payload.prompt_token_ids)


# --------------------------------------------- sampling floors, limits, scope


@pytest.mark.parametrize(
    ("temperature", "is_valid"),
    [
        (0.0, True),
        (MIN_TEMPERATURE, True),
        (0.7, True),
        (MAX_TEMPERATURE, True),
        (1e-300, False),
        (MIN_TEMPERATURE / 2, False),
        (MAX_TEMPERATURE * 1.01, False),
        (float("inf"), False),
        (-1.0, False),
    ],
)
def test_temperature_is_zero_or_within_its_range(temperature: float, is_valid: bool) -> None:
    request = gateway_pb2.GenerateRequest(
        prompt="a", max_tokens=1, sampling=common_pb2.SamplingParams(temperature=temperature)
    )
    if is_valid:
        assert _validate(request)[1].temperature == temperature
    else:
        with pytest.raises(InvalidArgument, match="temperature"):
            _validate(request)


def test_train_limits_name_the_setting() -> None:
    samples = [gateway_pb2.TrainSample(query="q")] * 5
    request = gateway_pb2.TrainRequest(samples=samples)
    with pytest.raises(
        InvalidArgument,
        match=re.escape("5 samples in one Train call; the limit (max_train_samples) is 4: split"),
    ):
        validate_train(request, tokenizer=TOKENIZER, max_context_tokens=64, max_samples=4)
    request = gateway_pb2.TrainRequest(samples=samples, batch_size=3)
    with pytest.raises(
        InvalidArgument,
        match=re.escape("batch_size 3 exceeds the limit (max_train_batch_size) of 2"),
    ):
        validate_train(request, tokenizer=TOKENIZER, max_context_tokens=64, max_train_batch_size=2)
    assert len(validate_train(request, tokenizer=TOKENIZER, max_context_tokens=64)) == 2


def test_client_scope_hashes_the_key_and_client_id() -> None:
    assert client_scope() == ANONYMOUS_SCOPE == ""
    keyed = client_scope(api_key="sk-secret")
    assert re.fullmatch(r"[0-9a-f]{12}", keyed) and keyed == client_scope(api_key="sk-secret")
    assert (
        len(
            {
                keyed,
                client_scope(api_key="other"),
                client_scope(client_id="sk-secret"),
                client_scope(api_key="sk-secret", client_id="a"),
            }
        )
        == 4
    )
    assert scope_from_headers({"authorization": "Bearer sk-secret"}) == keyed
    assert scope_from_headers({"authorization": "Basic sk-secret"}) == ANONYMOUS_SCOPE
    assert scope_from_headers({"x-client-id": " a "}) == client_scope(client_id="a")
    with pytest.raises(InvalidArgument, match="x-client-id header must not contain"):
        client_scope(client_id="a b")


def test_request_ids_are_named_within_the_scope() -> None:
    request = gateway_pb2.GenerateRequest(prompt="a", max_tokens=1, request_id="r1")
    assert _validate(request)[0].task_id == "r1"  # anonymous: the id itself
    task, _ = validate_generate(
        request, tokenizer=TOKENIZER, max_context_tokens=64, scope="0123456789ab"
    )
    assert task.task_id == scoped_task_id("r1", "0123456789ab") == "r1@0123456789ab"
    samples = [gateway_pb2.TrainSample(sample_id="s1", query="q")]
    train = gateway_pb2.TrainRequest(samples=samples)
    anonymous = validate_train(train, tokenizer=TOKENIZER, max_context_tokens=64)
    scoped = validate_train(train, tokenizer=TOKENIZER, max_context_tokens=64, scope="ab")
    assert anonymous[0][0].task_id != scoped[0][0].task_id
    assert (
        anonymous[0][0].task_id
        == validate_train(train, tokenizer=TOKENIZER, max_context_tokens=64)[0][0].task_id
    )  # stable
