"""A replica of a Model that another Node's daemon serves, as a ``ServingEngine``.

The head renders, tokenizes and checks a request exactly as for an engine of
its own (with the Model's tokenizer, and the context window and drafter the
worker reported); the worker runs the ``GenerationRequest`` on its engine and
streams each ``StepOutput`` back as one JSON line (the admin API's
``models/{name}/generate`` subresource, which only the cluster token opens on a
worker). So usage, ``cached_tokens`` and the speculation report arrive as the
worker's engine made them, and every API the head serves reaches every replica
the same way. A consumer that stops closes the connection, which cancels the
request on the worker; a Node that goes NotReady mid-stream (a Mac that hangs or
is cut off keeps its connections open) ends the request with an error naming it.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable

import aiohttp
import numpy as np

from ..core.embedding import Pooling
from ..core.request import GenerationRequest, Method, SpecStats, SpeculationConfig, StepOutput, TokenLogprob
from ..core.sampling import SamplingParams
from ..speculation.config import PolicySettings
from ..engine.embedder import Embedder, EmbeddingFailed, check_rows
from ..engine.engine import EngineOverloaded, EngineUnavailable
from ..engine.interface import ServingEngine, drain_within
from ..engine.scheduler import RequestRejected, check_request
from ..api.paths import MODEL_EMBED as EMBED, MODEL_GENERATE as GENERATE
from .fence import EPOCH_HEADER

WATCH_SECONDS = 2.0  # how often a replica with answers open looks at its Node's health


class ReplicaUnreachable(EngineUnavailable):
    """The replica's Node failed before the request's first token (HTTP 503: nothing was
    generated, so the client may send it again); after one, the stream ends with an error."""


def engine_report(engine: ServingEngine | Embedder) -> dict[str, Any]:
    """What a head needs of a worker's engine to check and route requests to it, and to show it."""
    if isinstance(engine, Embedder):
        return {"maxContext": engine.max_context, "vocabSize": engine.vocab_size, "dimensions": engine.dimensions,
                "pooling": asdict(engine.pooling)}
    return {"maxContext": engine.max_context, "vocabSize": engine.vocab_size, "drafter": engine.drafter,
            "incarnation": id(engine),  # a reloaded engine's RAM holds none of its predecessor's prefixes
            "speculation": asdict(engine.speculation), "speculationStatus": engine.speculation_status(),
            "prefixCache": engine.prefix_cache_status(), "kvCache": engine.kv_cache_status()}


def request_to_json(request: GenerationRequest) -> dict[str, Any]:
    """The request as a worker reads it (whether the head checked it is the head's business: a
    worker checks what it is sent against its own engine)."""
    body = asdict(request)
    del body["checked"]
    return body


def request_from_json(body: dict[str, Any]) -> GenerationRequest:
    """The request a head sent (TypeError or ValueError if it is not one)."""
    params = dict(body["params"])
    params["logit_bias"] = tuple((int(t), float(b)) for t, b in params["logit_bias"])
    speculation = body.get("speculation")
    return GenerationRequest(
        str(body["request_id"]), [int(t) for t in body["prompt_tokens"]], SamplingParams(**params),
        int(body["max_tokens"]), tuple(str(s) for s in body["stop"]),
        None if speculation is None else SpeculationConfig(**{**speculation, "method": Method(speculation["method"])}),
        body.get("grammar"), bool(body.get("stream", True)))


def output_to_json(out: StepOutput) -> dict[str, Any]:
    return asdict(out)


def output_from_json(body: dict[str, Any]) -> StepOutput:
    """An output as the worker sent it (``body`` is consumed)."""
    logprobs, spec = body.pop("logprobs"), body.pop("spec")
    return StepOutput(**body, logprobs=None if logprobs is None else [
        TokenLogprob(p["token"], p["logprob"], tuple(tuple(t) for t in p["top"])) for p in logprobs],
        spec=None if spec is None else SpecStats(**{**spec, "method": Method(spec["method"])}))


