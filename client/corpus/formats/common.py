"""What both corpus formats share: the context, the sample output and record, and checks."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from hsx import dtypes
from hsx_client.corpus import store
from hsx_client.postnorm import FinalNorm

if TYPE_CHECKING:
    from hsx.wire import Decoded
    from hsx_client.api import HsxClient

FORMAT_FILE = "hsx_format.json"
COMPACTION_JOURNAL = store.COMPACTION_JOURNAL


@dataclass
class CorpusContext:
    """Facts from the server's /info (and the run) that every sample shares."""

    layer_ids: list[int]
    hidden_size: int
    dtype: str
    final_norm: FinalNorm | None  # required by specforge
    draft_vocab_size: int | None
    vocab_size: int | None  # None: not reported (then no draft vocab mapping can be built)
    mask_policy: str | None = None  # recorded in hsx_format.json ("per_turn" | "all_turns")


@dataclass
class SampleOutput:
    """Complete files of one sample (relative path -> bytes, or a list of buffers that
    make the file in order) and its manifest record."""

    files: dict[str, Any]
    record: dict = field(default_factory=dict)


class CorpusFormat(Protocol):
    """What a corpus writer is to the run, merge and verify: every member declared, none
    optional (FormatDefaults has the plain behaviour of those a format may leave alone)."""

    name: str
    needs_final_norm: bool  # its states are post-norm: /final_norm must be readable (checked before any sample)

    def layer_problem(self, layers: list[int], num_hidden_layers: int | None, served: list[int]) -> str | None:
        """Why these layers cannot make this corpus, with what to do; None when they can."""

    def prepare(self) -> None:
        """What finalize needs, imported before the run (a missing package fails there)."""

    async def fetch(self, client: HsxClient, body: dict[str, Any], lease_ok: bool = True) -> Any:
        """One sample's response from the servers (a format may ask for less than states).
        `lease_ok`: False asks for an HTTP body (the sample's lease expired once)."""

    def drop_reason(self, mask: np.ndarray) -> str | None:
        """Why a sample with a supervised token still leaves its trainer nothing to learn
        (it is then dropped like an all-masked one); see `drop_reason`."""

    def encode_sample(self, index: int, decoded: Decoded, ctx: CorpusContext) -> SampleOutput: ...

    def finalize(self, out_dir: Path, records: list[tuple[int, dict]], ctx: CorpusContext) -> list[str]: ...

    def bytes_per_token(self, ctx: CorpusContext) -> float: ...

    def bytes_per_request(self, request: dict[str, Any]) -> int:
        """Bytes a sample's files take beyond its tokens' (the disk estimate adds them)."""

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]: ...


class FormatDefaults:
    """The plain behaviour of CorpusFormat's members a format may leave alone: post-norm
    states wanted when the server has them, any layers, nothing to import, the states
    fetched as they are, no drop rule of its own."""

    needs_final_norm = True
    draft = "eagle3"  # the draft the corpus trains (client/corpus/drafts.py); get_format sets it
    streams = False  # True: stream_open writes a sample as it arrives (hsx_client.corpus.stream_write)

    def stream_open(self, index: int, layout: Any, ctx: CorpusContext) -> StreamedSample:
        """One sample's file written as its states arrive; by default the format's
        `stream_file` (first bytes), each chunk through `stream_chunk`, `stream_tail`."""
        return StreamedSample(self, index, layout, ctx)

    def stream_chunk(self, data: Any, layout: Any, ctx: CorpusContext) -> Any:
        """A states chunk (token-major rows of layers x hidden) as the file holds it."""
        return data

    def layer_problem(self, layers: list[int], num_hidden_layers: int | None, served: list[int]) -> str | None:
        return None

    def bytes_per_request(self, request: dict[str, Any]) -> int:
        return 0

    def prepare(self) -> None:
        return None

    async def fetch(self, client: HsxClient, body: dict[str, Any], lease_ok: bool = True) -> Any:
        return await client.hidden_states_response(body, lease_ok=lease_ok)

    def drop_reason(self, mask: np.ndarray) -> str | None:
        return None


