"""Issue 41 item 1: chats with images on a CUDA machine (run by hand on the lent GPU).

For each tiny vision-language model of `hsx make-tiny-model` (Kimi-K2.5: MoonViT + MLA MoE,
4 layers, 16 heads as vLLM's Hopper MLA kernels take them; Qwen2.5-VL: windowed ViT + M-RoPE),
made and served in bf16 with torch.compile and CUDA graphs (vLLM's defaults):

  * chats with one and several images, from the real-photo fixture (tests/_image_chats.py:
    a photograph, an MRI slice, a drawing, written to --fixture by `session.sh prepare`) and
    synthetic PNG / JPEG of other sizes, an image in a later user turn, a photo named by path
    under --allowed-media-dir; all in flight at once (each twice), every layer id against
    transformers in fp32 fed the image processor vLLM used (tol 3e-2, docs/compatibility.md);
    the media mask is the image tokens and never supervised; another image's reference is
    far off (the states carry the image);
  * the same photo through /v1/chat/completions (the prompt's image tokens as /hidden_states');
  * hostile images (a 400 M-pixel PNG, an SVG, a truncated PNG) refused fast with 413 / 400
    while a text chat is answered, then an image chat served again; back to idle.

    python tests/gpu/check_images.py --fixture DIR [--family kimi_k25 --family qwen2_5_vl] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import _images as img  # noqa: E402
import check_cuda as cc  # noqa: E402
from _reference import load, per_layer_rel_err  # noqa: E402

from hsx.wire import decode  # noqa: E402

NUM_LAYERS = 4
FAMILIES = {  # family: (make_tiny_model kwargs, first layer id)
    "kimi_k25": ({"num_layers": NUM_LAYERS, "num_heads": 16}, 1),
    "qwen2_5_vl": ({"num_layers": NUM_LAYERS}, 0),
}
PHOTOS = {"hopper.jpg": "image/jpeg", "gift.png": "image/png", "mri.png": "image/png"}


def uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chats(fixture: Path) -> dict[str, tuple[list[dict], list[bytes]]]:
    """name: (messages, the images' bytes in the order they appear)."""
    b = {n: (fixture / n).read_bytes() for n in PHOTOS}
    part = img.image_part
    png, jpeg = img.png(100, 80, (200, 30, 40)), img.jpeg(200, 150)
    system = {"role": "system", "content": "You answer questions about pictures."}
    return {
        "one photograph": (
            [system, {"role": "user", "content": [part(uri(b["hopper.jpg"], "image/jpeg")),
                                                  {"type": "text", "text": "Who or what is in this photograph?"}]},
             {"role": "assistant", "content": "An elderly woman in a dark naval uniform and cap, wearing glasses."}],
            [b["hopper.jpg"]]),
        "three real images": (
            [{"role": "user", "content": [part(uri(b["gift.png"], "image/png")), part(uri(b["mri.png"], "image/png")),
                                          part(uri(b["hopper.jpg"], "image/jpeg")),
                                          {"type": "text", "text": "What do these three pictures show?"}]},
             {"role": "assistant", "content": "A blue gift box, a sagittal MRI slice of a head, and a naval officer."}],
            [b["gift.png"], b["mri.png"], b["hopper.jpg"]]),
        "an image in the second user turn": (
            [{"role": "user", "content": "I will show you a picture."},
             {"role": "assistant", "content": "Please do."},
             {"role": "user", "content": [{"type": "text", "text": "Describe the object."},
                                          part(uri(b["gift.png"], "image/png"))]},
             {"role": "assistant", "content": "A blue gift box tied with a silver ribbon and bow."}],
            [b["gift.png"]]),
        "two turns, two images": (
            [system, {"role": "user", "content": [part(uri(b["mri.png"], "image/png")),
                                                  {"type": "text", "text": "What kind of image is this?"}]},
             {"role": "assistant", "content": "A grayscale MRI scan of a head."},
             {"role": "user", "content": [part(uri(b["hopper.jpg"], "image/jpeg")), {"type": "text", "text": "And this?"}]},
             {"role": "assistant", "content": "A photograph of a woman in uniform."}],
            [b["mri.png"], b["hopper.jpg"]]),
        "synthetic PNG and JPEG": (
            [{"role": "user", "content": [part(uri(png, "image/png")), part(uri(jpeg, "image/jpeg")),
                                          {"type": "text", "text": "What is in them?"}]},
             {"role": "assistant", "content": "A red rectangle and a gradient."}],
            [png, jpeg]),
        "a photograph by path (--allowed-media-dir)": (
            [{"role": "user", "content": [part(str(fixture / "hopper.jpg")), {"type": "text", "text": "Who is this?"}]},
             {"role": "assistant", "content": "A naval officer."}],
            [b["hopper.jpg"]]),
    }


# ------------------------------------------------------------------ references (transformers, fp32)
def vllm_kimi_processor(model_dir: Path):
    """The image processor vLLM 0.33 picks for Kimi-K2.5: its fused one where numba imports,
    else the Hugging Face one read from the directory ("remote HF")."""
    try:
        import numba  # noqa: F401

        from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

        cfg = json.loads((model_dir / "preprocessor_config.json").read_text())["media_proc_cfg"]
        proc = KimiK25FusedVisionProcessor(cfg)
        return "fused (numba)", lambda pil: proc.preprocess([{"type": "image", "image": p} for p in pil],
                                                            return_tensors="pt")
    except Exception as e:  # noqa: BLE001
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(model_dir)
        return f"Hugging Face ({type(e).__name__}: {e})", lambda pil: proc(pil, return_tensors="pt")


@torch.no_grad()
def reference(family: str, model_dir: Path, ids: list[int], media: torch.Tensor, images: list[bytes],
              layers: list[int]) -> torch.Tensor:
    from PIL import Image

    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    model = load(str(model_dir))
    captured = {}
    handle = model.model.language_model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("pre", i[0]))
    try:
        if family == "kimi_k25":
            mm = vllm_kimi_processor(model_dir)[1](pil)
            grid = mm["grid_thws"] if "grid_thws" in mm else mm["image_grid_thw"]
            out = model(torch.as_tensor([ids]), pixel_values=mm["pixel_values"].float(), image_grid_thw=grid,
                        output_hidden_states=True)
        else:
            from transformers import AutoImageProcessor

            mm = AutoImageProcessor.from_pretrained(model_dir)(pil, return_tensors="pt")
            out = model(torch.as_tensor([ids]), pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
                        mm_token_type_ids=media[None].int(), output_hidden_states=True)
    finally:
        handle.remove()
    return torch.stack([captured["pre"][0] if k == NUM_LAYERS else out.hidden_states[k][0] for k in layers], dim=1)


