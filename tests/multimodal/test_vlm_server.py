"""Images over HTTP on a tiny random SmolVLM-shaped (Idefics3) model, with the official `openai`
client: data-URL images give HF's greedy tokens (with prefill chunks that split image runs), the same
image twice hits the radix cache and answers the same, a different image with the same text hits
only the text before it; /generate's image_data forms; every bad image is a 400 naming the part,
and the server keeps serving with its pools back at baseline."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch
from conftest import at_baseline
from multimodal.vlm_models import data_url, hf_llava_processor, hf_processor, hf_qwen2_vl_processor, random_image

transformers = pytest.importorskip("transformers")

PROMPT = "What is in the picture?"


@pytest.fixture(scope="module")
def server(shared_server, idefics3_path):
    return shared_server(
        "--model-path",
        idefics3_path,
        "--max-total-tokens",
        "8192",
        "--chunked-prefill-size",
        "48",
        "--max-images-per-request",
        "3",
        "--max-image-pixels",
        "100000",
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client, images: list[str], text: str = PROMPT, **kw):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": text}]
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0, **kw
    )


def hf_greedy(path: str, images, text: str, n: int, arch: str = "idefics3") -> str:
    processor, hf_class, hf_images = {
        "idefics3": (hf_processor, transformers.Idefics3ForConditionalGeneration, lambda ims: [ims]),
        "llava": (hf_llava_processor, transformers.LlavaForConditionalGeneration, lambda ims: ims),
        "qwen2_vl": (hf_qwen2_vl_processor, transformers.Qwen2VLForConditionalGeneration, lambda ims: ims),
    }[arch]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(path)(text=prompt, images=hf_images(images), return_tensors="pt")
    hf = hf_class.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tok.decode(out[0, inputs["input_ids"].shape[1] :])


def test_chat_images_match_hf_and_share_the_cache(server, client, idefics3_path):
    server.flush_cache()
    image = random_image(100, 150, seed=0)
    first = chat(client, [data_url(image)])
    assert first.choices[0].message.content == hf_greedy(idefics3_path, [image], PROMPT, 8)
    details = first.usage.prompt_tokens_details
    assert details.cached_tokens == 0 and details.image_tokens == 80  # 2 x 2 tiles + the global one, 16 each
    again = chat(client, [data_url(image)])
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    other = chat(client, [data_url(random_image(100, 150, seed=1))])
    # the text before the image's first row is shared (<|im_start|>User:<fake_token_around_image>
    # <row_1_col_1>); no image row is
    assert other.usage.prompt_tokens_details.cached_tokens == 5
    assert other.choices[0].message.content != first.choices[0].message.content
    # two images of different sizes, streamed: the same text as unstreamed
    images = [data_url(random_image(150, 100, seed=2)), data_url(random_image(40, 48, seed=3))]
    whole = chat(client, images).choices[0].message.content
    stream = chat(client, images, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.prompt_tokens_details.image_tokens == 80 + 80  # both are resized to 2 x 2 tiles
    at_baseline(server)


@pytest.mark.parametrize("arch", [pytest.param("llava", marks=pytest.mark.full), "qwen2_vl"])
def test_other_architectures_over_http(arch, request, shared_server):
    """LLaVA and Qwen2-VL (M-RoPE: the scheduler's 3-D prefill positions, chunked, and its shifted
    decode positions) give HF's greedy text; a repeated image is a cache hit with the same text."""
    path = request.getfixturevalue(f"{arch}_path")
    server = shared_server("--model-path", path, "--max-total-tokens", "4096", "--chunked-prefill-size", "24")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    images = [random_image(50, 40, seed=7), random_image(30, 60, seed=8)]
    first = chat(client, [data_url(im) for im in images])
    assert first.choices[0].message.content == hf_greedy(path, images, PROMPT, 8, arch)
    again = chat(client, [data_url(im) for im in images])
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    at_baseline(server)