class StreamedSample:
    """A sample's file front to back (store_stream calls begin, chunk per states chunk, end):
    the plain layout of a format's stream_file / stream_chunk / stream_tail. A format whose
    file needs state across chunks (SpecForge's zip: its CRCs; fp8's scales) returns its own."""

    def __init__(self, fmt: Any, index: int, layout: Any, ctx: CorpusContext) -> None:
        self.fmt, self.layout, self.ctx = fmt, layout, ctx
        self.rel, self._first = fmt.stream_file(index, layout, ctx)
        self._write: Any = None

    def begin(self, write: Any) -> None:
        self._write = write
        write(self._first)

    def chunk(self, data: Any) -> None:
        self._write(self.fmt.stream_chunk(data, self.layout, self.ctx))

    def end(self, head: Any) -> dict:
        """Writes the last bytes once the head (token ids, mask) is known; the record."""
        last, record = self.fmt.stream_tail(head, self.ctx)
        for part in last:
            self._write(part)
        return record

    def abort(self) -> None:
        """The sample is given up (its file is removed): nothing to undo here."""


class Eagle3Format(FormatDefaults):
    """A corpus for the format's `draft` (EAGLE-3 by default: 3 auxiliary layers plus the last,
    `eagle3_layer_problem`; the others: client/corpus/drafts.py)."""

    def layer_problem(self, layers: list[int], num_hidden_layers: int | None, served: list[int]) -> str | None:
        from hsx_client.corpus import drafts

        if self.draft == drafts.DEFAULT_DRAFT:
            return eagle3_layer_problem(self.name, layers, num_hidden_layers, served)
        return drafts.layer_problem(self.draft, self.name, layers, num_hidden_layers, served)

    def draft_facts(self, ctx: CorpusContext) -> dict:
        """hsx_format.json's record of the draft: its name, the layers and how to name them to its trainer."""
        from hsx_client.corpus import drafts

        return {"draft": self.draft, "trainer_layers": drafts.trainer_layer_ids(self.draft, self.name, list(ctx.layer_ids))}


def drop_reason(fmt: CorpusFormat, mask: np.ndarray | None) -> str | None:
    """Why a response gives the trainer nothing to learn (the sample is dropped, counted as
    such, never stored), or None. No mask: every token is supervised."""
    if mask is None:
        return None
    if not mask.any():
        return "no supervised token: the loss mask is all zero"
    return fmt.drop_reason(mask)


class CorpusFormatError(ValueError):
    """A response or a corpus that does not fit the format."""


def mask_to_runs(mask: np.ndarray) -> list[int]:
    """0/1 mask -> alternating run lengths, starting with the (maybe empty) run of 0s."""
    m = np.asarray(mask).reshape(-1).astype(bool)
    if m.size == 0:
        return []
    edges = np.flatnonzero(m[1:] != m[:-1]) + 1
    bounds = np.concatenate([[0], edges, [m.size]])
    runs = np.diff(bounds).tolist()
    return ([0] + runs) if m[0] else runs


def runs_to_mask(runs: list[int]) -> np.ndarray:
    """Inverse of `mask_to_runs` (int64 0/1)."""
    vals = np.arange(len(runs)) % 2
    return np.repeat(vals, runs).astype(np.int64)


def ids_crc(ids: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(ids, dtype="<i8").tobytes())


def eagle3_layer_problem(name: str, layers: list[int], num_hidden_layers: int | None,
                         served: list[int]) -> str | None:
    """Why `layers` cannot make an EAGLE-3 corpus (3 auxiliary ids below N, plus N, the last
    layer), with what to do; None when they can. Checked before any sample is sent (issue
    10: a first run sent every sample and failed each one)."""
    from hsx.layers import default_layers

    n = num_hidden_layers
    if n is None:
        return None if len(layers) == 4 else f"{name} corpora (EAGLE-3, --draft eagle3) need 4 layers (3 aux + the last), got {layers}"
    layers = sorted(layers)
    if len(layers) == 4 and layers[-1] == n and layers[2] < n:
        return None
    head = f"{name} corpora (EAGLE-3, --draft eagle3) need 4 layers, 3 auxiliary ids below {n} plus {n} (the last); the run has {layers}"
    if n < 3:
        return f"{head}, and this model has only {n} decoder layer(s): too few for an EAGLE-3 draft"
    aux = [k for k in served if k < n]
    if n in served and len(aux) >= 3:
        best = default_layers(n)
        pick = best if set(best) <= set(served) else [*aux[:3], n]
        return f"{head}: pass --layers {','.join(map(str, pick))} (the server serves {served})"
    return (f"{head}: the server serves {served}; restart hsx serve with --layers "
            f"{','.join(map(str, default_layers(n)))} (its default since hsx 0.1)")


