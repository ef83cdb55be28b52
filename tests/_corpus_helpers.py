"""Helpers for corpus tests: synthetic `Decoded` responses and a minimal file store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hsx.wire import Decoded
from hsx_client.corpus import store
from hsx_client.sample_stream import SampleHead, StatesChunk

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
LAYER_IDS = [1, 2, 3, 5]  # stories260K-like: N = 5 layers
HIDDEN = 64
VOCAB = 512


def make_decoded(
    seed: int,
    num_tokens: int,
    *,
    layer_ids: list[int] = LAYER_IDS,
    hidden: int = HIDDEN,
    vocab: int = VOCAB,
    dtype: torch.dtype = torch.bfloat16,
    mask: np.ndarray | None | str = "turns",
) -> Decoded:
    """A deterministic response: random states, random ids, a prompt/answer style mask."""
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(num_tokens, len(layer_ids), hidden, generator=g) * 3).to(dtype)
    ids = torch.randint(0, vocab, (num_tokens,), generator=g).numpy().astype(np.int64)
    if isinstance(mask, str):
        m = np.zeros(num_tokens, dtype=np.uint8)
        m[num_tokens // 3 :] = 1  # context, then an answer
        if num_tokens > 6:
            m[num_tokens // 2 : num_tokens // 2 + 2] = 0  # a second context turn
        mask = m
    meta = {"layer_ids": json.dumps(layer_ids), "hidden_size": str(hidden)}
    return Decoded(hidden_states=hs, token_ids=ids, loss_mask=mask, metadata=meta)


# ------------------------------------------------------------------ a token table's chats (--states none)
def image_chat(k: int) -> dict:
    """A request body as the run loop sends it: images inlined, plus what only extract uses."""
    return {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,iVBOR{k}w0KGgo="}},
                {"type": "text", "text": f"What is in picture {k}?"}]},
                         {"role": "assistant", "content": "A blue box."}],
            "chat_template_kwargs": {"enable_thinking": False}, "max_length": 64, "truncation": "left",
            "id": f"in.jsonl:{k}", "layers": [1, 2, 3, 5], "require_supervised": True}


def text_chat(k: int) -> dict:
    return {"messages": [{"role": "user", "content": f"hi {k}"}, {"role": "assistant", "content": "yo"}],
            "id": f"in.jsonl:{k}", "require_supervised": True}


def tokenized(seed: int, t: int, body: dict):
    """The /tokenize answer for `body` (an image chat's first unsupervised tokens its image), decoded."""
    from hsx_client.corpus.formats.speculators_variants import TokensResponse

    d = make_decoded(seed, t)
    out = {"token_ids": d.token_ids.tolist(), "loss_mask": d.loss_mask.tolist(), "layer_ids": LAYER_IDS}
    if "image_url" in json.dumps(body):
        media = np.zeros(t, dtype=np.uint8)
        media[np.flatnonzero(d.loss_mask == 0)[:3]] = 1
        out["media_mask"] = media.tolist()
    return TokensResponse(out, body).decode()


def store_files(out_dir: Path, files: dict[str, bytes]) -> None:
    """What the run loop's store does (store.write_files_atomic), without the manifest."""
    store.write_files_atomic(out_dir, files)


def write_samples(fmt, out_dir: Path, ctx, decoded: dict, *, order=None, tokens_only: bool = False) -> list:
    """Encode and store each decoded sample (in `order`, default the dict's) as the run loop
    does, then finalize the corpus; returns the (index, record) pairs. `tokens_only`: what a
    /tokenize answer decodes to (no states)."""
    records = []
    for i in order if order is not None else list(decoded):
        d = decoded[i]
        if tokens_only:  # (a TokensDecoded keeps its image chat's request)
            extra = {"request": d.request} if hasattr(d, "request") else {}
            d = type(d)(hidden_states=None, token_ids=d.token_ids, loss_mask=d.loss_mask, metadata=d.metadata,
                        media_mask=d.media_mask, **extra)
        so = fmt.encode_sample(i, d, ctx)
        store_files(out_dir, so.files)
        records.append((i, so.record))
    fmt.finalize(out_dir, records, ctx)
    return records


def specforge_batches(path: Path, max_len: int, run_id: str = "t", strategy: str = "eagle3") -> list[tuple[str, dict]]:
    """SpecForge 0.2's offline reader (of `strategy`: eagle3, dflash, dspark, domino),
    LocalFeatureStore, normalizer and collator over a corpus: [(sample file path, batch
    tensors)], one sample a batch."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    provider = builtin_algorithm_registry().resolve(strategy).providers.offline_for("text")
    refs = provider.build_reader(str(path), run_id=run_id, ttt_length=7, max_len=max_len).read()
    loader = FeatureDataLoader(
        LocalFeatureStore(run_id), refs=refs, batch_size=1,
        collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(max_len, ttt_length=7, use_usp_preprocess=False),
        drop_last=False, strategy=strategy,
    )
    files = {r.sample_id: r.feature_store_uri[len("file://"):] for r in refs}
    return [(files[b.sample_ids[0]], b.tensors) for b in loader]


def specforge_rows(path: Path, strategy: str, max_len: int = 4096) -> dict[int, dict]:
    """specforge_batches by sample index (`rows/..../data_{i}.ckpt`)."""
    return {int(f.rsplit("data_", 1)[1].split(".")[0]): t for f, t in specforge_batches(path, max_len, strategy=strategy)}


class DecodedStream:
    """A lease-shaped SampleStream over a whole response, `rows` tokens a chunk, read-only
    views (a lease's shared memory is never written); `fail_at`: that chunk's turn raises."""

    def __init__(self, d: Decoded, rows: int = 5, fail_at: int | None = None):
        self.d, self.rows, self.fail_at = d, rows, fail_at

    async def head(self):
        hs = self.d.hidden_states
        return SampleHead(self.d.token_ids, self.d.loss_mask, self.d.metadata, hs.dtype, tuple(hs.shape), self.d.media_mask)

    async def chunks(self):
        hs = self.d.hidden_states
        raw = memoryview(hs.contiguous().view(torch.uint8).numpy().tobytes())
        row = raw.nbytes // hs.shape[0]
        for k, start in enumerate(range(0, hs.shape[0], self.rows)):
            if k == self.fail_at:
                raise ConnectionError("cut")
            stop = min(hs.shape[0], start + self.rows)
            yield StatesChunk(start, stop, raw[start * row:stop * row].toreadonly())
