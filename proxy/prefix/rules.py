"""The canonicalization rules, one `Rule` each, in one registry (`RULES`).

A rule's entry is everything about it: its name, its setting (`PREFIXD_CANON_<NAME>`: the
`Settings` field, its default and its description are generated from the entry), the cause
labels it keeps from breaking the prefix (report hints, `would_fix`, `prefixd explain` and the
status page's fix suggestions), and what it does, as the steps `canonicalize` asks each rule
that is on for. Adding a rule is adding an entry here, plus its test; a rule that needs a
kind of step no rule has yet adds that hook to `Rule` and to `canonicalize`.

Pure data and small pure functions: nothing here reads settings or lane state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from prefixd.proxy.prefix import insertions as I
from prefixd.proxy.prefix import patterns as P
from prefixd.proxy.prefix.segments import canonical, collapse_ws

RuleMode = Literal["on", "off", "dry_run"]
# (messages, the lane's kept insertions, the client's newest user message on the last
# request, the system text) -> (index -> edited message, (fingerprint, text) to record)
Reappend = Callable[[list, dict[str, str], tuple[int, dict] | None, str],
                    tuple[dict[int, dict], tuple[str, str] | None]]


@dataclass(frozen=True, slots=True)
class Rule:
    """One canonicalization rule. The steps are capabilities with safe defaults (None/empty:
    the rule takes no part in that step); `canonicalize` runs each step for the rules that
    are on, in registry order."""

    name: str
    default: RuleMode
    doc: str                        # the setting's description: docs, env example, explain
    causes: tuple[str, ...]         # cause labels this rule keeps from breaking the prefix
    risky: bool = False             # hints suggest dry_run first
    # -- steps ------------------------------------------------------------------------------
    # every system text (and the lane's first-seen one) rewritten, from the first request
    rewrite: Callable[[str], str] | None = None
    # a system text equal to the lane's first-seen one this way is sent as first seen
    same_text: Callable[[str, str], bool] | None = None
    # a tool equal to its first-seen JSON this way (both without cache_control) is sent
    # with the first-seen bytes
    same_tool: Callable[[Any, Any], bool] | None = None
    orders_tools: bool = False      # tools go in the lane's first-seen order, new ones last
    # catalogue labels: a system line that differs only in these values keeps its first-seen
    # value, and the live line is restated in the newest turn
    values: tuple[str, ...] = ()
    # (old line, inside an <env>-style block): any change of such a line is pinned and
    # restated (tried only when no `values` rule explains the change)
    pins_line: Callable[[str, bool], bool] | None = None
    # re-appends text the client dropped from older messages, and replays what it re-appended
    reappend: Reappend | None = None

    @property
    def setting(self) -> str:
        """The `Settings` field: `canon_<name>`."""
        return f"canon_{self.name}"

    @property
    def env(self) -> str:
        """The environment variable: `PREFIXD_CANON_<NAME>`."""
        return f"PREFIXD_{self.setting.upper()}"

    @property
    def hint(self) -> str:
        """What a report's hint suggests for a cause this rule fixes."""
        return f"{self.setting}={'dry_run' if self.risky else 'on'}"


def strip_billing(text: str) -> str:
    return P.VOLATILE["anthropic_billing_header"].sub("", text)


def _same_words(base: str, text: str) -> bool:
    return base.split() == text.split()


def _same_json(a: Any, b: Any) -> bool:
    return canonical(a) == canonical(b)


def _same_but_whitespace(a: Any, b: Any) -> bool:
    return canonical(collapse_ws(a)) == canonical(collapse_ws(b))


def _env_line(old: str, in_env: bool) -> bool:
    return in_env or any(P.VOLATILE[label].search(old) for label in P.ENV_LABELS)


RULES: tuple[Rule, ...] = (
    Rule("strip_billing_header", "on",
         "R1: strip the `x-anthropic-billing-header:` line from system prompts.",
         ("anthropic_billing_header",), rewrite=strip_billing),
    Rule("pin_tool_order", "on",
         "R2/R3: send tools in the lane's first-seen order and key order.",
         ("tools_reordered", "schema_key_order"), same_tool=_same_json, orders_tools=True),
    Rule("pin_whitespace", "on",
         "R5: whitespace-only changes in system/tools keep first-seen bytes.",
         ("whitespace_only", "schema_whitespace"), same_text=_same_words,
         same_tool=_same_but_whitespace),
    Rule("freeze_date", "off",
         "R6: keep the lane's first date in the system prompt; restate a new date in the "
         "newest user message.",
         (*P.DATE_LABELS, "todays_date_line"), values=P.DATE_LABELS),
    Rule("relocate_clock_time", "off",
         "R7: keep the time of day out of the system prompt; state the exact time in the "
         "newest user message.",
         P.TIME_LABELS, values=P.TIME_LABELS),
    Rule("pin_env_block", "off",
         "R8 (risky): pin <env>-style blocks; restate changes in the newest user message.",
         ("env_block", *P.ENV_LABELS), risky=True, pins_line=_env_line),
    Rule("keep_trailing_reminder", "off",
         "R12: re-append a reminder the client dropped from an older user message (Aider's "
         "edit-format rules) so its turns append.",
         ("trailing_reminder_dropped",), reappend=I.restore_reminders),
)


def by_name(name: str) -> Rule | None:
    return next((r for r in RULES if r.name == name), None)


def enabled(names: Iterable[str]) -> list[Rule]:
    """The rules of `names`, in registry order."""
    wanted = set(names)
    return [r for r in RULES if r.name in wanted]


def for_cause(cause: str) -> Rule | None:
    """The rule that keeps the prefix when `cause` changes; None for real changes and for
    client behaviour the proxy must not undo."""
    return next((r for r in RULES if cause in r.causes), None)


def hint(cause: str) -> str | None:
    """A report's hint for `cause`: the setting of its rule, else advice about the client."""
    rule = for_cause(cause)
    return rule.hint if rule is not None else P.CLIENT_HINTS.get(cause)


def fixes() -> dict[str, str]:
    """cause -> the rule `prefixd explain` and the status page suggest for it. An anchor label
    (`todays_date_line`) names the line a value changed in, not the value, so it suggests
    nothing: the date or time label beside it does."""
    return {c: r.name for r in RULES for c in r.causes if c not in P.ANCHOR_LABELS}


def page_data() -> dict[str, Any]:
    """What the status page knows of the rules (`/ui/rules.json`)."""
    return {"rules": [{"name": r.name, "setting": r.env, "default": r.default, "doc": r.doc,
                       "causes": list(r.causes)} for r in RULES],
            "fixes": fixes()}


def credit_order(rule: Rule) -> int:
    """Rules that pin one line together are credited in the order reports list their
    causes (`patterns.LABEL_ORDER`)."""
    order = P.LABEL_ORDER
    return min((order.index(label) for label in rule.values if label in order),
               default=len(order))
