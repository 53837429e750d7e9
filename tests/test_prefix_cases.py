"""The ten request sequences of docs/MUTATIONS.md §8, played through the real PrefixTracker
as the pipeline's prefix stages call it: what the report says, and what canonicalization
forwards."""

from __future__ import annotations

import json

from prefixd.api.usage import Usage
from prefixd.proxy.prefix.report import header
from prefixd.proxy.prefix.tracker import PrefixTracker, Prepared
from prefixd.proxy.settings import Settings
from prefixd.proxy.translate import AnthropicTranslator

OFF = {"canon_strip_billing_header": "off", "canon_pin_tool_order": "off",
       "canon_pin_whitespace": "off"}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_stage(**kw: object) -> PrefixTracker:
    return PrefixTracker(Settings(_env_file=None, prefix_excerpts=True, **kw), clock=Clock())


def prepare(st: PrefixTracker, body: dict, headers: dict | None = None) -> Prepared:
    """What the pipeline's canonicalize and detect stages do with a request's body."""
    p = st.canonicalize(body, headers or {})
    if st.settings.prefix_detect:
        st.detect(p)
    return p


def play(st: PrefixTracker, body: dict, headers: dict | None = None, reply: dict | None = None,
         usage: Usage | None = None) -> Prepared:
    """One request and its answer."""
    p = prepare(st, body, headers)
    st.record_response(p, reply or {"role": "assistant", "content": "ok"}, usage)
    return p


def messages_api(body: dict) -> dict:
    """The chat body the proxy's translate stage makes of an Anthropic Messages body: what
    the prefix stages see of a /v1/messages request."""
    return AnthropicTranslator().request(body)


def chat(system: str, history: list[dict], user: str, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, *history,
                                       {"role": "user", "content": user}], **extra}


def pairs(n: int) -> list[dict]:
    out: list[dict] = []
    for i in range(n):
        out += [{"role": "user", "content": f"question {i} " + "lorem ipsum " * 20},
                {"role": "assistant", "content": f"answer {i} " + "dolor sit " * 20}]
    return out


def ok(content: str = "ok") -> dict:
    return {"role": "assistant", "content": content}


def fwd_text(p: Prepared) -> str:
    return json.dumps(p.body, ensure_ascii=False)


# --- 1. Claude Code billing header --------------------------------------------------------
CC_HEADERS = {"User-Agent": "claude-cli/2.1.37 (external, cli)",
              "X-Claude-Code-Session-Id": "57a121ec-f78c-48c3-a745-e3036a3ecc33"}
CC_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude.\n" + "Be careful. " * 200


def cc_body(cch: str, messages: list[dict]) -> dict:
    """Claude Code's /v1/messages body, as the prefix stages see it (translated)."""
    return messages_api({
        "model": "m", "max_tokens": 100, "messages": messages,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9;"
                    f" cc_entrypoint=cli; cch={cch};"},
                   {"type": "text", "text": CC_SYSTEM, "cache_control": {"type": "ephemeral"}}]})


def cc_turns(st: PrefixTracker) -> tuple[Prepared, Prepared]:
    first = [{"role": "user", "content": [{"type": "text", "text": "list the files"}]}]
    p1 = play(st, cc_body("fa690", first), CC_HEADERS, ok("Here they are."))
    echo = {"role": "assistant", "content": [{"type": "text", "text": "Here they are."}]}
    second = [*first, echo,
              {"role": "user", "content": [{"type": "text", "text": "now read a.py"}]}]
    return p1, play(st, cc_body("0aaa9", second), CC_HEADERS)


