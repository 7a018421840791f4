"""Offline replay: the fold over files and exported partitions, in parallel workers. Imports the ledger, schemas and
projections; never the Kafka runtime, the cross-check, the reports or the CLI."""
