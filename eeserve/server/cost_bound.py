"""What a request may cost before it is templated and tokenized: admission control's cheap bounds.

Contract: ``estimate(bounds, info, req)`` returns the request's ``admission.Estimate`` from its body
alone: its engine requests (choices; ``prepare.check_choices``: a 400 beyond the most) and, summed
over them, the UTF-8 bytes of their text prompts (a chat request's: ``chat_prompt_bound``'s bytes)
and the least their tokens can be: one token per text prompt (token ids as they are), and
``max_tokens`` of output (``prepare``'s defaults: 16 for a completion; for a chat request without
it, the room the context leaves after the prompt, which is at least what the prompt's most leaves).
``chat_prompt_bound(bounds, info, req)`` is that most: the UTF-8 bytes of the messages plus what the
chat template renders around them and what the tokenizer adds (every token of a byte-level or
byte-fallback vocabulary covers at least one byte of text). ``PromptBounds.of(tokenizer)`` measures
once, at startup, what the tokenizer adds to a text beside its bytes (its special tokens, and one
more for a leading-space marker) and what the template adds around messages (the bytes it renders
around one empty user message, and the most one more empty message of any role adds). The most is a
bound for such tokenizers and templates, not a promise for every one (where it fails, a chat request
without ``max_tokens`` is counted at more output than it will ask for).
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
        n = req.n
        out = req.max_completion_tokens or req.max_tokens
        text = _chat_bytes(bounds, info, req)
        if out is None:  # prepare's default: the context's room, at least what the most leaves
            out = max(1, info.max_model_len - text - bounds.special)
        return Estimate(choices=n, low=Cost(n, n * out), prompt_bytes=n * text)
    p = req.prompt
    prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    check_choices(len(prompts) * req.n)
    out = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    least = sum(1 if isinstance(prompt, str) else len(prompt) for prompt in prompts)
    text = sum(len(prompt.encode()) for prompt in prompts if isinstance(prompt, str))
    k = req.n * len(prompts)
    return Estimate(choices=k, low=Cost(req.n * least, k * out), prompt_bytes=req.n * text)


def chat_prompt_bound(bounds: PromptBounds, info: ModelInfo, req: ChatCompletionRequest) -> int:
    """The most tokens the chat template and the tokenizer can make of ``req``'s messages."""
    return _chat_bytes(bounds, info, req) + bounds.special


def _chat_bytes(bounds: PromptBounds, info: ModelInfo, req: ChatCompletionRequest) -> int:
    """The most bytes the chat template can render for ``req``'s messages (the whole context
    when the template could not be measured)."""
    texts = sum(len(m.text().encode()) + len((m.name or "").encode()) for m in req.messages)
    if not bounds.template:
        return texts + len(req.messages)  # the texts joined by newlines
    if bounds.chat_base is None:
        return info.max_model_len
    return bounds.chat_base + bounds.chat_per_message * (len(req.messages) - 1) + texts
