"""The processor runtime on Kafka: the checkpoint sequence, restore, clients, config, metrics, connection
settings and topics as code (spec in deploy/topics.json). Imports the ledger, schemas and projections; never
replay, the cross-check, the reports or the CLI."""
