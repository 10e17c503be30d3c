"""Exit-head tuning on a frozen model: ``eeserve tune-exits``.

Contract: ``tune(opts)`` trains, per exit layer, a ``tuned`` exit head (own RMSNorm, initialised
from the final norm, and a residual adapter, initialised to the identity, feeding the model's
frozen LM head) by distillation from the final layer's distribution, then a classifier probe on
the trained head's agreement with the final argmax; it evaluates both on held-out generated
tokens, picks per measure the loosest threshold whose exiting tokens still agree with full depth
at ``target_agreement``, writes the sidecar (``save_sidecar``) and a report (JSON + markdown).
The base model's weights are only read (a test checks them bit for bit). Training data is the
user's text, or by default the model's own continuations (``tuning_data.self_generated``).
Each trained layer is checkpointed in the cache folder; a rerun with the same options resumes.

The distillation loss is KL(final || exit) over a sampled vocabulary: the teacher's top-k tokens
of every row in the batch plus uniformly drawn negatives (the full vocabulary when it is small),
exact on that subset and ~10x cheaper than 49k-way logits on a CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from eeserve.exits import ExitConfig
from eeserve.models.exit_heads import ADAPTERS, ExitHead, ExitHeads, save_sidecar
from eeserve.models.llama import LlamaForCausalLM, RMSNorm
from eeserve.tuning_data import Collected
from eeserve.tuning_report import evaluate, write_report

DEFAULT_ADAPTER = "linear"


@dataclass
class TuneOptions:
    model: str
    exit_layers: list[int]
    out: Path
    data: list[Path] = field(default_factory=list)
    tokens: int = 30000  # self-generated tuning tokens (heads and probes together)
    heldout_tokens: int = 6000
    steps: int | None = None  # optimizer steps per head; default ``epochs`` passes
    epochs: int = 4
    adapter: str = DEFAULT_ADAPTER
    rank: int = 128  # lowrank / mlp width
    seed: int = 0
    batch_size: int = 256
    lr: float = 1e-3
    probe_fraction: float = 0.15  # of the tuning groups, kept for the probes (unseen by heads)
    topk: int = 32
    negatives: int = 1024
    max_tokens: int = 192  # per generated continuation
    target_agreement: float = 0.95
    threads: int = 2
    cache_dir: Path | None = None

    def key(self, *names: str) -> str:
        d = asdict(self)
        d["data"] = [(str(p), p.stat().st_mtime_ns) for p in self.data]
        picked = {n: d[n] for n in names} if names else d
        picked.pop("out", None), picked.pop("cache_dir", None), picked.pop("threads", None)
        return hashlib.sha256(json.dumps(picked, default=str).encode()).hexdigest()[:16]


# -- the loss ------------------------------------------------------------------------------------


def candidates(
    top_idx: torch.Tensor, vocab: int, negatives: int, gen: torch.Generator
) -> torch.Tensor:
    """Sorted token ids: the rows' teacher top-k plus ``negatives`` random ones (or all)."""
    if top_idx.numel() + negatives >= vocab // 2:
        return torch.arange(vocab)
    rand = torch.randint(0, vocab, (negatives,), generator=gen)
    return torch.cat([top_idx.reshape(-1), rand]).unique()


