"""Self-speculative decoding, the runner's half: what drafts in a step, and what is kept.

Contract: the model runner runs passes; the ``Speculator`` decides around them.
- ``exit_plans`` says which speculative rows may draft at the exits in this step (none when
  the int8 copy drafts, or when the step has too many rows for drafting to pay);
- ``int8_step`` says whether the int8 copy drafts every row of this step (then the runner runs
  the int8 pass instead of the float one), and ``int8_drafts`` turns that pass's logits into one
  draft per sequence;
- ``result`` turns a float pass's row into the sequence's ``SpecOutput``: a new draft (the row
  left at an exit), a verification (full-depth logits at the drafted positions and the next
  one: the accepted drafts plus one token of full depth's), or a plain decode (no drafts).
It keeps, per sequence, the distributions its pending drafts were sampled from (speculative
sampling needs them at verification). Greedy output equals full depth's; sampled output has
exactly full depth's distribution (``engine.speculative.accept_sampled``).
"""

from __future__ import annotations

import torch

from eeserve.engine.plan import ExitPlan
from eeserve.engine.runner_output import SeqStep
from eeserve.engine.sampler import Sampler, token_logprobs
from eeserve.engine.sequence import Sequence
from eeserve.engine.speculative import SpecOutput, accept_greedy, accept_sampled
from eeserve.sampling_params import SamplingParams

# No exit drafting in decode steps of more sequences than this. Every kept token still runs all
# L layers (a draft's deep layers run later, as a verification passenger), so speculation only
# pays where a step's cost hardly grows with its rows (weight reads dominate: small batches).
# On CPU a batch of 8 is already compute-bound: measured 0.70x full depth with drafting at
# batch 8 and 32 (docs/speculative.md); 4 is a cautious guess between measured points.
DRAFT_MAX_BATCH = 4
# The int8 drafter (``speculative_draft="int8"``) drafts at about half a step's cost at small
# batches; what limits it is the verification pass, whose rows (every sequence's drafts plus one)
# stop being nearly free once the pass is compute-bound. Sequences draft only in steps of at most
# INT8_DRAFT_MAX_BATCH rows, and again only while rows times (their drafts + 2) stay within
# VERIFY_MAX_ROWS: up to 4 drafts at batch 1-4, 3 at 5-6, 2 at 7-8. Measured on the default model
# on 2 CPU cores (docs/speculative.md): batch 8 gained 1.09x with 2 drafts, 1.05x with 1 or 4;
# batch 12 with 1 draft lost (0.89-0.93x).
INT8_DRAFT_MAX_BATCH = 8
VERIFY_MAX_ROWS = 24


