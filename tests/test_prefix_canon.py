"""Canonicalization rules: properties (deterministic, idempotent, byte-identical when off),
laziness, replay, and the catalogue regexes they rely on."""

from __future__ import annotations

import copy
import json
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_cases import messages_api, prepare

from prefixd.proxy.prefix import canonicalize as C
from prefixd.proxy.prefix.patterns import VOLATILE, client_family, span_labels
from prefixd.proxy.prefix.rules import RULES
from prefixd.proxy.prefix.tracker import PrefixTracker
from prefixd.proxy.settings import Settings

NAMES = [r.name for r in RULES]
ALL = frozenset(NAMES)
DATE, TIME, ENV = "freeze_date", "relocate_clock_time", "pin_env_block"

# --- strategies: bodies that look like agent requests, with the volatile bits that move -------
dates = st.sampled_from(["Tue Sep 16 2025", "Wed Sep 17 2025", "2026-01-02",
                         "Monday, March 9, 2026"])
times = st.builds(lambda h, m, s: f"{h:02d}:{m:02d}:{s:02d}", st.integers(0, 23),
                  st.integers(0, 59), st.integers(0, 59))
words = st.text(alphabet=st.sampled_from("abc xyz\n\t.:-<>/"), max_size=40)


@st.composite
def system_text(draw: st.DrawFn) -> str:
    lines = [draw(st.sampled_from(["You are an agent.", "Be brief.", "Use tools."]))]
    if draw(st.booleans()):
        lines.insert(0, f"x-anthropic-billing-header: cc_version=2.1; cch={draw(words)[:5]};")
    lines.append(f"Today's date: {draw(dates)}")
    lines.append(f"The current time is {draw(times)}.")
    if draw(st.booleans()):
        lines.append(f"<env>\n  Working directory: /home/u/{draw(words)[:6]}\n</env>")
    lines.append(draw(words))
    sep = draw(st.sampled_from(["\n", "\r\n", "  \n"]))
    return sep.join(lines)


@st.composite
def tools(draw: st.DrawFn) -> list[dict]:
    names = draw(st.permutations(["read", "write", "grep", "bash"]))
    out = []
    for n in names:
        props = [("path", {"type": "string"}), ("limit", {"type": "integer"}),
                 ("mode", {"type": "string"})]
        props = draw(st.permutations(props))
        out.append({"type": "function", "function": {
            "name": n, "description": f"{n} tool" + draw(st.sampled_from(["", " ", "\n"])),
            "parameters": {"type": "object", "properties": dict(props)}}})
    return out


@st.composite
def bodies(draw: st.DrawFn) -> dict:
    history = []
    for i in range(draw(st.integers(0, 3))):
        history += [{"role": "user", "content": f"q{i} {draw(words)}"},
                    {"role": "assistant", "content": f"a{i}"}]
    last = draw(st.sampled_from(["user", "tool", "assistant"]))
    tail: dict = {"role": last, "content": draw(words)}
    if draw(st.booleans()) and last == "user":
        tail["content"] = [{"type": "text", "text": draw(words)}]
    body = {"model": "m", "messages": [{"role": "system", "content": draw(system_text())},
                                       *history, tail]}
    if draw(st.booleans()):
        body["tools"] = draw(tools())
    return body


def committed(first: dict, enabled: frozenset[str]) -> C.CanonState:
    state = C.CanonState()
    C.commit(state, first, C.canonicalize(first, state, enabled))
    return state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(), bodies(), st.sets(st.sampled_from(NAMES)))
def test_canonicalize_is_deterministic_and_idempotent(first: dict, second: dict,
                                                      rules: set[str]) -> None:
    enabled = frozenset(rules)
    state = committed(first, enabled)
    before = json.dumps(second)
    a = C.canonicalize(second, copy.deepcopy(state), enabled)
    b = C.canonicalize(second, copy.deepcopy(state), enabled)
    assert json.dumps(a.body) == json.dumps(b.body)            # deterministic
    assert json.dumps(second) == before                        # the client's dict is untouched
    again = C.canonicalize(a.body, copy.deepcopy(state), enabled)
    assert json.dumps(again.body) == json.dumps(a.body)        # idempotent


