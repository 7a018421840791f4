"""The settlement processors, one sub-package per layer: ledger/ (the pure fold), replay/ (offline), kafka/
(the runtime), crosscheck/ (topics against a re-fold), audit/ (per-parent reports), cli/ (`settle`); and two
modules they share: gc_tuning (the collector kept off the hot path) and workload (a seeded realistic stream
for benchmarks, simulations and tests)."""
