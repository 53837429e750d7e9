"""Every Prometheus metric prefixd exports, declared once with its help text.

Owns: metric names, label sets and buckets. Holds no business logic: callers observe.
Modules: `proxy` (requests, queues, backends), `prefix` (mutation reports, canonicalization),
`picker` (the gateway picker), `llama` (managed llama-servers' slots), `worker` (the mlx
worker's prompt cache), `vllm` (the worker's
load under vLLM's names, for llm-d's scorers). All live in `REGISTRY`.
Naming: `prefixd_` prefix, units in names, counters end in `_total` (`vllm`'s are vLLM's own);
labels take fixed values only (never session ids or prompts).
"""

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client import exposition as _exposition

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(namespace="prefixd", registry=REGISTRY)

CONTENT_TYPE = _exposition.CONTENT_TYPE_LATEST


def render() -> bytes:
    """The text exposition of every registered metric."""
    return generate_latest(REGISTRY)
