"""The worker's KV events: what its prompt cache can restore, announced in vLLM's format
(`prefixd.kvevents`) as it changes, so fleet routers (and prefixd's own) route by it.

Owns: the announcer thread and its publisher (`announcer.py`), and reading the two tiers
for what they restore (`holdings.py`): the RAM store's entries and checkpoints, the disk
tier's records. Imports `cache` and `disk` only; the scheduler's generator starts it and
tells it, between two passes, when the RAM store changed.
"""
