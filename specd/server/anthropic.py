"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Served by the same engine path as the OpenAI routes (``completion.EngineRun``):
the conversation (text, ``tool_use`` and ``tool_result`` blocks) is rendered
through the model's chat template, ``tool_choice`` any/tool forces a call by
the same grammar, and the output is split into thinking, text and
``tool_use`` blocks, whole or as Anthropic's streaming events.  Errors take
Anthropic's shape (the app's middleware, by path).  Images, documents and
server tools are refused by name.

What Claude Code sends is implemented: ``thinking`` adaptive (the template
thinks, as enabled), ``output_config.effort`` (the template's
``reasoning_effort``), ``context_management``'s ``clear_thinking`` edit
(earlier turns' thinking is left out of the prompt, all but the ``keep``
newest), system messages inside ``messages`` (rendered where they stand), and
``cache_control`` marks (accepted: the prefix cache needs no marks).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from ..core.request import StepOutput
from ..core.sampling import SamplingParams
from .chat import ChatTurn, Conversation, Delta, Tool
from .errors import APIError, bad_request
from .images import Content, ImagePart, ImageParts
from .completion import (ANTHROPIC_WORDING, EngineRun, ParsedRequest, engine_named, event_stream, images_fetched,
                         integer_field, model_request, number_field, off_loop, read_json, stream_error)

routes = web.RouteTableDef()
# what /v1/messages reads (``seed`` is specd's extension); anything else gets a 400 that names it
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "thinking", "metadata", "service_tier", "seed", "context_management",
          "output_config"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "context_management",
                "output_config"}
# output_config.effort as the chat templates' reasoning_effort (they know low, medium and high)
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}
CLEAR_THINKING = "clear_thinking_20251015"
# The line Claude Code puts first in its system prompt for Anthropic's billing (its version and a
# fingerprint of the session's first message): metadata for the server, not an instruction, and
# different in every session, where it would keep sessions from sharing their 17k-token prefix
# (system prompt and tools). Dropped, as vllm-mlx and SGLang drop it.
BILLING_HEADER = "x-anthropic-billing-header:"
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def _text(content: Any, path: str) -> str:
    """A system prompt's or a tool result's text: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_block(block, f"{path}[{i}]") for i, block in enumerate(content))
    raise bad_request("content must be a string or a list of content blocks", path)


def _text_block(block: Any, path: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise bad_request(f"content blocks of type {kind!r} are not supported here", path)
    return block["text"]


def _system(content: Any) -> str:
    """The system prompt less Claude Code's billing header: its first block (or first line)."""
    if isinstance(content, list) and content and isinstance(content[0], dict) \
            and str(content[0].get("text", "")).startswith(BILLING_HEADER):
        return "".join(_text_block(block, f"system[{i}]") for i, block in enumerate(content) if i)
    text = _text(content, "system")
    return text.partition("\n")[2] if text.startswith(BILLING_HEADER) else text


def _image(block: dict, where: str, images: ImageParts) -> dict:
    """An ``image`` block: its base64 source (a URL source is refused: specd fetches nothing)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request("an image block needs a 'source'", f"{where}.source")
    if source.get("type") == "url" and isinstance(source.get("url"), str) and \
            source["url"].startswith(("http://", "https://")) and set(source) == {"type", "url"}:
        return images.link(source["url"], f"{where}.source.url")
    if source.get("type") != "base64":
        raise bad_request("source.type: must be base64, or url with an http(s) url", f"{where}.source.type")
    for key in source:
        if key not in ("type", "media_type", "data"):
            raise bad_request(f"{where}.source.{str(key)[:64]}: extra inputs are not permitted",
                              f"{where}.source.{str(key)[:64]}")
    return images.base64(source.get("data"), source.get("media_type"), f"{where}.source")


def _result(content: Any, path: str, images: ImageParts) -> str | list[dict]:
    """A tool result's content: a string, or text and image blocks."""
    if isinstance(content, str):
        return content
    parts = Content()
    for i, block in enumerate(_blocks(content, path)):
        if block["type"] == "image":
            parts.image(_image(block, f"{path}[{i}]", images))
        else:
            parts.text(_text_block(block, f"{path}[{i}]"))
    return parts.value()


