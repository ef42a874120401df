"""The messages between processes: finish reasons keep the client's JSON shape, and messages are
built with keywords only."""

import pickle

import pytest

from srt.managers.io_struct import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    BatchStrOutput,
    BatchTokenIDOutput,
    DecodeSettings,
    TokenizedGenerateReqInput,
)
from srt.managers.schedule_batch import Req
from srt.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "reason, json",
    [
        (FINISH_MATCHED_TOKEN(matched=2), {"type": "stop", "matched": 2}),
        (FINISH_MATCHED_STR(matched="\n\n"), {"type": "stop", "matched": "\n\n"}),
        (FINISH_LENGTH(length=16), {"type": "length", "length": 16}),
        (FINISH_ABORT(message="aborted"), {"type": "abort", "message": "aborted"}),
        (
            FINISH_ABORT(message="bad grammar", status_code=400),
            {"type": "abort", "message": "bad grammar", "status_code": 400},
        ),
    ],
)
def test_finish_reason_json(reason, json):
    assert reason.to_json() == json
    assert list(reason.to_json()) == list(json)  # key order too
    assert pickle.loads(pickle.dumps(reason)) == reason  # it crosses processes with send_pyobj


def test_messages_take_keywords_only():
    params = SamplingParams()
    with pytest.raises(TypeError):
        Req("rid", [1, 2], params)
    with pytest.raises(TypeError):
        TokenizedGenerateReqInput("rid", None, [1], params, False, -1, 0, False)
    with pytest.raises(TypeError):
        BatchStrOutput(["rid"], [None], [""], [[]], [1], [0], [0], [0])
    with pytest.raises(TypeError):
        BatchTokenIDOutput(["rid"])
    settings = DecodeSettings(
        skip_special_tokens=True, spaces_between_special_tokens=True, stop_strs=(), no_stop_trim=False
    )
    assert settings.stop_strs == () and settings._fields[0] == "skip_special_tokens"
