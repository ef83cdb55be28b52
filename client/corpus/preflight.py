"""What `hsx extract` checks before any sample is sent, against the servers' /info and
the inputs (issue 10: a first run used to send every sample and fail each one), and the
served tokenizer's real token counts for the disk estimate. Each problem is one
ConfigError line (exit 2) that says what to change."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsx_client.corpus import disk_estimate, images
from hsx_client.corpus import plan as planning
from hsx_client.api import HsxClient
from hsx_client.errors import HsxError
from hsx_client.corpus.plan import ConfigError
from hsx_client.corpus.settings import CorpusSettings

if TYPE_CHECKING:
    from hsx_client.corpus.formats import CorpusFormat  # torch: not at this module's import


@dataclass
class TokenCounts:
    """What the servers' tokenizer says of a sample of the planned rows."""

    ratio: float  # real tokens / characters-estimated tokens, both before truncation
    kept: float  # share of the (truncated) tokens in rows that will be stored, not dropped


async def token_ratio(client: HsxClient, keys: list[str], samples: planning.Samples,
                      settings: CorpusSettings) -> TokenCounts | None:
    """Count up to COUNT_SAMPLE of `keys` with the servers' tokenizer (`POST /tokenize`,
    no prefill); None when the servers cannot count (an older server)."""
    pick = keys if len(keys) <= disk_estimate.COUNT_SAMPLE else random.Random(0).sample(keys, disk_estimate.COUNT_SAMPLE)
    max_len, trunc = settings.max_length, settings.truncation

    async def one(key: str) -> tuple[int, int, int, int] | None:
        body = dict(samples.by_key[key].request, id=key)
        if max_len:
            body.update(max_length=max_len, truncation=trunc if trunc != "error" else "right")
        try:
            if images.needs_inlining(body):
                body = await asyncio.to_thread(images.inline, body)
            answer = await client.tokenize(body)
        except HsxError as exc:
            if exc.status == 404:
                raise
            return None  # a bad row: the run will say so
        except images.ImageFileError:
            return None
        n, mask = len(answer["token_ids"]), answer.get("loss_mask")
        stored = 0 if mask is not None and not any(mask) else n
        before = int(answer.get("num_input_tokens") or n)
        return before, disk_estimate.estimate_tokens(body, None, None), n, stored

    try:
        counts = [c for c in await asyncio.gather(*(one(k) for k in pick)) if c is not None]
    except Exception:  # noqa: BLE001  (an estimate is best effort: never a reason to stop a run)
        return None
    est, cut = sum(c[1] for c in counts), sum(c[2] for c in counts)
    if not est or not cut:
        return None
    return TokenCounts(ratio=sum(c[0] for c in counts) / est, kept=sum(c[3] for c in counts) / cut)


def preflight(fmt: CorpusFormat, settings: CorpusSettings, info: dict[str, Any], infos: dict[str, dict[str, Any]]) -> None:
    """What the servers' /info says against what the run asks, before any sample is sent:
    each problem is one ConfigError line (exit 2) that says what to change."""
    served = [int(x) for x in info["layer_ids"]]
    problem = fmt.layer_problem(settings.layers, info.get("num_hidden_layers"), served)
    if problem:
        raise ConfigError(problem)
    k = settings.draft_vocab_size
    if k is not None:
        vocab = info.get("vocab_size")
        if vocab is None:
            raise ConfigError("--draft-vocab-size needs the target vocab size, which the server does not report")
        if not 1 <= int(k) <= int(vocab):
            raise ConfigError(f"--draft-vocab-size {k} must be in 1..{vocab} (the served model's vocab size)")
    limit = planning.servers_max_tokens(infos.values())
    if settings.max_length and limit and settings.max_length > limit:
        who = min(infos, key=lambda u: planning.servers_max_tokens([infos[u]]) or limit)
        raise ConfigError(
            f"--max-length {settings.max_length} exceeds the {limit} tokens {who} takes per request "
            "(its max_tokens_per_request): lower it, or leave it out to use the servers' limit"
        )
    if fmt.needs_final_norm and "final_norm" in info and info["final_norm"] is None:
        raise ConfigError(f"{settings.format} corpora need the final norm's weights, and the server could not "
                          "read them from the checkpoint (GET /final_norm)")


def wants_final_norm(fmt: CorpusFormat, info: dict[str, Any]) -> bool:
    """speculators keeps states pre-norm: it does not need /final_norm (its absence is no error)."""
    if fmt.needs_final_norm:
        return True
    return info.get("final_norm") is not None


def check_states_for_images(fmt: CorpusFormat, samples: planning.Samples) -> None:
    """A token table (`--states none`) stores an image chat's request for the online backend
    to send again while it trains (client/corpus/image_requests.py): an image given as a file
    or data: URI is in that request, but one at an http(s) URL is not (a server fetches it,
    when its operator allows): it may have changed or gone by then, so such chats are refused."""
    if getattr(fmt, "needs_states", True):
        return
    n = sum(1 for s in samples.by_key.values() if images.remote_images(s.request))
    if n:
        raise ConfigError(
            f"{n} planned sample(s) are chats with images at http(s) URLs, and --states none stores each image "
            "chat's request for the online backend to send again while it trains, where a remote image may have "
            "changed or gone: give the images as files or data: URIs, or extract with states (leave out --states none)"
        )


def check_chat_template(samples: planning.Samples, infos: dict[str, dict[str, Any]]) -> None:
    chats = sum(1 for s in samples.by_key.values() if "messages" in s.request and "chat_template" not in s.request)
    if not chats:
        return
    bare = [u for u, i in infos.items() if "chat_template_sha256" in i and not i["chat_template_sha256"]]
    if bare:
        raise ConfigError(
            f"{chats} planned sample(s) are chats and {', '.join(bare)} has no chat template (the model ships "
            "none): restart hsx serve with --chat-template FILE"
        )


async def servers_agree(client: HsxClient, info: dict[str, Any], notes: list[str]) -> dict[str, dict[str, Any]]:
    """Every answering server's /info, which must serve what the first one does (ConfigError
    naming the difference); a server that never answers is set aside and named in `notes`
    (one that is loading is the run loop's business)."""
    infos = await client.server_infos()
    for url in client.servers:
        if url not in infos:
            notes.append(f"warning: {url} did not answer /info ({client.stats()[url]['last_error']}); "
                         "going on with the others")
    keys = ("model", "model_revision", "layer_ids", "hidden_size", "dtype")
    for url, other in infos.items():
        diffs = [k for k in keys if other.get(k) != info.get(k)]
        if diffs:
            raise ConfigError(
                f"{url} serves something else than {client.servers[0]}: "
                + ", ".join(f"{k}={other.get(k)!r} vs {info.get(k)!r}" for k in diffs)
            )
    return infos or {client.servers[0]: info}
