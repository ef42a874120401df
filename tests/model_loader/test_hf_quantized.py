"""Float checkpoints quantized at load: `--quantization w8a8_int8`, `int4_weight_only` (also spelled
`--torchao-config int4wo-N`) and `fp8`, against the same weights in float32."""

from __future__ import annotations

import math

import pytest
import requests
import torch

# A fixed English text for the perplexity check (written for this test).
TEXT = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, and the baker opened "
    "the shutters of a shop that smelled of bread and smoke. Children ran along the quay, counting the "
    "gulls that followed the last boat home. By noon the market was full: apples from the hills, cheese "
    "wrapped in cloth, and baskets of silver fish laid out on ice. An old woman sold honey from a cart, "
    "and everyone who passed stopped to taste it. In the evening the bells rang, the lamps were lit one "
    "by one, and the town grew quiet again, waiting for the tide."
)


def prefill_logits(path: str, prompts: list[list[int]], **args) -> tuple[torch.Tensor, dict]:
    from conftest import make_runner

    from srt.model_executor.static_batch import StaticBatchGenerator

    runner = make_runner(path, **args)
    return StaticBatchGenerator(runner).prefill_logits(prompts), runner.weight_report


PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 300, 64, 2, 77], [11, 12, 13], list(range(20, 120))]

# Bounds on max |logit - float32 logit| relative to max |float32 logit|, for a tiny random model
# (weights ~ N(0, 0.02), so no outlier channels). Measured: int8 ~5%, fp8 ~18%, int4 group 32
# ~23%. Per-weight errors: int8 per-channel rounding is <= max|w| / 254 (~0.4% of the row's
# range), fp8 e4m3 keeps 3 mantissa bits (~6% relative), 4 bits over a group's range ~3%; the logit
# error adds these up over 2 layers. A broken layout, scale or sign gives errors of the order of
# the logits themselves (ratio >= 1), which each bound rejects.
BOUNDS = {"w8a8_int8": 0.1, "fp8": 0.3, "int4_weight_only": 0.6}


@pytest.mark.parametrize(
    "method, extra",
    [("w8a8_int8", {}), ("fp8", {}), ("int4_weight_only", {"quantization_group_size": 32})],
)
def test_quantized_logits_track_float32(tiny_model_factory, method, extra):
    path = tiny_model_factory("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    ref, dense = prefill_logits(path, PROMPTS)
    out, report = prefill_logits(path, PROMPTS, quantization=method, **extra)
    assert report["quantization"] == method
    assert report["formats"]["embedding"] == "float32" and report["formats"]["lm_head"] == "float32"
    ratio = ((out - ref).abs().max() / ref.abs().max()).item()
    print(f"\n{method}: max |dlogit| / max |logit| = {ratio:.3f}")
    assert ratio < BOUNDS[method], ratio
    # linear weights at 1 (int8, fp8) or 5/8 (int4) bytes per weight instead of 4; the float32
    # embedding and LM head are 40% of this tiny model's bytes
    assert report["weight_bytes"] < 0.6 * dense["weight_bytes"]


def test_int4_groups_and_tensor_parallel_through_the_server(server_factory, tiny_chat_model):
    """int4 via SGLang's --torchao-config spelling; group 32 is exactly what TP 2 splits on (every
    row-parallel shard boundary falls on a group), so TP 2 gives TP 1's greedy tokens."""
    flags = ("--model-path", tiny_chat_model, "--dtype", "float32", "--max-total-tokens", "2048")
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    tp1 = server_factory(*flags, "--torchao-config", "int4wo-32")
    info = requests.get(f"{tp1.url}/server_info", timeout=30).json()
    assert info["quantization"] == "int4_weight_only"
    assert info["weight_formats"]["linear"] == "int4 (group 32, asymmetric)"
    ours = [tp1.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in PROMPTS]
    tp1.stop()
    tp2 = server_factory(
        *flags, "--quantization", "int4_weight_only", "--quantization-group-size", "32", "--tp-size", "2"
    )
    assert [tp2.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in PROMPTS] == ours
    tp2.stop()


def perplexity(server, ids: list[int]) -> float:
    out = server.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
    )
    lps = [lp[0] for lp in out["meta_info"]["input_token_logprobs"][1:]]  # the first token has none
    return math.exp(-sum(lps) / len(lps))


@pytest.mark.full  # one server per method; int4 and TP stay live in make test
def test_default_model_perplexity(shared_server, default_model_path):
    """Perplexity of a fixed text under each method, as a ratio to float32 (printed; the README
    reports it): int8 must stay within 1.10. The default model's weights are Q4_1 already (groups of
    32 on a 16-level grid), so int4 with groups of 32 re-finds that grid (ratio ~1.00), while groups
    of 128 round a second time onto a coarser one (~10% relative weight error, like any 4-bit
    round-to-nearest at that group size): reported and bounded loosely."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_path).encode(TEXT)
    flags = ("--dtype", "float32", "--max-total-tokens", "4096")
    reference = perplexity(shared_server("--quantization", "none", *flags), ids)
    ratios = {}
    for name, method in (
        ("w8a8_int8", ("w8a8_int8",)),
        ("int4 g32", ("int4_weight_only", "--quantization-group-size", "32")),
        ("int4 g128", ("int4_weight_only",)),
    ):
        server = shared_server("--quantization", *method, *flags)
        info = requests.get(f"{server.url}/server_info", timeout=30).json()
        assert info["quantization"] == method[0]
        ratios[name] = round(perplexity(server, ids) / reference, 4)
    print(f"\ndefault model, {len(ids)} tokens: float32 perplexity {reference:.3f}; ratios {ratios}")
    # 1.039 on an AVX-512 EPYC, 1.078 on a Sapphire Rapids Xeon (the same with every kernel variant:
    # the float layers around the int8 GEMMs differ); a broken int8 path lands far above
    assert ratios["w8a8_int8"] <= 1.10, ratios
    assert ratios["int4 g32"] <= 1.02, ratios
    assert ratios["int4 g128"] <= 2.5, ratios


def test_bad_quantization_flags_name_the_flag(tiny_model_factory, runner_factory):
    from srt.configs.model_config import ModelLoadError
    from srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="--quantization-group-size must be one of 32, 64, 128; got 48"):
        ServerArgs(quantization="int4_weight_only", quantization_group_size=48)
    with pytest.raises(ValueError, match="--torchao-config supports int4wo-<group size>.*got 'int8dq'"):
        ServerArgs(torchao_config="int8dq")
    with pytest.raises(ValueError, match="--torchao-config int4wo-64 contradicts --quantization fp8"):
        ServerArgs(torchao_config="int4wo-64", quantization="fp8")
    with pytest.raises(ModelLoadError, match="--load-format dummy makes random dense weights"):
        runner_factory(tiny_model_factory("LlamaForCausalLM"), quantization="w8a8_int8", load_format="dummy")