class _Remote:
    """What a head's client of one worker's replica keeps: the Node, its connection, what is in flight."""

    failure: str | None = None  # a replica that cannot serve is left out by the Node's heartbeats instead
    fault: str | None = None
    faults = 0
    vision = None
    image_refusal = "images are not sent to a replica on another Node yet"

    def __init__(self, name: str, node: str, address: str, session: Callable[..., aiohttp.ClientSession], tokenizer,
                 engine: dict[str, Any], lost: Callable[[], str | None], epoch: Callable[[], int]):
        self.name, self.node, self.address, self.tokenizer = name, node, address.rstrip("/"), tokenizer
        self.update(engine)
        self._lost = lost  # why the Node cannot serve now (NotReady), or None
        self._new_session = session  # the cluster's: TLS to the workers, with the token (``Cluster.session``)
        self._epoch = epoch  # the Model's placement epoch now, sent with each call (``serving/fence.py``)
        self._in_flight = 0
        self._session: aiohttp.ClientSession | None = None
        self._open: dict[aiohttp.ClientResponse, None] = {}  # answers being read
        self._cut: dict[aiohttp.ClientResponse, str] = {}  # answers the watcher closed, and why
        self._watcher: asyncio.Task | None = None

    def update(self, engine: dict[str, Any]) -> None:
        """The worker's latest report of its engine (``engine_report``)."""
        self.max_context: int = engine["maxContext"]
        self.vocab_size: int = engine["vocabSize"]
        self.reported = engine

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        """Nothing to start: the worker's engine runs already."""

    @asynccontextmanager
    async def _post(self, path: str, body: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """The worker's answer, refused (``_refusal``) unless it is a 200; watched while it is
        awaited and read: a Node gone NotReady has its calls and answers cut, and waiting for or
        reading one raises ConnectionResetError naming the Node."""
        if self._session is None:  # made on the event loop that serves the requests
            self._session = self._new_session(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                              read_bufsize=2**20)
        self._in_flight += 1
        sent = asyncio.ensure_future(self._session.post(self.address + path.format(self.name), json=body,
                                                        headers={EPOCH_HEADER: str(self._epoch())}))
        try:
            async with await self._answered(sent) as response:
                if response.status != 200:
                    raise _refusal(response.status, await response.text(), self.node)
                self._open[response] = None
                if self._watcher is None or self._watcher.done():
                    self._watcher = asyncio.ensure_future(self._watch())
                try:
                    yield response
                except (aiohttp.ClientError, ConnectionError, OSError) as exc:
                    if response in self._cut:
                        raise ConnectionResetError(self._cut[response]) from exc
                    raise
                finally:
                    self._open.pop(response, None)
                    self._cut.pop(response, None)
        finally:
            sent.cancel()  # the answer never came (nothing if it did)
            self._in_flight -= 1

    async def _answered(self, sent: asyncio.Future) -> aiohttp.ClientResponse:
        """The worker's answer once its headers arrive. A Node that goes NotReady before they do (a
        Mac that hangs or is cut off keeps the connection open) fails the call, naming the Node."""
        while not (await asyncio.wait({sent}, timeout=WATCH_SECONDS))[0]:
            if (why := self._lost()) is not None:
                raise ConnectionResetError(f"Node {self.node} is {why}")
        return sent.result()

    async def _watch(self) -> None:
        """While answers are open: one look at the Node's health every ``WATCH_SECONDS`` (a Mac that
        hangs or is cut off keeps its connections open), rather than one per read."""
        while self._open:
            await asyncio.sleep(WATCH_SECONDS)
            if (why := self._lost()) is not None:
                for response in list(self._open):
                    self._cut[response] = f"Node {self.node} is {why}"
                    response.close()

    def _failed(self, exc: BaseException) -> str:
        return f"the replica's Node {self.node} failed: {exc}"

    async def shutdown(self, grace: float = 30.0) -> None:
        """Let requests in flight finish within ``grace`` (``drain_within``); the worker's engine keeps running."""
        await drain_within(lambda: bool(self._in_flight), grace)
        if self._session is not None:
            await self._session.close()

    def group_status(self) -> dict | None:
        return None

    def exported_metrics(self) -> str | None:
        """The worker's series are on its own ``/metrics``."""
        return None


class RemoteEngine(_Remote):
    """A generation Model's replica on a worker Node, as a ``ServingEngine``."""

    def update(self, engine: dict[str, Any]) -> None:
        super().update(engine)
        self.drafter: Method | None = Method(engine["drafter"]) if engine.get("drafter") else None
        spec = engine["speculation"]
        self.speculation = SpeculationConfig(**{**spec, "method": Method(spec["method"])})

    def check_prompt(self, request: GenerationRequest) -> None:
        check_request(request, self.name, self.drafter, self.max_context, self.vocab_size)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        answered = False
        try:
            async with self._post(GENERATE, request_to_json(request)) as response:
                pending = b""
                while chunk := await response.content.readany():
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        out = output_from_json(json.loads(line))
                        answered = True
                        yield out
                        if out.finish_reason is not None or out.error is not None:
                            return
                raise ConnectionResetError("the worker ended the stream early")
        except (aiohttp.ClientError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
            if not answered:
                raise ReplicaUnreachable(self._failed(exc)) from None
            yield StepOutput("", [], None, error=self._failed(exc))

    def set_policy(self, policy: PolicySettings | None, name: str | None) -> None:
        """The worker's own control plane applies policies to its engine."""

    def speculation_status(self) -> dict:
        return self.reported.get("speculationStatus", {"default": self.speculation.method})

    def prefix_cache_status(self) -> dict:
        return self.reported.get("prefixCache", {})

    def kv_cache_status(self) -> dict:
        return self.reported.get("kvCache", {})


class RemoteEmbedder(_Remote):
    """An embedding Model's replica on a worker Node, as the embeddings route sees an ``Embedder``."""

    def update(self, engine: dict[str, Any]) -> None:
        super().update(engine)
        self.dimensions: int = engine["dimensions"]
        self.pooling = Pooling(**engine["pooling"])

    def check_rows(self, rows: list[list[int]]) -> None:
        check_rows(rows, self.name, self.max_context, self.vocab_size)

    async def embed(self, rows: list[list[int]]) -> np.ndarray:
        self.check_rows(rows)
        try:
            async with self._post(EMBED, {"rows": rows}) as response:
                return np.asarray((await response.json())["vectors"], dtype=np.float32)
        except (aiohttp.ClientError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
            raise EmbeddingFailed(self._failed(exc)) from None


def _refusal(status: int, text: str, node: str) -> Exception:
    """What a worker's refusal means to the route: its own reason, as the local engine would raise it."""
    try:
        body = json.loads(text)
        message, field = body.get("message", text), (body.get("details") or {}).get("causes", [{}])[0].get("field")
    except (ValueError, AttributeError, IndexError):
        message, field = text, None
    if status == 400:
        return RequestRejected(message, field or "prompt")
    if status == 429:
        return EngineOverloaded(message)
    return EngineUnavailable(f"the replica on Node {node} cannot serve: {message}")
