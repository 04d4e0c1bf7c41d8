"""The HTTP API: one module per dialect plus the server's own endpoints.

Each module has `register(router, ctx)`; `register_all` wires them into one Router.
"""

from __future__ import annotations

from lucebox.api import anthropic, info, openai_chat, openai_responses
from lucebox.api.common import ServerContext
from lucebox.http import Router


def register_all(router: Router, ctx: ServerContext) -> None:
    for module in (info, openai_chat, openai_responses, anthropic):
        module.register(router, ctx)
