"""The engine core: request state, scheduling, the paged KV cache, the model runner, its exit loop.

Rooms, and what flows between them (docs/design.md, "One decode step"):
- ``llm_engine.LLMEngine``: the entry point (add requests, ``step()``, outputs); applies each
  step's results to the ``sequence.Sequence`` records and detokenizes (``detokenizer``).
- ``scheduler`` (continuous batching, token budget, preemption) over ``block_manager`` (pure
  Python paged KV blocks, prefix caching): hands the runner the sequences of one pass.
- ``model_runner`` (owns every tensor): keeps one ``request_state.RequestState`` per request, runs
  the pass and returns a ``runner_output.RunnerOutput``, one ``SeqStep`` per sequence; its weights
  are laid out by ``weights``. ``kernel_route`` decides which kernel runs a pass and whether the
  exit checks run inside it. ``layer_stack`` runs layers without exits; ``exit_loop`` runs them
  with exits, keeping the per-row state of the pass in ``exit_state``; ``exit_checks`` computes
  a check's confidence (exit heads, shortlist, probes); ``plan``, ``measures`` and ``policy`` say
  which rows leave; ``speculator`` decides what drafts and what is kept
  (``speculative``: the acceptance rules; ``draft_model``: the int8 copy); ``attention`` is the
  KV pool and paged attention; ``sampler`` draws tokens.
May import ``kernels``, ``models`` and the top-level data types (``config``, ``sampling_params``,
``exit_params``, ``outputs``); never tuning, bench, server or CLI.
"""
