"""Two variants of the speculators corpus (`hsx extract --format speculators ...`).

`--states none`: the token table alone, for online training (docs/online-training.md)
    token_ids/ids_{i}.safetensors  {"token_ids": int64 [T]}: the sample's ids as the server
                                   tokenized them (POST /tokenize: chat template, masks and
                                   truncation as in a full run, no engine pass)
    data-*.arrow, dataset_info.json, state.json, token_freq.pt, d2t/t2d, hsx_format.json
                                   exactly as in a full corpus (same rows, same order)
    No hidden_states/ directory: speculators' `file` backend finds no row there; the
    `hsx` backend (hsx_client.training.speculators_backend) fetches each row's states from the
    servers instead. The per-sample id files make the run crash-safe and resumable like a
    full one (stored atomically, checksummed in the manifest, read back by finalize).

`--dtype fp8`: what speculators' `fp8` backend reads (hs_connectors 0.9, FP8Transfer)
    hidden_states/hs_{i}.safetensors  {"hidden_states": float8_e4m3fn [T, L, H],
                                       "hidden_states_scales": float32 [T, 1, 1],
                                       "token_ids": int64 [T]}
    One scale per token over all layers and features (hs_connectors.fp8_utils):
    scale = max(amax / 448, 1e-12), stored = (states as float32 / scale) cast to e4m3fn;
    the reader restores `stored.to(bf16) * scale.to(bf16)`. Train with
    `--hidden-states-backend fp8`. A sample whose states are not finite is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hsx import wire

from hsx_client.corpus.formats.common import (
    CorpusContext, CorpusFormatError, SampleOutput, check_decoded, check_tokens, make_record, record_problems,
)
from hsx_client.corpus.formats.speculators import SpeculatorsFormat, sample_file_parts

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, L, H] -> (float8_e4m3fn [T, L, H], float32 scales [T, 1, 1]), the same bits as
    hs_connectors.fp8_utils.quantize_tensor_to_fp8 (tests/client/training/test_speculators_variants.py)."""
    fp32 = states.float()
    amax = fp32.abs().amax(dim=tuple(range(1, fp32.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (fp32 / scale).to(FP8_DTYPE), scale


class SpeculatorsTokensFormat(SpeculatorsFormat):
    """speculators' table without states (`--states none`); see the module doc."""

    streams = False  # no states in its files: today's whole path

    format_facts = {"states": "none", "train_with": "--hidden-states-backend hsx (python -m hsx_client.training.speculators_train)"}
    needs_states = False

    @staticmethod
    def hs_path(index: int) -> str:
        return f"token_ids/ids_{int(index)}.safetensors"

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        return 8 + 16  # the id file, the table's input_ids + loss_mask

    async def fetch(self, client, body: dict, lease_ok: bool = True) -> "TokensResponse":
        """What the run loop asks the servers for: POST /tokenize, not /hidden_states."""
        return TokensResponse(await client.tokenize(body))

    def encode_sample(self, index: int, decoded: wire.Decoded, ctx: CorpusContext) -> SampleOutput:
        if len(ctx.layer_ids) != 4:
            raise CorpusFormatError(
                f"EAGLE-3 corpora need 4 layers (3 aux + last), the run has {ctx.layer_ids}: the online "
                "backend would fetch these"
            )
        ids, mask, source = check_tokens(decoded, ctx)
        ids = np.ascontiguousarray(ids, dtype="<i8")
        parts = sample_file_parts(ctx, [("token_ids", "I64", ids)])
        return SampleOutput({self.hs_path(index): parts}, make_record(ids, mask, source, ctx))

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]:
        return verify_layout(out_dir, self.hs_path(index), record, {"token_ids": ([record.get("num_tokens")], "I64")})


class TokensResponse:
    """A /tokenize answer in the shape the run loop stores (no states, no lease)."""

    lease = None

    def __init__(self, out: dict) -> None:
        self.out = out
        self.request_id = out.get("request_id")
        self.wire_bytes = 0

    def decode(self) -> wire.Decoded:
        ids = np.asarray(self.out["token_ids"], dtype=np.int64)
        mask = self.out.get("loss_mask")
        meta = {"layer_ids": json.dumps(self.out.get("layer_ids", [])), "model": str(self.out.get("model", "")),
                "num_input_tokens": self.out.get("num_input_tokens")}  # the run counts what was cut
        return wire.Decoded(hidden_states=None, token_ids=ids,
                            loss_mask=None if mask is None else np.asarray(mask, dtype=np.uint8), metadata=meta)


class SpeculatorsFp8Format(SpeculatorsFormat):
    """speculators' corpus with fp8 states (`--dtype fp8`); see the module doc."""

    streams = False  # its states are quantized from the decoded sample: today's whole path

    format_facts = {"stored_dtype": "float8_e4m3fn", "scales": "per token, hs_connectors fp8",
                    "train_with": "--hidden-states-backend fp8"}

    def bytes_per_token(self, ctx: CorpusContext) -> float:
        return len(ctx.layer_ids) * ctx.hidden_size + 4 + 8 + 16

    def encode_sample(self, index: int, decoded: wire.Decoded, ctx: CorpusContext) -> SampleOutput:
        hs, ids, mask, source = check_decoded(decoded, ctx)
        if not bool(torch.isfinite(hs).all()):
            raise CorpusFormatError("states hold NaN or infinity: fp8 scales cannot be computed")
        q, scale = quantize_fp8(hs)
        ids = np.ascontiguousarray(ids, dtype="<i8")
        parts = sample_file_parts(ctx, [("hidden_states", "F8_E4M3", q), (SCALES_KEY, "F32", scale),
                                                ("token_ids", "I64", ids)])
        return SampleOutput({self.hs_path(index): parts}, make_record(ids, mask, source, ctx))

    def verify_sample(self, out_dir: Path, index: int, record: dict) -> list[str]:
        t, n_layers, h = record.get("num_tokens"), record.get("num_layers", 4), record.get("hidden_size")
        return verify_layout(out_dir, self.hs_path(index), record, {
            "hidden_states": ([t, n_layers, h], "F8_E4M3"), SCALES_KEY: ([t, 1, 1], "F32"), "token_ids": ([t], "I64")})


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
