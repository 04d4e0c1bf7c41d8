"""Open WebUI, headless, against Lucebox: a chat through its own API, then its chat page in headless Chromium."""

from __future__ import annotations

import html
import re
import subprocess

import pytest

from lucebox import procs
from lucebox.clients import openwebui
from lucebox.clients.install import is_installed
from lucebox.clients.run import prepare
from tests.clients.conftest import free_port

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def webui(server, results_dir, tmp_path_factory):
    if not is_installed("openwebui"):
        pytest.fail("openwebui is not installed: python -m lucebox clients install --clients openwebui")
    port = free_port()
    home = tmp_path_factory.mktemp("openwebui")
    _, launch = prepare("openwebui", server.url, ["serve", "--host", "127.0.0.1", "--port", str(port)], home=home)
    log = open(results_dir / "openwebui-serve.log", "wb")
    proc = procs.spawn(launch.argv, env=launch.full_env(), cwd=launch.cwd, stdout=log, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        openwebui.wait_ready(base, 300, proc)
        yield base
    finally:
        procs.stop(proc, timeout=30)
        log.close()


def test_openwebui_chat_and_screenshot(webui, server, results_dir):
    token = openwebui.signin(webui)
    models = openwebui.api(webui, "/api/models", token=token)["data"]
    lucebox_model = openwebui.api(server.url, "/v1/models")["data"][0]["id"]
    assert [m["id"] for m in models] == [lucebox_model]  # the connection lists exactly the Lucebox model

    chat_id, answer = openwebui.chat(webui, token, lucebox_model, QUESTION)
    assert answer.strip()

    png = openwebui.screenshot(webui, chat_id, results_dir / "openwebui-chat.png")
    assert png.stat().st_size > 10_000  # a rendered page, not a blank one
    dom = openwebui.dump_dom(webui, chat_id)
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    assert QUESTION in text, "the chat page does not show the question"
    first_words = " ".join(answer.split()[:4])
    assert first_words in re.sub(r"\s+", " ", text), f"the chat page does not show the answer {answer!r}"
