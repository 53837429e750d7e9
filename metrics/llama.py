"""Managed llama-servers' slots (`backends/llama/`): where requests were placed, slot files
saved and restored (a miss counted by why), and the bytes the files take."""

from prometheus_client import Counter, Gauge

from prefixd.metrics import REGISTRY

SLOT_PLACEMENTS = Counter(
    "prefixd_llama_slot_placements_total", "Requests pinned to a managed llama-server's slot, "
    "by why that slot: holds_prefix (it held the longest start of the prompt), copy (another "
    "slot's prompt was copied into it through a slot file), restore (a slot file was restored "
    "into it first), fresh (nothing held any of it).",
    ["backend", "reason"], registry=REGISTRY)
SLOT_SAVES = Counter(
    "prefixd_llama_slot_saves_total", "Slots saved into slot files (before being overwritten "
    "or stopped), by outcome: saved, failed (the server refused), unreadable (the file did "
    "not check out), too_large (larger than the whole disk budget).", ["backend", "outcome"],
    registry=REGISTRY)
SLOT_RESTORES = Counter(
    "prefixd_llama_slot_restores_total", "Slot files restored into a slot before a request, "
    "by outcome: hit, or a miss (missing, damaged, failed): the prompt is then computed.",
    ["backend", "outcome"], registry=REGISTRY)
SLOT_FILE_BYTES = Gauge("prefixd_llama_slot_file_bytes", "Bytes a backend's slot files take "
                        "on disk.", ["backend"], registry=REGISTRY)
