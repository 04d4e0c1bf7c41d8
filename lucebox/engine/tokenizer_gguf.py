"""Build a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, token types, scores or merges and the
special-token ids under llama.cpp's key names. Two tokenizer models matter:

- `gpt2`: byte-level BPE (Llama 3, Qwen, SmolLM, Mistral Nemo...). The file gives the merges; how
  text is cut into words before merging depends on `tokenizer.ggml.pre`, which names the regexes
  of the original tokenizer (table below, from llama.cpp's llama-vocab.cpp and the models'
  tokenizer.json).
- `llama`: SentencePiece-style BPE (Llama 2, Mistral 7B, Gemma) with `<0xNN>` byte fallback and
  `▁` for spaces. The file gives scores, not merges; the merges are rebuilt from the vocabulary,
  ranked as transformers ranks them so both tokenize a GGUF the same way.

Token types: 3 (control) and 2 (unknown) become special added tokens, 4 (user-defined) plain
added tokens, so all of them are matched whole in the text.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from lucebox.engine.tokenizer import Tokenizer
from lucebox.engine.weights.config_check import describe
from lucebox.errors import ModelFileError

if TYPE_CHECKING:
    from lucebox.engine.weights.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer regexes, as in the models' tokenizer.json ------------------------------------

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (  # as Llama 3, but digits one at a time
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
)

# `tokenizer.ggml.pre` values -> how to cut text into words: a tuple of regexes applied one after
# the other (each splits the pieces the one before left, as llama.cpp does), or "gpt2" /
# "digits+gpt2" for the byte-level pre-tokenizer's own GPT-2 regex (after isolating each digit).
_PRE_GROUPS: list[tuple[tuple[str, ...], str | tuple[str, ...]]] = [
    (("default", "gpt2", "gpt-2", "mpt", "olmo", "phi-2", "jais", "exaone4", "mellum"), "gpt2"),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), "digits+gpt2"),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
         "smaug-bpe", "chatglm-bpe", "glm4"),
        (_LLAMA3,),
    ),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo"), (_QWEN2,)),
    (("tekken",), (_TEKKEN,)),
    (("gpt-4o", "llama4"), (_GPT4O,)),
    (("falcon",), _FALCON),
    (("deepseek-coder",), _DEEPSEEK_CODER),
    (("deepseek-v3",), _DEEPSEEK3),
]
_PRE = {name: spec for names, spec in _PRE_GROUPS for name in names}
# Pre values whose tokenizer.json looks a whole word up in the vocabulary before merging.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}
# ... and whose models want BOS when the file does not say (llama.cpp's defaults).
_ADD_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}
_NFC = {"qwen2", "deepseek-r1-qwen", "megrez", "kormo"}  # Qwen2's tokenizer.json normalizes to NFC


def build_from_gguf(reader: GGUFFile) -> Tokenizer:
    """The `Tokenizer` for a GGUF file (see the module docstring for the cases)."""
    meta = _Meta(reader)
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise ModelFileError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    _check_types(meta, reader, len(tokens) if isinstance(tokens, list) else 0)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFileError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if model == "gpt2":
        hf = _byte_level_bpe(meta, tokens, types, pre)
        add_bos_default = pre in _ADD_BOS
    elif model == "llama":
        hf = _sentencepiece_bpe(meta, tokens, types)
        add_bos_default = True
    else:
        raise ModelFileError(
            f"unsupported tokenizer model {model!r} in GGUF metadata (tokenizer.ggml.model); supported: gpt2, llama"
        )

    special = {i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)}
    special |= {i for i in (bos_id, eos_id) if i is not None and 0 <= i < len(tokens)}
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special) if tokens[i]])
    vocab = hf.get_vocab(with_added_tokens=False)
    # User-defined tokens are matched whole too, except Gemma's runs of spaces, respelled with `▁` for BPE.
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED and t in vocab]
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_bos = add_bos_default if add_bos is None else bool(add_bos)
    if add_bos and bos_id is not None and 0 <= bos_id < len(tokens):
        # Only for callers of `hf.encode` directly; `Tokenizer.encode` adds BOS itself.
        bos = tokens[bos_id]
        try:
            hf.post_processor = processors.TemplateProcessing(single=[bos, "$A"], special_tokens=[(bos, bos_id)])
        except Exception:  # a BOS spelling the template syntax cannot hold (e.g. with ':')
            log.debug("no BOS post-processor for %r", bos)
    extra_eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return Tokenizer(
        hf,
        bos_id=bos_id,
        eos_id=eos_id,
        extra_eos_ids=[i for i in extra_eos if i is not None],
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos=add_bos,
    )


# Key -> (what it must be, test); absent keys are fine (defaults apply).
_TYPES: dict[str, tuple[str, Any]] = {
    "tokenizer.ggml.model": ("a tokenizer name", lambda v: isinstance(v, str)),
    "tokenizer.ggml.pre": ("a pre-tokenizer name", lambda v: isinstance(v, str)),
    "tokenizer.ggml.tokens": ("a list of token strings", lambda v: isinstance(v, list)
                              and all(isinstance(t, str) for t in v)),
    "tokenizer.ggml.token_type": ("a list of token type numbers", lambda v: isinstance(v, list)
                                  and all(isinstance(t, int) for t in v)),
    "tokenizer.ggml.scores": ("a list of numbers", lambda v: isinstance(v, list)
                              and all(isinstance(t, (int, float)) for t in v)),
    "tokenizer.ggml.merges": ("a list of merge strings", lambda v: isinstance(v, list)
                              and all(isinstance(t, str) for t in v)),
    "tokenizer.ggml.add_bos_token": ("a boolean", lambda v: isinstance(v, (bool, int))),
    "tokenizer.ggml.add_space_prefix": ("a boolean", lambda v: isinstance(v, (bool, int))),
}
_TOKEN_IDS = ("bos", "eos", "eot", "eom", "padding", "unknown")


def _check_types(meta: _Meta, reader: GGUFFile, n_tokens: int) -> None:
    """Each tokenizer key holds the type it must, and token ids name tokens: else one error naming the key."""
    for key, (want, ok) in _TYPES.items():
        value = meta.get(key)
        if value is not None and not ok(value):
            raise ModelFileError(f"{reader.path}: {key} is {describe(value)}, not {want}")
    for name in _TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFileError(f"{reader.path}: {key} is {describe(value)}, not a token id")
        if name == "eos" and not 0 <= value < n_tokens:
            raise ModelFileError(f"{reader.path}: {key} is {value}, but the vocabulary has {n_tokens} tokens")


class _Meta:
    """Typed access to GGUF metadata values (strings decoded, arrays as lists)."""

    def __init__(self, reader: GGUFFile) -> None:
        self._fields = reader.fields

    def get(self, key: str) -> Any:
        return self._fields.get(key)


# --- byte-level BPE ------------------------------------------------------------------------------


def _byte_level_bpe(meta: _Meta, tokens: list[str], types: list[int], pre: str) -> HFTokenizer:
    alphabet = _byte_alphabet()
    spelling = {b: c for b, c in enumerate(alphabet)}
    alphabet_set = set(alphabet)
    vocab: dict[str, int] = {}
    for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty == NORMAL and not set(tok) <= alphabet_set:
            # A normal token must be spelled in the byte alphabet to be reachable by merges.
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab[tok] = i
    merges_raw = meta.get("tokenizer.ggml.merges")
    if merges_raw:
        merges = []
        for m in merges_raw:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ModelFileError(f"GGUF tokenizer merge {m!r} is not two tokens separated by a space")
            merges.append((parts[0], parts[1]))
    else:
        log.info("GGUF byte-level vocabulary has no merges; deriving them from the token order")
        merges = merges_from_vocab(list(vocab), [-float(i) for i in vocab.values()])

    spec = _PRE.get(pre)
    if spec is None:
        log.warning("unknown tokenizer.ggml.pre %r: splitting words with GPT-2's regex; tokens may differ", pre)
        spec = "gpt2"
    hf = HFTokenizer(
        _bpe(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", ignore_merges=pre in _IGNORE_MERGES)
    )
    if spec == "gpt2":
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif spec == "digits+gpt2":
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre in _NFC:
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    return hf


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (byte b is spelled alphabet[b])."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


# --- SentencePiece-style BPE ---------------------------------------------------------------------


def _sentencepiece_bpe(meta: _Meta, tokens: list[str], types: list[int]) -> HFTokenizer:
    tokens = list(tokens)
    taken = set(tokens)
    for i, tok in enumerate(tokens):
        # Gemma stores its runs-of-spaces tokens with real spaces; text reaches the model as `▁`s.
        if tok and tok == " " * len(tok) and "\u2581" * len(tok) not in taken:
            tokens[i] = "\u2581" * len(tok)
    vocab = {tok: i for i, tok in enumerate(tokens)}

    scores = meta.get("tokenizer.ggml.scores")
    arch = meta.get("general.architecture") or ""
    if arch.startswith("gemma") or not scores:
        # Gemma's merge order is its vocabulary order (its scores rank added tokens differently).
        rank = [-float(i) for i in range(len(tokens))]
    elif len(scores) != len(tokens):
        raise ModelFileError(f"GGUF tokenizer has {len(tokens)} tokens but {len(scores)} scores")
    else:
        rank = [float(s) for s in scores]
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        merges = [tuple(m.split(" ", 1)) for m in merges]
    else:
        merges = merges_from_vocab(tokens, rank)

    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    hf = HFTokenizer(_bpe(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=BYTE in types))

    # Spaces become `▁`; with add_space_prefix (llama.cpp's default here) the text gets one in front,
    # which decoding takes off again.
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    space_prefix = True if space_prefix is None else bool(space_prefix)
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if space_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    return hf


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> BPE:
    try:
        return BPE(vocab, merges, **options)
    except Exception as e:  # e.g. a merge naming a token the vocabulary lacks
        raise ModelFileError(f"GGUF tokenizer vocabulary and merges do not fit together: {e}") from e


def merges_from_vocab(tokens: list[str], rank: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens, best first.

    Order (as transformers' `generate_merges`, so both tokenize alike): by the merged token's
    rank, higher first; then longer left part; then longer right part; then vocabulary order.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    best = dict(zip(tokens, rank, strict=True))  # a token listed twice keeps its first position, last rank
    rows = [
        (r, k, len(tok) - k, tok[:k], tok[k:])
        for tok, r in best.items()
        for k in range(1, len(tok))
        if tok[:k] in vocab and tok[k:] in vocab
    ]
    rows.sort(key=lambda row: row[:3], reverse=True)  # stable: ties keep vocabulary order
    return [(left, right) for *_, left, right in rows]