# ------------------------------------------------------------------ checks
async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=600, headers={"Accept-Encoding": "zstd"}) as c:
        return await asyncio.gather(*[c.post(url + "/hidden_states", json=b) for b in bodies])


def image_chat_checks(family: str, model_dir: Path, srv, fixture: Path, layers: list[int]) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    pad = cfg["image_token_id"]
    cases = chats(fixture)
    names = [n for n in cases for _ in range(2)]  # each chat twice, all in flight at once
    t0 = time.time()
    rs = asyncio.run(post_all(srv.url, [{"messages": cases[n][0]} for n in names]))
    print(f"  {len(names)} image chats in {time.time() - t0:.1f}s", flush=True)
    worst, rows, bad = 0.0, [], []
    for n, r in zip(names, rs):
        if r.status_code != 200:
            bad.append(f"{n}: {r.status_code} {r.text[:300]}")
            continue
        d = decode(r.content)
        ids, media = d.token_ids.tolist(), torch.as_tensor(d.media_mask)
        loss = torch.as_tensor(d.loss_mask)
        n_img = int(media.sum())
        if ([i for i, m in zip(ids, media.tolist()) if m] != [pad] * n_img or ids.count(pad) != n_img
                or n_img < 4 * len(cases[n][1]) or bool((media.bool() & loss.bool()).any()) or int(loss.sum()) == 0):
            bad.append(f"{n}: media mask / loss mask wrong ({n_img} image tokens)")
            continue
        ref = reference(family, model_dir, ids, media, cases[n][1], layers)
        errs = per_layer_rel_err(d.hidden_states.cpu(), ref)
        worst = max(worst, max(errs))
        rows.append((n, len(ids), n_img, max(errs)))
    for n, t, m, e in rows[::2]:
        print(f"    {n}: {t} tokens, {m} image tokens, worst rel err {e:.2e}", flush=True)
    for b in bad:
        print("   ", b, flush=True)
    ok = not bad and len(rows) == len(names) and worst < cc.BF16_TOL
    cc.verdict(f"{family} {srv_dtype(srv)}: {len(names)} image chats in flight (1-3 images, real photos, a later turn, a path), "
               f"every layer {layers[0]}..{layers[-1]}", ok,
               f"worst per-layer rel err {worst:.2e} (tol {cc.BF16_TOL:g}); {len(bad)} bad; "
               + "; ".join(f"{n}: {t} tok / {m} img, {e:.1e}" for n, t, m, e in rows[::2]),
               worst_rel_err=worst, tol=cc.BF16_TOL)
    # The image is in the states: another image's reference is far off from the first image token on.
    if rows:
        msgs, images = cases["one photograph"]
        d = decode(rs[names.index("one photograph")].content)
        media = torch.as_tensor(d.media_mask)
        other = reference(family, model_dir, d.token_ids.tolist(), media,
                          [img.png(*Image_size(images[0]), (5, 5, 250))], layers)
        first = int(media.nonzero()[0])
        off = max(per_layer_rel_err(d.hidden_states.cpu()[first:], other[first:]))
        cc.verdict(f"{family}: another image's reference is far off", off > 3 * cc.BF16_TOL,
                   f"rel err {off:.2e} from the first image token on (vs {worst:.2e} for the right image)",
                   other_image_rel_err=off)
    # /v1/chat/completions with the photograph: the prompt's image tokens are /hidden_states'.
    msgs = cases["one photograph"][0][:2]
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                   json={"messages": msgs, "max_tokens": 4, "temperature": 0})
    if r.status_code == 200:
        out = r.json()
        n_img = out["prompt_token_ids"].count(pad)
        want = int(decode(rs[names.index("one photograph")].content).media_mask.sum())
        cc.verdict(f"{family}: /v1/chat/completions with the photograph",
                   bool(n_img == want and out["choices"][0]["token_ids"]),
                   f"{len(out['prompt_token_ids'])} prompt ids, {n_img} image tokens (/hidden_states: {want}), "
                   f"generated {out['choices'][0]['token_ids']}")
    else:
        cc.verdict(f"{family}: /v1/chat/completions with the photograph", False, f"{r.status_code} {r.text[:300]}")


