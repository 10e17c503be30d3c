"""The engine core: request state, scheduling, the paged KV cache, the model runner, its exit loop.

Contract: ``llm_engine.LLMEngine`` is the entry point (add requests, ``step()``, outputs); below it
``scheduler`` (continuous batching, preemption), ``block_manager`` (pure-Python paged KV blocks,
prefix caching), ``model_runner`` (owns every tensor), ``exit_loop`` (the layer loop with exit
checks and KV-debt payment), ``exits`` (plans, measures, policies), ``speculative`` (drafts and
their verification: acceptance, adaptive draft limit), ``attention`` (the KV pool and paged
attention) and ``sampler``. May import ``kernels``, ``models`` and the top-level data types
(``config``, ``sampling_params``, ``exit_params``, ``outputs``); never tuning, bench, server or CLI.
"""
