"""The worker's load under vLLM's names (`metrics/vllm.py`), set at each /metrics scrape from
its status: llm-d's and the Gateway API Inference Extension's default scorers read them.
Computed when asked, so never stale, and without waiting on the generation thread.

What each one is for prefixd:
- `vllm:num_requests_waiting`: jobs submitted and not admitted yet (the scheduler's queue,
  and those it has not taken from its inbox yet);
- `vllm:num_requests_running`: jobs admitted and not ended (a job paused between two passes
  included, as vLLM counts its whole running queue);
- `vllm:kv_cache_usage_perc`: what the admitted jobs' live caches hold over their budget
  (active_kv_share x cache_bytes; `scheduler/policy/room.py`), at most 1. vLLM's is the share of its
  KV blocks that requests under way hold: its prefix cache keeps a finished request's blocks
  in the free queue, evicted as needed, so they count as free. The stored prompt cache is
  prefixd's counterpart (evictable, with a budget of its own, full on a warm worker), left
  out for the same reason: counted, every warm worker would look saturated (the GIE's
  saturation detector takes 0.8 for full) however idle. The live caches' share is what makes
  the next job wait for memory, as a full block pool does in vLLM;
- `vllm:cache_config_info{block_size, num_gpu_blocks}` (value 1, once the model is loaded):
  blocks of `BLOCK_TOKENS` tokens (vLLM's default; prefixd's KV events are to use it), and
  the prompt cache's RAM budget (cache_bytes) in such blocks at the model's KV bytes per
  token: how much the prefix scorer may assume a worker keeps (0 for a model without
  attention KV).
"""

from __future__ import annotations

from prefixd.backends.mlx.scheduler.generator import Generator
from prefixd.metrics import vllm

ENGINE = "0"   # vLLM labels each engine core by its index; a worker is one


def observe(generator: Generator, model_name: str) -> None:
    """Set the vLLM-named gauges from `generator`'s status now (only this worker's series:
    one worker per process)."""
    waiting, running = generator.jobs()
    under_way = generator.status.under_way
    for gauge, value in ((vllm.WAITING, waiting), (vllm.RUNNING, running),
                         (vllm.KV_USAGE, usage(under_way.live_bytes, under_way.live_budget))):
        gauge.clear()
        gauge.labels(model_name, ENGINE).set(value)
    vllm.CACHE_CONFIG.clear()
    loaded, per_token = generator.loaded, generator.status.kv_bytes_per_token
    if loaded is not None and per_token is not None:
        block = vllm.BLOCK_TOKENS * per_token
        blocks = loaded.engine.config.cache_bytes // block if block else 0
        vllm.CACHE_CONFIG.labels(str(vllm.BLOCK_TOKENS), str(blocks), ENGINE).set(1)


def usage(live: int, budget: int) -> float:
    """The live caches' share of their budget, 0..1 (one job alone may outgrow it: 1)."""
    if budget <= 0:
        return 1.0 if live else 0.0
    return min(1.0, live / budget)
