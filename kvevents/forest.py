"""The publisher's side, pure: what one tier can restore now, as a forest of announced
blocks, and the events that bring a consumer from what was announced to that.

A tier holds token paths, each with the positions a prompt extending it restores to (every
position up to where a state trims back, and each exact restore point past it: a hybrid
model's checkpoints). Every such position is one announced block, named by the id of its
prefix (`prefix.Path.id_at`): the same prefix held by two paths is one block. A block's
parent is its path's announced position below it (for a block ending on a chunk boundary,
the highest one below that also does: vLLM's consumers, which rebuild their keys from the
token ids, then stay in step), so its tokens are the span between them: `CHUNK` tokens where
every position restores (one `BlockStored` carries a run of them, as vLLM's does), a longer
span up to a hybrid's next checkpoint otherwise. A path's blocks are planned once while its
positions stay the same: an update costs the paths that changed, and a pass over the rest.

Nothing is announced that the tier cannot restore: a block stands for the state at its end.
A block whose parent changes (the one below it went) is removed and stored again under the
new parent, so a consumer that drops what hangs below a removed block loses nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixd.kvevents.prefix import CHUNK, Path
from prefixd.kvevents.wire import BlockRemoved, BlockStored, Event

# (a token path, the positions of it that restore)
Holding = tuple[Path, Iterable[int]]


@dataclass(frozen=True, slots=True)
class Node:
    pos: int
    parent: int | None
    parent_pos: int


def restorable_positions(n: int, trims_to: int, points: Iterable[int]) -> list[int]:
    """The positions of a path of `n` tokens to announce: every chunk boundary up to
    `trims_to` (a state that trims back to any shorter prefix: plain KV, an unwrapped
    window), `trims_to` itself, and each restore point in `points`."""
    top = min(trims_to, n)
    out = set(range(CHUNK, top + 1, CHUNK))
    if top > 0:
        out.add(top)
    out.update(p for p in points if 0 < p <= n)
    return sorted(out)


def path_nodes(path: Path, positions: Iterable[int]) -> list[tuple[int, Node]]:
    """(block id, node) of each announced position of one path, its parent the path's own
    announced position below it (for one on a chunk boundary, the highest such one that is
    on one too). Kept on the path while its positions stay the same: an update re-plans only
    the paths that changed."""
    key = tuple(sorted({p for p in positions if 0 < p <= path.n}))
    if path.plan is not None and path.plan[0] == key:
        return path.plan[1]
    out: list[tuple[int, Node]] = []
    prev, aligned = 0, 0                       # the position below, the aligned one below
    ids: dict[int, int | None] = {0: None}
    for p in key:
        h = ids[p] = path.id_at(p)
        below = aligned if p % CHUNK == 0 else prev
        out.append((h, Node(p, ids[below], below)))
        prev = p
        if p % CHUNK == 0:
            aligned = p
    path.plan = (key, out)
    return out


def plan(holdings: Iterable[Holding], announced: dict[int, Node] | None = None
         ) -> dict[int, tuple[Node, Path]]:
    """block id -> (its node, a path holding it). A block several paths hold keeps the form
    it was announced in, if one of them gives it."""
    announced = announced or {}
    out: dict[int, tuple[Node, Path]] = {}
    for path, positions in holdings:
        for h, node in path_nodes(path, positions):
            if h not in out or announced.get(h) == node:
                out[h] = (node, path)
    return out


class Announced:
    """What one tier (`medium`) has announced: block id -> node."""

    def __init__(self, medium: str) -> None:
        self.medium = medium
        self.nodes: dict[int, Node] = {}

    def update(self, holdings: Iterable[Holding]) -> list[Event]:
        """The events from what was announced to what `holdings` restore (empty: no change)."""
        want = plan(holdings, self.nodes)
        gone = [h for h in self.nodes if h not in want]
        moved = {h for h, (n, _) in want.items() if h in self.nodes and self.nodes[h] != n}
        if moved or gone:
            # a consumer drops what hangs below a removed block: what still restores below
            # a moved or removed one is stored again too
            dropped = moved | set(gone)
            for h, (n, _) in sorted(want.items(), key=lambda kv: kv[1][0].pos):
                if h in self.nodes and n.parent in dropped and h not in moved:
                    moved.add(h)
                    dropped.add(h)
        events: list[Event] = []
        if gone or moved:
            events.append(BlockRemoved(tuple(gone + sorted(moved)), self.medium))
        for h in gone:
            del self.nodes[h]
        fresh = sorted((want[h][0].pos, h) for h in want if h not in self.nodes or h in moved)
        events += self._stored([(h, *want[h]) for _, h in fresh])
        for _, h in fresh:
            self.nodes[h] = want[h][0]
        return events

    def clear(self) -> None:
        self.nodes.clear()

    def _stored(self, items: Sequence[tuple[int, Node, Path]]) -> list[Event]:
        """`BlockStored` events, parents first: a chain of whole chunks is one event."""
        runs: list[list[tuple[int, Node, Path]]] = []
        open_runs: dict[int, list[tuple[int, Node, Path]]] = {}   # by its last block
        for item in items:
            h, node, _ = item
            run = open_runs.pop(node.parent, None) if node.parent is not None else None
            if run is not None and node.pos - node.parent_pos == CHUNK:
                run.append(item)
            else:
                run = [item]
                runs.append(run)
            if node.pos - node.parent_pos == CHUNK:
                open_runs[h] = run
        out: list[Event] = []
        for run in runs:
            first = run[0][1]
            path = run[-1][2]
            size = first.pos - first.parent_pos if len(run) == 1 else CHUNK
            out.append(BlockStored(tuple(h for h, _, _ in run), first.parent,
                                   tuple(path.tokens(first.parent_pos, run[-1][1].pos)),
                                   size, medium=self.medium))
        return out
