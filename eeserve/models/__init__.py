"""Models: plain ``nn.Module`` Llama-family decoders with HF weight names, their exit heads and
the sidecar format, the per-token cost model and the loader (resolve, fetch, convert, load).

Contract: knows nothing of the engine (no scheduling, no KV cache); may import only the
top-level data types (``eeserve.config``, ``eeserve.exit_params``).
"""
