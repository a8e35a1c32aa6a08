"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from ..api.manifest import MAX_SPECULATIVE_TOKENS
from ..serving.registry import ServedModel
from ..engine.interface import ServingEngine
from ..core.sampling import SamplingParams
from ..core.request import Method, StepOutput, TokenLogprob
from .chat import ChatTurn, Conversation, Delta, parse_tool_choice, parse_tools, template_kwargs, template_tool_calls
from .completion import (EngineRun, ParsedRequest, check_constraints, engine_named, event_stream, images_fetched,
                         integer_field, model_request, number_field, off_loop, read_json, stream_error)
from .errors import APIError, bad_request, model_not_found
from .images import Content, ImageParts
from .keys import REGISTRY

routes = web.RouteTableDef()
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_CHOICES = 16  # n
# OpenAI fields that would change what is generated and that specd does not implement:
# refused by name rather than ignored.  A field is accepted at its no-op value.
UNSUPPORTED = {
    "functions": lambda v: v in (None, []),  # the deprecated form of tools
    "function_call": lambda v: v in (None, "none"),
    "prediction": lambda v: v is None,
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
}
# Every other field each route reads; anything else gets a 400 that names it.  ``user``, ``metadata``,
# ``store`` and ``service_tier`` change nothing that is generated and are accepted as such.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options",
                 "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
                 "seed", "user", "response_format", "speculation", "metadata", "store", "service_tier"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return tuple(stop)
    raise bad_request("'stop' must be a string or a list of at most 16 strings", "stop")


