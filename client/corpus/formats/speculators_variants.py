"""Two variants of the speculators corpus (`hsx extract --format speculators ...`).

`--states none`: the token table alone, for online training (docs/online-training.md)
    token_ids/ids_{i}.safetensors  {"token_ids": int64 [T]}: the sample's ids as the server
                                   tokenized them (POST /tokenize: chat template, masks and
                                   truncation as in a full run, no engine pass)
    data-*.arrow, dataset_info.json, state.json, token_freq.pt, d2t/t2d, hsx_format.json
                                   exactly as in a full corpus (same rows, same order)
    token_ids/request_{i}.json     only for a sample whose request has images: the body the
                                   server tokenized, images as data: URIs (client/corpus/
                                   image_requests.py); token ids alone cannot carry pixels
    No hidden_states/ directory: speculators' `file` backend finds no row there; the
    `hsx` backend (hsx_client.training.speculators_backend) fetches each row's states from the
    servers instead (an image chat's by its request file). The per-sample files make the run
    crash-safe and resumable like a full one (stored atomically, checksummed in the manifest,
    the ids read back by finalize, both moved by its compaction).

`--dtype fp8`: what speculators' `fp8` backend reads (hs_connectors 0.9, FP8Transfer)
    hidden_states/hs_{i}.safetensors  {"hidden_states": float8_e4m3fn [T, L, H],
                                       "hidden_states_scales": float32 [T, 1, 1],
                                       "token_ids": int64 [T]}
    One scale per token over all layers and features (hs_connectors.fp8_utils):
    scale = max(amax / 448, 1e-12), stored = (states as float32 / scale) cast to e4m3fn;
    the reader restores `stored.to(bf16) * scale.to(bf16)`. Train with
    `--hidden-states-backend fp8`. A sample whose states are not finite is refused.

    Written as the states arrive (issue 36), like the plain corpus: a token's scale is its
    own states' amax, so each chunk is quantized alone to the bits the whole sample's
    quantization gives (no max over the sample is needed before the first byte: no second
    pass, no spilled temporary file). The file's order is the reader's (states, scales, ids),
    so the scales (4 bytes a token, beside the states' 4 x hidden) wait in memory with the
    token ids until the states are through.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsx import wire

from hsx_client.corpus import image_requests, images
from hsx_client.corpus.formats.common import (
    CorpusContext, CorpusFormatError, SampleOutput, check_decoded, check_layout, check_tokens, make_record,
    record_problems,
)
from hsx_client.corpus.formats.speculators import SpeculatorsFormat, sample_file_meta, sample_file_parts

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, L, H] -> (float8_e4m3fn [T, L, H], float32 scales [T, 1, 1]), the same bits as
    hs_connectors.fp8_utils.quantize_tensor_to_fp8 (tests/client/training/test_speculators_variants.py).
    Each token's scale is its own: quantizing any run of tokens alone gives the same bits.
    Non-finite states: CorpusFormatError (a NaN or infinity carries into its token's amax)."""
    fp32 = states.to(torch.float32, copy=True)  # a copy: divided in place, the input never written
    q = torch.empty(fp32.shape, dtype=FP8_DTYPE)
    return q, quantize_into(fp32, q)


