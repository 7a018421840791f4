#!/usr/bin/env bash
# A real Apache Kafka broker for development, tests and CI, with no Docker engine: the broker's jars come from
# Maven Central into a project-local cache, and one KRaft node (broker + controller) runs on 127.0.0.1.
#
#   bash deploy/kafka.sh up       install if needed, start, wait until the broker answers (no-op if running)
#   bash deploy/kafka.sh down     stop it: SIGTERM, then SIGKILL after KAFKA_STOP_TIMEOUT_S
#   bash deploy/kafka.sh status   what runs where; exit 0 when running, 3 when not
#   bash deploy/kafka.sh install  only resolve the jars into the cache
#
# Environment (defaults in brackets):
#   KAFKA_PORT [9092]  KAFKA_CONTROLLER_PORT [KAFKA_PORT + 1]  KAFKA_HEAP_MB [512]
#   KAFKA_UP_TIMEOUT_S [90]  KAFKA_STOP_TIMEOUT_S [30]
#   KAFKA_CACHE_DIR [.cache/kafka]  KAFKA_M2_DIR [.cache/m2]  KAFKA_RUN_DIR [.run/kafka]
#   KAFKA_ROLE [combined]: combined runs one node that is broker and controller. `controller` and `broker` run
#     the two halves as separate processes (node 1 and node 2, each with its own KAFKA_RUN_DIR and the same
#     KAFKA_CLUSTER_ID): a broker can then crash while its controller stays up, as in a production cluster.
#     The fault suite needs that (docs/faults.md, finding 2); development and CI use one combined node.
#   KAFKA_CLUSTER_ID [random]: the cluster id to format new storage with.
#   KAFKA_NODE_ID [1 for combined and controller, 2 for broker]: this node's node.id.
#   KAFKA_QUORUM_VOTERS [1@127.0.0.1:KAFKA_CONTROLLER_PORT]: controller.quorum.voters, for a quorum of several
#     controllers (the fault suite's replicated cluster: faults/cluster.py).
#   KAFKA_EXTRA_CONFIG [none]: a properties file whose settings replace or add to deploy/server.properties'
#     (e.g. replication factors for a cluster of several brokers).
#
# The data directory survives `down`, so topics survive a restart. `rm -rf .run/kafka` (when stopped) starts over.
set -euo pipefail

# Pinned: tests, CI and docker-compose.yml (apache/kafka image tag) run this same version.
readonly KAFKA_VERSION=4.3.1
readonly JAVA_MAJOR_MIN=17

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly REPO_DIR
readonly DEPLOY_DIR=$REPO_DIR/deploy
# How messages name this script (deploy/kafka-secure.sh sources it and names itself).
KAFKA_SCRIPT_NAME=${KAFKA_SCRIPT_NAME:-deploy/kafka.sh}
readonly PORT=${KAFKA_PORT:-9092}
readonly CONTROLLER_PORT=${KAFKA_CONTROLLER_PORT:-$((PORT + 1))}
readonly HEAP_MB=${KAFKA_HEAP_MB:-512}
readonly ROLE=${KAFKA_ROLE:-combined}
case $ROLE in combined | controller | broker) ;; *)
    echo "kafka: KAFKA_ROLE is '$ROLE'; it must be combined, controller or broker." >&2
    exit 2
    ;;
esac
if [[ $ROLE == broker ]]; then NODE_ID=${KAFKA_NODE_ID:-2}; else NODE_ID=${KAFKA_NODE_ID:-1}; fi
readonly NODE_ID
readonly QUORUM_VOTERS=${KAFKA_QUORUM_VOTERS:-}
readonly EXTRA_CONFIG=${KAFKA_EXTRA_CONFIG:-}
if [[ -n $EXTRA_CONFIG && ! -r $EXTRA_CONFIG ]]; then
    echo "kafka: KAFKA_EXTRA_CONFIG names $EXTRA_CONFIG, which cannot be read." >&2
    exit 2
fi
readonly UP_TIMEOUT_S=${KAFKA_UP_TIMEOUT_S:-90}
readonly STOP_TIMEOUT_S=${KAFKA_STOP_TIMEOUT_S:-30}
readonly CACHE_DIR=${KAFKA_CACHE_DIR:-$REPO_DIR/.cache/kafka}
readonly M2_DIR=${KAFKA_M2_DIR:-$REPO_DIR/.cache/m2}
readonly RUN_DIR=${KAFKA_RUN_DIR:-$REPO_DIR/.run/kafka}
readonly DATA_DIR=$RUN_DIR/data
readonly PID_FILE=$RUN_DIR/pid
readonly LOG_FILE=$RUN_DIR/server.log
readonly CONFIG_FILE=$RUN_DIR/server.properties
readonly POM_FILE=$DEPLOY_DIR/kafka-pom.xml
# The cache is keyed by version and by the pom's content, so editing the pom re-resolves instead of reusing
# a classpath that no longer matches it.
POM_SHA=$(sha256sum "$POM_FILE" | cut -c1-12)
readonly LIB_DIR=$CACHE_DIR/$KAFKA_VERSION-$POM_SHA/libs
readonly LIB_STAMP=$CACHE_DIR/$KAFKA_VERSION-$POM_SHA/complete

