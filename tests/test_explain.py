"""`prefixd explain` against a real prefixd on a loopback port (in front of the fake upstream),
after the conversations of tests/ui_helpers.py; plus the rendering of report fields the
conversations do not produce (dry-run rules, a verdict changed by canonicalization)."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest
from ui_helpers import backends, play

from prefixd.proxy import cli
from prefixd.proxy.explain import Style, report_lines, setting, target
from prefixd.proxy.prefix.rules import RULES, fixes
from prefixd.proxy.settings import Settings


@pytest.fixture(autouse=True)
def no_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)                  # no ./prefixd.env from the developer
    for name in [n for n in os.environ if n.startswith("PREFIXD_")]:
        monkeypatch.delenv(name)


async def explain(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = await asyncio.to_thread(cli.main, ["explain", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


async def test_explain_shows_where_what_and_the_fix(upstream, start_proxy, http, capsys):
    proxy = await start_proxy(backends=backends(upstream.url), prefix_excerpts=True)
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base)
    rc, out, err = await explain(capsys, "s:goose-7f3a", "--url", base, "-n", "2",
                                 "--color", "never")
    assert rc == 0, err
    assert out.startswith("lane s:goose-7f3a · client goose · turns 3–4\n")
    assert "turn 2 " not in out and "\x1b[" not in out
    turn4 = out.split("\n\nturn 4  ")[1].splitlines()
    assert turn4[0] == "MUTATED  iso_datetime, clock_time, todays_date_line"
    assert turn4[1] == "  where   system[0] +85 ch, token ~25 (estimated)"
    assert turn4[2].startswith("  reuse   25 / ") and turn4[2].endswith(" tok lost")
    assert turn4[3].startswith("  backend cached 14 / ") and turn4[3].endswith(" tok, agrees")
    assert turn4[5] == "    - The current date is 2025-05-03 14:2[-4:2-]7.\\n"
    assert turn4[6] == "    + The current date is 2025-05-03 14:2{+5:0+}7.\\n"
    # the rule is off; a run of it on a copy of the request measured what it would keep
    assert re.fullmatch(r"  fix     PREFIXD_CANON_RELOCATE_CLOCK_TIME=on  would keep \d+ more "
                        r"tok \(measured in dry run\)", turn4[7])

    # no LANE: the most recently active one (Cline's, played last), 5 reports by default
    rc, out, _ = await explain(capsys, "--url", base, "--color", "always")
    assert rc == 0 and out.startswith("lane \x1b[1ms:task-1\x1b[0m · client cline · turns 1–5")
    assert out.count("\nturn ") == 5 and "\x1b[1;32mAPPEND\x1b[0m" in out


async def test_explain_colours_old_red_and_new_green(upstream, start_proxy, http, capsys):
    proxy = await start_proxy(backends=backends(upstream.url), prefix_excerpts=True)
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base)
    rc, out, _ = await explain(capsys, "s:goose-7f3a", "--url", base, "-n", "1",
                               "--color", "always")
    assert rc == 0
    assert ("    \x1b[31m- The current date is 2025-05-03 14:2\x1b[0m"
            "\x1b[31m\x1b[7m4:2\x1b[0m\x1b[0m\x1b[31m7.\\n\x1b[0m\n") in out
    assert ("    \x1b[32m+ The current date is 2025-05-03 14:2\x1b[0m"
            "\x1b[32m\x1b[7m5:0\x1b[0m\x1b[0m\x1b[32m7.\\n\x1b[0m\n") in out
    assert "\x1b[1;31mMUTATED\x1b[0m" in out


async def test_explain_uses_the_api_key_from_the_environment(upstream, start_proxy, http,
                                                             tmp_path):
    proxy = await start_proxy(backends=backends(upstream.url), api_key="sekret")
    base = f"http://127.0.0.1:{proxy.port}"
    await play(http, base, key="sekret")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}

    async def run(extra_env: dict[str, str]) -> tuple[int, str, str]:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixd.proxy.cli", "explain", "--url", base, cwd=tmp_path,
            env={**env, **extra_env}, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 60)
        return p.returncode or 0, out.decode(), err.decode()

    rc, out, err = await run({"PREFIXD_API_KEY": "sekret"})
    assert rc == 0, err
    assert out.startswith("lane s:task-1 · client cline") and "\x1b[" not in out  # not a tty
    assert "(PREFIXD_PREFIX_EXCERPTS=true shows the text)" not in out   # Cline only appends
    rc, out, err = await run({})
    assert rc == 1 and out == ""
    assert "401, the API key is missing or wrong" in err


async def test_explain_reports_an_unknown_lane_and_an_unreachable_daemon(upstream, start_proxy,
                                                                          capsys):
    proxy = await start_proxy(backends=backends(upstream.url))
    base = f"http://127.0.0.1:{proxy.port}"
    rc, _, err = await explain(capsys, "--url", base)
    assert rc == 1 and "no conversations yet" in err
    rc, _, err = await explain(capsys, "nope", "--url", base)
    assert rc == 1 and "HTTP 404: no lane 'nope'" in err
    await proxy.shutdown(1.0)
    rc, _, err = await explain(capsys, "--url", base)
    assert rc == 1 and err.startswith(f"prefixd explain: cannot reach prefixd at {base}")


def test_the_daemon_is_found_from_its_settings():
    s = Settings(_env_file=None, host="0.0.0.0", port=9123, api_key="k1")
    assert target(s, None, None) == ("http://127.0.0.1:9123", "k1")
    assert target(s, "http://h:1", "k2") == ("http://h:1", "k2")
    assert target(Settings(_env_file=None, host="::1"), None, "") == ("http://[::1]:8400", None)


def test_dry_run_rules_and_canonicalized_verdicts_render():
    report = {"turn": 7, "client": "claude-cli", "verdict": "MUTATED", "sent_verdict": "APPEND",
              "causes": ["clock_time"], "path": "system[0]", "char_offset": 12,
              "token_offset": 40, "token_offset_exact": True, "reusable_tokens": 900,
              "prev_prompt_tokens": 900, "lost_tokens": 0, "fixed": ["relocate_clock_time"],
              "saved_tokens": 850,
              "would_fix": [{"rule": "pin_env_block", "saved_tokens": 300}],
              "spans": [{"path": "system[0]", "char_offset": 12, "causes": ["clock_time"],
                         "old_hash": "aaa", "new_hash": "bbb"}],
              "backend_cached_tokens": 0, "backend_prompt_tokens": 950, "miss": "unexplained",
              "suspects": ["eviction", "restart"], "hint": "canon_pin_env_block=on"}
    lines = report_lines(report, Style(color=False))
    assert lines[0] == "turn 7  MUTATED → APPEND (as sent, after canonicalization)  clock_time"
    assert "  where   system[0] +12 ch, token 40" in lines
    assert "  reuse   900 / 900 tok (100.0%)" in lines
    assert ("  backend cached 0 / 950 tok, unexplained (suspects: eviction, restart)"
            in lines)
    assert "    old #aaa → new #bbb (PREFIXD_PREFIX_EXCERPTS=true shows the text)" in lines
    assert "  fixed   by relocate_clock_time, kept 850 tok" in lines
    assert ("  fix     PREFIXD_CANON_PIN_ENV_BLOCK=on  would keep 300 more tok "
            "(measured in dry run)") in lines
    assert not any("RELOCATE" in line for line in lines)   # already fixed: no advice
    assert not any(line.startswith("  hint") for line in lines)   # the fix line says it
    assert setting("strip_billing_header") == "PREFIXD_CANON_STRIP_BILLING_HEADER"
    assert set(fixes().values()) == {r.name for r in RULES}      # every rule is suggested
    assert "todays_date_line" not in fixes()      # an anchor: its date or time label suggests


def test_a_dropped_reminder_suggests_its_rule():
    report = {"turn": 3, "verdict": "MUTATED", "causes": ["trailing_reminder_dropped"],
              "hint": "canon_keep_trailing_reminder=on"}
    lines = report_lines(report, Style(color=False))
    assert lines[-1].startswith("  fix     PREFIXD_CANON_KEEP_TRAILING_REMINDER=on  R12: ")
    assert not any(line.startswith("  hint") for line in lines)
