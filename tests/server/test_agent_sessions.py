"""Agent sessions as the real clients sent them keep their prefix: each request after the first
renders as all of the previous prompt but a few tokens, then its new tail, which is what the
prefix cache reuses.

The requests are the fixtures ``ops/bench/agent_capture.py`` recorded from Claude Code, Codex CLI
and OpenCode (``ops/bench/fixtures/agent_sessions``, with the clients' versions), rendered by the
routes' own readers with the forge's agent template. The few tokens a request does not keep are
where the previous prompt opened the reply (``<think>``, which the template does not render for a
turn sent back without reasoning) and, for Claude Code, a reminder it appends to the user's last
message after a reply with no visible text.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from mlx_lm.utils import load_tokenizer

from conftest import ROOT
from specd.core.prefix import common_prefix
from specd.server.anthropic import _read
from specd.server.openai import chat_conversation
from specd.server.responses import _conversation

FIXTURES = ROOT / "ops" / "bench" / "fixtures" / "agent_sessions"
MOST_LOST = 12  # previous-prompt tokens a request may not keep (Claude Code's appended reminder: 9 or 10)


@pytest.fixture(scope="module")
def agent(forged, tmp_path_factory):
    from specd.forge import AGENT_CONTEXT
    from specd.forge.chat import chat_variant

    path = chat_variant(forged / "draft", tmp_path_factory.mktemp("agent") / "agent", "hermes", context=AGENT_CONTEXT)
    return SimpleNamespace(tokenizer=load_tokenizer(path), name="agent")


def conversation(path: str, body: dict):
    if path.startswith("/v1/messages"):
        return _read(body).conversation
    if path.startswith("/v1/responses"):
        return _conversation(body, [], drop_hosted=True)[0]
    return chat_conversation(body)


@pytest.mark.parametrize("client", ["claude-code", "codex", "opencode"])
def test_each_request_of_a_session_starts_with_the_previous_prompt(client, agent):
    session = json.loads((FIXTURES / f"{client}.json").read_text())
    assert session["version"] and len(session["requests"]) >= 4
    prompts = [conversation(r["path"], r["body"]).turn(agent).prompt for r in session["requests"]]
    for i, (before, after) in enumerate(zip(prompts, prompts[1:]), 1):
        lost = len(before) - common_prefix(before, after)
        assert lost <= MOST_LOST, f"request {i} keeps all but {lost} tokens of the one before"
    if client == "claude-code":  # the billing line differs between sessions: it is not in any prompt
        assert session["requests"][0]["body"]["system"][0]["text"].startswith("x-anthropic-billing-header:")
        assert "x-anthropic-billing-header" not in agent.tokenizer.decode(prompts[0])
