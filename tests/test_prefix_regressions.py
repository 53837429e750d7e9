"""Request shapes found by a black-box review of real client formats."""

from __future__ import annotations

from test_prefix_cases import make_stage, play


def test_string_and_single_text_part_are_the_same_prompt():
    """Cline/Roo move a cache_control marker by turning the newest user message into a
    one-part list and back: the rendered prompt is unchanged, so no mutation is reported."""
    st = make_stage()
    h = {"X-Session-Id": "pv"}
    sys_msg = {"role": "system", "content": "You are a bot."}
    t1 = {"model": "m", "messages": [sys_msg, {"role": "user", "content": [
        {"type": "text", "text": "read a", "cache_control": {"type": "ephemeral"}}]}]}
    t2 = {"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are a bot."}]},
        {"role": "user", "content": "read a"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "read b",
                                      "cache_control": {"type": "ephemeral"}}]}]}
    assert play(st, t1, h).report.verdict.value == "NEW"
    assert play(st, t2, h).report.verdict.value == "APPEND"


def test_billing_header_part_of_an_openai_system_message_is_removed():
    st = make_stage()
    h = {"X-Claude-Code-Session-Id": "s"}
    body = {"model": "m", "messages": [
        {"role": "system", "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=fa690;"},
            {"type": "text", "text": "You are Claude Code."}]},
        {"role": "user", "content": "hi"}]}
    p = play(st, body, h)
    assert p.changed
    assert p.body["messages"][0]["content"] == [{"type": "text", "text": "You are Claude Code."}]
