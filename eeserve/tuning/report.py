"""Held-out evaluation of tuned exit heads and the ``tune-exits`` report.

Contract: ``evaluate`` measures, on held-out generated tokens (teacher-forced: every token's
context is the full-depth one), per exit layer the argmax agreement with the final layer of the
shared head (final norm + LM head on h_l) and of the tuned head (on its input: h_l, or for
``layer`` heads h_mid of layer l + 1, collected with ``lens`` so the shared baseline stays h_l),
the full-vocabulary KL of each, the classifier's calibration (ECE), and for each measure a
threshold sweep: per layer, the fraction of tokens that would exit there and the agreement among
them; over all exit layers at once (a token leaves at the first exit whose confidence reaches the
threshold, as the engine's ``per_sequence`` policy does), the cumulative exit fraction per layer,
the agreement among exiting tokens, the overall agreement and the ideal speed-up of the cost model
in ``bench.exit_sweep``. Per measure it picks the loosest single threshold whose exiting tokens
agree with full depth at the target (``chosen``, what the sidecar stores) and a per-layer set
(``chosen_per_layer``); the default measure is the one with the best ideal speed-up at its single
threshold; exits are enabled by default only when that speed-up reaches ``MIN_SPEEDUP``.
``write_report`` writes ``tune_report.json`` and ``tune_report.md`` and returns the markdown.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
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
    """``reference`` [N]: for a model trained to exit, the original model's final argmax at the
    same positions (each layer row then also has ``agreement_original``)."""
    layers = heads.config.exit_layers
    L = model.config.num_layers
    with torch.no_grad():
        teacher = F.log_softmax(data.final @ model.lm_head.weight.T, -1)
    rows, agrees, confs = [], [], []
    for layer in layers:
        row, agree, conf = _layer_eval(model, heads, data, layer, teacher, reference)
        row["sweep"] = {
            m: [
                {
                    "threshold": t,
                    "exit_fraction": float((conf[m] >= t).float().mean()),
                    "agreement": float(agree[conf[m] >= t].float().mean())
                    if (conf[m] >= t).any()
                    else None,
                }
                for t in SWEEP[m]
            ]
            for m in BASE_MEASURES
        }
        rows.append(row)
        agrees.append(agree)
        confs.append(conf)
    agree_m = torch.stack(agrees, 1)
    sweeps, chosen, per_layer = {}, {}, {}
    for m in BASE_MEASURES:
        conf_m = torch.stack([c[m] for c in confs], 1)
        cost = _cost_fn(model, heads, layers, m in LOGIT_MEASURES)
        run = partial(cascade, conf_m, agree_m, layers, cost=cost, L=L)

        def meets(t: float | list[float], run: Any = run) -> bool:
            res = run(t)
            return bool(res["exit_fraction"] > 0 and res["agreement_exiting"] >= target)

        sweeps[m] = [run(t) for t in SWEEP[m]]
        chosen[m] = run(_single(conf_m, agree_m, meets))
        per_layer[m] = run(_per_layer(conf_m, agree_m, meets))
    useful = [m for m in BASE_MEASURES if chosen[m]["exit_fraction"] > 0]
    best = max(useful, key=lambda m: chosen[m]["ideal_speedup"], default="softmax_margin")
    good = chosen[best]["ideal_speedup"] >= MIN_SPEEDUP
    return {
        "exit_layers": layers,
        "num_layers": L,
        "target_agreement": target,
        "layers": rows,
        "cascade": sweeps,
        "chosen": chosen,
        "chosen_per_layer": per_layer,
        "default_measure": best,
        "enabled_by_default": good,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt(t: float | list[float]) -> str:
    return " / ".join(f"{x:.3g}" for x in t) if isinstance(t, list) else f"{t:.4g}"


def _chosen_rows(r: dict[str, Any]) -> list[str]:
    layers = r["exit_layers"]
    head = " | ".join(f"exit <= {lay}" for lay in layers)
    out = [
        f"| measure | threshold | {head} | agree (exiting) | agree (all) | mean exit "
        "| ideal speed-up |",
        "|---|---|" + "---:|" * (len(layers) + 4),
    ]
    for kind in ("chosen", "chosen_per_layer"):
        for m, c in r[kind].items():
            cdf = " | ".join(f"{c['exit_cdf'][str(lay)]:.2f}" for lay in layers)
            out.append(
                f"| {m} | {_fmt(c['threshold'])} | {cdf} | {c['agreement_exiting']:.3f} "
                f"| {c['token_agreement']:.3f} | {c['mean_exit_layer']:.1f} "
                f"| {c['ideal_speedup']:.2f} |"
            )
    return out


def _sweep_rows(r: dict[str, Any], m: str) -> list[str]:
    layers = r["exit_layers"]
    out = [
        "| threshold | " + " | ".join(f"layer {lay}" for lay in layers) + " | cascade |",
        "|---:|" + "---|" * (len(layers) + 1),
    ]
    for i, c in enumerate(r["cascade"][m]):
        cells = [
            f"{s['exit_fraction']:.2f} / {_pct(s['agreement'])}"
            for s in (row["sweep"][m][i] for row in r["layers"])
        ]
        cells.append(f"{c['exit_fraction']:.2f} / {c['agreement_exiting']:.2f}")
        out.append(f"| {c['threshold']:g} | " + " | ".join(cells) + " |")
    return out


def markdown(r: dict[str, Any]) -> str:
    out = [
        f"# Exit-head tuning report: {r.get('model', '?')}",
        "",
        "Tokens: "
        + ", ".join(f"{k} {v}" for k, v in r.get("tokens", {}).items())
        + f"; adapter `{r.get('options', {}).get('adapter')}`; "
        f"{r.get('seconds', {}).get('total', 0):.0f} s.",
        "",
        "Argmax agreement with the final layer on held-out generated tokens (teacher-forced):",
        "",
        "| layer | shared head | tuned head | KL shared | KL tuned | classifier ECE |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["layers"]:
        out.append(
            f"| {row['layer']} | {row['agreement_shared']:.3f} | {row['agreement_tuned']:.3f} "
            f"| {row['kl_shared']:.2f} | {row['kl_tuned']:.2f} | {row['classifier_ece']:.3f} |"
        )
    out += [
        "",
        f"Thresholds for agreement >= {r['target_agreement']} among exiting tokens, one for all "
        "exit layers (first four rows) or one per layer (last four; 1.01 = never exit there). "
        "A token exits at the first exit layer whose confidence reaches the threshold. "
        f"Default measure `{r['default_measure']}`, enabled by default: "
        f"{r['enabled_by_default']}. Ideal speed-up: `models.cost.CostModel`, KV fill."
        + _layer_note(r),
        "",
        *_chosen_rows(r),
        *_variant_rows(r),
    ]
    for m in r["cascade"]:
        out += [
            "",
            f"Sweep `{m}` (per layer: exit fraction / agreement among exiting; "
            "all exits: cascade):",
            "",
            *_sweep_rows(r, m),
        ]
    return "\n".join(out) + "\n"


def _variant_rows(r: dict[str, Any]) -> list[str]:
    """A model trained to exit (``tune-exits --train-base lora``) against the original."""
    v = r.get("variant")
    if not v:
        return []
    ppl = v["perplexity"]
    out = [
        "",
        f"Model trained to exit (base delta rank {v['lora_rank']}): the variant's full depth "
        f"agrees with the original's on {v['full_depth_agreement_with_original']:.3f} of held-out "
        f"tokens; held-out prompt perplexity {ppl['original']:.2f} (original) -> "
        f"{ppl['variant']:.2f} (variant). Tuned-head argmax agreement per exit layer:",
        "",
        "| layer | with the variant's final | with the original's final |",
        "|---:|---:|---:|",
    ]
    for row in r["layers"]:
        out.append(
            f"| {row['layer']} | {row['agreement_tuned']:.3f} | {row['agreement_original']:.3f} |"
        )
    return out + _curve_rows(v["training"].get("curve", []))


def _curve_rows(curve: list[dict[str, Any]]) -> list[str]:
    """The delta's training curve: its joint heads' held-out agreement against positions trained."""
    if not curve:
        return []
    layers = list(curve[0]["exit_agreement"])
    out = [
        "",
        f"Training curve ({curve[0]['positions']} held-out positions, teacher-forced): the joint "
        "heads' argmax agreement with the variant's own final, and the variant's full depth "
        "with the original's.",
        "",
        "| positions | " + " | ".join(f"layer {x}" for x in layers) + " | full depth |",
        "|---:|" + "---:|" * (len(layers) + 1),
    ]
    for c in curve:
        cells = [f"{c['exit_agreement'][x]:.3f}" for x in layers]
        full = c["full_depth_agreement_with_original"]
        out.append(f"| {c['tokens']} | " + " | ".join(cells) + f" | {full:.3f} |")
    return out


def _layer_note(r: dict[str, Any]) -> str:
    if r.get("options", {}).get("adapter") != "layer":
        return ""
    return (
        " Layer heads: the head of exit l is layer l+1's attention (shared) plus a tuned copy of "
        "its MLP; it reads the state between the two, and `hidden_cosine` there is "
        "cos(h_mid, h_l)."
    )


def write_report(folder: Path, report: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tune_report.json").write_text(json.dumps(report, indent=2, default=str))
    md = markdown(report)
    (folder / "tune_report.md").write_text(md)
    return md
