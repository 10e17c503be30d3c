"""A speculative draft's LM head over part of the vocabulary.

Contract: ``SubsetHead(linear, ids, vocab_size, device)`` wraps a projection onto the rows
``ids`` of the LM head (``linear``: x [N, D] -> [N, len(ids)]) and returns logits over the whole
vocabulary [N, V] in float32, ``-inf`` outside ``ids``: a draft is then the argmax (or a
sample) among ``ids``, and a token outside them is never drafted, only produced by the
verification. Which ids a model drafts over is its exit config's ``draft_ids``.
"""

from __future__ import annotations

import torch


class SubsetHead(torch.nn.Module):
    def __init__(
        self, linear: torch.nn.Module, ids: list[int], vocab_size: int, device: torch.device
    ) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        index = torch.tensor(ids, dtype=torch.long, device=device)
        # Ids 0 .. n-1 (a BPE model's draft vocabulary) are a slice: no scatter needed.
        self.prefix = len(ids) if ids == list(range(len(ids))) else None
        self.register_buffer("ids", index, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.linear(x).float()  # [N, len(ids)]
        logits = part.new_full((x.shape[0], self.vocab_size), float("-inf"))
        if self.prefix is not None:
            logits[:, : self.prefix] = part
        else:
            logits[:, self.ids] = part
        return logits
