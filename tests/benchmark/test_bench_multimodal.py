"""benchmark/bench_multimodal.py's cheap parts: its flags, the SmolVLM-shaped folder it builds (SmolVLM's
sizes, 64 tokens a 512 px tile, its split) and its workloads' image reuse. The run itself (two servers
of the real-size model) is far too slow for a test."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

import bench_multimodal  # noqa: E402  # pyright: ignore[reportMissingImports]

transformers = pytest.importorskip("transformers")


def test_help_names_the_flags():
    proc = subprocess.run(
        [sys.executable, "benchmark/bench_multimodal.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--num-prompts", "--num-shared-images", "--concurrency", "--max-tokens", "--longest-edge", "--plot"):
        assert flag in proc.stdout


def test_model_folder_and_workloads(tmp_path):
    from srt.multimodal.processors import image_prompts_for
    from srt.server_args import ServerArgs

    path = bench_multimodal.build_model(1024, str(tmp_path))
    assert os.path.dirname(path) == str(tmp_path) and bench_multimodal.build_model(1024, str(tmp_path)) == path
    cfg = transformers.AutoConfig.from_pretrained(path)
    assert cfg.architectures == ["Idefics3ForConditionalGeneration"]
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (576, 30, 3)
    assert (vision.hidden_size, vision.num_hidden_layers, vision.image_size, vision.patch_size) == (768, 12, 512, 16)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert text.vocab_size == len(tok)

    args = argparse.Namespace(num_prompts=6, num_shared_images=2, image_size=96, seed=0, distinct_questions=False)
    shared, distinct = bench_multimodal.workloads(args)
    assert [i for i, _ in shared.prompts] == [0, 1, 0, 1, 0, 1] and len(set(shared.images)) == 2
    assert len({q for _, q in shared.prompts}) == 1  # a repeated image is a repeated prompt
    assert len(set(distinct.images)) == 6 and not set(distinct.images) & set(shared.images)

    image, question = shared.images[0], shared.prompts[0][1]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|im_start|>User:<image>{question}<end_of_utterance>\nAssistant:"
    prompts = image_prompts_for(ServerArgs(model_path=path, load_format="dummy"), tok)
    ids, items = prompts.expand(tok.encode(prompt, add_special_tokens=False), [image], ["image"])
    assert items[0].data["pixel_values"].shape[0] == 5  # resized to 1024 px: 2 x 2 tiles and the global one
    assert items[0].num_rows == 5 * 64
