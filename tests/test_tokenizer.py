"""Tokenizer tests.

- Parity with Hugging Face transformers loading the same GGUF files (SmolLM2: byte-level BPE;
  Gemma 3: SentencePiece-style BPE with byte fallback): encode, decode, special-token facts.
- The GGUF build paths on tiny vocabularies trained here and written with gguf.GGUFWriter, checked
  against independent references (the trained tokenizer with the model family's published
  pre-tokenizer, sentencepiece itself, transformers).
- The streaming detokenizer: deltas concatenate to `decode`, never half a character.
- `tokenizer_from_hf_dir` on folders transformers writes.
"""

from __future__ import annotations

import io
import json
import logging
import random
import unicodedata
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer

from lucebox.engine.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from lucebox.engine.tokenizer_cache import SegmentCache
from lucebox.engine.tokenizer_gguf import _NFC, _PRE
from lucebox.engine.weights.gguf_file import GGUFFile
from lucebox.errors import ModelFileError
from tests import hf_reference

DATA = Path(__file__).parent / "data"
TRAINING_TEXT = (DATA / "tokenizer_corpus.txt").read_text(encoding="utf-8")

CORPUS = {
    "empty": "",
    "ascii": "Hello world! The quick brown fox jumps over the lazy dog.",
    "cjk": "日本語のテキストとカタカナ。中文字符，你好世界！한국어 텍스트입니다",
    "accents": "Ça va? Crème brûlée, naïve façade, Ångström, résumé; e\u0301 combining",
    "rtl": "שלום עולם — مرحبا بالعالم، كيف حالك؟",
    "emoji": "Emoji: 😀👍🏽🇺🇸 ❤️ family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 🦙🦙 end",
    "python": (
        "def fib(n):\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n\n\n"
        "class A:\n    def __init__(self):\n        self.x = {'a': [1, 2, 3]}  # comment\n"
    ),
    "whitespace": "a  b   c    d\n\n\n e\t\tf \r\n g\r\n\r\n  trailing   ",
    "leading": "   leading spaces and a tab\t",
    "only_spaces": "     ",
    "numbers": "12345678901234567890 3.14159 1,000,000 0x1F 2024-11-29  42   7\n 99",
    "contractions": "I'm sure they'll say it's fine, don't you think? WE'VE SEEN IT.",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "gemma_turns": "<bos><start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n",
    "markers_glued": "x<|im_end|>y<end_of_turn>z<|im_start|><|im_start|>",
    "training_text": TRAINING_TEXT,
}
MODELS = ["smollm2", "gemma3"]


# --- fixtures: the real models, ours and transformers' ----------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Tokenizer:
    return tokenizer_from_gguf(GGUFFile(smollm2_path))


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path: Path):
    hf = hf_reference.tokenizer(smollm2_path)  # transformers' conversion of the file, kept between runs
    # transformers' GGUF converter knows no `smollm` pre-tokenizer and splits with GPT-2's regex
    # alone. SmolLM2's own tokenizer.json (and llama.cpp) isolate every digit first, which differs
    # on e.g. "  42"; give the reference the published pre-tokenizer.
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return hf


@pytest.fixture(scope="module")
def gemma3(gemma3_path: Path) -> Tokenizer:
    return tokenizer_from_gguf(GGUFFile(gemma3_path))


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_path: Path):
    return hf_reference.tokenizer(gemma3_path)  # converting it takes ~25 s: cached per machine


@pytest.fixture(params=MODELS)
def pair(request):
    """(our Tokenizer, transformers' tokenizer) for one real model."""
    return request.getfixturevalue(request.param), request.getfixturevalue(request.param + "_hf")


@pytest.fixture(params=MODELS)
def real(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


# --- parity with transformers on the real GGUF files -----------------------------------------------


@pytest.mark.parametrize("name", CORPUS)
def test_encode_matches_transformers(pair, name: str) -> None:
    tok, hf = pair
    text = CORPUS[name]
    assert tok.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text) == hf.encode(text)  # BOS where the model adds one (Gemma), like with like


