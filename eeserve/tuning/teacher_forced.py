"""Teacher-forced quality of an exit rule: held-out perplexity with the exits applied per token.

Contract:
- ``ScoredText(ids, first)``: a token sequence whose tokens ``ids[first:]`` are scored, each
  predicted from the position before it. ``continuation_texts`` makes them from prompts and their
  full-depth continuations (scored from the second continuation token on: the first comes from
  the prefill, which never exits); ``passage_texts`` from plain texts (every token but the first).
- ``collect_scores(engine, texts, measures)`` runs each text once through the engine's own model
  at full depth (teacher-forced: every position reads the true prefix, computed at every layer)
  and keeps, per scored token and exit layer, the confidence of each measure (the engine's measure
  code on the engine's heads: ``ExitChecks.confidence``, as the exit loop checks),
  the log-probability of the true next token under that exit's full-vocabulary head and its
  argmax; and the same two at full depth.
- ``evaluate(scores, plan)`` applies an ``ExitPlan`` token by token: a token leaves at the first
  exit layer whose confidence >= that layer's threshold (the ``per_sequence`` decision; the other
  policies exit no token earlier than that) and is scored by that exit's head. With no exit (plan
  None, or no threshold reached) the perplexity is full depth's exactly.

Teacher forcing reads every earlier position at full depth; a served request's earlier tokens
may have left early (their deep K/V filled from a shallower state), which the ROUGE-L of the
generated text against full depth measures instead. docs/calibration.md ("Perplexity").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eeserve.engine.exit_loop import ExitLoop
from eeserve.engine.llm_engine import LLMEngine
from eeserve.engine.plan import ExitPlan
from eeserve.models.llama import LlamaForCausalLM, Rotary

_ROWS = 256  # scored positions per head projection: bounds the [rows, V] logits held at once


@dataclass(frozen=True)
class ScoredText:
    ids: list[int]
    first: int  # index of the first scored token (>= 1)


def continuation_texts(prompts: list[list[int]], outputs: list[list[int]]) -> list[ScoredText]:
    """Prompt + continuation, scored from the continuation's second token (the decode tokens)."""
    return [
        ScoredText(list(p) + list(o), len(p) + 1) for p, o in zip(prompts, outputs) if len(o) > 1
    ]


def passage_texts(token_ids: list[list[int]], max_len: int) -> list[ScoredText]:
    """Plain texts cut to ``max_len`` tokens, every token but the first scored."""
    return [ScoredText(ids[:max_len], 1) for ids in token_ids if len(ids[:max_len]) > 1]


@dataclass
class ExitScores:
    """Per scored token (all texts, concatenated: N tokens) at each of E exit layers."""

    num_layers: int
    layers: list[int]  # the exit layers scored, ascending
    confidence: dict[str, torch.Tensor]  # measure -> [E, N] float64
    logprob: torch.Tensor  # [E, N] float64: log p(true next token) under the exit's head
    argmax: torch.Tensor  # [E, N] the exit head's argmax
    full_logprob: torch.Tensor  # [N] float64, at full depth
    full_argmax: torch.Tensor  # [N]

    @property
    def tokens(self) -> int:
        return int(self.full_logprob.numel())


@dataclass(frozen=True)
class ExitQuality:
    """An exit rule's teacher-forced quality on the scored tokens of ``ExitScores``."""

    tokens: int
    perplexity: float  # each token scored by the head of the layer it exits at
    full_perplexity: float  # every token scored at full depth
    ratio: float  # perplexity / full_perplexity
    mean_exit_layer: float  # full depth counts as the model's last layer
    exited: float  # share of tokens leaving before full depth
    argmax_agreement: float  # share whose exit argmax equals full depth's