class Speculator:
    def __init__(self, sampler: Sampler, num_layers: int, int8: bool) -> None:
        self.sampler = sampler
        self.num_layers = num_layers
        self.int8 = int8  # the int8 copy drafts (else the exits do)
        self._q: dict[int, list[torch.Tensor]] = {}  # seq_id -> [V] per pending sampled draft

    def release(self, seq_id: int) -> None:
        self._q.pop(seq_id, None)

    # -- what drafts -------------------------------------------------------------------------

    def exit_plans(self, seqs: list[Sequence], plans: list[ExitPlan | None], decoding: int) -> None:
        """Drops, in place, the exit plans of speculative rows that may not draft at exits in a
        step of ``decoding`` decode rows: their row runs to full depth and verifies."""
        if self.int8 or decoding > DRAFT_MAX_BATCH:
            for i, seq in enumerate(seqs):
                if seq.spec is not None:
                    plans[i] = None

    def int8_step(self, seqs: list[Sequence], counts: list[int], sampling: list[bool]) -> bool:
        """Does the int8 copy draft every row of this step? All rows or none: a step runs one
        pass. One row that needs the float model (a prompt chunk, a verification, a sequence that
        does not speculate) makes every sequence verify in that pass, which costs about what one
        draft would, and keeps the sequences' rounds in step."""
        if not self.int8:
            return False
        rows = len(seqs)
        return rows <= INT8_DRAFT_MAX_BATCH and all(
            sampling[i]
            and counts[i] == 1  # a decode row (not a prompt recomputed after preemption)
            and s.output_token_ids
            and s.spec is not None
            and rows * (s.num_draft_tokens + 2) <= VERIFY_MAX_ROWS
            and s.step_plan() is not None
            for i, s in enumerate(seqs)
        )

    def int8_drafts(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SeqStep]:
        """The int8 pass's logits [n, V] -> one draft per sequence; its position is then owed from
        layer 1 (its K/V so far are the int8 copy's). A draft's confidence is not recorded
        (verified tokens get the verification's)."""
        params = [s.sampling_params for s in seqs]
        tokens = self.sampler.sample(logits, params, [s.seq_id for s in seqs]).cpu().tolist()
        full = self.num_layers
        return [
            SeqStep(
                tokens[i],
                full,
                kv_debt={**seq.kv_debt, seq.num_computed_tokens: 0},
                spec=self._draft(seq.seq_id, seq.sampling_params, logits[i], tokens[i], full),
            )
            for i, seq in enumerate(seqs)
        ]

    # -- what is kept ------------------------------------------------------------------------

    def verifies(self, seq: Sequence, exit_layer: int) -> bool:
        """A speculative row with drafts that reached full depth verifies them: its tokens come
        from ``result``, not from the step's own draw."""
        return seq.spec is not None and exit_layer == self.num_layers and seq.num_draft_tokens > 0

    def result(
        self, seq: Sequence, step: SeqStep, logits: torch.Tensor, owed: torch.Tensor | None
    ) -> SpecOutput:
        """Sequence ``seq``'s draft (its row left at an exit) or verification (full depth).
        logits [V]: its row's; owed [k, V]: full depth at its k drafted positions."""
        params = seq.sampling_params
        if step.exit_layer < self.num_layers:
            assert step.token_id is not None, "a draft is sampled"
            return self._draft(seq.seq_id, params, logits, step.token_id, step.exit_layer)
        k = seq.num_draft_tokens
        if k == 0:  # nothing to verify: the step's own draw, as for any decode row
            assert step.token_id is not None, "a decode row is sampled"
            return SpecOutput(False, [step.token_id], logprobs=[step.logprobs])
        drafts = seq.output_token_ids[len(seq.output_token_ids) - k :]
        owed = owed if owed is not None else logits[None, :0]
        assert owed.shape[0] == k, f"{owed.shape[0]} verified positions for {k} drafts"
        return self._verify(seq.seq_id, params, drafts, torch.cat([owed, logits[None]]))

    def _draft(
        self, seq_id: int, params: SamplingParams, logits: torch.Tensor, token: int, layer: int
    ) -> SpecOutput:
        """A draft ``token`` sampled from logits [V] at ``layer``."""
        if not params.greedy:
            q = Sampler.probabilities(logits[None], [params])[0]
            self._q.setdefault(seq_id, []).append(q)
        return SpecOutput(True, [token], draft_layer=layer)

    def _verify(
        self, seq_id: int, params: SamplingParams, drafts: list[int], logits: torch.Tensor
    ) -> SpecOutput:
        """logits [k+1, V]: full depth at the k drafted positions and the next one."""
        if params.greedy:
            tokens, a = accept_greedy(drafts, logits)
        else:
            q = self._q.pop(seq_id, [])
            assert len(q) == len(drafts), "draft distributions out of step with the drafts"
            p = Sampler.probabilities(logits, [params] * logits.shape[0])
            gen = self.sampler.generator(seq_id, params.seed, logits.device)
            q_t = torch.stack(q) if q else p[:0]
            tokens, a = accept_sampled(drafts, q_t, p, gen)
        self._q.pop(seq_id, None)
        n = params.logprobs
        lps = [
            token_logprobs(logits[i], t, n) if n is not None else None for i, t in enumerate(tokens)
        ]
        return SpecOutput(False, tokens, num_accepted=a, logprobs=lps)
