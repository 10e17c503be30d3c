"""Incremental detokenization gives the text of decoding the whole list, a few tokens at a time."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eeserve.engine.detokenizer import Detokenizer
from tests.tiny_model import build_tokenizer

TEXT = ["héllo wörld, naïve café — 日本語のテキスト 🙂 and plain words again"] * 8


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """Pieces with a leading-space marker that the decoder strips at the start of a text: the
    kind of tokenizer whose pieces decode differently alone than after another piece."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


class _Counting:
    """Records how many ids each decode call got."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok, self.lengths = tok, []  # type: ignore[var-annotated]

    def decode(self, ids: list[int], **kw: object) -> str:
        self.lengths.append(len(ids))
        return str(self.tok.decode(ids, **kw))


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_incremental_text_is_the_whole_decode(kind: str) -> None:
    tok = build_tokenizer() if kind == "byte_level" else _sentencepiece_like()
    rng = random.Random(0)
    encoded = tok(" ".join(TEXT)).input_ids
    # Real text, then random ids: special tokens, and multi-byte characters split or never
    # completed.
    for ids in (encoded, [rng.randrange(tok.vocab_size) for _ in range(300)]):
        det = Detokenizer(tok)
        for n in range(1, len(ids) + 1):
            det.update(ids[:n])
            whole = tok.decode(ids[:n], skip_special_tokens=True)
            assert whole.startswith(det.text)
            # Only a held-back incomplete character (and what shares its window) is missing.
            assert det.text == whole or whole.endswith("\ufffd")
        det.finish(ids)
        assert det.text == tok.decode(ids, skip_special_tokens=True)


def test_each_step_decodes_a_few_tokens_not_the_whole_list() -> None:
    tok = build_tokenizer()
    ids = tok(" ".join(TEXT * 4)).input_ids
    counting = _Counting(tok)
    det = Detokenizer(counting)  # type: ignore[arg-type]
    for n in range(1, len(ids) + 1):
        det.update(ids[:n])
    assert len(ids) > 200 and max(counting.lengths) <= 8
    assert det.text == tok.decode(ids, skip_special_tokens=True)


def test_finish_keeps_an_incomplete_last_character() -> None:
    tok = build_tokenizer()
    smile = tok.encode("🙂", add_special_tokens=False)
    assert len(smile) > 1  # the byte-level tokenizer splits it
    ids = tok.encode("ok ", add_special_tokens=False) + smile[:-1]
    det = Detokenizer(tok)
    for n in range(1, len(ids) + 1):
        det.update(ids[:n])
    assert det.text == "ok "  # the split character waits for its last byte
    det.finish(ids)
    assert det.text.endswith("\ufffd")
    assert det.text == tok.decode(ids, skip_special_tokens=True)
