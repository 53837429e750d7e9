"""What the client did to its own history, told apart from a user's edit: template parameters
that leave the prompt alone, history compaction (a summary takes the place of old messages)
and tool-output pruning (an old output replaced by a placeholder). Each is played as a real
client's request sequence through PrefixTracker (a /v1/messages client's in the chat form the
proxy translates it to)."""

from __future__ import annotations

import json

from aider_fixtures import HEADERS as AIDER_HEADERS
from aider_fixtures import AiderSession
from test_prefix_cases import chat, make_stage, messages_api, ok, pairs, play

from prefixd.proxy.prefix.report import header


def claude_code(messages: list[dict]) -> dict:
    """A Claude Code /v1/messages body, as the prefix stages see it."""
    return messages_api({"model": "m", "max_tokens": 100, "system": "You are Claude Code.",
                         "messages": messages})


# --- template parameters ----------------------------------------------------------------------
def test_params_only_change_follows_the_prompt() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "params-1"}
    play(st, chat("sys " * 40, [], "hi", reasoning_effort="low", max_tokens=100), hdr, ok("yo"))
    hist = [{"role": "user", "content": "hi"}, ok("yo")]
    p = play(st, chat("sys " * 40, hist, "more", reasoning_effort="high", max_tokens=300,
                      temperature=0.2), hdr)
    r = p.report
    assert r.verdict == "APPEND" and r.causes == ["params_changed"]
    assert r.reusable_tokens == r.prev_prompt_tokens > 0 and r.lost_tokens == 0
    assert header(r).startswith("verdict=APPEND;cause=params_changed;sent=APPEND;reused=")
    assert "at=" not in header(r)


def test_params_added_on_a_resend_is_identical() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "params-2"}
    play(st, chat("sys", [], "hi"), hdr)
    r = play(st, chat("sys", [], "hi", tool_choice="auto"), hdr).report
    assert r.verdict == "IDENTICAL" and r.causes == ["params_changed"]


def test_params_change_with_a_real_mutation_keeps_the_mutation_first() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "params-3"}
    play(st, chat("You are a bot. " * 20 + "Context: doc A", [], "hi", reasoning_effort="low"),
         hdr, ok())
    hist = [{"role": "user", "content": "hi"}, ok()]
    r = play(st, chat("You are a bot. " * 20 + "Context: doc B", hist, "more",
                      reasoning_effort="high"), hdr).report
    assert r.verdict == "MUTATED" and r.path == "system[0]"
    assert r.causes == ["system_changed:unknown", "params_changed"]


def test_model_change_is_still_a_mutation() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "params-4"}
    play(st, chat("sys", [], "hi"), hdr, ok())
    body = chat("sys", [{"role": "user", "content": "hi"}, ok()], "more")
    body["model"] = "other"
    r = play(st, body, hdr).report
    assert r.verdict == "MUTATED" and r.causes == ["model_changed"] and r.reusable_tokens == 0


# --- history compaction -----------------------------------------------------------------------
def agent_turns(n: int) -> list[dict]:
    out: list[dict] = []
    for i in range(n):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read", "arguments": json.dumps({"path": f"src/f{i}.ts"})}}
        out += [{"role": "user", "content": f"step {i}: look at f{i}.ts"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": f"export const f{i} = 1;\n"
                 * 30}, ok(f"f{i}.ts exports one constant.")]
    return out


def test_opencode_summary_pair_is_history_compacted() -> None:
    """OpenCode sends the compaction as a user question and the summary as the answer."""
    st = make_stage()
    hdr = {"User-Agent": "opencode/1.0.3", "x-session-affinity": "ses_5d1f0c9a2b7e"}
    hist = agent_turns(6)
    play(st, chat("You are opencode.", hist, "go on"), hdr, ok("done"))
    compacted = [{"role": "user", "content": "What did we do so far?"},
                 ok("We read f0.ts to f5.ts in src/; each exports one constant. Next: tests.")]
    r = play(st, chat("You are opencode.", compacted, "now write the tests"), hdr).report
    assert r.verdict == "TRUNCATED" and r.causes == ["history_compacted"]
    assert r.path == "messages[1]"


