"""speculators' hidden-states backend `hsx`: every training row's states come from hsx servers.

    hsx extract --format speculators --states none --server URL --input chats.jsonl --output DATA
    python -m hsx_client.training.speculators_train --data-path DATA --hidden-states-backend hsx \\
        --hsx-servers URL[,URL...] --on-missing raise ...

speculators (0.9) reads a row with `transfer.get_cached(file_idx)`; `file_idx` is the row's
position in the whole `DATA` table (speculators adds the split's offset). This backend
reads that row's `input_ids` from the same table and posts them to `POST /hidden_states`
through `HsxClient` (least-loaded server, retries with backoff, failover, same-host
leases), so the states are exactly those of the row's tokens; it checks that the server's
token ids equal the row's, that the states are [T, L, H] with the corpus's layers, and
that they are finite (speculators' cached path checks none of this).

Image chats: token ids alone cannot carry an image's pixels (a server given a row's
`input_ids` embeds its image tokens as text), so `hsx extract --states none` stores an image
chat's request beside its row (`token_ids/request_{i}.json`: the body the server tokenized,
images as data: URIs, max_length and truncation; hsx_client.corpus.image_requests). For a
row with that file the backend posts its body (with the corpus's layers) instead of the ids,
and checks the answer the same way: the server's token ids must equal the row's (a server
that renders the chat otherwise, another template or processor, fails the row). A row with
image tokens (the table's media_mask) and no such file fails like any row that cannot be
fetched. A table of image chats without requests (its hsx_format.json has no
`image_requests`: a full corpus, or a token table an older hsx wrote) is refused when the
settings are read, with one line: extract it again with `--states none`, or train it with
its states (`--states all`) through speculators' `file` backend.

Which layers: those recorded in DATA/hsx_corpus.json (the servers must serve them, and
the same model: checked once per process), else `--hsx-layers`, else all the server serves.

A row that cannot be fetched (a 4xx for it, retries exhausted on 5xx, a failed check):
  `--on-missing raise` and `generate` (speculators' default; there is nothing else to
  generate from) raise HsxSampleError naming the row and the reason, which stops the
  training; `skip` drops the row (speculators' skip), `warn` drops it with a warning
  giving the reason. Servers that cannot be reached at all, or that refuse the API key,
  always raise: skipping every row would train on nothing.

Processes: speculators' DataLoader pickles the transfer into each spawned worker, so the
object holds only its settings; each process opens its own event loop (in a daemon
thread), client and table on first use, and closes them at exit (a multiprocessing
finalizer, which DataLoader workers run too) or on `close()`. The API key comes from
HSX_API_KEY or `--hsx-api-key-file`, never a flag: speculators writes every flag to
run.yaml and train_command.txt beside the checkpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from hsx_client import (AuthenticationError, HsxError, LeaseExpiredError, ResponseValidationError,
                        RetriesExhaustedError, ServerError, ServersUnreachableError)
from hsx_client.corpus import image_requests
from hsx_client.settings import DEFAULTS, TRANSFERS

log = logging.getLogger("hsx.speculators")

BACKEND_NAME = "hsx"
_LEASE_REDOS = 3


class HsxSampleError(RuntimeError):
    """A row whose states could not be fetched (with --on-missing raise / generate)."""


class HsxSetupError(RuntimeError):
    """The servers cannot serve this corpus at all (unreachable, wrong key, other model)."""


@dataclass(frozen=True)
class HsxSettings:
    servers: tuple[str, ...]
    data_path: str
    api_key: str | None = None
    timeout: float = 600.0
    max_attempts: int = 10
    transfer: str = "auto"
    layers: tuple[int, ...] | None = None
    on_missing: str = "raise"


def settings_from_args(args: argparse.Namespace, data_path: str) -> HsxSettings:
    """speculators' flattened train args -> settings; ValueError says what is missing."""
    servers = getattr(args, "hsx_servers", None) or os.environ.get("HSX_SERVER", "")
    urls = tuple(s.strip() for s in str(servers).split(",") if s.strip())
    if not urls:
        raise ValueError("--hidden-states-backend hsx needs --hsx-servers URL[,URL...] (or HSX_SERVER)")
    key = os.environ.get("HSX_API_KEY") or None
    key_file = getattr(args, "hsx_api_key_file", None)
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--hsx-api-key-file {key_file}: {exc.strerror or exc}") from None
    layers = getattr(args, "hsx_layers", None)
    try:
        layer_ids = tuple(sorted({int(x) for x in str(layers).split(",") if x.strip()})) if layers else None
    except ValueError:
        raise ValueError(f"--hsx-layers wants comma-separated integers, got {layers!r}") from None
    transfer = getattr(args, "hsx_transfer", None) or "auto"
    if transfer not in TRANSFERS:
        raise ValueError(f"--hsx-transfer must be one of {', '.join(TRANSFERS)}, not {transfer!r}")
    image_problem = image_table_problem(Path(data_path))
    if image_problem:
        raise ValueError(image_problem)
    return HsxSettings(
        servers=urls, data_path=str(data_path), api_key=key,
        timeout=float(getattr(args, "hsx_timeout", None) or DEFAULTS.timeout),
        max_attempts=int(getattr(args, "hsx_max_attempts", None) or DEFAULTS.max_attempts),
        transfer=transfer, layers=layer_ids, on_missing=getattr(args, "on_missing", "generate") or "generate",
    )


