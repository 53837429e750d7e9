"""Lane identity and the bounds on lane memory."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import generate_latest
from test_prefix_cases import messages_api, prepare

from prefixd.api.usage import Usage
from prefixd.metrics import REGISTRY
from prefixd.proxy.prefix.lanes import LaneStore, Shape, session_id
from prefixd.proxy.prefix.tracker import PrefixTracker
from prefixd.proxy.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def body(system: str, first: str = "hi", **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": first}], **extra}


def lane_of(st: PrefixTracker, b: dict, headers: dict | None = None) -> str:
    p = prepare(st, b, headers)
    st.record_response(p, {"role": "assistant", "content": "ok"}, None)
    return p.lane


@pytest.mark.parametrize(("headers", "extra", "want"), [
    ({"X-Claude-Code-Session-Id": "abc", "X-Session-Id": "zzz"}, {}, ("cc", "abc")),
    ({"session_id": "pi-1"}, {"prompt_cache_key": "k"}, ("s", "pi-1")),
    ({"x-session-affinity": "ses_1"}, {}, ("s", "ses_1")),
    ({}, {"metadata": {"user_id": "user_ab12_account_7_session_57a121ec-f78c-48c3"}},
     ("cc", "57a121ec-f78c-48c3")),
    ({}, {"metadata": {"user_id": json.dumps({"session_id": "s-9"})}}, ("cc", "s-9")),
    ({}, {"prompt_cache_key": "pk", "user": "u"}, ("pck", "pk")),
    ({}, {"conversation": {"id": "c1"}}, ("conv", "c1")),
    ({}, {"rid": "conv7_t3_r1"}, ("rid", "conv7")),
    ({}, {"user": "bob"}, ("user", "bob")),
    ({}, {}, None),
])
def test_session_id_priority(headers: dict, extra: dict, want: tuple | None) -> None:
    assert session_id(headers, body("s", **extra)) == want


def test_fingerprint_ignores_volatile_lines_and_separates_clients() -> None:
    st = PrefixTracker(Settings(_env_file=None), clock=Clock())
    a = lane_of(st, body("Agent.\nToday's date: 2025-01-01 10:00:00\n" + "Rules. " * 20))
    b = lane_of(st, body("Agent.\nToday's date: 2025-01-02 11:00:00\n" + "Rules. " * 20))
    c = lane_of(st, body("Agent.\n" + "Rules. " * 20), {"User-Agent": "aider/0.8"})
    d = lane_of(st, body("Agent.\n" + "Rules. " * 20, first="another task"))
    assert a == b and a.startswith("fp:") and len({a, c, d}) == 3


def test_idle_lanes_expire() -> None:
    clock = Clock()
    st = PrefixTracker(Settings(_env_file=None, lane_idle_s=60), clock=clock)
    lane_of(st, body("s"), {"X-Session-Id": "one"})
    clock.t = 30
    lane_of(st, body("s"), {"X-Session-Id": "two"})
    clock.t = 70
    lane_of(st, body("s"), {"X-Session-Id": "three"})
    assert [x["lane"] for x in st.debug_lanes()] == ["s:two", "s:three"]
    p = prepare(st, body("s"), {"X-Session-Id": "one"})
    assert p.report.verdict == "NEW"      # forgotten, so compared with nothing


def test_lane_count_and_bytes_are_capped() -> None:
    st = PrefixTracker(Settings(_env_file=None, lane_max=3), clock=Clock())
    for i in range(5):
        lane_of(st, body("s"), {"X-Session-Id": f"l{i}"})
    assert [x["lane"] for x in st.debug_lanes()] == ["s:l2", "s:l3", "s:l4"]
    st = PrefixTracker(Settings(_env_file=None, lane_max_bytes=60_000), clock=Clock())
    for i in range(6):
        lane_of(st, body("x" * 10_000), {"X-Session-Id": f"b{i}"})
    assert st.store.nbytes <= 60_000 and len(st.store) < 6
    assert st.debug_lanes()[-1]["lane"] == "s:b5"


def test_history_is_bounded() -> None:
    st = PrefixTracker(Settings(_env_file=None, prefix_history=3), clock=Clock())
    for _ in range(5):
        lane = lane_of(st, body("s"), {"X-Session-Id": "h"})
    assert [h["turn"] for h in st.debug_lane(lane)] == [3, 4, 5]


def test_store_never_drops_the_lane_in_use() -> None:
    store = LaneStore(idle_s=100, max_lanes=1, max_bytes=1024, history=2)
    lane = store.resolve("a", Shape("", frozenset(), "", True), 0.0)
    store.set_bytes(lane, 10_000)
    assert store.get("a") is lane


def test_log_line_and_metrics(caplog: pytest.LogCaptureFixture) -> None:
    st = PrefixTracker(Settings(_env_file=None), clock=Clock())
    hdr = {"User-Agent": "goose/1.0", "X-Session-Id": "g"}
    lane_of(st, body("Time 10:00:00\n" + "r " * 100), hdr)
    with caplog.at_level(logging.INFO, logger="prefixd.prefix"):
        lane_of(st, body("Time 10:00:09\n" + "r " * 100), hdr)
    rec = [r for r in caplog.records if r.name == "prefixd.prefix"]
    assert len(rec) == 1 and rec[0].levelno == logging.INFO
    text = rec[0].getMessage()
    assert text.startswith("prefix lane=s:g turn=2 client=goose verdict=MUTATED")
    assert "\n  reusable=" in text and "10:00:09" not in text       # no excerpts by default
    metrics = generate_latest(REGISTRY).decode()
    assert 'prefixd_prefix_mutations_total{cause="clock_time",client="goose",region="system"}' \
        in metrics
    assert "s:g" not in metrics and "prefixd_prefix_lanes " in metrics


def test_completions_prompt_and_unreadable_bodies() -> None:
    st = PrefixTracker(Settings(_env_file=None), clock=Clock())

    def send(b: dict) -> object:
        p = prepare(st, b, {"X-Session-Id": "c"})
        st.record_response(p, None, Usage(prompt=10))
        return p

    assert send({"model": "m", "prompt": "Once upon a time"}).report.verdict == "NEW"
    assert send({"model": "m", "prompt": "Once upon a time, a fox"}).report.verdict == "APPEND"
    r = send({"model": "m", "prompt": "Twice upon a time, a fox"}).report
    assert r.verdict == "MUTATED" and r.path == "prompt" and r.char_offset == 0
    weird = {"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}
    p = send(weird)
    assert p.body is weird and not p.changed and p.report is None


def test_detection_off_still_canonicalizes() -> None:
    st = PrefixTracker(Settings(_env_file=None, prefix_detect=False), clock=Clock())
    b = messages_api({"model": "m", "max_tokens": 10, "messages": [{"role": "user",
                      "content": "hi"}], "system": "x-anthropic-billing-header: cch=1;\n"
                      "You are Claude."})
    p = prepare(st, b)          # the pipeline leaves the detect stage out
    assert p.report is None
    assert p.changed and p.body["messages"][0]["content"] == "You are Claude."


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [tool(n) for n in ("Bash", "Read", "Edit", "Write", "Grep", "Glob")]
SYSTEM = "You are a Claude agent, built on Anthropic's Claude Agent SDK.\n"
CC = {"X-Claude-Code-Session-Id": "sess-1"}


def test_a_side_call_without_tools_gets_its_own_lane_not_a_mutation() -> None:
    """Claude Code's session-title call shares the session id and the system prompt's first
    line but has no tools: its own lane, both NEW; the main turn after it is no mutation."""
    st = PrefixTracker(Settings(_env_file=None), clock=Clock())
    title = prepare(st, body(SYSTEM + "Generate a concise title.", "<session>fix the bug"
                             "</session>"), CC)
    main = prepare(st, body(SYSTEM + "\nYou are an interactive agent. " * 20,
                            "fix the bug", tools=TOOLS), CC)
    assert title.lane != main.lane and title.lane.startswith("cc:sess-1")
    assert title.report is not None and main.report is not None
    assert title.report.verdict.value == "NEW" and main.report.verdict.value == "NEW"
    again = prepare(st, body(SYSTEM + "Generate a concise title.", "<session>next</session>"),
                    CC)
    # the next prompt's title call: a conversation of its own again, not a title "mutated"
    assert again.lane not in (title.lane, main.lane)
    assert again.report is not None and again.report.verdict.value == "NEW"


def test_a_tool_added_to_the_conversation_is_still_its_mutation() -> None:
    st = PrefixTracker(Settings(_env_file=None), clock=Clock())
    system = SYSTEM + "\nYou are an interactive agent. " * 20
    first = prepare(st, body(system, "fix the bug", tools=TOOLS), CC)
    st.record_response(first, {"role": "assistant", "content": "ok"}, None)
    more = prepare(st, body(system, "fix the bug", tools=[*TOOLS, tool("mcp__db__query")]), CC)
    assert more.lane == first.lane
    assert more.report is not None and "tools_added" in more.report.causes


def test_a_sub_agent_with_mostly_other_tools_gets_its_own_lane() -> None:
    st = PrefixTracker(Settings(_env_file=None), clock=Clock())
    system = SYSTEM + "\nYou are an interactive agent. " * 20
    main = prepare(st, body(system, "fix the bug", tools=TOOLS), CC)
    sub = prepare(st, body(system, "search the code", tools=[tool("Grep"), tool("Glob"),
                                                             tool("WebFetch")]), CC)
    assert sub.lane != main.lane
    assert sub.report is not None and sub.report.verdict.value == "NEW"


def test_two_sub_agents_of_one_kind_are_two_conversations() -> None:
    """Sub-agents of one type share the session id, the system prompt and the tools; each
    starts with its own task: each its own lane, and each one's next turn continues it."""
    st = PrefixTracker(Settings(_env_file=None), clock=Clock())
    sub = SYSTEM + "You are a sub-agent. Do the task. " * 10
    tools = [tool("Grep"), tool("Glob"), tool("Read")]
    a = prepare(st, body(sub, "find the config loader", tools=tools), CC)
    st.record_response(a, {"role": "assistant", "content": "found it"}, None)
    b = prepare(st, body(sub, "count the tests", tools=tools), CC)
    st.record_response(b, {"role": "assistant", "content": "42"}, None)
    assert a.lane != b.lane and b.report is not None and b.report.verdict.value == "NEW"
    a2 = {"model": "m", "tools": tools, "messages": [
        {"role": "system", "content": sub}, {"role": "user", "content": "find the config loader"},
        {"role": "assistant", "content": "found it"}, {"role": "user", "content": "and?"}]}
    nxt = prepare(st, a2, CC)
    assert nxt.lane == a.lane
    assert nxt.report is not None and nxt.report.verdict.value == "APPEND"
