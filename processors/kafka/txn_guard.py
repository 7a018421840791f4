"""A hard deadline on librdkafka's blocking transactional calls.

librdkafka 2.16 can block in `send_offsets_to_transaction` far past the timeout it is given when the
coordinator it has cached went away (librdkafka issues 5456 and 5511); the fault suite saw it after every
broker restart (docs/faults.md, finding 1). A native call cannot be interrupted, so each blocking
transactional call runs on a thread of its own and the caller waits with a deadline. Past it, the caller
gives the producer up and carries on with a new one: the new producer's `init_transactions` bumps the
producer epoch, so whatever the stuck call does later, the old producer can commit nothing more.

A given-up producer stays referenced by its stuck thread, so it is never destroyed while its call is in
flight (destroying it would block as well). Each one costs a thread and a few connections: after
`MAX_STUCK` of them are still stuck, `check_stuck_budget` raises, and the process should exit and be
restarted by its supervisor, which frees everything.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

from confluent_kafka import KafkaError, KafkaException

from branch_settlement.processors.kafka.errors import TooManyStuckCalls, TransactionCallStuck

log = logging.getLogger("settle.txn")

T = TypeVar("T")

MARGIN_S = 5.0  # beyond the call's own timeout: librdkafka returns _TIMED_OUT itself when it is healthy
MAX_STUCK = 3

_stuck: list[threading.Thread] = []
_stuck_lock = threading.Lock()


def bounded(what: str, call: Callable[..., T], *args, timeout_s: float) -> T:
    """`call(*args)` on a daemon thread; its result or exception, or TransactionCallStuck once `timeout_s`
    plus MARGIN_S have passed."""
    box: dict = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = call(*args)
        except SystemError as exc:
            # confluent-kafka: a fatal error (e.g. _FENCED) raised while a delivery callback was running
            # surfaces as a SystemError caused by the KafkaException: that is the error to handle. One with no
            # cause ("returned NULL without setting an exception", seen from flush under a coordinator kill)
            # says only that the call failed: a failed call of the transaction, handled as any other (the
            # transaction aborted or resolved by the next producer), never a crash of the processor.
            box["error"] = exc.__cause__ if isinstance(exc.__cause__, KafkaException) else KafkaException(
                KafkaError(KafkaError._FAIL, f"{what} failed inside confluent-kafka ({exc})"))
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"txn:{what}", daemon=True)
    thread.start()
    if not done.wait(timeout_s + MARGIN_S):
        with _stuck_lock:
            _stuck.append(thread)
        log.error("%s did not return within %.1f s (its timeout was %.1f s): giving this producer up "
                  "(librdkafka issues 5456/5511: a stale coordinator after a broker restart)",
                  what, timeout_s + MARGIN_S, timeout_s)
        raise TransactionCallStuck(f"{what} blocked past its timeout of {timeout_s:.1f} s", code="STUCK",
                                   retriable=True)
    if "error" in box:
        raise box["error"]
    return box.get("value")


def stuck_calls() -> int:
    """Given-up calls still blocked."""
    with _stuck_lock:
        _stuck[:] = [t for t in _stuck if t.is_alive()]
        return len(_stuck)


def check_stuck_budget() -> None:
    count = stuck_calls()
    if count >= MAX_STUCK:
        raise TooManyStuckCalls(f"{count} given-up transactional producers are still blocked in librdkafka: "
                                "exiting so that a restart frees them (the committed state is intact)",
                                code="STUCK", fatal=True)
