"""The projection store: a small byte-level interface with two implementations.

The fold never talks to a store directly; it works on a `LedgerView` (projections/view.py) that reads
through to the store and buffers changes. A store only has to do three things well:

- `get(key)`: one value or None;
- `scan(prefix)`: every (key, value) under a prefix, in key order;
- `write(changes, changelog_offset)`: apply puts and deletes and record the changelog offset they bring the
  projection up to, atomically (one RocksDB WriteBatch). State and offset never disagree.

`MemoryStore` is the in-memory twin used by tests, replay and benchmarks; `RocksStore` is the production
store. tests/projections/test_store_contract.py runs one contract suite against both.
"""

from __future__ import annotations

import os
from operator import itemgetter
from typing import Iterable, Iterator, Protocol

from branch_settlement.projections import keys
from branch_settlement.schemas import native

Change = tuple[bytes, bytes | None]  # (key, value) or (key, None) for a delete

NO_OFFSET = -1

# RocksDB's memory, bounded per process rather than per database (a process opens one database per owned
# partition): every RocksStore of the process shares one block cache, which also holds the index and filter
# blocks (otherwise kept outside any cache, growing with the data), and one write buffer manager whose
# memtables are charged to that same cache. RocksDB's memory then stays near ROCKSDB_CACHE_BYTES whatever
# the ledger's size and the number of partitions. `set_rocksdb_memory` changes both before the first store
# opens.
ROCKSDB_CACHE_BYTES = 64 * 1024 * 1024
ROCKSDB_WRITE_BUFFERS_BYTES = 32 * 1024 * 1024  # all memtables together, counted inside the cache
# One memtable of one database: small, so that a checkpoint's inserts (each a search of the memtable's skip list
# for one of ~2,700 scattered keys) and the fold's reads touch little memory; 2 MB against 8 MB: the store step
# 4.4-4.8 ms per checkpoint against 5.1-5.5, `settle run` 10-12% faster (docs/decisions.md, 37).
WRITE_BUFFER_BYTES = 2 * 1024 * 1024
MEMTABLE_BLOOM_RATIO = 0.05  # of the write buffer: 100 KB per memtable, ~100 bits for each of its ~8k keys
BLOOM_BITS_PER_KEY = 10  # most lookups of the fold are for keys not yet written (new children, new keys)

_first = itemgetter(0)
_shared: dict = {}


def set_rocksdb_memory(cache_bytes: int, write_buffers_bytes: int | None = None) -> None:
    """The process-wide RocksDB budget: the block cache (which also holds the memtables, up to
    `write_buffers_bytes`, default half of it). Only before the first RocksStore of the process opens."""
    global ROCKSDB_CACHE_BYTES, ROCKSDB_WRITE_BUFFERS_BYTES
    if _shared:
        raise RuntimeError("set_rocksdb_memory: a RocksStore is already open in this process")
    ROCKSDB_CACHE_BYTES = cache_bytes
    ROCKSDB_WRITE_BUFFERS_BYTES = cache_bytes // 2 if write_buffers_bytes is None else write_buffers_bytes


def _shared_memory():
    """The block cache and the write buffer manager every RocksStore of the process uses (created once, kept
    for the life of the process: RocksDB requires them to outlive every database using them)."""
    if not _shared:
        from rocksdict import Cache, WriteBufferManager

        cache = Cache(ROCKSDB_CACHE_BYTES)
        _shared["cache"] = cache
        _shared["write_buffers"] = WriteBufferManager.new_write_buffer_manager_with_cache(
            ROCKSDB_WRITE_BUFFERS_BYTES, False, cache)
    return _shared["cache"], _shared["write_buffers"]


def write_options():
    """A writable RocksStore's write options: each batch goes into the memtable with the per-batch insert hint (its
    keys in order, each next to the one before)."""
    from rocksdict import WriteOptions

    options = WriteOptions()
    options.memtable_insert_hint_per_batch = True
    return options


class Store(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...

    def write(self, changes: Iterable[Change], changelog_offset: int) -> None: ...

    def changelog_offset(self) -> int: ...

    def close(self) -> None: ...


def _encode_offset(offset: int) -> bytes:
    return b"%d" % offset


def _decode_offset(raw: bytes | None) -> int:
    return NO_OFFSET if raw is None else int(raw)


class MemoryStore:
    """A dict of bytes. Values are immutable bytes, so nothing the fold holds can alias stored state."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        for key in sorted(k for k in self._data if k.startswith(prefix)):
            yield key, self._data[key]

    def write(self, changes: Iterable[Change], changelog_offset: int) -> None:
        # Nothing below can fail half-way (bytes in, bytes out), so applying in place is all-or-nothing.
        data = self._data
        for key, value in changes:
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        data[keys.CHANGELOG_OFFSET_KEY] = _encode_offset(changelog_offset)

    def changelog_offset(self) -> int:
        return _decode_offset(self._data.get(keys.CHANGELOG_OFFSET_KEY))

    def close(self) -> None:
        pass


class RocksStore:
    """RocksDB through rocksdict, in raw (bytes) mode. One database directory per input partition."""

    def __init__(self, path: str | os.PathLike, *, read_only: bool = False) -> None:
        from rocksdict import AccessType, BlockBasedOptions, Options, Rdict

        cache, write_buffers = _shared_memory()
        options = Options(raw_mode=True)
        options.create_if_missing(not read_only)
        # One database per input partition, several per process: the memtables (8 MB each, two at most per
        # database) are also bounded all together by the shared write buffer manager.
        options.set_write_buffer_size(WRITE_BUFFER_BYTES)
        options.set_max_write_buffer_number(2)
        options.set_write_buffer_manager(write_buffers)
        table = BlockBasedOptions()
        table.set_block_cache(cache)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
        options.set_block_based_table_factory(table)
        # The same for the memtables: a key not written yet is known absent without searching them.
        options.set_memtable_whole_key_filtering(True)
        options.set_memtable_prefix_bloom_ratio(MEMTABLE_BLOOM_RATIO)
        self.path = os.fspath(path)
        if not read_only:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        access = AccessType.read_only() if read_only else AccessType.read_write()
        self._db = Rdict(self.path, options=options, access_type=access)
        if not read_only:
            self._db.set_write_options(write_options())
        # The fold's reads call RocksDB's own `get` (a miss costs no Python frame): the same as the method below.
        self.get = self._db.get

    def get(self, key: bytes) -> bytes | None:
        return self._db.get(key)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        it = self._db.iter()
        it.seek(prefix)
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                break
            yield key, it.value()
            it.next()

    def write(self, changes: Iterable[Change], changelog_offset: int) -> None:
        self._db.write(self.batch(changes, changelog_offset))

    @staticmethod
    def batch(changes: Iterable[Change], changelog_offset: int):
        """The RocksDB batch `write` writes: the changes, then the changelog offset they bring the store up to."""
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        # In key order, with the write's insert hint: each key goes into the memtable next to the one before it
        # instead of being searched for from the top. A stable sort: a key that comes twice (a restore's batch of
        # changelog records) keeps its last value.
        fill = native.compiled_function("fill_batch")
        if fill is not None:
            fill(batch, changes if type(changes) is list else list(changes))  # the same, from native/src/store.rs
        else:
            for key, value in sorted(changes, key=_first):
                if value is None:
                    batch.delete(key)
                else:
                    batch.put(key, value)
        batch.put(keys.CHANGELOG_OFFSET_KEY, _encode_offset(changelog_offset))
        return batch

    def changelog_offset(self) -> int:
        return _decode_offset(self._db.get(keys.CHANGELOG_OFFSET_KEY))

    def close(self) -> None:
        self._db.close()