@pytest.mark.parametrize("name", CORPUS)
def test_decode_matches_transformers(pair, name: str) -> None:
    tok, hf = pair
    text = CORPUS[name]
    ids = tok.encode(text)
    for skip in (False, True):
        assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text, add_special=False)) == text


def test_special_token_facts_match_transformers(pair) -> None:
    tok, hf = pair
    assert tok.vocab_size == len(hf)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert (tok.bos_token, tok.eos_token) == (hf.bos_token, hf.eos_token)
    assert tok.add_bos == (hf.encode("")[:1] == [hf.bos_token_id])
    assert tok.eos_id in tok.eos_ids
    assert set(hf.all_special_ids) <= tok.special_ids | {hf.unk_token_id}
    for i in tok.special_ids:  # control tokens round-trip as single ids
        assert tok.encode(tok.decode([i]), add_special=False) == [i]


def test_smollm2_stops_on_chatml_end(smollm2: Tokenizer) -> None:
    assert smollm2.token_to_id("<|im_end|>") in smollm2.eos_ids
    assert smollm2.token_to_id("<|endoftext|>") in smollm2.eos_ids
    assert smollm2.token_to_id("<|im_start|>") not in smollm2.eos_ids
    assert not smollm2.add_bos


def test_gemma3_stops_on_end_of_turn(gemma3: Tokenizer) -> None:
    assert {gemma3.token_to_id("<eos>"), gemma3.token_to_id("<end_of_turn>")} <= gemma3.eos_ids
    assert gemma3.token_to_id("<start_of_turn>") not in gemma3.eos_ids
    assert gemma3.add_bos and gemma3.bos_token == "<bos>"
    assert gemma3.encode("hi")[0] == gemma3.bos_id
    assert gemma3.encode("hi", add_special=False)[0] != gemma3.bos_id


def test_smollm2_isolates_digits(smollm2: Tokenizer) -> None:
    # Pre-tokenizer `smollm`: each digit is its own word, so text splits around digits exactly.
    text = "x  1  22 abc3d"
    pieces = ["x  ", "1", "  ", "2", "2", " abc", "3", "d"]
    assert smollm2.encode(text) == [i for p in pieces for i in smollm2.encode(p)]


def test_token_lookup(real: Tokenizer) -> None:
    for i in (0, 1, real.eos_id, real.vocab_size - 1):
        assert real.token_to_id(real.id_to_token(i)) == i
    assert real.id_to_token(real.vocab_size) is None
    assert real.id_to_token(-1) is None
    assert real.token_to_id("definitely not a token \u2603\u2603") is None


# --- the streaming detokenizer ------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip_special: bool) -> list[str]:
    det = tok.detokenizer(skip_special=skip_special)
    return [det.push(i) for i in ids] + [det.flush()]


@pytest.mark.parametrize("name", CORPUS)
def test_detokenizer_concatenates_to_decode(real: Tokenizer, name: str) -> None:
    ids = real.encode(CORPUS[name])
    for skip in (True, False):
        pieces = stream(real, ids, skip)
        full = real.decode(ids, skip_special=skip)
        assert "".join(pieces) == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_holds_a_split_emoji(real: Tokenizer) -> None:
    ids = real.encode("🦙", add_special=False)
    assert len(ids) > 1 and "\ufffd" in real.decode(ids[:1])  # the emoji's 4 bytes span several tokens
    pieces = stream(real, ids, skip_special=True)
    assert pieces[:-2] == [""] * (len(ids) - 1) and "".join(pieces) == "🦙"
    pieces = stream(real, real.encode("a🦙b", add_special=False), skip_special=True)
    assert "".join(pieces) == "a🦙b" and any("🦙" in p for p in pieces)


def test_gemma3_emoji_goes_through_byte_fallback(gemma3: Tokenizer) -> None:
    ids = gemma3.encode("🦙", add_special=False)
    assert [gemma3.id_to_token(i) for i in ids] == [f"<0x{b:02X}>" for b in "🦙".encode()]
    assert gemma3.decode(ids) == "🦙"


