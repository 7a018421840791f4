"""The cross-check of the committed topics against a re-fold (`settle replay --topic`). Imports replay, the Kafka
runtime and the ledger; never the CLI."""
