"""Issue 38, video: a chat with a video through a real `hsx serve` on the tiny Qwen2.5-VL in
fp32 (`make-tiny-model --family qwen2_5_vl`), whose vLLM model takes video. The video is a
short MP4 written in the test (OpenCV 'mp4v') from matplotlib's sample photograph, sent as
a data: URI `video_url` part; every layer id (0 included) is checked against transformers'
Qwen2.5-VL fed the same video processor outputs (the processor read from the model
directory, the frames and metadata vLLM's own opencv loader gives) and the same M-RoPE
positions (transformers' `get_rope_index` with the video's `second_per_grid_ts`, the text
after the video placed one past the video's largest position as vLLM places it, where
transformers 5.19 differs: see `_reference`). /tokenize gives the same ids and media mask; a text chat is served;
a truncated video is refused fast, naming its part."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

import _videos as vid
from _reference import per_layer_rel_err
from conftest import QWEN_VL_LAYERS as LAYERS, QWEN_VL_NUM_LAYERS as NUM_LAYERS

pytestmark = pytest.mark.slow
pytest.importorskip("cv2")  # the test writes its videos with OpenCV

TOL = 1e-4  # fp32 on both sides


def _chat(video: bytes) -> list[dict]:
    return [{"role": "system", "content": "You describe videos."},
            {"role": "user", "content": [vid.video_part(vid.data_uri(video)),
                                         {"type": "text", "text": "What happens in it?"}]},
            {"role": "assistant", "content": "A portrait slides to the right."}]


@torch.no_grad()
def _reference(model_dir: Path, ids: list[int], media: torch.Tensor, video: bytes,
               qwen_positions: bool = True) -> torch.Tensor:
    """transformers' Qwen2.5-VL on the served ids: the processor read from the model directory
    (as vLLM reads it) fed the frames and metadata of vLLM's own opencv loader, as vLLM's
    Qwen2.5-VL processor feeds it; the 3-D (M-RoPE) positions from transformers' get_rope_index
    (mm_token_type_ids = 2 on the video tokens, the video's second_per_grid_ts). transformers
    5.19 starts the text after a video at max(h, w) past the video's start, ignoring its time
    extent (t scaled by second_per_grid_ts x tokens_per_second); vLLM's
    get_mrope_input_positions starts it one past the video's largest position, the rule of
    Qwen2.5-VL's earlier get_rope_index (recalled, not read here). `qwen_positions` shifts
    that text to vLLM's rule; False keeps transformers' positions (the test checks both)."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata
    from vllm.multimodal.video import VideoBackend

    from _reference import load

    frames, meta = VideoBackend.load_bytes(video)
    processor = AutoProcessor.from_pretrained(model_dir)
    mm = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[frames], return_tensors="pt",
                   video_metadata=[VideoMetadata(**{k: v for k, v in meta.items() if k != "do_sample_frames"})])
    model = load(str(model_dir))
    input_ids = torch.as_tensor([ids])
    positions, _ = model.model.get_rope_index(input_ids, video_grid_thw=mm["video_grid_thw"],
                                              second_per_grid_ts=mm["second_per_grid_ts"],
                                              mm_token_type_ids=2 * media[None].int())
    if qwen_positions:
        end = int(media.nonzero()[-1]) + 1  # the first token after the (one) video
        positions[:, :, end:] += positions[:, :, :end].max() + 1 - positions[0, 0, end]
    captured = {}
    handle = model.model.language_model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("pre", i[0]))
    try:
        out = model(input_ids, pixel_values_videos=mm["pixel_values_videos"], video_grid_thw=mm["video_grid_thw"],
                    position_ids=positions, output_hidden_states=True)
    finally:
        handle.remove()
    return torch.stack([captured["pre"][0] if k == NUM_LAYERS else out.hidden_states[k][0] for k in LAYERS], dim=1)


@pytest.mark.engine
def test_video_chat_states_match_transformers_at_every_layer(qwen_vl_server, qwen_vl_model):
    from safetensors.torch import load as st_load

    video = vid.mp4(112, 84, frames=4, fps=2.0)
    chat = _chat(video)
    r = httpx.post(qwen_vl_server.url + "/hidden_states", json={"messages": chat}, timeout=300,
                   headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200, r.text
    t = st_load(r.content)
    ids, media, loss = t["token_ids"].tolist(), t["media_mask"], t["loss_mask"]
    pad = json.loads((qwen_vl_model / "config.json").read_text())["video_token_id"]  # <|video_pad|>
    # 4 frames of 84x112: 2 temporal patches of 6 x 8 patches, merged 2 x 2: 24 video tokens
    assert [i for i, m in zip(ids, media.tolist()) if m] == [pad] * 24 and ids.count(pad) == 24
    assert not bool((media.bool() & loss.bool()).any()) and int(loss.sum()) > 0
    tok = httpx.post(qwen_vl_server.url + "/tokenize", json={"messages": chat}, timeout=300)
    assert tok.status_code == 200, tok.text
    assert tok.json()["token_ids"] == ids and tok.json()["media_mask"] == media.tolist()
    ref = _reference(qwen_vl_model, ids, media, video)
    errs = per_layer_rel_err(t["hidden_states"], ref)
    assert max(errs) < TOL, f"relative error per layer {dict(zip(LAYERS, errs))}"
    # With transformers' own positions: the same states through the video's last token, and only
    # the text after it (positioned differently, see _reference) differs.
    end = int(media.nonzero()[-1]) + 1
    own = _reference(qwen_vl_model, ids, media, video, qwen_positions=False)
    assert max(per_layer_rel_err(t["hidden_states"][:end], own[:end])) < TOL
    after = max(per_layer_rel_err(t["hidden_states"][end:], own[end:]))
    # The video is in the states: another video's reference is far off from the first video token on.
    other = _reference(qwen_vl_model, ids, media, vid.mp4(112, 84, frames=4, fps=2.0, shift=-20))
    first = int(media.nonzero()[0])
    off = max(per_layer_rel_err(t["hidden_states"][first:], other[first:]))
    assert off > 100 * TOL, f"another video's states are as close ({off:.2e})"
    print(f"\nvideo chat: {len(ids)} tokens, {int(media.sum())} video tokens, worst rel err {max(errs):.2e}, "
          f"another video {off:.2e}; after the video with transformers' own positions {after:.2e}")


@pytest.mark.engine
def test_text_chats_are_served_and_a_hostile_video_is_refused_fast(qwen_vl_server):
    text = httpx.post(qwen_vl_server.url + "/hidden_states", timeout=300,
                      json={"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]})
    assert text.status_code == 200, text.text
    video = vid.mp4(112, 84, frames=4)
    for data, status, words in [(video[: len(video) // 2], 400, "cannot be read"),
                                (vid.mp4(64, 48, frames=9), 413, "over --max-video-frames 8"),
                                (b"#EXTM3U\n", 400, "not a video")]:
        t = time.perf_counter()
        r = httpx.post(qwen_vl_server.url + "/hidden_states", timeout=60,
                       json={"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        vid.video_part(vid.data_uri(data))]}]})
        took = time.perf_counter() - t
        msg = r.json()["error"]["message"]
        assert r.status_code == status and msg.startswith("messages[0].content[1]: ") and words in msg, r.text
        assert took < 5, f"{words}: {took:.2f}s"
    assert httpx.get(qwen_vl_server.url + "/health", timeout=10).status_code == 200