def image_table_problem(data_path: Path) -> str | None:
    """Why the table at `data_path` cannot be trained online (it holds image chats and, made
    by an older hsx, not the requests they were tokenized from), or None."""
    facts: dict[str, Any] = {}
    for name in ("hsx_format.json", "dataset_info.json"):
        try:
            facts[name] = json.loads((data_path / name).read_text())
        except (OSError, ValueError):
            facts[name] = {}
    images = int(facts["hsx_format.json"].get("num_media_tokens") or 0)
    if not images and "media_mask" not in (facts["dataset_info.json"].get("features") or {}):
        return None
    if facts["hsx_format.json"].get(image_requests.FORMAT_FACT):
        return None  # its image rows carry their requests
    return (f"{data_path} holds image chats ({images or 'some'} image tokens) without their requests (hsx extract "
            "--states none stores them; an older hsx did not): the hsx backend would fetch a row's states by its "
            "input_ids, which cannot carry the images; extract it again with --states none, or with --states all "
            "and train with --hidden-states-backend file")


def row_request(data_path: str, file_idx: int, media: np.ndarray | None) -> dict[str, Any] | None:
    """The request row `file_idx` was tokenized from (an image chat's), None for a text row;
    ValueError when its file is unreadable, or missing for a row with image tokens."""
    rel = image_requests.request_path(file_idx)
    path = Path(data_path) / rel
    if path.exists():
        return image_requests.read(path)
    if media is not None and media.any():
        raise ValueError(f"the row has {int(media.sum())} image tokens and no {rel} (the request they were "
                         "tokenized from): its input_ids cannot carry the images")
    return None


async def _receive(stream: Any) -> tuple[torch.Tensor, Any]:
    """A sample stream's states in one new tensor (each chunk copied into its rows) and its head."""
    from hsx_client import states_layout

    layout = await states_layout(stream)
    hs = torch.empty(layout.shape, dtype=layout.dtype)
    flat = hs.view(-1).view(torch.uint8).numpy()
    row = layout.row_bytes
    async for c in stream.chunks():
        flat[c.start * row : c.stop * row] = np.frombuffer(c.data, dtype=np.uint8)
    return hs, await stream.head()


class TokenMismatch(ValueError):
    """The server's token ids for a row are not the row's."""


def check_sample(hs: torch.Tensor, token_ids: torch.Tensor, row_ids: np.ndarray, num_layers: int | None) -> None:
    """Raise ValueError unless the states fit the row: same token ids, [T, L, H], finite."""
    if token_ids.shape != (len(row_ids),) or not np.array_equal(token_ids.numpy(), row_ids):
        raise TokenMismatch(f"the server returned other token ids than the row's ({tuple(token_ids.shape)[0]} vs {len(row_ids)})")
    if hs.ndim != 3 or hs.shape[0] != len(row_ids) or (num_layers is not None and hs.shape[1] != num_layers):
        raise ValueError(f"states of shape {tuple(hs.shape)} for {len(row_ids)} tokens and {num_layers} layers")
    if not bool(torch.isfinite(hs).all()):
        raise ValueError("the states hold NaN or infinity")


