"""--enable-torch-compile: bucketed, padded decode graphs compiled in the background give the same
greedy tokens as eager, for every architecture family and with the prefix read in place; with LoRA
enabled, batches that use an adapter run eagerly with the eager runner's tokens."""

import dataclasses
import logging

import pytest
import torch

from srt.model_executor.compiled_decode import CompiledDecodeRunner, bucket_sizes, compiled_graph_count
from srt.model_executor.static_batch import StaticBatchGenerator
from srt.sampling.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


@pytest.mark.full  # two cold compiles; tests/server/test_torch_compile.py keeps one live in make test
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_compiled_decode_matches_eager(tiny_model_factory, runner_factory, architecture, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile
    path = tiny_model_factory(architecture)
    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(3)]  # ragged; 3 rows pad to bucket 4
    lora = dict(enable_lora=True, max_loaded_loras=1, max_loras_per_batch=1, max_lora_rank=4)
    eager_runner = runner_factory(path, **lora)
    eager = StaticBatchGenerator(eager_runner).generate(prompts, GREEDY)

    runner = runner_factory(path, enable_torch_compile=True, torch_compile_max_bs=4, **lora)
    compiled = runner.compiled_decode
    assert compiled.buckets == [1, 2, 4]
    assert compiled.wait(timeout=900), compiled.status()
    assert compiled.status()["freezing"] is True  # the compile thread sees our (thread-local) settings
    graphs = compiled_graph_count()
    calls = []
    original = compiled.forward
    compiled.forward = lambda fb: calls.append(fb.batch_size) or original(fb)
    out = StaticBatchGenerator(runner).generate(prompts, GREEDY)
    assert calls and set(calls) == {3}, calls  # every decode step ran compiled, padded from 3 to 4
    assert [r.output_ids for r in out] == [r.output_ids for r in eager]
    single = StaticBatchGenerator(runner).generate(prompts[:1], GREEDY)
    assert single[0].output_ids == eager[0].output_ids
    assert compiled_graph_count() == graphs  # real batches hit the graphs compiled on dummy ones
    # an adapter in the batch: eager (the graphs hold no LoRA), the same tokens as the eager runner
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from srt.lora.adapter import load_adapter

    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    )
    peft_model.save_pretrained(str(tmp_path / "adapter"))

    def with_adapter(r):
        m = r.lora_manager
        m.load(0, load_adapter(str(tmp_path / "adapter"), m.base, m.max_rank, m.targets))
        forward = lambda fb: r.forward(dataclasses.replace(fb, lora_slots_cpu=[0, -1, 0][: fb.batch_size]))  # noqa: E731
        return [x.output_ids for x in StaticBatchGenerator(r, forward).generate(prompts, GREEDY)]

    calls.clear()
    want = with_adapter(eager_runner)
    assert with_adapter(runner) == want and not calls
    assert want[1] == eager[1].output_ids and want != [r.output_ids for r in eager]


def test_compile_failure_keeps_decode_eager(tiny_model_factory, runner_factory, monkeypatch):
    """A compiler error is logged once and decode keeps running eagerly, with the same tokens."""
    path = tiny_model_factory()
    expect = StaticBatchGenerator(runner_factory(path)).generate([[5, 6, 7]], GREEDY)

    def broken(self, *args):
        raise RuntimeError("C++ compile failed: no such header")

    # the module's own logger, not the root's handlers (caplog's): an earlier test in the same worker
    # that reconfigured logging once left the warning out of caplog.text
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    module_logger = logging.getLogger("srt.model_executor.compiled_decode")
    monkeypatch.setattr(module_logger, "disabled", False)
    level = module_logger.level
    module_logger.setLevel(logging.WARNING)
    module_logger.addHandler(handler)
    monkeypatch.setattr(CompiledDecodeRunner, "_decode_logits", broken)
    try:
        runner = runner_factory(path, enable_torch_compile=True, torch_compile_max_bs=2)
        assert not runner.compiled_decode.wait(timeout=300)
    finally:
        module_logger.removeHandler(handler)
        module_logger.setLevel(level)
    status = runner.compiled_decode.status()
    assert status["ready"] == [] and status["failed"]
    assert [r.getMessage() for r in records if "decode stays eager" in r.getMessage()], records
    out = StaticBatchGenerator(runner).generate([[5, 6, 7]], GREEDY)
    assert out[0].output_ids == expect[0].output_ids and runner.compiled_decode.steps == 0
