#!/usr/bin/env bash
# A secured local Kafka broker, beside the plain one of deploy/kafka.sh (same jars, same Java, same lifecycle),
# for running every role of branch-settlement under least privilege: TLS everywhere, SCRAM-SHA-512 users and
# client certificates, the StandardAuthorizer with nothing allowed unless an ACL allows it.
#
#   bash deploy/kafka-secure.sh up       make the CA, certificates and passwords if missing, start, wait until it answers
#   bash deploy/kafka-secure.sh down     stop it: SIGTERM, then SIGKILL after KAFKA_STOP_TIMEOUT_S
#   bash deploy/kafka-secure.sh status   listeners, principals, client settings files; exit 0 running, 3 not
#   bash deploy/kafka-secure.sh install  only resolve the jars into the cache (shared with deploy/kafka.sh)
#
# Listeners, all on 127.0.0.1 (the plain broker's 9092/9093 are left alone):
#   KAFKA_SECURE_PORT [9192]                         SASL_SSL, SCRAM-SHA-512 (no client certificate)
#   KAFKA_SECURE_SSL_PORT [KAFKA_SECURE_PORT + 1]    SSL, a client certificate is required; its CN is the principal
#   KAFKA_SECURE_CONTROLLER_PORT [KAFKA_SECURE_PORT + 2]  the KRaft controller, mutual TLS, the broker's certificate only
# KAFKA_SECURE_RUN_DIR [.run/kafka-secure]: broker state, and what the first start makes (mode 600, dirs 700):
#   tls/ca.pem                     the throwaway CA every client trusts (ssl.ca.location)
#   tls/<principal>.crt, .key      client certificates of admin, producer, processor, auditor (CN=<principal>)
#   secrets/<principal>.password   random SCRAM passwords, written into the storage when it is formatted
#   clients/<principal>.properties      librdkafka settings for the SASL_SSL listener (settle --kafka-config-file)
#   clients/<principal>-tls.properties  librdkafka settings for the SSL listener (client certificate)
# Principals: User:admin is a super user (topics, ACLs); producer, processor and auditor get only what
# `settle acls apply` grants them (deploy/acls.json). User:broker (the node's own certificate) is the other super user.
# KAFKA_HEAP_MB, KAFKA_UP_TIMEOUT_S, KAFKA_STOP_TIMEOUT_S, KAFKA_CACHE_DIR, KAFKA_M2_DIR as for deploy/kafka.sh.
#
# The data directory, the CA and the passwords survive `down`. `rm -rf .run/kafka-secure` (when stopped) starts
# over with new ones. Not a production setup: keys are unencrypted on disk, and the passwords are on the
# command line of the storage formatter for the second it runs (once, at the first start).
set -euo pipefail

KAFKA_PORT=${KAFKA_SECURE_PORT:-9192}
KAFKA_CONTROLLER_PORT=${KAFKA_SECURE_CONTROLLER_PORT:-$((KAFKA_PORT + 2))}
KAFKA_RUN_DIR=${KAFKA_SECURE_RUN_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.run/kafka-secure}
KAFKA_CLUSTER_ID=${KAFKA_SECURE_CLUSTER_ID:-}
KAFKA_ROLE=combined
KAFKA_SCRIPT_NAME=deploy/kafka-secure.sh
# shellcheck source=deploy/kafka.sh
source "$(dirname "${BASH_SOURCE[0]}")/kafka.sh"

readonly SSL_PORT=${KAFKA_SECURE_SSL_PORT:-$((PORT + 1))}
readonly TLS_DIR=$RUN_DIR/tls
readonly SECRETS_DIR=$RUN_DIR/secrets
readonly CLIENTS_DIR=$RUN_DIR/clients
readonly PRINCIPALS=(admin producer processor auditor)
# Subjects are O=branch-settlement-dev/CN=<name>: server-secure.properties maps exactly those to User:<name>.
readonly SUBJECT_ORG=branch-settlement-dev
readonly CERT_DAYS=365

fail() {
    echo "kafka-secure: $*" >&2
    exit 1
}

say() {
    echo "kafka-secure: $*"
}

require_port_free() {
    local port=$1 role=$2 holder
    port_open "$port" || return 0
    holder=$(who_listens "$port")
    fail "port $port ($role) on 127.0.0.1 is in use${holder:+ by $holder}, not by a broker this script started. Stop it, or choose other ports: KAFKA_SECURE_PORT=... (SASL_SSL; the SSL listener and the controller take the next two unless KAFKA_SECURE_SSL_PORT, KAFKA_SECURE_CONTROLLER_PORT say otherwise)."
}

require_openssl() {
    command -v openssl >/dev/null || fail "openssl is needed to make the broker's CA and certificates (e.g. apt-get install openssl)."
}

# -- TLS: a CA, the broker's certificate, one client certificate per principal -----------------------------

