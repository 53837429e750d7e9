"""The servers of `bench/speculative.py` and its requests, alone or in company: the concurrent
mode (`--concurrent 1,4,8`, issue 51) sends N different edit-shaped requests at once
(`specshapes.edit_tasks`: the same conversation on N methods, so the replies differ), greedy,
to each of prefixd (speculation on), prefixd-off (`PREFIXD_SPECULATIVE=false`) and stock
`mlx_lm.server`, all up at once as for the shapes, each idle while another answers
(`--repeats` bursts per N and server, in turn).

Per N and server:
- decode tok/s (aggregate): the tokens after each reply's first, summed, / the time from the
  burst's first first token to its last reply's end (median over the bursts);
- TPOT: each reply's time per output token after its first, (end - first token) /
  (completion tokens - 1), median over the requests of every burst; first token: median;
- accepted / drafted: the requests' `prefixd.speculative` counts, summed (the last burst);
  verify passes: the worker's (`GET /v1/cache` `speculative.verify_passes`: a batch's pass
  counted once) over that burst, in brackets the requests' own (one for each member a pass
  verified);
- replies = off / = stock: the requests whose reply is prefixd-off's (stock's) reply to the
  same request in the same N's burst, token for token (the text of a greedy reply).
The issue's target: N = 4 with speculation >= 1.5x the same without (prefixd / off), the
replies equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from multiturn import Server, get_json, start_server, stop_server, stream_chat, wait_ready
from specshapes import edit_tasks

SERVERS: dict[str, tuple[str, dict[str, str], bool]] = {
    # name: (kind, env, whether it gets a draft model: the served model itself)
    "prefixd": ("prefixd", {}, False),
    "prefixd-off": ("prefixd", {"PREFIXD_SPECULATIVE": "false"}, False),
    "prefixd-draft": ("prefixd", {}, True),
    "stock": ("stock", {}, False),
    "stock-draft": ("stock", {}, True),
}
COMPANY = ("prefixd", "prefixd-off", "stock")


def body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def measure(port: int, text: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    reply, usage, ttft, total = stream_chat(port, body(text, max_tokens), timeout=900)
    n = int(usage.get("completion_tokens", 0))
    spec = (usage.get("prefixd") or {}).get("speculative") or {}
    return {"text": reply, "tokens": n, "ttft": ttft, "decode_s": total - ttft,
            "rate": (n - 1) / (total - ttft) if n > 1 and total > ttft else None,
            "drafted": spec.get("drafted"), "accepted": spec.get("accepted"),
            "passes": spec.get("passes"), "model_drafted": spec.get("model_drafted")}


def start_servers(model_dir: Path, names: list[str], args: argparse.Namespace,
                  servers: dict[str, Server]) -> dict[str, Any]:
    """Every server of `names` on `model_dir` started into `servers` (the caller stops them,
    by PID, also when this raises), then each waited for and warmed up: {name: {}}, or
    {name: {"refused": why, "log": its log's line}} for one that would not start."""
    for name in names:
        kind, env, draft = SERVERS[name]
        if draft and kind == "prefixd":
            env = {**env, "PREFIXD_SPEC_DRAFT_MODEL": str(model_dir)}
        ns = argparse.Namespace(prefixd_env={"PREFIXD_DISK_CACHE_BYTES": "0", **env},
                                kv_bits=None, out=args.out / "speculative-logs")
        extra = ("--draft-model", str(model_dir)) if draft and kind == "stock" else ()
        servers[name] = start_server(kind, model_dir, ns, extra=extra, label=name)
    out: dict[str, Any] = {}
    for name, server in servers.items():
        out[name] = {}
        try:
            wait_ready(server)
            stream_chat(server.port, body([{"role": "user", "content": "warm up"}], 4),
                        timeout=300)
        except RuntimeError as e:       # stock refusing a draft model on a hybrid
            out[name] = {"refused": str(e)[:300], "log": _log_tail(args, model_dir, name)}
    return out


def _log_tail(args: argparse.Namespace, model_dir: Path, name: str) -> str:
    path = args.out / "speculative-logs" / "logs" / f"{model_dir.name}-{name}.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    hits = [ln for ln in lines if "Speculative" in ln or "Error" in ln]
    return (hits or lines[-3:] or [""])[-1][:300]


def _verify_passes(port: int) -> int | None:
    spec = get_json(port, "/v1/cache").get("speculative") or {}
    return spec.get("verify_passes")


def burst(port: int, texts: list[list[dict[str, str]]], max_tokens: int,
          worker: bool) -> dict[str, Any]:
    """`texts` sent at once: each reply (its first token and end in s from the burst's start;
    an error is a result), the aggregate decode rate, the worker's verify passes over it."""
    before = _verify_passes(port) if worker else None
    t0 = time.perf_counter()

    def one(text: list[dict[str, str]]) -> dict[str, Any]:
        sent = time.perf_counter() - t0
        try:
            r = measure(port, text, max_tokens)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:300]}
        return {**r, "first": sent + r["ttft"], "end": sent + r["ttft"] + r["decode_s"]}

    with ThreadPoolExecutor(len(texts)) as pool:
        replies = list(pool.map(one, texts))
    wall = time.perf_counter() - t0
    after = _verify_passes(port) if worker else None
    ok = [r for r in replies if "error" not in r]
    span = (max(r["end"] for r in ok) - min(r["first"] for r in ok)) if ok else 0.0
    after_first = sum(r["tokens"] - 1 for r in ok if r["tokens"] > 1)
    return {"replies": replies, "wall_s": wall, "rate": after_first / span if span > 0 else None,
            "verify_passes": after - before if after is not None and before is not None
            else None}


