"""Aider's two per-turn mutations, played with its real prompt text and chunk order
(tests/aider_fixtures.py): the edit-format reminder leaves a user message once it is history,
and after an applied edit the history moves ahead of the re-sent files. The first one is
undone by the opt-in rule `keep_trailing_reminder`; the second is only reported."""

from __future__ import annotations

import itertools
import json

from aider_fixtures import FILES_CONTENT_PREFIX, HEADERS, REMINDER, AiderSession
from test_prefix_cases import make_stage, play

from prefixd.proxy.settings import Settings

DB = "class Store:\n    def __init__(self, path):\n        self.path = path\n" * 8
CACHED = DB + "\n    def get(self, key):\n        return self._cache.get(key)\n"


def conversation(st: object, turns: list[tuple[str, str]]) -> list:
    """Play question/answer turns without edits; the prepared requests, in order."""
    s = AiderSession({"app/db.py": DB})
    out = []
    for question, answer in turns:
        out.append(play(st, s.send(question), HEADERS, s.reply(answer)))
    return out


def index_of(messages: list[dict], text: str) -> int:
    return next(i for i, m in enumerate(messages) if m["content"].startswith(text))


def test_reminder_dropped_from_the_older_user_message() -> None:
    p1, p2 = conversation(make_stage(), [("add a cache to Store.get", "Which size?"),
                                         ("128 entries", "Here is the change.")])
    r = p2.report
    k = index_of(p2.body["messages"], "add a cache")
    assert r.verdict == "MUTATED" and r.causes == ["trailing_reminder_dropped"]
    assert (r.path, r.char_offset) == (f"messages[{k}]", len("add a cache to Store.get"))
    assert r.hint == "canon_keep_trailing_reminder=on"
    assert 0.8 * len(REMINDER) / 4 < r.lost_tokens < 1.2 * len(REMINDER) / 4
    assert p1.body["messages"][k]["content"].endswith(REMINDER)      # what Aider sent before


def test_history_moves_ahead_of_the_files_after_an_edit() -> None:
    st = make_stage()
    s = AiderSession({"app/db.py": DB})
    p1 = play(st, s.send("add a cache to Store.get"), HEADERS,
              s.reply("app/db.py\n```\n<<<<<<< SEARCH\n...", edits={"app/db.py": CACHED}))
    p2 = play(st, s.send("now add tests"), HEADERS)
    r = p2.report
    files_at = index_of(p1.body["messages"], FILES_CONTENT_PREFIX)
    assert r.verdict == "MUTATED" and r.causes == ["history_before_files"]
    assert r.path == f"messages[{files_at}]" and r.char_offset == 0
    assert index_of(p2.body["messages"], FILES_CONTENT_PREFIX) == files_at + 4
    assert "Aider" in r.hint


def test_reminder_as_trailing_system_message_is_reported_not_rewritten() -> None:
    """`reminder: sys` (gpt-4.1, deepseek-v3 names): the reminder is a last system message."""
    st = make_stage(canon_keep_trailing_reminder="on")
    s = AiderSession({"app/db.py": DB}, reminder="sys")
    play(st, s.send("add a cache to Store.get"), HEADERS, s.reply("Which size?"))
    p = play(st, s.send("128 entries"), HEADERS)
    assert p.report.verdict == "MUTATED" and p.report.causes == ["trailing_reminder_dropped"]
    assert not p.changed


def test_file_edited_outside_aider_is_chat_files_changed() -> None:
    st = make_stage()
    s = AiderSession({"app/db.py": DB})
    p1 = play(st, s.send("add a cache to Store.get"), HEADERS, s.reply("Which size?"))
    s.files["app/db.py"] = DB.replace("self.path = path", "self.path = str(path)")
    r = play(st, s.send("128 entries"), HEADERS).report
    files_at = index_of(p1.body["messages"], FILES_CONTENT_PREFIX)
    assert r.verdict == "MUTATED" and r.causes == ["chat_files_changed"]
    assert r.path == f"messages[{files_at}]" and r.char_offset > len(FILES_CONTENT_PREFIX)


def test_keep_trailing_reminder_makes_aider_turns_append() -> None:
    st = make_stage(canon_keep_trailing_reminder="on")
    ps = conversation(st, [("add a cache to Store.get", "Which size?"),
                           ("128 entries", "LRU or FIFO?"), ("LRU", "Here is the plan."),
                           ("go ahead", "Done.")])
    assert [p.report.sent_verdict for p in ps] == ["NEW", "APPEND", "APPEND", "APPEND"]
    for prev, cur in itertools.pairwise(ps):
        n = len(prev.body["messages"])
        assert json.dumps(cur.body["messages"][:n]) == json.dumps(prev.body["messages"])
        assert cur.report.fixed == ["keep_trailing_reminder"]
        assert cur.report.verdict == "MUTATED"
        assert cur.report.causes == ["trailing_reminder_dropped"]
        assert cur.report.saved_tokens > len(REMINDER) / 8
    users = [m["content"] for m in ps[-1].body["messages"] if m["role"] == "user"
             and m["content"].startswith(("add a cache", "128 entries", "LRU", "go ahead"))]
    assert len(users) == 4 and all(u.endswith("\n\n" + REMINDER) for u in users)


def test_keep_trailing_reminder_dry_run_and_default_off() -> None:
    assert Settings(_env_file=None).canon_keep_trailing_reminder == "off"
    st = make_stage(canon_keep_trailing_reminder="dry_run")
    _, p2 = conversation(st, [("add a cache to Store.get", "Which size?"), ("128", "ok")])
    assert not p2.changed and p2.report.verdict == "MUTATED"
    [fix] = p2.report.would_fix
    assert fix["rule"] == "keep_trailing_reminder" and fix["saved_tokens"] > len(REMINDER) / 8
    _, p2 = conversation(make_stage(), [("add a cache to Store.get", "Which size?"), ("128", "k")])
    [fix] = p2.report.would_fix            # off: still measured on a copy, as a hint
    assert not p2.changed and fix["rule"] == "keep_trailing_reminder" and fix["mode"] == "off"


def test_kept_reminder_and_date_restatement_replay_together() -> None:
    """Aider's system prompt states the date. With freeze_date on, the new date is restated
    after the reminder; both are replayed once that message is history."""
    st = make_stage(canon_keep_trailing_reminder="on", canon_freeze_date="on")
    s = AiderSession({"app/db.py": DB})
    ps = [play(st, s.send("add a cache"), HEADERS, s.reply("Which size?"))]
    for question, day in (("128", "04"), ("LRU", "04"), ("go", "05")):
        body = json.loads(json.dumps(s.send(question)).replace("2026-08-03", f"2026-08-{day}"))
        ps.append(play(st, body, HEADERS, s.reply("ok")))
    assert [p.report.sent_verdict for p in ps] == ["NEW", "APPEND", "APPEND", "APPEND"]
    for prev, cur in itertools.pairwise(ps):
        n = len(prev.body["messages"])
        assert json.dumps(cur.body["messages"][:n]) == json.dumps(prev.body["messages"])
    newest = [p.body["messages"][-1]["content"] for p in ps]
    assert ["context-update" in t for t in newest] == [False, True, False, True]
    assert newest[1].index(REMINDER) < newest[1].index("2026-08-04 (supersedes")
