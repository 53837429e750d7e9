"""Lanes: which conversation a request belongs to (docs/MUTATIONS.md §6), and the bounded
store of per-lane state.

Identity, most trusted first: explicit session headers, then body fields, then a content
fingerprint (client family, model, first user message) that ignores volatile lines, keyed
with the run's lane secret (HMAC), so an id shown on a view never confirms a guessed message. Inside
one session, a request that does not continue a conversation of that session — its system
prompt of another family, or another tool set (none where the conversation has tools, or
mostly other tools: a title or summary side call, a sub-agent) — gets its own lane
`<session>~<hash>` instead of being reported as a mutation; a tool added to or removed from
the conversation's own set is still its mutation. Memory is bounded: idle lanes expire, and
the least recently used go first when `lane_max` lanes or `lane_max_bytes` bytes are
exceeded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixd.proxy.prefix.canonicalize import CanonState
from prefixd.proxy.prefix.patterns import strip_volatile_lines
from prefixd.proxy.prefix.segments import Segment, tool_name

# (header, lane prefix), in the order they are trusted (router-for-me/CLIProxyAPI#4452).
SESSION_HEADERS = (("x-claude-code-session-id", "cc"), ("session-id", "s"), ("session_id", "s"),
                   ("x-session-id", "s"), ("x-session-affinity", "s"), ("x-opencode-session", "oc"),
                   ("x-openwebui-chat-id", "owui"), ("x-grok-conv-id", "grok"),
                   ("helicone-property-session", "hc"), ("x-smg-routing-key", "smg"))
_SHORT = {"claude-cli": "cc", "opencode": "oc"}
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_RID_SUFFIX = re.compile(r"_t\d+(?:_r\d+)?$")
_SESSION_IN_USER_ID = re.compile(r"session_([0-9a-fA-F-]{8,})")


@dataclass(slots=True)
class LaneState:
    """Everything prefixd remembers about one conversation."""

    id: str
    family: str                                  # volatile-stripped system text
    last_seen: float
    tools: frozenset[str] = frozenset()          # the names of its tools
    head: str = ""                               # its first user message, volatile-stripped
    turn: int = 0
    raw: list[Segment] | None = None             # previous request as the client sent it
    fwd: list[Segment] | None = None             # previous request as forwarded
    shadow: list[Segment] | None = None          # previous request with dry-run rules applied
    fwd_body: dict | None = None
    fwd_tokens: list[int] | None = None          # exact tokens of fwd_body, when measured
    resp: dict | None = None                     # the answer to the previous request
    prompt_tokens: int | None = None             # usage.prompt_tokens of that answer
    ratio: float = 4.0                           # learned rendered chars per token
    ratio_learned: bool = False
    canon: CanonState = field(default_factory=CanonState)
    history: deque[Any] = field(default_factory=deque)   # PrefixReport, newest last
    unserved: int = 0                            # requests no backend accepted (not turns)
    nbytes: int = 0


def _clean(value: str) -> str:
    return _SAFE.sub("_", value.strip())[:64]


def session_id(headers: Mapping[str, str], body: dict) -> tuple[str, str] | None:
    """(prefix, id) from explicit headers or body fields, None when the client sent none."""
    lower = {k.lower(): v for k, v in headers.items()}
    for name, prefix in SESSION_HEADERS:
        if lower.get(name):
            return prefix, _clean(lower[name])
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        uid = meta["user_id"]
        try:
            parsed = json.loads(uid)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("session_id"):
            return "cc", _clean(str(parsed["session_id"]))
        m = _SESSION_IN_USER_ID.search(uid)
        if m:
            return "cc", _clean(m.group(1))
    for key, prefix in (("prompt_cache_key", "pck"), ("conversation_id", "conv")):
        if isinstance(body.get(key), str) and body[key]:
            return prefix, _clean(body[key])
    conv = body.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    if isinstance(conv, str) and conv:
        return "conv", _clean(conv)
    if isinstance(body.get("rid"), str) and body["rid"]:
        return "rid", _clean(_RID_SUFFIX.sub("", body["rid"]))
    if isinstance(body.get("user"), str) and body["user"]:
        return "user", _clean(body["user"])
    return None


def _digest(secret: bytes, *parts: str) -> str:
    """HMAC-SHA256 under the run's lane secret: without it, an id confirms no guessed text."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def base_key(headers: Mapping[str, str], body: dict, segs: list[Segment], client: str,
             secret: bytes, namespace: str = "") -> str:
    """The session part of a lane id. A content fingerprint (`fp:`) is keyed by `secret`
    and by the request's cache partition (`namespace`): the same first message under two
    keys, or in two runs with random secrets, gets two unrelated ids."""
    sid = session_id(headers, body)
    if sid is not None:
        prefix, value = sid
        if prefix == "s":
            prefix = _SHORT.get(client, "s")
        return f"{prefix}:{value}"
    first_user = next((s.text for s in segs if s.role == "user" and s.kind in ("text", "prompt")),
                      "")
    if not first_user:
        first_user = next((s.text for s in segs if s.kind == "prompt"), "")
    return "fp:" + _digest(secret, namespace, client, str(body.get("model", "")),
                           first_user[:4096])[:12]


def system_family(segs: list[Segment]) -> str:
    text = "\n".join(s.text for s in segs if s.region == "system")
    return strip_volatile_lines(text)[:4096]      # the head tells families apart