def state_bytes_per_token(ctx: CorpusContext) -> int:
    return len(ctx.layer_ids) * ctx.hidden_size * dtypes.by_name(ctx.dtype).itemsize


def check_decoded(decoded: Decoded, ctx: CorpusContext) -> tuple[torch.Tensor, np.ndarray, np.ndarray, str]:
    hs = decoded.hidden_states
    if not isinstance(hs, torch.Tensor) or hs.ndim != 3:
        raise CorpusFormatError(f"hidden_states must be a [T, L, H] tensor, got {getattr(hs, 'shape', type(hs))}")
    check_layout(SimpleNamespace(shape=tuple(hs.shape), dtype=hs.dtype, metadata=decoded.metadata), ctx)
    ids, mask, source = check_tokens(decoded, ctx, hs.shape[0])
    return hs, ids, mask, source


def check_layout(layout: Any, ctx: CorpusContext) -> None:
    """The states' checks (layers, hidden size, dtype, layer ids, tokens) from their layout: a
    stream's before any state arrives (hsx_client.sample_stream.StatesLayout), or a whole
    response's (check_decoded)."""
    t, n_layers, h = layout.shape
    if n_layers != len(ctx.layer_ids):
        raise CorpusFormatError(
            f"the run's corpus takes {len(ctx.layer_ids)} layers {list(ctx.layer_ids)}, the response has {n_layers} states"
        )
    if h != ctx.hidden_size:
        raise CorpusFormatError(f"hidden size {h} differs from the server's {ctx.hidden_size}")
    if ctx.dtype in dtypes.STATE_DTYPES and layout.dtype != dtypes.torch_dtype(ctx.dtype):
        raise CorpusFormatError(f"states are {layout.dtype}, the server said {ctx.dtype}")
    if "layer_ids" in layout.metadata and json.loads(layout.metadata["layer_ids"]) != list(ctx.layer_ids):
        raise CorpusFormatError(
            f"response layers {json.loads(layout.metadata['layer_ids'])} differ from the run's {ctx.layer_ids}")
    if t == 0:
        raise CorpusFormatError("response has no tokens")


