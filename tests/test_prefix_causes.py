"""Precise causes for three mutations a black-box review found reported generically: a
`<system-reminder>` sent as its own content part that moves to the newest message, an older
tool call whose arguments were re-serialized, and a refreshed Aider repo map. Each is played
as a real client request sequence through PrefixTracker."""

from __future__ import annotations

import json

from test_prefix_cases import chat, make_stage, messages_api, ok, pairs, play

# --- 1. A reminder part moves from an older user message to the newest one ------------------
CC_HEADERS = {"User-Agent": "claude-cli/2.1.37 (external, cli)",
              "X-Claude-Code-Session-Id": "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d"}
CTX = ("<system-reminder>\nAs you answer the user's questions, you can use the following context:"
       "\n# claudeMd\nContents of /home/me/proj/CLAUDE.md:\n\nUse pytest. Keep functions short."
       "\n</system-reminder>")
PLAN = ("<system-reminder>\nPlan mode is active. The user indicated that they do not want you to"
        " execute yet -- you MUST NOT make any edits.\n</system-reminder>")


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def test_reminder_part_moved_to_newest_message() -> None:
    st = make_stage()
    first = {"role": "user", "content": parts(CTX, PLAN, "plan the refactor of db.py")}
    body1 = {"model": "m", "messages": [{"role": "system", "content": "You are Claude Code."},
                                        first]}
    play(st, body1, CC_HEADERS, ok("Here is the plan: split db.py into two modules."))
    # Claude Code drops the plan-mode reminder from the old turn and attaches it to the new one
    kept = {"role": "user", "content": parts(CTX, "plan the refactor of db.py")}
    body = {"model": "m", "messages": [
        {"role": "system", "content": "You are Claude Code."}, kept,
        ok("Here is the plan: split db.py into two modules."),
        {"role": "user", "content": parts(PLAN, "what about the tests?")}]}
    r = play(st, body, CC_HEADERS).report
    assert r.verdict == "MUTATED"
    assert r.causes == ["block_moved", "system_reminder_moved"]
    assert (r.path, r.char_offset) == ("messages[1].content[1]", 0)
    assert r.moved_from == "messages[1].content[1]" and r.moved_to == "messages[3].content[0]"


def test_trailing_reminder_part_dropped_from_older_message_is_moved() -> None:
    """The old message loses a whole part, so no new segment shares the old part's path."""
    st = make_stage()
    first = {"role": "user", "content": parts(CTX, "plan the refactor of db.py", PLAN)}
    msgs = [{"role": "system", "content": "You are Claude Code."}, first]
    play(st, {"model": "m", "messages": msgs}, CC_HEADERS, ok("Split db.py in two."))
    msgs = [msgs[0], {"role": "user", "content": parts(CTX, "plan the refactor of db.py")},
            ok("Split db.py in two."), {"role": "user", "content": parts("go on", PLAN)}]
    r = play(st, {"model": "m", "messages": msgs}, CC_HEADERS).report
    assert r.verdict == "MUTATED" and r.causes == ["block_moved", "system_reminder_moved"]
    assert r.path == "messages[1].content[2]"
    assert r.moved_from == "messages[1].content[2]" and r.moved_to == "messages[3].content[1]"


def test_reminder_part_left_a_message_that_became_one_text() -> None:
    st = make_stage()
    hdr = {"User-Agent": "opencode/1.0.3", "x-session-affinity": "ses_0c4f7e21b9aa"}
    msgs = [{"role": "system", "content": "You are opencode."},
            {"role": "user", "content": parts("plan the change", PLAN)}]
    play(st, {"model": "m", "messages": msgs}, hdr, ok("plan"))
    msgs = [msgs[0], {"role": "user", "content": "plan the change"}, ok("plan"),
            {"role": "user", "content": parts("build it", PLAN)}]
    r = play(st, {"model": "m", "messages": msgs}, hdr).report
    assert r.verdict == "MUTATED" and r.causes == ["block_moved", "system_reminder_moved"]
    assert r.moved_from == "messages[1].content[1]" and r.moved_to == "messages[3].content[1]"


