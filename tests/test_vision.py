"""Vision-language models: images through every API to a real mlx-vlm model.

The models are tiny random-weight checkpoints of real mlx-vlm architectures
(Qwen2.5-VL, Qwen3-VL, Gemma 3, and mllama on the serial path), built offline by
``tools/build_tiny_vlm.py``
and loaded by mlx-vlm's own code; clients are the official SDKs.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from mlxtrio.chat.conversation import Conversation, Message
from mlxtrio.chat.images import ImageInput, ImageLimits, check, image_marker
from mlxtrio.chat.prompt import render_sync
from mlxtrio.engine.handle import EngineError
from mlxtrio.engine.image_tokens import KEY_BASE, VisionPrompt, key_tokens
from mlxtrio.engine.types import SamplingParams

from .conftest import Server, ServerFactory, wait_until

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlx_vlm") is None, reason="needs the vision extra (mlx-vlm)"
)

ROOT = Path(__file__).resolve().parent.parent
RUN = 64  # image tokens of a 224 x 224 picture on the tiny Qwen models (max_pixels)
# The fewest tokens an image adds to a prompt: Gemma 3's fixed 4 (+ markers);
# mllama keeps its one image token (the features reach it by cross-attention).
IMAGE_TOKENS = {"qwen2_5_vl": RUN, "qwen3_vl": RUN, "gemma3": 4, "mllama": 1}


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.spec_from_file_location(
        "build_tiny_vlm", ROOT / "tools/build_tiny_vlm.py"
    )
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    out = tmp_path_factory.mktemp("vlms")
    builder.build_qwen2_5_vl(out / "qwen2_5_vl", "float32", 0)
    builder.build_gemma3(out / "gemma3", "float32", 1)
    builder.build_qwen3_vl(out / "qwen3_vl", "float32", 2)
    builder.build_mllama(out / "mllama", "float32", 3)
    return out


def picture(seed: int, size: tuple[int, int] = (224, 224)) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_block(data: bytes) -> dict[str, Any]:
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


async def vlm_server(
    server_factory: ServerFactory, tiny_vlms: Path, family: str, **settings: Any
) -> Server:
    return await server_factory(model=str(tiny_vlms / family), model_name="vlm", **settings)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mlxtrio.access"]


# -- key tokens and spans (no model) ------------------------------------------------


def test_key_tokens_name_the_image_and_the_place() -> None:
    a, b = key_tokens("a" * 64, 40), key_tokens("b" * 64, 40)
    assert a == key_tokens("a" * 64, 40) and a != b
    assert all(KEY_BASE <= t < 2 * KEY_BASE for t in a + b)
    assert len(set(a)) == 40  # every place its own key


def test_model_tokens_put_the_models_ids_back() -> None:
    from mlxtrio.engine.image_tokens import ImageSpan

    keys = key_tokens("c" * 64, 3)
    span = ImageSpan(2, 5, (7, 8, 9), {}, "c" * 64)
    vision = VisionPrompt((span,))
    prompt = [1, 2, *keys, 3]
    assert vision.model_tokens(prompt) == [1, 2, 7, 8, 9, 3]
    assert vision.model_tokens(prompt, 3, 5) == [8, 9]
    assert vision.inside(3) is span and vision.inside(2) is None and vision.inside(5) is None


# -- every API, streaming and not -----------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "mllama"])
async def test_every_api_shows_the_model_the_image(
    server_factory: ServerFactory, tiny_vlms: Path, family: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlxtrio.access")
    server = await vlm_server(server_factory, tiny_vlms, family)
    assert server.engine.loaded is not None and server.engine.loaded.images is not None
    claude, openai = server.anthropic(), server.openai()

    def content(data: bytes) -> list[dict[str, Any]]:
        return [image_block(data), {"type": "text", "text": "What is in it?"}]

    answers = []
    for seed in (1, 2):
        message = await claude.messages.create(
            model="vlm",
            max_tokens=12,
            messages=[{"role": "user", "content": content(picture(seed))}],
        )
        counted = await claude.messages.count_tokens(
            model="vlm", messages=[{"role": "user", "content": content(picture(seed))}]
        )
        usage = message.usage
        assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
        answers.append(message.content[0].text)  # type: ignore[union-attr]
    assert answers[0] != answers[1], "the output does not depend on the image"
    text_only = await claude.messages.count_tokens(
        model="vlm", messages=[{"role": "user", "content": "What is in it?"}]
    )
    # The image's run is counted (see IMAGE_TOKENS).
    assert counted.input_tokens - text_only.input_tokens >= IMAGE_TOKENS[family]

    async with claude.messages.stream(
        model="vlm", max_tokens=12, messages=[{"role": "user", "content": content(picture(1))}]
    ) as stream:
        streamed = await stream.get_final_message()
    assert streamed.content[0].text == answers[0]  # type: ignore[union-attr]

    parts = [
        {"type": "text", "text": "What is in it?"},
        {"type": "image_url", "image_url": {"url": data_url(picture(1))}},
    ]
    completion = await openai.chat.completions.create(
        model="vlm",
        max_tokens=12,
        messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
    )
    chunks = await openai.chat.completions.create(
        model="vlm",
        max_tokens=12,
        messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert text == completion.choices[0].message.content

    inputs = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in it?"},
                {"type": "input_image", "image_url": data_url(picture(1)), "detail": "auto"},
            ],
        }
    ]
    response = await openai.responses.create(model="vlm", max_output_tokens=12, input=inputs)  # type: ignore[arg-type]
    counted_r = await openai.responses.input_tokens.count(model="vlm", input=inputs)  # type: ignore[arg-type]
    assert response.usage is not None and counted_r.input_tokens == response.usage.input_tokens
    events = await openai.responses.create(
        model="vlm",
        max_output_tokens=12,
        input=inputs,  # type: ignore[arg-type]
        stream=True,
    )
    ends = ("response.completed", "response.incomplete")
    finals = [e async for e in events if e.type in ends]
    assert finals and finals[0].response.output_text == response.output_text

    lines = access_lines(caplog)
    assert any("images=1 " in line for line in lines)
    assert not any("placeholder" in line for line in lines)


async def test_detail_low_costs_fewer_tokens(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    big = picture(3, (1024, 1024))

    async def count(detail: str) -> int:
        inputs = [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": data_url(big), "detail": detail}],
            }
        ]
        counted = await server.openai().responses.input_tokens.count(model="vlm", input=inputs)  # type: ignore[arg-type]
        return counted.input_tokens

    assert await count("low") <= await count("high")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "mllama"])
async def test_an_image_inside_a_claude_code_tool_result(
    server_factory: ServerFactory, tiny_vlms: Path, caplog: pytest.LogCaptureFixture, family: str
) -> None:
    caplog.set_level(logging.INFO, logger="mlxtrio.access")
    server = await vlm_server(server_factory, tiny_vlms, family)

    def conversation(result: list[dict[str, Any]]) -> list[dict[str, Any]]:
        call = {
            "type": "tool_use",
            "id": "toolu_1",
            "name": "Read",
            "input": {"file_path": "a.png"},
        }
        return [
            {"role": "user", "content": "Look at a.png"},
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}],
            },
        ]

    tools = [{"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}]
    claude = server.anthropic()
    shown = [{"type": "text", "text": "Read image"}, image_block(picture(4))]
    with_image = await claude.messages.count_tokens(
        model="vlm", tools=tools, messages=conversation(shown)
    )  # type: ignore[arg-type]
    without = await claude.messages.count_tokens(
        model="vlm",
        tools=tools,  # type: ignore[arg-type]
        messages=conversation([{"type": "text", "text": "Read image"}]),  # type: ignore[arg-type]
    )
    assert with_image.input_tokens - without.input_tokens >= IMAGE_TOKENS[family]
    answer = await claude.messages.create(
        model="vlm",
        max_tokens=8,
        tools=tools,
        messages=conversation(shown),  # type: ignore[arg-type]
    )
    assert answer.usage.input_tokens == with_image.input_tokens
    assert any("images=1 " in line for line in access_lines(caplog))


# -- the prefix cache knows the pixels ----------------------------------------------


async def test_the_same_image_is_reused_and_a_changed_one_is_not(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    claude = server.anthropic()

    def turns(first: bytes, reply: str | None) -> list[dict[str, Any]]:
        opening = {
            "role": "user",
            "content": [{"type": "text", "text": "Hi. Look:"}, image_block(first)],
        }
        if reply is None:
            return [opening]
        return [
            opening,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And now?"},
        ]

    first = await claude.messages.create(
        model="vlm", max_tokens=6, messages=turns(picture(5), None)
    )  # type: ignore[arg-type]
    reply = first.content[0].text  # type: ignore[union-attr]
    prompt1 = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    same = await claude.messages.create(
        model="vlm", max_tokens=6, messages=turns(picture(5), reply)
    )  # type: ignore[arg-type]
    changed = await claude.messages.create(
        model="vlm", max_tokens=6, messages=turns(picture(6), reply)
    )  # type: ignore[arg-type]
    same_hit = same.usage.cache_read_input_tokens or 0
    changed_hit = changed.usage.cache_read_input_tokens or 0
    assert same_hit >= prompt1 - 8, "the next turn with the same image was not reused past it"
    assert changed_hit + RUN <= same_hit, "a changed image was reused"
    # Where the images start: the changed one ends the match there exactly.
    assert changed_hit < prompt1 - RUN


async def test_a_match_never_ends_inside_an_image(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    """A cached prefix that ends inside an image's run is cut back to where
    the image starts (an image is encoded whole), and the count says so."""
    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    loaded = server.engine.loaded
    assert loaded is not None and loaded.images is not None
    image = check(ImageInput("base64", base64.b64encode(picture(7)).decode(), "x"), ImageLimits())
    conversation = Conversation(
        [Message("user", f"look {image_marker(image.input)} now")], images=[image.input]
    )
    prompt = await trio.to_thread.run_sync(
        lambda: render_sync(loaded.tokenizer, conversation, images=loaded.images, checked=[image])
    )
    assert prompt.vision is not None
    span = prompt.vision.spans[0]
    async with server.engine.submit(
        prompt.tokens, SamplingParams(max_tokens=1), vision=prompt.vision
    ) as handle:
        async for _ in handle:
            pass
    # The same keys up to the middle of the image's run, other keys after it:
    # as a prefix cut into blocks (the disk tier) matches a longer prompt.
    half = span.start + (span.end - span.start) // 2
    forged = [*prompt.tokens[:half], *(t ^ 1 for t in prompt.tokens[half : span.end])]
    forged += prompt.tokens[span.end :]
    engine = server.engine
    unaware = await engine.lookup(forged, "")
    aware = await engine.lookup(forged, "", prompt.vision)
    try:
        assert unaware is not None and unaware.length >= half
        assert aware is not None and aware.length <= span.start
    finally:
        engine.release(unaware)
        engine.release(aware)
    with pytest.raises(EngineError):
        engine.submit(prompt.tokens, SamplingParams(max_tokens=1))  # the images left out


# -- exactness: batched, alone, and as mlx-vlm generates --------------------------------


async def ask(server: Server, seed: int | None, tokens: int = 12) -> str:
    content: list[dict[str, Any]] = [{"type": "text", "text": "Say what you see."}]
    if seed is not None:
        content.append(image_block(picture(seed, (112 + 28 * seed, 168))))
    message = await server.anthropic().messages.create(
        model="vlm",
        max_tokens=tokens,
        messages=[{"role": "user", "content": content}],  # type: ignore[typeddict-item]
    )
    return message.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
async def test_greedy_output_is_the_same_batched_and_alone(
    server_factory: ServerFactory, tiny_vlms: Path, family: str
) -> None:
    server = await vlm_server(server_factory, tiny_vlms, family)
    seeds = [1, None, 2, 3]
    alone = [await ask(server, seed) for seed in seeds]
    # A fresh server: nothing cached, every row prefills in one batch.
    server = await vlm_server(server_factory, tiny_vlms, family)
    together: dict[int, str] = {}

    async def one(i: int) -> None:
        together[i] = await ask(server, seeds[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(seeds)):
            nursery.start_soon(one, i)
    assert [together[i] for i in range(len(seeds))] == alone
    assert server.engine.stats.max_batch_size >= 2


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
async def test_speculation_on_a_vision_model_changes_no_token(
    server_factory: ServerFactory, tiny_vlms: Path, family: str
) -> None:
    """Rows with pictures of different sizes (M-RoPE positions of their own,
    ragged rows), drafting and rolled back each on its own: the same greedy
    tokens as without drafts."""
    seeds = [1, None, 2, 3]

    async def answers(speculation: str) -> tuple[list[str], Any]:
        server = await vlm_server(
            server_factory, tiny_vlms, family, speculation=speculation, prefix_cache_bytes=0
        )
        texts: dict[int, str] = {}

        async def one(i: int) -> None:
            texts[i] = await ask(server, seeds[i], tokens=48)

        async with trio.open_nursery() as nursery:
            for i in range(len(seeds)):
                nursery.start_soon(one, i)
        return [texts[i] for i in range(len(seeds))], server.engine.stats

    drafted, stats = await answers("on")
    assert stats.speculation == "on" and stats.draft_tokens > 0
    assert stats.max_batch_size >= 2  # rows of different M-RoPE deltas side by side
    assert stats.accepted_tokens > 0  # random weights repeat themselves
    plain, _ = await answers("off")
    assert drafted == plain


async def test_a_vision_model_with_sliding_windows_does_not_draft(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    server = await vlm_server(server_factory, tiny_vlms, "gemma3", speculation="on")
    assert server.engine.stats.speculation.startswith("off: ")
    async with server.client() as client:
        health = (await client.get("/health")).json()
    assert "cannot roll back" in health["models"][0]["speculation"]["reason"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
async def test_the_engine_generates_what_mlx_vlm_generates(
    server_factory: ServerFactory, tiny_vlms: Path, family: str
) -> None:
    server = await vlm_server(server_factory, tiny_vlms, family)
    loaded = server.engine.loaded
    assert loaded is not None and loaded.images is not None
    pictures = [picture(8, (140, 90)), picture(9, (60, 200))]
    checked = [
        check(ImageInput("base64", base64.b64encode(p).decode(), f"i{i}"), ImageLimits())
        for i, p in enumerate(pictures)
    ]
    conversation = Conversation(
        [
            Message("system", "You look at pictures."),
            Message(
                "user",
                f"first {image_marker(checked[0].input)} then {image_marker(checked[1].input)}",
            ),
        ],
        images=[c.input for c in checked],
    )
    prompt = await trio.to_thread.run_sync(
        lambda: render_sync(loaded.tokenizer, conversation, images=loaded.images, checked=checked)
    )
    assert prompt.vision is not None and len(prompt.vision.spans) == 2
    ours = []
    async with server.engine.submit(
        prompt.tokens, SamplingParams(max_tokens=10), vision=prompt.vision
    ) as handle:
        async for event in handle:
            ours.extend(event.token_ids)
    path = str(tiny_vlms / family)
    theirs = await trio.to_thread.run_sync(mlx_vlm_greedy, path, prompt.vision, prompt.tokens, 10)
    assert ours == theirs


def mlx_vlm_greedy(path: str, vision: VisionPrompt, prompt: list[int], count: int) -> list[int]:
    """mlx-vlm's own generation (its generate_step, its loader) on the same
    tokens and pixels: the reference."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load

    model, _ = load(path)
    arrays = [s.arrays for s in vision.spans]
    if "aspect_ratio_ids" in arrays[0]:
        return mllama_greedy(model, vision, prompt, count)
    pixels = mx.array(np.concatenate([a["pixel_values"] for a in arrays]))
    extra = {}
    if "image_grid_thw" in arrays[0]:
        extra["image_grid_thw"] = mx.array(np.concatenate([a["image_grid_thw"] for a in arrays]))
    ids = mx.array(vision.model_tokens(prompt))[None]
    mask = mx.ones(ids.shape, dtype=mx.int32)
    steps = generate_step(ids, model, pixels, mask, max_tokens=count, temperature=0.0, **extra)
    return [int(token) for token, _ in steps]