def test_detokenizer_random_ids(real: Tokenizer) -> None:
    """Arbitrary id sequences, heavy on byte tokens and specials, even invalid UTF-8."""
    rng = random.Random(1234)
    specials = sorted(real.special_ids)[:40]
    low = [i for i in range(600) if i not in real.special_ids]  # byte tokens live low in both vocabularies
    for _ in range(400):
        ids = [
            rng.choice(specials) if r < 0.15 else rng.choice(low) if r < 0.6 else rng.randrange(real.vocab_size)
            for r in (rng.random() for _ in range(rng.randint(1, 24)))
        ]
        for skip in (True, False):
            assert "".join(stream(real, ids, skip)) == real.decode(ids, skip_special=skip), ids


def test_detokenizer_push_many_gives_the_same_text(real: Tokenizer) -> None:
    """Tokens that arrive together (one SSE event's worth) are decoded as one piece: the same text, never
    half a character, whatever the grouping."""
    rng = random.Random(77)
    specials = sorted(real.special_ids)[:40]
    low = [i for i in range(600) if i not in real.special_ids]
    texts = [real.encode(t, add_special=False) for t in CORPUS.values()]
    randoms = [[rng.choice(specials) if r < 0.1 else rng.choice(low) if r < 0.5 else rng.randrange(real.vocab_size)
                for r in (rng.random() for _ in range(rng.randint(1, 40)))] for _ in range(200)]
    for ids in texts + randoms:
        for skip in (True, False):
            det = real.detokenizer(skip_special=skip)
            pieces, i = [], 0
            while i < len(ids):
                k = rng.randint(1, 6)
                pieces.append(det.push_many(ids[i:i + k]))
                i += k
            pieces.append(det.flush())
            assert "".join(pieces) == real.decode(ids, skip_special=skip), ids
            if "\ufffd" not in real.decode(ids, skip_special=skip):
                assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_work_per_token_is_bounded(real: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = real.encode(TRAINING_TEXT * 3)
    seen: list[int] = []
    decode = real.decode

    def spy(window, skip_special=False):
        seen.append(len(window))
        return decode(window, skip_special)

    monkeypatch.setattr(real, "decode", spy)
    pieces = stream(real, ids, skip_special=True)
    monkeypatch.undo()
    assert "".join(pieces) == real.decode(ids, skip_special=True)
    assert len(seen) >= len(ids) and max(seen) <= 16


# --- tiny GGUF files written here ---------------------------------------------------------------------


def write_gguf(path: Path, model: str, tokens: list[str], types: list[int] | None = None, *,
               pre: str | None = None, merges: list[str] | None = None, scores: list[float] | None = None,
               **ids: int | bool) -> Path:
    """A GGUF holding only tokenizer metadata (no tensors); `ids` are e.g. bos_token_id=1."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for key, value in ids.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>", "<|end|>", "<|return|>"]


@pytest.fixture(scope="module")
def trained_bpe() -> HFTokenizer:
    """A byte-level BPE of ~500 tokens trained on the corpus file, plus a user-defined `<think>`."""
    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    t.add_tokens([AddedToken("<think>", normalized=False)])
    return t


@pytest.fixture(scope="module")
def tiny_bpe_gguf(trained_bpe: HFTokenizer, tmp_path_factory) -> Callable[..., Path]:
    """Writes `trained_bpe` as a GGUF with the given pre-tokenizer name; returns its path."""
    vocab = trained_bpe.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in SPECIALS else 4 if t == "<think>" else 1 for t in tokens]
    merges = [" ".join(m) for m in json.loads(trained_bpe.to_str())["model"]["merges"]]

    def make(pre: str, **kv) -> Path:
        path = tmp_path_factory.mktemp("bpe") / "tiny.gguf"
        kv = {"bos_token_id": 1, "eos_token_id": 0, "pad_token_id": 0, "eot_token_id": 3, **kv}
        return write_gguf(path, "gpt2", tokens, types, pre=pre, merges=merges, **kv)

    return make


def reference_split(pre: str):
    """(pre-tokenizer, normalizer, ignore_merges) of the model family's tokenizer.json, built from
    transformers' own tables, not ours."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False), None, False
    if pre == "smollm":  # SmolLM2's tokenizer.json: Digits(individual_digits) then ByteLevel
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ), None, False
    split = pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
    normalizer = normalizers.NFC() if pre == "qwen2" else None  # Qwen2Tokenizer normalizes to NFC
    return pre_tokenizers.Sequence([split, byte_level]), normalizer, pre in ("llama-bpe", "tekken")


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2", "tekken", "gpt-4o"])
def test_tiny_byte_level_bpe_matches_reference(trained_bpe, tiny_bpe_gguf, pre: str) -> None:
    tok = tokenizer_from_gguf(GGUFFile(tiny_bpe_gguf(pre)))
    data = json.loads(trained_bpe.to_str())
    pre_tok, normalizer, ignore_merges = reference_split(pre)
    ref = HFTokenizer(models.BPE(data["model"]["vocab"], [tuple(m) for m in data["model"]["merges"]],
                                 ignore_merges=ignore_merges))
    ref.pre_tokenizer, ref.normalizer, ref.decoder = pre_tok, normalizer, decoders.ByteLevel()
    ref.add_special_tokens([AddedToken(s, normalized=False) for s in SPECIALS])
    ref.add_tokens([AddedToken("<think>", normalized=False)])
    for text in [*CORPUS.values(), *TRAINING_TEXT.splitlines(), "NFC: e\u0301 A\u030a", "<think>x</think>"]:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special=False) == expected, text
        assert tok.decode(expected) == ref.decode(expected, skip_special_tokens=False)


