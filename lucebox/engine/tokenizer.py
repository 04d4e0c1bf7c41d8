"""Text <-> token ids, and streaming detokenization.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library) plus the facts about the model's
special tokens that the rest of the engine needs: which id to prepend (BOS), which ids end a turn
(EOS and end-of-turn tokens), which ids are control tokens.

Two ways to get one:

    tok = tokenizer_from_gguf(GGUFFile(path))          # built from GGUF metadata (tokenizer_gguf.py)
    tok = tokenizer_from_hf_dir(folder)                 # tokenizer.json + its config files

`encode` parses special-token text such as `<|im_start|>` into the special token, as llama.cpp and
transformers do for chat prompts: the chat template renders markers as text and they must come back
as single ids.

`IncrementalDetokenizer` turns generated ids into text deltas for streaming. It never emits half a
UTF-8 character and the deltas concatenate to exactly `decode(all_ids)`.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from lucebox.engine.tokenizer_cache import SegmentCache
from lucebox.errors import ModelFileError

if TYPE_CHECKING:
    from lucebox.engine.weights.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# Tokens that end a turn in the chat formats we know (llama.cpp's end-of-generation list). They
# count as stop tokens only where the vocabulary has them as special tokens.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML (Qwen, SmolLM)
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3.1 tool call
    "<end_of_turn>",  # Gemma
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|end|>",  # Phi-3
    "<|return|>",  # gpt-oss
    "<|call|>",  # gpt-oss
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek
)

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special-token facts.

    `add_bos` says whether a prompt should start with BOS; `encode(text)` does it for you.
    `eos_ids` is every id generation stops on; `special_ids` every control token (what
    `decode(..., skip_special=True)` leaves out).
    """

    hf: tokenizers.Tokenizer
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]
    pad_id: int | None
    add_bos: bool
    bos_token: str
    eos_token: str
    special_ids: frozenset[int]

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        extra_eos_ids: Iterable[int] = (),
        pad_id: int | None = None,
        add_bos: bool = False,
    ) -> None:
        self.hf = hf
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.segments = SegmentCache.for_tokenizer(hf)  # None where piecewise encoding would differ
        self.grammar: Any = None  # engine/runtime/grammar.py's TokenGrammar for this tokenizer, built on first use
        self.bos_id = _valid_id(bos_id, self.vocab_size)
        self.eos_id = _valid_id(eos_id, self.vocab_size)
        self.pad_id = _valid_id(pad_id, self.vocab_size)
        self.add_bos = bool(add_bos and self.bos_id is not None)
        self.bos_token = self._token_text(self.bos_id, added)
        self.eos_token = self._token_text(self.eos_id, added)

        eos = {i for i in extra_eos_ids if _valid_id(i, self.vocab_size) is not None}
        if self.eos_id is not None:
            eos.add(self.eos_id)
        for name in END_OF_TURN_TOKENS:
            i = hf.token_to_id(name)
            if i is not None and i in self.special_ids:
                eos.add(i)
        # gpt-oss: <|end|> closes a message but the turn goes on until <|return|> or <|call|>.
        end, ret = hf.token_to_id("<|end|>"), hf.token_to_id("<|return|>")
        if end is not None and ret is not None and ret in eos and end != self.eos_id:
            eos.discard(end)
        self.eos_ids = frozenset(eos)

        # Byte-fallback tokens (`<0xNN>`) decode as one group per run, so the streaming
        # detokenizer waits for a run to end. Empty for byte-level BPE vocabularies.
        byte_ids = [hf.token_to_id(f"<0x{b:02X}>") for b in range(256)]
        self._byte_ids = frozenset(byte_ids) if None not in byte_ids else frozenset()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest text one token stands for: the characters of its longest spelling (added tokens too)."""
        return max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1) or 1

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"eos_ids={sorted(self.eos_ids)}, add_bos={self.add_bos})"
        )

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids for `text`; special-token text in it becomes the special token.

        `add_special` prepends BOS where the model wants one (`add_bos`). Texts
        over a few KB go through `encode_batch`, which releases the GIL, so a
        long prompt tokenized in a worker thread does not stall the event loop.
        Such texts go piece by piece between special tokens, and the pieces seen
        before (an agent's system prompt and earlier turns) are not encoded again
        (`segments`).
        """
        if len(text) > 4096 and self.segments is not None:
            ids = self.segments.encode(text)
        elif len(text) > 4096:
            ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`; with `skip_special`, control tokens are left out."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, s: str) -> int | None:
        """The id of the token spelled `s` (the vocabulary's spelling), or None."""
        return self.hf.token_to_id(s)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary's spelling of token `i`, or None if there is no such id."""
        if i < 0:
            return None
        return self.hf.id_to_token(i)

    def detokenizer(self, skip_special: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer over this vocabulary."""
        return IncrementalDetokenizer(self, skip_special=skip_special)

    def _token_text(self, i: int | None, added: dict[int, tokenizers.AddedToken]) -> str:
        # Chat templates splice bos/eos into the prompt as text, so this must be the text that
        # encodes back to the token: an added token's content, else the token decoded.
        if i is None:
            return ""
        if i in added:
            return added[i].content
        return self.hf.decode([i], skip_special_tokens=False)


def _valid_id(i: int | None, vocab_size: int) -> int | None:
    if i is None or not 0 <= int(i) < vocab_size:
        return None
    return int(i)


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas.

    Each `push` decodes a short window of recent tokens twice (without and with the new ones) and
    emits the difference, so the cost per token does not grow with the sequence, and decoder rules
    that depend on context (SentencePiece's leading-space strip, byte-level BPE splitting a
    character over tokens) come out as they do when decoding everything at once. Text is held back
    while it ends in an incomplete UTF-8 sequence (U+FFFD) or inside a run of byte-fallback tokens,
    which the decoder turns into text as one group. `flush` returns what is still held.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []  # the window: already-emitted context, then pending tokens
        self._read = 0  # ids[:read] have been emitted; ids[read:] are pending

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never half a character)."""
        return self.push_many([token_id])

    def push_many(self, token_ids: list[int]) -> str:
        """Add ids that arrived together; return the text they complete (one window decode for all of them:
        the same text as pushing them one by one, in fewer pieces)."""
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        last = self._ids[-1]
        if last in self._tok._byte_ids or (self._skip and last in self._tok.special_ids):
            # A run of byte tokens decodes as one group (skipped tokens do not break it): wait for its end.
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is held back (call once the sequence is finished)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tok.decode
        prefix_text = decode(self._ids[: self._read], self._skip)
        text = decode(self._ids, self._skip)
        if not final and (len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT_CHAR)):
            return ""
        if not text.startswith(prefix_text):
            log.debug("detokenizer: window text %r does not extend %r", text, prefix_text)
        delta = text[len(prefix_text) :]
        # The tokens just emitted become the context window for the next ones.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return delta


def tokenizer_from_gguf(reader: GGUFFile) -> Tokenizer:
    """Build the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata."""
    from lucebox.engine.tokenizer_gguf import build_from_gguf

    return build_from_gguf(reader)


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    """Load `tokenizer.json` from a Hugging Face model folder, with the special-token facts from
    `tokenizer_config.json`, `special_tokens_map.json` and `generation_config.json`."""
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelFileError(f"no tokenizer.json in {path}")
    try:
        hf = tokenizers.Tokenizer.from_file(str(tj))
    except Exception as e:  # the Rust error names the JSON problem
        raise ModelFileError(f"cannot read {tj}: {e}") from e
    config = _read_json(path / "tokenizer_config.json")
    special_map = _read_json(path / "special_tokens_map.json")
    generation = _read_json(path / "generation_config.json")

    # Added tokens the config declares but tokenizer.json lacks (transformers adds them too).
    missing = []
    for entry in (config.get("added_tokens_decoder") or {}).values():
        content = entry.get("content") if isinstance(entry, dict) else None
        if content and hf.token_to_id(content) is None:
            missing.append(
                tokenizers.AddedToken(content, special=bool(entry.get("special")), normalized=False)
            )
    if missing:
        hf.add_tokens(missing)

    def special(name: str) -> int | None:
        value = config.get(name) or special_map.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return hf.token_to_id(value) if isinstance(value, str) else None

    bos_id = special("bos_token")
    if bos_id is None and isinstance(generation.get("bos_token_id"), int):
        bos_id = generation["bos_token_id"]
    eos_id = special("eos_token")
    gen_eos = generation.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else [i for i in gen_eos or [] if isinstance(i, int)]
    if eos_id is None and gen_eos:
        eos_id = gen_eos[0]

    if isinstance(config.get("add_bos_token"), bool):
        add_bos = config["add_bos_token"]
    else:  # no flag: does tokenizer.json's post-processor put BOS in front?
        with_special = hf.encode("", add_special_tokens=True).ids
        add_bos = bos_id is not None and with_special[:1] == [bos_id]
    return Tokenizer(hf, bos_id=bos_id, eos_id=eos_id, extra_eos_ids=gen_eos, pad_id=special("pad_token"),
                     add_bos=add_bos)


def _read_json(p: Path) -> dict[str, Any]:
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {p}: {e}") from e
    return data if isinstance(data, dict) else {}
