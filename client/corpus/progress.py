"""Live progress of `hsx extract` on stderr (tqdm) and the end-of-run summary.

The bar counts this run's samples (done + failed + dropped) against what this run has to
do (not the whole plan: a resumed run never shows 100% with nothing done), so tqdm's ETA
is the samples ETA; the postfix shows tokens/s, MB/s on the wire and written to disk,
retries, errors, failed samples and per-server requests in flight. Rates are averages
since this run started (a resumed run counts only its own work).

The per-server counters of the summary are the requests of the fan-out alone: what the
client did before it (/info, the disk estimate's /tokenize calls) is subtracted, and with
--workers the worker processes' clients, which did the work, are added in (`add_server_stats`).
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, Callable, TextIO

from hsx.sizes import fmt_bytes


def _short(url: str) -> str:
    return url.split("://", 1)[-1]


class Progress:
    def __init__(
        self,
        total: int,
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        server_stats: Callable[[], dict[str, dict[str, Any]]] | None = None,
        min_interval: float = 0.5,
    ) -> None:
        self.total = total
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.server_stats = server_stats
        self.min_interval = min_interval
        self.start = time.monotonic()
        self.samples = 0
        self.failed = 0
        self.dropped = 0
        self.tokens = 0
        self.wire_bytes = 0
        self.written_bytes = 0
        self._last_refresh = 0.0
        # Counters before the fan-out (pre-flight requests), subtracted from what is shown.
        self._baseline = server_stats() if server_stats is not None else {}
        self._worker_servers: dict[str, dict[str, Any]] = {}  # --workers: their clients' counters
        self._bar = None
        if not quiet and total > 0:  # nothing to do: no bar (it would stand at 100% with 0 done)
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=self.stream, unit="sample", dynamic_ncols=True,
                             smoothing=0.05, desc="extract")

    # ------------------------------------------------------------------ updates
    def sample_done(self, *, tokens: int, wire_bytes: int, written_bytes: int) -> None:
        self.samples += 1
        self.tokens += tokens
        self.wire_bytes += wire_bytes
        self.written_bytes += written_bytes
        if self._bar is not None:
            self._bar.update(1)
        self.refresh()

    def sample_failed(self, dropped: bool = False) -> None:
        if dropped:
            self.dropped += 1
        else:
            self.failed += 1
        if self._bar is not None:
            self._bar.update(1)
        self.refresh()

    def write(self, msg: str) -> None:
        """A message that does not break the bar (--quiet hides the bar, not messages)."""
        if self._bar is not None:
            self._bar.write(msg, file=self.stream)
        else:
            print(msg, file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        return max(1e-9, time.monotonic() - self.start)

    def add_server_stats(self, stats: dict[str, dict[str, Any]]) -> None:
        """A worker process's client counters (HsxClient.stats()), added to this run's."""
        add_stats(self._worker_servers, stats)

    def servers(self) -> dict[str, dict[str, Any]]:
        """Per-server counters of this run's fan-out (see the module doc)."""
        if self.server_stats is None:
            return {}
        out = since(self.server_stats(), self._baseline)
        add_stats(out, self._worker_servers)
        return out

    def _totals(self) -> tuple[int, int]:
        retries = errors = 0
        for s in self.servers().values():
            retries += s.get("retries", 0)
            errors += s.get("errors", 0)
        return retries, errors

    def leases_expired(self) -> int:
        """Leases found expired at their release: each of those samples was asked again over HTTP."""
        return sum(s.get("leases_expired", 0) for s in self.servers().values())

    def postfix(self) -> str:
        el = self.elapsed
        retries, errors = self._totals()
        parts = [
            f"{self.tokens / el:,.0f} tok/s",
            f"wire {fmt_bytes(self.wire_bytes / el)}/s",
            f"disk {fmt_bytes(self.written_bytes / el)}/s",
        ]
        if retries:
            parts.append(f"retries {retries}")
        if errors:
            parts.append(f"errors {errors}")
        expired = self.leases_expired()
        if expired:
            parts.append(f"leases expired {expired}")
        if self.failed:
            parts.append(f"failed {self.failed}")
        if self.dropped:
            parts.append(f"dropped {self.dropped}")
        if self.server_stats is not None:
            st = self.server_stats()
            flights = " ".join(
                f"{_short(u)}:{s['in_flight']}{'' if s['healthy'] else '(down)'}" for u, s in st.items()
            )
            parts.append(f"in-flight {flights}")
        return ", ".join(parts)

    def refresh(self, force: bool = False) -> None:
        if self._bar is None:
            return
        now = time.monotonic()
        if not force and now - self._last_refresh < self.min_interval:
            return
        self._last_refresh = now
        self._bar.set_postfix_str(self.postfix(), refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self.refresh(force=True)
            self._bar.close()
            self._bar = None

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict[str, Any]:
        el = self.elapsed
        retries, errors = self._totals()
        return {
            "elapsed_s": round(el, 3),
            "samples_this_run": self.samples,
            "failed_this_run": self.failed,
            "dropped_this_run": self.dropped,
            "tokens_this_run": self.tokens,
            "samples_per_s": round(self.samples / el, 3),
            "tokens_per_s": round(self.tokens / el, 1),
            "wire_bytes": self.wire_bytes,
            "written_bytes": self.written_bytes,
            "wire_MB_per_s": round(self.wire_bytes / el / 1e6, 3),
            "written_MB_per_s": round(self.written_bytes / el / 1e6, 3),
            "retries": retries,
            "errors": errors,
            "leases_expired": self.leases_expired(),
            "servers": self.servers(),
        }


_GAUGES = ("in_flight",)  # a level, not a count: never subtracted or summed


def _counter(k: str, v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _GAUGES


def since(now: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """HsxClient.stats() `now` less the counters of `before` (the rest as they are now)."""
    return {url: {k: v - before.get(url, {}).get(k, 0) if _counter(k, v) else v for k, v in st.items()}
            for url, st in now.items()}


def add_stats(total: dict[str, dict[str, Any]], one: dict[str, dict[str, Any]]) -> None:
    """HsxClient.stats() of a worker added into `total`: counters summed per server, the
    rest (healthy, last_error, transfer) the latest seen."""
    for url, counters in one.items():
        mine = total.setdefault(url, {})
        for k, v in counters.items():
            summable = isinstance(v, (int, float)) and not isinstance(v, bool)
            mine[k] = mine.get(k, 0) + v if summable else v


def reason_counts(entries: Any, limit: int = 10) -> list[dict[str, Any]]:
    """failed.jsonl entries grouped by reason (the message with its numbers left out), most
    frequent first, each with one example sample key (its input file:line). The reason
    shows the real numbers: one where the group agrees, else their range ("from 530-2048
    to 511 tokens")."""
    groups: dict[str, dict[str, Any]] = {}
    for e in entries:
        head = f"{e.get('status')} {e.get('type')}: " if e.get("status") else ""
        text = head + str(e.get("message") or e.get("kind"))
        shape = _NUMBER.sub("N", text)[:200]
        g = groups.setdefault(shape, {"reason": shape, "count": 0, "example": e.get("key"), "_text": text,
                                      "_numbers": []})
        g["count"] += 1
        g["_numbers"].append([int(n) for n in _NUMBER.findall(text)])
    for g in groups.values():
        g["reason"] = _with_numbers(g.pop("_text"), g.pop("_numbers"))[:200]
    return sorted(groups.values(), key=lambda g: -g["count"])[:limit]


_NUMBER = re.compile(r"\d+")


def _with_numbers(text: str, rows: list[list[int]]) -> str:
    """`text` with its k-th number replaced by the k-th numbers of all `rows`: the value, or
    "lo-hi" where they differ."""
    columns = list(zip(*rows))
    k = iter(range(len(columns)))

    def one(m: re.Match) -> str:
        col = columns[next(k)]
        lo, hi = min(col), max(col)
        return str(lo) if lo == hi else f"{lo}-{hi}"

    return _NUMBER.sub(one, text)


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"status: {s.get('status')}  done {s.get('done')}/{s.get('planned')}  failed {s.get('failed')}"
        f"  dropped {s.get('dropped', 0)}  remaining {s.get('remaining')}",
        f"this run: {s.get('samples_this_run', 0)} samples, {s.get('tokens_this_run', 0):,} tokens in "
        f"{s.get('elapsed_s', 0):.1f}s ({s.get('samples_per_s', 0):.2f} samples/s, "
        f"{s.get('tokens_per_s', 0):,.0f} tok/s, wire {s.get('wire_MB_per_s', 0):.1f} MB/s, "
        f"disk {s.get('written_MB_per_s', 0):.1f} MB/s), retries {s.get('retries', 0)}, errors {s.get('errors', 0)}",
    ]
    for url, st in (s.get("servers") or {}).items():
        lines.append(
            f"  {url}: requests ok {st.get('ok')} refused {st.get('refused', 0)} retries {st.get('retries')}"
            f" errors {st.get('errors')}"
            f" {'healthy' if st.get('healthy') else 'UNHEALTHY: ' + str(st.get('last_error'))}"
        )
    if s.get("leases_expired"):
        lines.append(f"{s['leases_expired']} leases expired, asked again over HTTP (their states were not taken out "
                     "in time: a loaded box, or a short server --lease-timeout)")
    if s.get("truncated"):
        lines.append(f"cut: {s['truncated']} stored sample(s) were longer than --max-length {s.get('max_length')} "
                     f"and cut ({s.get('truncation')} truncation)")
    if s.get("tools_not_rendered"):
        lines.append(f"warning: {s['tools_not_rendered']} sample(s) carry tool definitions (`tools`) that the "
                     "server's chat template does not render: their tokens hold no tools (serve a template "
                     "that renders them: hsx serve --chat-template FILE)")
    for what in ("dropped", "failed"):
        for r in s.get(f"{what}_reasons") or []:
            lines.append(f"{what}: {r['count']} x {r['reason']}" + (f" (e.g. {r['example']})" if r.get("example") else ""))
    bad = s.get("bad_rows") or 0
    if bad:
        kinds = ", ".join(f"{n} {k}" for k, n in (s.get("bad_row_kinds") or {}).items())
        lines.append(f"bad input rows: {bad} skipped ({kinds}); listed in {s.get('bad_rows_file')}")
        for b in s.get("bad_row_examples") or []:
            lines.append(f"  {b['source']}: {b['reason']}")
    if s.get("message"):
        lines.append(str(s["message"]))
    return "\n".join(lines)