def _blocks(content: Any, path: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content blocks", path)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request("each content block needs a 'type'", f"{path}[{i}]")
    return content


def _chat(body: dict, keep_thinking: int) -> tuple[list[dict], int, tuple[ImagePart, ...]]:
    """The conversation as chat-template messages, how many assistant turns'
    thinking was left out, and its images: system first, system messages in
    ``messages`` where they stand, a user's ``tool_result`` blocks as tool
    messages, an assistant's ``tool_use`` blocks as its tool calls, and the
    thinking of its ``keep_thinking`` newest turns that have some as
    ``reasoning_content``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list", "messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _system(body["system"])})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results
    images = ImageParts()
    thinking_turns = []  # (message, its thinking) of each assistant turn that has some
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_request("each message needs a role of user, assistant or system", f"messages[{i}].role")
        path = f"messages[{i}].content"
        if m["role"] == "system":
            out.append({"role": "system", "content": _text(m.get("content"), path)})
            continue
        text, calls, results, thinking = Content(), [], 0, []
        for j, block in enumerate(_blocks(m.get("content"), path)):
            where, kind = f"{path}[{j}]", block["type"]
            if kind == "tool_result" and m["role"] == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise bad_request("a tool_result needs its 'tool_use_id'", f"{where}.tool_use_id")
                result = _result(block.get("content", ""), f"{where}.content", images)
                if block.get("is_error"):
                    result = f"Error: {result}" if isinstance(result, str) else [{"type": "text", "text": "Error: "},
                                                                                 *result]
                out.append({"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, ""),
                            "content": result})
                results += 1
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise bad_request("a tool_use needs a 'name' and an object 'input'", where)
                call_id = block.get("id") if isinstance(block.get("id"), str) else f"toolu_{len(names)}"
                names[call_id] = block["name"]
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "thinking" and m["role"] == "assistant":
                if isinstance(block.get("thinking"), str) and block["thinking"]:
                    thinking.append(block["thinking"])
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue  # encrypted by another server: nothing this model can read
            elif kind == "image" and m["role"] == "user":
                text.image(_image(block, where, images))
            else:
                text.text(_text_block(block, where))
        if text.parts or calls or not results:  # a user turn of tool results alone is those results
            message = {"role": m["role"], "content": text.value()}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
            if thinking:
                thinking_turns.append((message, "".join(thinking)))
    kept = thinking_turns[len(thinking_turns) - keep_thinking:] if keep_thinking else []
    for message, thinking in kept:
        message["reasoning_content"] = thinking
    return out, len(thinking_turns) - len(kept), tuple(images.parts)


def _thinking_kept(body: dict) -> int | None:
    """How many of the newest assistant turns keep their thinking in the prompt,
    if ``context_management`` has a ``clear_thinking`` edit: its ``keep`` (one
    turn by default, as Anthropic's; ``"all"``: every turn).  None without one:
    then no earlier thinking is replayed."""
    value = body.get("context_management")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("edits", []), list):
        raise bad_request("context_management: must be an object with a list of 'edits'", "context_management")
    for key in value:
        if key != "edits":
            raise bad_request(f"context_management.{str(key)[:64]}: extra inputs are not permitted",
                              f"context_management.{str(key)[:64]}")
    kept = None
    for i, edit in enumerate(value.get("edits", [])):
        where = f"context_management.edits.{i}"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != CLEAR_THINKING:
            raise bad_request(f"{where}.type: {kind!r} is not supported; specd implements {CLEAR_THINKING!r}",
                              f"{where}.type")
        for key in edit:
            if key not in ("type", "keep"):
                raise bad_request(f"{where}.{str(key)[:64]}: extra inputs are not permitted",
                                  f"{where}.{str(key)[:64]}")
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all":
            kept = len(body.get("messages") or [])
        elif (isinstance(keep, dict) and keep.get("type") == "thinking_turns" and set(keep) == {"type", "value"}
              and isinstance(keep["value"], int) and not isinstance(keep["value"], bool) and keep["value"] >= 0):
            kept = keep["value"]
        else:
            raise bad_request(f"{where}.keep: must be 'all' or {{'type': 'thinking_turns', 'value': n}}",
                              f"{where}.keep")
    return kept


def _template_kwargs(body: dict) -> dict:
    """``thinking`` (enabled or adaptive: the template thinks; disabled: it does
    not) and ``output_config.effort``, as chat-template variables."""
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "adaptive", "disabled"):
            raise bad_request("thinking.type: must be enabled, adaptive or disabled", "thinking.type")
        for key in thinking:
            if key not in ("type", "budget_tokens", "display"):
                where = f"thinking.{str(key)[:64]}"
                raise bad_request(f"{where}: not supported by specd (it implements type, budget_tokens and display)",
                                  where)
        kwargs["enable_thinking"] = thinking["type"] != "disabled"
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise bad_request("output_config: must be an object", "output_config")
        for key in config:
            if key != "effort":
                where = f"output_config.{str(key)[:64]}"
                raise bad_request(f"{where}: not supported by specd (it implements output_config.effort)", where)
        if not isinstance(config.get("effort"), str) or config["effort"] not in EFFORTS:
            raise bad_request("output_config.effort: must be low, medium, high or max", "output_config.effort")
        kwargs["reasoning_effort"] = EFFORTS[config["effort"]]
    return kwargs


def _thinking_shown(body: dict) -> bool:
    """``thinking.display``: summarized (the default: thinking blocks hold the thinking) or omitted
    (they hold none, as Claude Code asks when it will not show them)."""
    display = (body.get("thinking") or {}).get("display", "summarized")
    if display not in ("summarized", "omitted"):
        raise bad_request("thinking.display: must be summarized or omitted", "thinking.display")
    return display == "summarized"


def _tools(body: dict) -> list[Tool]:
    value = body.get("tools")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools: must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools.{i}: server tool {kind!r} is not supported", f"tools.{i}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools.{i}.name: field required", f"tools.{i}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"tools.{i}.input_schema: must be a JSON schema object", f"tools.{i}.input_schema")
        tools.append(Tool(tool["name"], schema, tool.get("description") or ""))
    return tools


@dataclass(frozen=True)
class _Read:
    """A Messages request's conversation, checked; and, when it asked for context
    management, the thinking turns its edit cleared and the conversation that kept them."""

    conversation: Conversation
    managed: bool  # the request has context_management
    thinking_shown: bool = True  # thinking.display summarized: blocks hold the thinking (omitted: empty)
    cleared: int = 0  # assistant turns whose thinking the clear_thinking edit left out
    whole: list[dict] | None = None  # the messages with every turn's thinking (when some was cleared)


def _read(body: dict) -> _Read:
    """The conversation and what its output may hold: ``tool_choice`` auto (the
    default), none, any (some call) or tool (that one); checked without an engine."""
    tools = _tools(body)
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice.type: must be auto, any, tool or none", "tool_choice.type")
    if kind in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice: {kind!r} needs tools", "tool_choice")
    callable_tools = [] if kind == "none" else tools
    if kind == "tool":
        callable_tools = [t for t in tools if t.name == choice.get("name")]
        if not callable_tools:
            raise bad_request(f"tool_choice.name: no tool named {choice.get('name')!r}", "tool_choice.name")
    kwargs, keep, shown = _template_kwargs(body), _thinking_kept(body), _thinking_shown(body)
    messages, cleared, images = _chat(body, keep or 0)
    conversation = Conversation(messages, tools, callable_tools, kind in ("any", "tool"),
                                not choice.get("disable_parallel_tool_use"), kwargs, images)
    if body.get("context_management") is None:
        return _Read(conversation, False, shown)
    if keep is None or not cleared:
        return _Read(conversation, True, shown)
    return _Read(conversation, True, shown, cleared, _chat(body, len(body["messages"]))[0])


def _turn(engine, read: _Read) -> tuple[ChatTurn, dict | None]:
    """The prompt; and, when the request asked for context management, the edits
    applied (the thinking turns left out and the prompt tokens that saved)."""
    turn = read.conversation.turn(engine)
    if not read.managed:
        return turn, None
    if read.whole is None:
        return turn, {"applied_edits": []}
    whole = replace(read.conversation, messages=read.whole).turn(engine).prompt
    return turn, {"applied_edits": [{"type": CLEAR_THINKING, "cleared_thinking_turns": read.cleared,
                                     "cleared_input_tokens": len(whole) - len(turn.prompt)}]}


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
    seed = integer_field(body, "seed", 0, 2**63 - 1)
    params = SamplingParams(temperature=number_field(body, "temperature", 0.0, 1.0, 1.0),
                            top_p=number_field(body, "top_p", 0.0, 1.0, 1.0) or 1.0, top_k=top_k or 0, seed=seed)
    return ParsedRequest(model, stream, False, max_tokens, tuple(stop), params, None)


def _usage(out: StepOutput, prompt: int) -> dict:
    return {"input_tokens": prompt - out.cached_tokens, "output_tokens": out.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": out.cached_tokens}


def _stop(out: StepOutput, called: bool) -> tuple[str, str | None]:
    if out.stop_sequence is not None:
        return "stop_sequence", out.stop_sequence
    if called and out.finish_reason == "stop":
        return "tool_use", None
    return STOP_REASONS.get(out.finish_reason, "end_turn"), None


def _content_blocks(delta: Delta, thinking_shown: bool) -> list[dict]:
    """A split output as Anthropic's content blocks: thinking (empty if omitted), text, then tool_use."""
    blocks = []
    if delta.reasoning:
        blocks.append({"type": "thinking", "thinking": delta.reasoning if thinking_shown else "", "signature": ""})
    if delta.content.strip() or not delta.tool_calls:
        blocks.append({"type": "text", "text": delta.content})
    blocks += [_tool_use(call) for call in delta.tool_calls]
    return blocks


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = model_request(await read_json(request), FIELDS, ANTHROPIC_WORDING)
    parsed, read = _parse(body), _read(body)  # the whole request, checked before its Model is asked for
    read = replace(read, conversation=await images_fetched(request, read.conversation))
    engine = await engine_named(request, parsed.model, parsed.stream)
    turn, edits = await off_loop(lambda: _turn(engine, read))
    completion = await off_loop(lambda: EngineRun(engine, parsed, turn.prompt, turn, "msg_" + uuid.uuid4().hex))
    message = {"id": completion.id, "type": "message", "role": "assistant", "model": engine.name}
    managed = {} if edits is None else {"context_management": edits}
    if parsed.stream:
        return await _stream(request, completion, message, len(turn.prompt), managed, read.thinking_shown)
    text, last = [], None
    async for _, out in completion.merged():
        text.append(out.text)
        last = out
    delta = completion.splitters[0].feed("".join(text), finished=True)
    reason, sequence = _stop(last, bool(delta.tool_calls))
    return web.json_response({**message, "content": _content_blocks(delta, read.thinking_shown), "stop_reason": reason,
                              "stop_sequence": sequence, "usage": _usage(last, len(turn.prompt)), **managed})


class _Blocks:
    """Anthropic's streamed content blocks: a block opens when the kind of
    output changes (thinking, text, a tool call) and closes before the next."""

    def __init__(self, send, thinking_shown: bool):
        self.send = send
        self.thinking_shown = thinking_shown
        self.index = -1
        self.open: str | None = None
        self.called = False

    async def start(self, kind: str, block: dict) -> None:
        await self.close()
        self.index += 1
        self.open = kind
        await self.send("content_block_start", {"index": self.index, "content_block": block})

    async def close(self) -> None:
        if self.open is not None:
            await self.send("content_block_stop", {"index": self.index})
            self.open = None

    async def add(self, delta: Delta) -> None:
        if delta.reasoning:
            if self.open != "thinking":
                await self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.thinking_shown:
                await self.send("content_block_delta", {"index": self.index, "delta": {
                    "type": "thinking_delta", "thinking": delta.reasoning}})
        if delta.content and (self.open == "text" or delta.content.strip() or not self.called):
            if self.open != "text":
                await self.start("text", {"type": "text", "text": ""})
            await self.send("content_block_delta", {"index": self.index, "delta": {"type": "text_delta",
                                                                                  "text": delta.content}})
        for call in delta.tool_calls:
            self.called = True
            await self.start("tool_use", {**_tool_use(call), "input": {}})
            await self.send("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}})


async def _stream(request: web.Request, completion: EngineRun, message: dict, prompt: int,
                  managed: dict, thinking_shown: bool) -> web.StreamResponse:
    """Anthropic's event stream: message_start (its usage counts the prompt's
    cached tokens, known once the request is admitted), each content block's
    start, deltas and stop, message_delta (stop reason, the whole usage, the
    context edits applied), message_stop."""
    async with event_stream(request, completion) as (response, first, outputs):
        async def send(event: str, data: dict) -> None:
            await response.write(f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n".encode())

        blocks, splitter = _Blocks(send, thinking_shown), completion.splitters[0]
        try:
            last = first[1]
            await send("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                                     "stop_sequence": None, "usage": _usage(last, prompt)}})
            await blocks.add(splitter.feed(last.text, finished=last.finish_reason is not None))
            async for _, out in outputs:
                await blocks.add(splitter.feed(out.text, finished=out.finish_reason is not None))
                last = out
            if blocks.index < 0:  # an empty output still has its text block
                await blocks.start("text", {"type": "text", "text": ""})
            await blocks.close()
            reason, sequence = _stop(last, blocks.called)
            await send("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": _usage(last, prompt), **managed})
            await send("message_stop", {})
            await response.write_eof()
        except APIError as err:
            await response.write(stream_error(request, err))
    return response


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = model_request(await read_json(request), COUNT_FIELDS, ANTHROPIC_WORDING)
    read = _read(body)
    read = replace(read, conversation=await images_fetched(request, read.conversation))
    engine = await engine_named(request, body["model"])
    turn, edits = await off_loop(lambda: _turn(engine, read))
    return web.json_response({"input_tokens": len(turn.prompt), **({} if edits is None else
                                                                   {"context_management": edits})})
