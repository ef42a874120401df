import math

import pytest

from srt.sampling.sampling_params import InvalidSamplingParams, SamplingParams


def test_defaults_follow_sglang():
    p = SamplingParams.from_dict({})
    assert p.max_new_tokens == 128 and p.temperature == 1.0 and p.top_k == -1 and p.n == 1
    p.verify(100)


def test_unknown_keys_are_ignored_and_stop_normalized():
    p = SamplingParams.from_dict({"temperature": 0, "router_hint": 3, "stop": "END"})
    p.verify(100)
    assert p.is_greedy and p.stop_strs == ["END"]


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("temperature", -1, "temperature"),
        ("temperature", math.nan, "temperature"),
        ("temperature", math.inf, "temperature"),
        ("top_p", 0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", 0, "-1 (disabled)"),
        ("min_p", 2, "[0, 1]"),
        ("max_new_tokens", -1, ">= 0"),
        ("max_new_tokens", 1.5, "integer"),
        ("frequency_penalty", 3, "[-2, 2]"),
        ("repetition_penalty", 0, "(0, 2]"),
        ("n", 0, "in [1, 128]"),
        ("stop", [""], "non-empty"),
        ("stop", 5, "non-empty"),
        ("stop_token_ids", [100], "[0, 100)"),
        ("logit_bias", {"abc": 1}, "token ids"),
        ("logit_bias", {"5": 1000}, "[-100, 100]"),
        ("ignore_eos", "yes", "boolean"),
        ("sampling_seed", -3, "sampling_seed"),
        ("stop_regex", "(", "not a regular expression"),
        ("stop_regex", ["ok", ""], "non-empty regular expression"),
        ("stop_regex", ["x"] * 65, "at most 64"),
    ],
)
def test_invalid_values_name_field_value_and_limit(field, value, needle):
    p = SamplingParams.from_dict({field: value})
    with pytest.raises(InvalidSamplingParams) as e:
        p.verify(100)
    msg = str(e.value)
    assert field.split("[")[0] in msg and needle in msg


def test_stop_regex_normalized():
    p = SamplingParams.from_dict({"stop_regex": r"\d+\."})
    p.verify(100)
    assert p.stop_regex_strs == [r"\d+\."] and p.stop_strs == []


def test_min_new_tokens_cannot_exceed_max():
    with pytest.raises(InvalidSamplingParams, match="max_new_tokens"):
        SamplingParams(min_new_tokens=5, max_new_tokens=3).verify(100)


def test_non_dict_rejected():
    with pytest.raises(InvalidSamplingParams, match="object"):
        SamplingParams.from_dict([1, 2])
