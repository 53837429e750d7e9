"""The worker's load under vLLM's metric names: what llm-d's and the Gateway API Inference
Extension's default scorers read from a model server's /metrics (queue, running, KV usage;
the prefix scorer's block size and block count), so they work on prefixd workers unchanged.

Names, types and labels are vLLM's (v1: `model_name` and `engine`; `cache_config_info`'s
labels are its cache config, not the model), so they break the `prefixd_` naming rule on
purpose. The worker sets them at scrape time from its status (`backends/mlx/server/scrape.py`:
what each one means for prefixd, and why); never federated into the proxy's /metrics.
"""

from prometheus_client import Gauge

from prefixd.metrics import REGISTRY

LABELS = ["model_name", "engine"]
# Tokens per block: vLLM's default block size, and the one prefixd's KV events are to use;
# `cache_config_info`'s `block_size`, by which the GIE's prefix scorer sizes its index.
BLOCK_TOKENS = 16

WAITING = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                LABELS, registry=REGISTRY)
RUNNING = Gauge("vllm:num_requests_running",
                "Number of requests in model execution batches.", LABELS, registry=REGISTRY)
KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 LABELS, registry=REGISTRY)
CACHE_CONFIG = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["block_size", "num_gpu_blocks", "engine"], registry=REGISTRY)
