"""The ledger's state: its records (model), their store keys, the store behind a small interface with an
in-memory twin, and the view the fold works on between checkpoints. Imports only schemas and the error root."""
