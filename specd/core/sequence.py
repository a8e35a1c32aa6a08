"""A request's life inside the engine: its tokens, text, stop rules and outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .grammar import Constraint
from .request import GenerationRequest, Method, SpecStats, StepOutput, TokenLogprob
from .sampling import SamplingParams, make_key


class StopMatcher:
    """Finds stop strings in streamed text, even across token boundaries.

    Text that could still become the start of a stop string is held back, so
    a client never sees part of a stop string.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, text: str) -> tuple[str, bool]:
        """Return the text that is safe to emit and whether a stop string was hit."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            index, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:index], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request; touched only by the engine thread."""

    request: GenerationRequest
    emit: Callable[[StepOutput], None]
    detokenizer: object
    eos_ids: frozenset[int]
    max_total_tokens: int
    constraint: Constraint | None = None  # the request's grammar, at the tokens accepted so far
    key: mx.array = field(init=False)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why it ended with an error (``failed``)
    cancelled: bool = False
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (at its first prefill)
    restored_tokens: int = 0  # tokens its latest prefill started from in the prefix cache
    preemptions: int = 0  # times it left the batch to make room in the KV budget, to be recomputed
    produced: int = 0  # tokens the model produced for it, those after its finish included
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    stats: SpecStats = field(default_factory=SpecStats)  # its speculation, as the final output reports it

    def __post_init__(self) -> None:
        self.key = make_key(self.request.params.seed)
        images = self.request.images
        # what the prefix cache knows the prompt by: its image tokens keyed by their pixels
        self.prompt_keys = self.prompt if images is None else images.keys(self.prompt)
        self.prompt_embeddings: mx.array | None = None  # an image prompt's, while it prefills (``VisionTower``)
        self.stops = StopMatcher(self.request.stop)
        self.detokenizer.reset()
        asked = self.request.speculation
        if asked is not None:  # reported even if it ends before a decode step, or asked for none
            self.stats.method, self.stats.source = asked.method, "request"

    @property
    def ended(self) -> bool:
        """Whether it has had its last output (finished or failed), or its client went away."""
        return self.finish_reason is not None or self.error is not None or self.cancelled

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_tokens

    @property
    def prefill_tokens(self) -> list[int]:
        """What a prefill runs over: every token of the context but the last,
        which the decode step feeds (``next_input``). So no prefill computes
        logits, and a row's first token is sampled with the batch's."""
        return (self.prompt + self.tokens)[:-1]

    @property
    def context_keys(self) -> list[int]:
        """The context as the prefix cache knows it (``prompt_keys``, then the tokens produced)."""
        return self.prompt_keys + self.tokens

    @property
    def prefill_keys(self) -> list[int]:
        """``prefill_tokens`` as the prefix cache knows them."""
        return self.context_keys[:-1]

    @property
    def next_input(self) -> int:
        """The token a decode step feeds next: the prompt's last, then the last one produced."""
        return (self.tokens or self.prompt)[-1]

    @property
    def context_length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def _speculated(self) -> bool:
        """Whether the final output reports speculation: the request set it, or the model speculated."""
        return self.request.speculation is not None or self.stats.method != Method.NONE

    def accept(self, new_tokens: list[int], logprobs: list[TokenLogprob] | None) -> StepOutput:
        """Append tokens in order, stopping at EOS, a stop string or a limit.

        Tokens after the one that finishes the request are discarded, so a step
        that produced several tokens never overshoots max_tokens or a stop.
        """
        self.produced += len(new_tokens)
        text_parts: list[str] = []
        taken: list[int] = []
        hit_stop_string = False
        for token in new_tokens:
            taken.append(token)
            self.tokens.append(token)
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            self.detokenizer.add_token(token)
            safe, hit_stop_string = self.stops.feed(self.detokenizer.last_segment)
            text_parts.append(safe)
            if hit_stop_string:
                self.finish_reason = "stop"
                break
            if len(self.tokens) >= self.request.max_tokens or self.context_length >= self.max_total_tokens:
                self.finish_reason = "length"
                break
        if self.constraint is not None:
            self.constraint.advance(taken)
        if self.finish_reason is not None and not hit_stop_string:
            self.detokenizer.finalize()
            safe, hit_stop_string = self.stops.feed(self.detokenizer.last_segment)
            text_parts.append(safe if hit_stop_string else safe + self.stops.flush())
        return StepOutput(
            text="".join(text_parts),
            tokens=taken,
            logprobs=logprobs[: len(taken)] if logprobs is not None else None,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.tokens),
            cached_tokens=self.cached_tokens,
            stop_sequence=self.stops.matched,
            spec=self.stats if self.finish_reason is not None and self._speculated() else None,
        )

    def failed(self, message: str, code: str | None = None) -> StepOutput:
        """The output that ends this request with an error (``code``: its kind, where the API
        answers it apart)."""
        self.error = message
        return StepOutput(text="", tokens=[], logprobs=None, error=message, error_code=code,
                          prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens))
