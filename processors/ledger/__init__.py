"""The pure fold: events in, ledger changes and outputs out. Imports only schemas, projections, the error root and
itself: no I/O, no clock, no runtime."""
