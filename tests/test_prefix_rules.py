"""A canonicalization rule is one entry of `prefixd.proxy.prefix.rules.RULES`: its setting (and
the settings reference), the causes it fixes (hints, `would_fix`), its explanation in
`prefixd explain` and on the status page, and what it does all come from that entry."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from prefixd.proxy import docgen, explain
from prefixd.proxy.prefix import rules as R
from prefixd.proxy.prefix.report import hint_for
from prefixd.proxy.settings import Settings


def test_every_place_reads_the_rules_entry() -> None:
    table = docgen.settings_table()
    page = {x["name"]: x for x in R.page_data()["rules"]}
    for rule in R.RULES:
        field = Settings.model_fields[rule.setting]
        assert field.description is rule.doc and field.default == rule.default
        assert f"| `{rule.env}` | `{rule.default}` | {rule.doc} |" in table
        assert explain.setting(rule.name) == rule.env and explain.describe(rule.name) is rule.doc
        assert page[rule.name] == {"name": rule.name, "setting": rule.env,
                                   "default": rule.default, "doc": rule.doc,
                                   "causes": list(rule.causes)}
        for cause in rule.causes:
            assert R.for_cause(cause) is rule and hint_for([cause]) == rule.hint
    assert list(page) == [r.name for r in R.RULES]
    assert Settings(_env_file=None).rule_modes() == {r.name: r.default for r in R.RULES}


# One entry more, in a fresh interpreter (the settings are made from the registry when
# prefixd.proxy.settings is first imported): a rule that pins a session id in the system
# prompt, a cause (`uuid`) no rule fixed before.
NEW_RULE = textwrap.dedent('''
    import json, os
    from prefixd.proxy.prefix import rules as R
    R.RULES = (*R.RULES, R.Rule("pin_session_id", "off", "R99: keep the lane's first session "
               "id in the system prompt; restate a new one in the newest user message.",
               ("uuid",), values=("uuid",)))
    os.environ["PREFIXD_CANON_PIN_SESSION_ID"] = "dry_run"

    from prefixd.proxy import docgen, explain
    from prefixd.proxy.prefix.tracker import PrefixTracker
    from prefixd.proxy.settings import Settings

    def play(st, ids):
        out, hist = [], []
        for i, sid in enumerate(ids):
            body = {"model": "m", "messages": [
                {"role": "system", "content": f"You are an agent.\\nSession: {sid}\\n" + "x " * 50},
                *hist, {"role": "user", "content": f"step {i}"}]}
            p = st.canonicalize(body, {"X-Session-Id": "s"})
            st.detect(p)
            st.record_response(p, {"role": "assistant", "content": "ok"}, None)
            hist += [{"role": "user", "content": f"step {i}"},
                     {"role": "assistant", "content": "ok"}]
            out.append(p)
        return out

    ids = ["57a121ec-f78c-48c3-a745-e3036a3ecc33", "0b6a6c1e-2f9d-4c55-8b1e-3d2a4f5e6a7b"]
    dry = Settings(_env_file=None)
    on = Settings(_env_file=None, canon_pin_session_id="on")
    seen = play(PrefixTracker(dry), ids)[1]
    pinned = play(PrefixTracker(on), ids)[1]

    data = R.page_data()                 # what /ui/rules.json serves the page
    print(json.dumps({
        "modes": [dry.rule_modes()["pin_session_id"], on.rule_modes()["pin_session_id"]],
        "readme_row": "| `PREFIXD_CANON_PIN_SESSION_ID` | `off` | R99: " in docgen.settings_table(),
        "env_example": "# PREFIXD_CANON_PIN_SESSION_ID=off" in docgen.env_example(),
        "seen": [seen.report.causes[0], seen.report.hint,
                 [w["rule"] for w in seen.report.would_fix], seen.changed],
        "pinned": [pinned.report.causes[0], pinned.report.fixed, pinned.report.sent_verdict,
                   pinned.body["messages"][0]["content"].split("\\n")[1],
                   ids[1] in pinned.body["messages"][-1]["content"]],
        "explain": explain.report_lines({"turn": 2, "verdict": "MUTATED", "causes": ["uuid"]},
                                        explain.Style(color=False))[-1],
        "page": [data["fixes"].get("uuid"), data["rules"][-1]["setting"],
                 data["rules"][-1]["doc"][:4]],
    }))
''')


def test_a_new_rule_is_one_entry() -> None:
    out = subprocess.run([sys.executable, "-c", NEW_RULE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["modes"] == ["dry_run", "on"]               # its setting, read from the env
    assert got["readme_row"] and got["env_example"]         # the settings reference
    # detection: the cause it fixes hints at it; in dry run it measures what it would keep
    assert got["seen"] == ["uuid", "canon_pin_session_id=on", ["pin_session_id"], False]
    # on: what it does (a value pin, restated in the newest turn)
    assert got["pinned"] == ["uuid", ["pin_session_id"], "APPEND",
                             "Session: 57a121ec-f78c-48c3-a745-e3036a3ecc33", True]
    assert got["explain"] == ("  fix     PREFIXD_CANON_PIN_SESSION_ID=on  R99: keep the lane's "
                              "first session id in the system prompt; restate a new one in the "
                              "newest user message.")
    assert got["page"] == ["pin_session_id", "PREFIXD_CANON_PIN_SESSION_ID", "R99:"]
