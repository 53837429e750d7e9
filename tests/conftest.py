"""Shared fixtures: proxy + fake upstream (tests/proxy_fixtures.py) and tiny models
(tests/tiny_fixtures.py)."""

from proxy_fixtures import *  # noqa: F403
from tiny_fixtures import *  # noqa: F403
