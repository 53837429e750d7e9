"""Shared fixtures: proxy + fake upstream (tests/proxy_fixtures.py), tiny models
(tests/tiny_fixtures.py) and the in-process worker (tests/worker_fixtures.py)."""

import os

# The disk tier of the worker's prompt cache is off in tests unless a test turns it on with
# its own directory: a warm start from an earlier test (or run) would change what tests see.
os.environ.setdefault("PREFIXD_DISK_CACHE_BYTES", "0")

from hypothesis import settings as _hyp
from proxy_fixtures import *  # noqa: F403
from tiny_fixtures import *  # noqa: F403
from worker_fixtures import *  # noqa: F403

# CI runs derandomized property tests: a submission lands or not on its own merits.
_hyp.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    _hyp.load_profile("ci")
