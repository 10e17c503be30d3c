"""Builders for tiny random-weight HF-format model folders (no network, a second to build)."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eeserve import LLM, CompletionOutput, ExitParams, RequestOutput, SamplingParams
from eeserve.models.base_delta import delta_key
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import save_sidecar
from eeserve.models.loader import load_model
from eeserve.tuning.heads import init_heads

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Early exit lets confident tokens skip the remaining layers of a transformer.",
    "One two three four five six seven eight nine ten.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    folder: Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = True,
    arch: str = "llama",
    max_pos: int = 512,
    norm_noise: float = 0.0,
    weight_std: float = 0.08,
    **extra: Any,
) -> Path:
    """Write a random Llama (or Qwen2 with ``arch='qwen2'``) with its tokenizer into ``folder``.

    Every matrix and every bias (Qwen2's q/k/v biases) is random, so that a bias or a projection
    loaded into the wrong place changes the logits. ``norm_noise > 0`` also makes the RMSNorm
    weights ``1 + N(0, norm_noise)`` instead of ones, so that swapped norms show too. With the
    default ``weight_std`` greedy output mostly repeats one token; about 0.2 gives varied tokens.
    """
    tok = build_tokenizer()
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        rms_norm_eps=1e-5,
    )
    common.update(extra)
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model: Any = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Larger-than-default weights so that different layers disagree and logits are not flat.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, weight_std)
            elif name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif name.endswith("norm.weight") and norm_noise > 0:
                p.add_(torch.randn_like(p) * norm_noise)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"], cfg
    return folder


# -- Oracles and engine checks shared by the test modules ------------------------------------


def load_hf(folder: Path) -> Any:
    """The HF transformers reference model for ``folder``, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def add_base_delta(hf: Any, folder: Path, scale: float) -> None:
    """W += scale * B @ A on an HF model, by HF projection name, from the float16 delta stored in
    the sidecar ``folder`` (``base_delta.safetensors``): the oracle for a model trained to exit."""
    stored = load_file(str(folder / "base_delta.safetensors"))
    assert all(t.dtype == torch.float16 for t in stored.values())
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for group, projs in (
                (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
            ):
                for proj in projs:
                    a, b = (stored[f"{delta_key(i, proj)}.lora_{x}"].float() for x in "AB")
                    getattr(group, proj).weight += scale * b @ a


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate`` greedy continuation of one unpadded prompt, EOS ignored."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def hf_next_tokens(model: Any, prompt_ids: list[int], prefix: list[int]) -> list[int]:
    """HF's greedy choice after ``prompt_ids + prefix[:j]`` for every j up to ``len(prefix)``, in
    one forward pass: ``prefix`` continues the prompt greedily exactly where it equals them."""
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids + prefix]), logits_to_keep=len(prefix) + 1)
    return [int(t) for t in out.logits[0].argmax(-1)]


def hf_greedy_checked(
    model: Any, prompt_ids: list[int], draft: list[int], max_new_tokens: int
) -> list[int]:
    """HF's greedy continuation of one unpadded prompt, as ``hf_greedy``, found by checking a
    ``draft`` of it in one forward pass (``hf_next_tokens``). From where the draft first departs
    from HF, ``generate`` continues, so the answer does not depend on the draft; a right one (the
    engine's output) costs one pass over the weights, not one a token."""
    assert max_new_tokens >= 1
    best = hf_next_tokens(model, prompt_ids, draft[: max_new_tokens - 1])
    for j, token in enumerate(best):
        if j == len(draft) or draft[j] != token:
            head = [*draft[:j], token]
            rest = max_new_tokens - len(head)
            return head + (hf_greedy(model, prompt_ids + head, rest) if rest else [])
    return best