def srv_dtype(srv) -> str:
    return httpx.get(srv.url + "/info", timeout=10).json().get("dtype", "?")


def Image_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(data)).size


async def hostile(url: str) -> tuple[list[tuple[str, int, int, str, float]], httpx.Response, float]:
    cases = {
        "a 400 M-pixel PNG": (img.data_uri(img.png_bomb()), 413, "--max-image-pixels"),
        "an SVG": (img.data_uri(img.SVG, "image/svg+xml"), 400, "SVG images are not accepted"),
        "a truncated PNG": (img.data_uri(img.png(64, 64)[:-40]), 400, "truncated or corrupt"),
    }
    text = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."}]

    def chat(u: str) -> list[dict]:
        return [{"role": "user", "content": [img.image_part(u), {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "A picture."}]

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        t0 = time.perf_counter()
        bad, good = await asyncio.gather(asyncio.gather(*(c.post("/hidden_states", json={"messages": chat(u)})
                                                          for u, _, _ in cases.values())),
                                         c.post("/hidden_states", json={"messages": text}))
        took = time.perf_counter() - t0
    out = []
    for (name, (_, status, words)), r in zip(cases.items(), bad):
        try:
            msg = r.json()["error"]["message"]
        except Exception:  # noqa: BLE001
            msg = r.text[:200]
        out.append((name, status, r.status_code, msg if words in msg else f"[{words!r} missing] {msg}",
                    r.elapsed.total_seconds()))
    return out, good, took


def hostile_checks(family: str, srv, fixture: Path) -> None:
    got, good, took = asyncio.run(hostile(srv.url))
    ok = good.status_code == 200 and all(want == status and not msg.startswith("[") and s < 2.0
                                         for _, want, status, msg, s in got)
    cc.verdict(f"{family}: hostile images refused while a text chat is answered", ok,
               f"text chat {good.status_code}; " + "; ".join(f"{n}: {status} in {s:.2f}s ({msg[:90]})"
                                                             for n, _, status, msg, s in got)
               + f"; all answered in {took:.2f}s")
    r = asyncio.run(post_all(srv.url, [{"messages": chats(fixture)["one photograph"][0]}]))[0]
    cc.verdict(f"{family}: an image chat after the hostile ones", r.status_code == 200, f"{r.status_code}")


def family_checks(a, family: str, work: Path) -> None:
    from hsx_tools.tiny_model import make_tiny_model

    kw, first = FAMILIES[family]
    model_dir = make_tiny_model(work / f"tiny-{family}", family, dtype=a.dtype, **kw)
    layers = list(range(first, NUM_LAYERS + 1))
    if family == "kimi_k25":
        print(f"  reference image processor for Kimi-K2.5: {vllm_kimi_processor(model_dir)[0]}", flush=True)
    srv = cc.server(str(model_dir), "--dtype", a.dtype, "--layers", ",".join(map(str, layers)),
                    "--max-model-len", "2048", "--max-num-batched-tokens", "1024", "--max-images-per-request", "4",
                    "--allowed-media-dir", str(a.fixture), "--max-image-pixels", "4000000", *a.serve_arg, a=a, log_dir=work,
                    name=f"tiny-{family}", mem=0.3)
    try:
        used = [line for line in srv.log_path.read_text(errors="replace").splitlines()
                if "image preprocessing" in line or "MMEncoderAttention" in line or "attention backend" in line.lower()]
        for line in used[:6]:
            print("   log:", line[-200:], flush=True)
        image_chat_checks(family, model_dir, srv, a.fixture, layers)
        hostile_checks(family, srv, a.fixture)
        cc.check_idle(srv, f"tiny-{family}")
    finally:
        cc.stop(srv)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fixture", type=Path, required=True, help="a directory holding hopper.jpg, gift.png, mri.png")
    p.add_argument("--family", action="append", choices=list(FAMILIES), help="default: both")
    p.add_argument("--expect-runner", default="any", choices=["any", "v1", "v2"])
    p.add_argument("--serve-arg", action="append", default=[], help="an hsx serve flag, e.g. --serve-arg=--enforce-eager")
    p.add_argument("--dtype", default="bfloat16", help="model and serving dtype (float32 for a CPU dry run)")
    p.add_argument("--json")
    a = p.parse_args()
    a.tensor_parallel_size = 1
    a.fixture = a.fixture.resolve()
    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    print(f"torch {env['torch']}, cuda {env['cuda']} {env['gpu'] or ''}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-gpu-images-"))
    t0 = time.time()
    for family in a.family or list(FAMILIES):
        try:
            family_checks(a, family, work)
        except Exception as exc:  # a server that never came up: a failure, the next family still runs
            cc.verdict(f"{family}: run", False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:2000]}")
    print("ALL PASS" if not cc.failures else f"FAILED: {cc.failures}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"env": env, "argv": sys.argv[1:], "seconds": round(time.time() - t0),
                                            "date": time.strftime("%Y-%m-%d"), "results": cc.results}, indent=1))
    return 1 if cc.failures else 0


if __name__ == "__main__":
    sys.exit(main())