def test_1_billing_header_reported_when_rule_off() -> None:
    p1, p2 = cc_turns(make_stage(**OFF))
    assert p1.report.verdict == "NEW" and p1.lane == "cc:57a121ec-f78c-48c3-a745-e3036a3ecc33"
    r = p2.report
    assert (r.verdict, r.region, r.path) == ("MUTATED", "system", "system[0]")
    assert r.causes == ["anthropic_billing_header"]
    assert r.char_offset == len("x-anthropic-billing-header: cc_version=2.1.37.0d9; "
                                "cc_entrypoint=cli; cch=")        # the first changed byte
    assert r.reusable_tokens < 25 < r.lost_tokens
    assert "cch=fa690" in r.spans[0].old_excerpt and "cch=0aaa9" in r.spans[0].new_excerpt
    assert header(r).startswith("verdict=MUTATED;cause=anthropic_billing_header;sent=MUTATED;"
                       "reused=")
    # the rule that is off says what it would keep, computed by running it on a copy
    [fix] = r.would_fix
    assert fix["rule"] == "strip_billing_header" and fix["mode"] == "off"
    assert 0.9 * r.lost_tokens < fix["saved_tokens"] <= r.lost_tokens
    assert "would_fix=strip_billing_header" in header(r)
    assert r.hint == "canon_strip_billing_header=on"
    assert not p2.changed


def test_1_billing_header_stripped_by_default() -> None:
    p1, p2 = cc_turns(make_stage())
    assert p1.changed and "billing" not in fwd_text(p1)
    assert p1.body["messages"][0]["content"] == CC_SYSTEM   # the header line is gone
    r = p2.report
    # the report shows what the client did, and what prefixd did about it
    assert r.verdict == "MUTATED" and r.causes == ["anthropic_billing_header"]
    assert r.fixed == ["strip_billing_header"] and r.sent_verdict == "APPEND"
    assert header(r).startswith("verdict=MUTATED;cause=anthropic_billing_header;"
                       "fixed=strip_billing_header;sent=APPEND;reused=")
    assert r.reusable_tokens == r.prev_prompt_tokens > 0
    assert r.saved_tokens > 0.9 * r.reusable_tokens


# --- 2. OpenCode midnight rollover ----------------------------------------------------------
OC_HEADERS = {"User-Agent": "opencode/0.15.3", "x-session-affinity": "ses_6aade4081ffe216ygZUg"}


def oc_system(date: str) -> str:
    return ("You are opencode, an interactive CLI agent.\n" + "Follow the rules. " * 50 +
            "\n<env>\n  Working directory: /home/me/proj\n  Is directory a git repo: yes\n"
            f"  Platform: linux\n  Today's date: {date}\n</env>\n" + "More rules. " * 30)


def oc_turns(st: PrefixTracker) -> list[Prepared]:
    hist = pairs(20)
    out = [play(st, chat(oc_system("Tue Sep 16 2025"), hist, "fix the bug"), OC_HEADERS, ok("a"))]
    hist += [{"role": "user", "content": "fix the bug"}, {"role": "assistant", "content": "a"}]
    out.append(play(st, chat(oc_system("Wed Sep 17 2025"), hist, "run tests"), OC_HEADERS, ok("b")))
    hist += [{"role": "user", "content": "run tests"}, {"role": "assistant", "content": "b"}]
    out.append(play(st, chat(oc_system("Wed Sep 17 2025"), hist, "commit"), OC_HEADERS))
    return out


def test_2_midnight_rollover_reported() -> None:
    _, p2, p3 = oc_turns(make_stage())
    r = p2.report
    assert r.lane == "oc:ses_6aade4081ffe216ygZUg" and r.verdict == "MUTATED"
    assert {"js_todatestring", "todays_date_line"} <= set(r.causes) and r.region == "system"
    assert r.lost_tokens > 0.8 * r.prev_prompt_tokens
    assert p3.report.verdict == "APPEND"          # the new date is the new baseline


