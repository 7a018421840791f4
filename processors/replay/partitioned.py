"""Inputs of several partitions, kept apart: each partition has its own ledger and ledger time, so a
multi-partition replay folds each partition on its own, exactly as the processor does.

Also the export file format: an Avro object container whose records are `ExportedRecord` (partition,
offset, the event or, for a record that could not be decoded, its raw bytes and the reason). Any Avro
library reads it; `settle replay FILE.avro` folds it partition by partition.
"""

from __future__ import annotations

import gc
import os
import pickle
from typing import Callable, Iterable, Iterator, TypeVar

import fastavro

from branch_settlement.processors.replay.replayer import (Input, ReplayResult, _single_threaded, ledger_snapshot,
                                                          replay, replay_document)
from branch_settlement.processors.replay.errors import ReplayError
from branch_settlement.projections.store import MemoryStore, Store
from branch_settlement.schemas import EVENT_TYPES
from branch_settlement.schemas.codec import Codec, CodecError

EXPORT_RECORD = "io.branchsettlement.export.ExportedRecord"
T = TypeVar("T")


def export_schema(codec: Codec) -> dict:
    events = [codec.version(name).parsed for name in EVENT_TYPES]
    return fastavro.parse_schema({
        "type": "record", "name": EXPORT_RECORD,
        "doc": "One input record of branch-events: its position, and the event or why it is not one.",
        "fields": [
            {"name": "partition", "type": "int"},
            {"name": "offset", "type": "long"},
            {"name": "event", "type": ["null", *events], "default": None},
            {"name": "raw", "type": ["null", "bytes"], "default": None},
            {"name": "reason", "type": "string", "default": ""},
        ],
    })


def decode_record(codec: Codec, partition: int, offset: int, value: bytes | None) -> tuple[int, Input, bytes | None]:
    """An input record of the topic as the processor sees it: an event, or a dead letter with the reason."""
    try:
        return partition, Input(offset, codec.decode_event(value or b"")), value
    except CodecError as exc:
        return partition, Input(offset, None, str(exc)), value


def write_export(path, records: Iterable[tuple[int, Input, bytes | None]], codec: Codec) -> int:
    """Write (partition, input, raw bytes) records to an Avro container; return how many."""
    schema = export_schema(codec)
    count = 0

    def rows() -> Iterator[dict]:
        nonlocal count
        for partition, item, raw in records:
            count += 1
            if item.event is not None:
                event = {k: v for k, v in item.event.items() if k != "type"}
                yield {"partition": partition, "offset": item.offset,
                       "event": (f"io.branchsettlement.events.{item.event['type']}", event), "raw": None,
                       "reason": ""}
            else:
                yield {"partition": partition, "offset": item.offset, "event": None, "raw": raw or b"",
                       "reason": item.reason}

    with open(path, "wb") as out:
        fastavro.writer(out, schema, rows(), codec="deflate")
    return count


def is_export(path) -> bool:
    with open(path, "rb") as f:
        try:
            reader = fastavro.reader(f)
        except ValueError:
            return False
        schema = reader.writer_schema
        return isinstance(schema, dict) and schema.get("name") == EXPORT_RECORD


def read_export(path, codec: Codec) -> dict[int, list[Input]]:
    """Inputs of an export file, per partition, in offset order."""
    return {p: [export_input(row, codec) for row in rows] for p, rows in read_export_rows(path).items()}


def read_export_rows(path) -> dict[int, list[dict]]:
    """The rows of an export file as Avro decoded them, per partition, in offset order (`export_input`
    makes each an Input)."""
    by_partition: dict[int, list[dict]] = {}
    with open(path, "rb") as f:
        for row in fastavro.reader(f, return_record_name=True):
            by_partition.setdefault(row["partition"], []).append(row)
    return dict(sorted(by_partition.items()))


def export_input(row: dict, codec: Codec) -> Input:
    if row["event"] is not None:
        name, fields = row["event"]
        return Input(row["offset"], codec.event_from_json({"type": name.rsplit(".", 1)[1], **fields}))
    return Input(row["offset"], None, row["reason"])


def replay_partitions(inputs: dict[int, Iterable[Input]], codec: Codec, store_factory=MemoryStore,
                      progress=lambda events: None) -> dict[int, tuple[ReplayResult, Store]]:
    """Fold each partition's inputs into its own fresh store."""
    folded = {}
    for partition, items in sorted(inputs.items()):
        folded[partition] = replay(_counting(items, progress), store_factory(), codec=codec, partition=partition)
    return folded


def _counting(items: Iterable[Input], progress) -> Iterator[Input]:
    for n, item in enumerate(items, start=1):
        yield item
        if n % 1000 == 0:
            progress(1000)