@dataclass(frozen=True, slots=True)
class Shape:
    """What tells a session's conversations apart: the system prompt's family, the tool set,
    the first user message (volatile lines stripped), and whether the request starts a
    conversation (one user message, no answer yet)."""

    family: str
    tools: frozenset[str]
    head: str
    starts: bool


def shape(body: dict, segs: list[Segment]) -> Shape:
    users = [s for s in segs if s.region == "messages" and s.role == "user"
             and s.kind in ("text", "prompt")]
    answered = any(s.region == "messages" and s.role in ("assistant", "tool") for s in segs)
    head = strip_volatile_lines(users[0].text)[:4096] if users else ""
    return Shape(system_family(segs), tool_set(body), head,
                 len({s.msg for s in users}) == 1 and not answered)


def tool_set(body: dict) -> frozenset[str]:
    """The names of a request's tools."""
    tools = body.get("tools")
    return frozenset(tool_name(t) for t in tools) if isinstance(tools, list) else frozenset()


def same_tools(a: frozenset[str], b: frozenset[str]) -> bool:
    """Two tool sets of one conversation: equal, or mostly the same tools (one added or
    removed is the conversation's own change); none against some is a side call's."""
    return a == b or (bool(a) and bool(b) and _overlap(a, b) >= 0.5)


def _overlap(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def same_family(a: str, b: str) -> bool:
    """Two system prompts of one conversation, not a side call with its own prompt: they share
    a real prefix or most of their lines."""
    if a == b:
        return True
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    if n >= min(64, min(len(a), len(b)) // 2) and n > 0:
        return True
    la, lb = set(a.splitlines()) - {""}, set(b.splitlines()) - {""}
    return bool(la and lb) and len(la & lb) / len(la | lb) >= 0.5


class LaneStore:
    """Bounded per-lane state, least recently used first."""

    def __init__(self, idle_s: float, max_lanes: int, max_bytes: int, history: int,
                 secret: bytes = b"") -> None:
        self.idle_s, self.max_lanes, self.max_bytes, self.history = (idle_s, max_lanes,
                                                                      max_bytes, history)
        self.secret = secret        # keys the `~<digest>` of a session's side conversations
        self._lanes: OrderedDict[str, LaneState] = OrderedDict()
        self._sessions: dict[str, list[str]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._lanes)

    def get(self, lane_id: str) -> LaneState | None:
        return self._lanes.get(lane_id)

    def lanes(self) -> list[LaneState]:
        return list(self._lanes.values())

    def resolve(self, base: str, shape: Shape, now: float) -> LaneState:
        """The lane for a request of session `base`: the session's conversation it continues
        (the same kind: system family and tools; the same first message, else the closest
        kind), or a new one — also for a request that starts a conversation of a kind the
        session already has, with another first message (a second sub-agent of one type)."""
        self.expire(now)
        ids = self._sessions.setdefault(base, [])
        kin = [self._lanes[i] for i in ids if same_family(self._lanes[i].family, shape.family)
               and same_tools(self._lanes[i].tools, shape.tools)]
        same = [lane for lane in kin if lane.head == shape.head]
        found = same or ([] if shape.starts else kin)
        if found:
            lane = max(found, key=lambda c: (c.family == shape.family,
                                             _overlap(c.tools, shape.tools), c.last_seen))
            self._lanes.move_to_end(lane.id)
            lane.last_seen = now
            return lane
        lane_id = base if not ids else \
            f"{base}~{_digest(self.secret, shape.family, *sorted(shape.tools), shape.head)[:6]}"
        while lane_id in self._lanes:                   # the same kind and head again, later
            lane_id += "+"
        lane = LaneState(lane_id, shape.family, now, shape.tools, shape.head,
                         history=deque(maxlen=self.history))
        self._lanes[lane_id] = lane
        ids.append(lane_id)
        self.trim(keep=lane_id)
        return lane

    def set_bytes(self, lane: LaneState, nbytes: int) -> None:
        if lane.id in self._lanes:
            self.nbytes += nbytes - lane.nbytes
        lane.nbytes = nbytes
        self.trim(keep=lane.id)

    def expire(self, now: float) -> None:
        while self._lanes:
            oldest = next(iter(self._lanes.values()))
            if now - oldest.last_seen < self.idle_s:
                break
            self._drop(oldest.id)

    def trim(self, keep: str) -> None:
        while len(self._lanes) > self.max_lanes or self.nbytes > self.max_bytes:
            victim = next((k for k in self._lanes if k != keep), None)
            if victim is None:
                break
            self._drop(victim)

    def _drop(self, lane_id: str) -> None:
        lane = self._lanes.pop(lane_id)
        self.nbytes -= lane.nbytes
        base = lane_id.split("~", 1)[0]
        ids = self._sessions.get(base, [])
        if lane_id in ids:
            ids.remove(lane_id)
        if not ids:
            self._sessions.pop(base, None)


def state_bytes(lane: LaneState) -> int:
    """Approximate memory held by a lane (texts dominate; shared strings counted once)."""
    seen: set[int] = set()
    total = 0
    for segs in (lane.raw, lane.fwd, lane.shadow):
        for s in segs or ():
            if id(s.text) not in seen:
                seen.add(id(s.text))
                total += len(s.text) + 100
    total += 8 * len(lane.fwd_tokens or ())
    total += 1024 * len(lane.history)
    return total + lane.canon.nbytes()