def test_2_freeze_date_pins_and_replays() -> None:
    p1, p2, p3 = oc_turns(make_stage(canon_freeze_date="on"))
    assert p2.body["messages"][0] == p1.body["messages"][0]       # system bytes unchanged
    tail = p2.body["messages"][-1]["content"]
    assert tail.startswith("run tests\n\n<context-update") and "Wed Sep 17 2025" in tail
    assert "supersedes" in tail
    assert p2.report.sent_verdict == "APPEND" and p2.report.fixed == ["freeze_date"]
    assert p2.report.verdict == "MUTATED" and "js_todatestring" in p2.report.causes
    # Replay: turn 3 carries turn 2's user message with the very same block.
    assert p3.body["messages"][-3] == p2.body["messages"][-1]
    assert p3.report.sent_verdict == "APPEND"
    assert p3.body["messages"][0] == p1.body["messages"][0]


# --- 3. Cline/Roo tail environment block (negative) ------------------------------------------
def cline_user(task: str, sec: int, cost: float) -> dict:
    env = ("<environment_details>\n# VSCode Visible Files\nsrc/a.ts\n\n# Current Time\n"
           f"1/15/2025, 3:04:{sec:02d} PM (America/New_York, UTC-5:00)\n\n"
           f"# Current Cost\n${cost:.2f}\n</environment_details>")
    return {"role": "user", "content": [{"type": "text", "text": task},
                                        {"type": "text", "text": env}]}


def test_3_tail_environment_block_is_not_a_mutation() -> None:
    st = make_stage(canon_freeze_date="on", canon_relocate_clock_time="on",
                    canon_pin_env_block="on")
    hdr = {"User-Agent": "Cline/3.2", "X-Session-Id": "task-1"}
    msgs = [cline_user("<task>add a test</task>", 5, 0.01)]
    reports = []
    for turn in range(4):
        body = {"model": "m", "messages": [{"role": "system", "content": "You are Cline."},
                                           *msgs]}
        p = play(st, body, hdr, ok(f"step {turn}"))
        assert not p.changed
        reports.append(p.report)
        msgs += [ok(f"step {turn}"), cline_user(f"result {turn}", 6 + turn, 0.02 * turn)]
    assert [r.verdict for r in reports] == ["NEW", "APPEND", "APPEND", "APPEND"]
    assert all(not r.causes for r in reports)


# --- 4. Goose-style time with seconds ---------------------------------------------------------
def goose_system(stamp: str) -> str:
    return ("You are a general-purpose AI agent called goose.\n\n"
            f"The current date is {stamp}.\n\n" + "Use the tools wisely. " * 100)


def test_4_clock_time_in_system_prompt() -> None:
    st = make_stage()
    play(st, chat(goose_system("2025-05-03 14:22:07"), [], "hi"), {}, ok("hello"))
    p2 = play(st, chat(goose_system("2025-05-03 14:22:47"), [], "hi",), {}, ok())
    # the same first user message, no session header: the fingerprint lane still matches
    r = p2.report
    assert r.verdict == "MUTATED" and {"clock_time", "iso_datetime"} <= set(r.causes)
    assert r.path == "system[0]"
    assert r.char_offset == goose_system("2025-05-03 14:22:07").index("14:22:07") + 6
    assert 0 < r.token_offset < 30 and not r.token_offset_exact


def test_4_relocate_clock_time_keeps_the_prefix_and_states_the_time() -> None:
    st = make_stage(canon_relocate_clock_time="on")
    p1 = play(st, chat(goose_system("2025-05-03 14:22:07"), [], "hi"), {}, ok("hello"))
    hist = [{"role": "user", "content": "hi"}, ok("hello")]
    p2 = play(st, chat(goose_system("2025-05-03 14:22:47"), hist, "and now?"), {}, ok())
    assert p2.report.sent_verdict == "APPEND" and p2.report.fixed == ["relocate_clock_time"]
    assert p2.report.verdict == "MUTATED" and "clock_time" in p2.report.causes
    assert p2.body["messages"][0] == p1.body["messages"][0]
    where = [i for i, m in enumerate(p2.body["messages"]) if "14:22:47" in m["content"]]
    assert where == [len(p2.body["messages"]) - 1]


