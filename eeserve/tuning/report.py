"""The ``tune-exits`` report: ``tuning.evaluate``'s figures as JSON and as markdown tables.

Contract: ``markdown(report)`` renders the report: the tokens and options, per exit layer the
shared and tuned heads' agreement, KL and the classifier's ECE, the chosen thresholds (one for
all layers, one per layer) with their exit fractions and ideal speed-ups, for a model trained to
exit its agreement with the original and its training curve, and per measure the threshold
sweep. ``write_report(folder, report)`` writes ``tune_report.json`` and ``tune_report.md`` and
returns the markdown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