fail() {
    echo "kafka: $*" >&2
    exit 1
}

say() {
    echo "kafka: $*"
}

java_bin() {
    if [[ -n ${JAVA_HOME:-} && -x $JAVA_HOME/bin/java ]]; then
        echo "$JAVA_HOME/bin/java"
    else
        command -v java || true
    fi
}

require_java() {
    local java version major
    java=$(java_bin)
    [[ -n $java ]] || fail "no Java found. Kafka $KAFKA_VERSION needs Java $JAVA_MAJOR_MIN+ (e.g. apt-get install openjdk-17-jre-headless, or set JAVA_HOME)."
    # `java -version` prints e.g. 'openjdk version "17.0.15" 2025-04-15' (or "1.8.0_402" for Java 8).
    version=$("$java" -version 2>&1 | sed -n 's/.*version "\([^"]*\)".*/\1/p' | head -n1)
    major=${version%%.*}
    [[ $major == 1 ]] && major=$(echo "$version" | cut -d. -f2)
    [[ $major =~ ^[0-9]+$ ]] || fail "cannot tell the version of $java (it said: $("$java" -version 2>&1 | head -n1))."
    ((major >= JAVA_MAJOR_MIN)) || fail "$java is Java $version; Kafka $KAFKA_VERSION needs Java $JAVA_MAJOR_MIN+ (install it, or set JAVA_HOME)."
    JAVA=$java
}

install() {
    [[ -f $LIB_STAMP ]] && return 0
    command -v mvn >/dev/null || fail "Kafka $KAFKA_VERSION is not in $CACHE_DIR yet, and installing it needs Maven (e.g. apt-get install maven)."
    say "installing Apache Kafka $KAFKA_VERSION from Maven Central into $LIB_DIR (once)"
    local build_dir mvn_log
    build_dir=$(dirname "$LIB_DIR")
    mvn_log=$build_dir/maven.log
    rm -rf "$build_dir"
    mkdir -p "$build_dir"
    if ! mvn --batch-mode --no-transfer-progress --file "$POM_FILE" \
        -Dmaven.repo.local="$M2_DIR" -Dkafka.version="$KAFKA_VERSION" \
        -DincludeScope=runtime -DoutputDirectory="$LIB_DIR" \
        dependency:copy-dependencies >"$mvn_log" 2>&1; then
        echo "kafka: Maven could not resolve Apache Kafka $KAFKA_VERSION (full log: $mvn_log):" >&2
        # Maven's own advice (-e, -X, wiki links) does not help here; its first errors say what was missing.
        grep -E '^\[ERROR\]' "$mvn_log" | grep -vE '^\[ERROR\] *$|re-run Maven|Re-run Maven|For more information|\[Help [0-9]+\] http' |
            sed -e 's/ -> \[Help [0-9]*\]$//' -e 's/^/    /' | head -n 8 >&2 || true
        exit 1
    fi
    [[ -f $LIB_DIR/kafka_2.13-$KAFKA_VERSION.jar ]] || fail "Maven ran, but $LIB_DIR has no kafka_2.13-$KAFKA_VERSION.jar (see $mvn_log)."
    # The stamp is written last: an interrupted install is redone, never half-used.
    date -u +%FT%TZ >"$LIB_STAMP"
}

# Runs a Kafka main class on the cached classpath, with the given log level.
run_kafka_class() {
    local level=$1 main_class=$2
    shift 2
    "$JAVA" -Xmx256m -cp "$LIB_DIR/*" \
        -Dlog4j2.configurationFile="$DEPLOY_DIR/log4j2.properties" -Dkafka.root.log.level="$level" \
        "$main_class" "$@"
}

