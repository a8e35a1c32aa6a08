"""The Anthropic Messages API, through the official ``anthropic`` client,
against the daemon's forged model: served by the same engine path as the
OpenAI routes, with Anthropic's message object, stream events and errors."""

from __future__ import annotations

import anthropic
import pytest

from conftest import code_sample


@pytest.fixture(scope="module")
def claude(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=60)


SYSTEM = "You continue Python code."
MESSAGES = [{"role": "user", "content": code_sample("engine")[:300]}]
GREEDY = {"temperature": 0}  # the 2.x client no longer takes sampling settings as arguments


def test_a_message_and_its_stream_agree(claude, client):
    """Greedy: the message, its stream and the OpenAI route give the same text;
    usage counts the prompt (cached tokens apart) and the output."""
    message = claude.messages.create(model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=16,
                                     extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens <= 16
    with claude.messages.stream(model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=16,
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text and streamed.stop_reason == message.stop_reason
    openai_chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM}, *MESSAGES], max_tokens=16, temperature=0)
    assert openai_chat.choices[0].message.content == message.content[0].text
    counted = claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens == \
        openai_chat.usage.prompt_tokens


def test_stop_sequences_and_text_blocks(claude):
    blocks = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"][:150]},
                                           {"type": "text", "text": MESSAGES[0]["content"][150:]}]}]
    full = claude.messages.create(model="tiny", system=[{"type": "text", "text": SYSTEM}], messages=blocks,
                                  max_tokens=24, extra_body=GREEDY).content[0].text
    same = claude.messages.create(model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=24,
                                  extra_body=GREEDY).content[0].text
    assert full == same
    stop = full.strip()[len(full.strip()) // 2:][:3]
    assert stop
    stopped = claude.messages.create(model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=24,
                                     extra_body=GREEDY, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stop not in stopped.content[0].text and full.startswith(stopped.content[0].text)


def test_errors_come_in_anthropics_shape(claude):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="tiny", messages=MESSAGES, max_tokens=4,
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert err.value.body["type"] == "error" and "tools" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}],
            max_tokens=4)
    assert "image" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny", messages=MESSAGES, max_tokens=0)
