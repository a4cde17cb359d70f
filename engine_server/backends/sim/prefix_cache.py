"""A paged KV cache with prefix caching and the KV events it emits.

Physical blocks are either empty, in use (ref count > 0) or cached and
evictable (ref count 0, kept in LRU order). A full block whose KV has been
computed is committed under its hash; later requests with the same prefix
pin it instead of recomputing. Events follow every change of the cached set
exactly: applying them in order (stored adds, removed deletes, cleared
empties) yields ``cached_hashes()``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine_server.backends.base import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class KvBlock:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


class PrefixCache:
    """Block allocation, prefix lookup, LRU eviction and KV-event buffering."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        blocks = [KvBlock(i) for i in range(num_blocks)]
        self._empty: list[KvBlock] = blocks[::-1]  # popped from the end: low ids first
        self._evictable: OrderedDict[int, KvBlock] = OrderedDict()  # LRU first
        self._cached: dict[int, KvBlock] = {}
        self._num_used = 0
        self._events: list[KvEvent] = []
        self._removed: list[int] = []  # evictions not yet closed into an event

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return self._num_used

    @property
    def num_free(self) -> int:
        """Blocks a request could get now: empty ones plus evictable cached ones."""
        return self.num_blocks - self._num_used

    def cached_hashes(self) -> frozenset[int]:
        return frozenset(self._cached)

    def lookup(self, block_hashes: Sequence[int]) -> list[KvBlock]:
        """Cached blocks for the longest cached prefix of ``block_hashes``."""
        hits = []
        for h in block_hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def pin(self, blocks: Sequence[KvBlock]) -> None:
        """Take a reference on cached blocks (they are no longer evictable)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
                self._num_used += 1
            block.ref_count += 1

    def allocate(self, n: int) -> list[KvBlock]:
        """n blocks for one request: empty ones first, then evict the LRU cached ones."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        out = []
        for _ in range(n):
            if self._empty:
                block = self._empty.pop()
            else:
                _, block = self._evictable.popitem(last=False)
                assert block.block_hash is not None
                del self._cached[block.block_hash]
                self._removed.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        self._num_used += n
        return out

    def free(self, blocks: Sequence[KvBlock]) -> None:
        """Drop a request's references, last block first (so tails are evicted first)."""
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_used -= 1
                if block.block_hash is not None:
                    self._evictable[block.block_id] = block
                else:
                    self._empty.append(block)

    def commit(
        self,
        blocks: Sequence[KvBlock],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        cache_salt: str = "",
    ) -> None:
        """Cache consecutive full blocks of one request and emit BlockStored.

        ``token_ids`` holds ``block_size`` tokens per block. A block whose hash
        is already cached (another request computed the same prefix at the same
        time) stays private to its request: the cache keeps one block per hash,
        so no hash is ever stored twice.
        """
        bs = self.block_size
        group: list[int] = []
        group_parent = parent_hash
        group_start = 0
        for i, (block, h) in enumerate(zip(blocks, block_hashes, strict=True)):
            if h in self._cached:
                self._close_stored(
                    group, group_parent, token_ids[group_start * bs : i * bs], cache_salt
                )
                group, group_parent, group_start = [], h, i + 1
                continue
            block.block_hash = h
            self._cached[h] = block
            group.append(h)
        self._close_stored(group, group_parent, token_ids[group_start * bs :], cache_salt)

    def _close_stored(
        self, hashes: list[int], parent: int | None, tokens: Sequence[int], cache_salt: str
    ) -> None:
        if hashes:
            self._close_removed()
            self._events.append(
                BlockStored(
                    block_hashes=tuple(hashes),
                    parent_block_hash=parent,
                    token_ids=tuple(tokens),
                    block_size=self.block_size,
                    cache_salt=cache_salt,
                )
            )

    def _close_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(block_hashes=tuple(self._removed)))
            self._removed = []

    def reset(self, *, running: bool = False) -> bool:
        """Drop every cached block; refused (False) while any block is in use,
        unless ``running``: then blocks in use stay with their requests, no
        longer cached (vLLM recomputes such requests; the sim's outputs do not
        depend on its KV, so keeping them changes nothing but the cache).

        vLLM refuses too: a block in use cannot leave the cache without breaking
        the request using it, and AllBlocksCleared must mean "nothing cached".
        """
        if self._num_used and not running:
            return False
        self._close_removed()
        for block in self._cached.values():
            if block.ref_count:
                block.block_hash = None
        for block in self._evictable.values():
            block.block_hash = None
            self._empty.append(block)
        self._evictable.clear()
        self._cached.clear()
        self._empty.sort(key=lambda b: -b.block_id)
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        """The events since the last call, in order."""
        self._close_removed()
        events, self._events = self._events, []
        return events
