"""Per-token cost of the pieces of a decode step, from the model's shape alone.

Contract: ``CostModel.of(config)`` counts weights (one multiply-add per weight and row, one read
per step) of a decoder layer, the LM head, a K/V fill and an adapter; ``ideal_ratio`` is the best
speed-up an exit at a layer can give; ``shortlist_rows`` how much vocabulary a cheap check reads.
Used by head tuning's report, the engine and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

from eeserve.models.config import ModelConfig

# What an exit check may cost, as a fraction of one decoder layer: a check that costs a whole
# layer (a full-vocabulary softmax on SmolLM2 costs eight) saves nothing by exiting.
CHECK_BUDGET = 0.15


@dataclass(frozen=True)
class CostModel:
    """Per-token cost of the pieces of a decode step, in FLOPs and in weight bytes read."""

    layer: float
    head: float
    kv_fill: float
    adapter: float
    attn: float = 0.0  # the attention half of a layer: what a ``layer`` exit head's check runs

    @classmethod
    def of(cls, cfg: ModelConfig, adapter_params: int = 0) -> CostModel:
        d, hd = cfg.hidden_size, cfg.head_dim
        qkv = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        attn = qkv + cfg.num_heads * hd * d
        return cls(
            layer=float(attn + 3 * d * cfg.intermediate_size),
            head=float(cfg.vocab_size * d),
            kv_fill=float(2 * cfg.num_kv_heads * hd * d),
            adapter=float(adapter_params),
            attn=float(attn),
        )

    def shortlist_rows(self, hidden_size: int, budget: float = CHECK_BUDGET) -> int:
        """Rows of the vocabulary a logit check can project within ``budget`` of a decoder layer
        (the exit head's adapter included): a multiple of 16, at least 16."""
        rows = (budget * self.layer - self.adapter) / hidden_size
        return max(16, int(rows) // 16 * 16)

    def attention_context(self, cfg: ModelConfig, efficiency: float) -> float:
        """The context length at which one position's attention (a score and a value
        multiply-add per head dimension, head and earlier position) takes as long as its
        projections (``layer``), when attention runs at ``efficiency`` times the projections'
        FLOP rate."""
        return efficiency * self.layer / (2 * cfg.num_heads * cfg.head_dim)

    def ideal_ratio(self, num_layers: int, exit_layer: int, layer_head: bool = False) -> float:
        """Cost(full depth) / cost(exit at ``exit_layer`` with ``fill``): one head projection
        either way (the exit's logits give the token), fill K/V for the layers above. The same
        ratio holds for FLOPs (2 per weight and row) and for weight bytes (one read per step).
        ``layer_head``: the exit is decided inside layer l + 1, whose attention the token also
        runs (``adapter`` is then the head's MLP) and whose K/V need no fill."""
        full = num_layers * self.layer + self.head
        early = exit_layer * self.layer + self.head + self.adapter
        if layer_head:
            return full / (early + self.attn + (num_layers - exit_layer - 1) * self.kv_fill)
        early += (num_layers - exit_layer) * self.kv_fill
        return full / early