@settings(max_examples=40, deadline=None)
@given(st.lists(bodies(), min_size=1, max_size=4))
def test_every_rule_off_forwards_the_clients_bytes(seq: list[dict]) -> None:
    off = {r.setting: "off" for r in RULES}
    stage = PrefixTracker(Settings(_env_file=None, **off), clock=lambda: 0.0)
    for body in seq:
        before = json.dumps(body)
        p = prepare(stage, body, {"X-Session-Id": "p"})
        assert not p.changed and p.body is body and json.dumps(body) == before
        stage.record_response(p, {"role": "assistant", "content": "ok"}, None)


@settings(max_examples=40, deadline=None)
@given(st.lists(bodies(), min_size=1, max_size=4))
def test_dry_run_never_changes_the_forwarded_body(seq: list[dict]) -> None:
    dry = {r.setting: "dry_run" for r in RULES}
    stage = PrefixTracker(Settings(_env_file=None, **dry), clock=lambda: 0.0)
    for body in seq:
        p = prepare(stage, body, {"X-Session-Id": "p"})
        assert not p.changed and p.body is body


def _oc(date: str, clock: str, user: str) -> dict:
    system = f"Agent.\n<env>\n  Today's date: {date}\n  Time: {clock}\n</env>\nRules."
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": user}]}


def test_rules_are_lazy_and_sticky() -> None:
    enabled = frozenset({DATE, TIME})
    state = C.CanonState()
    first = _oc("Tue Sep 16 2025", "23:59:58", "a")
    r1 = C.canonicalize(first, state, enabled)
    assert not r1.changed and r1.body is first                 # first sight: baseline only
    C.commit(state, first, r1)
    r2 = C.canonicalize(_oc("Wed Sep 17 2025", "00:00:03", "b"), state, enabled)
    assert r2.body["messages"][0] == first["messages"][0]      # pinned to first-seen bytes
    assert set(r2.applied) == {DATE, TIME}
    tail = r2.body["messages"][1]["content"]
    assert "Wed Sep 17 2025" in tail and "00:00:03" in tail and tail.count("supersedes") == 2


def test_no_pin_without_a_fresh_user_turn() -> None:
    enabled = frozenset({TIME})
    state = committed(_oc("Tue Sep 16 2025", "10:00:00", "a"), enabled)
    body = _oc("Tue Sep 16 2025", "10:00:09", "a")
    body["messages"].append({"role": "assistant", "content": "prefill"})
    r = C.canonicalize(body, state, enabled)
    assert not r.changed            # nowhere to restate the live time: send it as it is


def test_env_block_pin_is_opt_in() -> None:
    body1 = _oc("Tue Sep 16 2025", "10:00:00", "a")
    body2 = json.loads(json.dumps(body1).replace("Rules.", "Rules.").replace("Agent.", "Agent."))
    body2["messages"][0]["content"] = body2["messages"][0]["content"].replace(
        "</env>", "  Working directory: /home/u/other\n</env>")
    for enabled, changed in ((frozenset({DATE, TIME}), False), (frozenset({ENV}), False)):
        state = committed(body1, enabled)
        assert C.canonicalize(body2, state, enabled).changed is changed   # an added line
    body3 = _oc("Tue Sep 16 2025", "10:00:00", "a")
    body3["messages"][0]["content"] = body3["messages"][0]["content"].replace("Time:", "Shell:")
    state = committed(body1, frozenset({ENV}))
    r = C.canonicalize(body3, state, frozenset({ENV}))
    assert r.applied == [ENV] and "Shell: 10:00:00" in r.body["messages"][1]["content"]


def test_billing_header_stripped_from_a_messages_api_system_prompt() -> None:
    body = messages_api({"model": "m", "max_tokens": 10, "messages": [{"role": "user",
                         "content": "hi"}], "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
        {"type": "text", "text": "You are Claude."}]})
    r = C.canonicalize(body, C.CanonState(), ALL)
    assert r.applied == ["strip_billing_header"]
    assert r.body["messages"][0] == {"role": "system", "content": "You are Claude."}


