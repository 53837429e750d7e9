"""Insertions that must not pile up: a pinned value is restated only when it changed since
its last restatement, earlier restatements and kept reminders are replayed byte for byte,
and every cause with a rule names it (rules.for_cause)."""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_cases import prepare

from prefixd.proxy.prefix import canonicalize as C
from prefixd.proxy.prefix import rules as R
from prefixd.proxy.prefix.patterns import CAUSES
from prefixd.proxy.prefix.tracker import PrefixTracker
from prefixd.proxy.settings import Settings

HDR = {"X-Session-Id": "restate"}


def stage(**modes: str) -> PrefixTracker:
    return PrefixTracker(Settings(_env_file=None, **modes), clock=lambda: 0.0)


def system(date: str, clock: str) -> str:
    return (f"You are an agent.\n<env>\n  Today's date: {date}\n  Time: {clock}\n</env>\n"
            + "Rules. " * 40)


def turns(st: PrefixTracker, values: list[tuple[str, str]]) -> list:
    """One request per (date, time); each appends a user turn to the history."""
    hist: list[dict] = []
    out = []
    for i, (date, clock) in enumerate(values):
        body = {"model": "m", "messages": [{"role": "system", "content": system(date, clock)},
                                           *hist, {"role": "user", "content": f"step {i}"}]}
        p = prepare(st, body, HDR)
        st.record_response(p, {"role": "assistant", "content": f"done {i}"}, None)
        out.append(p)
        hist += [{"role": "user", "content": f"step {i}"},
                 {"role": "assistant", "content": f"done {i}"}]
    return out


def blocks(p: object) -> list[str]:
    return [m["content"][m["content"].index("<context-update"):] for m in p.body["messages"]
            if "<context-update" in m["content"]]


def test_a_value_is_restated_once_per_change() -> None:
    days = ["Tue Sep 16 2025", "Wed Sep 17 2025", "Wed Sep 17 2025", "Wed Sep 17 2025",
            "Thu Sep 18 2025"]
    ps = turns(stage(canon_freeze_date="on"), [(d, "10:00") for d in days])
    assert [p.report.sent_verdict for p in ps] == ["NEW", "APPEND", "APPEND", "APPEND", "APPEND"]
    newest = ["<context-update" in p.body["messages"][-1]["content"] for p in ps]
    assert newest == [False, True, False, False, True]
    assert len(blocks(ps[-1])) == 2 and "Thu Sep 18 2025" in blocks(ps[-1])[1]
    assert all(p.body["messages"][0] == ps[0].body["messages"][0] for p in ps)


def test_only_the_changed_line_is_restated() -> None:
    ps = turns(stage(canon_freeze_date="on", canon_relocate_clock_time="on"),
               [("Tue Sep 16 2025", "23:59"), ("Wed Sep 17 2025", "00:01"),
                ("Wed Sep 17 2025", "00:02")])
    assert "Wed Sep 17" in blocks(ps[1])[-1] and "00:01" in blocks(ps[1])[-1]
    last = ps[2].body["messages"][-1]["content"]
    assert "00:02" in last and "Wed Sep 17" not in last


values = st.lists(st.tuples(st.sampled_from(["Tue Sep 16 2025", "Wed Sep 17 2025"]),
                            st.sampled_from(["10:00", "11:30"])), min_size=1, max_size=6)


def told(block: str) -> dict[str, str]:
    """{"Today's date": value, ...} as one restatement block states them."""
    lines = block.splitlines()[1:-1]
    return dict(line.split(" (supersedes", 1)[0].split(": ", 1) for line in lines)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values, st.sets(st.sampled_from(["freeze_date", "relocate_clock_time", "pin_env_block"])))