new_key() {
    # EC P-256, PKCS#8 PEM, unencrypted: what both librdkafka and Kafka's PEM key store read.
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

sign_cert() {
    local name=$1 extensions=$2 dir=$TLS_DIR
    new_key "$dir/$name.key"
    openssl req -new -key "$dir/$name.key" -subj "/O=$SUBJECT_ORG/CN=$name" -out "$dir/$name.csr" 2>/dev/null
    printf '%b' "$extensions" >"$dir/$name.ext"
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
        -set_serial "0x$(openssl rand -hex 16)" -days "$CERT_DAYS" -sha256 -extfile "$dir/$name.ext" \
        -out "$dir/$name.crt" 2>/dev/null
    rm -f "$dir/$name.csr" "$dir/$name.ext"
}

tls_current() {
    [[ -f $TLS_DIR/complete ]] || return 1
    # Still valid for a day at least, or made anew (clients find the new files at the same paths).
    openssl x509 -checkend 86400 -noout -in "$TLS_DIR/broker.crt" >/dev/null 2>&1
}

make_tls() {
    tls_current && return 0
    say "making a throwaway CA and certificates in $TLS_DIR"
    rm -rf "$TLS_DIR"
    mkdir -p "$TLS_DIR"
    chmod 700 "$TLS_DIR"
    local failed=0
    (
        set -e
        new_key "$TLS_DIR/ca.key"
        openssl req -x509 -new -key "$TLS_DIR/ca.key" -sha256 -days "$CERT_DAYS" \
            -subj "/O=$SUBJECT_ORG/CN=branch-settlement dev CA" \
            -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
            -out "$TLS_DIR/ca.pem" 2>/dev/null
        sign_cert broker 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n'
        for principal in "${PRINCIPALS[@]}"; do
            sign_cert "$principal" 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n'
        done
        cat "$TLS_DIR/broker.key" "$TLS_DIR/broker.crt" "$TLS_DIR/ca.pem" >"$TLS_DIR/broker-keystore.pem"
    ) || failed=1
    ((failed == 0)) || fail "openssl could not make the certificates in $TLS_DIR."
    chmod 600 "$TLS_DIR"/*.key "$TLS_DIR/broker-keystore.pem"
    chmod 644 "$TLS_DIR"/*.pem "$TLS_DIR"/*.crt
    chmod 600 "$TLS_DIR/broker-keystore.pem"
    date -u +%FT%TZ >"$TLS_DIR/complete"
}

# -- SCRAM passwords, and the settings files clients use -----------------------------------------------------

random_password() {
    local raw
    raw=$(head -c 48 /dev/urandom | base64 -w0 | tr -dc 'A-Za-z0-9')
    printf '%s\n' "${raw:0:32}"
}

password_of() {
    tr -d '\n' <"$SECRETS_DIR/$1.password"
}

make_passwords() {
    mkdir -p "$SECRETS_DIR"
    chmod 700 "$SECRETS_DIR"
    local principal missing=()
    for principal in "${PRINCIPALS[@]}"; do
        [[ -s $SECRETS_DIR/$principal.password ]] || missing+=("$principal")
    done
    ((${#missing[@]} == 0)) && return 0
    # The storage holds the SCRAM credentials made from these files when it was formatted: new passwords
    # would not match them.
    [[ -f $DATA_DIR/meta.properties ]] &&
        fail "the storage in $DATA_DIR was formatted with passwords that $SECRETS_DIR no longer has (${missing[*]}). Start over: bash $KAFKA_SCRIPT_NAME down && rm -rf $RUN_DIR"
    for principal in "${missing[@]}"; do
        (
            umask 077
            random_password >"$SECRETS_DIR/$principal.password"
        )
    done
}

write_client_configs() {
    mkdir -p "$CLIENTS_DIR"
    chmod 700 "$CLIENTS_DIR"
    local principal
    (
        umask 077
        for principal in "${PRINCIPALS[@]}"; do
            cat >"$CLIENTS_DIR/$principal.properties" <<EOF
# librdkafka settings of User:$principal on the SASL_SSL listener 127.0.0.1:$PORT (made by $KAFKA_SCRIPT_NAME).
# settle COMMAND --bootstrap-servers 127.0.0.1:$PORT --kafka-config-file $CLIENTS_DIR/$principal.properties
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.username=$principal
sasl.password=$(password_of "$principal")
ssl.ca.location=$TLS_DIR/ca.pem
EOF
            cat >"$CLIENTS_DIR/$principal-tls.properties" <<EOF
# librdkafka settings of User:$principal on the SSL listener 127.0.0.1:$SSL_PORT: its client certificate.
# settle COMMAND --bootstrap-servers 127.0.0.1:$SSL_PORT --kafka-config-file $CLIENTS_DIR/$principal-tls.properties
security.protocol=SSL
ssl.ca.location=$TLS_DIR/ca.pem
ssl.certificate.location=$TLS_DIR/$principal.crt
ssl.key.location=$TLS_DIR/$principal.key
EOF
        done
        # The Java tools' form, for the health check (and kafka-acls.sh, kafka-topics.sh --command-config).
        cat >"$CLIENTS_DIR/admin-java.properties" <<EOF
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(password_of admin)";
ssl.truststore.type=PEM
ssl.truststore.location=$TLS_DIR/ca.pem
EOF
    )
}

# -- what deploy/kafka.sh does, secured -------------------------------------------------------------------

# The plain template's node, topic and transaction settings, with its listener lines replaced by the secure ones.
write_config() {
    mkdir -p "$DATA_DIR"
    {
        sed -e "s|@PORT@|$PORT|g" -e "s|@CONTROLLER_PORT@|$CONTROLLER_PORT|g" -e "s|@DATA_DIR@|$DATA_DIR|g" \
            "$DEPLOY_DIR/server.properties" |
            grep -vE '^(listeners|advertised\.listeners|inter\.broker\.listener\.name|listener\.security\.protocol\.map)='
        sed -e "s|@PORT@|$PORT|g" -e "s|@SSL_PORT@|$SSL_PORT|g" -e "s|@CONTROLLER_PORT@|$CONTROLLER_PORT|g" \
            -e "s|@TLS_DIR@|$TLS_DIR|g" "$DEPLOY_DIR/server-secure.properties"
    } >"$CONFIG_FILE"
    chmod 600 "$CONFIG_FILE"
}

format_storage() {
    [[ -f $DATA_DIR/meta.properties ]] && return 0
    local out principal scram=()
    for principal in "${PRINCIPALS[@]}"; do
        scram+=(--add-scram "SCRAM-SHA-512=[name=$principal,password=$(password_of "$principal")]")
    done
    if ! out=$(run_kafka_class WARN kafka.tools.StorageTool format --cluster-id "${KAFKA_CLUSTER_ID:-$(random_cluster_id)}" \
        --config "$CONFIG_FILE" --ignore-formatted "${scram[@]}" 2>&1); then
        echo "kafka-secure: formatting KRaft storage in $DATA_DIR failed:" >&2
        echo "$out" | grep -vE '^\s+at ' | grep -v 'password=' | tail -n 8 >&2
        exit 1
    fi
}

# Healthy when admin, over SASL_SSL with the CA, gets the cluster id of our storage: TLS, SCRAM and the
# authorizer all answer.
broker_answers() {
    local answer
    port_open "$SSL_PORT" || return 1
    answer=$(timeout 30 "$JAVA" -Xmx128m -XX:TieredStopAtLevel=1 -cp "$LIB_DIR/*" \
        -Dlog4j2.configurationFile="$DEPLOY_DIR/log4j2.properties" -Dkafka.root.log.level=OFF \
        org.apache.kafka.tools.ClusterTool cluster-id --bootstrap-server "127.0.0.1:$PORT" \
        --command-config "$CLIENTS_DIR/admin-java.properties" 2>/dev/null) || return 1
    [[ $answer == *"Cluster ID: $(cluster_id_on_disk)"* ]]
}

eval "plain_$(declare -f cmd_up)"

cmd_up() {
    require_openssl
    if ! pid_alive >/dev/null; then
        require_port_free "$SSL_PORT" "SSL listener"
        mkdir -p "$RUN_DIR"
        chmod 700 "$RUN_DIR"
        make_tls
        make_passwords
    fi
    write_client_configs
    plain_cmd_up
}

cmd_status() {
    local pid
    if pid=$(pid_alive); then
        echo "kafka $KAFKA_VERSION (secured) running: pid $pid"
        echo "  SASL_SSL    127.0.0.1:$PORT  (SCRAM-SHA-512)"
        echo "  SSL         127.0.0.1:$SSL_PORT  (client certificate required)"
        echo "  controller  127.0.0.1:$CONTROLLER_PORT  (mutual TLS, broker only)"
        echo "  principals  ${PRINCIPALS[*]} (admin: super user)"
        echo "  CA          $TLS_DIR/ca.pem"
        echo "  clients     $CLIENTS_DIR/<principal>.properties, <principal>-tls.properties"
        echo "  cluster id  $(cluster_id_on_disk)"
        echo "  data        $DATA_DIR"
        echo "  log         $LOG_FILE"
        return 0
    fi
    if port_open "$PORT"; then
        local holder
        holder=$(who_listens "$PORT")
        echo "kafka-secure: not started by this script, but 127.0.0.1:$PORT is in use${holder:+ by $holder}"
    else
        echo "kafka-secure: not running (port $PORT free; cache $([[ -f $LIB_STAMP ]] && echo installed || echo empty))"
    fi
    return 3
}

secure_main() {
    case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    install) require_java && install ;;
    *)
        echo "usage: bash deploy/kafka-secure.sh up|down|status|install" >&2
        exit 2
        ;;
    esac
}

secure_main "$@"