def test_codex_compaction_keeps_user_messages_and_adds_a_summary() -> None:
    """Codex rebuilds the history as the earlier user messages, then the summary."""
    st = make_stage()
    hdr = {"User-Agent": "codex_cli_rs/0.46.0", "session_id": "0199a1b2-c3d4"}
    hist = agent_turns(4)
    play(st, chat("You are Codex.", hist, "continue"), hdr, ok("ok"))
    users = [m for m in hist if m["role"] == "user"]
    summary = ("Another language model started to solve this problem and produced a summary of "
               "its thinking process. ...\nWe read src/f0.ts to src/f3.ts.")
    body = chat("You are Codex.", [*users, {"role": "user", "content": "continue"},
                                   {"role": "user", "content": summary}], "write tests")
    r = play(st, body, hdr).report
    assert r.verdict == "TRUNCATED" and r.causes == ["history_compacted"]
    assert r.path == "messages[2]"


def test_claude_code_compaction_of_a_short_session() -> None:
    """The summary replaces as many messages as it adds: no shrinking to go by."""
    st = make_stage()
    hdr = {"X-Claude-Code-Session-Id": "0b6a6c1e-2f9d-4c55-8b1e-3d2a4f5e6a7b"}
    first = [{"role": "user", "content": "find the flaky test"}, ok("It is test_io." * 30),
             {"role": "user", "content": "fix it"}]
    play(st, claude_code(first), hdr, ok("Done."))
    summary = ("This session is being continued from a previous conversation that ran out of "
               "context. The conversation is summarized below:\nWe fixed test_io.")
    msgs = [{"role": "user", "content": summary}, ok("Understood."),
            {"role": "user", "content": "now run the suite"}]
    r = play(st, claude_code(msgs), hdr).report
    assert r.verdict == "TRUNCATED" and r.causes == ["history_compacted"]


def test_aider_summarized_done_messages_are_history_compacted() -> None:
    st = make_stage()
    s = AiderSession({"app/db.py": "class Store:\n    pass\n"})
    s.done = pairs(4)
    play(st, s.send("add a get method"), AIDER_HEADERS, s.reply("Which signature?"))
    s.done = [{"role": "user", "content": "I spoke to you previously about a number of things.\n"
                                          "I asked you about questions 0 to 3."}, ok("Ok.")]
    r = play(st, s.send("get(key)"), AIDER_HEADERS).report
    assert r.verdict == "TRUNCATED" and r.causes == ["history_compacted"]


def test_newest_message_asking_for_a_summary_is_still_a_branch() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "branch-summary"}
    hist = pairs(3)
    play(st, chat("sys", hist, "go on"), hdr, ok())
    r = play(st, chat("sys", hist[:2], "write a summary of the design"), hdr).report
    assert r.verdict == "BRANCH" and r.causes == ["branch_edit"]


# --- tool-output pruning ----------------------------------------------------------------------
def test_short_messages_api_tool_result_pruned_to_a_placeholder() -> None:
    st = make_stage()
    hdr = {"X-Claude-Code-Session-Id": "5e2c1a0b-7d3f-4e8a-9b6c-1f2e3d4c5b6a"}

    def result(text: str) -> dict:
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                             "content": text}]}

    use = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}]}
    listing = "README.md\npyproject.toml\nsrc/\ntests/\n" * 3
    msgs = [{"role": "user", "content": "what is here?"}, use, result(listing)]
    play(st, claude_code(msgs), hdr, ok("Files."))
    msgs = [msgs[0], use, result("(output pruned)"), ok("Files."),
            {"role": "user", "content": "and now?"}]
    r = play(st, claude_code(msgs), hdr).report
    assert r.verdict == "TRUNCATED" and r.causes == ["tool_output_pruned"]
    assert r.path == "messages[3]"        # the tool message the tool_result block became


def test_short_tool_message_pruned_keeps_its_message() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "prune-2"}
    hist = agent_turns(2)
    hist[2] = {**hist[2], "content": "export const f0 = 1;\n" * 4}
    play(st, chat("sys", hist, "go on"), hdr, ok("k"))
    pruned = [*hist[:2], {**hist[2], "content": "[tool output removed]"}, *hist[3:],
              {"role": "user", "content": "go on"}, ok("k")]
    r = play(st, chat("sys", pruned, "next"), hdr).report
    assert r.verdict == "TRUNCATED" and r.causes == ["tool_output_pruned"]


def test_rewritten_tool_output_is_not_pruning() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "prune-3"}
    hist = agent_turns(2)
    play(st, chat("sys", hist, "go on"), hdr, ok("k"))
    edited = [*hist[:2], {**hist[2], "content": "export const f0 = 2;\n" * 30}, *hist[3:],
              {"role": "user", "content": "go on"}, ok("k")]
    r = play(st, chat("sys", edited, "next"), hdr).report
    assert r.verdict == "MUTATED" and "tool_output_pruned" not in r.causes