def merged_document(folded: dict[int, tuple[ReplayResult, Store]], codec: Codec) -> dict:
    """One SPEC §12 document for several partitions: ledgers merged (a parent lives in one partition),
    outputs in (partition, offset) order."""
    return merge_documents({p: partition_document(p, result, store, codec) for p, (result, store) in folded.items()})


def partition_document(partition: int, result: ReplayResult, store: Store, codec: Codec) -> dict:
    """One partition's part of `merged_document`."""
    part = replay_document(result, store, codec)
    part["dead_letters"] = [{"partition": partition, "offset": letter["offset"], "reason": letter["reason"]}
                            for letter in result.dead_letters]
    return part


def merge_documents(parts: dict[int, dict]) -> dict:
    doc = {"parents": {}, "children": {}, "results": [], "releases": [], "dead_letters": []}
    for _, part in sorted(parts.items()):
        doc["parents"].update(part["parents"])
        doc["children"].update(part["children"])
        doc["results"].extend(part["results"])
        doc["releases"].extend(part["releases"])
        doc["dead_letters"].extend(part["dead_letters"])
    doc["parents"] = dict(sorted(doc["parents"].items()))
    doc["children"] = dict(sorted(doc["children"].items()))
    return doc


def replay_export(path, codec: Codec, render: Callable[[int, ReplayResult, Store], T],
                  jobs: int | None = None) -> dict[int, T]:
    """Fold each partition of an export file into a fresh in-memory store and `render` it (what is kept of
    a partition: a document, a text). The partitions are independent, so when this process runs a single
    thread, `jobs - 1` forked processes (default: one per core in all) take partitions too, the largest
    first, and send back what `render` made of them; the file is read once, here."""
    rows = read_export_rows(path)
    order = sorted(rows, key=lambda p: (-len(rows[p]), p))

    def one(p: int) -> T:
        result, store = replay((export_input(row, codec) for row in rows[p]), MemoryStore(), codec=codec,
                               partition=p)
        return render(p, result, store)

    jobs = min(len(order), jobs or _cores())
    if jobs <= 1 or not _single_threaded():
        return {p: one(p) for p in sorted(order)}
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    next_index = ctx.Value("i", 0)

    def claim() -> int | None:
        with next_index.get_lock():
            i = next_index.value
            next_index.value = i + 1
        return order[i] if i < len(order) else None

    def take_all() -> dict[int, T]:
        done = {}
        while (p := claim()) is not None:
            done[p] = one(p)
        return done

    workers = []
    try:
        gc.freeze()  # the forked processes' collector leaves the rows alone: their pages stay shared
        try:
            start_workers(workers, ctx, lambda send: send_outcome(send, take_all), [()] * (jobs - 1))
        finally:
            gc.unfreeze()
        done = take_all()
        gather_workers(workers, done, ReplayError)
        return dict(sorted(done.items()))
    finally:
        stop_workers(workers)


def start_workers(workers: list, ctx, target: Callable, args_per_worker: Iterable[tuple]) -> None:
    """One process of `ctx` per tuple of `args_per_worker`, running target(*args, send) with `send` the
    writing end of a pipe; each appended to `workers` as (process, reading end) once started, so that a
    failure half-way still leaves every started one to stop_workers."""
    for args in args_per_worker:
        receive, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=target, args=(*args, send), daemon=True)
        worker.start()
        send.close()
        workers.append((worker, receive))


def send_outcome(send, compute: Callable[[], dict]) -> None:
    """In a worker process: ("ok", compute()), or ("error", how it failed) if it raised (the message
    travels; the exception's class may not unpickle), pickled to `send`, which is then closed."""
    try:
        data = pickle.dumps(("ok", compute()), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:
        data = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
    try:
        send.send_bytes(data)
    finally:
        send.close()


def gather_workers(workers: list, results: dict, failure: type[Exception]) -> None:
    """Each worker process's ("ok", {partition: result}) (send_outcome) into `results`; a worker's
    ("error", message), or its death, raised as `failure`."""
    for worker, receive in workers:
        try:
            status, value = pickle.loads(receive.recv_bytes())
        except EOFError:
            worker.join(5)
            raise failure(f"a replay process died (exit code {worker.exitcode})") from None
        if status != "ok":
            raise failure(value)
        results.update(value)


def stop_workers(workers: list) -> None:
    for worker, receive in workers:
        receive.close()
        worker.join(10)
        if worker.is_alive():
            worker.kill()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


__all__ = ["decode_record", "write_export", "read_export", "is_export", "replay_partitions", "merged_document",
           "replay_export", "partition_document", "merge_documents",
           "ledger_snapshot"]