def sampled_kl(
    student: torch.Tensor, teacher: torch.Tensor, lm_w: torch.Tensor, cand: torch.Tensor
) -> torch.Tensor:
    """Mean KL(softmax(teacher) || softmax(student)) over the vocabulary subset ``cand``.

    student/teacher: [B, D] inputs of the LM head; lm_w: [V, D] its weight.
    """
    w = lm_w[cand]
    with torch.no_grad():
        t = F.log_softmax(teacher @ w.T, dim=-1)
    s = F.log_softmax(student @ w.T, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def full_kl(student: torch.Tensor, teacher: torch.Tensor, lm_w: torch.Tensor) -> float:
    """Mean full-vocabulary KL(teacher || student) (for reports and tests), in chunks."""
    total = 0.0
    with torch.no_grad():
        for s, t in zip(student.split(1024), teacher.split(1024)):
            total += float(
                F.kl_div(
                    F.log_softmax(s @ lm_w.T, -1),
                    F.log_softmax(t @ lm_w.T, -1),
                    log_target=True,
                    reduction="sum",
                )
            )
    return total / max(1, student.shape[0])


# -- training ------------------------------------------------------------------------------------


def init_heads(cfg: ExitConfig, model: LlamaForCausalLM) -> ExitHeads:
    """Tuned heads that start as the shared head: final-norm weights, identity adapters."""
    heads = ExitHeads(cfg, model.config.hidden_size, model.config.rms_norm_eps)
    final = model.model.norm
    assert isinstance(final, RMSNorm)
    with torch.no_grad():
        for layer in cfg.exit_layers:
            heads.head(layer).norm.weight.copy_(final.weight)
    return heads


def _schedule(step: int, total: int) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def train_head(
    head: ExitHead,
    x: torch.Tensor,
    data: Collected,
    lm_w: torch.Tensor,
    opts: TuneOptions,
    desc: str = "head",
) -> list[float]:
    """Distil ``head`` on hidden states ``x`` [N, D]; returns the loss per step."""
    gen = torch.Generator().manual_seed(opts.seed)
    n, vocab = x.shape[0], lm_w.shape[0]
    per_epoch = math.ceil(n / opts.batch_size)
    steps = opts.steps or opts.epochs * per_epoch
    params = [p for name, p in head.named_parameters() if not name.startswith("classifier")]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, steps))
    losses: list[float] = []
    bar = tqdm(range(steps), desc=desc, unit="step")
    order = torch.randperm(n, generator=gen)
    for step in bar:
        i = step % per_epoch
        if i == 0 and step:
            order = torch.randperm(n, generator=gen)
        idx = order[i * opts.batch_size : (i + 1) * opts.batch_size]
        cand = candidates(data.top_idx[idx, : opts.topk], vocab, opts.negatives, gen)
        loss = sampled_kl(head.norm(head.adapter(x[idx])), data.final[idx], lm_w, cand)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    bar.close()
    return losses


@torch.no_grad()
def head_argmax(head: ExitHead, x: torch.Tensor, lm_w: torch.Tensor) -> torch.Tensor:
    return torch.cat([(head.norm(head.adapter(c)) @ lm_w.T).argmax(-1) for c in x.split(1024)])


def train_probe(head: ExitHead, x: torch.Tensor, agree: torch.Tensor, l2: float = 1e-2) -> None:
    """Logistic regression of ``agree`` on ``x`` (standardised, folded back into the probe)."""
    assert head.classifier is not None
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z, y = (x - mu) / sd, agree.float()
    rate = float(y.mean().clamp(1e-3, 1 - 1e-3))
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.tensor(math.log(rate / (1 - rate)), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * w.square().sum() / 2
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        head.classifier.weight.copy_((w / sd)[None])
        head.classifier.bias.fill_(float(b - (w * mu / sd).sum()))


def tune_layers(
    model: LlamaForCausalLM,
    heads: ExitHeads,
    train: Collected,
    probe: Collected,
    opts: TuneOptions,
    checkpoints: Path | None = None,
) -> dict[int, dict[str, float]]:
    """Train every head, then its probe; a layer with a checkpoint is loaded instead."""
    lm_w = model.lm_head.weight.detach()
    stats: dict[int, dict[str, float]] = {}
    for layer in heads.config.exit_layers:
        head = heads.head(layer)
        ckpt = checkpoints / f"layer{layer}.pt" if checkpoints else None
        if ckpt is not None and ckpt.exists():
            saved = torch.load(ckpt, weights_only=True)
            head.load_state_dict(saved["state"])
            stats[layer] = saved["stats"]
            continue
        losses = train_head(head, train.hidden[layer], train, lm_w, opts, f"layer {layer}")
        agree = head_argmax(head, probe.hidden[layer], lm_w) == probe.target
        train_probe(head, probe.hidden[layer], agree)
        stats[layer] = {
            "first_loss": sum(losses[:10]) / len(losses[:10]),
            "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "steps": float(len(losses)),
            "probe_agreement": float(agree.float().mean()),
        }
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"state": head.state_dict(), "stats": stats[layer]}, ckpt)
    return stats


# -- the command ----------------------------------------------------------------------------------