def test_tiny_byte_level_bpe_special_tokens(tiny_bpe_gguf) -> None:
    tok = tokenizer_from_gguf(GGUFFile(tiny_bpe_gguf("qwen2", add_bos_token=True)))
    start, end, think = (tok.token_to_id(s) for s in ("<|im_start|>", "<|im_end|>", "<think>"))
    ids = tok.encode("<|im_start|>user\n<think>hm</think><|im_end|>")
    assert ids[:2] == [tok.bos_id, start] and ids[-1] == end and think in ids
    assert tok.add_bos and tok.bos_token == "<|im_start|>" and tok.eos_token == "<|endoftext|>"
    # eos, eot key, end-of-turn names (gpt-oss's <|end|> only ends a message where <|return|> exists)
    named = {tok.token_to_id(s) for s in ("<|endoftext|>", "<|eot|>", "<|im_end|>", "<|return|>")}
    assert tok.eos_ids == named
    assert {start, end} <= tok.special_ids and think not in tok.special_ids
    assert tok.decode(ids, skip_special=True) == "user\n<think>hm</think>"
    assert tok.pad_id == 0


@pytest.mark.parametrize("pre", sorted(_PRE))
def test_every_known_pre_tokenizer_builds_and_round_trips(tiny_bpe_gguf, pre: str) -> None:
    tok = tokenizer_from_gguf(GGUFFile(tiny_bpe_gguf(pre)))
    for text in CORPUS.values():
        expected = unicodedata.normalize("NFC", text) if pre in _NFC else text
        assert tok.decode(tok.encode(text, add_special=False)) == expected


def test_unknown_pre_tokenizer_falls_back_to_gpt2(tiny_bpe_gguf, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lucebox.engine.tokenizer_gguf"):
        tok = tokenizer_from_gguf(GGUFFile(tiny_bpe_gguf("made-up-pre")))
    assert "made-up-pre" in caplog.text
    gpt2 = tokenizer_from_gguf(GGUFFile(tiny_bpe_gguf("gpt2")))
    assert tok.encode(CORPUS["numbers"]) == gpt2.encode(CORPUS["numbers"])


def train_sentencepiece(add_dummy_prefix: bool):
    """A ~700-piece SentencePiece BPE with byte fallback, trained on the corpus file."""
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT.splitlines()), model_writer=buf, model_type="bpe", vocab_size=700,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, split_by_whitespace=False, allow_whitespace_only_pieces=True,
        split_digits=True, user_defined_symbols=["<think>"], control_symbols=["<|turn|>"],
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, hard_vocab_limit=False,
    )
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def sentencepiece_gguf(sp, path: Path, add_space_prefix: bool) -> Path:
    """The GGUF llama.cpp's converter writes for a SentencePiece model: pieces, scores, types."""
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]

    def kind(i: int) -> int:
        if pieces[i] == "<think>":
            return 4
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1

    return write_gguf(path, "llama", pieces, [kind(i) for i in range(n)], pre="default",
                      scores=[sp.get_score(i) for i in range(n)], bos_token_id=1, eos_token_id=2,
                      unk_token_id=0, add_bos_token=True, add_space_prefix=add_space_prefix)


