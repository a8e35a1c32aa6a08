"""What every API's completion shares: the engine a request names, the
fields all APIs parse alike, and the run of its engine requests.

The OpenAI routes (``openai``) and Anthropic's (``anthropic``) translate
their request and response shapes only; this module holds the rest, so a
field means the same thing under every API.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, TypeVar

from aiohttp import web

from ..serving.registry import ModelNotFound, ModelNotReady, WrongTask
from ..core.grammar import GrammarError, check_grammar, grammar_tokenizer, json_schema_grammar
from ..core.request import GenerationRequest, SpeculationConfig, StepOutput
from ..core.sampling import SamplingParams
from ..engine.embedder import Embedder
from ..engine.engine import EngineOverloaded, EngineUnavailable
from ..engine.interface import ServingEngine
from ..engine.scheduler import RequestRejected
from .bodies import BodyError, json_body
from .chat import ChatTurn, Conversation, call_grammar, splitter
from .errors import APIError, api_error, bad_request, engine_failure, model_not_found
from .images import fetch
from .keys import FETCH_IMAGE_URLS, REGISTRY

T = TypeVar("T")
# Rendering templates and tokenizing run here, off the event loop (the tokenizers release the GIL), so
# /healthz and /metrics answer whatever one request carries; one thread, as a fast tokenizer's
# settings are not safe to change from two at once.
_PREPARE = ThreadPoolExecutor(1, thread_name_prefix="specd-prepare")


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    params: SamplingParams
    speculation: dict | None  # the request's own {"method", "num_speculative_tokens"}
    n: int = 1  # choices, each its own request (they share the prompt's prefill through the prefix cache)
    response_format: dict | None = None  # a JSON schema ({} for any JSON object) the output must match
    # where the request set it and its schema, as errors name them
    format_field: str = "response_format"
    schema_field: str = "response_format.json_schema.schema"


# How each API words a missing model and a field it does not know
OPENAI_WORDING = ("'model' is required and must be a string", "unrecognized request argument supplied: {}")
ANTHROPIC_WORDING = ("model: a model name is required", "{}: extra inputs are not permitted")


def model_request(body: Any, fields: Collection[str], wording: tuple[str, str] = OPENAI_WORDING) -> dict:
    """The body, if it is a JSON object that names a model and holds only ``fields``."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request(wording[0], "model")
    for key in body:
        if key not in fields:
            raise bad_request(wording[1].format(str(key)[:64]), str(key)[:64])
    return body