def hf_logprobs(model: Any, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: log-softmax of HF's logits at every position of one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def hf_next_logprobs(model: Any, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: HF's log-softmax predicting each generated token, row ``j`` after
    ``prompt_ids + token_ids[:j]`` (one forward pass; logits of the prompt's rows not made)."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + token_ids[:-1]])
        logits = model(ids, logits_to_keep=len(token_ids)).logits[0]
    return logits.float().log_softmax(-1)


def logprob_error(
    token_ids: list[int], logprobs: list[dict[int, float]] | None, ref: torch.Tensor
) -> float:
    """Largest |engine - reference| over every returned logprob of a completion.

    ``ref`` is ``hf_next_logprobs`` of the completion: row ``j`` predicts generated token ``j``.
    Also checks that each entry holds the reference's top tokens (nothing outside it is more
    likely than what it holds).
    """
    assert logprobs is not None, "no logprobs returned"
    assert len(logprobs) == len(token_ids) == len(ref), (len(logprobs), len(token_ids), len(ref))
    worst = 0.0
    for j, entry in enumerate(logprobs):
        row = ref[j]
        assert entry, f"empty logprobs entry at token {j}"
        for tid, value in entry.items():
            worst = max(worst, abs(float(row[tid]) - value))
        others = row.clone()
        others[list(entry)] = float("-inf")
        assert float(others.max()) <= min(entry.values()) + 1e-4, f"token {j}: not the top-n"
    return worst


_LIVE_LLMS: weakref.WeakSet[LLM] = weakref.WeakSet()

# The KV pool of a tiny model's engine: 16-32k positions (1-2 KiB each), dozens of sequences at
# their full 512. The engine's default, 512 MiB, is zero-filled at every build: most of a tiny
# engine's build time, and most of the suite's memory where fixtures hold engines.
TINY_KV_BYTES = 32 * 2**20


def make_llm(model: str | Path, **options: Any) -> LLM:
    """An ``LLM`` that the suite's autouse fixture checks for leaks after every test. A model
    folder (the suite's tiny models) gets a ``TINY_KV_BYTES`` pool unless ``options`` name one;
    a model name (``smollm2``) keeps the engine's default."""
    if Path(model).is_dir():
        options.setdefault("kv_cache_memory", TINY_KV_BYTES)
    llm = LLM(str(model), **options)
    _LIVE_LLMS.add(llm)
    return llm


def live_llms() -> list[LLM]:
    return list(_LIVE_LLMS)


def assert_engine_clean(llm: LLM) -> None:
    """No request left behind, no runner record of one, and every KV block back in the free pool
    with no reference."""
    engine = llm.engine
    bm = engine.block_manager
    assert not engine.has_unfinished_requests(), "requests left in the scheduler"
    assert engine.num_unfinished == 0, "requests left in the engine"
    engine.step()  # nothing to run: the runner hears of the requests that finished
    assert not engine.runner.requests, "the runner kept records of finished requests"
    held = [b.block_id for b in bm.blocks if b.ref_count != 0]
    assert not held, f"blocks still referenced: {held[:10]}"
    assert bm.num_free_blocks == bm.num_blocks, (bm.num_free_blocks, bm.num_blocks)


def kv_block_bytes(llm: LLM, block_size: int) -> int:
    """Bytes of one KV block of ``llm``'s model (for sizing a deliberately small pool)."""
    cfg = llm.engine.model_config
    itemsize = llm.engine.config.resolved_dtype().itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * block_size


def random_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """A reproducible prompt of ``length`` ordinary token ids (the 3 special ids excluded)."""
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, vocab_size, (length,), generator=gen)]


# -- recompute KV debt ---------------------------------------------------------------------------


def step_until_debt(engine: Any, prompt: list[int], exit_params: Any, tokens: int = 11) -> Any:
    """Run one greedy request until it has ``tokens`` outputs; returns its sequence (still
    running). Asserts that some step left KV debt behind, so the caller's check is not vacuous."""
    from eeserve import SamplingParams

    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params, exit_params=exit_params)
    seen_debt = False
    while True:
        engine.step()
        (seq,) = engine.scheduler.running
        seen_debt |= bool(seq.owed)
        if len(seq.output_token_ids) == tokens:
            break
    assert seen_debt, "no token exited: weak test"
    return seq