# --- 5. MCP tools reordered, schema keys shuffled -------------------------------------------
def mcp_tools() -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"mcp_tool_{i:02d}", "description": f"Tool number {i}. " * 5,
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "limit": {"type": "integer"}, "mode": {"type": "string"}},
            "required": ["path"]}}} for i in range(12)]


def shuffled_tools() -> list[dict]:
    tools = list(reversed(mcp_tools()))
    for t in tools[:2]:
        props = t["function"]["parameters"]["properties"]
        t["function"]["parameters"]["properties"] = dict(reversed(list(props.items())))
    return tools


def test_5_reordered_tools_reported_when_rule_off() -> None:
    st = make_stage(**OFF)
    play(st, chat("sys", [], "hi", tools=mcp_tools()), {}, ok("x"))
    hist = [{"role": "user", "content": "hi"}, ok("x")]
    r = play(st, chat("sys", hist, "more", tools=shuffled_tools())).report
    assert r.verdict == "MUTATED" and r.region == "tools" and r.path == "tools[0]"
    assert {"tools_reordered", "schema_key_order"} <= set(r.causes)
    assert r.reusable_tokens < 20 < r.lost_tokens


def test_5_pin_tool_order_forwards_first_seen_bytes() -> None:
    st = make_stage()
    p1 = play(st, chat("sys", [], "hi", tools=mcp_tools()), {}, ok("x"))
    hist = [{"role": "user", "content": "hi"}, ok("x")]
    p2 = play(st, chat("sys", hist, "more", tools=shuffled_tools()))
    assert json.dumps(p2.body["tools"]) == json.dumps(p1.body["tools"])
    assert p2.report.sent_verdict == "APPEND" and p2.report.fixed == ["pin_tool_order"]
    assert p2.report.verdict == "MUTATED"
    assert {"tools_reordered", "schema_key_order"} <= set(p2.report.causes)


# --- 6. Tool added mid-session ----------------------------------------------------------------
def test_6_tool_added_is_reported_even_when_pinned() -> None:
    st = make_stage()
    hist: list[dict] = []
    nav = {"type": "function", "function": {"name": "browser_navigate",
                                            "parameters": {"type": "object"}}}
    for turn in range(5):
        tools = mcp_tools() if turn < 4 else [*mcp_tools()[:3], nav, *mcp_tools()[3:]]
        p = play(st, chat("sys " * 300, hist, f"turn {turn}", tools=tools), {}, ok(f"r{turn}"))
        hist += [{"role": "user", "content": f"turn {turn}"}, ok(f"r{turn}")]
    r = p.report
    assert r.verdict == "MUTATED" and r.tools_added == ["browser_navigate"]
    # where the client put it; prefixd sends it last, after the twelve pinned tools
    assert r.causes == ["tools_added"] and r.path == "tools[3]"
    assert p.body["tools"][-1]["function"]["name"] == "browser_navigate"
    tools_chars = sum(len(json.dumps(t, separators=(",", ":"))) for t in mcp_tools())
    # tools render first: all twelve old ones stay reusable, system and history are lost
    assert abs(r.reusable_tokens - tools_chars / 4) <= 2
    assert r.lost_tokens == r.prev_prompt_tokens - r.reusable_tokens > len("sys " * 300) / 4


# --- 7. Moved <system-reminder> ---------------------------------------------------------------
def test_7_moved_system_reminder() -> None:
    st = make_stage()
    hist = [*pairs(24), {"role": "user", "content": "ok"}]
    reminder = "<system-reminder>Plan mode is active. Do not edit files.</system-reminder>\n"
    hdr = {"User-Agent": "opencode/1.0", "X-Session-Id": "ses_plan"}
    body1 = chat("sys", hist, reminder + "plan the change")
    assert len(body1["messages"]) == 51
    play(st, body1, hdr, ok("plan"))
    hist2 = [*hist, {"role": "user", "content": "plan the change"}, ok("plan")]
    p = play(st, chat("sys", hist2, reminder + "build it"), hdr)
    r = p.report
    assert r.verdict == "MUTATED" and r.causes == ["block_moved", "system_reminder_moved"]
    assert r.moved_from == "messages[50]" and r.moved_to == "messages[52]"
    assert "23595" in r.hint and not p.changed


