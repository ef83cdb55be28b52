"""POST /hidden_states, end to end: validate, admit, prefill, then the reply, in the shape
decided once (`_lease_terms`) and built by replies.py.

Who frees what: the request's admission ticket belongs to the guard middleware (it
enters the gate and leaves it when the response has ended); the arena range belongs to
the request's `Reservation`, which `Reply.close` releases, unless the engine took it
over after a failure or it was handed over to a same-host lease.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from dataclasses import dataclass

import numpy as np

from hsx import __version__ as hsx_version
from hsx.dtypes import st_code
from hsx.protocol.lease import SendReport
from hsx.wire import FORMAT, TensorSpec
from hsx_service.core.admission import AdmissionGate, Ticket
from hsx_service.engine.arena import Reservation
from hsx_service.engine.prefill import PrefillEngine
from hsx_service.engine.window import StreamWindow
from hsx_service.core.errors import BadInput, NoSupervisedTokens, TooLarge
from hsx_service.engine.lease import Leases
from hsx_service.core.metrics import Metrics
from hsx_service.core.schema import HiddenStatesRequest
from hsx_service.media.chat_media import ChatMedia
from hsx_service.media.limits import MediaLimits
from hsx_service.body.compress import CompressPool, default_threads
from hsx_service.replies import LeaseTerms, Outgoing, Replies, Reply
from hsx_service.settings import ServiceSettings
from hsx_service.text_bounds import check_message_count, check_text_bytes, default_max_text_bytes, is_long
from hsx_service.tokenize import Encoded
from hsx_service.tokenize_pool import TokenizerPool

log = logging.getLogger("hsx.serving")


@dataclass
class Prepared:
    encoded: Encoded
    layer_ids: list[int]  # the model's layer ids, as HTTP's `layers` names them
    layer_positions: list[int]  # the same layers' positions among the captured ones (the engine's)
    input_tokens: int  # before truncation (the reply's metadata says so: the client counts cut rows)


class HiddenStatesService:
    def __init__(self, settings: ServiceSettings, prefill: PrefillEngine, tokenizer: TokenizerPool, metrics: Metrics,
                 gate: AdmissionGate, http_workers: int = 0):
        self.settings = settings
        self.prefill = prefill
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.gate = gate
        self.facts = prefill.facts
        assert self.facts is not None
        f = self.facts
        # The model as every answer names it (/info, /tokenize, each body's metadata), made once.
        self.card = {
            "model": f.served_model_name,
            "model_path": f.model,
            "model_revision": f.revision or "",
            "num_hidden_layers": f.num_hidden_layers,
            "hidden_size": f.hidden_size,
            "dtype": f.dtype,
            "vllm_version": f.vllm_version,
            "hsx_version": hsx_version,
        }
        self.max_tokens = min(
            settings.max_tokens_per_request or self.facts.max_model_len - 1, self.facts.max_model_len - 1
        )
        # Text beyond what max_tokens could ever need is work without use: refused before any
        # templating or tokenizing, on every route that takes text (text_bounds.py).
        self.max_text_bytes = settings.max_text_bytes or default_max_text_bytes(self.max_tokens)
        self.media = ChatMedia(MediaLimits.from_settings(settings), lambda: prefill.engine,
                                getattr(getattr(prefill, "vllm_config", None), "model_config", None), f.architecture,
                                settings.request_timeout)
        self.compress = CompressPool(settings.compress_threads or default_threads(), settings.compress_inflight,
                                     settings.zstd_level, frame_threads=settings.zstd_frame_threads)
        self.leases: Leases | None = None
        # HTTP workers (http_worker.py) take their states under leases of their own, so the
        # lease table exists with them even where clients get none (--shm-lease false).
        if settings.shm_lease or http_workers:
            self.leases = Leases(settings.lease_timeout, on_end=lambda outcome: metrics.leases.labels(outcome).inc(),
                                 per_session=settings.lease_max_per_session,
                                 arena_bytes=prefill.allocator.size if prefill.allocator is not None else None)
        self.replies = Replies(prefill, self.compress, metrics, settings.lease_timeout)
        # Chunked saves whose responses are still open: the drain's cut-off ends them (`cut_off`).
        self._windows: weakref.WeakSet[StreamWindow] = weakref.WeakSet()
        gate.engine_dead = lambda: prefill.dead
        allocator = prefill.allocator
        metrics.engine_running.set_function(lambda: prefill.engine_running)
        metrics.leases_live.set_function(lambda: len(self.leases) if self.leases is not None else 0)
        metrics.arena_used.set_function(lambda: allocator.used if allocator is not None else 0)

    def cut_off(self) -> None:
        """The drain's --shutdown-timeout is over: every chunked response still open ends now
        (its stream says 503: send the sample elsewhere) and every lease ends, so that a
        client that stopped reading or releasing holds the stop no longer."""
        for window in list(self._windows):
            window.cut("the server shut down before this sample's chunks were sent (--shutdown-timeout); "
                       "send it to another server")
        if self.leases is not None:
            self.leases.end_all()

    @property
    def busy(self) -> int:
        """Requests in progress plus live leases: what a drain waits for (a same-host
        client still reading its states would otherwise see the server go first)."""
        return self.gate.in_flight + (len(self.leases) if self.leases is not None else 0)

    # ------------------------------------------------------------------ validation
    def _layers(self, asked: list[int] | None) -> tuple[list[int], list[int]]:
        """The layer ids asked for (all served ones when none) and their positions among them."""
        served = self.facts.layer_ids
        if asked is None:
            return served, list(range(len(served)))
        unknown = sorted(set(asked) - set(served))
        if unknown:
            raise BadInput(f"layers {unknown} are not served; this server captures layers {served}")
        ids = sorted(set(asked))
        return ids, [served.index(k) for k in ids]

    def _check_text(self, req: HiddenStatesRequest) -> int:
        """Refuses a request template the server does not run, too many messages or too much
        text; returns its text bytes."""
        if req.chat_template is not None and not self.settings.trust_request_chat_template:
            raise BadInput("this server does not run request-supplied chat templates (a template is code); "
                           "leave chat_template out to use the server's, or start it with "
                           "--trust-request-chat-template")
        check_message_count(req.messages, self.settings.max_messages)
        return check_text_bytes(req, self.max_text_bytes)

    async def _encode(self, req: HiddenStatesRequest, client: str = "") -> Encoded:
        if req.input_ids is not None:  # never waits for the tokenizer pool
            vocab = self.facts.vocab_size
            bad = next((t for t in req.input_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadInput(f"input id {bad} is outside the vocabulary 0..{vocab - 1}")
            mask = list(req.loss_mask) if req.loss_mask is not None else None
            return Encoded(list(req.input_ids), mask, "request" if mask is not None else "none")
        limit = self._limit(req)
        # Refused past the limit: tokenizing stops there (Encoded.complete), however long the text.
        bounds = {"client": client, "long": is_long(self._check_text(req), limit),
                  "most": limit if req.truncation == "error" else None}
        if req.prompt is not None:
            keep = limit if req.truncation == "right" else None
            return await self.tokenizer.encode("prompt", req.prompt, req.add_special_tokens, keep, **bounds)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        return await self.tokenizer.encode("chat", messages, req.tools, req.chat_template, req.assistant_mask,
                                           req.chat_template_kwargs, **bounds)

    def _limit(self, req: HiddenStatesRequest) -> int:
        return min(req.max_length or self.max_tokens, self.max_tokens)

    def _truncate(self, enc: Encoded, req: HiddenStatesRequest) -> Encoded:
        limit = self._limit(req)
        n = len(enc.token_ids)
        if n == 0:
            raise BadInput("the input tokenizes to zero tokens")
        if n <= limit:
            return enc
        if req.truncation == "error":
            who = "max_length" if req.max_length and req.max_length <= self.max_tokens else "this server's limit"
            count = str(n) if enc.complete else f"more than {limit}"
            raise TooLarge(
                f"{count} tokens exceed {who} of {limit} tokens (max_model_len {self.facts.max_model_len}); "
                "send truncation='right' or 'left' to cut, or a shorter input"
            )
        sl = slice(0, limit) if req.truncation == "right" else slice(n - limit, n)
        mask = enc.loss_mask[sl] if enc.loss_mask is not None else None
        return Encoded(enc.token_ids[sl], mask, enc.mask_source)

    @staticmethod
    def _check_supervised(enc: Encoded, req: HiddenStatesRequest, input_tokens: int) -> None:
        """A training row must have a supervised token (shared/DESIGN.md); refusing here,
        before admission and the prefill, makes a row that truncation emptied cheap."""
        if req.require_supervised and enc.loss_mask is not None and not any(enc.loss_mask):
            cut = (f" after {req.truncation} truncation from {input_tokens} to {len(enc.token_ids)} tokens"
                   if input_tokens > len(enc.token_ids) else "")
            raise NoSupervisedTokens(f"no supervised token{cut}: the loss mask is all zero")

    async def prepare(self, req: HiddenStatesRequest, client: str = "") -> Prepared:
        """`client`: who sends it (guard.py names it), for a fair share of the tokenizer processes."""
        layer_ids, layer_positions = self._layers(req.layers)
        req, images = await self.media.take(req)  # loaded and decoded; placeholders in the messages
        enc = await self._encode(req, client)  # templating and tokenizing: in the pool's processes
        cut = self._truncate(enc, req)
        if images:  # the model's processor expands each placeholder to its image's tokens
            cut = await self.media.expand(cut, images, len(enc.token_ids), self._limit(req))
        self._check_supervised(cut, req, len(enc.token_ids))
        return Prepared(cut, layer_ids, layer_positions, len(enc.token_ids))

    async def tokenize(self, req: HiddenStatesRequest, request_id: str, client: str = "") -> dict:
        """POST /tokenize: the token ids and loss mask /hidden_states would prefill for
        this body (same template, masks, truncation), without the engine: the token
        table of an online-training corpus costs no GPU pass (`hsx extract --states none`).
        The guard's gate door refuses it while draining, as it does /hidden_states."""
        prep = await self.prepare(req, client)
        enc = prep.encoded
        return {
            "token_ids": enc.token_ids,
            "loss_mask": enc.loss_mask,
            "loss_mask_source": enc.mask_source,
            **({"media_mask": enc.media_mask} if enc.media_mask is not None else {}),
            "layer_ids": prep.layer_ids,
            "model": self.card["model"],
            "model_revision": self.card["model_revision"],
            "chat_template_sha256": self.template_sha256(req),
            "request_id": request_id,
            "caller_id": req.id or "",
            "num_input_tokens": prep.input_tokens,
        }

    # ------------------------------------------------------------------- the request
    async def run(self, req: HiddenStatesRequest, request_id: str, ticket: Ticket, coding: str,
                  lease: bool = False, session: str | None = None, http_worker: bool = False) -> Reply:
        """Prepare, admit (`ticket`), prefill; raises ServiceError on refusal. `lease`:
        answer with a lease on the arena range instead of the states' bytes (lease.py);
        the range then lives until the lease is released or expires. `http_worker`: the lease is
        an HTTP worker's (http_worker.py), which sends the body itself. `coding`: identity,
        zstd or bf16split (negotiate.choose_coding)."""
        t_start = time.perf_counter()
        prep = await self.prepare(req, ticket.client)
        # Counted with tokenize, for requests that pass it (a refused input runs no phase).
        # wait: body parsed and validated, the handler scheduled; long on a saturated loop.
        self.metrics.phase.labels("wait").observe(t_start - ticket.entered)
        self.metrics.phase.labels("tokenize").observe(time.perf_counter() - t_start)
        ids = prep.encoded.token_ids
        ticket.admit(len(ids))
        reservation = self.prefill.reserve(len(ids), len(prep.layer_ids))
        if isinstance(reservation, StreamWindow):
            self._windows.add(reservation)
        started = time.perf_counter()
        try:
            with_images = {"prompt": prep.encoded.engine_input} if prep.encoded.engine_input is not None else {}
            timing = await self.prefill.extract(ids, prep.layer_positions, reservation, request_id, **with_images)
        except asyncio.CancelledError:  # a hang-up or the drain's cut-off: the route counts it
            reservation.release()
            raise
        except BaseException:
            reservation.release()  # does nothing when the engine took the range over
            self.metrics.requests.labels("error").inc()
            raise
        for phase, seconds in timing.items():
            self.metrics.phase.labels(phase).observe(seconds)
        terms = self._lease_terms(lease, reservation, session, http_worker)
        sample = self._outgoing(req, prep, request_id, started)
        if terms is None:
            return self.replies.body(sample, reservation, coding)
        if isinstance(reservation, StreamWindow):
            return self.replies.lease_stream(sample, reservation, terms)
        return self.replies.lease(sample, reservation, terms)

    def _lease_terms(self, asked: bool, reservation: Reservation | StreamWindow, session: str | None,
                     http_worker: bool) -> LeaseTerms | None:
        """The one decision whether this reply is a lease, and on what terms: None (an HTTP
        body) unless a lease was asked for and the server keeps leases; an HTTP worker's is
        always granted, a client's only within its session's caps."""
        if not asked or self.leases is None:
            return None
        if not http_worker and not self._admit_client_lease(reservation, session):
            return None
        return LeaseTerms(self.leases, session, http_worker)

    def _admit_client_lease(self, reservation: Reservation | StreamWindow, session: str) -> bool:
        """Whether a client's lease of this range fits its session's caps (Leases.may_lease);
        beyond them the answer is an HTTP body: nothing waits, nothing is pinned. A lease
        stream's window is counted here, in the same step as the check: its chunk leases come
        later, so streams admitted together overshot the half-arena cap by a window."""
        assert self.leases is not None
        capped = self.leases.may_lease(session, reservation.extent.reserved)
        if capped is not None:
            self.metrics.leases.labels(f"refused_{capped}").inc()
            return False
        if isinstance(reservation, StreamWindow):
            reservation.when_freed(self.leases.hold(session, reservation.extent.reserved).release)
        return True

    def _outgoing(self, req: HiddenStatesRequest, prep: Prepared, request_id: str, started: float) -> Outgoing:
        """What every reply shape sends of this sample: the states' spec, the tensors after them,
        the metadata and the headers."""
        t_send = time.perf_counter()  # the send phase counts the reply's build
        f = self.facts
        ids = prep.encoded.token_ids
        n = len(ids)
        states = TensorSpec("hidden_states", st_code(f.dtype), (n, len(prep.layer_ids), f.hidden_size))
        specs = [TensorSpec("token_ids", "I64", (n,))]
        parts: list = [np.asarray(ids, dtype=np.int64).tobytes()]
        if prep.encoded.loss_mask is not None:
            specs.append(TensorSpec("loss_mask", "U8", (n,)))
            parts.append(np.asarray(prep.encoded.loss_mask, dtype=np.uint8).tobytes())
        if prep.encoded.media_mask is not None:  # a chat with images: 1 on each image token
            specs.append(TensorSpec("media_mask", "U8", (n,)))
            parts.append(np.asarray(prep.encoded.media_mask, dtype=np.uint8).tobytes())
        headers = {"X-Request-Id": request_id, "X-Hsx-Num-Tokens": str(n)}
        return Outgoing(states, specs, parts, self._metadata(req, prep, request_id), headers, n, started, t_send)

    def template_sha256(self, req: HiddenStatesRequest) -> str:
        """The server's chat template's hash when it rendered this input (a chat without a
        template of its own), else ""."""
        return (self.tokenizer.template_sha256 or "") if req.messages and not req.chat_template else ""

    def _metadata(self, req: HiddenStatesRequest, prep: Prepared, request_id: str) -> dict[str, str]:
        return {
            "format": FORMAT,
            **self.card,
            "layer_ids": json.dumps(prep.layer_ids),
            "last_layer_pre_norm": "true",
            "loss_mask_source": prep.encoded.mask_source,
            "request_id": request_id,
            "caller_id": req.id or "",
            "chat_template_sha256": self.template_sha256(req),
            "num_input_tokens": prep.input_tokens,
        }

    def release_lease(self, lease_id: str, report: SendReport | None = None) -> bool:
        """A client's release (True: its read was valid), or an HTTP worker's, with its report."""
        return self.leases is not None and self.leases.release(lease_id, detail=report)
