"""The figures of a `hsx bench` run as a table, and the ratios between the modes."""

from __future__ import annotations

from typing import Any

from hsx.sizes import fmt_bytes

MODE_NAMES = {"a": "plain prefill", "b": "vLLM file connector", "c": "hsx end to end"}


def ratios(modes: dict[str, Any]) -> dict[str, float | None]:
    def r(x: str, y: str) -> float | None:
        if x in modes and y in modes and modes[y].get("tokens_per_s"):
            return modes[x]["tokens_per_s"] / modes[y]["tokens_per_s"]
        return None

    return {"c_over_a": r("c", "a"), "c_over_b": r("c", "b"), "b_over_a": r("b", "a")}


def format_table(result: dict[str, Any]) -> str:
    modes, rat = result["modes"], result["ratios"]
    per_token = len(result["layers"]) * result["model"]["hidden_size"] * result["itemsize"]
    lines = [
        f"model {result['model']['num_hidden_layers']} layers x {result['model']['hidden_size']} hidden "
        f"({result['dtype']}), {result['prompts']['count']} prompts x {result['prompts']['length']} tokens, "
        f"layers {result['layers']}, concurrency {result['concurrency']}, codec {result['codec']}, "
        f"transfer {result.get('transfer', 'http')}",
        f"{'mode':<26}{'tokens/s':>12}{'GB/s states':>13}{'vs (a)':>8}{'vs (b)':>8}{'time s':>9}  engine peak RSS / PSS",
    ]
    for m in ("a", "b", "c"):
        if m not in modes:
            continue
        d = modes[m]
        tps = d["tokens_per_s"]
        va = tps / modes["a"]["tokens_per_s"] if "a" in modes else None
        vb = tps / modes["b"]["tokens_per_s"] if "b" in modes else None
        mem = d.get("engine_memory") or {}
        gbs = tps * per_token / 1e9
        lines.append(
            f"{'(' + m + ') ' + MODE_NAMES[m]:<26}{tps:>12,.0f}{gbs:>12.3f}{'*' if m == 'a' else ' '}"
            f"{(f'{va:.3f}' if va else '-'):>8}{(f'{vb:.3f}' if vb else '-'):>8}{d['measured_s']:>9.2f}  "
            f"{fmt_bytes(mem.get('peak_rss_sum'))} / {fmt_bytes(mem.get('peak_pss_sum'))}"
        )
    lines.append("* (a) extracts nothing: its GB/s is what that token rate would carry")
    if "b" in modes:
        b = modes["b"]
        lines.append(f"(b) engine alone {b['engine_tokens_per_s']:,.0f} tokens/s ({b['engine_s']:.2f}s), read-back "
                     f"{b['readback_s']:.2f}s of {fmt_bytes(b['file_bytes'])} files in {b['states_dir']}")
    if "c" in modes:
        c = modes["c"]
        lines.append(
            f"(c) wire {fmt_bytes(c['wire_bytes'])} vs raw states {fmt_bytes(c['hs_bytes'])} "
            f"(ratio {c['hs_bytes'] / max(c['wire_bytes'], 1):.3f}x); finalize {c.get('finalize_s') or 0:.2f}s "
            f"-> {c['tokens_per_s_with_finalize']:,.0f} tokens/s with it; corpus "
            f"{c['corpus'].get('rows')} rows, {fmt_bytes(c['corpus'].get('disk_bytes'))}"
        )

        def rate(d: dict[str, Any]) -> str:  # "N tokens/s = R of (a)"
            tps = d["tokens_per_s"]
            return f"{tps:,.0f} tokens/s" + (f" = {tps / modes['a']['tokens_per_s']:.3f} of (a)" if "a" in modes else "")

        for t, one in (c.get("by_transfer") or {}).items():
            cm1 = one.get("client_memory") or {}
            lines.append(f"(c) transfer {t}: {rate(one)}, wire {fmt_bytes(one['wire_bytes'])}, client peak RSS "
                         f"{fmt_bytes(cm1.get('peak_rss'))} (budget {fmt_bytes(cm1.get('max_buffer_bytes'))})")
        for t, one in (c.get("by_transfer") or {}).items():
            prof = _http_profile(t, one) if t.startswith("http") else None
            if prof:
                lines.append(prof)
        if c.get("server_http_only"):
            lines.append(f"(c) profile: server + HTTP + decompression alone (bodies dropped) {rate(c['server_http_only'])}")
        if c.get("server_lease_only"):
            lines.append(f"(c) profile: server + leases alone (released unread) {rate(c['server_lease_only'])}")
        if c.get("soak"):
            sk = c["soak"]
            pts = ", ".join(f"{k} {fmt_bytes(v['rss'])} (API {fmt_bytes(v['root_rss'])})"
                            for k, v in sk["points"].items())
            lines.append(f"(c) RSS soak, {sk['requests']} more requests ({sk.get('transfer', 'http')}, "
                         f"{sk['tokens_per_s']:,.0f} tokens/s): server tree {pts}")
        cm, em = c.get("client_memory") or {}, c.get("engine_memory") or {}
        lines.append(f"(c) server: API process peak RSS {fmt_bytes(em.get('root_peak_rss'))}, whole tree "
                     f"{fmt_bytes(em.get('peak_rss_sum'))} RSS / {fmt_bytes(em.get('peak_pss_sum'))} PSS; "
                     f"client peak RSS {fmt_bytes(cm.get('peak_rss'))} (budget {fmt_bytes(cm.get('max_buffer_bytes'))})")
    parts = [f"{k.replace('_over_', '/')} = {v:.3f}" for k, v in rat.items() if v is not None]
    if parts:
        lines.append("ratios: " + ", ".join(parts))
    return "\n".join(lines)



