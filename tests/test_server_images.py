"""Images in chat requests: the prompt layout of transformers' Qwen3VLProcessor, the
GenerationRequest the engine receives, and a 400 naming the part for every bad image.
Live uvicorn + FakeEngine; a local HTTP server for downloads. (Preprocessing itself:
tests/test_image_processor.py.)"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fake_engine import FakeEngine, LiveServer, real_tokenizer
from image_samples import data_url, encoded, picture, write_processor_dir
from PIL import Image

from deltaserve.models.chat_format import IMAGE_PAD_ID
from deltaserve.models.image_processor import ImageProcessorConfig, preprocess
from deltaserve.server.app import create_app
from deltaserve.server.frontend.messages import ImageRef, PromptError
from deltaserve.server.images import fetch
from deltaserve.server.settings import ConfigError, ImageSettings, ModelSettings, Settings

MODEL = "qwen-test"
CHAT = "/v1/chat/completions"
MAX_PIXELS = 600 * 600  # the test server's limits
MAX_BYTES = 200_000


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


PNG = encoded(picture(300, 200))
PNG_URL = data_url(PNG)


# --------------------------------------------------------------------- live server


class _Files(BaseHTTPRequestHandler):
    """/cat.png, /missing (404), /redirect/N (N + 1 redirects to /cat.png), /to-file, /big (with
    Content-Length), /big-stream (without), /slow."""

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        path = self.path
        if path.startswith("/redirect/"):
            hops = int(path.rsplit("/", 1)[1])
            self._redirect("/cat.png" if hops == 0 else f"/redirect/{hops - 1}")
        elif path == "/to-file":
            self._redirect("file:///etc/hostname")
        elif path == "/cat.png":
            self._send(PNG)
        elif path in ("/big", "/big-stream"):
            self._send(b"\x89PNG" + bytes(MAX_BYTES), with_length=path == "/big")
        elif path == "/slow":
            time.sleep(2)
            self._send(PNG)
        else:
            self.send_error(404)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send(self, body: bytes, with_length: bool = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if with_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the test checkpoints' preprocessor_config.json."""
    return write_processor_dir(tmp_path_factory.mktemp("processor"))


@pytest.fixture(scope="module")
def files_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allowed directory: cat.png, a link to a file outside it, and a file outside."""
    root = tmp_path_factory.mktemp("images")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (root / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(root / "secret.png")
    return allowed


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(real_tokenizer(), max_context=4096)


@pytest.fixture(scope="module")
def server(engine: FakeEngine, image_dir: Path) -> Iterator[LiveServer]:
    images = ImageSettings(
        max_per_request=2,
        max_pixels=MAX_PIXELS,
        max_bytes=MAX_BYTES,
        local_dir=str(image_dir),
        http=True,
        http_timeout=1.0,
        http_max_redirects=2,
    )
    settings = Settings(model=ModelSettings(path="unused", served_name=MODEL), images=images)
    with LiveServer(create_app(engine, real_tokenizer(), settings)) as live:
        yield live


@pytest.fixture
def http(server: LiveServer, engine: FakeEngine) -> Iterator[httpx.Client]:
    engine.reset()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def ask(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    return http.post(CHAT, json={"model": MODEL, "messages": messages, **fields})


def user(*parts: dict[str, Any] | str) -> dict[str, Any]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def image_only_processor(processor_dir: Path, tokenizer_dir: Path) -> Any:
    """transformers' Qwen3VLProcessor without its video processor (which needs
    torchvision): text + images -> input_ids, pixel_values, image_grid_thw."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageOnly(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name: str, argument: Any) -> Any:
            if name == "video_processor":
                return None
            return super().check_argument_for_proper_class(name, argument)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    images = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    return ImageOnly(images, tokenizer, None, chat_template=tokenizer.chat_template)