# --- the catalogue (Appendix A samples and negatives) -----------------------------------------
SAMPLES = {
    "anthropic_billing_header": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cch=fa690;",
    "iso_datetime": "2025-10-20T01:42:44.726Z", "iso_date": "Today's date is 2026-08-03.",
    "todays_date_line": "  Today's date: Tue Sep 16 2025", "js_todatestring": "Tue Sep 16 2025",
    "long_date": "Monday, March 9, 2026", "dmy_short": "26 Jul 2024", "clock_time": "06:00:31 PM",
    "us_locale_datetime": "1/15/2025, 3:04:05 PM", "tz_offset": "UTC+8:00",
    "iana_tz": "Asia/Shanghai", "uuid": "57a121ec-f78c-48c3-a745-e3036a3ecc33",
    "prefixed_id": "ses_6aade4081ffe216ygZUgcUQdR1", "hex_id": "9f86d0818abc",
    "epoch": "1701875634123", "cost_counter": "# Current Cost\n$0.42",
    "token_counter": "12,345 tokens used", "cwd_line": "  Working directory: /Users/me/proj",
    "os_platform": "Platform: darwin", "env_block": "<env>x</env>",
    "recent_files": "# VSCode Open Tabs\na.ts",
    "system_reminder": "<system-reminder>x</system-reminder>",
}


def test_catalogue_matches_samples_and_not_negatives() -> None:
    for name, sample in SAMPLES.items():
        assert VOLATILE[name].search(sample), name
    assert not VOLATILE["hex_id"].search("deadbeefcafe")
    assert not VOLATILE["epoch"].search("8080 2024")
    assert not VOLATILE["iso_date"].search("2024-13-45")
    assert not VOLATILE["uuid"].search("00000000-0000-0000-0000-000000000000")


def test_span_labels_only_name_values_that_changed() -> None:
    assert span_labels("Date: 2025-01-01 at 10:00", "Date: 2025-01-01 at 10:05") == ["clock_time",
                                                                                    "todays_date_line"]
    assert span_labels("hello", "world") == []
    assert client_family({"User-Agent": "opencode/1.2"}) == "opencode"
    assert client_family({"user-agent": "curl/8"}) == "other"
    assert re.fullmatch(r"[a-z-]+", client_family({"User-Agent": "Roo-Code/3"}))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(bodies(), min_size=2, max_size=4))
def test_stage_sequences_are_deterministic_and_settled(seq: list[dict]) -> None:
    """Two stages fed the same requests forward the same bytes; and what a stage forwarded
    (with its recorded insertions) is a fixed point of the rules."""
    on = {r.setting: "on" for r in RULES}
    stages = [PrefixTracker(Settings(_env_file=None, **on), clock=lambda: 0.0) for _ in range(2)]
    for body in seq:
        out = []
        for stage in stages:
            p = prepare(stage, body, {"X-Session-Id": "d"})
            stage.record_response(p, {"role": "assistant", "content": "ok"}, None)
            out.append(json.dumps(p.body))
        assert out[0] == out[1]
    lane = stages[1].store.get(p.lane)          # p: the last stage's (lane ids are keyed)
    again = C.canonicalize(p.body, lane.canon, stages[1].live)
    assert json.dumps(again.body) == json.dumps(p.body)


_PIECES = ["alpha ", "Today's date: ", "2026-11-29", " 14:05:33", " msg_", "abcdef123456",
           "Working directory: /home/u", "x-anthropic-billing-header: cch=1;", "٣", "DATE ",
           "cwd", " 550e8400-e29b-41d4-a716-446655440000", "deadbeef0123", "\t", " tools "]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_PIECES), max_size=6).map("".join), max_size=8))
def test_volatile_lines_are_the_lines_any_volatile_pattern_matches(lines: list[str]) -> None:
    """The quick pre-check before the patterns (`_MAYBE_VOLATILE`) drops no line a pattern
    would match: the result is the lines none of the patterns matches."""
    from prefixd.proxy.prefix.patterns import _LINE_LABELS, strip_volatile_lines

    text = "\n".join(lines)
    expected = [line for line in text.splitlines()
                if not any(VOLATILE[n].search(line) for n in _LINE_LABELS)]
    assert strip_volatile_lines(text) == "\n".join(expected)