def test_history_shifted_by_compaction_is_not_a_move() -> None:
    """A reminder repeated in later turns that slide down after compaction did not move."""
    st = make_stage()
    hdr = {"X-Session-Id": "cc-compact"}
    old = [{"role": "user", "content": "task " + PLAN}, ok("a"), {"role": "user", "content": "x"},
           ok("b"), {"role": "user", "content": "y " + PLAN}, ok("c")]
    play(st, chat("sys", old, "next"), hdr, ok("d"))
    summary = [{"role": "user", "content": "Summary of the previous conversation: a, b."},
               ok("Understood."), {"role": "user", "content": "y " + PLAN}, ok("c")]
    r = play(st, chat("sys", summary, "next"), hdr).report
    assert "block_moved" not in r.causes


def test_reminder_inside_text_moved_to_a_part_of_the_newest_message() -> None:
    st = make_stage()
    hdr = {"User-Agent": "opencode/1.0.3", "x-session-affinity": "ses_5f1d9c2aa0e3"}
    hist = pairs(3)
    play(st, chat("You are opencode.", hist, "plan the change\n" + PLAN), hdr, ok("plan"))
    hist += [{"role": "user", "content": "plan the change"}, ok("plan")]
    body = chat("You are opencode.", hist, "")
    body["messages"][-1]["content"] = parts("build it", PLAN)
    r = play(st, body, hdr).report
    assert r.verdict == "MUTATED" and r.causes == ["block_moved", "system_reminder_moved"]
    assert r.path == "messages[7]" and r.moved_from == "messages[7]"
    assert r.moved_to == "messages[9].content[1]"


def test_reminder_repeated_in_every_turn_is_append() -> None:
    st = make_stage()
    first = {"role": "user", "content": parts(CTX, "list the files")}
    msgs = [{"role": "system", "content": "You are Claude Code."}, first]
    play(st, {"model": "m", "messages": msgs}, CC_HEADERS, ok("a.py b.py"))
    msgs = [*msgs, ok("a.py b.py"), {"role": "user", "content": parts(CTX, "read a.py")}]
    assert play(st, {"model": "m", "messages": msgs}, CC_HEADERS).report.verdict == "APPEND"


# --- 2. An older, already echoed tool call re-serialized -------------------------------------
def call(i: int, args: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "read_file", "arguments": args}}]}


def result(i: int) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": f"contents of f{i}.py " * 20}


def test_older_tool_call_args_reserialized() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "goose-7"}
    a0 = '{"path": "src/f0.py", "offset": 0, "limit": 200}'
    a1 = '{"path": "src/f1.py", "offset": 0, "limit": 200}'
    hist = [{"role": "user", "content": "read the sources"}]
    play(st, {"model": "m", "messages": [{"role": "system", "content": "sys"}, *hist]}, hdr,
         call(0, a0))
    hist += [call(0, a0), result(0)]
    play(st, {"model": "m", "messages": [{"role": "system", "content": "sys"}, *hist]}, hdr,
         call(1, a1))
    hist += [call(1, a1), result(1)]
    p = play(st, {"model": "m", "messages": [{"role": "system", "content": "sys"}, *hist]}, hdr)
    assert p.report.verdict == "APPEND"
    # the client re-serializes every stored call: compact bytes, keys sorted
    hist[1] = call(0, json.dumps(json.loads(a0), separators=(",", ":"), sort_keys=True))
    hist += [ok("done"), {"role": "user", "content": "now summarize"}]
    r = play(st, {"model": "m", "messages": [{"role": "system", "content": "sys"}, *hist]},
             hdr).report
    assert r.verdict == "MUTATED" and r.causes == ["tool_args_reserialized"]
    assert r.path == "messages[2].tool_calls[0]"


