"""`prefixd explain`: the last prefix reports of one conversation, fetched from a running
prefixd's /debug/prefix, printed as a terminal-friendly diff: per turn the verdict, where the
prompt changed, the tokens lost, the text around the change (when the daemon keeps excerpts:
PREFIXD_PREFIX_EXCERPTS=true) and the setting that would keep the prefix.

Reads only the JSON of /debug/prefix and /debug/prefix/{lane}; renders, never decides.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from prefixd.proxy.prefix import rules
from prefixd.proxy.prefix.detect import REUSING as _REUSING
from prefixd.proxy.settings import Settings

REUSING = frozenset(v.value for v in _REUSING)


def setting(rule: str) -> str:
    """`relocate_clock_time` -> `PREFIXD_CANON_RELOCATE_CLOCK_TIME`."""
    r = rules.by_name(rule)
    return r.env if r is not None else f"PREFIXD_CANON_{rule.upper()}"


def describe(rule: str) -> str:
    """What the rule does (its setting's description)."""
    r = rules.by_name(rule)
    return r.doc if r is not None else ""


class ExplainError(Exception):
    """A message for the user: unreachable daemon, a refused key, an unknown lane."""


def fetch_json(url: str, api_key: str | None, timeout: float = 10.0) -> Any:
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise ExplainError(f"{url}: 401, the API key is missing or wrong "
                               "(--api-key or PREFIXD_API_KEY)") from None
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ExplainError(f"{url}: HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ExplainError(f"cannot reach prefixd at {url}: "
                           f"{getattr(e, 'reason', None) or e}") from None


def load(base: str, api_key: str | None, lane: str | None, n: int) -> tuple[str, list[dict]]:
    """(lane id, its last n reports); the lane defaults to the most recently active one."""
    base = base.rstrip("/")
    if lane is None:
        lanes = fetch_json(base + "/debug/prefix", api_key)["lanes"]
        if not lanes:
            raise ExplainError("no conversations yet: prefixd has seen no chat request")
        lane = min(lanes, key=lambda x: x["idle_s"])["lane"]
    reports = fetch_json(f"{base}/debug/prefix/{quote(lane, safe='')}", api_key)["reports"]
    return lane, reports[-n:] if n > 0 else []


@dataclass(frozen=True)
class Style:
    color: bool

    def _sgr(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and text else text

    def bold(self, t: str) -> str:
        return self._sgr("1", t)

    def dim(self, t: str) -> str:
        return self._sgr("2", t)

    def red(self, t: str) -> str:
        return self._sgr("31", t)

    def green(self, t: str) -> str:
        return self._sgr("32", t)

    def verdict(self, v: str) -> str:
        code = ("1;32" if v in ("IDENTICAL", "APPEND") else "1;33" if v in REUSING
                else "1;2" if v == "NEW" else "1;31")
        return self._sgr(code, v)


def _visible(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r") \
        .replace("\t", "\\t")


def excerpt_lines(old: str, new: str, s: Style) -> list[str]:
    """`- old` / `+ new` with the differing middle marked: colored on a terminal, otherwise
    wdiff-style `[-removed-]` / `{+added+}`."""
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    q = 0
    while q < min(len(old), len(new)) - p and old[-1 - q] == new[-1 - q]:
        q += 1

    def line(sign: str, t: str, paint: Any, mark: tuple[str, str]) -> str:
        head, mid, tail = (_visible(x) for x in (t[:p], t[p:len(t) - q], t[len(t) - q:]))
        mid = s._sgr("7", mid) if s.color else f"{mark[0]}{mid}{mark[1]}"
        return "    " + paint(f"{sign} {head}") + (paint(mid) if s.color else mid) + paint(tail)

    return [line("-", old, s.red, ("[-", "-]")), line("+", new, s.green, ("{+", "+}"))]


def _tok(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def report_lines(r: dict, s: Style) -> list[str]:
    verdict, sent = r.get("verdict", "?"), r.get("sent_verdict")
    head = f"turn {r.get('turn', '?')}  {s.verdict(verdict)}"
    if sent and sent != verdict:
        head += f" → {s.verdict(sent)} {s.dim('(as sent, after canonicalization)')}"
    causes = r.get("causes") or []
    out = [head + (f"  {', '.join(causes)}" if causes else "")]

    def kv(key: str, value: str) -> None:
        out.append(f"  {key:<8}{value}")

    if verdict == "NEW":
        kv("reuse", "first request of the lane: full prefill")
    if r.get("path"):
        approx = "" if r.get("token_offset_exact") else "~"
        kv("where", f"{r['path']} +{r.get('char_offset', 0)} ch, token {approx}"
                    f"{_tok(r.get('token_offset'))}"
                    + ("" if approx == "" else s.dim(" (estimated)")))
    if verdict != "NEW":
        prev, reused, lost = (r.get("prev_prompt_tokens"), r.get("reusable_tokens"),
                              r.get("lost_tokens") or 0)
        pct = f" ({100 * reused / prev:.1f}%)" if prev and isinstance(reused, int) else ""
        kv("reuse", f"{_tok(reused)} / {_tok(prev)} tok{pct}"
                    + (", " + s.red(f"{_tok(lost)} tok lost") if lost else ""))
    if r.get("moved_from") or r.get("moved_to"):
        kv("moved", f"{r.get('moved_from') or '?'} → {r.get('moved_to') or '?'}")
    for key in ("tools_added", "tools_removed"):
        if r.get(key):
            kv(key.replace("_", " ").split()[1], ", ".join(r[key]))
    if r.get("backend_cached_tokens") is not None:
        miss = r.get("miss") or "agrees"
        suspects = f" (suspects: {', '.join(r['suspects'])})" if r.get("suspects") else ""
        kv("backend", f"cached {_tok(r['backend_cached_tokens'])} / "
                      f"{_tok(r.get('backend_prompt_tokens'))} tok, "
                      + (s.red(miss + suspects) if miss == "unexplained" else miss))
    for span in r.get("spans") or []:
        kv("change", f"{span.get('path')} +{span.get('char_offset', 0)} ch  "
                     f"{', '.join(span.get('causes') or []) or '?'}")
        if span.get("old_excerpt") is not None:
            out += excerpt_lines(span["old_excerpt"], span.get("new_excerpt") or "", s)
        else:
            out.append(s.dim(f"    old #{span.get('old_hash')} → new #{span.get('new_hash')} "
                             "(PREFIXD_PREFIX_EXCERPTS=true shows the text)"))
    out += _fix_lines(r, s)
    return out


def _fix_lines(r: dict, s: Style) -> list[str]:
    out = []
    if r.get("fixed"):
        out.append(f"  {'fixed':<8}by {', '.join(r['fixed'])}, kept "
                   f"{_tok(r.get('saved_tokens'))} tok")
    done = set(r.get("fixed") or [])
    for w in r.get("would_fix") or []:
        done.add(w["rule"])
        out.append(f"  {'fix':<8}{s.bold(setting(w['rule']) + '=on')}  would keep "
                   f"{_tok(w.get('saved_tokens'))} more tok (measured in dry run)")
    sent = r.get("sent_verdict") or r.get("verdict")
    fixes = rules.fixes()
    suggested = [] if sent in REUSING or sent == "NEW" else list(dict.fromkeys(
        fixes[c] for c in r.get("causes") or [] if c in fixes and fixes[c] not in done))
    for rule in suggested:
        out.append(f"  {'fix':<8}{s.bold(setting(rule) + '=on')}  {s.dim(describe(rule))}")
    hint = r.get("hint")
    fix_shown = bool(suggested or r.get("would_fix"))
    if hint and not (fix_shown and hint.startswith("canon_")):   # not the fix line again
        out.append(f"  {'hint':<8}{hint}")
    return out


def render(lane: str, reports: list[dict], s: Style) -> str:
    if not reports:
        return f"lane {lane}: no reports\n"
    first, last = reports[0], reports[-1]
    head = (f"lane {s.bold(lane)} · client {last.get('client', '?')} · "
            f"turns {first.get('turn')}–{last.get('turn')}")
    blocks = ["\n".join(report_lines(r, s)) for r in reports]
    return head + "\n\n" + "\n\n".join(blocks) + "\n"


def target(settings: Settings, url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """The daemon's base URL and key: the flags, else what its settings say it listens on
    and its operator key (every key's lanes under per-key isolation), else its API key."""
    if url is None:
        host = "127.0.0.1" if settings.host in ("", "0.0.0.0", "::") else settings.host
        url = f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"
    secret = settings.operator_key or settings.api_key
    if api_key is None and secret is not None:
        api_key = secret.get_secret_value()
    return url, api_key or None


def run(url: str, api_key: str | None, lane: str | None, n: int, color: bool) -> str:
    """The text `prefixd explain` prints; ExplainError for the user otherwise."""
    lane_id, reports = load(url, api_key, lane, n)
    return render(lane_id, reports, Style(color))