pid_alive() {
    local pid
    [[ -f $PID_FILE ]] || return 1
    pid=$(cat "$PID_FILE")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    # A pid is only ours if that process is a broker on our config: pids are reused after a reboot.
    tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "kafka.Kafka $CONFIG_FILE" || return 1
    echo "$pid"
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

who_listens() {
    ss -Hltnp "sport = :$1" 2>/dev/null | sed -n 's/.*users:((\(.*\)))/\1/p' | head -n1
}

require_port_free() {
    local port=$1 role=$2 holder
    port_open "$port" || return 0
    holder=$(who_listens "$port")
    fail "port $port ($role) on 127.0.0.1 is in use${holder:+ by $holder}, not by a broker this script started. Stop it, or choose other ports: KAFKA_PORT=... KAFKA_CONTROLLER_PORT=... (and SETTLE_BOOTSTRAP_SERVERS=127.0.0.1:<port> for the tests)."
}

# One template for every role: a separate controller or broker replaces the lines that say which node it is
# and where it listens; everything else (topic defaults, transaction settings) is the same as the combined node's.
role_lines() {
    case $ROLE in
    controller)
        printf '%s\n' "process.roles=controller" "node.id=$NODE_ID" "listeners=CONTROLLER://127.0.0.1:$CONTROLLER_PORT"
        ;;
    broker)
        printf '%s\n' "process.roles=broker" "node.id=$NODE_ID" "listeners=PLAINTEXT://127.0.0.1:$PORT" \
            "advertised.listeners=PLAINTEXT://127.0.0.1:$PORT" "inter.broker.listener.name=PLAINTEXT"
        ;;
    combined)
        [[ -z ${KAFKA_NODE_ID:-} ]] || printf '%s\n' "node.id=$NODE_ID"
        ;;
    esac
    [[ -z $QUORUM_VOTERS ]] || printf '%s\n' "controller.quorum.voters=$QUORUM_VOTERS"
}

# The keys that role_lines and KAFKA_EXTRA_CONFIG set, as an extended regex of 'key=' line starts: the
# template's lines for them are left out, so every key appears once in the written config.
overridden_keys() {
    {
        [[ $ROLE == combined ]] || printf '%s=\n' process.roles node.id listeners advertised.listeners \
            inter.broker.listener.name
        role_lines
        [[ -z $EXTRA_CONFIG ]] || grep -vE '^\s*(#|$)' "$EXTRA_CONFIG"
    } | sed -n 's/^\s*\([^=[:space:]]*\)\s*=.*/\1/p' | sed 's/\./\\./g' | paste -sd'|' -
}

write_config() {
    mkdir -p "$DATA_DIR"
    local keys
    keys=$(overridden_keys)
    {
        sed -e "s|@PORT@|$PORT|g" -e "s|@CONTROLLER_PORT@|$CONTROLLER_PORT|g" -e "s|@DATA_DIR@|$DATA_DIR|g" \
            "$DEPLOY_DIR/server.properties" |
            if [[ -z $keys ]]; then cat; else grep -vE "^($keys)=" || true; fi
        role_lines
        [[ -z $EXTRA_CONFIG ]] || grep -vE '^\s*(#|$)' "$EXTRA_CONFIG"
    } >"$CONFIG_FILE"
}

random_cluster_id() {
    # A Kafka Uuid as text: 16 random bytes in URL-safe base64 without padding. Kafka's own generator avoids a
    # leading '-' because a command line would read it as an option; so do we.
    local id
    while :; do
        id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
        [[ $id != -* ]] && break
    done
    echo "$id"
}

format_storage() {
    [[ -f $DATA_DIR/meta.properties ]] && return 0
    local out
    if ! out=$(run_kafka_class WARN kafka.tools.StorageTool format --cluster-id "${KAFKA_CLUSTER_ID:-$(random_cluster_id)}" \
        --config "$CONFIG_FILE" --ignore-formatted 2>&1); then
        echo "kafka: formatting KRaft storage in $DATA_DIR failed:" >&2
        echo "$out" | grep -vE '^\s+at ' | tail -n 8 >&2
        exit 1
    fi
}

cluster_id_on_disk() {
    sed -n 's/^cluster.id=//p' "$DATA_DIR/meta.properties" 2>/dev/null
}

# The broker is healthy when a client gets metadata from it and that metadata names our cluster, so a
# different broker on the same port is never mistaken for ours.
broker_answers() {
    local answer
    answer=$(timeout 20 "$JAVA" -Xmx128m -XX:TieredStopAtLevel=1 -cp "$LIB_DIR/*" \
        -Dlog4j2.configurationFile="$DEPLOY_DIR/log4j2.properties" -Dkafka.root.log.level=OFF \
        org.apache.kafka.tools.ClusterTool cluster-id --bootstrap-server "127.0.0.1:$PORT" 2>/dev/null) || return 1
    [[ $answer == *"Cluster ID: $(cluster_id_on_disk)"* ]]
}

show_log_tail() {
    echo "kafka: last lines of $LOG_FILE:" >&2
    tail -n 30 "$LOG_FILE" | sed 's/^/    /' >&2
}

