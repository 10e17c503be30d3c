"""Exit-head training on a frozen model: the loss and the per-layer training.

Contract: ``tune_layers`` trains, per exit layer, a ``tuned`` exit head (own RMSNorm and a
residual adapter feeding the model's frozen LM head; ``layer`` heads: ``tuning.layer_heads``) by
distillation from the final layer's distribution, then a classifier probe on the trained head's
agreement with the final argmax (on tuning text the head never saw); ``tuning.evaluate`` measures
both on held-out generated tokens and picks the thresholds. The model's weights are only read (a
test checks them bit for bit). Training data is the user's text, or by default the model's own
continuations (``tuning.groups``), as hidden states (``tuning.data``). Deterministic for a seed
and thread count; every trained layer is checkpointed in the cache folder, and a rerun with the
same options resumes.

Training details, each chosen by measurement on the default model (README, "Tuned exit heads"):
- KL(final || exit) over a sampled vocabulary: the batch's teacher top-k tokens plus uniformly
  drawn negatives (all tokens when the vocabulary is small): exact on that subset and ~10x
  cheaper than 49k-way logits on a CPU.
- Heads start as the shared head (final-norm weights, identity adapter); layers are trained
  deepest first and each starts from the one above it (adjacent layers' maps are alike).
- The first adapter matrix is trained on standardised inputs (the residual stream has a few
  dimensions ~40x the median) and folded back into the stored weights afterwards.
- Probes: L2-regularised logistic regression, the penalty picked by two-fold log-loss.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import ExitHead, ExitHeads
from eeserve.models.llama import LlamaForCausalLM, RMSNorm
from eeserve.tuning.data import Collected
from eeserve.tuning.layer_heads import init_layer_heads
from eeserve.tuning.options import TuneOptions

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


# -- training ------------------------------------------------------------------------------------


def init_heads(cfg: ExitConfig, model: LlamaForCausalLM) -> ExitHeads:
    """Tuned heads that start as the shared head: final-norm weights, identity adapters (``layer``
    heads: the shared head at layer l + 1)."""
    heads = ExitHeads(cfg, model.config.hidden_size, model.config.rms_norm_eps)
    final = model.model.norm
    assert isinstance(final, RMSNorm)
    with torch.no_grad():
        for layer in cfg.exit_layers:
            heads.head(layer).norm.weight.copy_(final.weight)
    if cfg.adapter == "layer":
        init_layer_heads(heads, model)
    return heads


def schedule(step: int, total: int) -> float:
    """Learning-rate factor: linear warm-up over the first 5%, then cosine down to 0.1."""
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
    # Preconditioning: the first adapter matrix is trained on standardised inputs (the residual
    # stream has a few dimensions ~40x the median) and folded back afterwards.
    mu, sd = _stats(x)
    _fold(head, mu, sd, unfold=True)
    lr = opts.layer_lr if head.adapter.kind == "layer" else opts.lr
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=opts.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, steps))
    losses: list[float] = []
    bar = tqdm(range(steps), desc=desc, unit="step")
    order = torch.randperm(n, generator=gen)
    for step in bar:
        i = step % per_epoch
        if i == 0 and step:
            order = torch.randperm(n, generator=gen)
        idx = order[i * opts.batch_size : (i + 1) * opts.batch_size]
        cand = candidates(data.top_idx[idx, : opts.topk], vocab, opts.negatives, gen)
        student = head.norm(_adapt(head, x[idx], mu, sd))
        loss = sampled_kl(student, data.final[idx], lm_w, cand)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    bar.close()
    _fold(head, mu, sd, unfold=False)
    return losses


def _adapt(head: ExitHead, h: torch.Tensor, mu: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """The adapter with its first matrix applied to (h - mu) / sd (bias-free: h / sd)."""
    ad = head.adapter
    if ad.kind in ("none", "layer"):  # a layer head's first op is an RMSNorm: nothing to scale
        return ad(h)  # type: ignore[no-any-return]
    first = ad.layers[0]
    assert isinstance(first, torch.nn.Linear)
    mid = first((h - mu) / sd if first.bias is not None else h / sd)
    if ad.kind == "linear":
        return h + mid
    return h + ad.layers[1](F.silu(mid) if ad.kind == "mlp" else mid)


@torch.no_grad()
def _fold(head: ExitHead, mu: torch.Tensor, sd: torch.Tensor, unfold: bool) -> None:
    """Between W' on standardised inputs and W on raw ones: W = W' / sd, b = b' - W mu."""
    if head.adapter.kind in ("none", "layer"):
        return
    first = head.adapter.layers[0]
    assert isinstance(first, torch.nn.Linear)
    if unfold:
        if first.bias is not None:
            first.bias.add_(first.weight @ mu)
        first.weight.mul_(sd)
    else:
        first.weight.div_(sd)
        if first.bias is not None:
            first.bias.sub_(first.weight @ mu)