def hf_keys_values(model_dir: Path, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, HF's cached K and V [T, Hkv, hd] for a full-depth forward over ``ids``."""
    hf = load_hf(model_dir)
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    return [(lay.keys[0].transpose(0, 1), lay.values[0].transpose(0, 1)) for lay in cache.layers]


def assert_cache_matches_hf(engine: Any, seq: Any, model_dir: Path, owed_extra: int = 0) -> int:
    """Every cached position's K/V equals HF's full-depth ones: at every layer, or for a position
    owed (``recompute`` debt) up to its exit layer + ``owed_extra``. Returns how many (position,
    layer) pairs were compared."""
    ref = hf_keys_values(model_dir, seq.token_ids[: seq.num_computed_tokens])
    bs = engine.block_manager.block_size
    kv = engine.runner.kv
    owed = engine.runner.requests[seq.seq_id].owed
    assert set(owed) == set(seq.owed), "the engine's owed positions are the runner's"
    checked = 0
    for pos in range(seq.num_computed_tokens):
        slot = seq.block_table[pos // bs] * bs + pos % bs
        depth = owed[pos].layer + owed_extra if pos in owed else len(ref)
        for layer in range(depth):
            torch.testing.assert_close(kv.k[layer, slot], ref[layer][0][pos], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(kv.v[layer, slot], ref[layer][1][pos], atol=1e-5, rtol=1e-4)
            checked += 1
    return checked


# -- exit-head tuning ----------------------------------------------------------------------------


def base_weight_hashes(folder: Path) -> dict[str, str]:
    """sha256 of the model's own weight files (the exit sidecar excluded)."""
    import hashlib

    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.glob("*.safetensors"))
        if f.name != "exit_heads.safetensors"
    }


def tiny_tune_options(folder: Path, cache: Path, exit_layers: list[int], **kw: Any) -> Any:
    """``TuneOptions`` sized for a tiny model: a few hundred tokens and steps, one thread."""
    from eeserve.tuning.options import TuneOptions

    base: dict[str, Any] = dict(
        model=str(folder),
        exit_layers=exit_layers,
        out=folder,
        tokens=600,
        heldout_tokens=300,
        steps=60,
        batch_size=64,
        lr=3e-3,
        max_tokens=24,
        threads=1,
        cache_dir=cache,
    )
    base.update(kw)
    return TuneOptions(**base)


def run_together(
    llm: LLM, prompts: list[Any], params: SamplingParams, exits: list[ExitParams | None]
) -> list[CompletionOutput]:
    """Every request added before the first step (so they share batches), each with its own
    exit parameters; the final completions in request order."""
    engine = llm.engine
    ids = [engine.add_request(p, params, exit_params=e) for p, e in zip(prompts, exits)]
    done: dict[str, CompletionOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[i] for i in ids]


def assert_same_completion(a: RequestOutput, b: RequestOutput, tol: float = 1e-4) -> None:
    """Same tokens, text and finish reason; logprobs (if any) over the same ids within ``tol``."""
    ca, cb = a.outputs[0], b.outputs[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert ca.token_ids == cb.token_ids
    assert ca.text == cb.text
    assert ca.finish_reason == cb.finish_reason
    if ca.logprobs is None or cb.logprobs is None:
        assert ca.logprobs is None and cb.logprobs is None
        return
    assert len(ca.logprobs) == len(cb.logprobs) == len(ca.token_ids)
    for j, (la, lb) in enumerate(zip(ca.logprobs, cb.logprobs)):
        assert la.keys() == lb.keys(), f"token {j}: different top-n"
        worst = max(abs(la[t] - lb[t]) for t in la)
        assert worst < tol, f"token {j}: logprobs differ by {worst}"


def with_random_tuned_heads(
    src: Path, dst: Path, layers: list[int], seed: int, shortlist: list[int] | None = None
) -> Path:
    """A copy of the model folder ``src`` at ``dst`` with random tuned exit heads (linear
    adapters, classifier probes) at ``layers``, and the vocabulary ``shortlist`` if given."""
    shutil.copytree(src, dst)
    model, mcfg = load_model(dst, torch.float32, torch.device("cpu"))
    cfg = ExitConfig(mcfg.num_layers, layers, head="tuned", adapter="linear", classifier=True)
    if shortlist is not None:
        cfg.shortlist, cfg.shortlist_size = shortlist, len(shortlist)
    heads = init_heads(cfg, model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    save_sidecar(dst, cfg, heads)
    return dst


def build_agreeing_model(folder: Path, num_layers: int = 4) -> Path:
    """A tiny Llama whose last layer barely changes the hidden state: the logit lens at the layer
    below mostly agrees with full depth, so drafts are both accepted and rejected."""
    build_tiny_model(folder, weight_std=0.2, norm_noise=0.1, seed=3, num_layers=num_layers)
    path = folder / "model.safetensors"
    state = load_file(str(path))
    for name in list(state):
        if name.startswith(f"model.layers.{num_layers - 1}.") and name.endswith(
            ("o_proj.weight", "down_proj.weight")
        ):
            state[name] = state[name] * 0.15
    save_file(state, str(path), metadata={"format": "pt"})
    return folder
