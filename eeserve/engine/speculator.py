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
It keeps nothing of its own: a request's drafts (exit layers, the distributions sampled ones were
drawn from) and adaptive limit live in the runner's record of it (``engine.request_state``),
which the speculator reads and updates. Greedy output equals full depth's; sampled output has
exactly full depth's distribution (``engine.speculative.accept_sampled``).
"""

from __future__ import annotations

import torch

from eeserve.engine.grammar import TokenMatcher, constrain, draft_masks
from eeserve.engine.plan import ExitPlan
from eeserve.engine.request_state import Draft, OwedPosition, RequestState
from eeserve.engine.runner_output import SeqStep
from eeserve.engine.sampler import Sampler, token_logprobs
from eeserve.engine.sequence import Sequence
from eeserve.engine.speculative import SpecOutput, accept_greedy, accept_sampled
from eeserve.exit_params import DraftSource
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
    def __init__(self, *, sampler: Sampler, num_layers: int, draft: DraftSource) -> None:
        self.sampler = sampler
        self.num_layers = num_layers
        self.draft = draft

    # -- what drafts -------------------------------------------------------------------------

    @staticmethod
    def step_plan(seq: Sequence, state: RequestState) -> ExitPlan | None:
        """The exit plan of ``seq``'s next pass: none for the prefill's first token, and none for
        a speculative sequence that may not draft now (that pass verifies)."""
        if not seq.output_token_ids or seq.exit_plan is None:
            return None
        spec = state.spec
        if spec is not None:
            pending = len(state.drafts)
            room = seq.num_verified_output + pending + 1 < seq.sampling_params.max_tokens
            if not spec.may_draft(pending, room):
                return None
            # A grammar that forces the next token: verify now, and the forced run follows the
            # verified tokens without a pass (drafting it would cost a pass a token).
            if pending and state.matcher is not None and state.matcher.single() is not None:
                return None
        return seq.exit_plan

    def exit_plans(
        self, states: list[RequestState], plans: list[ExitPlan | None], decoding: int
    ) -> None:
        """Drops, in place, the exit plans of speculative rows that may not draft at exits in a
        step of ``decoding`` decode rows: their row runs to full depth and verifies."""
        if self.draft is DraftSource.INT8 or decoding > DRAFT_MAX_BATCH:
            for i, state in enumerate(states):
                if state.spec is not None:
                    plans[i] = None

    def int8_step(
        self,
        seqs: list[Sequence],
        states: list[RequestState],
        counts: list[int],
        sampling: list[bool],
    ) -> bool:
        """Does the int8 copy draft every row of this step? All rows or none: a step runs one
        pass. One row that needs the float model (a prompt chunk, a verification, a sequence that
        does not speculate) makes every sequence verify in that pass, which costs about what one
        draft would, and keeps the sequences' rounds in step."""
        if self.draft is not DraftSource.INT8:
            return False
        rows = len(seqs)
        return rows <= INT8_DRAFT_MAX_BATCH and all(
            sampling[i]
            and counts[i] == 1  # a decode row (not a prompt recomputed after preemption)
            and seq.output_token_ids
            and state.spec is not None
            and rows * (len(state.drafts) + 2) <= VERIFY_MAX_ROWS
            and self.step_plan(seq, state) is not None
            for i, (seq, state) in enumerate(zip(seqs, states))
        )

    def int8_drafts(
        self,
        seqs: list[Sequence],
        states: list[RequestState],
        logits: torch.Tensor,
        h0: torch.Tensor,
    ) -> list[SeqStep]:
        """The int8 pass's logits [n, V] -> one draft per sequence. Its position is then owed
        from layer 1 with its embedding h0 [n, D] as input (its K/V so far are the int8 copy's).
        A draft's confidence is not recorded (verified tokens get the verification's)."""
        params = [s.sampling_params for s in seqs]
        covered = [st.matcher is None or constrain(st.matcher, logits[i]) for i, st in
                   enumerate(states)]  # fmt: skip
        tokens = self.sampler.sample(logits, params, [s.seq_id for s in seqs]).cpu().tolist()
        full = self.num_layers
        steps = []
        for i, (seq, state) in enumerate(zip(seqs, states)):
            if state.matcher is not None:
                if not covered[i]:  # the int8 vocabulary holds none of the allowed tokens
                    tokens[i] = state.matcher.first_allowed()
                    logits[i, tokens[i]] = 0.0  # the draft's distribution: that token alone
                state.matcher.accept([tokens[i]])
            state.owed[seq.num_computed_tokens] = OwedPosition(layer=0, hidden=h0[i])
            spec = self._draft(state, seq.sampling_params, logits[i], tokens[i], full)
            steps.append(
                SeqStep(token_id=tokens[i], exit_layer=full, owed=state.owed_positions, spec=spec)
            )
        return steps

    # -- what is kept ------------------------------------------------------------------------

    def verifies(self, state: RequestState, exit_layer: int) -> bool:
        """A speculative row with drafts that reached full depth verifies them: its tokens come
        from ``result``, not from the step's own draw."""
        return state.spec is not None and exit_layer == self.num_layers and bool(state.drafts)

    def result(
        self,
        seq: Sequence,
        state: RequestState,
        step: SeqStep,
        logits: torch.Tensor,
        owed: torch.Tensor | None,
    ) -> SpecOutput:
        """Sequence ``seq``'s draft (its row left at an exit) or verification (full depth).
        logits [V]: its row's; owed [k, V]: full depth at its k drafted positions."""
        params = seq.sampling_params
        if step.exit_layer < self.num_layers:
            assert step.token_id is not None, "a draft is sampled"
            return self._draft(state, params, logits, step.token_id, step.exit_layer)
        assert state.spec is not None
        k = len(state.drafts)
        if k == 0:  # nothing to verify: the step's own draw, as for any decode row
            assert step.token_id is not None, "a decode row is sampled"
            state.spec.after_verification(0, 0, 1)
            return SpecOutput(drafted=False, token_ids=[step.token_id], logprobs=[step.logprobs])
        drafts = seq.output_token_ids[len(seq.output_token_ids) - k :]
        owed = owed if owed is not None else logits[None, :0]
        assert owed.shape[0] == k, f"{owed.shape[0]} verified positions for {k} drafts"
        out = self._verify(seq.seq_id, params, drafts, state, torch.cat([owed, logits[None]]))
        state.spec.after_verification(k, out.num_accepted, len(out.token_ids))
        return out

    def _draft(
        self,
        state: RequestState,
        params: SamplingParams,
        logits: torch.Tensor,
        token: int,
        layer: int,
    ) -> SpecOutput:
        """A draft ``token`` sampled from logits [V] at ``layer``, added to ``state``."""
        probs = None if params.greedy else Sampler.probabilities(logits[None], [params])[0]
        state.drafts.append(Draft(layer=layer, probs=probs))
        return SpecOutput(drafted=True, token_ids=[token])

    def _verify(
        self,
        seq_id: int,
        params: SamplingParams,
        drafts: list[int],
        state: RequestState,
        logits: torch.Tensor,
    ) -> SpecOutput:
        """logits [k+1, V]: full depth at the k drafted positions and the next one. The drafts
        leave ``state``: the kept tokens are verified, the rest are gone."""
        pending, state.drafts = state.drafts, []
        if state.matcher is not None:
            mask_positions(state.matcher, drafts, logits)
        if params.greedy:
            tokens, a = accept_greedy(drafts, logits)
        else:
            q = [d.probs for d in pending if d.probs is not None]
            assert len(q) == len(drafts), "draft distributions out of step with the drafts"
            p = Sampler.probabilities(logits, [params] * logits.shape[0])
            gen = self.sampler.generator(seq_id, params.seed, logits.device)
            q_t = torch.stack(q) if q else p[:0]
            tokens, a = accept_sampled(drafts, q_t, p, gen)
        n = params.logprobs
        lps = [
            token_logprobs(logits[i], t, n) if n is not None else None for i, t in enumerate(tokens)
        ]
        layers = [d.layer for d in pending]
        if state.matcher is not None:
            state.matcher.accept(tokens)
        return SpecOutput(
            drafted=False, token_ids=tokens, num_accepted=a, draft_layers=layers, logprobs=lps
        )


def mask_positions(matcher: TokenMatcher, drafts: list[int], logits: torch.Tensor) -> None:
    """logits [k+1, V] at k drafted positions and the next, each masked in place to what the
    grammar allows there (after the drafts before it). ``matcher`` has accepted the k drafts on
    entry and is back before them on return (the caller accepts the verified tokens)."""
    for row, ok in zip(logits, draft_masks(matcher, drafts)):
        row.masked_fill_(~ok, float("-inf"))
    matcher.rollback(len(drafts))