def number_field(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number", key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return float(value)


def integer_field(body: dict, key: str, lo: int, hi: int | None = None, prefix: str = "") -> int | None:
    value, param = body.get(key), prefix + key
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{param}' must be an integer", param)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise bad_request(f"'{param}' must be {bound}, got {value}", param)
    return value


def speculation_for(engine: ServingEngine, asked: dict | None) -> SpeculationConfig | None:
    """The request's speculation, filling what it left out from the model's pairing."""
    if asked is None:
        return None
    default = engine.speculation
    k = asked["num_speculative_tokens"] or default.num_speculative_tokens
    return SpeculationConfig(asked["method"], k, default.ngram_min, default.ngram_max, default.tree_top_k,
                             default.tree_tokens)


def check_constraints(parsed: ParsedRequest, conversation: Conversation | None) -> None:
    """Before any engine is asked for: refuse a request whose output two things would constrain (a
    required tool call and ``response_format``), and a JSON schema no grammar can be made of (checked
    again against the model's tokenizer once the engine is known)."""
    if conversation is not None and conversation.forced and parsed.response_format is not None:
        raise bad_request(f"'{parsed.format_field}' cannot constrain a required tool call", parsed.format_field)
    if parsed.response_format is not None:
        try:
            check_grammar(json_schema_grammar(parsed.response_format), None)
        except GrammarError as err:
            raise bad_request(f"cannot enforce this schema: {err}", parsed.schema_field) from None


def request_grammar(engine: ServingEngine, parsed: ParsedRequest, turn: ChatTurn | None) -> str | None:
    """The grammar the output must match: a forced tool call, or the requested JSON (``response_format``);
    ``check_constraints`` refused a request that asked for both, before its engine was looked up."""
    forced = turn is not None and turn.forced
    if not forced and parsed.response_format is None:
        return None
    where = "tools" if forced else parsed.schema_field
    try:
        if forced:
            grammar = call_grammar(engine.tokenizer, turn.tools, turn.parallel)
        else:
            grammar = json_schema_grammar(parsed.response_format)
        tokenizer = grammar_tokenizer(engine.tokenizer, engine.vocab_size, engine.tokenizer.eos_token_ids)
        check_grammar(grammar, tokenizer)
    except GrammarError as err:
        raise bad_request(f"cannot enforce this schema: {err}", where) from None
    return grammar


async def images_fetched(request: web.Request, conversation: Conversation) -> Conversation:
    """The conversation with its image URLs fetched (a 400 where the daemon fetches none)."""
    if not any(part.url for part in conversation.images):
        return conversation
    return replace(conversation, images=await fetch(conversation.images, request.app[FETCH_IMAGE_URLS]))


async def off_loop(fn: Callable[[], T]) -> T:
    """``fn()`` on the preparing thread (its exceptions raised here)."""
    return await asyncio.get_running_loop().run_in_executor(_PREPARE, fn)


LOAD_KEEPALIVE_SECONDS = 5.0  # a streamed request waiting for its Model's load gets an SSE comment this often
WAITING_STREAM = "specd.waiting_stream"  # the request's stream, opened while its Model loads


async def engine_named(request: web.Request, name: str, stream: bool = False) -> ServingEngine:
    """The engine generating for the Model ``name`` (waiting while it loads; a ``stream``
    keeps its connection alive meanwhile), else the API error that says why not."""
    return await _serving(request, request.app[REGISTRY].engine(name), name, stream)


async def embedder_named(request: web.Request, name: str) -> Embedder:
    """The embedder of the Model ``name`` (waiting while it loads), else the API error that says why not."""
    return await _serving(request, request.app[REGISTRY].embedder(name), name, False)


async def _serving(request: web.Request, lookup: Awaitable[T], name: str, stream: bool) -> T:
    waiting = asyncio.ensure_future(lookup)
    try:
        while stream and not (await asyncio.wait({waiting}, timeout=LOAD_KEEPALIVE_SECONDS))[0]:
            await (await _opened_stream(request)).write(b": waiting for the model to load\n\n")
        return await waiting
    except ModelNotFound:
        raise model_not_found(name) from None
    except (ModelNotReady, WrongTask) as err:
        raise api_error(err) from None
    finally:
        waiting.cancel()


async def _opened_stream(request: web.Request) -> web.StreamResponse:
    """The request's server-sent event stream, opened on first use."""
    if WAITING_STREAM not in request:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        request[WAITING_STREAM] = response
    return request[WAITING_STREAM]


def stream_error(request: web.Request, err: APIError) -> bytes:
    """An error as the last event of a stream already open, in the shape of the request's API
    (the chat, completions and Messages routes end their own streams with it)."""
    if request.path.startswith("/v1/messages"):
        return f"event: error\ndata: {json.dumps(err.anthropic_body())}\n\n".encode()
    if request.path.startswith("/v1/responses"):
        # the route's own error events are numbered; a stream opened while its Model loaded has sent none
        body = {"type": "error", "sequence_number": 0, "code": err.code or err.type, "message": err.message,
                "param": err.param}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    return f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()


async def read_json(request: web.Request) -> Any:
    try:
        return await json_body(request)
    except BodyError as err:
        raise api_error(err) from None


class EngineRun:
    """One request of any API against an engine: ``n`` engine requests (one
    per choice) sharing the prompt, their outputs as they come, and each chat
    choice's text split into reasoning, content and tool calls."""

    def __init__(self, engine: ServingEngine, parsed: ParsedRequest, prompt: list[int], turn: ChatTurn | None,
                 request_id: str):
        chat = turn is not None
        self.engine, self.parsed, self.chat, self.id = engine, parsed, chat, request_id
        limit = engine.max_context - len(prompt)
        max_tokens = min(parsed.max_tokens or limit, max(limit, 1))
        speculation = speculation_for(engine, parsed.speculation)
        grammar = request_grammar(engine, parsed, turn)
        seed = parsed.params.seed
        # a seeded request gives each choice its own seed, so choices differ and are reproducible
        self.requests = [GenerationRequest(request_id if parsed.n == 1 else f"{request_id}-{i}", prompt,
                                           parsed.params if seed is None else replace(parsed.params,
                                                                                      seed=(seed + i) % 2**63),
                                           max_tokens, parsed.stop, speculation, grammar, parsed.stream,
                                           checked=True, images=turn.images if chat else None)
                         for i in range(parsed.n)]
        try:  # once, for every choice: the engine trusts a checked request
            engine.check_prompt(self.requests[0])
        except RequestRejected as err:
            raise api_error(err, param="messages" if chat and err.field == "prompt" else None) from None
        self.splitters = [splitter(engine.tokenizer, prompt, turn.tools, turn.forced)
                          for _ in range(parsed.n)] if chat else []

    async def outputs(self, index: int) -> AsyncIterator[StepOutput]:
        try:
            async for out in self.engine.generate(self.requests[index]):
                if out.error:
                    raise engine_failure(out)
                yield out
        except (RequestRejected,  # a replica on another Node checked it against its own engine
                EngineOverloaded, EngineUnavailable) as err:
            raise api_error(err) from None

    async def merged(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """Every choice's outputs as they come, tagged with the choice's index."""
        if self.parsed.n == 1:
            async for out in self.outputs(0):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for out in self.outputs(index):
                    await queue.put((index, out, None))
            except Exception as err:  # handed to the consumer, raised there
                await queue.put((index, None, err))
            await queue.put((index, None, None))
        tasks = [asyncio.ensure_future(pump(i)) for i in range(self.parsed.n)]
        try:
            running = len(tasks)
            while running:
                index, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    running -= 1
                    continue
                yield index, out
        finally:
            for task in tasks:
                task.cancel()


@asynccontextmanager
async def event_stream(request: web.Request, run: EngineRun) -> AsyncIterator[
        tuple[web.StreamResponse, tuple[int, StepOutput], AsyncIterator[tuple[int, StepOutput]]]]:
    """A run's outputs as server-sent events: the stream opens once the first output
    came (an admission error is still a plain HTTP error); a client that leaves ends
    it quietly, and closing the outputs frees the run's batch slots."""
    outputs = run.merged()
    first = await anext(outputs)
    response = await _opened_stream(request)
    try:
        yield response, first, outputs
    except ConnectionResetError:
        pass
    finally:
        await outputs.aclose()