def mllama_greedy(model: Any, vision: VisionPrompt, prompt: list[int], count: int) -> list[int]:
    """mllama's greedy output as transformers defines it, computed by mlx-vlm's
    model without a cache: the whole sequence each step, on inputs as
    MllamaProcessor makes them (transformers' own mask functions), a
    generated token's cross-attention mask row repeating the prompt's last
    (transformers' generation does that; mlx-vlm's generate_step drops the
    mask after the prompt, so there a generated token sees every image)."""
    import mlx.core as mx
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    arrays = [s.arrays for s in vision.spans]

    def joined(name: str) -> Any:
        return mx.array(np.concatenate([a[name] for a in arrays], axis=1))

    ids = vision.model_tokens(prompt)
    tiles = [[int(np.asarray(a["num_tiles"]).reshape(-1)[0]) for a in arrays]]
    spans = get_cross_attention_token_mask(ids, model.config.image_token_index)
    dense = mx.array(
        convert_sparse_cross_attention_mask_to_dense(
            [spans], tiles, model.config.vision_config.max_num_tiles, len(ids)
        )
    )
    out: list[int] = []
    for _ in range(count):
        rows = mx.concatenate([dense, mx.repeat(dense[:, -1:], len(out), axis=1)], axis=1)
        logits = model(
            mx.array([ids + out]),
            joined("pixel_values"),
            aspect_ratio_ids=joined("aspect_ratio_ids"),
            aspect_ratio_mask=joined("aspect_ratio_mask"),
            cross_attention_mask=rows,
        ).logits
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def mllama_text_greedy(path: str, prompt: list[int], count: int) -> list[int]:
    """mlx-vlm's generation of a prompt without images, its cross-attention
    layers shut (tanh(0) gates: each such layer passes its input through)."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load

    model, _ = load(path)
    for layer in model.language_model.model.layers:
        if hasattr(layer, "cross_attn_attn_gate"):
            layer.cross_attn_attn_gate = mx.zeros_like(layer.cross_attn_attn_gate)
            layer.cross_attn_mlp_gate = mx.zeros_like(layer.cross_attn_mlp_gate)
    ids = mx.array(prompt)[None]
    mask = mx.ones(ids.shape, dtype=mx.int32)
    steps = generate_step(ids, model, None, mask, max_tokens=count, temperature=0.0)
    return [int(token) for token, _ in steps]


# -- the serial path: a model that reads images by cross-attention (mllama) ------------


async def vision_prompt(loaded: Any, text: str, pictures: list[bytes]) -> Any:
    """``text`` (with ``{}`` where each picture stands) as the server renders it."""
    checked = [
        check(ImageInput("base64", base64.b64encode(p).decode(), f"i{i}"), ImageLimits())
        for i, p in enumerate(pictures)
    ]
    conversation = Conversation(
        [Message("user", text.format(*(image_marker(c.input) for c in checked)))],
        images=[c.input for c in checked],
    )
    return await trio.to_thread.run_sync(
        lambda: render_sync(loaded.tokenizer, conversation, images=loaded.images, checked=checked)
    )


async def generated(
    engine: Any, prompt: Any, max_tokens: int = 10, times: list[float] | None = None
) -> list[int]:
    """Greedy tokens; ``times`` gets when each event arrived."""
    tokens = []
    async with engine.submit(
        prompt.tokens, SamplingParams(max_tokens=max_tokens), vision=prompt.vision
    ) as handle:
        async for event in handle:
            tokens.extend(event.token_ids)
            if times is not None:
                times.append(trio.current_time())
    return tokens


async def test_a_cross_attention_model_generates_what_mlx_vlm_generates_one_at_a_time(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    # A small prefill chunk: the prompt's prefill takes several engine steps.
    server = await vlm_server(server_factory, tiny_vlms, "mllama", prefill_chunk=8)
    engine, loaded = server.engine, server.engine.loaded
    assert loaded is not None and loaded.images is not None and loaded.serial
    prompts = [
        await vision_prompt(loaded, "first {} then {}", [picture(8, (140, 90)), picture(9)]),
        await vision_prompt(loaded, "what is {} about?", [picture(10, (60, 200))]),
        await vision_prompt(loaded, "no picture at all, just words", []),
    ]
    together: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}

    async def one(i: int) -> None:
        together[i] = await generated(engine, prompts[i], times=times[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
            await wait_until(lambda i=i: engine.stats.submitted > i, what="the submit")
    # One at a time, in arrival order: each starts generating once the one
    # before it has ended.
    for i in (1, 2):
        assert times[i][0] > times[i - 1][-1], i
    path = str(tiny_vlms / "mllama")
    for i in (0, 1):
        theirs = await trio.to_thread.run_sync(
            mlx_vlm_greedy, path, prompts[i].vision, prompts[i].tokens, 10
        )
        assert together[i] == theirs, i
    # Without images the cross-attention layers are skipped, as transformers
    # does: mlx-vlm's own generation with those layers' gates shut agrees.
    assert prompts[2].vision is None
    theirs = await trio.to_thread.run_sync(mllama_text_greedy, path, prompts[2].tokens, 10)
    assert together[2] == theirs
    assert engine.stats.speculation.startswith("off: not on the serial path")
    assert await engine.lookup(prompts[0].tokens) is None  # no prefix reuse for it


async def test_a_hang_up_on_the_serial_path_lets_the_next_one_run(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    server = await vlm_server(server_factory, tiny_vlms, "mllama")
    engine, loaded = server.engine, server.engine.loaded
    assert loaded is not None
    first = await vision_prompt(loaded, "tell me about {}", [picture(11)])
    second = await vision_prompt(loaded, "and {}?", [picture(12)])
    with trio.fail_after(60):
        async with engine.submit(
            first.tokens, SamplingParams(max_tokens=100_000), vision=first.vision
        ) as handle:
            async with engine.submit(
                second.tokens, SamplingParams(max_tokens=3), vision=second.vision
            ) as waiting:
                async for event in handle:
                    if event.token_ids:
                        handle.cancel()
                    if event.finish_reason:
                        break
                finals = [event async for event in waiting if event.finish_reason]
    assert event.finish_reason == "cancelled"
    assert finals[-1].finish_reason == "length"
    while engine.active_sequences:
        await trio.sleep(0.01)


# -- hang-ups and bad images -----------------------------------------------------------


async def test_a_hang_up_during_image_encoding_idles_the_engine(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    # Steps of a few milliseconds: the tiny model's 40 images take many.
    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl", prefill_step_seconds=0.002)
    loaded = server.engine.loaded
    assert loaded is not None
    checked = [
        check(
            ImageInput("base64", base64.b64encode(picture(20 + i)).decode(), f"i{i}"), ImageLimits()
        )
        for i in range(40)
    ]
    conversation = Conversation(
        [Message("user", " ".join(image_marker(c.input) for c in checked))],
        images=[c.input for c in checked],
    )
    prompt = await trio.to_thread.run_sync(
        lambda: render_sync(loaded.tokenizer, conversation, images=loaded.images, checked=checked)
    )
    assert prompt.vision is not None
    engine = server.engine
    events = []
    with trio.fail_after(60):
        async with engine.submit(
            prompt.tokens, SamplingParams(max_tokens=4), vision=prompt.vision
        ) as handle:
            while handle.prefilled == 0:
                await trio.sleep(0.001)
            handle.cancel()
            async for event in handle:
                events.append(event)
    assert events[-1].finish_reason == "cancelled"
    assert handle.prefilled < prompt.vision.end, "the encode ran to the end"
    assert not events[-1].token_ids
    while engine.active_sequences:
        await trio.sleep(0.01)
    assert not engine.active_sequences
    # The engine serves on: the same prompt again runs to its end.
    async with engine.submit(
        prompt.tokens, SamplingParams(max_tokens=2), vision=prompt.vision
    ) as again:
        finals = [event async for event in again if event.finish_reason]
    assert finals[-1].finish_reason == "length"


async def test_a_bad_image_to_a_vlm_is_a_400(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    import anthropic

    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    before = server.engine.stats.submitted
    with pytest.raises(anthropic.BadRequestError) as caught:
        await server.anthropic().messages.create(
            model="vlm",
            max_tokens=4,
            messages=[{"role": "user", "content": [image_block(b"\x89PNG not really")]}],
        )
    assert caught.value.body["error"]["message"].startswith("messages.0.content.0: ")
    assert server.engine.stats.submitted == before


async def test_codex_is_told_the_model_takes_images(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    async with server.client() as http:
        body = (await http.get("/v1/models", params={"client_version": "0.171.0"})).json()
    [info] = body["models"]
    assert info["input_modalities"] == ["text", "image"]


async def test_image_blocks_survive_a_restart_and_a_changed_image_misses(
    tiny_vlms: Path, tmp_path: Path
) -> None:
    """On disk the KV is cut into 256-token blocks: after a restart a match
    ends at a block edge, which here falls inside an image; it is cut back
    to where that image starts, and a changed image before it misses."""
    from mlxtrio.engine.types import BLOCK_TOKENS

    from .conftest import start_server

    settings = {
        "model": str(tiny_vlms / "qwen2_5_vl"),
        "model_name": "vlm",
        "data_dir": str(tmp_path),
    }

    def content(seeds: list[int]) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": "Compare these:"}]
        return blocks + [image_block(picture(s)) for s in seeds]

    answers: list[str] = []

    async def ask_cached(server: Server, seeds: list[int]) -> tuple[int, int]:
        message = await server.anthropic().messages.create(
            model="vlm",
            max_tokens=6,
            messages=[{"role": "user", "content": content(seeds)}],  # type: ignore[typeddict-item]
        )
        answers.append(message.content[0].text)  # type: ignore[union-attr]
        cached = message.usage.cache_read_input_tokens or 0
        return message.usage.input_tokens + cached, cached

    seeds = [30, 31, 32, 33, 34]
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        total, cached = await ask_cached(server, seeds)
        assert cached == 0 and total > BLOCK_TOKENS
        disk = server.engine.cache.index.disk
        assert disk is not None
        with trio.fail_after(30):
            while len(disk) < total // BLOCK_TOKENS:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        _, changed = await ask_cached(server, [99, *seeds[1:]])
        _, same = await ask_cached(server, seeds)
        nursery.cancel_scope.cancel()
    # Blocks hold the first 256 tokens; the 4th image (64 tokens each, after
    # a few of text) straddles the edge, so the match ends where it starts.
    assert changed < RUN
    assert 3 * RUN < same < BLOCK_TOKENS
    assert answers[2] == answers[0], (
        f"the KV read back from disk is not the KV computed cold: {answers}"
    )


# -- each image where it stands --------------------------------------------------------


async def render_vlm(server: Server, conversation: Conversation) -> Any:
    loaded = server.engine.loaded
    assert loaded is not None and loaded.images is not None
    limits = ImageLimits()
    checked = [check(image, limits) for image in conversation.images]
    return await trio.to_thread.run_sync(
        lambda: render_sync(loaded.tokenizer, conversation, images=loaded.images, checked=checked)
    )


async def test_each_image_takes_its_own_place(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    """Claude Code sends an image beside a tool result whose content holds
    another: the tool message is rendered first, so the images stand in the
    prompt in another order than the request lists them."""
    import hashlib

    from mlxtrio.api.messages.convert import to_conversation
    from mlxtrio.api.messages.requests import MessagesRequest

    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    beside, inside = picture(40), picture(41)
    request = MessagesRequest.model_validate(
        {
            "model": "vlm",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "Look at a.png"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        image_block(beside),
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [image_block(inside)],
                        },
                    ],
                },
            ],
        }
    )
    conversation = to_conversation(request)
    assert [m.role for m in conversation.messages][-2:] == ["tool", "user"]
    prompt = await render_vlm(server, conversation)
    digests = [span.digest for span in prompt.vision.spans]
    assert digests == [hashlib.sha256(inside).hexdigest(), hashlib.sha256(beside).hexdigest()]


async def test_an_earlier_turns_image_that_is_not_sent_again_is_a_placeholder(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    """A Responses chain rebuilt from the store holds its images' markers but
    not their pixels: those stay placeholders, the new image takes its place."""
    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    stored = ImageInput("base64", base64.b64encode(picture(42)).decode(), "input.0")
    new = ImageInput("base64", base64.b64encode(picture(43)).decode(), "input.1")
    conversation = Conversation(
        [
            Message("user", f"before {image_marker(stored)}"),
            Message("assistant", "ok"),
            Message("user", f"now {image_marker(new)}"),
        ],
        images=[new],
    )
    prompt = await render_vlm(server, conversation)
    assert prompt.vision is not None and len(prompt.vision.spans) == 1
    loaded = server.engine.loaded
    assert loaded is not None
    text = loaded.tokenizer.decode(prompt.vision.model_tokens(prompt.tokens))
    assert "[image omitted" in text and text.index("[image omitted") < text.index("now")


async def test_text_that_spells_the_image_markup_is_refused(
    server_factory: ServerFactory, tiny_vlms: Path
) -> None:
    import anthropic

    server = await vlm_server(server_factory, tiny_vlms, "qwen2_5_vl")
    markup = "<|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(anthropic.BadRequestError) as caught:
        await server.anthropic().messages.create(
            model="vlm",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": markup}, image_block(picture(44))],
                }
            ],
        )
    assert "image markup" in caught.value.body["error"]["message"]


async def test_a_hybrid_checkpoint_with_a_vision_config_still_serves_text(
    server_factory: ServerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen3.5 checkpoints carry a vision config; their recurrent layers'
    state is not a cache the text batch takes from mlx-vlm, so mlx-lm serves
    the language model, exactly as without the vision config."""
    import json
    import shutil

    from .scripted_hybrid import build_hybrid

    plain = build_hybrid(tmp_path / "plain", "ssm")
    seeing = tmp_path / "seeing"
    shutil.copytree(plain, seeing)
    config = json.loads((seeing / "config.json").read_text())
    vision = {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32, "out_hidden_size": 64}
    (seeing / "config.json").write_text(json.dumps({**config, "vision_config": vision}))
    caplog.set_level(logging.INFO, "mlxtrio")
    answers = []
    for path in (plain, seeing):
        server = await server_factory(model=str(path), model_name="hybrid")
        message = await server.anthropic().messages.create(
            model="hybrid",
            max_tokens=8,
            messages=[{"role": "user", "content": "What is the rule?"}],
        )
        answers.append(message.content[0].text)  # type: ignore[union-attr]
    assert answers[0] == answers[1]
    assert any("served as text only" in r.getMessage() for r in caplog.records)


