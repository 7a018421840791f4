"""RocksStore.write fills its batch with the compiled loop (native/src/store.rs `fill_batch`) where the compiled
implementation is selected: the same database, deletes included, as the Python loop gives. The batch is written in
key order; a key that comes twice keeps the value written last, wherever the other keys sort."""

from __future__ import annotations

import pytest

from branch_settlement.projections import store as store_module
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas import native

pytestmark = [pytest.mark.unit, pytest.mark.skipif(native.module() is None, reason="needs the compiled module")]


def contents(store: RocksStore) -> dict:
    return dict(store.scan(b""))


@pytest.mark.parametrize("implementation", [native.COMPILED, native.PYTHON])
def test_a_batch_puts_and_deletes_alike(tmp_path, monkeypatch, implementation) -> None:
    monkeypatch.setenv(native.ENV, implementation)
    assert (native.compiled_function("fill_batch") is not None) == (implementation == native.COMPILED)
    store = RocksStore(tmp_path / implementation)
    try:
        store.write([(b"p\0a", b"1"), (b"p\0b", b"2"), (b"c\0a\0x", b"3")], 5)
        store.write([(b"p\0a", None), (b"p\0b", b"22"), (b"p\0c", b""), (b"p\0d", b"4"), (b"p\0d", None)], 9)
        store.write(iter([(b"c\0a\0x", None)]), 11)  # any iterable
        # a restore's batch of changelog records: the same key twice, other keys between that sort before it
        store.write([(b"p\0z", b"1"), (b"p\0e", b"5"), (b"p\0z", None), (b"p\0y", None), (b"c\0b", b"6"),
                     (b"p\0y", b"7")], 12)
        assert contents(store) == {b"p\0b": b"22", b"p\0c": b"", b"p\0e": b"5", b"c\0b": b"6", b"p\0y": b"7",
                                   store_module.keys.CHANGELOG_OFFSET_KEY: store_module._encode_offset(12)}
        assert store.changelog_offset() == 12
    finally:
        store.close()
