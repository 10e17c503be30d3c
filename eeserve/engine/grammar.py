"""Constrained decoding: a request's constraint compiled once, and its matcher per request.

Contract: ``GrammarCompiler(tokenizer, vocab_size=, eos=)`` turns a
``StructuredOutputsParams`` into a ``Grammar`` (``compile``), checked by llguidance against the
model's tokenizer: a schema, regex or grammar it rejects is a ``ValueError`` naming the field
(``structured_outputs.json: ...``). Compiled grammars are kept by the constraint's key (LRU,
``cache_size``), so a schema used by many requests compiles once. The tokenizer's llguidance
view is built on the first compile (about 0.3 s for a 49k vocabulary), not at start-up.

``Grammar.matcher()`` starts a ``TokenMatcher``: the grammar's state after the tokens it has
accepted. ``mask_(logits)`` sets the logits [V] of tokens the grammar does not allow next to
-inf; ``accept(tokens)`` advances (a token the mask did not allow is a ``RuntimeError``: the
engine chose it, so it is a bug); ``rollback(n)`` forgets the last n (rejected speculative
drafts, a preemption's drafts); ``forced(limit)`` accepts and returns the run of tokens the
grammar forces from here: while exactly one token is allowed, that token (llguidance allows one
tokenization of forced text, so the run is what constrained full depth would choose). Where the
grammar is complete only the end-of-sequence token is allowed, so the run ends with it.

Why llguidance: it computes a token mask in tens of microseconds on the CPU with no GPU or
torch.compile dependency, rolls back any number of tokens (speculative drafts), ships CPU wheels
with no further dependencies, and reads JSON schema, regex, Lark and (converted) GBNF grammars.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from eeserve.structured_outputs import ConstraintKind, StructuredOutputsParams

if TYPE_CHECKING:  # a typing-only name of llguidance's stubs
    from llguidance._lib import JsonCompileOptions

# How a JSON schema's output is laid out: no free whitespace (every byte that the schema fixes is
# forced), items and keys separated as Python's json.dumps does and models write.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True, kw_only=True)
class Grammar:
    """A compiled constraint: llguidance's grammar text for one tokenizer."""

    key: str
    text: str
    tokenizer: llguidance.LLTokenizer
    vocab_size: int
    eos_token_id: int

    def matcher(self) -> TokenMatcher:
        m = llguidance.LLMatcher(self.tokenizer, self.text)
        return TokenMatcher(m, self.vocab_size, self.eos_token_id)


# Masks kept behind the current position (a verification rolls back up to its drafts; a mask
# dropped is computed again if a longer rollback needs it).
KEEP_MASKS = 16


@dataclass(kw_only=True)
class _Mask:
    """The tokens one grammar state allows next."""

    words: torch.Tensor  # [ceil(V / 32)] int32, 1 bit a token
    allowed: torch.Tensor | None = None  # [V] bool, made from ``words`` when first read


