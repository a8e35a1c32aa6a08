"""Images through every API, with the official clients, against a daemon serving a forged
vision-language Model (``specd.forge.vision``'s Gemma 3) beside the text-only forged target."""

from __future__ import annotations

import base64
import contextlib
import io
import json

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import anthropic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import BadRequestError, OpenAI
from PIL import Image

from conftest import model_manifest, start_daemon
from specd.forge.vision import build
from specd.server.images import MAX_IMAGES, MAX_PIXELS

GREEDY = {"temperature": 0}


def encoded(seed: int = 1, fmt: str = "PNG", size: tuple[int, int] = (90, 100)) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def vision_daemon(forged, tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-daemon")
    model = build("gemma3", root / "gemma3", forged / "target", seed=3)
    d = start_daemon(root, {"models.yaml": model_manifest("eyes", model) + "---\n"
                            + model_manifest("blind", forged / "target")})
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oai(vision_daemon):
    return OpenAI(base_url=vision_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(vision_daemon):
    return anthropic.Anthropic(base_url=vision_daemon.url, api_key="unused", max_retries=0, timeout=60)


def chat(oai, url: str, model: str = "eyes", **kw):
    return oai.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **kw}},
                                     {"type": "text", "text": "Describe this image."}]}])


def test_an_image_through_openai_anthropic_and_responses_gives_one_answer(oai, claude):
    png = encoded(1)
    openai_chat = chat(oai, data_url(png))
    text = openai_chat.choices[0].message.content
    message = claude.messages.create(model="eyes", max_tokens=8, extra_body=GREEDY, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": "Describe this image."}]}])
    assert message.content[0].text == text
    response = oai.responses.create(model="eyes", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png)},
                                     {"type": "input_text", "text": "Describe this image."}]}])
    assert response.output_text == text
    text_only = oai.chat.completions.create(model="eyes", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Describe this image."}])
    image_tokens = 4  # the forged Gemma 3's mm_tokens_per_image, between its begin and end markers
    assert openai_chat.usage.prompt_tokens >= text_only.usage.prompt_tokens + image_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == \
        openai_chat.usage.prompt_tokens


def test_a_resent_image_is_served_from_the_prefix_cache(oai):
    url = data_url(encoded(5, "JPEG"), "image/jpeg")
    first = chat(oai, url)
    again = chat(oai, url)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2


def bomb() -> bytes:
    """A PNG of more pixels than MAX_PIXELS in a few hundred bytes."""
    buffer = io.BytesIO()
    side = int(MAX_PIXELS ** 0.5) + 64
    Image.new("1", (side, side)).save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


BAD = {
    "truncated": (data_url(encoded(1)[:200]), "could not be decoded"),
    "decompression bomb": (data_url(bomb()), "pixels"),
    "wrong media type": (data_url(encoded(1, "JPEG"), "image/png"), "JPEG data, declared image/png"),
    "not base64": ("data:image/png;base64,@@@not-base64@@@", "base64"),
    "not an image": (data_url(b"hello, this is text" * 10), "could not be decoded"),
    "unsupported type": (data_url(encoded(1, "BMP"), "image/bmp"), "media type"),
    "a URL to fetch": ("https://example.com/cat.png", "does not fetch"),
    "not a data URL": ("file:///etc/passwd", "data:image"),
    "empty": ("data:image/png;base64,", "empty"),
}


@pytest.mark.parametrize("case", BAD)
def test_every_bad_image_is_a_400_naming_its_field(case, oai, claude, vision_daemon):
    url, words = BAD[case]
    with pytest.raises(BadRequestError) as err:
        chat(oai, url)
    assert words in err.value.message and err.value.body["param"] == "messages[0].content[0].image_url"
    status, body = vision_daemon.get("/v1/responses", {"model": "eyes", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]})
    assert status == 400 and words in json.loads(body)["error"]["message"]
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(model="eyes", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": head[5:].split(";")[0] or "image/png",
                                             "data": data}}]}])
        assert err.value.status_code == 400


def test_limits_and_fields_specd_does_not_implement_are_400s(oai, vision_daemon):
    url = data_url(encoded(1, size=(8, 8)))
    with pytest.raises(BadRequestError, match="at most"):
        oai.chat.completions.create(model="eyes", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}] * (MAX_IMAGES + 1)}])
    with pytest.raises(BadRequestError, match="detail") as err:
        chat(oai, url, detail="high")
    assert err.value.body["param"].endswith("image_url.detail")
    with pytest.raises(BadRequestError, match="takes no images") as err:
        chat(oai, url, model="blind")
    status, _ = vision_daemon.get("/readyz")
    assert status == 200


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=2048), st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp"]))
def test_any_bytes_as_an_image_are_answered_never_a_500(vision_daemon, data, media_type):
    status, body = vision_daemon.get("/v1/chat/completions", {"model": "eyes", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(data, media_type)}}]}]})
    assert status in (200, 400), body


