"""Greedy tokens from a float32 LM head at about a quarter of its bytes: an int8 screen, then the
float rows that can still hold the maximum.

Contract: ``ScreenedHead(head, weight)`` wraps a float32 LM head ``head`` on the engine's kernel
(a ``PackedLinear`` with ops) whose weight is ``weight`` [V, D].
- ``forward(x)`` is ``head(x)``: every logit, as before (logprobs, sampling, exit measures).
- ``top(x)`` [M, V] float32: in each row, logits bitwise equal to ``head(x)``'s at every id that
  can be that row's maximum (and at the other ids of the same 32-id tiles), -inf elsewhere. So
  ``top(x).argmax(-1) == head(x).argmax(-1)``, ties included (argmax takes the first index, and
  every id that ties with the maximum is kept). ``top(x, allowed)`` does the same for the
  maximum over each row's allowed ids (a constrained row: ``engine.grammar``).
``screened(head, weight)`` wraps a head where it can be screened, and
``head_logits(head, x, argmax_only)`` is what callers use: ``top`` where the head is screened
and only the argmax is read, the full head otherwise.

How: an int8 copy of the head (``kernels.quant``: groups of 32 inputs, activations rounded to
int16) gives approximate logits a_i, and a rigorous bound b_i >= |head(x)_i - a_i| comes from the
scales: per group g of 32 inputs of row i with scale s_ig, the weights' rounding adds at most
s_ig / 2 * ||x_g||_1 and the activations' at most 127 s_ig * 32 * amax(x_g) / 65534; float
summation in either kernel is covered by a margin of 254 K 2^-24 s_ig ||x_g||_1 (at most K
rounding steps of 2^-24 over sum |w x| <= 127 s_ig ||x_g||_1, twice), and the bound's own float
arithmetic by a factor 1 + 2^-8. Each s_ig is bounded by the row's largest, so b is one number
per row of x times one per id (4 bytes an id to read, not 4 per 32 weights). The maximum's id m
has a_m + b_m >= head(x)_m >= head(x)_j >= a_j - b_j for every j, so it is among the ids whose
a_i + b_i reach max_j (a_j - b_j). Those ids' tiles of 32 rows then run through the same float
kernel on the same rows of x (its arithmetic per output depends only on x's row count and that
output's weights: ``csrc/f32_ops.cpp``), so their logits are the full head's, bit for bit. On
SmolLM2-135M and Gemma-3-270M text the screen keeps 8 and 21 ids a row on average (at most 82
and 192 over 1,024 positions; the bound is ~300x the largest error seen), so a step reads the
int8 head (1 + 4/32 bytes a weight) and a few float tiles instead of 4 bytes a weight. The screen
pass (``csrc/screen_ops.cpp``) reduces its logits and bounds to a maximum per row and 32-id tile
inside the kernel, so no [M, V] temporary is written and the screen pays at any number of rows:
where a step is compute-bound (many rows), the int8 kernel's integer multiply-adds still cost
less than float FMAs over the whole head. When more than ``MAX_TILE_SHARE`` of the tiles would
be kept, the full head runs instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eeserve.kernels.packing import TILE, PackedLinear
from eeserve.kernels.quant import GROUP_SIZE, Int8Linear

# Beyond this share of kept tiles the float pass over them costs about what the full head does.
MAX_TILE_SHARE = 0.25
# Tiles of allowed ids probed first for a row whose maximum its grammar refuses (``top``).
PROBE_TILES = 2
# ``top`` keeps its output buffer for steps of up to this many rows (at most 64 MB for a 262k
# vocabulary); a larger step gets a fresh tensor and pays its page faults.
KEEP_ROWS = 64
# |q| <= 127 over a group of 32 inputs, each activation off by at most amax / 65534.
_ACTIVATION_TERM = 127 * GROUP_SIZE / 65534
_MARGIN = 1 + 2**-8


class ScreenedHead(nn.Module):
    def __init__(
        self, head: PackedLinear, weight: torch.Tensor, screen: Int8Linear | None = None
    ) -> None:
        super().__init__()
        assert head.ops is not None, "the screen needs the float head on the engine's kernel"
        self.head, self.ops = head, head.ops
        self.vocab_size, self.in_features = weight.shape
        # Reuse an int8 copy of the same weight when there is one (the int8 drafter's head).
        self.screen = screen if screen is not None else Int8Linear(weight.detach(), None, head.ops)
        assert self.screen.bias is None and self.screen.ops is not None
        # One scale per row for the bound (the largest of the row's): a bound [M, V] then costs
        # 4 bytes a row, not 4 per 32 weights, for a few more ids kept (3.5 -> 7.5 on average).
        self.row_scale = self.screen.row_scales()  # [V]
        self.num_tiles = head.packed.shape[0] // 2  # of 32 output rows (2 packed blocks each)
        # ``top``'s output [rows, V], kept across calls (as large as the most rows seen, up to
        # KEEP_ROWS): -inf but for the columns last written.
        self._out = torch.empty(0, self.vocab_size, device=weight.device)
        self._written: torch.Tensor | None = None  # those columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)  # type: ignore[no-any-return]

    def coeff(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> c [M], margin included: the bound is c[m] * row_scale[i] (module
        docstring)."""
        m, k = x.shape
        ax = x.abs()
        width = -(-k // GROUP_SIZE) * GROUP_SIZE
        chunk_max = F.pad(ax, (0, width - k)).view(m, -1, GROUP_SIZE).amax(-1)  # [M, chunks]
        coeff = ax.sum(-1) * (0.5 + 254 * k * 2**-24) + chunk_max.sum(-1) * _ACTIVATION_TERM
        return (coeff * _MARGIN).contiguous()

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> b [M, V] with |head(x) - screen(x)| <= b (module docstring)."""
        return torch.outer(self.coeff(x), self.row_scale)

    def top(
        self, x: torch.Tensor, allowed: list[torch.Tensor | None] | None = None
    ) -> torch.Tensor:
        """x [M, K] -> [M, V]: the full head's logits where a row's maximum can be, -inf
        elsewhere (module docstring). ``allowed``: per row None or [V] bool, the ids the row's
        token is chosen among; such a row's logits are exact wherever its maximum over those ids
        can be. The result is this head's own buffer, valid until its next
        ``top``: read it, or write -inf into it (a mask), nothing else; do not keep it. A fresh
        [M, V] tensor would cost its page faults on every step (~10 ms at 32 rows of a 262k
        vocabulary on the 2-core VM), more than the float tiles."""
        x = x.reshape(-1, self.in_features).float().contiguous()
        s = self.screen
        # Per row and 32-id tile: max(a + b) [M, T]; per row: max(a - b) [M], below which no
        # row's maximum lies. The [M, V] screen logits stay inside the kernel.
        hi, floor = self.ops.int8_screen(
            x, s.qweight, s.scale, self.vocab_size, self.coeff(x), self.row_scale
        )
        kept = (hi >= floor[:, None]).any(0)  # [T]
        if kept.sum() > MAX_TILE_SHARE * self.num_tiles:
            return self.head(x)  # type: ignore[no-any-return]
        out = self._exact(x, kept)
        refused = self._refused(out, allowed)
        if not refused:
            return out
        # A row whose maximum its grammar refuses: its best allowed id is among the tiles of
        # allowed ids with the highest screen bound (probed first: their exact logits give a
        # floor), or among those whose bound still reaches that floor.
        probe = min(PROBE_TILES, hi.shape[1])
        for r, _, holds in refused:
            kept[hi[r].masked_fill(~holds, float("-inf")).topk(probe).indices] = True
        if kept.sum() > MAX_TILE_SHARE * self.num_tiles:
            return self.head(x)  # type: ignore[no-any-return]
        out = self._exact(x, kept)
        more = kept.clone()
        for r, ok, holds in refused:
            best = out[r].masked_fill(~ok, float("-inf")).max()  # an allowed id's exact logit
            more |= holds & (hi[r] >= best)
        if torch.equal(more, kept):
            return out
        if more.sum() > MAX_TILE_SHARE * self.num_tiles:
            return self.head(x)  # type: ignore[no-any-return]
        return self._exact(x, more)

    def _exact(self, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """The buffer with the full head's logits of x [M, K] in the ``kept`` [T] tiles."""
        ids = kept.nonzero().flatten()  # [n] tile indices
        exact = self.ops.f32_tiles_at(x, self.head.packed, ids)  # [M, n * 32]
        cols = (ids[:, None] * TILE + torch.arange(TILE, device=x.device)).flatten()
        valid = cols < self.vocab_size  # the last tile may run past V
        cols = cols[valid]
        out = self._output(x.shape[0], cols)
        out[:, cols] = exact[:, valid]
        return out

    def _refused(
        self, out: torch.Tensor, allowed: list[torch.Tensor | None] | None
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """The rows whose maximum their allowed ids exclude, each with its allowed ids [V] and
        the tiles [T] bool that hold one. Where a row's maximum m is allowed it is also the
        allowed maximum, ties included (an allowed id before m with m's logit would be the
        row's first maximum)."""
        if allowed is None:
            return []
        top = out.argmax(-1).tolist()
        pad = -self.vocab_size % TILE
        return [
            (r, ok, F.pad(ok, (0, pad)).view(-1, TILE).any(-1))
            for r, ok in enumerate(allowed)
            if ok is not None and not bool(ok[top[r]])
        ]

    def _output(self, rows: int, cols: torch.Tensor) -> torch.Tensor:
        """[rows, V] of -inf, to be written at ``cols``: the kept buffer's first rows, or a fresh
        tensor above ``KEEP_ROWS`` rows."""
        if rows > KEEP_ROWS:
            return torch.full((rows, self.vocab_size), float("-inf"), device=self._out.device)
        if self._out.shape[0] < rows:
            self._out = torch.full((rows, self.vocab_size), float("-inf"), device=self._out.device)
        elif self._written is not None:
            self._out[:, self._written] = float("-inf")
        self._written = cols
        return self._out[:rows]


def screened(head: PackedLinear, weight: torch.Tensor, int8: nn.Module | None = None) -> nn.Module:
    """``head`` with a screen when it runs on the engine's kernel, else ``head`` itself. ``int8``:
    an int8 copy of ``weight`` that exists anyway (the int8 drafter's head), shared when it is
    one (an ``Int8Linear`` over every row)."""
    if head.ops is None:
        return head
    return ScreenedHead(head, weight, int8 if isinstance(int8, Int8Linear) else None)


def head_logits(
    head: nn.Module,
    x: torch.Tensor,
    argmax_only: bool,
    allowed: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """[M, D] -> [M, V] float32 logits: screened (``ScreenedHead.top``, whose result is the
    head's own buffer until its next call) when only their argmax (over a row's ``allowed`` ids,
    where given) is read and the head has a screen, every logit otherwise."""
    if argmax_only and isinstance(head, ScreenedHead):
        return head.top(x, allowed)
    return head(x).float()  # type: ignore[no-any-return]
