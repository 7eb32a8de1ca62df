"""KV blocks: fixed-size pages of the cache, reference-counted, with automatic prefix caching."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


class BlockManager:
    """Fixed-size KV blocks, reference-counted, with automatic prefix caching.

    A block that holds a full block of some prompt's tokens is registered under a hash of those
    tokens and of every token before them (a chain: the same hash means the same prefix). A request
    whose prompt starts with registered blocks takes them instead of computing them again. Blocks no
    request holds wait in least-recently-freed order and keep their hash until they are handed out
    again, so a prefix stays cached for as long as the memory is not needed.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend a block table to hold num_tokens; False (and no change) if blocks run out."""
        need = self.blocks_for(num_tokens) - len(blocks)
        if need > len(self._free):
            return False
        for _ in range(need):
            blocks.append(self._take())
        return True

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        cached = self._hash_of[block]
        if cached is not None:  # evicted: its prefix is no longer cached
            del self._cached[cached]
            self._hash_of[block] = None
        self._refs[block] = 1
        return block

    def share(self, blocks: list[int]) -> list[int]:
        """A second holder of the same blocks (a beam forked from another)."""
        for block in blocks:
            self._refs[block] += 1
        return list(blocks)

    def grow_writable(
        self, blocks: list[int], num_tokens: int, copies: list[tuple[int, int]]
    ) -> bool:
        """`grow`, for a table whose blocks may be shared (beams): when the block that token
        num_tokens - 1 lands in is partly filled and held by another table too, it is replaced by a
        fresh block, and (source, destination) goes on `copies` for execute to copy first (copy on
        write at the first divergent token). False (and no change) if blocks run out."""
        last = (num_tokens - 1) // self.block_size
        shared = last < len(blocks) and self._refs[blocks[last]] > 1
        if self.blocks_for(num_tokens) - len(blocks) + shared > len(self._free):
            return False
        if shared:
            source = blocks[last]
            self._refs[source] -= 1
            blocks[last] = self._take()
            copies.append((source, blocks[last]))
        return self.grow(blocks, num_tokens)

    def free(self, blocks: list[int]) -> None:
        # Tail first: a prefix's last blocks are evicted before its first ones.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        blocks.clear()

    def match(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks of the longest cached prefix of `hashes`, now held by the caller."""
        blocks = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            blocks.append(block)
        return blocks

    def reset_prefix_cache(self) -> int:
        """Forget the prefix of every block no request holds (a held block keeps its own: its
        request still reads it); how many were forgotten."""
        dropped = 0
        for block in self._free:
            block_hash = self._hash_of[block]
            if block_hash is not None:
                del self._cached[block_hash]
                self._hash_of[block] = None
                dropped += 1
        return dropped

    def register(self, block: int, block_hash: bytes) -> None:
        """`block` now holds (or its step will write) the full block that `block_hash` names."""
        if block_hash not in self._cached and self._hash_of[block] is None:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash


def prompt_block_hashes(
    prompt_ids: np.ndarray, block_size: int, cache_salt: str | None = None, lora_id: int = 0
) -> list[bytes]:
    """A chained hash per full block of the prompt: block j's covers tokens [0, (j + 1) * size).

    BLAKE2b rather than Python's hash: a client must not be able to craft a prompt that collides
    with another's prefix and read its cached KV (why vLLM hashes with SHA-256 by default). A
    salt (vLLM's cache_salt) goes into the first block's hash, so the whole chain: requests
    share cached blocks only when their salts are the same (or both absent). A LoRA adapter's id
    goes in the same way: its KV is not the base model's, nor another adapter's.
    """
    ids = np.ascontiguousarray(prompt_ids, np.int32)
    hashes = []
    parent = b""
    if cache_salt is not None:  # a hash of its own (`person`), so no token block can match it
        parent = hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"cache_salt").digest()
    if lora_id:
        parent = hashlib.blake2b(
            parent + lora_id.to_bytes(8, "little"), digest_size=16, person=b"lora"
        ).digest()
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(
            parent + ids[start : start + block_size].tobytes(), digest_size=16
        ).digest()
        hashes.append(parent)
    return hashes
