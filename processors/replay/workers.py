"""Worker processes for the replays that fold partitions or shards side by side (an export file's partitions,
a file's parent shards, the topic cross-check's partitions): each started with a pipe, each sending back one
pickled outcome, gathered in order, and stopped however the run ended."""

from __future__ import annotations

import os
import pickle
from typing import Callable, Iterable


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


__all__ = ["start_workers", "send_outcome", "gather_workers", "stop_workers"]