def quantize_into(fp32: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Quantizes the float32 states `fp32` [n, ...] into `out` (float8_e4m3fn, same shape),
    dividing `fp32` in place; returns the scales [n, 1, ...]. quantize_fp8's one step, which
    the streamed writer runs over buffers of its own."""
    # amax(|x|) as max(max x, -min x): the same value, without a second float32 copy for abs
    lo, hi = torch.aminmax(fp32.view(fp32.shape[0], -1), dim=1)
    amax = torch.maximum(hi, lo.neg_()).view(-1, *([1] * (fp32.dim() - 1)))
    if not bool(torch.isfinite(amax).all()):
        raise CorpusFormatError("states hold NaN or infinity: fp8 scales cannot be computed")
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    out.copy_(fp32.div_(scale))  # the cast of `.to(float8_e4m3fn)`
    return scale


# Bytes of float32 copy quantized at once: a few MiB (smaller slices cost more in torch's
# per-call work, its threads' start and join, than they save: 1 MiB ones ran several times
# slower on a busy 2-core box), so a default chunk (sample_stream.DEFAULT_CHUNK_BYTES of
# bf16) takes two, and a whole sample handed over as one chunk (a lease view) is never
# copied whole.
QUANT_SLICE_BYTES = 4 << 20


class SpeculatorsTokensFormat(SpeculatorsFormat):
    """speculators' table without states (`--states none`); see the module doc."""

    streams = False  # no states in its files: today's whole path

    format_facts = {"states": "none", "train_with": "--hidden-states-backend hsx (python -m hsx_client.training.speculators_train)",
                    image_requests.FORMAT_FACT: image_requests.REQUEST_PATH}
    needs_states = False

    @staticmethod
    def hs_path(index: int) -> str:
        return f"token_ids/ids_{int(index)}.safetensors"

    @staticmethod
    def request_path(index: int) -> str:
        """An image chat's request file (verify and merge renumber it with the row)."""
        return image_requests.request_path(index)

    def extra_paths(self, index: int) -> list[str]:
        return [self.request_path(index)]

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        # the id file, the table's input_ids + loss_mask (an image chat's request file follows
        # its images, not its tokens: bytes_per_request)
        return 8 + 16

    def bytes_per_request(self, request: dict) -> int:
        return image_requests.estimated_size(request) if images.request_has_images(request) else 0

    async def fetch(self, client, body: dict, lease_ok: bool = True) -> "TokensResponse":
        """What the run loop asks the servers for: POST /tokenize, not /hidden_states (the
        body, its images inlined, kept for an image chat's request file)."""
        return TokensResponse(await client.tokenize(body), body)

    def encode_sample(self, index: int, decoded: wire.Decoded, ctx: CorpusContext) -> SampleOutput:
        problem = self.layer_problem(list(ctx.layer_ids), None, list(ctx.layer_ids))
        if problem:  # the online backend would fetch these layers
            raise CorpusFormatError(problem)
        ids, mask, source = check_tokens(decoded, ctx)
        ids = np.ascontiguousarray(ids, dtype="<i8")
        files = {self.hs_path(index): sample_file_parts(ctx, [("token_ids", "I64", ids)])}
        request = getattr(decoded, "request", None)
        if request is not None:  # an image chat: what the online backend sends for its states
            files[self.request_path(index)] = image_requests.encode(request)
        return SampleOutput(files, make_record(ids, mask, source, ctx, getattr(decoded, "media_mask", None)))

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]:
        probs = verify_layout(out_dir, self.hs_path(index), record, {"token_ids": ([record.get("num_tokens")], "I64")})
        return probs + image_requests.problems(out_dir, index, record)


@dataclass
class TokensDecoded(wire.Decoded):
    """A /tokenize answer decoded, with the request of an image chat (None for text)."""

    request: dict | None = None


class TokensResponse:
    """A /tokenize answer in the shape the run loop stores (no states, no lease); `body`:
    the request it answers, kept only when it has images (image_requests)."""

    lease = None

    def __init__(self, out: dict, body: dict | None = None) -> None:
        self.out = out
        self.request = body if body is not None and images.request_has_images(body) else None
        self.request_id = out.get("request_id")
        self.wire_bytes = 0

    def decode(self) -> wire.Decoded:
        ids = np.asarray(self.out["token_ids"], dtype=np.int64)
        mask, media = self.out.get("loss_mask"), self.out.get("media_mask")
        meta = {"layer_ids": json.dumps(self.out.get("layer_ids", [])), "model": str(self.out.get("model", "")),
                "num_input_tokens": self.out.get("num_input_tokens")}  # the run counts what was cut
        return TokensDecoded(hidden_states=None, token_ids=ids,
                             loss_mask=None if mask is None else np.asarray(mask, dtype=np.uint8), metadata=meta,
                             media_mask=None if media is None else np.asarray(media, dtype=np.uint8),
                             request=self.request)


class SpeculatorsFp8Format(SpeculatorsFormat):
    """speculators' corpus with fp8 states (`--dtype fp8`); see the module doc."""

    streams = True  # each chunk quantized as it arrives (_StreamedFp8)

    format_facts = {"stored_dtype": "float8_e4m3fn", "scales": "per token, hs_connectors fp8",
                    "train_with": "--hidden-states-backend fp8"}

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        return len(ctx.layer_ids) * ctx.hidden_size + 4 + 8 + 16

    @staticmethod
    def file_specs(t: int, n_layers: int, hidden: int) -> list[wire.TensorSpec]:
        """The sample file's tensors in file order: the streamed header (encode_sample's comes
        from its tensors, the same; the byte-equality tests hold them together)."""
        return [wire.TensorSpec("hidden_states", "F8_E4M3", (t, n_layers, hidden)),
                wire.TensorSpec(SCALES_KEY, "F32", (t, 1, 1)), wire.TensorSpec("token_ids", "I64", (t,))]

    def encode_sample(self, index: int, decoded: wire.Decoded, ctx: CorpusContext) -> SampleOutput:
        hs, ids, mask, source = check_decoded(decoded, ctx)
        q, scale = quantize_fp8(hs)
        ids = np.ascontiguousarray(ids, dtype="<i8")
        parts = sample_file_parts(ctx, [("hidden_states", "F8_E4M3", q), (SCALES_KEY, "F32", scale),
                                                ("token_ids", "I64", ids)])
        return SampleOutput({self.hs_path(index): parts}, make_record(ids, mask, source, ctx, getattr(decoded, "media_mask", None)))

    def stream_open(self, index: int, layout, ctx: CorpusContext) -> _StreamedFp8:
        return _StreamedFp8(self, index, layout, ctx)

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]:
        t, n_layers, h = record.get("num_tokens"), record.get("num_layers", 4), record.get("hidden_size")
        return verify_layout(out_dir, self.hs_path(index), record, {
            "hidden_states": ([t, n_layers, h], "F8_E4M3"), SCALES_KEY: ([t, 1, 1], "F32"), "token_ids": ([t], "I64")})


