"""DeepSeek-V3's own multi-token-prediction layer as the EAGLE head (`--speculative-algorithm EAGLE`
without a draft path) through live servers, on a tiny DeepSeek-V3 (MLA attention, MoE) whose
checkpoint carries layer n as its checkpoints do (`add_mtp_layer`).

- A random MTP layer: greedy outputs token-identical to the plain server (drafts mostly fail).
- A "bigram" model (attention and MLP outputs zeroed, so each next token is a function of the
  current one) whose MTP layer passes the token's embedding through: it predicts exactly what the
  model does, so chains of drafts are accepted near their maximum; also with --tp-size 2 (the MTP
  layer whole on rank 0).
- A DeepSeek-V3 without MTP layers is a start-up error naming the flag.
The KV pools (target and head) are back at their baseline after every scenario."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import ServerStartError, accepted_drafts, add_mtp_layer, at_baseline, build_tiny_model, check_spec_meta

PROMPTS = [
    [1] + [100 + (i * 7) % 900 for i in range(60)],
    [1, 5, 9, 200, 300],
    [1] + [2000 + i for i in range(30)],
]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
ALWAYS = {"RADIXSERVE_SPEC_ALWAYS_DRAFT": "1"}  # exactness needs drafts, whether or not they pay here
BASE = ("--max-total-tokens", "4096")


def tiny_v3(path: str, default_model_path: str, mtp: bool, bigram: bool = False) -> str:
    build_tiny_model(path, "DeepseekV3ForCausalLM", vocab_size=49152, eos_token_id=2)
    if mtp:
        add_mtp_layer(path, bigram=bigram)
    for name in os.listdir(default_model_path):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(default_model_path, name), path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_path):
    root = tmp_path_factory.mktemp("mtp")
    return {
        kind: tiny_v3(str(root / kind), default_model_path, mtp=kind != "plain", bigram=kind == "bigram")
        for kind in ("random", "bigram", "plain")
    }


def outputs(server, prompts=PROMPTS, params=GREEDY) -> list[dict]:
    return server.generate(input_ids=prompts, sampling_params=params)


@pytest.mark.parametrize(
    "kind,tp",
    [
        pytest.param("random", 1, marks=pytest.mark.full),
        ("bigram", 1),
        pytest.param("bigram", 2, marks=pytest.mark.full),
    ],
)
def test_mtp_drafts_keep_greedy_outputs_exact(kind, tp, shared_server, models):
    plain = shared_server("--model-path", models[kind], *BASE)
    want = [o["output_ids"] for o in outputs(plain)]
    # bigram: chains of 3 (each should hold); random: the automatic tree (top-4 per level, 8 nodes);
    # --tp-size 2: the MTP layer runs whole on rank 0
    tree = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")
    flags = ["--speculative-algorithm", "EAGLE", *(tree if kind == "bigram" else ()), "--tp-size", str(tp)]
    spec = shared_server("--model-path", models[kind], *BASE, *flags, env=ALWAYS)
    for _ in range(2):  # the second round hits the radix cache
        outs = outputs(spec)
        assert [o["output_ids"] for o in outs] == want
        for o in outs:
            check_spec_meta(o)
            if kind == "bigram":
                assert o["meta_info"]["spec_accept_length"] > 3.5  # of at most 4 (3 drafts and the target's token)
    if kind == "bigram":
        assert accepted_drafts(outs) > 0
    assert spec.state()["speculative"]["draft_forwards"] > 0
    at_baseline(spec)


def test_a_deepseek_without_mtp_layers_is_a_startup_error(server_factory, models):
    with pytest.raises(ServerStartError) as e:
        server_factory("--model-path", models["plain"], *BASE, "--speculative-algorithm", "EAGLE")
    assert "no multi-token-prediction layer" in e.value.log and "--speculative-algorithm EAGLE" in e.value.log