def check_tokens(decoded: Decoded, ctx: CorpusContext, t: int | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """A response's token ids (in the target vocab) and 0/1 loss mask (all ones when none
    came back), with its source; `t`: the number of states they must match."""
    ids = np.asarray(decoded.token_ids).astype(np.int64, copy=False).reshape(-1)
    t = ids.shape[0] if t is None else t
    if t == 0:
        raise CorpusFormatError("response has no tokens")
    if ids.shape[0] != t:
        raise CorpusFormatError(f"{ids.shape[0]} token ids for {t} states")
    if ctx.vocab_size is None:
        if ctx.draft_vocab_size:
            raise CorpusFormatError("a draft vocab mapping needs the target vocab size, which the server did not report")
        if (ids < 0).any():
            raise CorpusFormatError("negative token ids")
    elif (ids < 0).any() or (ids >= ctx.vocab_size).any():
        raise CorpusFormatError(f"token ids outside the target vocab of {ctx.vocab_size}")
    if decoded.loss_mask is None:
        mask, source = np.ones(t, dtype=np.int64), "none"
    else:
        mask = np.asarray(decoded.loss_mask).reshape(-1).astype(np.int64)
        if mask.shape[0] != t or ((mask != 0) & (mask != 1)).any():
            raise CorpusFormatError("loss_mask must be 0/1 with one entry per token")
        source = "server"
    return ids, mask, source


def make_record(ids: np.ndarray, mask: np.ndarray, source: str, ctx: CorpusContext, media: Any = None) -> dict:
    """A sample's manifest record; `media`: the response's media mask (chats with images),
    recorded as `media_runs` when it marks any token."""
    record = {
        "num_tokens": int(ids.shape[0]),
        "num_supervised": int(mask.sum()),
        "mask_runs": mask_to_runs(mask),
        "ids_crc32": ids_crc(ids),
        "hidden_size": int(ctx.hidden_size),
        "num_layers": len(ctx.layer_ids),
        "dtype": ctx.dtype,
        "mask_source": source,
    }
    media = check_media(media, mask)
    if media is not None:
        record.update(num_media=int(media.sum()), media_runs=mask_to_runs(media))
    return record


def media_facts(records: Any) -> dict:
    """hsx_format.json's record of a corpus's image tokens (nothing for a text corpus)."""
    n = sum(int(r.get("num_media", 0)) for r in records)
    return {"num_media_tokens": n, "media": MEDIA_NOTE} if n else {}


# What a corpus with image chats holds, said in its hsx_format.json.
MEDIA_NOTE = ("token ids include each image's expanded placeholder tokens (the target's image token id), "
              "their states are the target's; the loss mask never supervises them; the manifest's media_runs "
              "(and a speculators table's media_mask column) mark them")


def check_media(media: Any, mask: np.ndarray) -> np.ndarray | None:
    """The media mask as int64 0/1 (None: no image token), checked: one entry per token, and
    no image token supervised (the contract: a draft never learns to predict image tokens)."""
    if media is None:
        return None
    media = np.asarray(media).reshape(-1).astype(np.int64)
    if media.shape != mask.shape or ((media != 0) & (media != 1)).any():
        raise CorpusFormatError(f"media_mask must be 0/1 with one entry per token ({mask.shape[0]}), got {media.shape[0]}")
    if not media.any():
        return None
    if (media & mask).any():
        raise CorpusFormatError(f"{int((media & mask).sum())} image tokens are supervised by the loss mask")
    return media


def record_problems(record: dict, ids: np.ndarray) -> list[str]:
    out = []
    if ids.shape[0] != record.get("num_tokens"):
        out.append(f"{ids.shape[0]} tokens in the file, the record says {record.get('num_tokens')}")
    elif ids_crc(ids) != record.get("ids_crc32"):
        out.append("token ids differ from the record (crc32 mismatch)")
    runs = record.get("mask_runs", [])
    if sum(runs) != record.get("num_tokens"):
        out.append(f"record's loss mask covers {sum(runs)} tokens, not {record.get('num_tokens')}")
    media = record.get("media_runs")
    if media is not None:
        if sum(media) != record.get("num_tokens"):
            out.append(f"record's media mask covers {sum(media)} tokens, not {record.get('num_tokens')}")
        elif sum(runs) == sum(media) and (runs_to_mask(runs) & runs_to_mask(media)).any():
            out.append("the record supervises image tokens (its loss and media masks overlap)")
    return out


def format_json(name: str, ctx: CorpusContext, **extra: object) -> bytes:
    doc = {
        "format": name,
        "mask_policy": ctx.mask_policy,
        "layer_ids": list(ctx.layer_ids),
        "hidden_size": ctx.hidden_size,
        "dtype": ctx.dtype,
        "vocab_size": ctx.vocab_size,
        "draft_vocab_size": ctx.draft_vocab_size,
        **extra,
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def sorted_records(records: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    recs = sorted(records, key=lambda r: r[0])
    idx = [i for i, _ in recs]
    if len(set(idx)) != len(idx):
        raise CorpusFormatError("finalize got the same sample index twice")
    if idx and idx[0] < 0:
        raise CorpusFormatError(f"negative sample index {idx[0]}")
    if not recs:
        raise CorpusFormatError("finalize got no samples: nothing to write")
    return recs
