"""The request an image chat's row of a token table (`--states none`) was tokenized from.

Token ids cannot carry an image's pixels: a server given a row's `input_ids` embeds its image
tokens as text. So for each sample whose request has images, `hsx extract --states none`
stores beside the row's id file the body the server tokenized,

    token_ids/request_{i}.json   a JSON object: the chat `messages`, every image a `data:` URI
                                 (as extract sent it: a path read and inlined by
                                 client/corpus/images.py), and every other field that shapes
                                 the tokens (tools, chat_template, chat_template_kwargs,
                                 assistant_mask, max_length, truncation, ...)

and the online backend (hsx_client.training.speculators_backend) posts that body for the row,
checking the server's token ids against the row's. Left out of the file: the caller's `id`,
`layers` (the trainer asks for the corpus's) and `require_supervised` (the row was kept, so
it had supervised tokens). The file moves with its row (finalize's compaction, `hsx merge`).

Plain JSON, not compressed: nearly all of it is the images' base64, which zstd shrinks by a
quarter at most, and it stays readable with `jq`. A text row has no such file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REQUEST_PATH = "token_ids/request_{index}.json"
FORMAT_FACT = "image_requests"  # hsx_format.json: this table's image rows carry their requests
_NOT_TOKENIZATION = ("id", "layers", "require_supervised")


def request_path(index: int) -> str:
    return REQUEST_PATH.format(index=int(index))


def stored_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the file keeps of a request body: everything that shapes its tokens."""
    return {k: v for k, v in body.items() if k not in _NOT_TOKENIZATION}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(stored_body(body), separators=(",", ":")).encode()


def estimated_size(body: dict[str, Any]) -> int:
    """Bytes of the file `body` will make (for the disk estimate, before the run): its JSON,
    each `file://` image or video counted as the `data:` URI extract inlines (base64: 4/3 of the file)."""
    from hsx_client.corpus.images import local_media_paths

    size = len(encode(body))
    for url, path in local_media_paths(body):
        try:
            size += (path.stat().st_size + 2) // 3 * 4 + len("data:image/jpeg;base64,") - len(url)
        except OSError:  # refused when the run reads it; nothing to count
            pass
    return size


def read(path: Path) -> dict[str, Any]:
    """The stored body; ValueError (one line, naming the file) when it is missing or not one."""
    path = Path(path)
    try:
        body = json.loads(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, not UTF-8
        raise ValueError(f"{path} is not JSON ({exc})") from None
    msgs = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise ValueError(f"{path} holds no chat (a JSON object with a non-empty `messages` list)")
    return body


def problems(out_dir: Path, index: int, record: dict[str, Any]) -> list[str]:
    """`hsx verify`'s check of sample `index`'s request file: present and a chat when the
    sample has image tokens, a chat whenever present."""
    rel = request_path(index)
    path = Path(out_dir) / rel
    if not path.exists():
        n = int(record.get("num_media") or 0)
        return [f"{rel} is missing: sample {index} has {n} image tokens, and the online backend "
                "needs the request they were tokenized from"] if n else []
    try:
        read(path)
    except ValueError as exc:
        return [f"sample {index}'s request file: {exc}"]
    return []
