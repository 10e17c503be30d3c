"""Engine outputs -> OpenAI JSON: whole responses, stream chunks, logprobs and exit statistics.

Contract: a ``Formatter`` is made per HTTP request for ``kind`` ``"completion"`` or ``"chat"``.
``delta_chunk(index, output)`` turns the cumulative ``CompletionOutput`` of choice ``index`` into
a stream chunk holding only what is new since the previous call (``None`` when nothing is), and
holds back the last ``longest stop string - 1`` characters while the choice runs, so that text
later cut at a stop string is never sent. ``response(finals, prompt_lens)`` builds the
non-streaming body; ``usage_chunk`` the final streamed usage. Exit statistics are reported per
choice and over all choices (token-weighted); with logprobs, each token carries its exit layer.
Every stream chunk's choice also carries ``exit_tokens`` (extension): one entry per token
generated since the previous chunk, ``{"text", "exit_layer", "confidence"}``: ``text`` is what
the token adds to the decoded output (``""`` for a special token, or for the first bytes of a
character that a later token completes), ``confidence`` is ``null`` at full depth. It is sent as
soon as the token exists, ahead of ``content`` held back for stop strings.
With ``tool_calls`` (the request offers tools), a chat output's calls become
``message.tool_calls`` and stream ``delta.tool_calls`` as ``tool_output.py`` reads them, and an
output that stopped after a call finishes with ``"tool_calls"``.
``exit_config_summary(cfg, policy)`` is the body of ``GET /v1/eeserve/exit_config``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from eeserve.exit_params import SHORTLIST_MEASURES
from eeserve.models.exit_config import ExitConfig
from eeserve.outputs import CompletionOutput
from eeserve.server.tool_output import ToolStream, tool_finish_reason, tool_message

LOGPROB_FLOOR = -9999.0  # the sampled token was outside the top-n the engine reported
Kind = Literal["completion", "chat"]


class TokenStrings:
    """Token id -> its text, cached (one per app; used on the event-loop thread only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = str(self.tokenizer.decode([token_id]))
        return s


def token_piece(
    tokenizer: Any, ids: list[int], k: int, anchor: int, done: int, *, last: bool = False
) -> tuple[str, bool]:
    """(the text token ``k`` adds to ``decode(ids[:k + 1])``, whether that text is complete).

    ``anchor``: the first token after the last complete character; ``done``: the characters the
    pieces of tokens before ``k`` hold. Usually two short decodes from one token before the
    anchor (so that a tokenizer's start-of-text quirks, like a dropped leading space, cancel);
    around U+FFFD (an unfinished or invalid character) one decode of the whole output, so that
    the pieces always concatenate to the output text exactly. An unfinished character goes to
    the token that completes it, or to the ``last`` token of a finished output. Special tokens
    add nothing.
    """
    start = max(0, anchor - 1)
    full = str(tokenizer.decode(ids[start : k + 1], skip_special_tokens=True))
    before = str(tokenizer.decode(ids[start:k], skip_special_tokens=True))
    if "\ufffd" not in full and full.startswith(before):
        return full[len(before) :], True
    text = str(tokenizer.decode(ids[: k + 1], skip_special_tokens=True))
    complete = last or not text.endswith("\ufffd")
    return (text if last else text.rstrip("\ufffd"))[done:], complete


def exit_stats(outputs: list[CompletionOutput], num_layers: int) -> dict[str, Any]:
    """Exit statistics over ``outputs``: over the tokens the model chose, with the tokens a
    grammar forced counted apart; speculative ones add the acceptance rate and mean draft length
    (averaged over the choices that drafted)."""
    layers = [x for c in outputs for k, x in enumerate(c.exit_layers) if not _forced(c, k)]
    total = sum(layers)
    out: dict[str, Any] = {
        "mean_exit_layer": total / len(layers) if layers else float(num_layers),
        "layers_saved_fraction": 1 - total / (len(layers) * num_layers) if layers else 0.0,
        "num_layers": num_layers,
        "num_forced": sum(sum(c.forced) for c in outputs),
    }
    spec = [
        c.exit_stats for c in outputs if c.exit_stats and c.exit_stats.acceptance_rate is not None
    ]
    if spec:
        out["acceptance_rate"] = sum(s.acceptance_rate or 0.0 for s in spec) / len(spec)
        out["mean_draft_length"] = sum(s.mean_draft_length or 0.0 for s in spec) / len(spec)
    return out


@dataclass
class _ChoiceState:
    text: str = ""
    tokens: int = 0
    text_offset: int = 0
    final: CompletionOutput | None = None
    piece_anchor: int = 0  # token_piece's state for exit_tokens: anchor token, characters done
    piece_chars: int = 0
    tools: ToolStream | None = None  # the request offers tools: the calls streamed so far


class Formatter:
    def __init__(
        self,
        kind: Kind,
        model: str,
        strings: TokenStrings,
        num_layers: int,
        num_choices: int,
        top_logprobs: int | None,
        stop: list[str],
        *,
        tool_calls: bool = False,
    ) -> None:
        self.kind = kind
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.strings = strings
        self.num_layers = num_layers
        self.top_logprobs = top_logprobs
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.tool_calls = tool_calls and kind == "chat"
        self.states = [
            _ChoiceState(tools=ToolStream() if self.tool_calls else None)
            for _ in range(num_choices)
        ]

    # -- streaming ----------------------------------------------------------------------------

    def start_chunks(self) -> list[dict[str, Any]]:
        if self.kind == "completion":
            return []
        choices = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(self.states))
        ]
        return [self._envelope(choices, chunk=True)]

    def delta_chunk(self, index: int, c: CompletionOutput) -> dict[str, Any] | None:
        st = self.states[index]
        finished = c.finish_reason is not None
        upto = len(c.text) if finished else max(len(st.text), len(c.text) - self.holdback)
        delta = c.text[len(st.text) : upto] if c.text.startswith(st.text) else ""
        st.text += delta
        new_tokens = len(c.token_ids) - st.tokens
        logprobs = None
        if self.top_logprobs is not None and new_tokens > 0:
            logprobs = self._logprobs(c, st.tokens, len(c.token_ids), st)
        exit_tokens = self._exit_tokens(c, st.tokens, len(c.token_ids), st)
        st.tokens = len(c.token_ids)
        if finished:
            st.final = c
        if not (delta or finished or logprobs or exit_tokens):
            return None
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs}
        if self.kind == "completion":
            choice["text"] = delta
        else:
            choice["delta"] = _chat_delta(st, delta, finished)
        called = st.tools is not None and st.tools.called
        choice["finish_reason"] = tool_finish_reason(_finish_reason(c.finish_reason), called)
        choice["exit_tokens"] = exit_tokens
        if finished:
            choice["early_exit"] = exit_stats([c], self.num_layers)
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, prompt_lens: list[int]) -> dict[str, Any]:
        finals = [st.final for st in self.states if st.final is not None]
        body = self._envelope([], chunk=True)
        body["usage"] = _usage(prompt_lens, finals)
        body["early_exit"] = exit_stats(finals, self.num_layers)
        return body

    # -- whole responses ----------------------------------------------------------------------

    def response(self, finals: list[CompletionOutput], prompt_lens: list[int]) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(finals):
            st = _ChoiceState()
            logprobs = None
            if self.top_logprobs is not None:
                logprobs = self._logprobs(c, 0, len(c.token_ids), st)
            choice: dict[str, Any] = {"index": i}
            if self.kind == "completion":
                choice["text"] = c.text
            elif self.tool_calls:
                choice["message"] = tool_message(c.text)
            else:
                choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = logprobs
            called = "tool_calls" in choice.get("message", {})
            choice["finish_reason"] = tool_finish_reason(_finish_reason(c.finish_reason), called)
            choice["early_exit"] = exit_stats([c], self.num_layers)
            choices.append(choice)
        body = self._envelope(choices, chunk=False)
        body["usage"] = _usage(prompt_lens, finals)
        body["early_exit"] = exit_stats(finals, self.num_layers)
        return body

    # -- pieces -------------------------------------------------------------------------------

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _exit_tokens(
        self, c: CompletionOutput, a: int, b: int, st: _ChoiceState
    ) -> list[dict[str, Any]]:
        """Tokens a..b with where they left the model (the playground colours text by these)."""
        out = []
        for k in range(a, b):
            layer = c.exit_layers[k] if k < len(c.exit_layers) else self.num_layers
            conf = None
            if layer < self.num_layers and k < len(c.exit_confidences):
                conf = round(float(c.exit_confidences[k]), 4)
            last = c.finish_reason is not None and k == len(c.token_ids) - 1
            text, complete = token_piece(
                self.strings.tokenizer, c.token_ids, k, st.piece_anchor, st.piece_chars, last=last
            )
            st.piece_chars += len(text)
            if complete:
                st.piece_anchor = k + 1
            out.append(
                {"text": text, "exit_layer": layer, "confidence": conf, "forced": _forced(c, k)}
            )
        return out

    def _logprobs(self, c: CompletionOutput, a: int, b: int, st: _ChoiceState) -> dict[str, Any]:
        ids = c.token_ids[a:b]
        lps = (c.logprobs or [])[a:b]
        lps = lps + [{}] * (len(ids) - len(lps))
        layers = c.exit_layers[a:b]
        layers = layers + [self.num_layers] * (len(ids) - len(layers))
        n = self.top_logprobs or 0
        if self.kind == "chat":
            return {
                "content": [self._chat_entry(t, lp, L, n) for t, lp, L in zip(ids, lps, layers)]
            }
        s = self.strings
        tokens = [s(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(st.text_offset)
            st.text_offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.get(t, LOGPROB_FLOOR) for t, lp in zip(ids, lps)],
            "top_logprobs": [{s(k): v for k, v in list(lp.items())[:n]} for lp in lps],
            "text_offset": offsets,
            "exit_layers": layers,
        }

    def _chat_entry(self, tid: int, lp: dict[int, float], layer: int, n: int) -> dict[str, Any]:
        s = self.strings(tid)
        top = [
            {"token": self.strings(k), "logprob": v, "bytes": list(self.strings(k).encode())}
            for k, v in list(lp.items())[:n]
        ]
        return {
            "token": s,
            "logprob": lp.get(tid, LOGPROB_FLOOR),
            "bytes": list(s.encode()),
            "top_logprobs": top,
            "exit_layer": layer,
        }