class _StreamedFp8:
    """One fp8 sample file front to back (stream_write: begin, chunk..., end), the bytes of
    encode_sample's: the header (from the layout), each chunk's tokens quantized as they come
    (QUANT_SLICE_BYTES of float32 at a time, in two buffers the writer keeps: no allocation
    per chunk), then the scales and the token ids."""

    def __init__(self, fmt: SpeculatorsFp8Format, index: int, layout, ctx: CorpusContext) -> None:
        check_layout(layout, ctx)
        self.layout, self.ctx = layout, ctx
        self.tokens, n_layers, hidden = layout.shape
        self.rel = fmt.hs_path(index)
        self._first = wire.encode_header(fmt.file_specs(self.tokens, n_layers, hidden), sample_file_meta(ctx))
        self._scales = np.empty(self.tokens, dtype="<f4")  # the file's second tensor: written last but one
        self._done = 0  # tokens written
        self._slice = min(self.tokens, max(1, QUANT_SLICE_BYTES // (n_layers * hidden * 4)))
        self._fp32: torch.Tensor | None = None
        self._fp8: torch.Tensor | None = None
        self._write = None

    def begin(self, write) -> None:
        self._write = write
        write(self._first)

    def chunk(self, data) -> None:
        _, n_layers, hidden = self.layout.shape
        if self._fp32 is None:
            self._fp32 = torch.empty(self._slice, n_layers, hidden, dtype=torch.float32)
            self._fp8 = torch.empty(self._slice, n_layers, hidden, dtype=FP8_DTYPE)
        with warnings.catch_warnings():  # a lease's shared memory is read-only: only read here
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.frombuffer(data, dtype=self.layout.dtype).view(-1, n_layers, hidden)
        for start in range(0, rows.shape[0], self._slice):
            part = rows[start:start + self._slice]
            n = part.shape[0]
            fp32, q = self._fp32[:n], self._fp8[:n]
            fp32.copy_(part)  # exact, as quantize_fp8's `.to(float32)`
            scale = quantize_into(fp32, q)
            self._write(q.view(torch.uint8).reshape(-1).numpy().data)  # written before q is reused
            self._scales[self._done:self._done + n] = scale.reshape(-1).numpy()
            self._done += n

    def end(self, head) -> dict:
        ids, mask, source = check_tokens(head, self.ctx, self.tokens)
        if self._done != self.tokens:  # store_stream checks the count too; the file must not lie
            raise CorpusFormatError(f"{self._done} of {self.tokens} tokens quantized")
        ids = np.ascontiguousarray(ids, dtype="<i8")
        self._write(self._scales.data)
        self._write(ids.data)
        self._fp32 = self._fp8 = None
        return make_record(ids, mask, source, self.ctx, getattr(head, "media_mask", None))

    def abort(self) -> None:
        """The sample is given up (store_stream removes its file): its buffers go."""
        self._fp32 = self._fp8 = None


def verify_layout(out_dir: Path, rel: str, record: dict, want: dict[str, tuple[list, str]]) -> list[str]:
    """A stored sample file holds exactly the tensors `want` ({name: (shape, safetensors
    dtype)}), and its token ids agree with the record."""
    from safetensors import safe_open

    path = Path(out_dir) / rel
    if not path.exists():
        return [f"{rel} is missing"]
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
            ids = f.get_tensor("token_ids") if "token_ids" in shapes else None
    except Exception as exc:  # truncated or not safetensors
        return [f"{path.name} is unreadable: {type(exc).__name__}: {exc}"]
    probs = [f"{k} is {shapes.get(k)}, expected {w}" for k, w in want.items() if shapes.get(k) != tuple(w)]
    return probs or record_problems(record, ids.numpy())


def variant_format(name: str, *, states: str, dtype: str) -> SpeculatorsFormat:
    """The writer for a variant; refuses combinations that make no corpus."""
    if name != "speculators":
        raise ValueError(
            f"--states {states} / --dtype {dtype} are for --format speculators only: SpecForge's online mode "
            "takes only its own Mooncake backend (docs/online-training.md), and its offline reader wants "
            "the model dtype"
        )
    if states not in ("all", "none"):
        raise ValueError(f"--states must be all or none, not {states!r}")
    if dtype not in ("auto", "fp8"):
        raise ValueError(f"--dtype must be auto or fp8, not {dtype!r}")
    if states == "none" and dtype != "auto":
        raise ValueError("--states none stores no states, so --dtype has nothing to apply to")
    return SpeculatorsTokensFormat() if states == "none" else SpeculatorsFp8Format()