def test_restatements_follow_changes_and_history_stays_a_prefix(seq: list, rules: set) -> None:
    modes = {f"canon_{r}": "on" for r in rules}
    ps = turns(stage(**modes), seq)
    base = ps[0].body["messages"][0]
    first = {"Today's date": seq[0][0], "Time": seq[0][1]}
    last = dict(first)                                 # what the model was last told
    for i, p in enumerate(ps):
        pinned = p.body["messages"][0] == base
        if i and pinned and ps[i - 1].body["messages"][0] == base:         # history: a prefix
            n = len(ps[i - 1].body["messages"])
            assert json.dumps(p.body["messages"][:n]) == json.dumps(ps[i - 1].body["messages"])
        newest = p.body["messages"][-1]["content"]
        now = told(newest[newest.index("<context-update"):]) if "<context-update" in newest else {}
        assert all(last[k] != v for k, v in now.items())       # never the same value again
        last.update(now)
        live = {"Today's date": seq[i][0], "Time": seq[i][1]}
        if pinned:                       # a changed value (not back to the first one) is told
            assert all(last[k] == v for k, v in live.items() if v != first[k])
    again = [json.dumps(p.body) for p in turns(stage(**modes), seq)]
    assert again == [json.dumps(p.body) for p in ps]                      # deterministic


# --- keep_trailing_reminder: properties ------------------------------------------------------
REMINDER = "\n\n# Rules:\nAlways answer with *SEARCH/REPLACE* blocks only.\n"


@st.composite
def reminder_sessions(draw: st.DrawFn) -> list[tuple[dict, str]]:
    """Aider-like turns, (request, answer): the newest user message carries the reminder,
    the history does not."""
    out, hist = [], []
    for i in range(draw(st.integers(1, 5))):
        question = draw(st.sampled_from(["fix it", "go on", "why?", ""])) + f" {i}"
        answer = draw(st.sampled_from(["ok", "done", ""]))
        msgs = [{"role": "system", "content": "sys" + REMINDER}, *hist,
                {"role": "user", "content": question + REMINDER}]
        out.append(({"model": "m", "messages": msgs}, answer))
        hist += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reminder_sessions())
def test_kept_reminders_append_are_idempotent_and_off_is_identity(turns: list) -> None:
    on, off = stage(canon_keep_trailing_reminder="on"), stage(canon_keep_trailing_reminder="off")
    state, keep = C.CanonState(), frozenset({"keep_trailing_reminder"})
    prev = None
    for body, answer in turns:
        before = json.dumps(body)
        res = C.canonicalize(body, state, keep)
        twin = C.canonicalize(body, copy.deepcopy(state), keep)
        again = C.canonicalize(res.body, state, keep)
        assert json.dumps(res.body) == json.dumps(twin.body)                # deterministic
        assert json.dumps(again.body) == json.dumps(res.body)               # idempotent
        C.commit(state, body, res)
        p, q = prepare(on, body, HDR), prepare(off, body, HDR)
        assert json.dumps(body) == before and q.body is body and not q.changed
        assert json.dumps(p.body) == json.dumps(res.body)
        if prev is not None:
            assert p.report.sent_verdict == "APPEND"
            n = len(prev.body["messages"])
            assert json.dumps(p.body["messages"][:n]) == json.dumps(prev.body["messages"])
        for st_, prep in ((on, p), (off, q)):
            st_.record_response(prep, {"role": "assistant", "content": answer}, None)
        prev = p


# --- causes -> rules --------------------------------------------------------------------------
def test_every_rule_has_causes_and_every_cause_names_a_real_rule() -> None:
    fixed = [c for r in R.RULES for c in r.causes]
    assert len(fixed) == len(set(fixed)) and set(fixed) <= CAUSES    # one rule per cause
    for rule in R.RULES:
        assert rule.causes
        for cause in rule.causes:
            assert R.for_cause(cause) is rule and R.hint(cause) == rule.hint
            assert R.hint(cause).startswith(f"canon_{rule.name}=")
    assert R.for_cause("trailing_reminder_dropped").name == "keep_trailing_reminder"
    assert R.for_cause("clock_time").name == "relocate_clock_time"
    assert R.hint("env_block") == "canon_pin_env_block=dry_run"          # risky: try it first
    assert R.for_cause("history_before_files") is None
    assert R.hint("history_before_files").startswith("Aider moves its history")
    assert "history_compacted" in CAUSES and "compacted" not in CAUSES
