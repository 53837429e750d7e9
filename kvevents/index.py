"""The subscriber's side, pure: what one model server announced, token by token.

Each `BlockStored` block is placed on its parent (the event's `parent_block_hash`, a block
announced before; None: a prompt's start) and its prefix is rebuilt from the token ids, so a
prompt's own token ids find every announced prefix of it (`held`): nothing about the
publisher's hash function or block size is assumed, as llm-d rebuilds its keys. A block whose
parent was never seen cannot be placed (counted `unplaced`, dropped).

Honest by construction:
- each medium is a forest of its own: a block removed from one takes the blocks placed below
  it there along (a KV block after a missing one is useless to vLLM; prefixd's publisher
  re-announces what still restores), and leaves the other media as they are;
- a publisher that splits its cache into groups (vLLM's hybrid models: full attention,
  Mamba, sliding window, each with `group_idx`) is credited, for a prompt, the least any
  group holds of it: a prefix counts when every part of the model state holds it, not when
  the attention KV alone does (Dynamo drops the non-attention groups; SGLang publishes only
  attention blocks);
- a prompt is credited at most its length minus one (the last token is always computed);
- blocks keyed by more than their tokens (a LoRA adapter's, `extra_keys`: a cache salt, an
  image) are not placed (counted `keyed`): a prompt's token ids alone would credit them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixd.kvevents.prefix import CHUNK, Path, next_key, seed_key, token_bytes
from prefixd.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

DEFAULT_MEDIUM = "GPU"      # vLLM's MEDIUM_GPU: what an event without `medium` means
_SEED = seed_key("prefixd-subscriber")
_CHUNK_BYTES = 4 * CHUNK


@dataclass(eq=False, slots=True)
class _Node:
    group: int | None
    medium: str
    block: int
    pos: int
    key: bytes              # the key of its prefix's whole chunks
    tail: bytes             # its tokens past them
    parent: _Node | None
    children: list[_Node] = field(default_factory=list)


class Held:
    """One server's announced blocks, by group and medium: each medium (`GPU`, `CPU`, `DISK`)
    is a forest of its own (a block's parent in one may differ from its parent in another, and
    leaving one medium leaves the others as they are)."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[int | None, str, int], _Node] = {}
        self._by_key: dict[tuple[int | None, bytes], list[_Node]] = {}
        self._any: dict[tuple[int | None, int], _Node] = {}    # a block in some medium
        self._mediums: set[str] = set()
        self.groups: set[int | None] = set()
        # stored, removed, unplaced, malformed, keyed, cleared
        self.counts: Counter[str] = Counter()

    def __len__(self) -> int:
        """Distinct blocks held (in any medium)."""
        return len({(n.group, n.block) for n in self._nodes.values()})

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            medium = event.medium or DEFAULT_MEDIUM
            for h in event.block_hashes:
                node = self._nodes.get((event.group_idx, medium, h))
                if node is not None:
                    self._drop(node)
                    self.counts["removed"] += 1
        elif isinstance(event, AllBlocksCleared):
            self.clear()
            self.counts["cleared"] += 1

    def clear(self) -> None:
        self._nodes.clear()
        self._any.clear()
        self._by_key.clear()
        self.groups.clear()

    def _parent(self, group: int | None, medium: str, block: int) -> _Node | None:
        """A parent in the same medium, else one another medium holds (a block offloaded to
        CPU names its parent as the GPU knew it)."""
        return self._nodes.get((group, medium, block)) or self._any.get((group, block))

    def _stored(self, e: BlockStored) -> None:
        group, medium = e.group_idx, e.medium or DEFAULT_MEDIUM
        n = len(e.block_hashes)
        if n == 0 or e.block_size <= 0 or len(e.token_ids) != n * e.block_size:
            self.counts["malformed"] += 1
            return
        if e.lora_name is not None or e.lora_id is not None or \
                any(k is not None for k in e.extra_keys or ()):
            # an adapter's blocks, a salted prompt's, an image's: their token ids alone do
            # not name them, so nothing is credited from them (nothing placed below either)
            self.counts["keyed"] += n
            return
        parent: _Node | None = None
        if e.parent_block_hash is not None:
            parent = self._parent(group, medium, e.parent_block_hash)
            if parent is None:
                self.counts["unplaced"] += n
                return
        self.groups.add(group)
        self._mediums.add(medium)
        key, tail, pos = (parent.key, parent.tail, parent.pos) if parent else (_SEED, b"", 0)
        raw = token_bytes(e.token_ids)
        span = 4 * e.block_size
        for i, h in enumerate(e.block_hashes):
            data = tail + raw[i * span:(i + 1) * span]
            whole = len(data) // _CHUNK_BYTES
            for c in range(whole):
                key = next_key(key, data[c * _CHUNK_BYTES:(c + 1) * _CHUNK_BYTES])
            tail, pos = data[whole * _CHUNK_BYTES:], pos + e.block_size
            node = self._nodes.get((group, medium, h))
            if node is None:
                # linked below its parent only in the same medium: what leaving one medium
                # takes along
                below = parent if parent is not None and parent.medium == medium else None
                node = _Node(group, medium, h, pos, key, tail, below)
                self._nodes[(group, medium, h)] = node
                self._any[(group, h)] = node
                self._by_key.setdefault((group, key), []).append(node)
                if below is not None:
                    below.children.append(node)
            self.counts["stored"] += 1
            parent = node

    def _drop(self, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if self._nodes.pop((n.group, n.medium, n.block), None) is None:
                continue
            if self._any.get((n.group, n.block)) is n:     # another medium's, if one holds it
                del self._any[(n.group, n.block)]
                for medium in self._mediums:
                    if (m := self._nodes.get((n.group, medium, n.block))) is not None:
                        self._any[(n.group, n.block)] = m
                        break
            bucket = self._by_key.get((n.group, n.key))
            if bucket is not None:
                bucket.remove(n)
                if not bucket:
                    del self._by_key[(n.group, n.key)]
            stack.extend(n.children)
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)

    def held(self, prompt: Sequence[int], path: Path | None = None) -> int:
        """The tokens of `prompt` this server holds: per group, the furthest announced
        position on its path (at most `len(prompt) - 1`); the least of the groups."""
        limit = len(prompt) - 1
        if limit <= 0 or not self.groups:
            return 0
        path = path if path is not None and path.n == len(prompt) else Path(_SEED, prompt)
        if path.keys[0] != _SEED:
            path = Path(_SEED, prompt)
        path.key(limit // CHUNK)
        return min(self._furthest(group, path, limit) for group in self.groups)

    def _furthest(self, group: int | None, path: Path, limit: int) -> int:
        for j in range(limit // CHUNK, -1, -1):
            bucket = self._by_key.get((group, path.keys[j]))
            if not bucket:
                continue
            best = 0
            for node in bucket:
                if node.pos <= limit and node.pos > best and \
                        path.raw[j * _CHUNK_BYTES:4 * node.pos] == node.tail:
                    best = node.pos
            if best:
                return best
        return 0

    def media(self) -> dict[str, int]:
        """Blocks held per medium (what /status shows)."""
        return dict(Counter(node.medium for node in self._nodes.values()))


def path_for(prompt: Sequence[int]) -> Path:
    """A prompt's path with the subscriber's seed: computed once per request, read by every
    server's `Held.held`."""
    return Path(_SEED, prompt)
