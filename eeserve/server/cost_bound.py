"""What a request may cost before it is templated and tokenized: admission control's cheap bound.

Contract: ``PromptBounds.of(tokenizer)`` measures once, at startup, what the tokenizer adds to a
text beside its bytes (its special tokens, and one more for a leading-space marker) and what the
chat template adds around messages (the bytes it renders around one empty user message, and the
most one more empty message of any role adds). ``estimate(bounds, info, req)`` returns the
request's ``admission.Estimate`` from its body alone: its engine requests (choices;
``prepare.check_choices``: a 400 beyond the most) and, summed over them, the least and the most
their tokens can be. A text prompt has at least 1 token and at most its UTF-8 bytes plus what
the tokenizer adds (every token of a byte-level or byte-fallback vocabulary covers at least one
byte); chat messages at most their bytes plus what the template renders around them; token ids
are counted as they are. Output tokens are ``max_tokens`` (``prepare``'s defaults: 16 for a
completion; for a chat request without it, the room the context leaves after the prompt, whose
least and most follow from the prompt's most and least). The most is a bound for such
tokenizers and templates, not a promise for every one: admission control checks exactly any
request whose tokens turn out to exceed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eeserve.server.admission import Cost, Estimate
from eeserve.server.prepare import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    GenerationRequest,
    ModelInfo,
    check_choices,
)
from eeserve.server.protocol import ChatCompletionRequest

_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, kw_only=True)
class PromptBounds:
    special: int  # tokens a tokenizer call adds to a text beyond one per byte
    template: bool  # the tokenizer has a chat template (else: the texts, one per line)
    chat_base: int | None  # template bytes around one empty user message (None: not rendered)
    chat_per_message: int  # the most one more (empty) message adds to the template's bytes

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBounds:
        special = len(tokenizer("").input_ids) + 1
        if getattr(tokenizer, "chat_template", None) is None:
            return cls(special=special, template=False, chat_base=None, chat_per_message=0)
        user = {"role": "user", "content": ""}
        base = _rendered_bytes(tokenizer, [user])
        more = [_rendered_bytes(tokenizer, [user, {"role": r, "content": ""}]) for r in _ROLES]
        known = [m - base for m in more if m is not None and base is not None]
        return cls(
            special=special, template=True, chat_base=base, chat_per_message=max([0, *known])
        )


def _rendered_bytes(tokenizer: Any, messages: list[dict[str, str]]) -> int | None:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # a template may refuse a conversation (roles out of its order)
        return None
    return len(str(text).encode())


def estimate(bounds: PromptBounds, info: ModelInfo, req: GenerationRequest) -> Estimate:
    if isinstance(req, ChatCompletionRequest):
        check_choices(req.n)
        high = _chat_bytes(bounds, info, req) + bounds.special
        out = req.max_completion_tokens or req.max_tokens
        n = req.n
        if out is not None:
            return Estimate(choices=n, low=Cost(n, n * out), high=Cost(n * high, n * out))
        room = info.max_model_len
        return Estimate(
            choices=n,
            low=Cost(n, n * max(1, room - high)),
            high=Cost(n * high, n * max(1, room - 1)),
        )
    p = req.prompt
    prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    check_choices(len(prompts) * req.n)
    out = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    low = high = 0
    for prompt in prompts:
        exact = not isinstance(prompt, str)
        low += len(prompt) if exact else 1
        high += len(prompt) if exact else len(prompt.encode()) + bounds.special
    n, k = req.n, req.n * len(prompts)
    return Estimate(choices=k, low=Cost(n * low, k * out), high=Cost(n * high, k * out))


def _chat_bytes(bounds: PromptBounds, info: ModelInfo, req: ChatCompletionRequest) -> int:
    """The most bytes the chat template can render for ``req``'s messages (the whole context
    when the template could not be measured)."""
    texts = sum(len(m.text().encode()) + len((m.name or "").encode()) for m in req.messages)
    if not bounds.template:
        return texts + len(req.messages)  # the texts joined by newlines
    if bounds.chat_base is None:
        return info.max_model_len
    return bounds.chat_base + bounds.chat_per_message * (len(req.messages) - 1) + texts