SPM_TEXTS = [*TRAINING_TEXT.splitlines(), *(v for k, v in CORPUS.items() if k not in ("chatml", "gemma_turns")),
             "x<think>y", "🫨 unseen emoji", "ĀāĂ unseen letters"]


def test_tiny_sentencepiece_matches_sentencepiece(tmp_path: Path) -> None:
    """No space prefix (Gemma's setting): the same ids and text as sentencepiece itself."""
    sp = train_sentencepiece(add_dummy_prefix=False)
    tok = tokenizer_from_gguf(GGUFFile(sentencepiece_gguf(sp, tmp_path / "spm.gguf", False)))
    assert tok.add_bos and tok.bos_token == "<s>" and tok.eos_ids == {2}
    for text in SPM_TEXTS:
        assert tok.encode(text, add_special=False) == sp.encode(text), text
        assert tok.decode(tok.encode(text), skip_special=True) == sp.decode(sp.encode(text)) == text


def test_tiny_sentencepiece_with_space_prefix_matches_transformers(tmp_path: Path) -> None:
    """With a space prefix (Llama 2's setting), compare with transformers reading the same file
    (sentencepiece itself keeps a leading space on decode that transformers and llama.cpp drop)."""
    sp = train_sentencepiece(add_dummy_prefix=True)
    path = sentencepiece_gguf(sp, tmp_path / "spm.gguf", True)
    tok = tokenizer_from_gguf(GGUFFile(path))
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*SPM_TEXTS, "<s>hi</s> there", "<|turn|>user"]:
        assert tok.encode(text) == hf.encode(text), text
        ids = tok.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("prefix", [True, False])
def test_tiny_sentencepiece_detokenizer_random_ids(tmp_path: Path, prefix: bool) -> None:
    """SentencePiece decoding strips the first space and groups byte tokens: streamed deltas
    still add up to `decode` of the whole sequence."""
    sp = train_sentencepiece(add_dummy_prefix=prefix)
    tok = tokenizer_from_gguf(GGUFFile(sentencepiece_gguf(sp, tmp_path / "spm.gguf", prefix)))
    rng = random.Random(99)
    spaces = [i for i in range(tok.vocab_size) if tok.id_to_token(i).startswith("\u2581")]
    for _ in range(1500):
        ids = [rng.choice(spaces) if r < 0.3 else rng.randrange(tok.vocab_size)
               for r in (rng.random() for _ in range(rng.randint(1, 16)))]
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip), ids


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "rwkv.gguf", "rwkv", ["a", "b"], [1, 1])
    with pytest.raises(ModelFileError, match="rwkv"):
        tokenizer_from_gguf(GGUFFile(path))


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    w.add_context_length(16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="no tokenizer"):
        tokenizer_from_gguf(GGUFFile(tmp_path / "bare.gguf"))


# --- tokenizer_from_hf_dir -------------------------------------------------------------------------


def test_hf_dir_matches_transformers(smollm2: Tokenizer, smollm2_hf, tmp_path: Path) -> None:
    smollm2_hf.save_pretrained(tmp_path)
    tok = tokenizer_from_hf_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text in CORPUS.values():
        assert tok.encode(text) == hf.encode(text) == smollm2.encode(text)
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)
    for attr in ("vocab_size", "bos_id", "eos_id", "eos_ids", "pad_id", "add_bos", "bos_token", "eos_token",
                 "special_ids"):
        assert getattr(tok, attr) == getattr(smollm2, attr), attr