wait_until_healthy() {
    local pid=$1 deadline=$((SECONDS + UP_TIMEOUT_S))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "kafka: the broker (pid $pid) exited during startup." >&2
            show_log_tail
            rm -f "$PID_FILE"
            exit 1
        fi
        if [[ $ROLE == controller ]]; then
            # A controller serves no client requests; it is up when its quorum port accepts connections.
            port_open "$CONTROLLER_PORT" && return 0
        elif port_open "$PORT" && broker_answers; then
            return 0
        fi
        sleep 0.5
    done
    echo "kafka: the broker (pid $pid) did not answer on 127.0.0.1:$PORT within ${UP_TIMEOUT_S}s (KAFKA_UP_TIMEOUT_S). It is left running: inspect it, then bash $KAFKA_SCRIPT_NAME down." >&2
    show_log_tail
    exit 1
}

cmd_up() {
    local pid started_s
    require_java
    if pid=$(pid_alive); then
        # Still wait: a broker that is starting (or was left unhealthy) is not yet one to hand to a caller.
        wait_until_healthy "$pid"
        say "already running (pid $pid) on 127.0.0.1:$PORT"
        return 0
    fi
    [[ $ROLE == controller ]] || require_port_free "$PORT" broker
    [[ $ROLE == broker ]] || require_port_free "$CONTROLLER_PORT" controller
    install
    started_s=$SECONDS
    write_config
    format_storage
    rm -f "$PID_FILE"
    echo "---- $(date -u +%FT%TZ) $KAFKA_SCRIPT_NAME up: Kafka $KAFKA_VERSION $ROLE on 127.0.0.1:$PORT" >>"$LOG_FILE"
    # setsid: the broker must outlive the shell that started it (make, pytest) and must not receive the Ctrl-C
    # meant for that shell. The inner shell records its own pid, then becomes java, so the pid file names the JVM.
    # shellcheck disable=SC2016 # $$ and $@ are meant for the inner shell.
    setsid bash -c 'echo $$ >"$0"; exec "$@"' "$PID_FILE" \
        "$JAVA" -Xms128m -Xmx"${HEAP_MB}m" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError \
        -Djava.awt.headless=true -Dkafka.logs.dir="$RUN_DIR" \
        -Dlog4j2.configurationFile="$DEPLOY_DIR/log4j2.properties" \
        -cp "$LIB_DIR/*" kafka.Kafka "$CONFIG_FILE" </dev/null >>"$LOG_FILE" 2>&1 &
    # Wait for the pid file: the background shell writes it before it execs java.
    for _ in {1..100}; do
        [[ -s $PID_FILE ]] && break
        sleep 0.05
    done
    [[ -s $PID_FILE ]] || fail "the broker process did not start (see $LOG_FILE)."
    pid=$(cat "$PID_FILE")
    wait_until_healthy "$pid"
    if [[ $ROLE == controller ]]; then
        say "Kafka $KAFKA_VERSION controller up on 127.0.0.1:$CONTROLLER_PORT (pid $pid, $((SECONDS - started_s))s)"
    else
        say "Kafka $KAFKA_VERSION up on 127.0.0.1:$PORT (pid $pid, $((SECONDS - started_s))s)"
    fi
}

cmd_down() {
    local pid deadline
    if ! pid=$(pid_alive); then
        rm -f "$PID_FILE"
        say "not running"
        return 0
    fi
    kill -TERM "$pid"
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
        sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "kafka: the broker (pid $pid) did not stop within ${STOP_TIMEOUT_S}s of SIGTERM; sending SIGKILL." >&2
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    rm -f "$PID_FILE"
    say "stopped (pid $pid)"
}

cmd_status() {
    local pid
    if pid=$(pid_alive); then
        echo "kafka $KAFKA_VERSION running: pid $pid"
        echo "  bootstrap   127.0.0.1:$PORT"
        echo "  controller  127.0.0.1:$CONTROLLER_PORT"
        echo "  cluster id  $(cluster_id_on_disk)"
        echo "  data        $DATA_DIR"
        echo "  log         $LOG_FILE"
        echo "  jars        $LIB_DIR"
        return 0
    fi
    if port_open "$PORT"; then
        local holder
        holder=$(who_listens "$PORT")
        echo "kafka: not started by this script, but 127.0.0.1:$PORT is in use${holder:+ by $holder}"
    else
        echo "kafka: not running (port $PORT free; cache $([[ -f $LIB_STAMP ]] && echo installed || echo empty))"
    fi
    return 3
}

main() {
    case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    install) require_java && install ;;
    *)
        echo "usage: bash deploy/kafka.sh up|down|status|install" >&2
        exit 2
        ;;
    esac
}

# Run unless sourced: deploy/kafka-secure.sh sources this file for its install, Java and lifecycle functions.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
