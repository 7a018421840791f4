"""Errors of offline replay."""

from __future__ import annotations

from branch_settlement.errors import SettlementError


class ReplayError(SettlementError):
    """The process reading a replayed file failed; the message says how."""