def test_prompt_layout_matches_transformers_processor(
    http: httpx.Client, engine: FakeEngine, processor_dir: Path
) -> None:
    """Two images over two user turns: prompt ids equal Qwen3VLProcessor's (each image's
    one pad expanded to grid/merge^2 tokens, in order), and the images the engine gets
    equal its pixel_values and grids."""
    second = picture(360, 200, "RGBA", seed=1)
    messages = [
        user(image_part(PNG_URL), "What is this?"),
        {"role": "assistant", "content": "A gradient."},
        user("And this one:", image_part(data_url(encoded(second)))),
    ]
    assert ask(http, messages).status_code == 200
    request = engine.requests[-1]
    processor = image_only_processor(processor_dir, engine.tokenizer.model_dir)
    template_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        messages[1],
        {"role": "user", "content": [{"type": "text", "text": "And this one:"}, {"type": "image"}]},
    ]
    text = processor.tokenizer.apply_chat_template(
        template_messages, tokenize=False, add_generation_prompt=True
    )
    first = Image.open(io.BytesIO(PNG))
    expected = processor(text=[text], images=[first, second], return_tensors="np")
    assert list(request.prompt_ids) == expected["input_ids"][0].tolist()
    grids = expected["image_grid_thw"].tolist()
    assert [list(image.grid) for image in request.images] == grids
    assert [image.num_tokens for image in request.images] == [t * h * w // 4 for t, h, w in grids]
    patches = np.concatenate([image.patches for image in request.images])
    np.testing.assert_allclose(patches, expected["pixel_values"], atol=1e-5, rtol=0)
    assert request.prompt_ids.count(IMAGE_PAD_ID) == sum(i.num_tokens for i in request.images)


def test_request_images_digest_and_prefix_hint(http: httpx.Client, engine: FakeEngine) -> None:
    """Equal pixels give equal digests (whatever the encoding), other pixels another;
    the prefix hint counts expanded image tokens: the next turn starts with them."""
    lossless = data_url(encoded(picture(300, 200), "WEBP", lossless=True), "image/webp")
    other = data_url(encoded(picture(300, 200, seed=5)))
    turn_one = [user(image_part(PNG_URL), "look")]
    turn_two = [
        *turn_one,
        {"role": "assistant", "content": "ok"},
        user("and", image_part(lossless)),
    ]
    for messages in (turn_one, turn_two, [user(image_part(other))]):
        response = ask(http, messages)
        assert response.status_code == 200, response.text
    first, later, different = engine.requests
    assert later.images[0].digest == later.images[1].digest == first.images[0].digest
    assert different.images[0].digest != first.images[0].digest
    assert 0 < first.prefix_hint < len(first.prompt_ids)
    assert later.prompt_ids[: first.prefix_hint] == first.prompt_ids[: first.prefix_hint]
    text = engine.tokenizer.decode(list(first.prompt_ids[first.prefix_hint :]))
    assert text.startswith("<|im_start|>assistant\n")


def test_sources_gif_exif_and_metrics(
    http: httpx.Client, engine: FakeEngine, files_url: str, image_dir: Path
) -> None:
    """A file under the allowed dir (file:// URL or path), an http download after
    redirects, a GIF's first frame, an EXIF-rotated JPEG (made upright) all arrive;
    /metrics counts the images."""
    before = _images_metric(http)
    frames = [picture(64, 64, seed=s) for s in (1, 2)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:])
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to view
    jpeg = encoded(picture(320, 256), "JPEG", exif=exif.tobytes())
    parts = [
        image_part(f"file://{image_dir / 'cat.png'}"),
        image_part("cat.png"),
        image_part(f"{files_url}/redirect/1"),
        image_part(data_url(gif.getvalue(), "image/gif")),
        image_part(data_url(jpeg, "image/jpeg")),
    ]
    for part in parts:
        assert ask(http, [user(part, "?")]).status_code == 200, part
    cat, path, download, first_frame, rotated = (r.images[0] for r in engine.requests)
    assert cat.digest == path.digest == download.digest
    animation = Image.open(io.BytesIO(gif.getvalue()))
    np.testing.assert_array_equal(first_frame.patches, preprocess(animation, _cfg())[0])
    animation.seek(1)
    assert not np.array_equal(first_frame.patches, preprocess(animation, _cfg())[0])
    assert rotated.grid[1:] == preprocess(picture(256, 320), _cfg())[1][1:]  # tall now
    assert _images_metric(http) == before + len(parts)


def _cfg() -> ImageProcessorConfig:
    return ImageProcessorConfig()


def _images_metric(http: httpx.Client) -> float:
    lines = http.get("/metrics").text.splitlines()
    line = next(line for line in lines if line.startswith("deltaserve_images_total "))
    return float(line.split()[1])


TRUNCATED_PNG = PNG[: len(PNG) // 2]
BMP = encoded(picture(32, 32), "BMP")
NOISE = np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)
HEAVY_PNG = encoded(Image.fromarray(NOISE))  # ~480 KB > MAX_BYTES
PART = "messages[0].content[0].image_url"