class TokenMatcher:
    """One request's grammar state (see the module's contract)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._num_words = (vocab_size + 31) // 32
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._consumed: list[bool] = []  # per accepted token: did llguidance consume it
        # The masks of the states along the accepted tokens, by position, computed once each: a
        # step reads a state's mask up to four times (the exit checks' allowed set, the LM head's
        # screen, the draw, the forced run), and a verification reads the masks of the drafted
        # positions again after a rollback. ``_masks[n]`` holds for the state after
        # ``_path[:n]``; accepting another token at n drops what lay beyond it.
        self._path: list[int] = []
        self._masks: dict[int, _Mask] = {}

    def _mask(self) -> _Mask:
        n = len(self._consumed)
        mask = self._masks.get(n)
        if mask is None:
            words = torch.empty(self._num_words, dtype=torch.int32)  # 1 bit a token
            self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
            mask = self._masks[n] = _Mask(words=words)
        return mask

    def _fill(self) -> torch.Tensor:
        """The bitmask of the tokens allowed next [ceil(V / 32)] int32."""
        return self._mask().words

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        mask = self._mask()
        if mask.allowed is None:
            bits = (mask.words[:, None] >> self._shifts) & 1  # [W, 32]
            mask.allowed = bits.view(-1)[: self.vocab_size].bool()
        return mask.allowed

    def single(self) -> int | None:
        """The one token allowed next, or None when there are several (or none)."""
        w = self._fill()
        nz = w.nonzero()
        if nz.numel() != 1:
            return None
        i = int(nz[0, 0])
        word = int(w[i]) & 0xFFFFFFFF
        return i * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None

    def allowed_ids(self, limit: int) -> torch.Tensor | None:
        """[k] the ids of the tokens allowed next, when there are at most ``limit`` of them."""
        ids = self.allowed().nonzero().view(-1)
        return ids if 0 < ids.numel() <= limit else None

    def first_allowed(self) -> int:
        return int(self.allowed().nonzero()[0, 0])

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V], in place: -inf where the grammar allows no token. Returns it."""
        logits.masked_fill_(~self.allowed().to(logits.device), float("-inf"))
        return logits

    def accept(self, tokens: list[int]) -> None:
        for t in tokens:
            n = len(self._consumed)
            if n >= len(self._path) or self._path[n] != t:  # another branch: its masks go
                del self._path[n:]
                self._path.append(t)
                self._masks = {k: m for k, m in self._masks.items() if k <= n}
            self._masks.pop(n - KEEP_MASKS, None)
            if (left := self._masks.get(n)) is not None:
                left.allowed = None  # [V] bool: 8x the bitmask, made again from it if read
            # The end of sequence after a complete grammar ends the output: llguidance takes
            # nothing more, so it is recorded as not consumed (for ``rollback``).
            done = t == self.eos_token_id and self._m.is_stopped()
            if not done and not self._m.consume_token(t):
                raise RuntimeError(f"the grammar refused token {t}: {self._m.get_error()}")
            self._consumed.append(not done)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        undo, self._consumed = self._consumed[-n:], self._consumed[:-n]
        k = sum(undo)
        if k and not self._m.rollback(k):
            raise RuntimeError(f"the grammar could not roll back {k} tokens")

    def forced(self, limit: int) -> list[int]:
        """Accepts and returns up to ``limit`` tokens that the grammar forces from here."""
        run: list[int] = []
        while len(run) < limit and (t := self.single()) is not None:
            self.accept([t])
            run.append(t)
            if t == self.eos_token_id:
                break
        return run

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow (end of sequence included)."""
        return self._m.is_stopped()


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        vocab_size: int,
        eos: int,
        cache_size: int = 256,
    ) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if not isinstance(self._hf, PreTrainedTokenizerFast):
                raise ValueError(
                    "structured_outputs needs a fast (Rust) tokenizer; this model's is "
                    f"{type(self._hf).__name__}"
                )
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=self.eos_token_id
            )
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        key = params.key()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        tokenizer = self._llg_tokenizer()
        text = grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{params.kind.value}: {messages[0].strip()}")
        grammar = Grammar(
            key=key,
            text=text,
            tokenizer=tokenizer,
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
        )
        self._cache[key] = grammar
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return grammar


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint (not yet checked against a tokenizer)."""
    kind = params.kind
    LL = llguidance.LLMatcher
    try:
        if kind is ConstraintKind.JSON:
            return LL.grammar_from_json_schema(params.json or {}, defaults=JSON_LAYOUT)
        if kind is ConstraintKind.JSON_OBJECT:
            return LL.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind.value}: {e}") from None
    if kind is ConstraintKind.REGEX:
        return LL.grammar_from_regex(params.regex or "")
    if kind is ConstraintKind.CHOICE:
        # Lark string literals: JSON's escapes (quotes, backslashes) are Lark's.
        options = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice or [])
        return LL.grammar_from_lark(f"start: {options}")
    grammar = params.grammar or ""
    if "::=" in grammar:  # GBNF (llama.cpp's grammars): converted to Lark
        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as e:  # the converter raises plain exceptions on bad GBNF
            raise ValueError(f"structured_outputs.grammar: not a valid GBNF grammar: {e}") from None
    return LL.grammar_from_lark(grammar)


def constrain(matcher: TokenMatcher, logits: torch.Tensor) -> bool:
    """Masks logits [V] in place to the grammar's allowed tokens; False when none of them has a
    finite logit (a draft head or int8 draft vocabulary that covers none of them)."""
    return bool(matcher.mask_(logits).amax() > float("-inf"))


def draft_masks(matcher: TokenMatcher, drafts: list[int]) -> list[torch.Tensor]:
    """The allowed tokens [V] bool at k drafted positions and the next (after all k), in order.
    ``matcher`` has accepted the k ``drafts`` on entry and on return."""
    k = len(drafts)
    matcher.rollback(k)
    out = []
    for i in range(k + 1):
        out.append(matcher.allowed())
        if i < k:
            matcher.accept([drafts[i]])
    return out
