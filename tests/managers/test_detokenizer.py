"""Incremental detokenization: UTF-8 safe, prefix-monotonic, stop strings trimmed and held back."""

import random
import re

import pytest

from srt.hf_transformers_utils import get_tokenizer
from srt.managers.detokenizer_manager import IncrementalDecoder, stop_holdback
from srt.managers.io_struct import FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN, FINISHED_MATCHED_REGEX


@pytest.fixture(scope="module")
def tok(default_model_path):
    return get_tokenizer(default_model_path)


def run(tok, ids, reason, chunk=1, **kw):
    dec = IncrementalDecoder(tok, **kw)
    pieces = []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        last = i + chunk >= len(ids)
        pieces.append(dec.step(part, reason if last else None))
    return pieces


def test_stop_holdback():
    assert stop_holdback("hello wor", ("world",)) == 3
    assert stop_holdback("hello", ("world",)) == 0
    assert stop_holdback("abc END tail", ("END",)) == len(" END tail") - 1
    assert stop_holdback("xx<|", ("<|im", "|>")) == 2


@pytest.mark.parametrize(
    "text", ["héllo wörld ✓", "日本語のテキスト", "emoji 🤖🚀 and more 🎉", "mixed ascii and ünïcödé 𝔘"]
)
def test_streaming_concat_equals_full_decode_with_multibyte(tok, text):
    ids = tok.encode(text)
    for chunk in (1, 2, 3):
        pieces = run(tok, ids, FINISH_LENGTH(length=len(ids)), chunk)
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)  # never a broken character


def test_random_byte_tokens_never_emit_broken_or_duplicate_text(tok):
    rng = random.Random(0)
    # byte-level tokens: many are partial (or invalid) UTF-8 sequences
    for _ in range(30):
        ids = [rng.randrange(17, 49152) for _ in range(rng.randrange(1, 40))]
        pieces = run(tok, ids, FINISH_LENGTH(length=len(ids)))
        final = tok.decode(ids)
        assert "".join(pieces) == final
        # every prefix sent so far is a prefix of the final text: nothing is sent twice or changed
        sent = ""
        for p in pieces:
            sent += p
            assert final.startswith(sent)


def test_stop_string_straddling_tokens_is_trimmed_and_held_back(tok):
    text = "The answer is forty-two. END of story"
    ids = tok.encode(text)
    # the scheduler stops once the stop string is in the decoded output
    cut = next(i for i in range(1, len(ids) + 1) if "two. E" in tok.decode(ids[:i]))
    pieces = run(tok, ids[:cut], FINISH_MATCHED_STR(matched="two. E"), stop_strs=("two. E",))
    assert "".join(pieces) == "The answer is forty-"
    # nothing of the stop string leaked before the final piece
    assert all("two" not in "".join(pieces[: k + 1]) for k in range(len(pieces)))


def test_stop_regex_streams_all_but_where_a_match_may_start(tok):
    """sampling_params.stop_regex: text streams as it comes, but for what a match could still start in
    (partial matching), and the final text ends before the match that stopped the request."""
    text = "Count with me: one, two, three, four, five, six, seven and then ANSWER: 42 done"
    ids = tok.encode(text)
    pattern = r"ANSWER: \d+"
    # the scheduler stops once the pattern matches the output's tail
    cut = next(i for i in range(1, len(ids) + 1) if re.search(pattern, tok.decode(ids[:i])))
    pieces = run(tok, ids[:cut], FINISHED_MATCHED_REGEX(matched=pattern), stop_regex=(pattern,))
    assert "".join(pieces) == text[: text.index("ANSWER")]
    # every token's text went out one step later at most (no 64-token hold-back), but none of the match
    sent, prefix = "", text[: text.index("ANSWER")]
    for k, p in enumerate(pieces[:-1]):
        sent += p
        assert "A" not in sent
        before = tok.decode(ids[:k])
        assert len(sent) >= min(len(before), len(prefix)) - 1 or "A" in before[len(sent) :], (k, sent)
    # a possible start is held back until it can no longer match ("AN" then "ANSWER: x" fails)
    near = tok.encode("ANSWER? no, ANSWER: 7")
    got = run(tok, near, FINISHED_MATCHED_REGEX(matched=pattern), stop_regex=(pattern,))
    assert "".join(got) == "ANSWER? no, " and got[-1] == ""
    # a pattern whose match depends on where the scheduler's tail starts keeps the whole tail held back
    anchored = run(tok, ids, FINISH_LENGTH(length=len(ids)), stop_regex=(r"^ANSWER",))
    assert all(p == "" for p in anchored[:-1]) and "".join(anchored) == text


def test_no_stop_trim_keeps_the_stop_string(tok):
    ids = tok.encode("alpha beta gamma")
    pieces = run(tok, ids, FINISH_MATCHED_STR(matched="beta"), stop_strs=("beta",), no_stop_trim=True)
    assert "".join(pieces) == "alpha beta gamma"


def test_matched_stop_token_is_excluded_from_text(tok):
    ids = tok.encode("hello world")
    stop = tok.encode(" there")[0]
    pieces = run(tok, ids + [stop], FINISH_MATCHED_TOKEN(matched=stop))
    assert "".join(pieces) == "hello world"
    kept = run(tok, ids + [stop], FINISH_MATCHED_TOKEN(matched=stop), no_stop_trim=True)
    assert "".join(kept) == tok.decode(ids + [stop])


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi") + [2] + tok.encode(" there")
    assert "".join(run(tok, ids, FINISH_LENGTH(length=3))) == "hi there"
    shown = "".join(run(tok, ids, FINISH_LENGTH(length=3), skip_special_tokens=False))
    assert "<|im_end|>" in shown