def tune(opts: TuneOptions) -> dict[str, Any]:
    """The whole ``tune-exits`` run; returns the report (also written next to the sidecar)."""
    from eeserve.loader import eeserve_home, load_model, resolve_model
    from eeserve.tuning_data import load_groups

    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    start = time.perf_counter()
    folder = resolve_model(opts.model)
    cache = opts.cache_dir or eeserve_home() / "tune" / folder.name
    train_groups, heldout_groups = load_groups(
        opts.model, opts.data, opts.tokens, opts.heldout_tokens, opts.seed, opts.max_tokens, cache
    )
    model, mcfg = load_model(folder, torch.float32, torch.device("cpu"))
    bad = [x for x in opts.exit_layers if not 1 <= x < mcfg.num_layers]
    if bad:
        raise ValueError(f"exit layers must be in [1, {mcfg.num_layers - 1}]: {bad}")
    train, probe, heldout = _collect_all(model, train_groups, heldout_groups, opts)
    cfg = ExitConfig(
        num_layers=mcfg.num_layers,
        exit_layers=sorted(set(opts.exit_layers)),
        head="tuned",
        adapter=opts.adapter,
        adapter_rank=opts.rank if opts.adapter in ("lowrank", "mlp") else 0,
        classifier=True,
    )
    heads = init_heads(cfg, model)
    t_train = time.perf_counter()
    stats = tune_layers(model, heads, train, probe, opts, cache / f"heads-{opts.key()}")
    report = evaluate(model, heads, heldout, opts.target_agreement)
    report.update(
        model=opts.model,
        options={k: v for k, v in asdict(opts).items() if k not in ("out", "cache_dir")},
        tokens={"train": train.size, "probe": probe.size, "heldout": heldout.size},
        training=stats,
        seconds={"data": t_train - start, "total": time.perf_counter() - start},
    )
    cfg.default_measure = report["default_measure"]
    cfg.thresholds = {m: c["threshold"] for m, c in report["chosen"].items()}
    cfg.enabled_by_default = bool(report["enabled_by_default"])
    save_sidecar(opts.out, cfg, heads)
    print(write_report(opts.out, report))
    return report


def _collect_all(
    model: LlamaForCausalLM, train_groups: list[Any], heldout_groups: list[Any], opts: TuneOptions
) -> tuple[Collected, Collected, Collected]:
    from eeserve.tuning_data import collect

    layers = sorted(set(opts.exit_layers))
    n_probe = max(1, round(len(train_groups) * opts.probe_fraction))
    train = collect(model, train_groups[:-n_probe], layers, opts.topk, desc="collect (heads)")
    probe = collect(model, train_groups[-n_probe:], layers, opts.topk, desc="collect (probes)")
    heldout = collect(model, heldout_groups, layers, opts.topk, desc="collect (heldout)")
    return train, probe, heldout


def add_tune_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tune-exits",
        help="train tuned exit heads and classifier probes on a frozen model",
        description="Distil per-layer exit heads (own norm + adapter, frozen LM head) from the "
        "final layer, train classifier probes, evaluate on held-out generated text and write "
        "the exit sidecar and a report to --out.",
    )
    p.add_argument("model", help="smollm2, an HF folder or a .gguf file")
    p.add_argument("--exit-layers", required=True, help="comma-separated, e.g. 6,10,14,18,22,26")
    p.add_argument("--out", required=True, type=Path, help="folder for the sidecar and report")
    p.add_argument(
        "--data",
        nargs="+",
        type=Path,
        default=[],
        help=".txt/.jsonl training text "
        "(default: the model's own continuations of the offline 'tune' prompts)",
    )
    p.add_argument("--tokens", type=int, default=30000, help="self-generated tuning tokens")
    p.add_argument("--heldout-tokens", type=int, default=6000)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per head")
    p.add_argument("--epochs", type=int, default=4, help="passes over the data (without --steps)")
    p.add_argument("--adapter", default=DEFAULT_ADAPTER, choices=ADAPTERS)
    p.add_argument("--rank", type=int, default=128, help="lowrank / mlp width")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-agreement", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", type=Path, default=None, help="checkpoints (resumable)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    layers = [int(x) for x in str(args.exit_layers).split(",") if x.strip()]
    opts = TuneOptions(
        model=args.model,
        exit_layers=layers,
        out=args.out,
        data=list(args.data),
        tokens=args.tokens,
        heldout_tokens=args.heldout_tokens,
        steps=args.steps,
        epochs=args.epochs,
        adapter=args.adapter,
        rank=args.rank,
        seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        target_agreement=args.target_agreement,
        threads=args.threads,
        cache_dir=args.cache_dir,
    )
    tune(opts)
    return 0
