"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Served by the same engine path as the OpenAI routes (``openai.Completion``):
the messages are rendered through the model's chat template, and outputs are
rendered as Anthropic's message object or its streaming events.  Errors take
Anthropic's shape (the app's middleware, by path).  Tools, images and
extended thinking are refused by name until specd implements them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from ..core.request import StepOutput
from ..core.sampling import SamplingParams
from .chat import ChatTurn
from .errors import APIError, bad_request
from .openai import Completion, ParsedRequest, engine_named, integer_field, number_field, read_json

routes = web.RouteTableDef()
UNSUPPORTED = {"tools": lambda v: v in (None, []), "tool_choice": lambda v: v is None,
               "thinking": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "disabled")}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def _text(content: Any, path: str) -> str:
    """A message's or the system prompt's text: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise bad_request(f"content blocks of type {kind!r} are not supported yet", f"{path}[{i}]")
            parts.append(block["text"])
        return "".join(parts)
    raise bad_request("content must be a string or a list of content blocks", path)


def _chat(body: dict) -> list[dict]:
    """The conversation as chat-template messages (system first)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list", "messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request("each message needs a role of user or assistant", f"messages[{i}].role")
        out.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")})
    return out


def _prompt(engine, body: dict) -> list[int]:
    tokenizer = engine.tokenizer
    if not tokenizer.has_chat_template:
        raise bad_request(f"model '{engine.name}' has no chat template", "model")
    return list(tokenizer.apply_chat_template(_chat(body), add_generation_prompt=True, tokenize=True))


def _checked(body: Any) -> dict:
    """The body, if it is an object that names a model and asks nothing specd lacks."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("model: a model name is required", "model")
    for key, no_op in UNSUPPORTED.items():
        if key in body and not no_op(body[key]):
            raise bad_request(f"'{key}' is not supported yet", key)
    return body


def _parse(body: dict) -> ParsedRequest:
    model = body["model"]
    max_tokens = integer_field(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad_request("max_tokens: field required", "max_tokens")
    stop = body.get("stop_sequences") or []
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 16):
        raise bad_request("stop_sequences: must be a list of at most 16 non-empty strings", "stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be a boolean", "stream")
    top_k = integer_field(body, "top_k", 0)
    params = SamplingParams(temperature=number_field(body, "temperature", 0.0, 1.0, 1.0),
                            top_p=number_field(body, "top_p", 0.0, 1.0, 1.0) or 1.0, top_k=top_k or 0)
    return ParsedRequest(model, stream, False, max_tokens, tuple(stop), params, None)


def _usage(out: StepOutput | None, prompt: int) -> dict:
    cached = out.cached_tokens if out is not None else 0
    return {"input_tokens": prompt - cached, "output_tokens": out.completion_tokens if out is not None else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop(out: StepOutput) -> tuple[str, str | None]:
    if out.stop_sequence is not None:
        return "stop_sequence", out.stop_sequence
    return STOP_REASONS.get(out.finish_reason, "end_turn"), None


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = _checked(await read_json(request))
    parsed = _parse(body)
    engine = engine_named(request, parsed.model)
    prompt = _prompt(engine, body)
    completion = Completion(engine, parsed, prompt, ChatTurn(prompt, [], False, False))
    message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": engine.name}
    if parsed.stream:
        return await _stream(request, completion, message, len(prompt))
    text, last = [], None
    async for _, out in completion.merged():
        text.append(out.text)
        last = out
    reason, sequence = _stop(last)
    return web.json_response({**message, "content": [{"type": "text", "text": "".join(text)}],
                              "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(last, len(prompt))})


async def _stream(request: web.Request, completion: Completion, message: dict, prompt: int) -> web.StreamResponse:
    """Anthropic's event stream: message_start, one text block's start, deltas
    and stop, message_delta (stop reason, output tokens), message_stop."""
    outputs = completion.merged()
    first = await anext(outputs)  # admission errors surface as a plain HTTP error
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(event: str, data: dict) -> None:
        await response.write(f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n".encode())

    try:
        await send("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                                 "stop_sequence": None, "usage": _usage(None, prompt)}})
        await send("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        last = first[1]
        if last.text:
            await send("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": last.text}})
        async for _, out in outputs:
            if out.text:
                await send("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": out.text}})
            last = out
        await send("content_block_stop", {"index": 0})
        reason, sequence = _stop(last)
        usage = _usage(last, prompt)
        await send("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": {"output_tokens": usage["output_tokens"]}})
        await send("message_stop", {})
        await response.write_eof()
    except APIError as err:
        await send("error", {"error": err.anthropic_body()["error"]})
    except ConnectionResetError:
        pass  # the client left; closing ``outputs`` frees its batch slot
    finally:
        await outputs.aclose()
    return response


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = _checked(await read_json(request))
    engine = engine_named(request, body["model"])
    return web.json_response({"input_tokens": len(_prompt(engine, body))})
