"""Everything that talks to Kafka's admin side: connection settings (connection.py), topics as code
(topics.py, spec in deploy/topics.json) and the `settle topics` command (topics_cli.py)."""
