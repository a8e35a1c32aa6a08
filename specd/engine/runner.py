"""The model runner: executes what the scheduler planned, every forward of the target.

- a prefill chunk (``prefill``): the forward over the planned columns of a
  group's contexts (every token of a row's context but the last), for keys
  and values only (no logits); the speculator's drafters see it;
- a decode step (``decode``): the round's proposals (``Speculator.propose``:
  nothing, when no row may speculate), one forward over ``[last,
  proposals...]`` per row (or every row's draft tree, with ancestor-only
  attention), ``last`` being its context's last token (so a row that just
  joined samples its first token here, with the batch's), the logits
  processors, and then one sampled token per row or, when some row proposed,
  the verdict (``speculation.verifier``), after which every drafter commits
  and the target's cache forgets each row's rejected columns.

The logits processors, in this order: each row's ``logit_bias`` and
presence, frequency and repetition penalties (``adjust_logits``, every
position with its own context), then its grammar's mask (``mask_logits``),
so a speculating row and a plain one are decided by the same distribution.

**Running ahead.** A plain step (no row may speculate, or a goodput policy
measured plain decoding best and has no try due, or its rows' estimates pay
for no proposal and no probe is due; none has a grammar or a penalty that
reads its latest token) needs nothing from the host between its sampled
tokens and the next step's inputs (a drafter that reads the target's
features, an EAGLE, MTP or DFlash one, takes each step's as its forward is
built, so the next one built ahead does not replace them). Where
``decode_ahead`` is on, the runner builds and starts the next step's forward
over the tokens this one is still sampling before it waits for them (mlx-lm's
generators do the same with ``mx.async_eval``), so the host's work for step n+1 (building its graph,
handing out step n's tokens) overlaps the device's work. The scheduler's next
plan then takes that step as it is (rows that finished meanwhile drop out of
it); a plan it does not fit (a row joined, a row speculates) drops it: each
row forgets the column it wrote and gets its RNG key back, as if it had never
run.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import mlx.core as mx
import mlx.nn as nn

from ..core import cpu_fast, cpu_jit, dispatch
from ..core.batch import RunningBatch
from ..core.grammar import mask_logits
from ..core.layout import clock
from ..core.model_parts import decoder
from ..core.sampling import adjust_logits, sample_rows
from ..core.sequence import Sequence
from ..core.vision import VisionTower
from ..metrics import Metrics
from ..speculation.proposer import Outcome, Proposal
from ..speculation.speculator import Speculator
from ..speculation.verifier import verify_round
from .plan import DecodeStep, PrefillChunk, PrefillGroup

# Hands a step's tokens to the requests: deliver(seqs, logits, emitted), logits[b, j] produced emitted[b][j].
Deliver = Callable[[list[Sequence], mx.array, list[list[int]]], None]


@dataclass
class Launched:
    """A plain decode step on its way: its forward built and started, one token per row sampled lazily."""

    seqs: list[Sequence]
    tokens: mx.array  # (B,)
    logits: mx.array  # (B, 1, V): what produced each token
    keys: list[mx.array]  # each row's RNG key before the step (given back if it is dropped)
    features: mx.array | None  # the target features a drafter reads, taken as the forward was built

    def rows(self, index: list[int]) -> "Launched":
        if index == list(range(len(self.seqs))):
            return self
        take = mx.array(index)
        return Launched([self.seqs[i] for i in index], self.tokens[take], self.logits[take],
                        [self.keys[i] for i in index], None if self.features is None else self.features[take])


class ModelRunner:
    """Runs the target's forwards for one engine, as the scheduler planned them."""

    def __init__(self, name: str, model: nn.Module, speculator: Speculator, metrics: Metrics,
                 max_context: Callable[[], int], decode_ahead: bool, vision: VisionTower | None = None):
        self.name = name
        self.model = model
        self.vision = vision
        self.speculator = speculator
        self.metrics = metrics
        self.max_context = max_context
        self.decode_ahead = decode_ahead
        self.ahead: Launched | None = None  # the next plain step, started before this one's tokens were read
        cpu_jit.install()  # on an x86-64 CPU, MLX's compiled kernels with its FMA
        cpu_fast.install()  # on MLX's CPU backend, a step's norms and RoPE as compiled functions

    def prefill(self, chunk: PrefillChunk) -> None:
        """One prefill chunk of a group's rows: their keys and values only. Its logits are
        never evaluated (lazy, they cost nothing): a context's last token is fed by the
        decode step, as mlx-lm's generators feed it apart from the prompt. A chunk before
        the group's last is evaluated here; the last one's with the decode step after it."""
        group = chunk.group
        tokens = group.tokens[:, chunk.start:chunk.end]
        with self._positioned(group, chunk):
            group.cache.forward(self.model, tokens, embeddings=self._embeddings(group, chunk, tokens))
        self.speculator.prefilled(group.seqs, chunk.start, chunk.end, group.padding(), first=chunk.first)
        if not chunk.last:
            mx.eval(group.cache.state)
        else:
            for seq in group.seqs:
                seq.prompt_embeddings = None

    def _positioned(self, group: PrefillGroup, chunk: PrefillChunk) -> ContextManager:
        """Where the model's image tokens take their own rotary positions (Qwen-VL) and a row of
        the group has images: the chunk's forward rotates every row at its (t, h, w) positions."""
        mrope = self.vision.mrope if self.vision is not None else None
        if mrope is None or all(seq.request.images is None for seq in group.seqs):
            return nullcontext()
        rows = [(seq.request.images, chunk.start - pad) for seq, pad in zip(group.seqs, group.padding())]
        return mrope.at(self.vision.chunk_positions(rows, chunk.end - chunk.start))

    def _embeddings(self, group: PrefillGroup, chunk: PrefillChunk, tokens: mx.array) -> mx.array | None:
        """A chunk's input embeddings where it covers some row's image tokens (None: the tokens').
        A row's prompt embeddings are made at its first such chunk: a row whose images the
        prefix cache held runs no vision tower."""
        if self.vision is None:
            return None
        rows, covered = [], False
        for seq, pad in zip(group.seqs, group.padding()):
            first = chunk.start - pad  # the prompt position of the chunk's first column
            images = seq.request.images
            if images is not None and seq.prompt_embeddings is None and images.token_id in \
                    seq.prompt[max(first, 0):max(chunk.end - pad, 0)]:
                seq.prompt_embeddings = self.vision.embeddings(seq.prompt, images)
            covered = covered or seq.prompt_embeddings is not None
            rows.append((seq.prompt_embeddings, first))
        return self.vision.chunk(decoder(self.model).embed_tokens, tokens, rows) if covered else None

    def process(self, logits: mx.array, seqs: list[Sequence], inputs: mx.array | None = None,
                ancestry: mx.array | None = None, drafts: list[list[int]] | None = None,
                columns: list[list[int]] | None = None) -> mx.array:
        """The logits processors over (B, N, V) logits: position j of row b is
        decided after ``inputs[b, :j + 1]`` (its proposals before it, or its
        tree ``ancestry``), and a grammar is walked through ``drafts`` (laid
        out at ``columns`` in a tree)."""
        logits = adjust_logits(logits, [s.params for s in seqs], [s.prompt for s in seqs], [s.tokens for s in seqs],
                               inputs, ancestry)
        return mask_logits(logits, [s.constraint for s in seqs], drafts or [[] for _ in seqs], columns)

    def decode(self, step: DecodeStep, deliver: Deliver) -> None:
        """One decode step for the running batch; ``deliver`` hands each row its tokens."""
        step_started = clock()
        batch, speculator = step.batch, self.speculator
        seqs = batch.seqs
        launched = self._ahead_for(step)
        proposal = speculator.propose(step.round)
        inputs = mx.array(proposal.inputs)
        if proposal.width == 0:
            self._finish(step, launched or self._launch(batch, inputs), proposal, deliver, step_started,
                         launched is not None)
            return
        started = clock()
        with speculator.verify_context(batch.cache, proposal), dispatch.forwards():
            logits = batch.cache.forward(self.model, inputs, provisional=True)
        if any(s.constraint for s in seqs):  # the forward runs while the grammars fill their masks
            mx.async_eval(logits)
        tree = proposal.tree
        logits = self.process(logits, seqs, inputs, None if tree is None else mx.array(tree.ancestry),
                              proposal.drafts, None if tree is None else [[0] + c for c in tree.columns])
        outcome, logits = self._verify(batch, logits, proposal)
        forward_seconds = clock() - started  # verification and rollback included
        speculator.feedback.count(seqs, proposal, outcome)
        deliver(seqs, logits, outcome.emitted)
        speculator.feedback.observe_step(len(seqs), proposal, forward_seconds, clock() - step_started)
        batch.last_tokens = [e[-1] for e in outcome.emitted]

    def _verify(self, batch: RunningBatch, logits: mx.array, proposal: Proposal) -> tuple[Outcome, mx.array]:
        """Keep each row's accepted proposals plus one target token; roll the target's and the
        drafters' caches back to exactly that, all evaluated in this step. Returns the outcome and,
        per row, the logits that produced each emitted token."""
        started = time.perf_counter()
        verification = verify_round(batch.seqs, logits, proposal, self.speculator.vocab)
        self.metrics.spec_verify_seconds.labels(self.name).observe(time.perf_counter() - started)
        started = time.perf_counter()
        self.speculator.commit(proposal, verification.outcome)  # first: a recurrent target's rollback runs it again
        batch.cache.forget(verification.drop)
        # evaluated now, so that the step that rolled back pays for it: the controller compares whole steps
        batch.cache.settle()
        self.speculator.settle()
        self.metrics.spec_rollback_seconds.labels(self.name).observe(time.perf_counter() - started)
        return verification.outcome, verification.logits

    # -- running ahead ------------------------------------------------------------

    def _rows_may_run_ahead(self, batch: RunningBatch) -> bool:
        """Whether a plain step and the next one, for these rows, may run without the host between
        them (see the module's docstring), whatever the rows propose: where ``decode_ahead`` is
        on, a cache whose rollback is a change of length (no recurrent state), and no row that has
        a grammar or a penalty or would pass its context window in the next step. The callers add
        that no row speculates: as the scheduler planned this step, or as the controller says it
        will plan the next (a goodput policy that measured plain decoding to pay best)."""
        if not self.decode_ahead or batch.cache.chains_only:
            return False
        window = self.max_context()
        return not any(s.constraint is not None or s.params.penalized or s.context_length + 2 > window
                       for s in batch.seqs)

    def _launch(self, batch: RunningBatch, inputs: mx.array) -> Launched:
        """Build a plain step's forward, its logits processors and its sampling (each row's own
        settings and RNG key), and start it on the device."""
        seqs = list(batch.seqs)  # the rows as they are now: the batch's own list changes as rows join
        keys = [s.key for s in seqs]
        with dispatch.forwards():
            logits = batch.cache.forward(self.model, inputs)
        features = self.speculator.take_features()  # before a forward built ahead replaces them
        if any(s.constraint for s in seqs):  # the forward runs while the grammars fill their masks
            mx.async_eval(logits)
        logits = self.process(logits, seqs, inputs)
        tokens, sampled_keys, _ = sample_rows(logits[:, -1, :], [s.params for s in seqs], keys)
        for seq, key in zip(seqs, sampled_keys):
            seq.key = key
        mx.async_eval(tokens, sampled_keys)
        return Launched(seqs, tokens, logits, keys, features)

    def _ahead_for(self, step: DecodeStep) -> Launched | None:
        """The step started ahead for this plan's rows, if the plan is what it ran: the same rows
        (or fewer: rows that finished drop out), each decoding plainly. Otherwise it is dropped."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        batch = step.batch
        position = {s: i for i, s in enumerate(ahead.seqs)}
        index = [position.get(s) for s in batch.seqs]
        if None not in index and self._rows_may_run_ahead(batch) and not any(step.round.ks):
            return ahead.rows(index)
        batch.cache.rollback([0 if i is None else 1 for i in index])
        for seq, i in zip(batch.seqs, index):
            if i is not None:
                seq.key = ahead.keys[i]
        return None

    def _finish(self, step: DecodeStep, launched: Launched, proposal: Proposal, deliver: Deliver,
                step_started: float, ran_ahead: bool) -> None:
        """A plain step: start the next one over its tokens (when it may run ahead), then read
        its tokens and hand them out. Its seconds are told with whether it ran ahead of the one
        before, where its rows could have (None where they could not)."""
        batch = step.batch
        may_run_ahead = self._rows_may_run_ahead(batch)  # the rows as they were planned and will be next
        pace = ran_ahead if may_run_ahead and not any(step.round.ks) else None
        if may_run_ahead and self.speculator.decodes_plainly(batch.seqs):
            self.ahead = self._launch(batch, launched.tokens[:, None])
        emitted = [[t] for t in launched.tokens.tolist()]
        forward_seconds = clock() - step_started
        outcome = Outcome([0] * len(emitted), emitted, [[0]] * len(emitted), launched.features)
        self.speculator.commit(proposal, outcome)
        self.speculator.feedback.count(batch.seqs, proposal, outcome)
        deliver(batch.seqs, launched.logits, emitted)
        self.speculator.feedback.observe_step(len(emitted), proposal, forward_seconds,
                                              clock() - step_started, pace)
        batch.last_tokens = [e[-1] for e in emitted]

    def drop_ahead(self) -> None:
        """Forget a step started ahead whose rows are gone (the batch emptied, or failed)."""
        self.ahead = None

    def withdraw(self, seq: Sequence) -> None:
        """``seq`` leaves the batch to come back later (preempted): it gets back the RNG key a step
        started ahead took from it, so that it samples on resuming what it would have."""
        if self.ahead is not None and seq in self.ahead.seqs:
            seq.key = self.ahead.keys[self.ahead.seqs.index(seq)]