def token_exits(
    scores: ExitScores, plan: ExitPlan | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per scored token under ``plan``: exit layer [N] (full depth: the model's last layer), log
    p(true next token) [N] and argmax [N] of the head it exits at."""
    n = scores.tokens
    layer = torch.full((n,), scores.num_layers, dtype=torch.long)
    logp, arg = scores.full_logprob.clone(), scores.full_argmax.clone()
    if plan is not None and plan.mode != "exit":
        raise ValueError(f"a {str(plan.mode)!r} plan's output is full depth's: nothing exits")
    if plan is None or not plan.thresholds:
        return layer, logp, arg
    conf = scores.confidence.get(plan.measure)
    if conf is None or any(lay not in scores.layers for lay in plan.layers):
        raise ValueError(
            f"scores hold measures {sorted(scores.confidence)} at layers {scores.layers}; "
            f"the plan needs {str(plan.measure)!r} at {plan.layers}"
        )
    open_ = torch.ones(n, dtype=torch.bool)
    for lay in plan.layers:
        e = scores.layers.index(lay)
        go = open_ & (conf[e] >= plan.thresholds[lay])
        layer[go], logp[go], arg[go] = lay, scores.logprob[e][go], scores.argmax[e][go]
        open_ &= ~go
    return layer, logp, arg


def evaluate(scores: ExitScores, plan: ExitPlan | None) -> ExitQuality:
    """``plan`` applied token by token (see the module docstring)."""
    if scores.tokens == 0:
        raise ValueError("no scored tokens")
    layer, logp, arg = token_exits(scores, plan)
    ppl = math.exp(-float(logp.mean()))
    full = math.exp(-float(scores.full_logprob.mean()))
    return ExitQuality(
        tokens=scores.tokens,
        perplexity=ppl,
        full_perplexity=full,
        ratio=ppl / full,
        mean_exit_layer=float(layer.double().mean()),
        exited=float((layer < scores.num_layers).double().mean()),
        argmax_agreement=float((arg == scores.full_argmax).double().mean()),
    )


# -- the teacher-forced pass --------------------------------------------------------------------


def _attention(
    windows: tuple[int | None, ...], n: int, device: torch.device
) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Causal attention of one sequence of ``n`` positions over itself, with each layer's sliding
    window (keys a query sees, its own included), at the engine's scale (head_dim ** -0.5)."""
    pos = torch.arange(n, device=device)
    masks: dict[int, torch.Tensor] = {}

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, hd]
        window = windows[layer] if layer < len(windows) else None
        if window is None or window >= n:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            if window not in masks:
                back = pos[:, None] - pos[None, :]  # [n, n]: query minus key position
                masks[window] = (back >= 0) & (back < window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=masks[window], enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).reshape(n, -1)

    return attend


def _exit_states(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    rot: Rotary,
    rows: torch.Tensor,
    layers: list[int],
    layer_heads: bool,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """One full-depth pass over ``ids`` [n]: yields (exit layer, the head's input [m, D], the
    state it is compared with [m, D]) at ``rows`` [m], as the exit loop checks them (after layer
    l: h_l and h_(l-1); ``layer`` heads: h_mid of layer l + 1 and h_l), then (0, the last
    layer's output [m, D], the same)."""
    windows = model.config.layer_windows()
    attend = _attention(windows, int(ids.shape[0]), ids.device)
    at = {(lay + 1 if layer_heads else lay): lay for lay in layers}
    h = model.embed(ids)
    for j, layer in enumerate(model.layers, start=1):
        exit_layer = at.get(j)
        if exit_layer is None:
            h = layer(h, rot, attend)
        elif layer_heads:
            h_mid = layer.attn_block(h, rot, attend)
            yield exit_layer, h_mid[rows], h[rows]
            h = layer.mlp_block(h_mid)
        else:
            h_in = h[rows]
            h = layer(h, rot, attend)
            yield exit_layer, h[rows], h_in
    yield 0, h[rows], h[rows]


def _head_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [m, V], targets [m] -> (log p(target) [m] float64, argmax [m])."""
    logp = logits.float().log_softmax(dim=-1).gather(1, targets[:, None]).squeeze(1)
    return logp.double().cpu(), logits.argmax(dim=-1).cpu()


def _exit_scores(
    loop: ExitLoop,
    layer: int,
    h: torch.Tensor,
    h_prev: torch.Tensor,
    targets: torch.Tensor,
    measures: list[str],
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """At exit ``layer``: each measure's confidence [m] (float64), log p(target) [m], argmax [m]."""
    conf: dict[str, list[torch.Tensor]] = {m: [] for m in measures}
    logps, args = [], []
    for a in range(0, h.shape[0], _ROWS):
        hc, hp, tc = h[a : a + _ROWS], h_prev[a : a + _ROWS], targets[a : a + _ROWS]
        head: torch.Tensor | None = None
        for m in measures:
            c, lg = loop.checks.confidence(m, layer, hc, hp)
            conf[m].append(c.double().cpu())
            head = lg if lg is not None else head
        full = head if head is not None else loop.checks.head_logits(layer, hc)
        logp, arg = _head_scores(full, tc)
        logps.append(logp)
        args.append(arg)
    return {m: torch.cat(v) for m, v in conf.items()}, torch.cat(logps), torch.cat(args)


@dataclass
class _Parts:
    """Per-text pieces of ``ExitScores``, concatenated at the end."""

    conf: dict[str, list[list[torch.Tensor]]]  # measure -> per exit layer -> per text [m]
    logp: list[list[torch.Tensor]]  # per exit layer -> per text [m]
    arg: list[list[torch.Tensor]]
    full_logp: list[torch.Tensor]  # per text [m]
    full_arg: list[torch.Tensor]


def _score_text(
    engine: LLMEngine, text: ScoredText, exits: list[int], measures: list[str], parts: _Parts
) -> None:
    runner, loop = engine.runner, engine.runner.exit_loop
    ids = text.ids[: engine.max_model_len]
    if not 1 <= text.first < len(ids):
        return
    t = torch.tensor(ids, dtype=torch.long, device=runner.device)
    rows = torch.arange(text.first - 1, len(ids) - 1, device=runner.device)
    targets = t[text.first :]
    rot = Rotary(runner.cos[: len(ids)], runner.sin[: len(ids)])
    for layer, h, h_prev in _exit_states(runner.model, t, rot, rows, exits, loop.layer_heads):
        if layer == 0:
            for a in range(0, h.shape[0], _ROWS):
                normed = runner.model.final_norm(h[a : a + _ROWS])
                lp, am = _head_scores(loop.lm_head(normed), targets[a : a + _ROWS])
                parts.full_logp.append(lp)
                parts.full_arg.append(am)
            continue
        e = exits.index(layer)
        c, lp, am = _exit_scores(loop, layer, h, h_prev, targets, measures)
        for m in measures:
            parts.conf[m][e].append(c[m])
        parts.logp[e].append(lp)
        parts.arg[e].append(am)


@torch.inference_mode()
def collect_scores(
    engine: LLMEngine,
    texts: list[ScoredText],
    measures: list[str],
    layers: list[int] | None = None,
) -> ExitScores:
    """Teacher-forced scores of ``texts`` at ``layers`` (default: the exit config's exit layers)
    for ``measures`` (see the module docstring)."""
    num_layers = engine.model_config.num_layers
    exits = sorted(set(layers or engine.exit_config.exit_layers))
    if any(not 1 <= x < num_layers for x in exits):
        raise ValueError(f"exit layers must be in [1, {num_layers}), got {exits}")
    parts = _Parts({m: [[] for _ in exits] for m in measures}, [[] for _ in exits],
                   [[] for _ in exits], [], [])  # fmt: skip
    for text in texts:
        _score_text(engine, text, exits, measures, parts)
    if not parts.full_logp:
        raise ValueError("no text has a scored token")
    return ExitScores(
        num_layers=num_layers,
        layers=exits,
        confidence={m: torch.stack([torch.cat(x) for x in v]) for m, v in parts.conf.items()},
        logprob=torch.stack([torch.cat(x) for x in parts.logp]),
        argmax=torch.stack([torch.cat(x) for x in parts.arg]),
        full_logprob=torch.cat(parts.full_logp),
        full_argmax=torch.cat(parts.full_arg),
    )