@torch.no_grad()
def head_argmax(head: ExitHead, x: torch.Tensor, lm_w: torch.Tensor) -> torch.Tensor:
    return torch.cat([(head.norm(head.adapter(c)) @ lm_w.T).argmax(-1) for c in x.split(1024)])


def _fit_logistic(z: torch.Tensor, y: torch.Tensor, l2: float) -> tuple[torch.Tensor, torch.Tensor]:
    rate = float(y.mean().clamp(1e-3, 1 - 1e-3))
    w = torch.zeros(z.shape[1], requires_grad=True)
    b = torch.tensor(math.log(rate / (1 - rate)), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * w.square().sum() / 2
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]
    return w.detach(), b.detach()


def train_probe(
    head: ExitHead, x: torch.Tensor, agree: torch.Tensor, l2s: tuple[float, ...] = (0.01, 0.1, 1)
) -> float:
    """Logistic regression of ``agree`` on ``x`` into ``head.classifier``; returns the penalty.

    Fitted on standardised features (folded back into the probe); the L2 penalty is the one of
    ``l2s`` with the lowest two-fold held-out log-loss (a weak penalty was measured to give
    overconfident probes on held-out text).
    """
    assert head.classifier is not None
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z, y = (x - mu) / sd, agree.float()
    half = z.shape[0] // 2
    folds = [(slice(0, half), slice(half, None)), (slice(half, None), slice(0, half))]

    def cv_loss(l2: float) -> float:
        total = 0.0
        for fit, val in folds:
            w, b = _fit_logistic(z[fit], y[fit], l2)
            total += float(F.binary_cross_entropy_with_logits(z[val] @ w + b, y[val]))
        return total

    best = min(l2s, key=cv_loss) if half >= 8 else l2s[-1]
    w, b = _fit_logistic(z, y, best)
    with torch.no_grad():
        head.classifier.weight.copy_((w / sd)[None])
        head.classifier.bias.fill_(float(b - (w * mu / sd).sum()))
    return float(best)


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(0), x.std(0).clamp_min(1e-4)


def _warm_start(dst: ExitHead, src: ExitHead, x_dst: torch.Tensor, x_src: torch.Tensor) -> None:
    """``dst`` := ``src`` as a map of standardised inputs, re-expressed for ``dst``'s inputs."""
    tmp = copy.deepcopy(src)
    _fold(tmp, *_stats(x_src), unfold=True)
    state = {k: v for k, v in tmp.state_dict().items() if not k.startswith("classifier")}
    dst.load_state_dict(state, strict=False)
    _fold(dst, *_stats(x_dst), unfold=False)


def tune_layers(
    model: LlamaForCausalLM,
    heads: ExitHeads,
    train: Collected,
    probe: Collected,
    opts: TuneOptions,
    checkpoints: Path | None = None,
) -> dict[int, dict[str, float]]:
    """Train every head (deepest first, each from the one above), then its probe; a layer with a
    checkpoint is loaded instead of trained."""
    lm_w = model.lm_head.weight.detach()
    stats: dict[int, dict[str, float]] = {}
    above: int | None = None
    for layer in sorted(heads.config.exit_layers, reverse=True):
        head = heads.head(layer)
        ckpt = checkpoints / f"layer{layer}.pt" if checkpoints else None
        if ckpt is not None and ckpt.exists():
            saved = torch.load(ckpt, weights_only=True)
            head.load_state_dict(saved["state"])
            stats[layer], above = saved["stats"], layer
            continue
        if above is not None and opts.adapter not in ("none", "layer"):
            _warm_start(head, heads.head(above), train.hidden[layer], train.hidden[above])
        losses = train_head(head, train.hidden[layer], train, lm_w, opts, f"layer {layer}")
        agree = head_argmax(head, probe.hidden[layer], lm_w) == probe.target
        l2 = train_probe(head, probe.hidden[layer], agree)
        stats[layer] = {
            "first_loss": sum(losses[:10]) / len(losses[:10]),
            "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "steps": float(len(losses)),
            "probe_agreement": float(agree.float().mean()),
            "probe_l2": l2,
        }
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"state": head.state_dict(), "stats": stats[layer]}, ckpt)
        above = layer
    return stats
