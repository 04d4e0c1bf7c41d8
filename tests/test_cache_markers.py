"""Tier 1 boundaries: ChatMarkers learned from real templates and tokenizers.

Expected boundaries are found independently of the markers: render a conversation, find where each
message's content starts in the text, and tokenize the text before it; the boundary is that length.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken

from lucebox.cache.markers import ChatMarkers, NoChatMarkers
from lucebox.chat.template import ChatTemplate
from lucebox.engine.tokenizer import Tokenizer, tokenizer_from_gguf
from lucebox.engine.weights import gguf_loader
from tests.fixtures.tiny_models import hf_tokenizer, tiny_vocab

TEMPLATES = Path(__file__).parent / "data" / "templates"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "Thanks, one more: Spain?"},
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a city up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def tiny_tokenizer(arch: str, extra_specials: tuple[str, ...] = (), bos: str | None = None) -> Tokenizer:
    vocab = tiny_vocab(arch)
    hf = hf_tokenizer(vocab)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_specials])
    bos_id = hf.token_to_id(bos) if bos else vocab.bos_id
    return Tokenizer(hf, bos_id=bos_id, eos_id=vocab.eos_id, add_bos=vocab.add_bos)


def llama3_tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary with Llama 3's chat special tokens added, as Llama 3's tokenizer.json has them."""
    return tiny_tokenizer("llama", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                          bos="<|begin_of_text|>")


def load_template(name: str, tok: Tokenizer) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), bos_token=tok.bos_token, eos_token=tok.eos_token)


def expected_boundaries(template: ChatTemplate, tok: Tokenizer, messages: list[dict], starts: list[str],
                        **kwargs) -> tuple[list[int], list[int]]:
    """(ids, boundaries): where each content in `starts` begins, in tokens, plus the end (generation prompt)."""
    text = template.render(messages, **kwargs)
    ids = tok.encode(text, add_special=False)
    out, at = [], 0
    for content in starts:
        at = text.index(content, at)
        head = tok.encode(text[:at], add_special=False)
        assert ids[:len(head)] == head, f"the text before {content!r} tokenizes differently in context"
        out.append(len(head))
    return ids, out + [len(ids)]


def turn_contents(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages]


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> tuple[ChatTemplate, Tokenizer]:
    reader = gguf_loader.open_gguf(smollm2_path)
    tok = tokenizer_from_gguf(reader)
    source = gguf_loader.field(reader, "tokenizer.chat_template")
    return ChatTemplate(source, bos_token=tok.bos_token, eos_token=tok.eos_token, origin="gguf"), tok


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma3_path) -> Tokenizer:
    return tokenizer_from_gguf(gguf_loader.open_gguf(gemma3_path))


def test_smollm2_markers_are_chatml(smollm2):
    template, tok = smollm2
    m = ChatMarkers.from_template(template, tok)
    assert [tok.id_to_token(i) for i in m.start] == ["<|im_start|>"]
    assert tok.decode(m.end) == "<|im_end|>\n"
    assert tok.decode(m.header_end) == "\n"


@pytest.mark.parametrize("with_system", [True, False])
def test_smollm2_boundaries_on_a_real_conversation(smollm2, with_system):
    template, tok = smollm2
    m = ChatMarkers.from_template(template, tok)
    messages = CONVERSATION if with_system else CONVERSATION[1:]
    # Without a system message SmolLM2's template adds its own, which starts a turn too.
    starts = turn_contents(messages) if with_system else ["You are a helpful AI"] + turn_contents(messages)
    ids, expect = expected_boundaries(template, tok, messages, starts, add_generation_prompt=True)
    got = m.boundaries(ids)
    assert got == expect
    roles = ([] if with_system else ["system"]) + [msg["role"] for msg in messages] + ["assistant"]
    for b, role in zip(got, roles):
        assert tok.decode(ids[:b]).endswith(f"<|im_start|>{role}\n")


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja"])
def test_chatml_templates_with_tools(name):
    tok = tiny_tokenizer("llama")  # byte-level BPE with <|im_start|> / <|im_end|>
    template = load_template(name, tok)
    m = ChatMarkers.from_template(template, tok)
    assert [tok.id_to_token(i) for i in m.start + m.end[:1]] == ["<|im_start|>", "<|im_end|>"]
    # With tools the system turn holds the tool definitions: its content start is the system boundary.
    ids, expect = expected_boundaries(template, tok, CONVERSATION, turn_contents(CONVERSATION),
                                      add_generation_prompt=True, tools=TOOLS)
    assert m.boundaries(ids) == expect