def test_a_model_says_what_it_takes_and_why_not(vision_daemon, forged, tmp_path):
    from daemons import model_status

    assert model_status(vision_daemon, "eyes")["modalities"] == ["text", "image"]
    blind = model_status(vision_daemon, "blind")
    assert blind["modalities"] == ["text"] and "no vision tower" in blind["imageRefusal"]
    asked = start_daemon(tmp_path, {"m.yaml": model_manifest("asked", forged / "target", modalities="[text, image]")},
                         wait_ready=False)
    try:
        import time

        deadline = time.monotonic() + 60
        while "no vision tower" not in json.dumps(model_status(asked, "asked")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "modalities names image" in json.dumps(model_status(asked, "asked"))
    finally:
        asked.stop()


def test_an_image_in_a_tool_result_reaches_the_model(claude):
    """As Claude Code sends a file its Read tool opened: an image block inside a tool_result."""
    png = base64.b64encode(encoded(8)).decode()

    def ask(image: bool):
        content = [{"type": "text", "text": "the file:"}] + ([{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": png}}] if image else [])
        return claude.messages.create(model="eyes", max_tokens=6, extra_body=GREEDY, messages=[
            {"role": "user", "content": "Read picture.png"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                               "input": {"file_path": "picture.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}])
    with_image, without = ask(True), ask(False)
    assert with_image.usage.input_tokens + (with_image.usage.cache_read_input_tokens or 0) > \
        without.usage.input_tokens + (without.usage.cache_read_input_tokens or 0)


@pytest.fixture(scope="module")
def image_host():
    """An HTTP server on loopback: /ok.png an image, /missing a 404, /slow no answer for 12 s,
    /huge a body over the size limit."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from specd.server.images import MAX_IMAGE_BYTES

    png = encoded(9)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow":
                time.sleep(12)
            if self.path == "/missing":
                self.send_error(404)
                return
            body = png if self.path != "/huge" else b"\0" * (MAX_IMAGE_BYTES + 1)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", png
    server.shutdown()


def test_image_urls_are_fetched_only_where_the_operator_allows_it(forged, tmp_path, image_host, vision_daemon):
    base, png = image_host
    model = build("gemma3", tmp_path / "gemma3", forged / "target", seed=3)
    fetching = start_daemon(tmp_path, {"m.yaml": model_manifest("eyes", model)}, True, "--fetch-image-urls")
    try:
        client = OpenAI(base_url=fetching.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        fetched = chat(client, f"{base}/ok.png").choices[0].message.content
        assert fetched == chat(client, data_url(png)).choices[0].message.content
        claude = anthropic.Anthropic(base_url=fetching.url, api_key="unused", max_retries=0, timeout=60)
        message = claude.messages.create(model="eyes", max_tokens=8, extra_body=GREEDY, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": f"{base}/ok.png"}},
                                         {"type": "text", "text": "Describe this image."}]}])
        assert message.content[0].text == fetched
        for path, words in (("/missing", "HTTP 404"), ("/huge", "over"), ("/slow", "took over"),
                            ("http://127.0.0.1:9/x.png", "could not be fetched")):
            with pytest.raises(BadRequestError, match=words) as err:
                chat(client, path if path.startswith("http") else base + path)
            assert err.value.body["param"] == "messages[0].content[0].image_url"
    finally:
        fetching.stop()
    with pytest.raises(BadRequestError, match="--fetch-image-urls"):
        chat(OpenAI(base_url=vision_daemon.url + "/v1", api_key="unused", max_retries=0), f"{base}/ok.png")


def test_a_template_that_drops_images_is_a_400_not_an_ignored_image(forged, tmp_path):
    """A chat template that renders only text parts would leave the image out of the prompt: the
    request is refused, never answered as if no image had been sent."""
    model = build("gemma3", tmp_path / "gemma3", forged / "target", seed=3)
    text_only = ("{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
                 "{% for c in m.content %}{% if c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}\n"
                 "{% endfor %}")
    for name in ("tokenizer_config.json", "chat_template.json"):
        config = json.loads((model / name).read_text())
        config["chat_template"] = text_only
        (model / name).write_text(json.dumps(config))
    d = start_daemon(tmp_path, {"m.yaml": model_manifest("eyes", model)})
    try:
        status, body = d.get("/v1/chat/completions", {"model": "eyes", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(encoded(1))}},
                                         {"type": "text", "text": "Describe this image."}]}]})
        error = json.loads(body)["error"]
        assert status == 400 and ("none of the 1 image" in error["message"] or "0 image tokens" in error["message"])
        assert error["param"] == "messages[0].content[0].image_url"
    finally:
        d.stop()
