"""Hidden states for exit-head tuning: token groups (``tuning.groups``) in, hidden states out.

Contract: ``collect`` runs the frozen model once over every group (no KV cache; block-causal
attention: each continuation sees its prompt and its own earlier tokens, ``pack_groups``) and
keeps, at trained positions only: the hidden state after each exit layer, its cosine with the
state before that layer (``hidden_cosine``), the final-normed hidden state (the teacher's logits
are recomputed from it on the fly: 30k x 49152 fp32 logits would be 6 GB) and the teacher's top-k
token ids (the first is the final layer's argmax). For ``layer`` exit heads (``mid=True``) the
state kept for exit l is h_mid of layer l + 1 instead (between its attention and MLP halves),
with cos(h_mid, h_l). ``collect_splits`` gives the head-training, probe-training and held-out
sets; ``run_layers`` and ``exit_states`` are the same pass with gradients left on, for
``tuning.delta_train``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from eeserve.models.config import rope_tables
from eeserve.models.llama import LlamaForCausalLM, Rotary
from eeserve.tuning.groups import Group


@dataclass
class Collected:
    hidden: dict[int, torch.Tensor]  # exit layer -> [N, D] the head's input (h_l, or h_mid)
    cosine: dict[int, torch.Tensor]  # exit layer -> [N] cos(that input, the state before it)
    final: torch.Tensor  # [N, D] final-normed hidden state (teacher = lm_head(final))
    top_idx: torch.Tensor  # [N, k] int64, the teacher's top-k token ids (argmax first)
    # exit layer -> [N, D] h_l, the logit-lens baseline's input: ``hidden`` itself, except for
    # ``layer`` heads (``collect(mid=True)``), where it is kept only when asked (``lens=True``).
    lens: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.final.shape[0])

    @property
    def target(self) -> torch.Tensor:
        return self.top_idx[:, 0]


@dataclass
class Packed:
    ids: torch.Tensor  # [n] token ids of all groups, flat
    positions: torch.Tensor  # [n]
    spans: list[tuple[int, int, torch.Tensor]]  # (start, end, attention mask [len, len])
    rows: torch.Tensor  # [m] flat indices of trained positions

    def to(self, device: torch.device) -> Packed:
        spans = [(a, b, m.to(device)) for a, b, m in self.spans]
        return Packed(self.ids.to(device), self.positions.to(device), spans, self.rows.to(device))


def pack_groups(groups: list[Group], prompt_rows: bool, decode_rows: bool) -> Packed:
    ids: list[int] = []
    pos: list[int] = []
    spans: list[tuple[int, int, torch.Tensor]] = []
    rows: list[int] = []
    for g in groups:
        start, p = len(ids), len(g.prompt)
        ids += g.prompt
        pos += range(p)
        if prompt_rows:
            rows += range(start, start + p)
        owner = [0] * p  # 0: prompt, i: continuation i
        for i, c in enumerate(g.continuations, start=1):
            if decode_rows:
                rows += range(len(ids), len(ids) + len(c) - 1)
            ids += c
            pos += range(p, p + len(c))
            owner += [i] * len(c)
        own = torch.tensor(owner)
        n = len(owner)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        visible = (own[None, :] == 0) | (own[None, :] == own[:, None])
        spans.append((start, len(ids), causal & visible))
    return Packed(torch.tensor(ids), torch.tensor(pos), spans, torch.tensor(rows))


def _attention(packed: Packed) -> Any:
    def attend(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for start, end, mask in packed.spans:
            qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[start:end] = o.squeeze(0).transpose(0, 1).reshape(end - start, -1)
        return out

    return attend


def chunks(groups: list[Group], chunk_tokens: int) -> Iterator[list[Group]]:
    part: list[Group] = []
    size = 0
    for g in groups:
        if part and size + g.num_tokens > chunk_tokens:
            yield part
            part, size = [], 0
        part.append(g)
        size += g.num_tokens
    if part:
        yield part


@torch.inference_mode()
def collect(
    model: LlamaForCausalLM,
    groups: list[Group],
    exit_layers: list[int],
    topk: int = 32,
    chunk_tokens: int = 4096,
    desc: str = "collect",
    rows: str = "decode",
    mid: bool = False,
    lens: bool = False,
) -> Collected:
    """Hidden states at the trained positions of ``groups`` (see the module docstring).

    ``rows``: "decode" (continuation positions), "prompt" (prompt positions) or "all".
    ``mid`` (``layer`` exit heads): for exit layer l keep instead h_mid, layer l + 1's state
    between its attention and MLP halves (the head's input), and cos(h_mid, h_l); ``lens`` then
    also keeps h_l in ``Collected.lens`` (without ``mid``, ``lens`` is ``hidden`` anyway).
    """
    if mid and max(exit_layers) >= model.config.num_layers:
        raise ValueError(f"mid states of exit l need a layer l + 1: got {max(exit_layers)}")
    max_len = max(g.num_tokens for g in groups)
    cos_t, sin_t = rope_tables(model.config, max_len)
    keep: dict[str, dict[int, list[torch.Tensor]]] = {
        k: {lay: [] for lay in exit_layers} for k in ("hidden", "cosine", "lens")
    }
    finals: list[torch.Tensor] = []
    tops: list[torch.Tensor] = []
    dtype = model.lm_head.weight.dtype
    bar = tqdm(desc=desc, unit="tok")
    for part in chunks(groups, chunk_tokens):
        packed = pack_groups(part, rows in ("prompt", "all"), rows in ("decode", "all"))
        rot = Rotary(cos_t[packed.positions].to(dtype), sin_t[packed.positions].to(dtype))
        h = run_layers(model, packed, rot, exit_layers, mid, keep, lens)
        final = model.final_norm(h[packed.rows])
        finals.append(final.float())
        tops.append(model.lm_head(final).float().topk(topk, dim=-1).indices)
        bar.update(len(packed.rows))
    bar.close()
    hidden, cosine = (
        {lay: torch.cat(v) for lay, v in keep[k].items()} for k in ("hidden", "cosine")
    )
    kept_lens = {lay: torch.cat(v) for lay, v in keep["lens"].items() if v}
    return Collected(
        hidden, cosine, torch.cat(finals), torch.cat(tops), kept_lens if mid else hidden
    )


def run_layers(
    model: LlamaForCausalLM,
    packed: Packed,
    rot: Rotary,
    exit_layers: list[int],
    mid: bool,
    keep: dict[str, dict[int, list[torch.Tensor]]],
    lens: bool,
) -> torch.Tensor:
    """One pass over a chunk, appending the kept states to ``keep``; returns the last hidden.

    Not itself under ``inference_mode``: ``tuning.delta_train`` trains through it."""
    attend = _attention(packed)
    # Where exit layer l is read: after layer l, or (``mid``) inside layer l + 1.
    at = {(lay + 1 if mid else lay): lay for lay in exit_layers}
    h = model.embed(packed.ids)
    for j, layer in enumerate(model.layers, start=1):
        exit_layer = at.get(j)
        if exit_layer is None:
            h = layer(h, rot, attend)
            continue
        before = h[packed.rows].float()
        if mid:
            h_mid = layer.attn_block(h, rot, attend)
            after = h_mid[packed.rows].float()
            h = layer.mlp_block(h_mid)
        else:
            h = layer(h, rot, attend)
            after = h[packed.rows].float()
        keep["hidden"][exit_layer].append(after)
        keep["cosine"][exit_layer].append(F.cosine_similarity(after, before, dim=-1))
        if mid and lens:
            keep["lens"][exit_layer].append(before)
    return h


def exit_states(
    model: LlamaForCausalLM,
    packed: Packed,
    rope: tuple[torch.Tensor, torch.Tensor],
    layers: list[int],
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One pass over ``packed`` (rope: cos, sin tables [max_len, head_dim]): the exit layers'
    states {l: [m, D]} and the final-normed state [m, D] at the packed rows. Gradients flow
    unless the caller turns them off (``tuning.delta_train`` trains through it)."""
    dtype = model.lm_head.weight.dtype
    cos, sin = rope
    rot = Rotary(cos[packed.positions].to(dtype), sin[packed.positions].to(dtype))
    keep: dict[str, dict[int, list[torch.Tensor]]] = {
        k: {lay: [] for lay in layers} for k in ("hidden", "cosine", "lens")
    }
    h = run_layers(model, packed, rot, layers, False, keep, False)
    return {lay: v[0] for lay, v in keep["hidden"].items()}, model.final_norm(h[packed.rows])


def collect_splits(
    model: LlamaForCausalLM,
    train_groups: list[Group],
    heldout_groups: list[Group],
    layers: list[int],
    topk: int,
    probe_fraction: float,
    mid: bool = False,
) -> tuple[Collected, Collected, Collected]:
    """Head-training, probe-training and held-out data (``mid``: for ``layer`` heads, see
    ``collect``; the held-out split then keeps h_l too, for the report's shared-head baseline).

    The last ``probe_fraction`` of the tuning groups are kept for the probes (the heads never
    see them). Heads also learn from prompt positions: free (the pass runs over them anyway) and
    measured to help; probes and the report see decode positions only.
    """
    n_probe = max(1, round(len(train_groups) * probe_fraction))
    run = partial(collect, model, exit_layers=layers, topk=topk, mid=mid)
    heads = run(train_groups[:-n_probe], desc="collect (heads)", rows="all")
    probe = run(train_groups[-n_probe:], desc="collect (probes)")
    heldout = run(heldout_groups, desc="collect (held-out)", lens=True)
    return heads, probe, heldout