# --- 8. Reasoning stripped on echo --------------------------------------------------------------
def test_8_reasoning_dropped_on_echo() -> None:
    st = make_stage()
    resp = {"role": "assistant", "content": "42", "reasoning_content": "Let me think. " * 30}
    play(st, chat("sys", [], "q"), {}, resp)
    p = play(st, chat("sys", [{"role": "user", "content": "q"}, ok("42")], "why?"))
    r = p.report
    assert r.verdict == "APPEND+ECHO_DRIFT" and r.causes == ["reasoning_dropped"]
    assert r.path == "messages[2]" and r.lost_tokens > 50


def test_8_template_drops_reasoning_unexplained_miss() -> None:
    st = make_stage()
    resp = {"role": "assistant", "content": "42", "reasoning_content": "hmm " * 30}
    play(st, chat("sys " * 200, [], "q"), {}, resp, Usage(prompt=300))
    p = play(st, chat("sys " * 200, [{"role": "user", "content": "q"}, resp], "why?"),
             usage=Usage(prompt=360, cached=12))
    r = p.report
    assert r.verdict == "APPEND" and r.backend_cached_tokens == 12
    assert r.miss == "unexplained" and r.suspects[0] == "template"


def test_8_a_prefixd_workers_own_reason_explains_the_miss() -> None:
    """A prefixd worker says why it restored less (`prefixd.cache.miss`): the report carries
    that reason instead of guessing suspects."""
    st = make_stage()
    play(st, chat("sys " * 200, [], "q"), {}, ok("42"), Usage(prompt=300))
    usage = Usage.parse({"prompt_tokens": 360, "prompt_tokens_details": {"cached_tokens": 0}},
                        {"cache": {"tier": None, "known_tokens": 300, "miss": "evicted"}})
    p = play(st, chat("sys " * 200, [{"role": "user", "content": "q"}, ok("42")], "why?"),
             usage=usage)
    r = p.report
    assert r.verdict == "APPEND" and r.backend_cached_tokens == 0
    assert r.miss == "worker:evicted" and r.suspects == []


# --- 9. Tool output pruning / compaction ------------------------------------------------------
def agent_history(n: int) -> list[dict]:
    out: list[dict] = [{"role": "user", "content": "do the task"}]
    for i in range(n):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read", "arguments": json.dumps({"path": f"f{i}.py"})}}
        out += [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": f"file {i}\n" * 80}]
    return out


async def char_tokenize(body: dict) -> list[int]:
    """The backend's tokenizer at the outer boundary: one token per rendered character."""
    return [ord(c) for c in json.dumps(body["messages"], ensure_ascii=False)]


async def test_9_tool_output_pruned_exact_lost_tokens() -> None:
    st = make_stage()
    hist = agent_history(15)
    play(st, chat("sys", hist, "continue"), {}, ok("done"))
    pruned = json.loads(json.dumps(hist))
    pruned[24]["content"] = "[Old tool result content cleared]"    # the 12th tool result
    after = [*hist, {"role": "user", "content": "continue"}, ok("done")]
    body2 = chat("sys", pruned + after[len(hist):], "next")
    p = prepare(st, body2)
    r = p.report
    assert r.verdict == "TRUNCATED" and r.causes == ["tool_output_pruned"]
    assert r.path == "messages[25]"
    est = r.lost_tokens
    await st.measure(p, char_tokenize)
    prev = await char_tokenize(chat("sys", hist, "continue"))
    cur = await char_tokenize(body2)
    lcp = next(i for i, (a, b) in enumerate(zip(prev, cur, strict=False)) if a != b)
    assert r.token_offset_exact and r.reusable_tokens == lcp
    assert r.lost_tokens == len(prev) - lcp and est > 0
    assert "reused=" + str(lcp) in header(p.report)


def test_9_compacted_history() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "ses_compact"}     # a new first message: only an id can tell
    play(st, chat("sys", pairs(10), "go on"), hdr, ok("x"))
    summary = [{"role": "user", "content": "Summary of the conversation so far: we fixed it."}]
    r = play(st, chat("sys", summary, "next"), hdr).report
    assert r.verdict == "TRUNCATED" and r.causes == ["history_compacted"]


