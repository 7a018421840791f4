"""Tests of the fold (processors/ledger/): transitions, edge cases, the auditor, the reference model, the exhaustive check, the input limits."""