# (id, content part url or messages, expected param, words of the message)
BAD: list[tuple[str, Any, str, str]] = [
    ("not-an-image", data_url(b"hello, world"), PART, "not a readable image"),
    ("truncated", data_url(TRUNCATED_PNG), PART, "corrupt or truncated"),
    ("bad-base64", "data:image/png;base64,@@@", PART, "base64"),
    ("no-comma", "data:image/png;base64", PART, "comma"),
    ("unsupported-format", data_url(BMP, "image/bmp"), PART, "BMP is not supported"),
    ("too-many-pixels", data_url(encoded(Image.new("RGB", (700, 600)))), PART, "700x600"),
    ("too-many-bytes", data_url(HEAVY_PNG), PART, "over 200000 bytes"),
    ("thin", data_url(encoded(Image.new("RGB", (402, 2)))), PART, "aspect ratio"),
    ("scheme", "ftp://example.com/cat.png", PART, "'ftp' is not supported"),
    ("malformed-url", "http://[::1/cat.png", PART, "malformed"),
    ("outside-dir", "../secret.png", PART, "outside"),
    ("absolute-outside", "/etc/hostname", PART, "outside"),
    ("symlink-outside", "link.png", PART, "outside"),
    ("missing-file", "file://{dir}/nope.png", PART, "no such file"),
    ("remote-file-host", "file://example.com/cat.png", PART, "local file"),
    ("http-404", "{http}/missing", PART, "HTTP 404"),
    ("http-redirects", "{http}/redirect/2", PART, "too many"),
    ("http-to-file", "{http}/to-file", PART, "off http"),
    ("http-too-big", "{http}/big", PART, "over 200000 bytes"),
    ("http-too-big-stream", "{http}/big-stream", PART, "over 200000 bytes"),
    ("http-slow", "{http}/slow", PART, "timed out"),
    ("http-refused", "http://127.0.0.1:1/cat.png", PART, "failed"),
    ("too-many-images", [user(*[image_part(PNG_URL)] * 3)], "messages[0].content[2].image_url",
     "at most 2 images"),
    ("system-image", [{"role": "system", "content": [image_part(PNG_URL)]}, user("hi")],
     "messages[0].content[0]", "only user messages"),
    ("assistant-image", [user("hi"), {"role": "assistant", "content": [image_part(PNG_URL)]},
                         user("?")], "messages[1].content[0]", "only user messages"),
    ("developer-image", [{"role": "developer", "content": [image_part(PNG_URL)]}, user("x")],
     "messages[0].content[0]", "only user messages"),
    ("tool-image", [user("hi"), {"role": "tool", "tool_call_id": "c", "content": [
        image_part(PNG_URL)]}], "messages[1].content[0]", "only user messages"),
    ("pad-in-text", [user(image_part(PNG_URL), "<|image_pad|>")], "messages", "<|image_pad|>"),
    ("empty-url", [user(image_part(""))], "messages[0].content[0].image_url", "needs"),
    ("no-image-url", [user({"type": "image_url"})], "messages.0.content.0", "image_url"),
    ("bad-detail", [user({"type": "image_url", "image_url": {"url": PNG_URL, "detail": "max"}})],
     "messages.0.content.0.image_url.detail", "detail"),
    ("audio-part", [user({"type": "input_audio", "input_audio": {}})], "messages.0.content.0",
     "not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "param", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_images_are_400_naming_the_part(
    http: httpx.Client,
    engine: FakeEngine,
    files_url: str,
    image_dir: Path,
    case: Any,
    param: str,
    words: str,
) -> None:
    """Each bad image is a 400 in OpenAI's shape naming the part, and never reaches the
    engine."""
    if isinstance(case, str):
        case = [user(image_part(case.format(http=files_url, dir=image_dir)), "what is it?")]
    response = ask(http, case)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"], error
    assert engine.requests == []


def test_default_settings_take_data_urls_only(engine: FakeEngine) -> None:
    """Out of the box: data: URLs yes; files and http(s) are refused as not enabled."""
    engine.reset()
    settings = Settings(model=ModelSettings(path="unused", served_name=MODEL))
    with (
        LiveServer(create_app(engine, real_tokenizer(), settings)) as live,
        httpx.Client(base_url=live.url, timeout=30) as client,
    ):
        assert ask(client, [user(image_part(PNG_URL))]).status_code == 200
        for url in ("https://example.com/cat.png", "file:///tmp/cat.png", "cat.png"):
            error = ask(client, [user(image_part(url))]).json()["error"]
            assert error["param"] == PART and "not enabled" in error["message"], error
    assert len(engine.requests) == 1


def test_data_urls_can_be_switched_off_and_settings_are_checked(tmp_path: Path) -> None:
    """images.data_urls=false refuses data: URLs; bad limits and a missing local_dir
    are config errors."""
    with pytest.raises(PromptError, match="not enabled") as error:
        fetch(ImageRef(PNG_URL, PART), ImageSettings(data_urls=False))
    assert error.value.param == PART
    for bad in ({"max_per_request": -1}, {"max_bytes": 0}, {"http_timeout": 0}):
        with pytest.raises(ConfigError):
            ImageSettings(**bad)
    with pytest.raises(ConfigError, match="not a directory"):
        ImageSettings(local_dir=str(tmp_path / "missing"))