def test_hf_dir_reads_generation_config_and_add_bos(smollm2_hf, tmp_path: Path) -> None:
    smollm2_hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = tokenizer_from_hf_dir(tmp_path)
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id == smollm2_hf.bos_token_id
    assert {2, 7} <= tok.eos_ids


def test_hf_dir_gemma_bos_from_post_processor(gemma3: Tokenizer, gemma3_hf, tmp_path: Path) -> None:
    gemma3_hf.save_pretrained(tmp_path)  # its tokenizer_config.json has no add_bos_token
    assert "add_bos_token" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok = tokenizer_from_hf_dir(tmp_path)
    assert tok.add_bos and tok.bos_id == gemma3.bos_id
    for name in ("ascii", "whitespace", "gemma_turns", "emoji"):
        assert tok.encode(CORPUS[name]) == gemma3.encode(CORPUS[name])


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        tokenizer_from_hf_dir(tmp_path)


# --- piecewise encoding with remembered pieces (lucebox.engine.tokenizer_cache) ------------------------


def _pieces_texts(tok: Tokenizer) -> list[str]:
    """Chat-shaped texts: long messages between the model's special tokens, odd whitespace around them."""
    specials = sorted(tok.segments.specials) if tok.segments else []
    long = " ".join(f"Line {i}: def f(x):\n    return x * {i}  # ünïcode ✓" for i in range(40))
    out = []
    for s in specials[:6]:
        out += [f"{s}system\n{long}{s}\n{s}user\n Hi  there\n\n{s}", f"{long}{s}{s} {long[:300]}\t{s}",
                f"\n{s}{long}\n\n", f"{s}x{s} y{s}  z"]
    return out


def test_piecewise_encoding_equals_encoding_whole_texts(real):
    assert real.segments is not None, "both default models' tokenizers split cleanly at special tokens"
    for text in _pieces_texts(real) + [TRAINING_TEXT]:
        assert real.segments.encode(text) == real.hf.encode(text, add_special_tokens=False).ids


@given(parts=st.lists(st.one_of(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
                                st.text(alphabet=" \n\tab1é✓<|>", max_size=300)), max_size=12))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_piecewise_encoding_equals_whole_on_any_mix(smollm2, parts):
    text = "".join(parts)
    assert smollm2.segments.encode(text) == smollm2.hf.encode(text, add_special_tokens=False).ids


def test_a_second_turn_reuses_the_first_turns_pieces(smollm2):
    seg = smollm2.segments
    system = "You are a coding agent. " * 200  # texts over 4 KB go piecewise
    turn1 = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{'Fix the bug. ' * 30}<|im_end|>\n"
    turn2 = turn1 + f"<|im_start|>assistant\n{'Done. ' * 60}<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
    smollm2.encode(turn1)
    hits = seg.hits
    assert smollm2.encode(turn2) == smollm2.hf.encode(turn2, add_special_tokens=False).ids
    assert seg.hits - hits == 2, "the system prompt and the first user message come from the cache"


def test_tokenizers_that_strip_around_specials_are_encoded_whole():
    hf = HFTokenizer(models.BPE(vocab={"a": 0, " ": 1, "b": 2}, merges=[], unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens([AddedToken("<s>", lstrip=True, rstrip=True, special=True)])
    assert SegmentCache.for_tokenizer(hf) is None


def test_remembered_pieces_stay_within_their_budget(smollm2, monkeypatch):
    import lucebox.engine.tokenizer_cache as tc

    monkeypatch.setattr(tc, "BUDGET_CHARS", 8000)  # pieces over a quarter of it are not kept
    cache = SegmentCache.for_tokenizer(smollm2.hf)
    texts = [f"<|im_start|>user\n{k} " + "word " * 200 + "<|im_end|>" for k in range(10)]
    for t in texts:
        assert cache.encode(t) == smollm2.hf.encode(t, add_special_tokens=False).ids
    assert cache._chars <= 8000 and len(cache._pieces) == 7  # the newest seven 1,008-character pieces
    assert cache.encode(texts[-1]) == smollm2.hf.encode(texts[-1], add_special_tokens=False).ids
    assert cache.hits == 1