# --- 10. Open WebUI date + RAG in the system message -------------------------------------------
def owui_system(stamp: str, rag: str) -> str:
    return (f"Current date and time: {stamp}\n\n"
            "You are a helpful assistant. Answer from the context below and cite it.\n"
            + "Keep answers short and precise. " * 20 + f"\n<context>\n{rag}\n</context>")


def test_10_open_webui_two_spans_and_partial_would_fix() -> None:
    st = make_stage(canon_relocate_clock_time="dry_run")
    hdr = {"User-Agent": "Mozilla/5.0 open-webui"}
    play(st, chat(owui_system("2026-08-12 10:41:03", "doc A: cats purr.\n" * 10), [], "cats?"),
         hdr, ok("they purr"))
    hist = [{"role": "user", "content": "cats?"}, ok("they purr")]
    p = play(st, chat(owui_system("2026-08-12 10:42:15", "doc B: dogs bark.\n" * 10), hist,
                      "dogs?"), hdr)
    r = p.report
    assert r.verdict == "MUTATED" and not p.changed
    assert [s.causes for s in r.spans][1] == ["system_changed:unknown"]
    assert "clock_time" in r.spans[0].causes
    assert {"clock_time", "system_changed:unknown"} <= set(r.causes)
    assert [w["rule"] for w in r.would_fix] == ["relocate_clock_time"]
    saved = r.would_fix[0]["saved_tokens"]
    assert 0 < saved < r.lost_tokens          # only the part up to the retrieved context
    assert "would_fix=relocate_clock_time" in header(p.report)


# --- stretch cases ----------------------------------------------------------------------------
def test_side_call_with_other_system_prompt_gets_its_own_lane() -> None:
    st = make_stage()
    hdr = {"X-Session-Id": "s1"}
    main = play(st, chat("You are the main agent. " * 20, [], "hi"), hdr)
    title = play(st, chat("Generate a short title for this conversation.", [], "hi"), hdr)
    again = play(st, chat("You are the main agent. " * 20, [{"role": "user", "content": "hi"},
                                                           ok()], "more"), hdr)
    assert main.lane == again.lane == "s:s1" and title.lane.startswith("s:s1~")
    assert title.report.verdict == "NEW" and again.report.verdict == "APPEND"


def test_identical_resend_and_whitespace_pin() -> None:
    st = make_stage()
    p1 = play(st, chat("Rules:\n- be brief\n", [], "hi"))
    assert play(st, chat("Rules:\n- be brief\n", [], "hi")).report.verdict == "IDENTICAL"
    p3 = play(st, chat("Rules:\r\n- be brief  \n", [], "hi"))
    assert p3.body["messages"][0] == p1.body["messages"][0]
    assert p3.report.sent_verdict == "IDENTICAL" and p3.report.fixed == ["pin_whitespace"]
    assert p3.report.causes == ["whitespace_only"]


def test_debug_endpoints_hide_text_unless_excerpts() -> None:
    st = PrefixTracker(Settings(_env_file=None, **OFF), clock=Clock())
    cc_body_turns = cc_turns(st)
    hist = st.debug_lane(cc_body_turns[1].lane)
    assert [h["verdict"] for h in hist] == ["NEW", "MUTATED"]
    assert "cch=" not in json.dumps(hist) and hist[1]["spans"][0]["old_hash"]
    lanes = st.debug_lanes()
    assert lanes[0]["lane"] == cc_body_turns[1].lane and lanes[0]["reports"] == 2
    assert st.debug_lane("nope") is None