@pytest.mark.parametrize("real_vocab", [False, True], ids=["tiny-vocab", "gemma3-270m-vocab"])
def test_gemma3_template(real_vocab, request):
    tok = request.getfixturevalue("gemma_tokenizer") if real_vocab else tiny_tokenizer("gemma3")
    template = load_template("google-gemma-3-it.jinja", tok)
    m = ChatMarkers.from_template(template, tok)
    assert [tok.id_to_token(i) for i in m.start + m.end[:1]] == ["<start_of_turn>", "<end_of_turn>"]
    # Gemma 3 folds the system message into the first user turn: that turn starts at the system text.
    starts = ["You are terse."] + turn_contents(CONVERSATION[2:])
    ids, expect = expected_boundaries(template, tok, CONVERSATION, starts, add_generation_prompt=True)
    got = m.boundaries(ids)
    assert got == expect
    assert tok.decode(ids[:got[1]]).endswith("<start_of_turn>model\n")


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_llama3_templates(name, tools):
    tok = llama3_tokenizer()
    template = load_template(name, tok)
    m = ChatMarkers.from_template(template, tok)
    assert [tok.id_to_token(i) for i in m.start] == ["<|start_header_id|>"]
    assert [tok.id_to_token(i) for i in m.end] == ["<|eot_id|>"]
    assert tok.decode(m.header_end) == "<|end_header_id|>\n\n"
    # Llama 3 always writes a system header (knowledge cutoff, date) before the system message; with tools
    # the first user turn starts with the tool instructions instead of the user's text.
    text = template.render(CONVERSATION, add_generation_prompt=True, tools=tools)
    first_user = "Given the following functions" if tools else CONVERSATION[1]["content"]
    starts = ["Cutting Knowledge Date" if tools is None else "Environment: ipython", first_user]
    starts += turn_contents(CONVERSATION[2:])
    ids, expect = expected_boundaries(template, tok, CONVERSATION, starts, add_generation_prompt=True, tools=tools)
    assert tok.encode(text, add_special=False) == ids
    assert m.boundaries(ids) == expect


def test_templates_without_role_markers_are_refused():
    tok = tiny_tokenizer("mistral")
    with pytest.raises(NoChatMarkers):  # [INST] ... [/INST]: no role names
        ChatMarkers.from_template(load_template("mistralai-Mistral-Nemo-Instruct-2407.jinja", tok), tok)
    plain = ChatTemplate("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}\n\n{% endfor %}"
                         "{% if add_generation_prompt %}### assistant:\n{% endif %}")
    chatml_tok = tiny_tokenizer("llama")
    with pytest.raises(NoChatMarkers):  # role headers in plain text, no special token to anchor on
        ChatMarkers.from_template(plain, chatml_tok)
    refusing = ChatTemplate("{{ raise_exception('no chat here') }}")
    with pytest.raises(NoChatMarkers, match="no chat here"):
        ChatMarkers.from_template(refusing, chatml_tok)


def test_content_fused_with_the_header_moves_only_its_own_boundary(smollm2):
    # "\n\n\n" tokenizes as "\n\n" + "\n", "\n  x" as "\n " + " x": the header's newline is no longer its own
    # token. That turn's boundary is then missed or lands a few tokens into the content (still a consistent
    # cache point: keys are exact token ids); every other boundary stays exact.
    template, tok = smollm2
    m = ChatMarkers.from_template(template, tok)
    messages = [{"role": "user", "content": "\n\nstarts with blank lines"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "  x\nmore"}]
    ids = tok.encode(template.render(messages, add_generation_prompt=True), add_special=False)
    got = m.boundaries(ids)
    clean = ["You are a helpful AI", "ok"]
    _, expect = expected_boundaries(template, tok, messages, clean, add_generation_prompt=True)
    assert set(expect) <= set(got) and len(got) <= len(messages) + 2
    reach = len(m.start) + m.max_role_tokens + len(m.header_end)
    starts = [i for i in range(len(ids)) if tuple(ids[i:i + len(m.start)]) == m.start]
    for b in got:
        assert any(0 < b - s <= reach for s in starts), "a boundary is always just after a role-start marker"


def test_a_role_start_without_a_header_end_in_reach_is_no_boundary(smollm2):
    template, tok = smollm2
    m = ChatMarkers.from_template(template, tok)
    word = tok.encode(" word", add_special=False)
    nl = list(m.header_end)
    ids = list(m.start) + word * (m.max_role_tokens + 1) + nl + list(m.start) + word + nl + word
    assert m.boundaries(ids) == [len(ids) - len(word)]
    assert m.boundaries(list(m.start)) == []
    assert m.boundaries(list(m.start) + word + nl) == [len(m.start) + len(word) + len(nl)]
