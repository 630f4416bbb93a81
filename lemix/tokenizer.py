"""Tokenizers the gateway counts and encodes prompts with.

`Tokenizer` is what the gateway needs from one. `ApproxTokenizer` is an
EMULATION STAND-IN for the emulated backend, which runs no model: it only has
to turn text into a deterministic number of tokens (about one per 4 UTF-8
bytes, roughly what BPE vocabularies average on English) so context limits
and the planner's sizes are realistic. Its ids are stable hashes, not a
vocabulary: they mean nothing to a model, so the gateway does not send them
(`is_emulated`). Real tokenizers (a model directory's, or a byte-level BPE
trained on the default corpus) are in `lemix.model.tokenizer`; the gateway's
`load_tokenizer` picks one by name.

Prompts for a real model start with BOS when the tokenizer has one (the Llama
convention; `encode` itself adds no special tokens): see `encode_prompt`.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Protocol

APPROX_VOCAB_SIZE = 32_000
APPROX_BYTES_PER_TOKEN = 4
APPROX_EOS_ID = 0  # reserved: no encoded chunk or emulated output hashes to it


class Tokenizer(Protocol):
    """Text <-> token ids for one model's vocabulary."""

    @property
    def eos_id(self) -> int:
        """The end-of-sequence token id."""
        ...

    @property
    def bos_id(self) -> int | None:
        """The beginning-of-sequence token id; None when the vocabulary has none."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (ids are 0..vocab_size-1)."""
        ...

    @property
    def is_emulated(self) -> bool:
        """True when ids are stand-ins no model understands (emulated backend)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""
        ...


def _stable_id(data: bytes, vocab_size: int) -> int:
    # crc32, not hash(): Python salts str/bytes hashes per process.
    return zlib.crc32(data) % (vocab_size - 1) + 1  # never APPROX_EOS_ID


class ApproxTokenizer:
    """Emulation stand-in: one token per `bytes_per_token` UTF-8 bytes.

    Deterministic across processes and runs. `decode` returns placeholders
    ``<t{id}>``; there is no text to recover.
    """

    def __init__(
        self, vocab_size: int = APPROX_VOCAB_SIZE, bytes_per_token: int = APPROX_BYTES_PER_TOKEN
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
        self.vocab_size = vocab_size
        self.bytes_per_token = bytes_per_token

    @property
    def eos_id(self) -> int:
        return APPROX_EOS_ID

    @property
    def bos_id(self) -> int | None:
        return None  # no vocabulary, nothing to begin with

    @property
    def is_emulated(self) -> bool:
        return True

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        step = self.bytes_per_token
        return [_stable_id(data[i : i + step], self.vocab_size) for i in range(0, len(data), step)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<t{i}>" for i in ids)


def emulated_token_id(position: int, vocab_size: int = APPROX_VOCAB_SIZE) -> int:
    """The id reported for output token `position` (0-based) of an emulated run.

    The emulated backend produces token counts, not tokens; clients still get
    one deterministic id per position so streams can be counted and compared.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return _stable_id(b"out:%d" % position, vocab_size)


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> str | None:
    """`messages` ({role, content}) through the checkpoint's own chat template,
    ending with the assistant's generation prompt; None when the tokenizer has
    no template (the gateway then uses its fallback). Tokenizers that can have
    one (`lemix.model.tokenizer.HFTokenizer`) offer a `render_chat` method.
    ValueError when the template refuses the messages."""
    render = getattr(tokenizer, "render_chat", None)
    if render is None:
        return None
    text: str | None = render(messages)
    return text


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids a model is prompted with for `text`: BOS first when the tokenizer
    has one (Llama convention), then `encode(text)`. Emulated ids get no BOS:
    their count is the emulated prompt length and must stay as it was."""
    ids = tokenizer.encode(text)
    bos_id = None if tokenizer.is_emulated else tokenizer.bos_id
    return ids if bos_id is None else [bos_id, *ids]