class _Runtime:
    """What one process uses: an event loop in a daemon thread, an HsxClient, the table."""

    def __init__(self, s: HsxSettings) -> None:
        from datasets import load_from_disk

        from hsx_client import HsxClient

        self.pid = os.getpid()
        table = load_from_disk(s.data_path)
        self.columns = [c for c in ("input_ids", "media_mask") if c in table.column_names]
        self.table = table.with_format("numpy", columns=self.columns)
        self.client = HsxClient(list(s.servers), api_key=s.api_key, timeout=s.timeout,
                                max_attempts=s.max_attempts, transfer=s.transfer, concurrency_per_server=4)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hsx-transfer", daemon=True)
        self.thread.start()
        self.finalizer = mp_util.Finalize(None, self.close, exitpriority=10)
        self.layers: list[int] | None = None  # sent with each request when not all served ones
        self.num_layers: int | None = None

    def call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_closed() or os.getpid() != self.pid:
            return
        try:
            self.call(self.client.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    async def check_servers(self, s: HsxSettings) -> None:
        """Once per process: the servers serve the corpus's model and layers."""
        try:
            info = await self.client.info()
        except AuthenticationError as exc:
            raise HsxSetupError(f"hsx servers {', '.join(s.servers)} refuse the API key (HSX_API_KEY, "
                                f"--hsx-api-key-file): {exc}") from exc
        except (RetriesExhaustedError, ServersUnreachableError) as exc:  # the latter: none ever answered
            raise HsxSetupError(f"hsx servers {', '.join(s.servers)} unreachable: {exc}") from exc
        served = [int(x) for x in info["layer_ids"]]
        corpus_path = Path(s.data_path) / "hsx_corpus.json"
        corpus = json.loads(corpus_path.read_text()) if corpus_path.exists() else {}
        for k in ("model", "model_revision"):
            if corpus.get(k) is not None and corpus.get(k) != info.get(k):
                raise HsxSetupError(f"{corpus_path} was made with {k} {corpus[k]!r}; the servers serve {info.get(k)!r}")
        want = list(s.layers) if s.layers else corpus.get("layer_ids") or served
        missing = sorted(set(want) - set(served))
        if missing:
            raise HsxSetupError(f"layers {want} asked (corpus or --hsx-layers), the servers serve {served}")
        self.layers = None if want == served else sorted(want)
        self.num_layers = len(want)


class HsxTransfer(HiddenStatesTransfer):
    """The `hsx` backend's transfer (see the module doc); picklable, settings only."""

    def __init__(self, settings: HsxSettings) -> None:
        self.settings = settings
        self._rt: _Runtime | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])

    def _runtime(self) -> _Runtime:
        rt = self._rt
        if rt is not None and rt.pid == os.getpid():
            return rt
        with self._lock:
            if self._rt is None or self._rt.pid != os.getpid():  # first use here, or a forked child
                rt = _Runtime(self.settings)
                try:
                    rt.call(rt.check_servers(self.settings))
                except BaseException:
                    rt.finalizer()
                    raise
                self._rt = rt
            return self._rt

    def setup(self) -> None:
        self._runtime()

    def close(self) -> None:
        """Close this process's client and loop (also done at exit)."""
        rt, self._rt = self._rt, None
        if rt is not None and rt.pid == os.getpid():
            rt.finalizer()

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        rt = self._runtime()
        if not 0 <= file_idx < len(rt.table):
            raise IndexError(f"row {file_idx} is outside the table of {len(rt.table)} rows at {self.settings.data_path}")
        row = rt.table[int(file_idx)]
        row_ids = np.asarray(row["input_ids"], dtype=np.int64)
        try:
            request = row_request(self.settings.data_path, int(file_idx), row.get("media_mask"))
            return rt.call(self._fetch(rt, int(file_idx), row_ids, request))
        except (AuthenticationError, HsxSetupError):
            raise
        except ServersUnreachableError as exc:  # no server ever answered: infrastructure, not this row
            raise HsxSetupError(f"hsx servers unreachable at row {file_idx}: {exc}") from exc
        except RetriesExhaustedError as exc:
            if not isinstance(exc.last_error, (ServerError, ResponseValidationError)):  # unreachable, timing out or busy: not this row's fault
                raise HsxSetupError(f"hsx servers unreachable or busy at row {file_idx}: {exc}") from exc
            return self._unavailable(file_idx, exc)  # the engine failed on this row every time
        except (HsxError, ValueError) as exc:
            return self._unavailable(file_idx, exc)

    async def _fetch(self, rt: _Runtime, file_idx: int, row_ids: np.ndarray,
                     request: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """`request`: an image chat's stored body, posted instead of the row's ids."""
        body: dict[str, Any] = {**request} if request is not None else {"input_ids": row_ids.tolist()}
        body["id"] = f"row-{file_idx}"
        if rt.layers is not None:
            body["layers"] = rt.layers
        lease_ok = True
        for _ in range(_LEASE_REDOS):
            # Streamed (issue 29): the states go from each chunk straight into the one tensor
            # handed to the trainer (a leased range is reused once released, so one copy is
            # needed; over HTTP the body is never held whole besides).
            stream = await rt.client.hidden_states_stream(body, lease_ok=lease_ok)
            try:
                hs, head = await _receive(stream)
                release = getattr(stream, "release", None)
                if release is not None:  # a whole lease: a 204 proves the bytes were ours while copied
                    await release()
            except LeaseExpiredError as exc:  # read under an expired lease: asked again over HTTP (cannot expire)
                log.warning("row %d: %s; asking again over HTTP", file_idx, exc)
                lease_ok = False
                continue
            except HsxError as exc:
                if not exc.retryable:
                    raise
                log.warning("row %d: %s; requesting it again", file_idx, exc)
                continue
            finally:
                await stream.aclose()
            ids = torch.from_numpy(np.array(head.token_ids, dtype=np.int64))
            try:
                check_sample(hs, ids, row_ids, rt.num_layers)
            except TokenMismatch as exc:
                if request is None:
                    raise
                raise ValueError(f"{exc}, for the chat of {image_requests.request_path(file_idx)}: the servers "
                                 "render it otherwise than when the table was made (another template or "
                                 "processor?)") from None
            return {"hidden_states": hs, "token_ids": ids}
        raise LeaseExpiredError(f"the lease expired {_LEASE_REDOS} times: raise the server's --lease-timeout "
                                "or use --hsx-transfer http")

    def _unavailable(self, file_idx: int, exc: Exception) -> None:
        reason = f"hsx: no hidden states for row {file_idx} of {self.settings.data_path}: {exc}"
        mode = self.settings.on_missing
        if mode in ("raise", "generate"):
            raise HsxSampleError(reason) from exc
        if mode == "warn":
            warnings.warn(reason, stacklevel=2)
        else:
            log.info(reason)
        return None

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise HsxSampleError("the hsx backend serves every row from get_cached; nothing is generated through vLLM")


def _add(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    if not any(a.dest == dest for a in parser._actions):  # noqa: SLF001 - as hs_connectors does
        parser.add_argument(flag, **kwargs)


if BACKEND_NAME not in HiddenStatesBackend.registry:

    @HiddenStatesBackend.register(BACKEND_NAME)
    class HsxBackend(HiddenStatesBackend):
        """Rows' states fetched from `hsx serve` over HTTP (or same-host shared memory).
        speculators copies only type, choices and help of these flags (no actions, no nargs)."""

        @staticmethod
        def add_train_args(parser: argparse.ArgumentParser) -> None:
            _add(parser, "--hsx-servers", type=str, default=None,
                 help="hsx servers, comma-separated URLs (env HSX_SERVER). API key: env HSX_API_KEY or --hsx-api-key-file")
            _add(parser, "--hsx-api-key-file", type=str, default=None,
                 help="file holding the hsx servers' API key (not a flag: speculators records flags in run.yaml)")
            _add(parser, "--hsx-timeout", type=float, default=600.0, help="seconds per hsx request (default 600)")
            _add(parser, "--hsx-max-attempts", type=int, default=10, help="attempts per row over the hsx servers (default 10)")
            _add(parser, "--hsx-transfer", type=str, choices=list(TRANSFERS), default=DEFAULTS.transfer,
                 help="auto: same-host hsx servers hand states over in shared memory; http: always HTTP bodies")
            _add(parser, "--hsx-layers", type=str, default=None,
                 help="layer ids to fetch (default: the corpus's, from hsx_corpus.json, else all served)")

        @staticmethod
        def add_launch_args(parser: argparse.ArgumentParser) -> None:
            """Nothing to launch: `hsx serve MODEL` is the server."""

        @staticmethod
        def from_train_args(args: argparse.Namespace, data_path: str) -> HsxTransfer:
            return HsxTransfer(settings_from_args(args, data_path))

        @staticmethod
        def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
            raise ValueError("the hsx backend needs no vLLM KV connector: serve the model with `hsx serve MODEL`")


def check_registered() -> None:
    """Raise when speculators collected its backend flags before this module registered hsx."""
    import sys

    resolution = sys.modules.get("speculators.train.config.resolution")
    if resolution is not None and BACKEND_NAME not in resolution._BACKEND_ACTIONS:  # noqa: SLF001
        raise RuntimeError("speculators' train config was imported before hsx_client.training.speculators_backend, so its "
                           "--hsx-* flags are missing: import hsx_client.training.speculators_backend first")