def test_recurrent_layers_are_not_taken_into_the_vision_batch() -> None:
    """mlx-vlm's Qwen3.5 keeps its Gated DeltaNet state in ArraysCache: the
    vision path refuses it before any weight is read (mlx-lm then serves the
    model as text, see above)."""
    import json

    from mlx_vlm.utils import get_model_and_args, update_module_configs

    from mlxtrio.engine.vision import VisionTextModel

    from .scripted_hybrid import _ssm_config

    text = _ssm_config(4160)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 3, 3]}
    vision = {"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2}
    raw = {"model_type": "qwen3_5", "text_config": text, "vision_config": vision}
    arch, _ = get_model_and_args(raw)
    config = update_module_configs(
        arch.ModelConfig.from_dict(json.loads(json.dumps(raw))), arch, raw, ["text", "vision"]
    )
    with pytest.raises(ValueError, match="ArraysCache"):
        VisionTextModel(arch.Model(config), None).make_cache()


async def test_the_model_reads_a_picture_with_a_tool_and_sees_it(
    server_factory: ServerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent loop Claude Code runs: the model calls Read, the client
    answers with the picture inside the tool result, the model goes on."""
    from .scripted_vision import SEEN, build_scripted_vlm

    caplog.set_level(logging.INFO, logger="mlxtrio.access")
    model = build_scripted_vlm(tmp_path / "scripted-vlm", "/work/shot.png")
    server = await server_factory(model=str(model), model_name="vlm")
    tools = [
        {
            "name": "Read",
            "description": "Read a file",
            "input_schema": {
                "type": "object",
                "properties": {"file_path": {"type": "string"}},
                "required": ["file_path"],
            },
        }
    ]
    claude = server.anthropic()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in /work/shot.png?"}]
    first = await claude.messages.create(model="vlm", max_tokens=64, tools=tools, messages=messages)  # type: ignore[arg-type]
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "Read" and call.input == {"file_path": "/work/shot.png"}
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [image_block(picture(50))],
                }
            ],
        },
    ]
    second = await claude.messages.create(
        model="vlm", max_tokens=64, tools=tools, messages=messages
    )  # type: ignore[arg-type]
    assert second.content[0].text == "".join(SEEN)  # type: ignore[union-attr]
    assert second.stop_reason == "end_turn"
    await wait_until(lambda: len(access_lines(caplog)) >= 2, what="both access lines")
    lines = access_lines(caplog)
    assert "images" not in lines[0] and "images=1 " in lines[1], lines


def test_an_encoder_decoder_vlm_says_why_it_is_not_served(tmp_path: Path) -> None:
    from mlxtrio.engine.model import read_checkpoint

    config = {"model_type": "florence2", "vision_config": {"model_type": "davit"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="encoder-decoder with task prompts"):
        read_checkpoint(str(tmp_path))
