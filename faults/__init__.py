"""The fault-injection suite: scenarios against a real broker, an independent verifier, and a
deterministic simulation without Kafka. `python -m faults.run` (= `make faults`) runs the full suite and
writes faults/report.json and faults/report.md; tests/faults runs a reduced set. See docs/faults.md.

Nothing here imports tests/: the suite runs from `make faults` on its own."""
