"""Vision-language models in process against HF transformers (float32), through the tokenizer
side's prompt expansion and the model runner: the expanded prompt equals HF's processor's, the
last position's logits agree within 1e-4 and greedy tokens are identical, for one image, several
images of different sizes and images between chat turns, over chunk sizes and page sizes 1 and 16."""

from __future__ import annotations

import pytest
import torch
from multimodal.vlm_models import data_url, hf_llava_processor, hf_processor, hf_qwen2_vl_processor, random_image

from srt.model_executor.static_batch import StaticBatchGenerator
from srt.models.multimodal import model_ids
from srt.multimodal.media import MediaLimits
from srt.multimodal.processors import ImagePrompts
from srt.sampling.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

LIMITS = MediaLimits(max_bytes=1 << 24, max_pixels=1 << 24, allow_remote=False, fetch_timeout=5.0)


def ours(path: str, prompt: str, images: list) -> tuple[list[int], list]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    cfg = transformers.AutoConfig.from_pretrained(path)
    prompts = ImagePrompts(cfg.architectures[0], path, cfg, tok, LIMITS, max_images=8, cache_bytes=1 << 26)
    ids = tok.encode(prompt, add_special_tokens=False)
    return prompts.expand(ids, [data_url(im) for im in images], [f"image_data[{i}]" for i in range(len(images))])


CASES = {
    "one image": ("User:<image>What is in the picture?<end_of_utterance>\nAssistant:", [(100, 150)]),
    "two sizes": ("User:<image>and<image>: compare them.<end_of_utterance>\nAssistant:", [(150, 100), (40, 48)]),
    "between turns": (
        "User:<image>Describe it.<end_of_utterance>\nAssistant: A cat.<end_of_utterance>\n"
        "User:<image>And this one?<end_of_utterance>\nAssistant:",
        [(64, 64), (90, 30)],
    ),
}


# architecture -> (the path fixture, HF's model class, HF's processor over the folder, HF's
# images argument for one prompt's images)
MODELS = {
    "idefics3": ("idefics3_path", "Idefics3ForConditionalGeneration", hf_processor, lambda ims: [ims]),
    "llava": ("llava_path", "LlavaForConditionalGeneration", hf_llava_processor, lambda ims: ims),
    "qwen2_vl": ("qwen2_vl_path", "Qwen2VLForConditionalGeneration", hf_qwen2_vl_processor, lambda ims: ims),
}
PLACEHOLDERS = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
HF_MODELS: dict = {}


# make test runs each architecture on several images of different sizes, Idefics3 and Qwen2-VL
# (M-RoPE) on every case; the rest run in make test-all
QUICK = {("idefics3", c) for c in CASES} | {
    ("llava", "two sizes"),
    ("qwen2_vl", "two sizes"),
    ("qwen2_vl", "between turns"),
}


