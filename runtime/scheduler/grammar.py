"""Structured output: each constrained request's grammar matcher (llguidance), on the scheduler.

A request may ask for one of ``json_schema`` (a JSON Schema dict), ``regex``, ``grammar``
(Lark text as llguidance takes it; GBNF is converted) or ``json_object`` (any JSON object).
The grammar is compiled and checked at admission (a bad one is refused with llguidance's
message). While the request decodes, its ``Constraint`` gives the bitmask of the tokens the
grammar allows next (sent with the step; the worker masks that row's logits) and is advanced
with every finalized token. A constrained row's next mask needs its last token: when that
token is still in flight, the row chains like any other and its mask follows the step in a
``Masks`` message once the token is back; the worker runs the forward meanwhile and samples
the step when the masks arrive.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.scheduler.admission import RequestRejected

if TYPE_CHECKING:
    from runtime.protocol.client import Generate
    from runtime.scheduler.tokenizer import Tokenizer

MAX_GRAMMAR_BYTES = 256 * 1024  # a schema, pattern or grammar longer than this is refused
# JSON with fixed separators and no free whitespace (a schema's own "x-guidance" wins): with
# flexible whitespace a weak model can fill max_tokens with blanks between two keys.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class GrammarSpec:
    """Which constraint a request asked for, as llguidance grammar text."""

    kind: str  # "json_schema", "regex", "grammar" or "json_object"
    grammar: str


def grammar_spec(msg: Generate) -> GrammarSpec | None:
    """The request's constraint, or None; RequestRejected names a bad or doubled field."""
    asked = [name for name, on in (("json_schema", msg.json_schema is not None), ("regex", msg.regex is not None),
                                   ("grammar", msg.grammar is not None), ("json_object", msg.json_object)) if on]
    if not asked:
        return None
    if len(asked) > 1:
        raise RequestRejected(f"at most one of json_schema, regex, grammar and json_object may be set, got {asked}")
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    kind = asked[0]
    try:
        if kind == "json_schema":
            if not isinstance(msg.json_schema, dict):
                raise RequestRejected("json_schema must be a JSON Schema object")
            text = json.dumps({"x-guidance": JSON_LAYOUT} | msg.json_schema)
            _check_size("json_schema", text)
            grammar = LLMatcher.grammar_from_json_schema(text)
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema(json.dumps({"type": "object", "x-guidance": JSON_LAYOUT}))
        elif kind == "regex":
            _check_size("regex", msg.regex or "")
            grammar = LLMatcher.grammar_from_regex(msg.regex or "")
        else:
            text = msg.grammar or ""
            _check_size("grammar", text)
            if "::=" in text:  # GBNF (llama.cpp's notation): llguidance takes it as Lark
                text = gbnf_to_lark(text)
            grammar = LLMatcher.grammar_from_lark(text)
        problem = LLMatcher.validate_grammar(grammar)
    except RequestRejected:
        raise
    except Exception as exc:  # llguidance's parse errors
        raise RequestRejected(f"invalid {kind}: {exc}") from None
    if problem:
        raise RequestRejected(f"invalid {kind}: {problem.strip()}")
    return GrammarSpec(kind, grammar)


def _check_size(name: str, text: str) -> None:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise RequestRejected(f"{name} is longer than {MAX_GRAMMAR_BYTES // 1024} KiB")


class Grammars:
    """Makes matchers for the model's tokenizer (llguidance's view of it is built on first use).

    ``vocab_size``: the model's logits width; tokens past the tokenizer's are never allowed.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll: Any = None
        self._executor: Any = None  # llguidance's thread pool: a step's masks are computed together

    def _ll_tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance.hf

            hf = self.tokenizer.hf
            n_vocab = max(self.vocab_size, len(hf))
            try:
                self._ll = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=sorted(self.tokenizer.eos_ids))
            except Exception as exc:  # e.g. a tokenizer without a byte-level or sentencepiece decoder
                raise RequestRejected(f"structured output is not available for this model: llguidance cannot "
                                      f"read its tokenizer ({exc})") from None
        return self._ll

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for ``spec``; RequestRejected with llguidance's message when invalid."""
        from llguidance import LLMatcher

        ll = self._ll_tokenizer()
        problem = LLMatcher.validate_grammar(spec.grammar, ll)
        if problem:
            raise RequestRejected(f"invalid {spec.kind}: {problem.strip()}")
        try:
            matcher = LLMatcher(ll, spec.grammar)
        except Exception as exc:
            raise RequestRejected(f"invalid {spec.kind}: {exc}") from None
        if matcher.is_error():
            raise RequestRejected(f"invalid {spec.kind}: {matcher.get_error()}")
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return Constraint(matcher, self.vocab_size, self._executor)


class Constraint:
    """One request's grammar state: the next token's mask, advanced with each finalized token."""

    def __init__(self, matcher: Any, vocab_size: int, executor: Any = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # the mask's uint32 words the worker expects
        self.executor = executor

    def mask(self) -> bytes:
        """Allowed next tokens: bit i of little-endian uint32 word i // 32 for token i. A finished
        grammar allows every token: a step already in flight still draws one for its row, which
        the scheduler drops (the request has ended)."""
        if self.ended:
            return self.allow_all()
        return self.fit(self.matcher.compute_bitmask())

    @property
    def ended(self) -> bool:
        """The grammar is finished or failed: its mask allows every token (see ``mask``)."""
        return bool(self.matcher.is_stopped() or self.matcher.is_error())

    def allow_all(self) -> bytes:
        return b"\xff" * (4 * self.words)

    def fit(self, raw: bytes) -> bytes:
        """llguidance's bitmask cut or zero-padded to the model's logits width."""
        size = 4 * self.words
        return raw[:size] if len(raw) >= size else raw + bytes(size - len(raw))

    def advance(self, token: int) -> str | None:
        """Take the token the worker chose; an error message if the grammar refused it."""
        if not self.matcher.consume_token(token):
            return f"the grammar refused token {token}: {self.matcher.get_error()}"
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        return bool(self.matcher.is_stopped())


def masks_of(constraints: list[Constraint]) -> list[bytes]:
    """``[c.mask() for c in constraints]``, the live grammars' masks computed in parallel on
    llguidance's threads (no GIL held): a step's masks are on the worker's critical path, and
    one mask of a 128k vocabulary takes about 60 us."""
    if not all(isinstance(c, Constraint) and c.executor is not None for c in constraints):
        return [c.mask() for c in constraints]
    live = [i for i, c in enumerate(constraints) if not c.ended]
    if len(live) < 2:
        return [c.mask() for c in constraints]
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    first = constraints[live[0]]
    bits = allocate_token_bitmask(len(live), first.vocab_size)
    fill_next_token_bitmask_par(first.executor, [(constraints[i].matcher, k) for k, i in enumerate(live)], bits)
    out = [c.allow_all() for c in constraints]
    for k, i in enumerate(live):
        out[i] = constraints[i].fit(bits[k].tobytes())
    return out


@dataclass
class MaskClock:
    """Time the scheduler spent computing grammar masks, and how many steps needed them
    (``runtime status`` shows both; the bench's structured workload reports their ratio)."""

    seconds: float = 0.0
    steps: int = 0

    def masks(self, constraints: list[Constraint]) -> list[bytes]:
        """``masks_of(constraints)``, timed as one step's masks."""
        start = time.perf_counter()
        out = masks_of(constraints)
        self.seconds += time.perf_counter() - start
        self.steps += 1
        return out
