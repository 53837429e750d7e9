"""TEMPORARY: `proxy/exchange.py` still imports `Prepared` from here. The prefix stage became
`PrefixTracker` in `tracker.py`; delete this file once exchange.py imports
`from prefixd.proxy.prefix.tracker import Prepared`."""

from prefixd.proxy.prefix.tracker import Prepared

__all__ = ["Prepared"]
