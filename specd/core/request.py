"""What a request asks of an engine and what it gets back, as plain data
shared by the HTTP layer, the scheduler and speculation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling import SamplingParams
from .vision import PromptImages


class Method(enum.StrEnum):
    """How proposals are made; a member equals (and serialises as) its string."""

    NONE = "none"
    NGRAM = "ngram"
    DRAFT = "draft"
    EAGLE = "eagle"
    MTP = "mtp"  # the head the target's checkpoint ships
    DFLASH = "dflash"  # a block drafter: one forward drafts k tokens


# the methods that draft with a model the pairing attaches, and what each is called
DRAFTERS = {Method.DRAFT: "draft model", Method.EAGLE: "EAGLE head", Method.MTP: "MTP head",
            Method.DFLASH: "DFlash drafter"}


@dataclass(frozen=True)
class SpeculationConfig:
    """``method``; k proposals per round (an EAGLE tree's depth); n-gram
    match lengths; EAGLE tree shape (``tree_top_k`` 1 drafts a chain; else
    each expansion keeps that many children and the tree is cut to
    ``tree_tokens`` nodes)."""

    method: Method = Method.NONE
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    tree_top_k: int = 1
    tree_tokens: int = 16

    @property
    def enabled(self) -> bool:
        return self.method != Method.NONE and self.num_speculative_tokens > 0


NO_SPECULATION = SpeculationConfig()


@dataclass(frozen=True)
class GenerationRequest:
    """A tokenised request, as the HTTP layer hands it to an engine."""

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    speculation: SpeculationConfig | None = None  # None: the model's default
    grammar: str | None = None  # an llguidance grammar the output must match (core/grammar.py)
    stream: bool = True  # False: the client reads only the whole answer (a replica on another Node sends one piece)
    checked: bool = False  # the route checked it against this engine (``check_prompt``): the engine trusts it
    images: PromptImages | None = None  # the prompt's images, as the Model's processor made them


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SpecStats:
    """A request's speculation so far, as its usage reports it: the method in
    effect (its own ``speculation`` or the Model's pairing, ``source``), rounds
    that verified proposals, and steps it decoded plainly though speculating
    (the controller chose k = 0, or nothing matched to propose); and the rounds
    by the method that proposed them, as ``/metrics`` counts them (a draft
    pairing's free prompt lookups under ``ngram``)."""

    plain_steps: int = 0
    method: Method = Method.NONE
    source: str = "model"  # "request": its own speculation field; "model": the Model's DraftPairing
    by_method: dict[Method, list[int]] = field(default_factory=dict)  # method -> [rounds, drafted, accepted]: the totals sum them

    def count(self, drafted: int, accepted: int, method: Method) -> None:
        """One round's proposals, made by ``method``."""
        totals = self.by_method.setdefault(method, [0, 0, 0])
        for i, n in enumerate((1, drafted, accepted)):
            totals[i] += n

    rounds = property(lambda self: self._total(0))
    drafted = property(lambda self: self._total(1))
    accepted = property(lambda self: self._total(2))

    def _total(self, i: int) -> int:
        return sum(totals[i] for totals in self.by_method.values())

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "source": self.source,
            "plain_steps": self.plain_steps,
            **_rates(self.rounds, self.drafted, self.accepted),
            "by_method": {m: _rates(*totals) for m, totals in self.by_method.items()},
        }


def _rates(rounds: int, drafted: int, accepted: int) -> dict:
    return {
        "rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_accepted_length": round(accepted / rounds, 4) if rounds else 0.0,
    }


@dataclass
class StepOutput:
    """What one engine step produced for one request (possibly several tokens)."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    stop_sequence: str | None = None  # the stop string that ended the request
    error: str | None = None
    spec: SpecStats | None = None  # set on the final output of a speculating request
    error_code: str | None = None  # what kind of error, where the API answers it apart (``server/errors.py``)


def merge_outputs(outputs: list[StepOutput]) -> StepOutput:
    """Consecutive outputs of one request as one: their text, tokens and logprobs in order, and
    the last one's ending, counts and speculation report."""
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    logprobs = [p for out in outputs for p in out.logprobs or ()]
    return StepOutput("".join(out.text for out in outputs), [t for out in outputs for t in out.tokens],
                      logprobs if any(out.logprobs is not None for out in outputs) else None, last.finish_reason,
                      last.prompt_tokens, last.completion_tokens, last.cached_tokens, last.stop_sequence,
                      last.error, last.spec, last.error_code)
