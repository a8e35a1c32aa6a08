"""Constrained decoding: a request's grammar as a per-position token mask.

llguidance compiles JSON schemas and Lark grammars into a matcher that walks
the output token by token.  The matcher follows only tokens the sequence
really accepted: to mask a verify forward's positions it consumes the row's
proposals, fills one mask per position, and rolls back.  The same masks go on
every distribution the verifier compares, so speculation stays lossless with
respect to the constrained distribution.  Tokens the grammar forces (a key
name, a closing brace) end a row's proposal (``Constraint.extend``), to be
verified for free in the same forward.
"""

from __future__ import annotations

import weakref
from typing import Sequence as Seq

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

NEG_INF = -float("inf")
COMPACT_JSON = {"whitespace_flexible": False}  # "," and ":" without spaces: a weak model cannot pad with blanks
MAX_FORCED = 32  # forced tokens appended to one round's proposal

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """The grammar (or schema) cannot be compiled."""


def json_schema_grammar(schema: dict | None) -> str:
    """The grammar for JSON matching ``schema`` (None: any JSON object), compact."""
    schema = {"type": "object"} if schema is None else schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
    except ValueError as e:
        raise GrammarError(str(e)) from e


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def grammar_tokenizer(tokenizer, vocab: int, eos_ids: Seq[int]) -> llguidance.LLTokenizer:
    """llguidance's view of an mlx-lm tokenizer, built once per tokenizer; ids
    past the tokenizer's own (the model's padded vocabulary) are never allowed."""
    built = _tokenizers.get(tokenizer)
    if built is None:
        built = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab, eos_token=sorted(eos_ids))
        _tokenizers[tokenizer] = built
    return built


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None) -> None:
    """Raise GrammarError if ``grammar`` cannot be served by ``tokenizer`` (None: the grammar alone,
    as a request is checked before its model's tokenizer is at hand)."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise GrammarError(messages[0] if messages else "invalid grammar")


class Constraint:
    """One sequence's grammar state, advanced only through accepted tokens."""

    def __init__(self, grammar: str, tokenizer: llguidance.LLTokenizer, eos_ids: Seq[int]):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.eos = frozenset(eos_ids)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def extend(self, proposal: list[int], room: int, sampled_from_q: bool) -> tuple[list[int], int]:
        """A proposal checked against the grammar, and how many tokens at its
        end the grammar forced (the chain stays within ``room`` tokens).

        The proposal is cut at its first token the grammar rejects.  If the
        grammar forces tokens there, they replace the rest: whatever was
        proposed, the verifier's outcome at a forced position follows the
        masked distribution alone, so they are proposed with certainty (q a
        point mass).  Otherwise a token drawn from a draft's q
        (``sampled_from_q``) stays: the verifier rejects it and draws from the
        residual, which keeps a sampled draft lossless.  A deterministic
        proposal's rejected token would leave exactly the masked distribution
        as its residual, so it goes and saves the column."""
        valid = self.valid_prefix(proposal)
        chain = proposal[:valid]
        forced = self._forced(chain, min(MAX_FORCED, room - valid))
        if forced:
            return chain + forced, len(forced)
        return proposal[: valid + 1] if sampled_from_q else chain, 0

    def _forced(self, chain: list[int], limit: int) -> list[int]:
        """Tokens the grammar forces after ``chain`` (all valid), at most ``limit``."""
        if limit <= 0 or self.eos.intersection(chain):  # nothing follows the end
            return []
        self.matcher.consume_tokens(chain)
        forced = [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()[:limit]
        self.matcher.rollback(len(chain))
        return forced

    def masks(self, proposal: list[int], out: np.ndarray) -> None:
        """Fill ``out`` (len(proposal)+1 bitmask rows) with the allowed tokens
        after each prefix of ``proposal``; rows past a rejected token or an
        end of sequence (nothing there is ever kept) allow all."""
        allowed = self.valid_prefix(proposal)
        out[...] = -1
        consumed = 0
        for j in range(allowed + 1):
            self._fill(out, j)
            # the matcher does not count an end-of-sequence token it stops on, so none is consumed here
            if j == allowed or proposal[j] in self.eos:
                break
            self.matcher.consume_token(proposal[j])
            consumed += 1
        self.matcher.rollback(consumed)

    def _fill(self, out: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, out, row)
        if not out[row].any():  # an error state: only ending is left
            words = out[row].view(np.uint32)
            words[:] = 0
            for t in sorted(self.eos):
                words[t // 32] |= np.uint32(1 << (t % 32))

    def step(self, token: int) -> bool:
        """Follow one drafted token, if the grammar allows it (``rewind`` undoes
        it); not an end of sequence, which the matcher would not count."""
        if token in self.eos or self.valid_prefix([token]) != 1:
            return False
        self.matcher.consume_token(token)
        return True

    def rewind(self, tokens: int) -> None:
        self.matcher.rollback(tokens)

    def advance(self, tokens: list[int]) -> None:
        """The sequence accepted ``tokens``."""
        if tokens and not self.matcher.is_stopped():
            self.matcher.consume_tokens(tokens)


def mask_logits(logits: mx.array, constraints: Seq[Constraint | None], proposals: Seq[Seq[int]],
                columns: Seq[Seq[int]] | None = None) -> mx.array:
    """``logits`` (B, L, V) with each constrained row's disallowed tokens at -inf.

    Row b's position ``columns[b][j]`` (default j) follows ``proposals[b][:j]``;
    its other positions (padding, other branches) are left alone."""
    if not any(constraints):
        return logits
    B, L, V = logits.shape
    words = (V + 31) // 32
    bits = np.full((B, L, words), -1, dtype=np.int32)  # rows without a grammar allow everything
    for b, constraint in enumerate(constraints):
        if constraint is None:
            continue
        proposal = list(proposals[b])
        filled = np.empty((len(proposal) + 1, words), dtype=np.int32)
        constraint.masks(proposal, filled)
        where = list(range(len(proposal) + 1)) if columns is None else list(columns[b])
        bits[b, where] = filled
    return mx.where(unpack_bitmask(mx.array(bits), V), logits, mx.array(NEG_INF, dtype=logits.dtype))


def unpack_bitmask(bits: mx.array, vocab: int) -> mx.array:
    """(…, words) int32 bitmasks -> (…, vocab) booleans."""
    shifted = mx.right_shift(bits.view(mx.uint32)[..., None], mx.arange(32, dtype=mx.uint32))
    return (mx.bitwise_and(shifted, 1) == 1).reshape(*bits.shape[:-1], -1)[..., :vocab]