def parse_common(body: Any, chat: bool) -> ParsedRequest:
    """Validate the fields chat and text completions share."""
    model_request(body, (CHAT_FIELDS if chat else COMPLETION_FIELDS) | UNSUPPORTED.keys())
    for key, no_op in UNSUPPORTED.items():
        if key in body and not no_op(body[key]):
            raise bad_request(f"'{key}' is not supported yet", key)
    if not isinstance(body.get("user", ""), str):
        raise bad_request("'user' must be a string", "user")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    max_tokens = integer_field(body, "max_completion_tokens", 1) if chat else None
    max_tokens = max_tokens or integer_field(body, "max_tokens", 1)
    if chat:
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise bad_request("'logprobs' must be a boolean", "logprobs")
        top = integer_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    else:
        top = integer_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        logprobs, top = top is not None, top or 0
    top_k = integer_field(body, "top_k", -1)
    seed = integer_field(body, "seed", -(2**63), 2**63 - 1)
    params = SamplingParams(
        temperature=number_field(body, "temperature", 0.0, 2.0, 1.0),
        top_p=number_field(body, "top_p", 0.0, 1.0, 1.0) or 1.0,
        top_k=max(0, top_k or 0),
        min_p=number_field(body, "min_p", 0.0, 1.0, 0.0),
        seed=None if seed is None else seed % (2**63),
        logprobs=logprobs,
        top_logprobs=top,
        logit_bias=_logit_bias(body),
        presence_penalty=number_field(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=number_field(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=number_field(body, "repetition_penalty", 0.01, 2.0, 1.0),
    )
    return ParsedRequest(body["model"], stream, bool(options.get("include_usage")), max_tokens, _stop(body), params,
                         _speculation(body), integer_field(body, "n", 1, MAX_CHOICES) or 1, _response_format(body))


def _response_format(body: dict) -> dict | None:
    """``response_format``: text, ``json_object``, or ``json_schema`` (always enforced, ``strict`` or not)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                              "response_format.json_schema.schema")
        return schema
    raise bad_request("'response_format.type' must be text, json_object or json_schema", "response_format.type")


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) to a bias in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias' values must be numbers between -100 and 100, got {value!r}",
                              "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _speculation(body: dict) -> dict | None:
    """specd's extension: ``"speculation": {"method": ..., "num_speculative_tokens": k}``."""
    spec = body.get("speculation")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise bad_request("'speculation' must be an object", "speculation")
    unknown = set(spec) - {"method", "num_speculative_tokens"}
    if unknown:
        raise bad_request(f"unknown field '{sorted(unknown)[0]}'", f"speculation.{sorted(unknown)[0]}")
    try:
        method = Method(spec.get("method", Method.NONE))
    except ValueError:
        raise bad_request(f"'speculation.method' must be one of {', '.join(Method)}", "speculation.method") from None
    k = integer_field(spec, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, "speculation.")
    return {"method": method, "num_speculative_tokens": k}


def _message_content(content: Any, index: int, images: ImageParts) -> str | list[dict]:
    """A message's text, or where it holds images, its text and image parts in order (as a
    vision model's chat template takes them)."""
    where = f"messages[{index}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("message content must be a string or a list of content parts", where)
    parts = Content()
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.text(part["text"])
        elif kind == "image_url":
            url = f"{where}[{j}].image_url"
            parts.image(images.data_url(_image_url(part.get("image_url"), url), url))
        else:
            raise bad_request("content parts must be text or image_url parts", f"{where}[{j}]")
    return parts.value()


def _image_url(value: Any, where: str) -> Any:
    """An ``image_url`` part's URL (a string, or an object with ``url`` and ``detail``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise bad_request("'image_url' must be an object with a 'url'", where)
    for key in value:
        if key not in ("url", "detail"):
            raise bad_request(f"unknown field '{str(key)[:64]}'", f"{where}.{str(key)[:64]}")
    if value.get("detail", "auto") != "auto":
        raise bad_request("specd sizes an image as the model's processor does: 'detail' must be auto",
                          f"{where}.detail")
    return value.get("url")


def chat_conversation(body: dict) -> Conversation:
    """A chat completion's messages, tools and template variables, checked (no engine needed)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    clean, images = [], ImageParts()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request("each message needs a role of system, user, assistant, developer or tool",
                              f"messages[{i}].role")
        message = {"role": m["role"], "content": _message_content(m.get("content"), i, images)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = template_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        reasoning = _reasoning(m, i)
        if reasoning:  # what the model thought, as a reply reported it: the template decides what it shows
            message["reasoning_content"] = reasoning
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad_request("a tool message needs its 'tool_call_id'", f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        clean.append(message)
    tools = parse_tools(body.get("tools"))
    mode, callable_tools = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    kwargs = template_kwargs(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("low", "medium", "high"):
            raise bad_request("'reasoning_effort' must be low, medium or high", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
    return Conversation(clean, tools, callable_tools if mode != "none" else [], mode == "required", parallel, kwargs,
                        tuple(images.parts))


def _reasoning(message: dict, i: int) -> str | None:
    """An assistant message's reasoning as clients send it back: ``reasoning_content`` (as specd,
    DeepSeek and vLLM report it) or vLLM's newer ``reasoning``."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is None:
            continue
        if message["role"] != "assistant" or not isinstance(value, str):
            raise bad_request(f"'{key}' must be a string, on an assistant message", f"messages[{i}].{key}")
        return value
    return None


def completion_prompt(body: dict) -> str | list[int]:
    """A text completion's prompt, checked: its text, or its token ids (no engine needed)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)  # each id is checked against the model's vocabulary with the rest of the request
    raise bad_request("'prompt' must be a string, a list with one string, or a list of token ids", "prompt")


def prompt_tokens(engine: ServingEngine, prompt: str | list[int]) -> list[int]:
    return engine.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt


def _token_text(engine: ServingEngine, token: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes, as OpenAI's logprobs report them."""
    text = engine.tokenizer.decode([token])
    return text, list(text.encode())


class Completion(EngineRun):
    """An engine run rendered in OpenAI's shape."""

    def __init__(self, engine: ServingEngine, parsed: ParsedRequest, prompt: list[int], turn: ChatTurn | None):
        prefix = "chatcmpl-" if turn is not None else "cmpl-"
        super().__init__(engine, parsed, prompt, turn, prefix + uuid.uuid4().hex)
        self.created = int(time.time())
        self.text_offset = [0] * parsed.n
        self.calls_made = [0] * parsed.n

    def logprobs(self, items: list[TokenLogprob] | None, index: int = 0) -> dict | None:
        if items is None:
            return None
        if self.chat:
            content = []
            for lp in items:
                text, raw = _token_text(self.engine, lp.token)
                top = []
                for tid, val in lp.top:
                    t_text, t_raw = _token_text(self.engine, tid)
                    top.append({"token": t_text, "logprob": val, "bytes": t_raw})
                content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content}
        tokens, values, tops, offsets = [], [], [], []
        for lp in items:
            text, _ = _token_text(self.engine, lp.token)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append({_token_text(self.engine, t)[0]: v for t, v in lp.top})
            offsets.append(self.text_offset[index])
            self.text_offset[index] += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def usage(self, finals: list[StepOutput]) -> dict:
        """The prompt counted once, the choices' completions together; the
        speculation figures are the first choice's."""
        first = finals[0]
        completion = sum(out.completion_tokens for out in finals)
        usage = {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": first.prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}
        if first.spec is not None:
            usage["speculation"] = first.spec.as_dict()
        return usage

    def envelope(self, choices: list, usage: dict | None = None, chunk: bool = False) -> dict:
        obj = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.engine.name,
                "choices": choices}
        if usage is not None or not chunk:
            body["usage"] = usage
        return body

    async def respond(self) -> dict:
        n = self.parsed.n
        text, logprobs, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        async for index, out in self.merged():
            text[index].append(out.text)
            if out.logprobs is not None:
                logprobs[index].extend(out.logprobs)
            last[index] = out
        choices = []
        for index in range(n):
            lp = self.logprobs(logprobs[index], index) if self.parsed.params.logprobs else None
            joined = "".join(text[index])
            choice = {"index": index, "logprobs": lp}
            if self.chat:
                delta = self.splitters[index].feed(joined, finished=True)
                content = delta.content if delta.content.strip() or not delta.tool_calls else None
                message: dict = {"role": "assistant", "content": content}
                if delta.reasoning:
                    message["reasoning_content"] = delta.reasoning
                if delta.tool_calls:
                    message["tool_calls"] = self.tool_calls(delta, index, streaming=False)
                choice["message"] = message
            else:
                choice["text"] = joined
            choice["finish_reason"] = self.finish_reason(last[index], index)
            choices.append(choice)
        return self.envelope(choices, self.usage(last))

    def tool_calls(self, delta: Delta, index: int, streaming: bool) -> list[dict]:
        """A choice's new tool calls in OpenAI's shape (numbered when streamed)."""
        calls = []
        for call in delta.tool_calls:
            entry = {"id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            if streaming:
                entry["index"] = self.calls_made[index]
            self.calls_made[index] += 1
            calls.append(entry)
        return calls

    def finish_reason(self, out: StepOutput | None, index: int) -> str | None:
        reason = out.finish_reason if out else None
        return "tool_calls" if reason == "stop" and self.chat and self.calls_made[index] else reason

    def chunk(self, out: StepOutput | None, first: bool, index: int = 0) -> dict:
        choice: dict = {"index": index, "logprobs": self.logprobs(out.logprobs, index) if out else None}
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if out is not None:
                split = self.splitters[index].feed(out.text, finished=out.finish_reason is not None)
                if split.content:
                    delta["content"] = split.content
                if split.reasoning:
                    delta["reasoning_content"] = split.reasoning
                if split.tool_calls:
                    delta["tool_calls"] = self.tool_calls(split, index, streaming=True)
            choice["delta"] = delta
            choice["finish_reason"] = self.finish_reason(out, index)
        else:
            choice["finish_reason"] = out.finish_reason if out else None
            choice["text"] = out.text if out else ""
        return self.envelope([choice], chunk=True)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        async with event_stream(request, self) as (response, first, outputs):
            async def send(obj: dict) -> None:
                await response.write(f"data: {json.dumps(obj)}\n\n".encode())

            last: list[StepOutput | None] = [None] * self.parsed.n
            try:
                if self.chat:
                    for index in range(self.parsed.n):
                        await send(self.chunk(None, first=True, index=index))
                index, out = first
                await send(self.chunk(out, first=False, index=index))
                last[index] = out
                async for index, out in outputs:
                    await send(self.chunk(out, first=False, index=index))
                    last[index] = out
                if self.parsed.include_usage:
                    await send(self.envelope([], self.usage(last), chunk=True))
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
            except APIError as err:
                await response.write(stream_error(request, err))
        return response


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    body = await read_json(request)
    parsed = parse_common(body, chat)
    # the whole request is checked before its Model is asked for: a malformed one loads nothing
    conversation = chat_conversation(body) if chat else None
    prompt = None if chat else completion_prompt(body)
    check_constraints(parsed, conversation)
    if conversation is not None:
        conversation = await images_fetched(request, conversation)
    engine = await engine_named(request, parsed.model, parsed.stream)

    def prepare() -> Completion:
        if conversation is not None:
            turn = conversation.turn(engine)
            return Completion(engine, parsed, turn.prompt, turn)
        return Completion(engine, parsed, prompt_tokens(engine, prompt), None)
    completion = await off_loop(prepare)
    if parsed.stream:
        return await completion.stream(request)
    return web.json_response(await completion.respond())


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    models = sorted(registry.models.values(), key=lambda m: m.name)  # a stable order, whatever loaded first
    return web.json_response({"object": "list", "data": [_model_entry(m) for m in models]})


def _model_entry(m: ServedModel) -> dict:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "specd", "status": m.phase.value,
            "task": m.task}


@routes.get("/v1/models/{name}")
async def get_model(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    m = registry.models.get(request.match_info["name"])
    if m is None:
        raise model_not_found(request.match_info["name"])
    return web.json_response(_model_entry(m))