def test_messages_api_tool_use_input_key_order_reserialized() -> None:
    """Claude Code resends a tool_use with its input's keys in another order: after the
    translation to chat form, the same arguments in other bytes."""
    st = make_stage()
    hdr = {"X-Claude-Code-Session-Id": "2f6a1c9e-0d4b-4e8a-9f3c-7b5d1e2a4c6f"}

    def use(inp: dict) -> dict:
        return {"role": "assistant", "content": [
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_01A", "name": "Read", "input": inp}]}

    res = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A",
                                         "content": "print('hi')\n" * 30}]}
    msgs = [{"role": "user", "content": "read main.py"},
            use({"file_path": "/home/me/main.py", "limit": 200}), res]
    def body(messages: list[dict]) -> dict:
        return messages_api({"model": "m", "max_tokens": 100, "system": "You are Claude Code.",
                             "messages": messages})

    play(st, body(msgs), hdr, ok("ok"))
    msgs = [msgs[0], use({"limit": 200, "file_path": "/home/me/main.py"}), res, ok("ok"),
            {"role": "user", "content": "thanks"}]
    r = play(st, body(msgs), hdr).report
    assert r.verdict == "MUTATED" and r.causes == ["tool_args_reserialized"]
    assert r.path == "messages[2].tool_calls[0]"


def test_older_tool_call_with_other_args_is_not_reserialized() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "goose-8"}
    a0 = '{"path": "src/f0.py"}'
    hist = [{"role": "user", "content": "read"}]
    play(st, {"model": "m", "messages": [{"role": "system", "content": "sys"}, *hist]}, hdr,
         call(0, a0))
    hist += [call(0, a0), result(0)]
    play(st, {"model": "m", "messages": [{"role": "system", "content": "sys"}, *hist]}, hdr)
    hist[1] = call(0, '{"path": "src/other.py"}')
    hist += [ok("done"), {"role": "user", "content": "next"}]
    r = play(st, {"model": "m", "messages": [{"role": "system", "content": "sys"}, *hist]},
             hdr).report
    assert "tool_args_reserialized" not in r.causes


# --- 3. Aider refreshes its repo map in messages[1] -------------------------------------------
AIDER_HEADERS = {"User-Agent": "aider/0.86.1", "X-Session-Id": "aider-proj"}
AIDER_SYSTEM = ("Act as an expert software developer.\nAlways use best practices when coding.\n"
                + "Respect and use existing conventions, libraries, etc. " * 20)
REPO_PREFIX = ("Here are summaries of some files present in my git repository.\n"
               "Do not propose changes to these files, treat them as *read-only*.\n"
               "If you need to edit any of these files, ask me to *add them to the chat* first.\n"
               "\n")


def repo_map(extra: str = "") -> str:
    return (REPO_PREFIX + "app/db.py:\n⋮\n│class Store:\n│    def __init__(self, path):\n⋮\n"
            "│    def get(self, key):\n⋮\n\napp/main.py:\n⋮\n│def main(argv):\n⋮\n" + extra)


def aider_body(rmap: str, history: list[dict], user: str) -> dict:
    return chat(AIDER_SYSTEM, [{"role": "user", "content": rmap},
                               ok("Ok, I won't try and edit those files without asking first."),
                               *history], user)


def test_aider_repo_map_refresh_is_mutated_repo_map() -> None:
    st = make_stage()
    hist = pairs(4)
    play(st, aider_body(repo_map(), hist, "add a cache to Store.get"), AIDER_HEADERS, ok("done"))
    hist += [{"role": "user", "content": "add a cache to Store.get"}, ok("done")]
    fresh = repo_map("\napp/cache.py:\n⋮\n│class LRU:\n│    def put(self, key, value):\n⋮\n")
    r = play(st, aider_body(fresh, hist, "now add tests"), AIDER_HEADERS).report
    assert r.verdict == "MUTATED" and r.causes == ["repo_map"]
    assert r.path == "messages[1]" and r.char_offset == len(repo_map())


def test_edit_of_older_user_prose_stays_branch_edit() -> None:
    st = make_stage()
    hist = pairs(4)
    play(st, aider_body(repo_map(), hist, "add a cache to Store.get"), AIDER_HEADERS, ok("done"))
    hist[2] = {"role": "user", "content": "question 1 but phrased differently"}
    r = play(st, aider_body(repo_map(), hist, "again"), AIDER_HEADERS).report
    assert r.verdict == "BRANCH" and r.causes == ["branch_edit"]
    assert r.path == "messages[5]"