def test_generate_image_data_forms(server, tmp_path):
    image = random_image(64, 64, seed=4)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    path = tmp_path / "cat.png"
    path.write_bytes(buf.getvalue())
    text = "User:<image>Describe it.<end_of_utterance>\nAssistant:"
    outs = [
        server.generate(text=text, image_data=src, sampling_params={"max_new_tokens": 6, "temperature": 0})
        for src in (data_url(image), base64.b64encode(buf.getvalue()).decode(), str(path), [str(path)])
    ]
    assert len({o["text"] for o in outs}) == 1 and outs[0]["meta_info"]["image_tokens"] == 80
    batch = server.generate(
        text=[text, "User: plain text<end_of_utterance>\nAssistant:"],
        image_data=[str(path), None],
        sampling_params={"max_new_tokens": 6, "temperature": 0},
    )
    assert batch[0]["text"] == outs[0]["text"] and "image_tokens" not in batch[1]["meta_info"]
    # token ids with the placeholder, {"url": ...} items, and prompt logprobs (an image row reports
    # the placeholder token, never a pad value)
    ids = transformers.AutoTokenizer.from_pretrained(server_model(server)).encode(text, add_special_tokens=False)
    out = server.generate(
        input_ids=ids,
        image_data=[{"url": str(path)}],
        return_logprob=True,
        logprob_start_len=0,
        return_text_in_logprobs=True,
        sampling_params={"max_new_tokens": 6, "temperature": 0},
    )
    assert out["text"] == outs[0]["text"]
    prompt = out["meta_info"]["input_token_logprobs"]
    assert len(prompt) == out["meta_info"]["prompt_tokens"] and sum(t[2] == "<image>" for t in prompt) == 80
    # n = 2 samples share the image's prefill
    pair = server.generate(text=text, image_data=str(path), sampling_params={"max_new_tokens": 4, "n": 2})
    assert [o["meta_info"]["cached_tokens"] for o in pair] == [out["meta_info"]["prompt_tokens"] - 1] * 2
    info = requests.get(server.url + "/model_info", timeout=30).json()
    assert info["modalities"] == ["text", "image"] and info["has_image_understanding"]
    at_baseline(server)


def server_model(server) -> str:
    return requests.get(server.url + "/model_info", timeout=30).json()["model_path"]


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed=5).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "source,expected",
    [
        ("data:image/png;base64,not*base64", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(_png(40, 40)[:200]).decode(), "corrupt or truncated"),
        ("data:image/png;base64," + base64.b64encode(b"GIF89a nonsense").decode(), "not a readable image"),
        ("data:image/png;base64," + base64.b64encode(_png(1, 1)).decode(), "at least 2 pixels"),
        ("data:image/png;base64," + base64.b64encode(_png(400, 400)).decode(), "--max-image-pixels"),
        ("http://127.0.0.1:9/cat.png", "--allow-remote-media"),
        ("/no/such/file.png", "no such file"),
        ("data:text/plain;base64,aGk=", "is not an image"),
    ],
    ids=["bad-base64", "truncated-png", "not-an-image", "1x1", "huge", "remote", "missing-file", "not-image-type"],
)
def test_bad_images_are_400s_naming_the_part(server, client, source, expected):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m",
            max_tokens=4,
            messages=[
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": source}}],
                },
            ],
        )
    assert "messages[1].content[1].image_url" in e.value.message and expected in e.value.message, e.value.message
    r = server.post("/generate", {"text": "User:<image>hi", "image_data": source})
    assert r.status_code == 400 and "image_data" in r.json()["error"]["message"], r.text
    at_baseline(server)


def test_counts_and_placeholders(server, client):
    url = data_url(random_image(20, 20, seed=6))
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [url] * 4)
    assert "4 images, more than the limit of 3 (--max-images-per-request)" in e.value.message
    assert "messages[0].content[3].image_url" in e.value.message
    r = server.post("/generate", {"text": "no placeholder here", "image_data": url})
    assert r.status_code == 400 and "0 image placeholder(s) ('<image>'" in r.json()["error"]["message"]
    r = server.post("/generate", {"text": ["a<image>", "b<image>"], "image_data": [url]})
    assert r.status_code == 400 and "one entry per prompt" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "max"}}]}],
        )
    assert "detail" in e.value.message
    assert chat(client, [url]).choices[0].finish_reason == "length"  # and it still serves
    at_baseline(server)


def test_text_only_model_refuses_images(tiny_server):
    r = tiny_server.post("/generate", {"text": "hi", "image_data": data_url(random_image(8, 8, seed=0))})
    assert r.status_code == 400 and "accepts text only" in r.json()["error"]["message"]
    models = requests.get(tiny_server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["modalities"] == ["text"]


def _generate_all(url: str, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: requests.post(url + "/generate", json=b, timeout=300).json(), bodies))


