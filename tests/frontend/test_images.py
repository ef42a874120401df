"""`image()` in DSL programs on a tiny random SmolVLM-shaped (Idefics3) model, through a live server
(`RuntimeEndpoint`) and an in-process Engine (`EngineBackend`): greedy answers equal a direct POST
/generate of the same text and image_data, forks keep the state's images (and their prefill hits the
cache), `select` scores its choices with the images, and a text-only model refuses images clearly."""

from __future__ import annotations

import base64
import io
import pathlib

import pytest
from multimodal.vlm_models import data_url, random_image

import frontend as sgl

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(shared_server, idefics3_path):
    return shared_server("--model-path", idefics3_path, "--max-total-tokens", "8192")


# the Engine's own start-up (about 10 s) is paid in make test-all only
@pytest.fixture(scope="module", params=["endpoint", pytest.param("engine", marks=pytest.mark.full)])
def backend(request, server, idefics3_path):
    if request.param == "endpoint":
        yield sgl.RuntimeEndpoint(server.url)
    else:
        be = sgl.EngineBackend(model_path=idefics3_path, max_total_tokens=8192, dtype="float32", log_level="warning")
        yield be
        be.shutdown()


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    """A PNG file and its PIL image."""
    image = random_image(100, 150, seed=0)
    path = tmp_path_factory.mktemp("images") / "picture.png"
    image.save(path, format="PNG")
    return str(path), image


def direct(server, text: str, images: list, max_new_tokens: int = 8) -> dict:
    out = server.generate(
        text=text, image_data=images, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0}
    )
    assert isinstance(out, dict)
    return out


@sgl.function
def describe(s, *pictures):
    with s.user():
        for p in pictures:
            s += sgl.image(p)
        s += QUESTION
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


def prompt_of(state, var: str) -> str:
    text = state.text()
    return text[: text.rindex(state[var])] if state[var] else text


def test_image_gen_equals_a_direct_generate(backend, server, picture):
    path, image = picture
    state = describe.run(path, temperature=0, backend=backend)
    prompt = prompt_of(state, "answer")
    assert prompt.count("<image>") == 1 and prompt.index("<image>") < prompt.index(QUESTION)
    ref = direct(server, prompt, [data_url(image)])
    assert state["answer"] == ref["text"]
    assert state.get_meta_info("answer")["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
    # the same picture as a PIL image, and streamed
    assert describe.run(image, temperature=0, backend=backend)["answer"] == ref["text"]
    streamed = describe.run(image, temperature=0, backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == ref["text"]
    # two images: their placeholders and image_data in the order appended
    other = random_image(48, 40, seed=1)
    two = describe.run(data_url(other), path, temperature=0, backend=backend)
    ref_two = direct(server, prompt_of(two, "answer"), [data_url(other), data_url(image)])
    assert two["answer"] == ref_two["text"] != ref["text"]


@sgl.function
def forked(s, picture):
    s += sgl.user(sgl.image(picture) + QUESTION)
    branches = s.fork(2)
    branches += sgl.assistant(sgl.gen("answer", max_tokens=8))
    branches.join()
    return branches


def test_fork_keeps_the_images(backend, server, picture):
    path, image = picture
    backend.flush_cache()
    state = forked.run(path, temperature=0, backend=backend)
    branches = state.ret_value
    ref = direct(server, prompt_of(branches[0], "answer"), [data_url(image)])
    assert state["answer"] == [ref["text"], ref["text"]]
    # the fork prefilled the prefix with its image, so even the first branch's request hit the
    # image's 80 rows (2 x 2 tiles and the global one, 16 each) in the cache
    assert all(b.get_meta_info("answer")["cached_tokens"] > 80 for b in branches)


@sgl.function
def pick(s, picture, method):
    s += sgl.user(sgl.image(picture) + "Is it a cat or a dog?")
    s += sgl.assistant(sgl.select("animal", choices=["a cat", "a dog"], choices_method=method))


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.unconditional_likelihood_normalized])
def test_select_after_an_image(backend, server, picture, method):
    path, image = picture
    state = pick.run(path, method, backend=backend)
    assert state["animal"] in ("a cat", "a dog")
    meta = state.get_meta_info("animal")
    prefix = state.text()[: state.text().rindex(state["animal"])]
    # the choices were scored after the expanded image (the unconditional ones after no image)
    assert meta["prompt_tokens"] == direct(server, prefix, [data_url(image)], 0)["meta_info"]["prompt_tokens"]
    assert len(meta["scores"]) == 2 and all(lp for lp in meta["input_token_logprobs"])


def test_image_on_a_text_only_model_is_a_clear_error(tiny_server, picture):
    with pytest.raises(sgl.ProgramError, match="accepts text only, not images"):
        describe.run(picture[0], backend=sgl.RuntimeEndpoint(tiny_server.url))


def test_image_sources(picture, tmp_path):
    path, image = picture
    raw = pathlib.Path(path).read_bytes()
    encoded = base64.b64encode(raw).decode()
    assert sgl.image(path).data == encoded == sgl.image("file://" + path).data == sgl.image(raw).data
    assert sgl.image(data_url(image)).data == data_url(image)
    assert sgl.image("https://example.com/cat.png").data == "https://example.com/cat.png"
    pil = base64.b64decode(sgl.image(image).data)
    assert pil.startswith(b"\x89PNG") and random_image(100, 150, seed=0).tobytes() == _decode(pil).tobytes()
    with pytest.raises(ValueError, match="no such file"):
        sgl.image(str(tmp_path / "missing.png"))
    with pytest.raises(TypeError, match="image\\(\\) takes"):
        sgl.image(42)  # pyright: ignore[reportArgumentType]


def _decode(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")
