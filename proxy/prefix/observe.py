"""What a finished prefix report leaves behind: one log line and the prefix metrics.
Counts what the client did (mutations), whether or not a rule repaired it."""

from __future__ import annotations

import logging

from prefixd.metrics import prefix as M
from prefixd.proxy.prefix.detect import Verdict
from prefixd.proxy.prefix.report import PrefixReport, log_text

log = logging.getLogger("prefixd.prefix")


def observe(r: PrefixReport) -> None:
    """One finished report: its log line (INFO when the prefix broke, or the backend restored
    less than expected) and its metrics."""
    missed = r.miss == "unexplained" or (r.miss or "").startswith("worker:")
    level = logging.INFO if r.mutated or missed else logging.DEBUG
    if log.isEnabledFor(level):
        log.log(level, "%s", log_text(r))
    M.REQUESTS.labels(r.client, r.verdict.value).inc()
    if r.mutated or r.verdict is Verdict.APPEND_ECHO_DRIFT:
        # what the client did, whether or not a rule repaired it
        for cause in r.causes:
            M.MUTATIONS.labels(r.client, r.region or "messages", cause).inc()
        if r.causes and r.lost_tokens > 0:
            M.LOST_TOKENS.labels(r.client, r.causes[0]).inc(r.lost_tokens)
    if r.verdict is not Verdict.NEW and r.prev_prompt_tokens:
        M.REUSE_RATIO.labels(r.client).observe(min(1.0, r.reusable_tokens
                                                   / r.prev_prompt_tokens))
    if r.suspects:
        M.UNEXPLAINED_MISS.labels(r.suspects[0]).inc()
    share = r.saved_tokens // max(1, len(r.fixed))
    for rule in r.fixed:
        M.CANON_APPLIED.labels(rule, "on").inc()
        M.CANON_SAVED.labels(rule, "on").inc(share)
    for w in r.would_fix:
        M.CANON_APPLIED.labels(w["rule"], w["mode"]).inc()
        M.CANON_SAVED.labels(w["rule"], w["mode"]).inc(w["saved_tokens"])
