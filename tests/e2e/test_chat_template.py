"""--chat-template: a template of the operator's instead of the model's, read and
checked at start by the tokenizer pool (which renders chats with it) and the frontend
(which reads how it writes tool calls); end to end with real processes."""

from __future__ import annotations

import json

import httpx
import pytest

import processes
from common.errors import ModelLoadError
from common.tokenizer import read_chat_template
from helpers import WEATHER

# Hermes-style: it names <tool_call>, so tool_choice auto is served with it.
HERMES = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
          "{% if tools %}Call a tool as <tool_call>{...}</tool_call>.\n{% endif %}"
          "{% if add_generation_prompt %}<<assistant>> {% endif %}")


def test_a_template_file_is_read_and_checked(tmp_path):
    good = tmp_path / "good.jinja"
    good.write_text(HERMES)
    assert read_chat_template(str(good)) == HERMES
    with pytest.raises(ModelLoadError, match="cannot read the chat template .*missing.jinja"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}{{ m }}\n")
    with pytest.raises(ModelLoadError, match=r"bad.jinja is not a valid Jinja template: "
                                             r"line 2: .*endfor"):
        read_chat_template(str(bad))


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_llama_dir):
    run = tmp_path_factory.mktemp("template")
    template = run / "hermes.jinja"
    template.write_text(HERMES)
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{run}/tok.sock", 1, None,
                                    "--chat-template", str(template))
    engine = processes.engine(tiny_llama_dir, f"ipc://{run}/engine.sock")
    front = processes.frontend(tiny_llama_dir, engine.address, pool.address,
                               "--served-model-name", "t", "--chat-template", str(template))
    try:
        processes.wait_healthy(front)
        yield front.url
    finally:
        for p in (front, pool, engine):
            p.stop()


def test_chats_are_rendered_and_parsed_by_the_given_template(url):
    r = httpx.post(url + "/tokenize", json={
        "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
    assert "".join(r.json()["token_strs"]) == "<<user>> hi\n<<assistant>> "
    # The model's own template writes no calls: tool_choice auto is served only
    # because the given one does, and the reply's <tool_call> is parsed.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "t", "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER], "max_tokens": 60,
        "guided_grammar": "start: " + json.dumps(call)})
    assert r.status_code == 200, r.text
    (got,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(got["function"]["arguments"]) == {"city": "Paris"}


def test_a_bad_template_stops_the_pool_and_the_frontend_at_start(tmp_path, tiny_llama_dir):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/t.sock", 1, None,
                                    "--chat-template", str(bad))
    front = processes.frontend(tiny_llama_dir, f"ipc://{tmp_path}/e.sock", pool.address,
                               "--chat-template", str(tmp_path / "none.jinja"))
    try:
        for proc, message in ((pool, "bad.jinja is not a valid Jinja template: line 1"),
                              (front, "cannot read the chat template")):
            proc.proc.wait(timeout=60)
            assert proc.proc.returncode != 0 and message in proc.output(), proc.output()
    finally:
        pool.stop()
        front.stop()