def exit_config_summary(cfg: ExitConfig, policy: str) -> dict[str, Any]:
    """What a client needs to pick exit settings: layers, measures, defaults, calibrations."""
    measures = ["softmax_margin", "max_prob", "hidden_cosine"]
    if cfg.classifier:
        measures.append("classifier")
    if cfg.shortlist:
        measures += SHORTLIST_MEASURES
    calibrated = [
        {
            "measure": r.get("measure"),
            "tolerance": r.get("delta"),
            "threshold": r.get("threshold"),
            "policy": r.get("policy"),
        }
        for r in cfg.calibration
    ]
    return {
        "num_layers": cfg.num_layers,
        "exit_layers": list(cfg.exit_layers),
        "head": cfg.head,
        "measures": measures,
        "default_measure": cfg.default_measure,
        "thresholds": dict(cfg.thresholds),
        "calibrated": calibrated,
        "enabled_by_default": cfg.enabled_by_default,
        "exit_policy": policy,
    }


def _chat_delta(st: _ChoiceState, delta: str, finished: bool) -> dict[str, Any]:
    """A chat chunk's ``delta``: the new text, or with tools, its content and call parts."""
    if st.tools is None:
        return {"content": delta} if delta else {}
    content, calls = st.tools.delta(st.text, final=finished)
    out: dict[str, Any] = {"content": content} if content else {}
    if calls:
        out["tool_calls"] = calls
    return out


def _forced(c: CompletionOutput, k: int) -> bool:
    """Was token ``k`` forced by the request's grammar (no layer chose it)?"""
    return k < len(c.forced) and c.forced[k]


def _finish_reason(reason: str | None) -> str | None:
    return None if reason == "abort" else reason


def _usage(prompt_lens: list[int], finals: list[CompletionOutput]) -> dict[str, int]:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