# The client profile's phases of a sample's life, in order: (JSON key, printed label).
CLIENT_PHASES = (("response_s", "to headers"), ("receive_s", "receive"), ("decode_s", "decode"), ("store_s", "store"))


def _http_profile(transfer: str, one: dict[str, Any]) -> str | None:
    """The HTTP path per phase, mean seconds per request: where the next bottleneck is.
    Server: wait (body read -> handler running), engine (queue + prefill), copy (into the
    arena), compress (pool time in the body's coding), send (reply start to last byte
    handed over; minus compress = waiting on the wire and the client), and the event
    loop's mean lag over the run (every request, write and engine output waits it).
    Client: each sample's life (taken by a request loop -> stored) split into to headers
    (request sent -> response headers: the server's phases and the wire), receive (headers
    to last byte), decode (decompress + checks), store (encode, write, fsync, manifest) and
    what none of them covers; beside it the life Little's law implies (in flight x run time
    / samples): well above the measured life, samples wait before any request loop takes
    them."""
    sp, cp = one.get("server_phases") or {}, one.get("client_profile")
    if not sp and not cp:
        return None
    parts = [f"{k} {sp[k]['mean_s']:.3f}"
             for k in ("wait", "tokenize", "engine", "copy", "compress", "encode_identity", "send") if k in sp]
    if "send" in sp:
        work = (sp.get("compress") or sp.get("encode_identity") or {}).get("mean_s", 0.0)
        parts.append(f"wire (send - coding) {max(0.0, sp['send']['mean_s'] - work):.3f}")
    if "loop_lag" in sp:
        parts.append(f"event loop lag {sp['loop_lag']['mean_s']:.4f}")
    line = f"(c) HTTP profile [{transfer}, {one.get('compression')}], mean s per request: server " + ", ".join(parts)
    if cp:
        phases = [(label, cp[k]) for k, label in CLIENT_PHASES if k in cp]
        line += "; client " + ", ".join(f"{label} {s:.3f}" for label, s in phases)
        if cp.get("life_s"):
            rest = cp["life_s"] - sum(s for _, s in phases)
            line += f", other {max(0.0, rest):.3f} of a life of {cp['life_s']:.3f}"
        line += f" (at {cp.get('concurrency')} in flight"
        if cp.get("implied_life_s"):
            line += f", Little's law: {cp['implied_life_s']:.3f}"
        line += ")"
    if one.get("start_s") is not None:  # not in the figure: planning and the worker processes' start
        line += f"; before the clock {one['start_s']:.1f} s"
    if one.get("teardown_s"):  # not in the figure either: the worker processes closing after the last sample
        line += f", after it {one['teardown_s']:.1f} s"
    return line