def test_a_tight_pool_retracts_image_requests_and_outputs_match(shared_server, server, idefics3_path):
    """Twelve image prompts (80 image rows each, four images shared by three prompts) that grow by
    150 tokens each in a 700-token KV pool whose admission keeps room for almost none of that growth
    (--schedule-conservativeness 0.05: requests arriving apart still run together), so requests are
    retracted and resumed (their image rows recomputed), and every output equals the roomy server's."""
    text = "User:<image>Describe it at length.<end_of_utterance>\nAssistant:"
    images = [data_url(random_image(100, 150, seed=20 + i % 4)) for i in range(12)]
    bodies = [
        {
            "text": text,
            "image_data": im,
            "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True},
        }
        for im in images
    ]
    expect = _generate_all(server.url, bodies)
    tight = shared_server(
        "--model-path", idefics3_path, "--max-total-tokens", "700", "--chunked-prefill-size", "64",
        "--schedule-conservativeness", "0.05",
    )  # fmt: skip
    before = tight.wait_idle()
    got = _generate_all(tight.url, bodies)
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expect]
    assert tight.wait_idle()["total_retractions"] > before["total_retractions"]
    at_baseline(tight)


def test_images_under_continuous_decode(shared_server, qwen2_vl_path):
    """--num-continuous-decode-steps 4 on Qwen2-VL: a request with images decodes several steps a call
    from its M-RoPE-shifted positions, and gives HF's greedy text."""
    server = shared_server(
        "--model-path", qwen2_vl_path, "--max-total-tokens", "4096", "--num-continuous-decode-steps", "4"
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    images = [random_image(50, 40, seed=7), random_image(30, 60, seed=8)]
    before = server.state()["continuous_decode"]["multi_step_steps"]
    out = client.chat.completions.create(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [
                    *({"type": "image_url", "image_url": {"url": data_url(im)}} for im in images),
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
        max_tokens=14,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.content == hf_greedy(qwen2_vl_path, images, PROMPT, 14, "qwen2_vl")
    assert server.state()["continuous_decode"]["multi_step_steps"] - before >= 12  # 13 decode steps, 3 calls of 4
    at_baseline(server)


@pytest.mark.full
@pytest.mark.parametrize(
    "flags",
    [
        ("--enable-overlap-schedule", "--kv-cache-dtype", "int8"),
        ("--enable-hierarchical-cache",),
        ("--tp-size", "2"),
        ("--quantization", "w8a8_int8"),
    ],
    ids=["overlap-int8-kv", "hicache", "tp2", "w8a8"],
)
def test_works_with(flags, shared_server, idefics3_path):
    """Image prompts under the overlap schedule with 8-bit KV, the hierarchical cache, tensor
    parallelism (the encoder on every rank) and int8 text weights: a repeated image is a cache hit
    with the same answer, a different one shares only the text before it."""
    server = shared_server(
        "--model-path", idefics3_path, "--max-total-tokens", "8192", "--chunked-prefill-size", "48", *flags
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    server.flush_cache()
    image = data_url(random_image(100, 150, seed=0))
    first, again = chat(client, [image]), chat(client, [image])
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    other = chat(client, [data_url(random_image(100, 150, seed=1))])
    assert other.usage.prompt_tokens_details.cached_tokens == 5
    # two new images in one prefill: with TP each rank encodes one of them
    pair = [data_url(random_image(150, 100, seed=2)), data_url(random_image(40, 48, seed=3))]
    assert chat(client, pair).choices[0].message.content == chat(client, pair).choices[0].message.content
    at_baseline(server)


class _Images(http.server.BaseHTTPRequestHandler):
    """A remote image host: /cat.png, /big.png (over the server's byte limit), /slow.png (past its
    fetch timeout); anything else is a 404."""

    files: dict[str, bytes] = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(3)
        body = self.files.get(self.path.replace("/slow", "/cat"))
        try:
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server gave up on a slow fetch, as it should

    def log_message(self, *args):
        pass


def test_remote_images_with_the_flag(shared_server, server, idefics3_path):
    cat = random_image(100, 150, seed=0)
    buf = io.BytesIO()
    cat.save(buf, format="PNG")
    _Images.files = {"/cat.png": buf.getvalue(), "/big.png": _png(200, 200) + bytes(100_000)}
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{host.server_address[1]}"
    try:
        remote = shared_server(
            "--model-path", idefics3_path, "--max-total-tokens", "8192", "--allow-remote-media",
            "--media-fetch-timeout", "1", "--max-image-bytes", "100000",
        )  # fmt: skip
        body = {
            "text": "User:<image>Describe it.<end_of_utterance>\nAssistant:",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        }
        fetched = remote.generate(**body, image_data=base + "/cat.png")
        assert fetched["text"] == server.generate(**body, image_data=data_url(cat))["text"]
        for path, expected in [
            ("/big.png", "larger than the limit of 100000 bytes (--max-image-bytes)"),
            ("/slow.png", "timed out"),
            ("/missing.png", "404"),
        ]:
            r = remote.post("/generate", {**body, "image_data": base + path})
            assert r.status_code == 400 and expected in r.json()["error"]["message"], r.text
        at_baseline(remote)
    finally:
        host.shutdown()
