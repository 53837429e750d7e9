"""Fold the managed workers' own metrics (their prompt cache: `prefixd_worker_*`) into the
proxy's /metrics, each sample labelled with its backend, so one scrape target shows all."""

from __future__ import annotations

PREFIX = "prefixd_worker_"


def _families(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """family -> (HELP/TYPE lines, sample lines), for the `prefixd_worker_*` families."""
    fams: dict[str, tuple[list[str], list[str]]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split(" ", 3)[2]
            current = name if name.startswith(PREFIX) else None
            if current is not None:
                fams.setdefault(current, ([], []))[0].append(line)
        elif current is not None and line.startswith(PREFIX):
            fams[current][1].append(line)
    return fams


def _labelled(line: str, label: str) -> str:
    name, sep, rest = line.partition("{")
    if sep:
        return f"{name}{{{label},{rest}"
    name, _, value = line.partition(" ")
    return f"{name}{{{label}}} {value}"


def label_worker_metrics(texts: dict[str, str]) -> str:
    """Exposition text of every `prefixd_worker_*` family in `texts` (backend -> that worker's
    /metrics text), samples labelled `backend=...`, each family one contiguous group."""
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for backend, text in texts.items():
        label = 'backend="' + backend.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for fam, (meta, samples) in _families(text).items():
            slot = merged.setdefault(fam, (meta, []))
            slot[1].extend(_labelled(s, label) for s in samples)
    lines = [line for meta, samples in merged.values() for line in (*meta, *samples)]
    return "\n".join(lines) + ("\n" if lines else "")
