"""The catalogue of volatile patterns (docs/MUTATIONS.md §5, Appendix A) and the small
fixed vocabularies reports use: cause labels, client families, client-issue hints.

Principle: classify the delta, not the prompt. `span_labels` runs the catalogue only on the
old and new text of a span that actually changed, widened to whole lines, so broad patterns
(clock times, hex ids) label real changes and rarely fire on prose that stayed put.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_P = {
    "anthropic_billing_header": r"(?m)^x-anthropic-billing-header:[^\n]*\n?",
    "iso_datetime": r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d{1,9})?)?"
                    r"(?:Z|[+-]\d{2}:?\d{2})?\b",
    "iso_date": r"\b(?:19|20)\d{2}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b",
    "todays_date_line": r"(?im)^.*\b(?:today(?:'s)?\s+date(?:\s+is)?|today\s+is|current\s+date"
                        r"(?:\s*(?:/|and)\s*time)?|the\s+current\s+date\s+is|date)\s*[:=]?\s*.+$",
    "js_todatestring": rf"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?:{_MONTHS}) \d{{2}} \d{{4}}\b",
    "long_date": r"\b(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday),?\s+(?:January"
                 r"|February|March|April|May|June|July|August|September|October|November"
                 r"|December)\s+\d{1,2}(?:st|nd|rd|th)?,?\s+\d{4}\b",
    "dmy_short": rf"\b\d{{1,2}} (?:{_MONTHS}) \d{{4}}\b",
    "clock_time": r"\b(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d(?:\.\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?\b",
    "us_locale_datetime": r"\b\d{1,2}/\d{1,2}/\d{4},?\s+\d{1,2}:\d{2}:\d{2}\s?[AP]M\b",
    "tz_offset": r"\b(?:UTC|GMT)\s?[+-]\d{1,2}(?::?\d{2})?\b",
    "iana_tz": r"\b(?:Africa|America|Antarctica|Asia|Atlantic|Australia|Europe|Indian|Pacific"
               r"|Etc)/[A-Za-z_]+(?:/[A-Za-z_]+)?\b",
    "uuid": r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-8][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}"
            r"-[0-9a-fA-F]{12}\b",
    "prefixed_id": r"\b(?:ses|msg|req|run|call|toolu|chatcmpl|resp|task|conv|sess)"
                   r"_[A-Za-z0-9]{8,}\b",
    "hex_id": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{12,64}\b",
    "epoch": r"\b1[5-9]\d{8}(?:\d{3})?\b",
    "cost_counter": r"(?i)(?:current\s+cost|total\s+cost|cost)\s*[:\n]\s*\$?\d+(?:\.\d+)?",
    "token_counter": r"(?i)\b(?:\d[\d,]*\s*(?:/\s*\d[\d,]*\s*)?tokens?\s*(?:used|remaining|left)"
                     r"|context\s+(?:window\s+)?usage\s*[:=]\s*\d+%?"
                     r"|tokens?\s+(?:used|remaining)\s*[:=]\s*[\d,]+)",
    "cwd_line": r"(?im)^\s*(?:working\s+directory|current\s+(?:workspace\s+)?(?:working\s+)?"
                r"directory|cwd|primary\s+working\s+directory)\s*[:=]?\s*.*$",
    "abs_path": r"(?:(?<=\s)|^)(?:/(?:Users|home|tmp|var|opt|mnt|workspace|private)/[^\s'\"<>]+"
                r"|[A-Za-z]:\\[^\s'\"<>]+)",
    "git_status_block": r"(?s)(?:gitStatus:|<context name=\"gitStatus\">|# Git Status|Status:\n)"
                        r".*?(?:\n\n|</context>|$)",
    "porcelain_line": r"(?m)^(?:[ MADRCU?!]{2}) \S.*$",
    "os_platform": r"(?im)^\s*(?:platform|os\s+version|operating\s+system|shell|default\s+shell"
                   r"|arch)\s*:\s*.+$",
    "env_block": r"(?s)<env>.*?</env>|<environment_details>.*?</environment_details>"
                 r"|<environment_context>.*?</environment_context>",
    "recent_files": r"(?is)#\s*(?:VSCode Visible Files|VSCode Open Tabs|Visual Studio Code Visible"
                    r" Files|Recently Modified Files|Actively Running Terminals)\b.*?(?=\n#\s|\Z)",
    "system_reminder": r"(?s)<system-reminder>.*?</system-reminder>",
    # Aider's repo map: a preamble line, then paths and code signatures to the end of the
    # message (`repo_content_prefix` of its coders; ask mode says "git repo.")
    "repo_map": r"(?s)Here are summaries of some files present in my git repo(?:sitory)?\..*",
}
VOLATILE: dict[str, re.Pattern[str]] = {k: re.compile(v) for k, v in _P.items()}

# Labels that say "this span changed because a value moved on", in the order reports list
# them. git_sha is omitted: it fires on any short hex word; hex_id covers real ids.
LABEL_ORDER = ("anthropic_billing_header", "iso_datetime", "iso_date", "js_todatestring",
               "long_date", "dmy_short", "us_locale_datetime", "clock_time", "todays_date_line",
               "tz_offset", "iana_tz", "uuid", "prefixed_id", "hex_id", "epoch", "cost_counter",
               "token_counter", "cwd_line", "abs_path", "git_status_block", "porcelain_line",
               "os_platform", "recent_files", "system_reminder")

# A line that a date or time changed in: it anchors the value labels beside it, and on its
# own it is too broad to be a cause.
ANCHOR_LABELS = ("todays_date_line",)

# What each value-pinning canonicalization rule may pin (docs/MUTATIONS.md §7.4 R6-R8).
DATE_LABELS = ("iso_date", "js_todatestring", "long_date", "dmy_short")
TIME_LABELS = ("iso_datetime", "clock_time", "us_locale_datetime", "epoch")
ENV_LABELS = ("cwd_line", "abs_path", "os_platform")

# Structural causes (not regexes); with the catalogue labels they form the fixed `cause` set.
STRUCTURAL_CAUSES = ("model_changed", "params_changed", "tools_added", "tools_removed",
                     "tools_reordered", "schema_key_order", "schema_whitespace", "schema_changed",
                     "whitespace_only", "system_changed:unknown", "block_moved",
                     "system_reminder_moved", "trailing_reminder_dropped", "history_before_files",
                     "chat_files_changed", "tool_output_pruned", "history_compacted",
                     "history_truncated", "branch_edit", "messages_changed:unknown",
                     "reasoning_dropped", "tool_args_reserialized", "whitespace_trimmed",
                     "content_edited", "env_block", "repo_map")
CAUSES = frozenset(LABEL_ORDER) | frozenset(STRUCTURAL_CAUSES)

# Placeholders agents put in place of an old tool output they prune (OpenCode and Claude Code:
# "[Old tool result content cleared]"); a short replacement naming its own removal counts too.
CLEARED_MARKERS = ("[Old tool result content cleared]", "content cleared", "[output truncated]",
                   "[duplicate file read", "tool result pruned")
PLACEHOLDER = re.compile(r"(?i)\b(?:cleared|pruned|removed|omitted|truncated|elided|compacted"
                         r"|redacted)\b")
PLACEHOLDER_MAX = 200
# A summary that took the place of compacted history. The preambles of known agents count
# anywhere; the broad words only in a message that is not the newest (that is the user's).
COMPACTION_PREAMBLE = re.compile(
    r"(?im)This session is being continued from a previous conversation"   # Claude Code
    r"|^What did we do so far\?\s*$"                                        # OpenCode
    r"|Another language model started to solve this problem"               # Codex
    r"|I spoke to you previously about a number of things")                # Aider
SUMMARY_MARKER = re.compile(r"(?i)\b(?:summary|summari[sz]ed|compacted|conversation so far"
                            r"|previous conversation)\b")
# First line of Aider's chat-files message (`files_content_prefix` and its no-files variants,
# all edit formats): after an edit Aider moves its history ahead of this block.
FILES_BLOCK = re.compile(
    r"I have \*added these files to the chat\*|These files have been \*added these files to the "
    r"chat\*|Here is the current content of the files?:|I am not sharing any files that you can"
    r" edit yet\.|Don't try and edit any existing code without asking me to add the files to the"
    r" chat!|These are some files we have been discussing")
REMINDER_MIN = 16      # chars: shorter trailing blocks are edits, not reminders
THINK = re.compile(r"(?s)<think>.*?</think>\s*")

# Hints for causes no canonicalization rule fixes (a rule's own hint names its setting:
# rules.hint).
CLIENT_HINTS = {
    "system_reminder_moved": "client issue anomalyco/opencode#23595",
    "reasoning_dropped": "the client strips reasoning from history; R10 restore_reasoning "
                         "(future) or a template that drops it",
    "history_before_files": "Aider moves its history ahead of the re-sent files after an edit;"
                            " report only (docs/MUTATIONS.md)",
}

_CLIENTS = (("claude-cli", "claude-cli"), ("claude-code", "claude-cli"), ("opencode", "opencode"),
            ("roo", "roo"), ("cline", "cline"), ("aider", "aider"), ("continue", "continue"),
            ("goose", "goose"), ("open-webui", "openwebui"), ("openwebui", "openwebui"),
            ("librechat", "librechat"), ("sillytavern", "sillytavern"), ("codex", "codex"))
CLIENT_FAMILIES = (*sorted({f for _, f in _CLIENTS}), "other")


def client_family(headers: Mapping[str, str]) -> str:
    """A fixed, small label for the client from its User-Agent (metrics must not explode)."""
    ua = ""
    for k, v in headers.items():
        if k.lower() == "user-agent":
            ua = v.lower()
            break
    for needle, family in _CLIENTS:
        if needle in ua:
            return family
    return "other"


WIDEN_MAX = 1024


def widen_to_lines(text: str, start: int, end: int) -> str:
    """text[start:end] grown to whole lines (patterns need their line context), but at most
    WIDEN_MAX characters either side, so one huge line cannot make labelling slow."""
    a = max(text.rfind("\n", 0, start) + 1, start - WIDEN_MAX)
    b = text.find("\n", end)
    b = min(len(text) if b < 0 else b, end + WIDEN_MAX)
    return text[a:b]


def span_labels(old: str, new: str) -> list[str]:
    """Catalogue labels of a changed span: a pattern counts if it matches the old or the new
    text and its matches differ between them (a date that stayed the same explains nothing)."""
    found = []
    for name in LABEL_ORDER:
        rx = VOLATILE[name]
        a, b = rx.findall(old), rx.findall(new)
        if (a or b) and a != b:
            found.append(name)
    return found if any(label not in ANCHOR_LABELS for label in found) else []


def mask(text: str, labels: tuple[str, ...]) -> str:
    """`text` with every match of `labels` replaced by a fixed placeholder, so two lines that
    differ only in those values compare equal."""
    for name in labels:
        text = VOLATILE[name].sub("\x00", text)
    return text


_LINE_LABELS = ("anthropic_billing_header", *DATE_LABELS, *TIME_LABELS, "todays_date_line",
                "uuid", "prefixed_id", "hex_id", "cwd_line")
# What every one of `_LINE_LABELS` needs in a line to match it: a digit (dates, times, ids),
# `_` (a prefixed id) or one of these words; a line without any is searched no further
_MAYBE_VOLATILE = re.compile(r"\d|_|(?i:date|today|director|cwd|x-anthropic-billing)")


def strip_volatile_lines(text: str) -> str:
    """`text` without lines carrying volatile values; used for content fingerprints."""
    return _strip_head(text[:8192])


@functools.lru_cache(maxsize=128)
def _strip_head(text: str) -> str:
    """Each turn of a conversation sends the same system prompt and first user message: their
    fingerprints are made once (at most 8 KiB each, 128 kept)."""
    keep = []
    for line in text.splitlines():
        if _MAYBE_VOLATILE.search(line) is not None and \
                any(VOLATILE[n].search(line) for n in _LINE_LABELS):
            continue
        keep.append(line)
    return "\n".join(keep)


def dropped_reminder(old: str, new: str, newest: str, system: str) -> str | None:
    """The trailing block an older message lost (`old` became `new`), if it is a reminder the
    client attaches to its newest turn only: the newest message ends with the very same bytes,
    or the system prompt carries the block (Aider puts its system_reminder in both)."""
    if len(new) >= len(old) or not old.startswith(new):
        return None
    suffix = old[len(new):]
    block = suffix.strip()
    if len(block) < REMINDER_MIN or not (newest.endswith(suffix) or block in system):
        return None
    return suffix