def summary(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """One N's bursts on one server: medians, the last burst's counts and replies."""
    rates = [b["rate"] for b in bursts if b["rate"]]
    done = [r for b in bursts for r in b["replies"] if "error" not in r]
    tpots = [r["decode_s"] / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    last = bursts[-1]["replies"]

    def total(key: str) -> int | None:
        got = [r[key] for r in last if r.get(key) is not None]
        return sum(got) if got else None

    return {"n": len(last), "rate": statistics.median(rates) if rates else None,
            "tpot": statistics.median(tpots) if tpots else None,
            "ttft": statistics.median([r["ttft"] for r in done]) if done else None,
            "wall_s": statistics.median(b["wall_s"] for b in bursts),
            "tokens": total("tokens"), "drafted": total("drafted"),
            "accepted": total("accepted"), "passes": total("passes"),
            "verify_passes": bursts[-1]["verify_passes"],
            "errors": [r["error"] for b in bursts for r in b["replies"] if "error" in r],
            "texts": [r.get("text") for r in last]}


def run_company(model_dir: Path, names: list[str], args: argparse.Namespace, ns: list[int],
                max_tokens: int) -> dict[str, Any]:
    """The concurrent mode on one model: {server: {"concurrent": {N: summary}}}, every N's
    replies compared with prefixd-off's and stock's."""
    names = [n for n in names if n in COMPANY]
    tasks = edit_tasks(max(ns))
    servers: dict[str, Server] = {}
    try:
        out = start_servers(model_dir, names, args, servers)
        live = [n for n in names if "refused" not in out[n]]
        for n in ns:
            bursts: dict[str, list[dict[str, Any]]] = {name: [] for name in live}
            for _ in range(args.repeats):
                for name in live:
                    bursts[name].append(burst(servers[name].port, tasks[:n], max_tokens,
                                              SERVERS[name][0] == "prefixd"))
            for name in live:
                r = out[name].setdefault("concurrent", {})[n] = summary(bursts[name])
                print(f"  {model_dir.name} {name} N={n}: {_f(r['rate'])} tok/s decode, TPOT "
                      f"{_f(r['tpot'] and 1000 * r['tpot'])} ms, drafted {r['drafted']} "
                      f"accepted {r['accepted']}, {len(r['errors'])} errors "
                      f"{r['errors'][:1]}", flush=True)
            for name in live:
                r = out[name]["concurrent"][n]
                for base in ("prefixd-off", "stock"):
                    theirs = out.get(base, {}).get("concurrent", {}).get(n)
                    r[f"same_{base}"] = None if theirs is None else sum(
                        a is not None and a == b
                        for a, b in zip(r["texts"], theirs["texts"], strict=True))
    finally:
        for server in servers.values():
            stop_server(server)
    return out


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def company_table(model: str, results: dict[str, Any], ns: list[int]) -> str:
    head = ("| N | server | decode tok/s | / off | TPOT ms (median) | first token s (median) | "
            "wall s | tokens | accepted / drafted | verify passes (per request) | "
            "replies = off | replies = stock |")
    lines = [f"### {model}: N edit-shaped requests at once", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    ratios = {}
    for n in ns:
        off = results.get("prefixd-off", {}).get("concurrent", {}).get(n, {})
        for name, res in results.items():
            r = res.get("concurrent", {}).get(n)
            if r is None:
                continue
            ratio = r["rate"] / off["rate"] if r["rate"] and off.get("rate") else None
            if name == "prefixd":
                ratios[n] = (ratio, r.get("same_prefixd-off"), r.get("same_stock"), r["n"])
            acc = (f"{r['accepted']} / {r['drafted']}" if r["drafted"] is not None else "-")
            passes = (f"{_f(r['verify_passes'], 'd')} ({r['passes']})"
                      if r["passes"] is not None else "-")
            same = [f"{_f(r.get(f'same_{b}'), 'd')}/{r['n']}" for b in ("prefixd-off", "stock")]
            lines.append(f"| {n} | {name} | {_f(r['rate'])} | {_f(ratio, '.2f')}x | "
                         f"{_f(r['tpot'] and 1000 * r['tpot'])} | {_f(r['ttft'], '.2f')} | "
                         f"{r['wall_s']:.2f} | {r['tokens']} | {acc} | {passes} | "
                         f"{same[0]} | {same[1]} |"
                         + (f" errors: {r['errors'][:1]}" if r["errors"] else ""))
    lines.append("")
    for n, (ratio, off_same, stock_same, count) in ratios.items():
        target = (" (target: >= 1.50x at N = 4, every reply = off: "
                  + ("met" if ratio and ratio >= 1.5 and off_same == count else "not met")
                  + ")" if n == 4 else "")
        lines.append(f"N = {n}: prefixd / prefixd-off {_f(ratio, '.2f')}x, replies = off "
                     f"{_f(off_same, 'd')}/{count}, = stock {_f(stock_same, 'd')}/{count}"
                     f"{target}")
    for name, res in results.items():
        if "refused" in res:
            lines.append(f"\n{name}: **{res['refused']}** {res.get('log', '')}")
    return "\n".join(lines) + "\n"
