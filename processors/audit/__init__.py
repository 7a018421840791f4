"""One parent's story for people (`settle audit`: text and HTML). Imports replay and the ledger; never the
Kafka runtime or the CLI."""
