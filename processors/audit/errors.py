"""Errors of the per-parent reports (`settle audit`)."""

from __future__ import annotations

from branch_settlement.errors import SettlementError


class UnknownParentError(SettlementError):
    """`settle audit` was asked about a parent that no event of the input reserved.

    Raised by `parent_history` before anything is rendered. Operator: check the parent id (it is case
    sensitive) and that the file or partition is the one the parent's events were written to.
    """
