#!/usr/bin/env bash
# The broker `make demo`, `make test` and `make bench` use: the one SETTLE_BOOTSTRAP_SERVERS names (default
# 127.0.0.1:9092) when it answers, whoever started it; otherwise, for a local address, the local broker of
# deploy/kafka.sh on that port. Needs the project's virtualenv (make install) for its probe.
#
#   bash deploy/broker.sh     exit 0 once a broker answers at the configured address, 1 with the reason if none can
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly REPO_DIR
readonly ADDRESS=${SETTLE_BOOTSTRAP_SERVERS:-127.0.0.1:9092}
readonly PYTHON=${PYTHON_BIN:-$REPO_DIR/.venv/bin/python}

answers() {
    "$PYTHON" - "$ADDRESS" <<'PY'
import sys
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

try:
    AdminClient({"bootstrap.servers": sys.argv[1], "log_level": 0}).list_topics(timeout=5)
except KafkaException:
    sys.exit(1)
PY
}

if answers; then
    echo "broker: using the Kafka cluster at $ADDRESS"
    exit 0
fi
if [[ $ADDRESS =~ ^(127\.0\.0\.1|localhost):([0-9]+)$ ]]; then
    KAFKA_PORT=${BASH_REMATCH[2]} exec bash "$REPO_DIR/deploy/kafka.sh" up
fi
echo "broker: no Kafka broker answers at $ADDRESS (SETTLE_BOOTSTRAP_SERVERS), and it is not a local address deploy/kafka.sh could start one on" >&2
exit 1
