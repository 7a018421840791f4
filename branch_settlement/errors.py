"""The error tree's root. One root, a small tree: each layer keeps its branches in its own `errors` module
(processors/ledger/errors.py, processors/replay/errors.py, processors/audit/errors.py, processors/kafka/errors.py,
schemas/errors.py), and each error says what raises it and what the operator should do. The command line
catches the root and prints one line, never a traceback, for every expected failure.

Expected bad input is never an exception: it is a result code (processors/ledger/results.py) or a dead letter.
"""

from __future__ import annotations


class SettlementError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(SettlementError):
    """A setting is missing or invalid. Raised at start-up; the message names the setting to fix."""
