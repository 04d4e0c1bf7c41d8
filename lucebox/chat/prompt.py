"""Conversation → prompt token ids, the one way every entry point does it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lucebox.chat.template import ChatTemplate, resolve_chat_template
from lucebox.engine.tokenizer import Tokenizer
from lucebox.engine.weights.loader import LoadedModel


class PromptBuilder:
    """The model's chat template plus its tokenizer.

    Rendered text is tokenized without adding BOS: templates write the BOS
    token themselves, as transformers' `apply_chat_template` assumes.
    """

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, loaded: LoadedModel, override_file: Path | None = None) -> PromptBuilder:
        tok = loaded.tokenizer
        template = resolve_chat_template(
            override_file=override_file,
            gguf_template=loaded.chat_template,
            tokenizer_config=loaded.tokenizer_config,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
        )
        return cls(template, tok)

    def render(self, messages: list[dict], **kwargs: Any) -> str:
        return self.template.render(messages, **kwargs)

    def render_ids(self, messages: list[dict], **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(self.render(messages, **kwargs), add_special=False)