@pytest.mark.parametrize(
    "arch,case",
    [
        pytest.param(a, c, id=f"{a}-{c}", marks=() if (a, c) in QUICK else pytest.mark.full)
        for a in MODELS
        for c in CASES
    ],
)
def test_matches_hf(arch, case, request, runner_factory):
    fixture, hf_class, processor, hf_images = MODELS[arch]
    path = request.getfixturevalue(fixture)
    if path not in HF_MODELS:
        HF_MODELS[path] = getattr(transformers, hf_class).from_pretrained(path, dtype=torch.float32).eval()
    hf = HF_MODELS[path]
    prompt, sizes = CASES[case]
    prompt = prompt.replace("<image>", PLACEHOLDERS.get(arch, "<image>"))
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    ids, items = ours(path, prompt, images)
    ref = processor(path)(text=prompt, images=hf_images(images), return_tensors="pt")
    assert model_ids(ids, items) == ref["input_ids"][0].tolist()  # the expansion is HF's
    assert all(t >= 1 << 30 for it in items for s, n in it.spans for t in ids[s : s + n])  # pads at image rows
    with torch.no_grad():
        want_logits = hf(**ref).logits[0, -1]
        want = hf.generate(**ref, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = want[0, len(ids) :].tolist()
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    for page_size in (1, 16):
        gen = StaticBatchGenerator(runner_factory(path, page_size=page_size))
        torch.testing.assert_close(gen.prefill_logits([ids], [items])[0], want_logits, atol=1e-4, rtol=1e-4)
        for chunk in (None, 37):  # 37 splits image runs across chunks
            out = gen.generate([ids], params, chunk_size=chunk, mm_items=[items])
            assert out[0].output_ids == want, (page_size, chunk)
        allocator = gen.runner.token_to_kv_pool_allocator
        assert allocator.available_size() == allocator.size


def test_idefics3_batch_mixes_images_and_text(idefics3_path, runner_factory):
    """A batch of a text prompt and two image prompts gives each what it gives alone."""
    tok = transformers.AutoTokenizer.from_pretrained(idefics3_path)
    a = ours(idefics3_path, CASES["one image"][0], [random_image(100, 150, 0)])
    b = ours(idefics3_path, CASES["two sizes"][0], [random_image(150, 100, 0), random_image(40, 48, 1)])
    text = tok.encode("User: hello there<end_of_utterance>\nAssistant:", add_special_tokens=False)
    gen = StaticBatchGenerator(runner_factory(idefics3_path))
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    together = gen.generate([a[0], text, b[0]], params, chunk_size=50, mm_items=[a[1], None, b[1]])
    alone = [
        gen.generate([p], params, mm_items=[m])[0].output_ids for p, m in ((a[0], a[1]), (text, None), (b[0], b[1]))
    ]
    assert [r.output_ids for r in together] == alone


def counted(fn, calls: list):
    """fn, appending each call's first argument to `calls` first."""

    def wrapper(arg):
        calls.append(arg)
        return fn(arg)

    return wrapper


@pytest.mark.parametrize("capacity", [1 << 26, 0], ids=["cache-on", "cache-off"])
def test_caches_skip_preprocessing_and_the_encoder(capacity, idefics3_path, runner_factory):
    """A repeated image is not preprocessed again (tokenizer side) nor encoded again (model side);
    an image split over prefill chunks is encoded once; with the caches off (0 bytes) each prefill
    (each chunk) encodes. The outputs do not depend on it."""
    tok = transformers.AutoTokenizer.from_pretrained(idefics3_path)
    cfg = transformers.AutoConfig.from_pretrained(idefics3_path)
    image = data_url(random_image(100, 150, seed=3))
    ids = tok.encode(CASES["one image"][0], add_special_tokens=False)
    prompts = ImagePrompts(cfg.architectures[0], idefics3_path, cfg, tok, LIMITS, max_images=8, cache_bytes=capacity)
    processed, encoded = [], []
    prompts.processor.process = counted(prompts.processor.process, processed)
    (a, items_a), (b, items_b) = prompts.expand(ids, [image], ["a"]), prompts.expand(ids, [image], ["b"])
    assert a == b and len(processed) == (1 if capacity else 2)
    runner = runner_factory(idefics3_path)
    model = runner.model
    model.encoder_cache.capacity = capacity
    model.encode_images = counted(model.encode_images, encoded)
    gen = StaticBatchGenerator(runner)
    first, second = gen.prefill_logits([a], [items_a]), gen.prefill_logits([b], [items_b])
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    assert len(encoded) == (1 if capacity else 2)
    encoded.clear()
    model.encoder_cache.entries.clear()
    model.encoder_cache.bytes = 0
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    gen.generate([a], params, chunk_size=40, mm_items=[items_a])  # 80 image rows over 3 chunks
    assert len(encoded) == (1 if capacity else 3)


def test_encoder_cache_is_bounded_in_bytes():
    from srt.models.multimodal import EncoderCache

    cache = EncoderCache(capacity_bytes=3 * 400)
    for key in range(4):
        cache.put(key, torch.zeros(100))  # 400 bytes each
    assert list(cache.entries) == [1, 2, 3] and cache.bytes == 1200
    assert cache.get(1) is not None  # now the most recent
    cache.put(4, torch.zeros(100))
    assert list(cache.entries) == [3, 1, 4]
    cache.put(5, torch.zeros(1000))  # larger than the whole cache: not kept
    assert 5 not in cache.entries and cache.get(5) is None
