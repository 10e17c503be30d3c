"""Held-out evaluation of tuned exit heads: per-layer figures and the thresholds to store.

Contract: ``evaluate`` measures, on held-out generated tokens (teacher-forced: every token's
context is the full-depth one), per exit layer the argmax agreement with the final layer of the
shared head (final norm + LM head on h_l) and of the tuned head (on its input: h_l, or for
``layer`` heads h_mid of layer l + 1, collected with ``lens`` so the shared baseline stays h_l),
the full-vocabulary KL of each, the classifier's calibration (ECE), and for each measure a
threshold sweep: per layer, the fraction of tokens that would exit there and the agreement among
them; over all exit layers at once (``cascade``: a token leaves at the first exit whose
confidence reaches the threshold, as the engine's ``per_sequence`` policy does), the cumulative
exit fraction per layer, the agreement among exiting tokens, the overall agreement and the ideal
speed-up of the cost model in ``bench.exit_sweep``. Per measure it picks the loosest single
threshold whose exiting tokens agree with full depth at the target (``chosen``, what the sidecar
stores) and a per-layer set (``chosen_per_layer``); the default measure is the one with the best
ideal speed-up at its single threshold; exits are enabled by default only when that speed-up
reaches ``MIN_SPEEDUP``. ``tuning.report`` writes the result out.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from eeserve.exit_params import BASE_MEASURES, LOGIT_MEASURES
from eeserve.models.cost import CostModel
from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM
from eeserve.tuning.data import Collected

SWEEP = {
    "softmax_margin": [0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99],
    "max_prob": [0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99],
    "classifier": [0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99],
    "hidden_cosine": [0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99],
}
MIN_SPEEDUP = 1.1  # below this, exits are not worth enabling by default
NEVER = 1.01  # a threshold no measure reaches


@torch.no_grad()
def _layer_eval(
    model: LlamaForCausalLM,
    heads: ExitHeads,
    data: Collected,
    layer: int,
    teacher: torch.Tensor,
    reference: torch.Tensor | None,
) -> tuple[dict[str, Any], torch.Tensor, dict[str, torch.Tensor]]:
    """Per-layer numbers, the tuned head's agreement [N] and each measure's confidence [N]."""
    lm_w = model.lm_head.weight
    # x: the tuned head's input (h_mid of layer l + 1 for layer heads); the shared head (logit
    # lens) reads h_l (``Collected.lens``).
    x, x_lens, target = data.hidden[layer], data.lens[layer], data.target
    shared: list[torch.Tensor] = []
    tuned: list[torch.Tensor] = []
    conf: dict[str, list[torch.Tensor]] = {"softmax_margin": [], "max_prob": []}
    kl_shared = kl_tuned = 0.0
    for xs, xl, ts in zip(x.split(1024), x_lens.split(1024), teacher.split(1024)):
        ls = F.log_softmax(model.final_norm(xl) @ lm_w.T, -1)
        lt = F.log_softmax(heads.normed(layer, xs) @ lm_w.T, -1)
        kl_shared += float(F.kl_div(ls, ts, log_target=True, reduction="sum"))
        kl_tuned += float(F.kl_div(lt, ts, log_target=True, reduction="sum"))
        shared.append(ls.argmax(-1))
        tuned.append(lt.argmax(-1))
        top = lt.exp().topk(2, dim=-1).values
        conf["softmax_margin"].append(top[:, 0] - top[:, 1])
        conf["max_prob"].append(top[:, 0])
    agree = torch.cat(tuned) == target
    measures = {m: torch.cat(v) for m, v in conf.items()}
    measures["hidden_cosine"] = data.cosine[layer]
    measures["classifier"] = torch.sigmoid(heads.probe(layer, x))
    n = max(1, x.shape[0])
    row: dict[str, Any] = {
        "layer": layer,
        "agreement_shared": float((torch.cat(shared) == target).float().mean()),
        "agreement_tuned": float(agree.float().mean()),
        "kl_shared": kl_shared / n,
        "kl_tuned": kl_tuned / n,
        "classifier_ece": ece(measures["classifier"], agree),
    }
    if reference is not None:  # a model trained to exit: also against the original's argmax
        row["agreement_original"] = float((torch.cat(tuned) == reference).float().mean())
    return row, agree, measures


def ece(prob: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error of ``prob`` for the boolean ``outcome``."""
    which = (prob * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += float(sel.sum()) * abs(
                float(prob[sel].mean()) - float(outcome[sel].float().mean())
            )
    return total / max(1, prob.numel())


def cascade(
    conf: torch.Tensor,
    agree: torch.Tensor,
    layers: list[int],
    threshold: float | list[float],
    cost: Any,
    L: int,
) -> dict[str, Any]:
    """Exit at the first exit layer whose confidence reaches its threshold; conf/agree [N, E]."""
    passed = conf >= torch.tensor(threshold, dtype=conf.dtype)
    exits = passed.any(1)
    first = passed.float().argmax(1)  # index of the first passing exit (0 when none passes)
    ok = agree.gather(1, first[:, None]).squeeze(1) & exits
    n = max(1, conf.shape[0])
    depth = torch.tensor([*layers, L], dtype=torch.float32)[torch.where(exits, first, len(layers))]
    return {
        "threshold": threshold,
        "exit_fraction": float(exits.float().mean()),
        "exit_cdf": {
            str(lay): float((exits & (first <= e)).float().sum()) / n
            for e, lay in enumerate(layers)
        },
        "agreement_exiting": float(ok.sum()) / max(1, int(exits.sum())),
        "token_agreement": float((ok | ~exits).float().mean()),
        "mean_exit_layer": float(depth.mean()),
        "ideal_speedup": cost(exits, first),
    }


def _single(conf: torch.Tensor, agree: torch.Tensor, meets: Any) -> float:
    """The loosest one threshold for all layers whose cascade meets the target (1.01: never)."""
    grid = torch.quantile(conf.flatten().double(), torch.linspace(0, 1, 401, dtype=torch.float64))
    for t in sorted({round(float(x), 4) for x in grid}):
        if meets(t):
            return t
    return NEVER


def _layer_threshold(conf: torch.Tensor, agree: torch.Tensor, level: float) -> float:
    """The lowest threshold at which the tokens reaching it agree at ``level`` (>= 20 tokens)."""
    order = conf.argsort(descending=True)
    running = agree[order].float().cumsum(0) / torch.arange(1, conf.numel() + 1)
    ok = (running >= level).nonzero().flatten()
    ok = ok[ok >= 19]
    return round(float(conf[order[ok[-1]]]), 4) if ok.numel() else NEVER


def _per_layer(conf: torch.Tensor, agree: torch.Tensor, meets: Any) -> list[float]:
    """Per-layer thresholds, each the loosest that meets a common per-layer agreement level,
    raised until the cascade meets the target."""
    for level in torch.arange(0.9, 1.0001, 0.0025).tolist():
        ts = [_layer_threshold(conf[:, e], agree[:, e], level) for e in range(conf.shape[1])]
        if meets(ts):
            return ts
    return [NEVER] * conf.shape[1]


def _cost_fn(
    model: LlamaForCausalLM, heads: ExitHeads, layers: list[int], logit_measure: bool
) -> Any:
    """Ideal full-depth / early-exit cost per token (``models.cost.CostModel``; fill strategy).

    A check costs the head (adapter + LM head) for softmax measures, a dot product otherwise; a
    token that exits with a probe measure pays its head once more for its logits. A ``layer``
    head decides exit l inside layer l + 1: an exiting token also runs that layer's attention,
    whose K/V then need no fill, and its adapter cost is the head's MLP; a continuing token runs
    that attention anyway (nothing extra)."""
    adapter = sum(
        p.numel() for n, p in heads.head(layers[0]).named_parameters() if "classifier" not in n
    )
    cm = CostModel.of(model.config, adapter)
    L = model.config.num_layers
    probe = float(model.config.hidden_size)
    own_attn, attn_fills = (cm.attn, 1.0) if heads.layer_heads else (0.0, 0.0)

    def cost(exits: torch.Tensor, first: torch.Tensor) -> float:
        full = L * cm.layer + cm.head
        lay = torch.tensor(layers, dtype=torch.float32)
        n_checks = torch.where(exits, first + 1, len(layers)).float()
        check = cm.head + cm.adapter if logit_measure else probe
        out_head = torch.where(exits, 0.0 if logit_measure else cm.head + cm.adapter, cm.head)
        depth = torch.where(exits, lay[first], float(L))
        fill = torch.where(exits, L - depth - attn_fills, 0.0) * cm.kv_fill
        early = depth * cm.layer + exits.float() * own_attn + n_checks * check + out_head + fill
        return float(full / early.mean())

    return cost


def evaluate(
    model: LlamaForCausalLM,
    heads: ExitHeads,
    data: Collected,
    target: float,
    reference: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The evaluation (see the module docstring). ``reference`` [N]: for a model trained to exit,
    the original model's final argmax at the same positions (each layer row then also has
    ``agreement_original``)."""
    layers = heads.config.exit_layers
    L = model.config.num_layers
    with torch.no_grad():
        teacher = F.log_softmax(data.final @ model.lm_head.weight.T, -1)
    rows, agrees, confs = [], [], []
    for layer in layers:
        row, agree, conf = _layer_eval(model, heads, data, layer, teacher, reference)
        row["sweep"] = {m: _layer_sweep(conf[m], agree, SWEEP[m]) for m in BASE_MEASURES}
        rows.append(row)
        agrees.append(agree)
        confs.append(conf)
    agree_all = torch.stack(agrees, 1)
    sweeps, chosen, per_layer = {}, {}, {}
    for m in BASE_MEASURES:
        conf_m = torch.stack([c[m] for c in confs], 1)
        run = partial(
            cascade,
            conf_m,
            agree_all,
            layers,
            cost=_cost_fn(model, heads, layers, m in LOGIT_MEASURES),
            L=L,
        )
        sweeps[m], chosen[m], per_layer[m] = _cascades(run, conf_m, agree_all, target, SWEEP[m])
    useful = [m for m in BASE_MEASURES if chosen[m]["exit_fraction"] > 0]
    best = max(useful, key=lambda m: chosen[m]["ideal_speedup"], default="softmax_margin")
    return {
        "exit_layers": layers,
        "num_layers": L,
        "target_agreement": target,
        "layers": rows,
        "cascade": sweeps,
        "chosen": chosen,
        "chosen_per_layer": per_layer,
        "default_measure": best,
        "enabled_by_default": chosen[best]["ideal_speedup"] >= MIN_SPEEDUP,
    }


def _layer_sweep(
    conf: torch.Tensor, agree: torch.Tensor, thresholds: list[float]
) -> list[dict[str, Any]]:
    """One exit layer on its own: per threshold, the fraction of tokens whose confidence reaches
    it and their agreement with full depth (None when no token does)."""
    out: list[dict[str, Any]] = []
    for t in thresholds:
        exits = conf >= t
        agreement = float(agree[exits].float().mean()) if exits.any() else None
        out.append(
            {"threshold": t, "exit_fraction": float(exits.float().mean()), "agreement": agreement}
        )
    return out


def _cascades(
    run: Callable[[float | list[float]], dict[str, Any]],
    conf: torch.Tensor,
    agree: torch.Tensor,
    target: float,
    sweep: list[float],
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """One measure over all exit layers (``run``: its ``cascade`` at a threshold): at each
    ``sweep`` threshold, at the loosest single threshold whose exiting tokens agree at
    ``target`` and at the per-layer set that does."""

    def meets(t: float | list[float]) -> bool:
        res = run(t)
        return bool(res["exit_fraction"] > 0 and res["agreement_exiting"] >= target)

    single = _single(conf, agree, meets)
    return [run(t) for t in sweep], run(single), run(_per_layer(conf, agree, meets))
