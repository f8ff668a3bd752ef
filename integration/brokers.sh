#!/usr/bin/env bash
# Starts, stops and inspects the real brokers the integration tests run against:
# RabbitMQ, Apache Kafka (KRaft), ElasticMQ (SQS), PostgreSQL and Redis, all on
# 127.0.0.1 with the addresses internal/testenv defaults to.
#
#   integration/brokers.sh up       install what is missing, start what is stopped,
#                                   wait until each answers a real client operation
#   integration/brokers.sh up rabbitmq4   the optional RabbitMQ 4.0 node alone (5682;
#                                   make test-rabbit4 runs the rabbit suite on it)
#   integration/brokers.sh up rabbitmq-cluster   three RabbitMQ 4.0 nodes as one
#                                   cluster (5691-5693; make test-cluster)
#   integration/brokers.sh up kafka-cluster   three Kafka nodes as one cluster
#                                   (19091-19093; make test-cluster)
#   integration/brokers.sh down     stop them (state is kept)
#   integration/brokers.sh status   one line per service; exit 1 if any is down
#   integration/brokers.sh restart kafka   stop and start the named services only (the
#                                   others keep running), and wait until they answer
#   integration/brokers.sh logs [service...]   the last lines of their logs
#
# Natively (the default) everything runs from Debian packages and Maven Central
# jars, with state and logs in .brokers/ at the repository root (FERRY_BROKERS_DIR
# overrides). With FERRY_BROKERS=docker and a running Docker engine it uses
# docker-compose.yml instead.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONF=$ROOT/integration/config
STATE=${FERRY_BROKERS_DIR:-$ROOT/.brokers}
SERVICES=(rabbitmq kafka sqs postgres redis)
KAFKA_CLUSTER_ID=ZmVycnlGZXJyeUthZmthMQ # any 16 bytes, base64url: a fixed test cluster
# The SCRAM user of Kafka's SASL_SSL listener: test credentials, the same as
# internal/testenv's KafkaSCRAMUser and KafkaSCRAMPassword.
KAFKA_SCRAM_USER=ferry
KAFKA_SCRAM_PASSWORD=ferry-scram-test
UP_TIMEOUT=${FERRY_BROKERS_TIMEOUT:-180}

log() { printf 'brokers: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
	cat >&2 <<EOF
usage: integration/brokers.sh up [OPTIONAL] | down [OPTIONAL] | status | restart service... | logs [service...] | kill-node CLUSTER [SECONDS]

  up      install what is missing, start the brokers, wait until each is ready
  up rabbitmq4  start only the optional RabbitMQ 4.0 node (AMQP on 5682, amqps
          on 5681), run from a Debian trixie root made once with debootstrap
  up rabbitmq-cluster  start only the optional cluster of three RabbitMQ 4.0
          nodes (AMQP on 5691-5693), from the same root
  up kafka-cluster  start only the optional cluster of three Kafka nodes
          (19091-19093, replication factor 3, min.insync.replicas 2)
  down    stop the brokers (their state stays in ${STATE/#$ROOT\//}); down rabbitmq4
          or down rabbitmq-cluster or down kafka-cluster stops only those
  status  print one line per broker; exit 1 if any is not ready
  restart stop and start the named brokers only, and wait until they are ready
  logs    print the last lines of each broker's log (or of those named)
  kill-node kafka-cluster|rabbitmq-cluster [SECONDS]  SIGKILL a random node of the
          cluster, and start it again SECONDS (5) later

services: ${SERVICES[*]}; optional: $RABBIT4 (make test-rabbit4 runs the rabbit
          suite on it), $RABBITC and $KAFKAC (make test-cluster)
environment: FERRY_BROKERS=docker uses docker-compose.yml when a Docker engine runs;
             FERRY_BROKERS_DIR moves the state folder (default .brokers/).
EOF
}

port_of() { # the client port of a service
	case $1 in
	rabbitmq) echo 5672 ;; kafka) echo 9092 ;; sqs) echo 9324 ;; postgres) echo 5432 ;; redis) echo 6379 ;;
	esac
}

ports_of() { # every port a service listens on
	case $1 in
	rabbitmq) echo 5672 5671 25672 ;; kafka) echo 9092 9093 9094 ;; *) port_of "$1" ;;
	esac
}

# ---------------------------------------------------------------- the Go checker

CHECKER=$STATE/bin/brokercheck

# build_checker builds integration/brokercheck, with -race where it
# can: then the client libraries it compiles are the ones `go test -race` needs.
build_checker() {
	command -v go >/dev/null || die "go is not on PATH (it builds the readiness checker integration/brokercheck)"
	mkdir -p "$STATE/bin"
	(
		cd "$ROOT"
		go build -race -o "$CHECKER" ./integration/brokercheck >"$STATE/bin/build.log" 2>&1 ||
			go build -o "$CHECKER" ./integration/brokercheck >>"$STATE/bin/build.log" 2>&1
	) || {
		cat "$STATE/bin/build.log" >&2
		die "could not build integration/brokercheck"
	}
}

# ---------------------------------------------------------------- processes

# pid_of SERVICE prints the pid of our running process of SERVICE, if any.
pid_of() {
	local f want
	case $1 in
	rabbitmq) f=$STATE/rabbitmq/rabbitmq.pid want=beam ;;
	kafka) f=$STATE/kafka/kafka.pid want=kafka.Kafka ;;
	sqs) f=$STATE/elasticmq/elasticmq.pid want=elasticmq ;;
	postgres) f=$STATE/postgres/data/postmaster.pid want=postgres ;;
	redis) f=$STATE/redis/redis.pid want=redis-server ;;
	esac
	pid_in "$f" "$want"
}

# started_pid SERVICE prints the pid the checker watches while SERVICE,
# just started, comes up: the pid that was started, as its start function
# wrote it. pid_of would check the process's command line, which is still
# the launching shell's until the child has exec'd (a restart under load
# handed the checker pid 0 and took a healthy Kafka for dead). For RabbitMQ
# it is the launcher's: the server writes its own pid file only once it has
# booted. Postgres' pg_ctl -w returns once the server runs, so its pid file
# is there.
started_pid() {
	local f
	case $1 in
	rabbitmq) f=$STATE/rabbitmq/launcher.pid ;;
	kafka) f=$STATE/kafka/kafka.pid ;;
	sqs) f=$STATE/elasticmq/elasticmq.pid ;;
	postgres) f=$STATE/postgres/data/postmaster.pid ;;
	redis) f=$STATE/redis/redis.pid ;;
	esac
	local pid
	pid=$(head -n1 "$f" 2>/dev/null | tr -dc 0-9)
	echo "${pid:-0}"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

port_owner() {
	local who=""
	command -v ss >/dev/null && who=$(ss -ltnpH "( sport = :$1 )" 2>/dev/null | grep -o 'users:(([^)]*))' | head -n1)
	echo "${who:-an unknown process}"
}

log_of() {
	case $1 in
	rabbitmq) echo "$STATE/rabbitmq/log/rabbit@localhost.log $STATE/rabbitmq/rabbitmq.out" ;;
	kafka) echo "$STATE/kafka/logs/server.log $STATE/kafka/kafka.out $STATE/kafka/logs/format.log" ;;
	sqs) echo "$STATE/elasticmq/elasticmq.log" ;;
	postgres) echo "$STATE/postgres/postgres.log" ;;
	redis) echo "$STATE/redis/redis.log" ;;
	rabbitmq4) echo "$STATE/rabbitmq4/root/ferry/log/rabbit4@localhost.log $STATE/rabbitmq4/rabbitmq.out $STATE/rabbitmq4/debootstrap.log" ;;
	rabbitmq-cluster) echo "$STATE"/rabbitmq4/root/ferry/c?/log/rabbitc?@localhost.log ;;
	kafka-cluster) echo "$STATE"/kafka-cluster/n?/logs/server.log ;;
	esac
}

tail_logs() {
	local svc=$1 n=${2:-40} f
	for f in $(log_of "$svc"); do
		[[ -s $f ]] || continue
		echo "----- $svc: last $n lines of ${f/#$ROOT\//}" >&2
		tail -n "$n" "$f" >&2
	done
}

# ---------------------------------------------------------------- installs

pg_bindir() {
	local d
	d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
	[[ -n $d && -x $d/postgres && -x $d/initdb ]] && echo "$d"
}

ensure_packages() {
	local pkgs=()
	[[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]] || pkgs+=(rabbitmq-server)
	command -v redis-server >/dev/null || pkgs+=(redis-server)
	pg_bindir >/dev/null || pkgs+=(postgresql)
	command -v java >/dev/null || pkgs+=(openjdk-17-jre-headless)
	command -v mvn >/dev/null || pkgs+=(maven)
	((${#pkgs[@]})) || return 0
	[[ $(id -u) == 0 ]] || die "missing packages: ${pkgs[*]}; install them (sudo apt-get install ${pkgs[*]}) or run as root"
	log "installing ${pkgs[*]} with apt-get"
	local made_policy=""
	if [[ ! -e /usr/sbin/policy-rc.d ]]; then
		# Keep the packages' own services from starting: the ports stay ours.
		printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
		chmod 755 /usr/sbin/policy-rc.d
		made_policy=1
	fi
	mkdir -p "$STATE"
	local rc=0
	{
		apt-get update -q &&
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}"
	} >"$STATE/apt.log" 2>&1 || rc=$?
	[[ -n $made_policy ]] && rm -f /usr/sbin/policy-rc.d
	if ((rc)); then
		tail -n 30 "$STATE/apt.log" >&2
		die "apt-get install ${pkgs[*]} failed (log: $STATE/apt.log)"
	fi
}

jars_exist() {
	local j
	while read -r j; do
		[[ -f $j ]] || return 1
	done < <(tr ':' '\n' <"$1")
}

# resolve_classpaths: the runtime classpaths of integration/kafka/pom.xml and
# integration/elasticmq/pom.xml, in one Maven run over integration/pom.xml,
# from Maven's cache when it has them; kept in the state folder by the poms' hash.
resolve_classpaths() {
	local d=$STATE/classpath sum
	sum=$(cat "$ROOT"/integration/pom.xml "$ROOT"/integration/kafka/pom.xml "$ROOT"/integration/elasticmq/pom.xml | sha256sum | cut -d' ' -f1)
	if [[ -f $d/sha && $(cat "$d/sha") == "$sum" ]] &&
		jars_exist "$d/kafka.classpath" && jars_exist "$d/elasticmq.classpath"; then
		return 0
	fi
	command -v mvn >/dev/null || die "mvn is not on PATH"
	mkdir -p "$d"
	rm -f "$d/sha"
	local mvn=(mvn -B -q -T 2 -f "$ROOT/integration/pom.xml" dependency:build-classpath -Dferry.classpath.dir="$d")
	# Offline first (a warm cache needs no network), then online.
	if ! "${mvn[@]}" -o >"$d/mvn.log" 2>&1; then
		"${mvn[@]}" >"$d/mvn.log" 2>&1 || {
			tail -n 30 "$d/mvn.log" >&2
			die "maven could not resolve integration/pom.xml (log: $d/mvn.log)"
		}
	fi
	echo "$sum" >"$d/sha"
}

# ---------------------------------------------------------------- state folder

# The postgres and rabbitmq users must reach the state folder. A repository
# under a private home (/root) is not reachable: keep the state in /var/tmp
# then, with a symlink from .brokers.
setup_state() {
	if [[ -L $STATE || -d $STATE ]]; then
		STATE=$(cd "$STATE" && pwd -P)
	elif [[ $(id -u) == 0 ]] && id postgres >/dev/null 2>&1 &&
		! runuser -u postgres -- test -x "$(dirname "$STATE")"; then
		local real
		real=/var/tmp/ferry-brokers-$(echo "$ROOT" | sha256sum | cut -c1-12)
		mkdir -p "$real"
		ln -sfn "$real" "$STATE"
		log "state folder: $real (the service users cannot reach $(dirname "$STATE"))"
		STATE=$real
	fi
	mkdir -p "$STATE"
	chmod 755 "$STATE"
	CHECKER=$STATE/bin/brokercheck
}

as_user() { # as_user USER CMD...: run CMD as USER when we are root
	local u=$1
	shift
	if [[ $(id -u) == 0 ]]; then
		(cd / && runuser -u "$u" -- "$@") # from a folder the user can read
	else
		"$@"
	fi
}

own() { # own USER DIR: let USER write DIR when we are root
	[[ $(id -u) == 0 ]] && chown -R "$1:$1" "$2" || true
}

# ---------------------------------------------------------------- services

start_redis() {
	local d=$STATE/redis
	mkdir -p "$d"
	# In the foreground of a background job, so that its pid file holds the
	# pid that was started before the server has written it itself.
	nohup redis-server --bind 127.0.0.1 --port 6379 --protected-mode yes \
		--save "" --appendonly no --daemonize no \
		--dir "$d" --pidfile "$d/redis.pid" --logfile "$d/redis.log" >/dev/null 2>&1 </dev/null &
	echo $! >"$d/redis.pid"
}

start_postgres() {
	local d=$STATE/postgres bin sock
	bin=$(pg_bindir) || die "no PostgreSQL server binaries under /usr/lib/postgresql"
	mkdir -p "$d/run"
	# A unix socket path must stay under ~107 bytes.
	sock=$d/run
	((${#sock} < 90)) || sock=/tmp/ferry-pg-$(echo "$ROOT" | sha256sum | cut -c1-12)
	mkdir -p "$sock"
	touch "$d/postgres.log"
	own postgres "$d"
	own postgres "$sock"
	if [[ ! -f $d/data/PG_VERSION ]]; then
		rm -rf "$d/data"
		as_user postgres "$bin/initdb" -D "$d/data" -U postgres -E UTF8 --locale=C.UTF-8 \
			--auth-local=trust --auth-host=scram-sha-256 --no-sync >"$d/initdb.log" 2>&1 || {
			cat "$d/initdb.log" >&2
			return 1
		}
	fi
	# Test settings: no durability needed, many connections allowed.
	as_user postgres "$bin/pg_ctl" -D "$d/data" -l "$d/postgres.log" -w -t 60 start \
		-o "-c listen_addresses=127.0.0.1 -p 5432 -c unix_socket_directories=$sock \
-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" >/dev/null || return 1
	local psql=("$bin/psql" -h "$sock" -p 5432 -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA)
	if [[ $(as_user postgres "${psql[@]}" -c "select 1 from pg_roles where rolname='ferry'") != 1 ]]; then
		as_user postgres "${psql[@]}" -c "create role ferry login createdb password 'ferry'" >/dev/null
	fi
	if [[ $(as_user postgres "${psql[@]}" -c "select 1 from pg_database where datname='ferry'") != 1 ]]; then
		as_user postgres "${psql[@]}" -c "create database ferry owner ferry" >/dev/null
	fi
}

rabbit_env() {
	local d=$STATE/rabbitmq
	export HOME=/var/lib/rabbitmq
	export RABBITMQ_NODENAME=rabbit@localhost
	export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
	export RABBITMQ_NODE_PORT=5672
	export RABBITMQ_DIST_PORT=25672
	export RABBITMQ_MNESIA_BASE=$d/mnesia
	export RABBITMQ_LOG_BASE=$d/log
	export RABBITMQ_PID_FILE=$d/rabbitmq.pid
	export RABBITMQ_CONFIG_FILE=$d/rabbitmq.conf
	export RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins
	export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
	export ERL_EPMD_ADDRESS=127.0.0.1
}

# The amqps listener's certificate: self-signed for 127.0.0.1 and localhost,
# made once, readable by the rabbitmq user. Clients trust tls/cert.pem.
rabbit_tls() {
	local d=$STATE/rabbitmq/tls
	[[ -s $d/cert.pem && -s $d/key.pem ]] && return 0
	command -v openssl >/dev/null || die "openssl is needed for the amqps listener's certificate"
	mkdir -p "$d"
	openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=127.0.0.1 \
		-addext subjectAltName=IP:127.0.0.1,DNS:localhost \
		-keyout "$d/key.pem" -out "$d/cert.pem" >"$d/openssl.log" 2>&1 || {
		cat "$d/openssl.log" >&2
		die "could not make the amqps certificate"
	}
	chmod 644 "$d/cert.pem"
	chmod 640 "$d/key.pem"
	own rabbitmq "$d"
}

# rabbit_conf writes the node's rabbitmq.conf from integration/config.
rabbit_conf() {
	sed "s|@STATE@|$STATE|g" "$CONF/rabbitmq.conf" >"$1"
}

rabbitmqctl_() { # rabbitmqctl against our node, as its user
	(
		rabbit_env
		as_user rabbitmq /usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBITMQ_NODENAME" -q "$@"
	)
}

# A vhost of its own and a user who may use only it, for the tests that show
# a restricted user is refused elsewhere: ferry-tenant / ferry-tenant-secret
# on vhost ferry-tenant. Idempotent: run after every up.
RABBIT_TENANT=ferry-tenant
RABBIT_TENANT_PASSWORD=ferry-tenant-secret
# rabbit_tenant [CTL]: CTL is the rabbitmqctl function of the node (default
# the 3.10 node's).
rabbit_tenant() {
	local ctl=${1:-rabbitmqctl_}
	"$ctl" list_vhosts name | grep -x "$RABBIT_TENANT" >/dev/null || "$ctl" add_vhost "$RABBIT_TENANT" >/dev/null
	if ! "$ctl" list_users | awk '{print $1}' | grep -x "$RABBIT_TENANT" >/dev/null; then
		"$ctl" add_user "$RABBIT_TENANT" "$RABBIT_TENANT_PASSWORD" >/dev/null
	fi
	"$ctl" set_permissions -p "$RABBIT_TENANT" "$RABBIT_TENANT" '.*' '.*' '.*' >/dev/null
}

# kafka_extras restarts a running Kafka started with other settings (its
# server.properties differs from what kafka-server.properties renders to).
kafka_extras() {
	local d=$STATE/kafka want
	[[ -f $d/server.properties ]] || return 0
	want=$(mktemp)
	sed "s|@STATE@|$STATE|g" "$CONF/kafka-server.properties" >"$want"
	if ! cmp -s "$want" "$d/server.properties"; then
		log "kafka: restarting it with the new configuration"
		stop_service kafka >/dev/null
		start_kafka || { rm -f "$want"; tail_logs kafka 30; die "kafka did not start again"; }
		"$CHECKER" -wait "${UP_TIMEOUT}s" $(versions) $(kafka_ca_flag) -pid="kafka=$(cat "$d/kafka.pid")" kafka >/dev/null ||
			{ rm -f "$want"; tail_logs kafka 30; die "kafka did not come back after the restart"; }
	fi
	rm -f "$want"
}

# rabbit_extras brings a running node up to date: a node started before the
# amqps listener existed (its rabbitmq.conf differs) is restarted with it,
# and the restricted user is made.
rabbit_extras() {
	local d=$STATE/rabbitmq want
	rabbit_tls
	want=$(mktemp)
	rabbit_conf "$want"
	if ! cmp -s "$want" "$d/rabbitmq.conf"; then
		log "rabbitmq: restarting it with the new configuration (amqps on 5671)"
		stop_service rabbitmq >/dev/null
		start_rabbitmq
		"$CHECKER" -wait "${UP_TIMEOUT}s" -pid="rabbitmq=$(cat "$d/launcher.pid")" rabbitmq >/dev/null ||
			{ rm -f "$want"; tail_logs rabbitmq 30; die "rabbitmq did not come back after the restart"; }
	fi
	rm -f "$want"
	rabbit_tenant
	port_open 5671 || die "rabbitmq: the amqps listener on 127.0.0.1:5671 is not open (logs: integration/brokers.sh logs rabbitmq)"
}

start_rabbitmq() {
	local d=$STATE/rabbitmq
	mkdir -p "$d/mnesia" "$d/log"
	rabbit_tls
	rabbit_conf "$d/rabbitmq.conf"
	cp "$CONF/rabbitmq-enabled-plugins" "$d/enabled_plugins"
	rm -f "$d/rabbitmq.pid"
	own rabbitmq "$d"
	(
		rabbit_env
		cd "$d"
		as_user rabbitmq nohup /usr/lib/rabbitmq/bin/rabbitmq-server >"$d/rabbitmq.out" 2>&1 </dev/null &
		echo $! >"$d/launcher.pid"
	)
}

# ---------------------------------------------------------------- RabbitMQ 4.0

# rabbitmq4 is a RabbitMQ 4.0 node beside the 3.10 one, for make test-rabbit4:
# Debian bookworm ships only 3.10 (its Erlang 25 is too old for 4.x), so the
# node runs from a minimal Debian trixie root (RabbitMQ 4.0.5, Erlang 27)
# made with debootstrap and entered with chroot. It is started only when
# named (up rabbitmq4); status, down and logs know it. The root is made once
# a machine (about 40-90 s, 370 MB), kept as a tarball in RABBIT4_CACHE and
# unpacked into the state folder; the node's own files (configuration,
# certificate, data, logs) live in /ferry inside the root. It registers with
# the host's epmd, so its node name differs from the 3.10 node's.
RABBIT4=rabbitmq4
RABBIT4_NODE=rabbit4@localhost
RABBIT4_PORT=5682     # AMQP
RABBIT4_TLS_PORT=5681 # amqps, with the 3.10 node's certificate
RABBIT4_DIST_PORT=25682
RABBIT4_CACHE=${FERRY_RABBIT4_CACHE:-/var/cache/ferry/rabbitmq4-trixie-root.tar}
DEBIAN_MIRROR=${FERRY_DEBIAN_MIRROR:-http://deb.debian.org/debian}

rabbit4_root() { echo "$STATE/$RABBIT4/root"; }

# pid_in FILE WANT prints the pid FILE holds when that process runs and
# its command line holds WANT.
pid_in() {
	local pid
	[[ -s $1 ]] || return 1
	pid=$(head -n1 "$1" | tr -dc 0-9)
	[[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
	tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2" || return 1
	echo "$pid"
}

# any_running PIDFN N...: whether PIDFN finds a running process for any N.
any_running() {
	local fn=$1 n
	shift
	for n; do
		"$fn" "$n" >/dev/null && return 0
	done
	return 1
}

rabbit4_pid() { pid_in "$(rabbit4_root)/ferry/rabbitmq.pid" beam; } # the 4.0 node's, if it runs

# rabbit4_make_root makes the trixie root's tarball with debootstrap, once.
rabbit4_make_root() {
	[[ -s $RABBIT4_CACHE ]] && return 0
	local tmp log=$STATE/$RABBIT4/debootstrap.log
	if ! command -v debootstrap >/dev/null; then
		log "$RABBIT4: installing debootstrap with apt-get"
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap; } \
			>"$STATE/$RABBIT4/apt.log" 2>&1 || {
			tail -n 20 "$STATE/$RABBIT4/apt.log" >&2
			die "$RABBIT4: apt-get install debootstrap failed"
		}
	fi
	log "$RABBIT4: making a Debian trixie root with rabbitmq-server from $DEBIAN_MIRROR (debootstrap, about a minute, 370 MB)"
	tmp=$(mktemp -d /var/tmp/ferry-trixie.XXXXXX)
	debootstrap --variant=minbase --include=rabbitmq-server trixie "$tmp/root" "$DEBIAN_MIRROR" >"$log" 2>&1 || {
		tail -n 20 "$log" >&2
		rm -rf "$tmp"
		die "$RABBIT4: debootstrap failed (log: $log)"
	}
	mkdir -p "$(dirname "$RABBIT4_CACHE")"
	tar --numeric-owner -C "$tmp/root" -cf "$RABBIT4_CACHE.part" . && mv "$RABBIT4_CACHE.part" "$RABBIT4_CACHE"
	rm -rf "$tmp"
}

# rabbit4_root_ready unpacks the root into the state folder once.
rabbit4_root_ready() {
	local r
	r=$(rabbit4_root)
	[[ -f $r/.ferry-root && -x $r/usr/lib/rabbitmq/bin/rabbitmq-server ]] && return 0
	[[ $(id -u) == 0 ]] || die "$RABBIT4: RabbitMQ 4.0 runs from a Debian root entered with chroot, which needs root"
	mkdir -p "$STATE/$RABBIT4"
	rabbit4_make_root
	rabbit4_unmount
	rm -rf --one-file-system "$r"
	mkdir -p "$r"
	tar --numeric-owner -C "$r" -xf "$RABBIT4_CACHE" || die "$RABBIT4: could not unpack $RABBIT4_CACHE"
	# The root's rabbitmq user takes the host's uid and gid when the host
	# has one (the 3.10 node's): its own (101) may be another host user's,
	# whose name ps would show and whose files it could touch.
	local hu hg
	if hu=$(id -u rabbitmq 2>/dev/null) && hg=$(id -g rabbitmq 2>/dev/null); then
		{ chroot "$r" groupmod -g "$hg" rabbitmq && chroot "$r" usermod -u "$hu" -g "$hg" rabbitmq &&
			chroot "$r" chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq /etc/rabbitmq; } >/dev/null 2>&1 ||
			log "$RABBIT4: the root's rabbitmq user keeps its own uid (the host's $hu is taken there): ps may show its nodes under another name"
	fi
	touch "$r/.ferry-root"
}

rabbit4_unmount() {
	local r
	r=$(rabbit4_root)
	if mountpoint -q "$r/proc" 2>/dev/null; then umount "$r/proc" 2>/dev/null || umount -l "$r/proc" || true; fi
	! mountpoint -q "$r/proc" 2>/dev/null || die "could not unmount $r/proc"
}

# root_in [--nohup] NODE PORT DIST_PORT DIR CMD...: run CMD inside the root
# as the rabbitmq user, with the environment of the node named NODE, its
# AMQP and distribution ports and its files in DIR (a path in the root).
root_in() {
	local pre=()
	if [[ $1 == --nohup ]]; then
		pre=(nohup)
		shift
	fi
	local node=$1 port=$2 dist=$3 dir=$4
	shift 4
	"${pre[@]}" chroot "$(rabbit4_root)" /usr/sbin/runuser -u rabbitmq -- env -i \
		HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
		RABBITMQ_NODENAME="$node" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
		RABBITMQ_NODE_PORT="$port" RABBITMQ_DIST_PORT="$dist" \
		RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" \
		RABBITMQ_PID_FILE="$dir/rabbitmq.pid" RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
		RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
		"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}" \
		ERL_EPMD_ADDRESS=127.0.0.1 "$@"
}

rabbit4ctl_() {
	root_in "$RABBIT4_NODE" "$RABBIT4_PORT" "$RABBIT4_DIST_PORT" /ferry \
		/usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBIT4_NODE" -q "$@"
}

# rabbit4_ctl_wrapper writes the CLI for the tests (FERRY_RABBITMQCTL): the
# 4.0 nodes' own rabbitmqctl, run inside the root, for any node (-n NODE).
rabbit4_ctl_wrapper() {
	cat >"$STATE/$RABBIT4/rabbitmqctl" <<EOS
#!/bin/sh
# rabbitmqctl of the RabbitMQ 4.0 nodes (integration/brokers.sh up rabbitmq4,
# up rabbitmq-cluster), run inside their Debian root: rabbitmqctl -n NODE ...
exec chroot '$(rabbit4_root)' /usr/sbin/runuser -u rabbitmq -- env -i HOME=/var/lib/rabbitmq \\
	PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 ERL_EPMD_ADDRESS=127.0.0.1 \\
	/usr/lib/rabbitmq/bin/rabbitmqctl "\$@"
EOS
	chmod 755 "$STATE/$RABBIT4/rabbitmqctl"
}

start_rabbitmq4() {
	local r d
	rabbit4_root_ready
	r=$(rabbit4_root) d=$(rabbit4_root)/ferry
	mkdir -p "$d/mnesia" "$d/log" "$d/tls"
	rabbit_tls
	cp "$STATE/rabbitmq/tls/cert.pem" "$STATE/rabbitmq/tls/key.pem" "$d/tls/"
	# The 3.10 node's configuration on the 4.0 node's ports, files under /ferry.
	sed -e "s|@STATE@/rabbitmq/tls|/ferry/tls|g" -e "s|:5672$|:$RABBIT4_PORT|" -e "s|:5671$|:$RABBIT4_TLS_PORT|" \
		"$CONF/rabbitmq.conf" >"$d/rabbitmq.conf"
	cp "$CONF/rabbitmq-enabled-plugins" "$d/enabled_plugins"
	rm -f "$d/rabbitmq.pid"
	chroot "$r" chown -R rabbitmq:rabbitmq /ferry
	mountpoint -q "$r/proc" || mount -t proc proc "$r/proc" || die "$RABBIT4: could not mount proc in its root"
	rabbit4_ctl_wrapper
	(
		cd /
		root_in --nohup "$RABBIT4_NODE" "$RABBIT4_PORT" "$RABBIT4_DIST_PORT" /ferry \
			/usr/lib/rabbitmq/bin/rabbitmq-server >"$STATE/$RABBIT4/rabbitmq.out" 2>&1 </dev/null &
		echo $! >"$STATE/$RABBIT4/launcher.pid"
	)
}

# rabbit4_check waits until the 4.0 node answers AMQP (the checker's
# rabbitmq check on its port) and prints the checker's line under its name.
rabbit4_check() {
	local out rc=0 pid=${1:-}
	out=$(FERRY_AMQP_URL="amqp://guest:guest@127.0.0.1:$RABBIT4_PORT/" "$CHECKER" ${pid:+-wait "${UP_TIMEOUT}s" -pid="rabbitmq=$pid"} rabbitmq) || rc=$?
	sed -n "s/^rabbitmq /$RABBIT4/p" <<<"$out"
	return $rc
}

stop_rabbitmq4() {
	local pid
	if pid=$(rabbit4_pid); then
		kill -TERM "$pid" 2>/dev/null || true
		await_stop "$RABBIT4" "$pid"
	fi
	rabbitc_running || rabbit4_unmount
}

# up_rabbitmq4: start the 4.0 node unless it runs, wait until it answers, and
# give it the restricted user of the 3.10 node.
up_rabbitmq4() {
	setup_state
	build_checker
	if ! rabbit4_pid >/dev/null; then
		local port
		for port in $RABBIT4_PORT $RABBIT4_TLS_PORT $RABBIT4_DIST_PORT; do
			port_open "$port" && die "port $port ($RABBIT4) is already in use by $(port_owner "$port"), not by integration/brokers.sh; stop it first"
		done
		start_rabbitmq4
		rabbit4_check "$(cat "$STATE/$RABBIT4/launcher.pid")" || {
			tail_logs "$RABBIT4" 30
			die "$RABBIT4 is not ready (logs: integration/brokers.sh logs $RABBIT4)"
		}
	else
		echo "$(rabbit4_check) (already running)"
	fi
	rabbit_tenant rabbit4ctl_
	port_open "$RABBIT4_TLS_PORT" || die "$RABBIT4: the amqps listener on 127.0.0.1:$RABBIT4_TLS_PORT is not open"
}

# rabbitmq-cluster is a cluster of three RabbitMQ 4.0 nodes in the same
# Debian root as rabbitmq4, for make test-cluster: rabbitc1@localhost,
# rabbitc2@localhost and rabbitc3@localhost, AMQP on 5691-5693 (guest/guest
# from loopback), Erlang distribution on 25691-25693, each node's files in
# /ferry/cN. They find each other through classic_config peer discovery at
# their first boot; a node started again (after a kill) rejoins with its
# data. `up rabbitmq-cluster` starts the nodes that are not running and
# waits until all three are running members of one cluster.
RABBITC=rabbitmq-cluster
RABBITC_NODES=(1 2 3)

rabbitc_pid() { pid_in "$(rabbit4_root)/ferry/c$1/rabbitmq.pid" beam; } # node N's, if it runs

# rabbitc_in [--nohup] N CMD...: root_in with node N's environment.
rabbitc_in() {
	local pre=()
	if [[ $1 == --nohup ]]; then
		pre=(--nohup)
		shift
	fi
	local n=$1
	shift
	root_in "${pre[@]}" "rabbitc$n@localhost" $((5690 + n)) $((25690 + n)) "/ferry/c$n" "$@"
}

start_rabbitc_node() {
	local n=$1 d
	d=$(rabbit4_root)/ferry/c$n
	mkdir -p "$d/mnesia" "$d/log"
	cat >"$d/rabbitmq.conf" <<EOC
listeners.tcp.1 = 127.0.0.1:$((5690 + n))
loopback_users.guest = true
default_user = guest
default_pass = guest
log.console = false
log.file.level = info
cluster_formation.peer_discovery_backend = classic_config
cluster_formation.classic_config.nodes.1 = rabbitc1@localhost
cluster_formation.classic_config.nodes.2 = rabbitc2@localhost
cluster_formation.classic_config.nodes.3 = rabbitc3@localhost
EOC
	cp "$CONF/rabbitmq-enabled-plugins" "$d/enabled_plugins"
	rm -f "$d/rabbitmq.pid"
	chroot "$(rabbit4_root)" chown -R rabbitmq:rabbitmq "/ferry/c$n"
	(
		cd /
		rabbitc_in --nohup "$n" /usr/lib/rabbitmq/bin/rabbitmq-server >"$d/rabbitmq.out" 2>&1 </dev/null &
		echo $! >"$d/launcher.pid"
	)
}

stop_rabbitmq_cluster() {
	local n pid
	for n in "${RABBITC_NODES[@]}"; do
		pid=$(rabbitc_pid "$n") || continue
		kill -TERM "$pid" 2>/dev/null || true
		await_stop "$RABBITC node $n" "$pid"
	done
	rabbit4_pid >/dev/null || rabbit4_unmount
}

rabbitc_running() { any_running rabbitc_pid "${RABBITC_NODES[@]}"; }

# up_rabbitmq_cluster: start the nodes that do not run, wait until each
# answers AMQP and all three run as one cluster.
up_rabbitmq_cluster() {
	setup_state
	build_checker
	rabbit4_root_ready
	local r n port started=()
	r=$(rabbit4_root)
	mountpoint -q "$r/proc" || mount -t proc proc "$r/proc" || die "$RABBITC: could not mount proc in its root"
	rabbit4_ctl_wrapper
	# With no node running, the cluster is made anew: three nodes of a
	# cluster formed before, started together, can fail to boot (Mnesia's
	# protocol negotiation between them is killed), and a test cluster
	# keeps nothing worth that. A node started while the others run (after
	# a kill) keeps its data and rejoins.
	if ! rabbitc_running; then
		rm -rf --one-file-system "$r"/ferry/c?/mnesia
	fi
	for n in "${RABBITC_NODES[@]}"; do
		rabbitc_pid "$n" >/dev/null && continue
		for port in $((5690 + n)) $((25690 + n)); do
			port_open "$port" && die "port $port ($RABBITC node $n) is already in use by $(port_owner "$port"), not by integration/brokers.sh"
		done
		start_rabbitc_node "$n"
		started+=("$n")
	done
	local out rc=0
	for n in "${RABBITC_NODES[@]}"; do
		local watch=()
		[[ " ${started[*]} " == *" $n "* ]] && watch=(-wait "${UP_TIMEOUT}s" -pid="rabbitmq=$(cat "$r/ferry/c$n/launcher.pid")")
		out=$(FERRY_AMQP_URL="amqp://guest:guest@127.0.0.1:$((5690 + n))/" "$CHECKER" "${watch[@]}" rabbitmq) || rc=1
		sed -n "s/^rabbitmq /rabbitc$n /p" <<<"$out"
	done
	if ((rc)); then
		tail -n 30 "$r/ferry/c1/log/rabbitc1@localhost.log" >&2 || true
		die "$RABBITC: not every node is ready (logs in $r/ferry/cN/log)"
	fi
	rabbitc_in 1 /usr/lib/rabbitmq/bin/rabbitmqctl -n rabbitc1@localhost -q await_online_nodes 3 --timeout 120000 >/dev/null ||
		die "$RABBITC: the three nodes did not form one cluster within 120 s"
	echo "$RABBITC: 3 nodes running as one cluster (amqp://guest:guest@127.0.0.1:5691,127.0.0.1:5692,127.0.0.1:5693/)"
}

jvm_start() { # jvm_start PIDFILE OUT ARGS...: start java in the background
	local pidfile=$1 out=$2
	shift 2
	nohup java "$@" >"$out" 2>&1 </dev/null &
	echo $! >"$pidfile"
}

start_kafka() {
	local d=$STATE/kafka cp
	cp=$(cat "$STATE/classpath/kafka.classpath")
	mkdir -p "$d/data" "$d/logs"
	sed "s|@STATE@|$STATE|g" "$CONF/kafka-server.properties" >"$d/server.properties"
	cp "$CONF/kafka-log4j2.properties" "$d/log4j2.properties"
	local jvm=(-Xms256m -Xmx512m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
		-Djava.awt.headless=true -Dkafka.logs.dir="$d/logs" -Dlog4j2.configurationFile="$d/log4j2.properties")
	kafka_tls "$d/tls" || return 1
	if [[ ! -f $d/data/meta.properties ]]; then
		# The SCRAM user of the SASL_SSL listener is created with the log dir;
		# on one formatted before, brokercheck creates it through the admin API.
		java "${jvm[@]}" -cp "$cp" kafka.tools.StorageTool format -t "$KAFKA_CLUSTER_ID" \
			-c "$d/server.properties" --standalone -g \
			--add-scram "SCRAM-SHA-512=[name=$KAFKA_SCRAM_USER,password=$KAFKA_SCRAM_PASSWORD]" \
			>"$d/logs/format.log" 2>&1 || return 1
	fi
	jvm_start "$d/kafka.pid" "$d/kafka.out" "${jvm[@]}" -cp "$cp" kafka.Kafka "$d/server.properties"
}

# kafka_tls DIR: a self-signed certificate for 127.0.0.1, made once. server.pem
# (PKCS#8 key, then the certificate) is the broker's PEM keystore; ca.pem is
# what clients trust (FERRY_KAFKA_CA).
kafka_tls() {
	local dir=$1
	[[ -s $dir/server.pem && -s $dir/ca.pem ]] && return 0
	command -v openssl >/dev/null || die "openssl is not on PATH (it makes the Kafka SASL_SSL certificate)"
	mkdir -p "$dir"
	openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=127.0.0.1 \
		-addext subjectAltName=IP:127.0.0.1 -keyout "$dir/key.pem" -out "$dir/ca.pem" >"$dir/openssl.log" 2>&1 || {
		cat "$dir/openssl.log" >&2
		return 1
	}
	openssl pkcs8 -topk8 -nocrypt -in "$dir/key.pem" -out "$dir/key8.pem" 2>>"$dir/openssl.log" || return 1
	cat "$dir/key8.pem" "$dir/ca.pem" >"$dir/server.pem"
	rm -f "$dir/key.pem" "$dir/key8.pem"
	chmod 600 "$dir/server.pem"
}

start_sqs() {
	local d=$STATE/elasticmq
	mkdir -p "$d"
	# Its queues and messages persist in $d (queues-storage, messages-storage).
	# It keeps every message in its heap too: 1 GiB holds a 100k-order chaos
	# backlog beside the benchmarks' queues (256 MiB ran out of memory).
	sed "s|@STATE@|$d|g" "$CONF/elasticmq.conf" >"$d/elasticmq.conf"
	jvm_start "$d/elasticmq.pid" "$d/elasticmq.log" -Xms64m -Xmx1g -XX:+UseSerialGC -XX:+ExitOnOutOfMemoryError \
		-Djava.awt.headless=true -Dconfig.file="$d/elasticmq.conf" \
		-cp "$(cat "$STATE/classpath/elasticmq.classpath")" org.elasticmq.server.Main
}

stop_service() {
	local svc=$1 pid
	pid=$(pid_of "$svc") || return 0
	case $svc in
	postgres) as_user postgres "$(pg_bindir)/pg_ctl" -D "$STATE/postgres/data" -m fast -w -t 30 stop >/dev/null 2>&1 || true ;;
	*) kill -TERM "$pid" 2>/dev/null || true ;;
	esac
	await_stop "$svc" "$pid"
}

# await_stop NAME PID: wait up to 30 s for PID, asked to stop, to end;
# kill it then; say NAME stopped.
await_stop() {
	local i
	for ((i = 0; i < 300; i++)); do
		kill -0 "$2" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$2" 2>/dev/null; then
		log "$1 (pid $2) did not stop in 30 s: killing it"
		kill -KILL "$2" 2>/dev/null || true
	fi
	echo "$1 stopped"
}

versions() { # versions for the checker's lines, from what we run
	local v
	if [[ -s $STATE/classpath/kafka.classpath ]]; then
		v=$(tr ':' '\n' <"$STATE/classpath/kafka.classpath" | sed -n 's|.*/kafka_2.13-\(.*\)\.jar$|\1|p' | head -n1)
		[[ -n $v ]] && echo "-version=kafka=$v"
	fi
	if [[ -s $STATE/classpath/elasticmq.classpath ]]; then
		v=$(tr ':' '\n' <"$STATE/classpath/elasticmq.classpath" | sed -n 's|.*/elasticmq-server_2.13-\(.*\)\.jar$|\1|p' | head -n1)
		[[ -n $v ]] && echo "-version=sqs=elasticmq-$v"
	fi
	return 0
}

kafka_ca_flag() { # the checker also checks the SASL_SSL listener when it can trust it
	[[ -s $STATE/kafka/tls/ca.pem ]] && echo "-kafka-ca=$STATE/kafka/tls/ca.pem"
	return 0
}

# ---------------------------------------------------------------- Kafka cluster

# kafka-cluster is three Apache Kafka nodes as one cluster, for make
# test-cluster: each a broker and a controller (KRaft quorum of three),
# clients on 127.0.0.1:19091-19093, controllers on 19191-19193, replication
# factor 3 and min.insync.replicas 2 (integration/config/kafka-cluster.properties),
# the same jars as kafka, files in kafka-cluster/nN. Started only when named;
# a node killed by a test is started again by the next up.
KAFKAC=kafka-cluster
KAFKAC_NODES=(1 2 3)
KAFKAC_CLUSTER_ID=ZmVycnlLYWZrYUNsdXN0cg # 16 bytes, base64url: a fixed test cluster

kafkac_pid() { pid_in "$STATE/$KAFKAC/n$1/kafka.pid" kafka.Kafka; } # node N's, if it runs
kafkac_running() { any_running kafkac_pid "${KAFKAC_NODES[@]}"; }

start_kafkac_node() {
	local n=$1 d cp
	d=$STATE/$KAFKAC/n$n
	cp=$(cat "$STATE/classpath/kafka.classpath")
	mkdir -p "$d/data" "$d/logs"
	sed -e "s|@STATE@|$STATE|g" -e "s|@N@|$n|g" "$CONF/kafka-cluster.properties" >"$d/server.properties"
	cp "$CONF/kafka-log4j2.properties" "$d/log4j2.properties"
	local jvm=(-Xms256m -Xmx512m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
		-Djava.awt.headless=true -Dkafka.logs.dir="$d/logs" -Dlog4j2.configurationFile="$d/log4j2.properties")
	if [[ ! -f $d/data/meta.properties ]]; then
		java "${jvm[@]}" -cp "$cp" kafka.tools.StorageTool format -t "$KAFKAC_CLUSTER_ID" \
			-c "$d/server.properties" >"$d/logs/format.log" 2>&1 || {
			cat "$d/logs/format.log" >&2
			return 1
		}
	fi
	jvm_start "$d/kafka.pid" "$d/kafka.out" "${jvm[@]}" -cp "$cp" kafka.Kafka "$d/server.properties"
}

stop_kafka_cluster() {
	local n pid pids=()
	for n in "${KAFKAC_NODES[@]}"; do # all asked at once, then waited for
		pid=$(kafkac_pid "$n") || continue
		pids[n]=$pid
		kill -TERM "$pid" 2>/dev/null || true
	done
	for n in "${!pids[@]}"; do
		await_stop "$KAFKAC node $n" "${pids[n]}"
	done
}

# up_kafka_cluster: start the nodes that do not run and wait until each
# answers (the checker's kafka check on its port).
up_kafka_cluster() {
	setup_state
	command -v java >/dev/null || ensure_packages
	build_checker &
	local build_pid=$!
	resolve_classpaths
	wait "$build_pid" || exit 1
	local n port started=()
	for n in "${KAFKAC_NODES[@]}"; do
		kafkac_pid "$n" >/dev/null && continue
		for port in $((19090 + n)) $((19190 + n)); do
			port_open "$port" && die "port $port ($KAFKAC node $n) is already in use by $(port_owner "$port"), not by integration/brokers.sh"
		done
		start_kafkac_node "$n" || die "$KAFKAC: node $n did not start (logs in $STATE/$KAFKAC/n$n/logs)"
		started+=("$n")
	done
	local out rc=0
	for n in "${KAFKAC_NODES[@]}"; do
		local watch=()
		[[ " ${started[*]} " == *" $n "* ]] && watch=(-wait "${UP_TIMEOUT}s" -pid="kafka=$(cat "$STATE/$KAFKAC/n$n/kafka.pid")")
		out=$(FERRY_KAFKA_BROKERS="127.0.0.1:$((19090 + n))" "$CHECKER" $(versions) "${watch[@]}" kafka) || rc=1
		sed -n "s/^kafka    /kafkac$n  /p" <<<"$out"
	done
	if ((rc)); then
		tail -n 30 "$STATE/$KAFKAC"/n?/logs/server.log >&2 || true
		die "$KAFKAC: not every node is ready (logs in $STATE/$KAFKAC/nN/logs)"
	fi
	echo "$KAFKAC: 3 nodes (kafka://127.0.0.1:19091,127.0.0.1:19092,127.0.0.1:19093)"
}

# ---------------------------------------------------------------- docker

use_docker() {
	[[ ${FERRY_BROKERS:-} == docker ]] || return 1
	if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
		return 0
	fi
	log "FERRY_BROKERS=docker, but no Docker engine answers: starting the brokers natively"
	return 1
}

docker_compose() { docker compose -f "$ROOT/docker-compose.yml" "$@"; }

# docker_services OPTIONAL: the services of docker-compose.yml's profile
# "cluster" that stand for an optional broker of brokers.sh.
docker_services() {
	case $1 in
	"$RABBIT4") echo rabbitmq4 ;;
	"$RABBITC") echo rabbitc1 rabbitc2 rabbitc3 ;;
	"$KAFKAC") echo kafkac1 kafkac2 kafkac3 ;;
	*) die "name no service, or one of the optional ones alone: $RABBIT4, $RABBITC, $KAFKAC" ;;
	esac
}

# docker_kill_node CLUSTER SECONDS: kill-node on docker-compose.yml's
# containers: SIGKILL one of the three, chosen at random, and start it again.
docker_kill_node() {
	local svc=$1 secs=$2 nodes running=() n
	[[ $svc == "$KAFKAC" || $svc == "$RABBITC" ]] || die "kill-node: name $KAFKAC or $RABBITC"
	read -ra nodes <<<"$(docker_services "$svc")"
	for n in "${nodes[@]}"; do
		[[ -n $(docker_compose --profile cluster ps --status running -q "$n") ]] && running+=("$n")
	done
	((${#running[@]} == 3)) || die "kill-node: $svc has ${#running[@]} of 3 nodes running; up $svc first"
	n=${running[RANDOM % 3]}
	docker_compose --profile cluster kill -s KILL "$n" >/dev/null
	log "$svc: container $n killed; starting it again in ${secs}s"
	sleep "$secs"
	docker_compose --profile cluster up -d --wait "${nodes[@]}"
}

# ---------------------------------------------------------------- commands

cmd_up() {
	if (($#)); then
		(($# == 1)) || die "up: name no service, or one of the optional ones alone: $RABBIT4 (a RabbitMQ 4.0 node), $RABBITC, $KAFKAC"
		if use_docker; then
			# shellcheck disable=SC2046 # the services are words
			docker_compose --profile cluster up -d --wait $(docker_services "$1")
			return
		fi
		case $1 in
		"$RABBIT4") up_rabbitmq4 ;;
		"$RABBITC") up_rabbitmq_cluster ;;
		"$KAFKAC") up_kafka_cluster ;;
		*) die "up: name no service, or one of the optional ones alone: $RABBIT4 (a RabbitMQ 4.0 node), $RABBITC, $KAFKAC" ;;
		esac
		return
	fi
	if use_docker; then
		docker_compose up -d --wait
		build_checker
		"$CHECKER" -wait 60s
		return
	fi
	setup_state

	# Which services are ours and running, which ports someone else holds.
	local todo=() svc port busy=0 free
	for svc in "${SERVICES[@]}"; do
		pid_of "$svc" >/dev/null && continue
		free=1
		for port in $(ports_of "$svc"); do
			if port_open "$port"; then
				log "error: port $port ($svc) is already in use by $(port_owner "$port"), not by integration/brokers.sh; stop it first"
				busy=1 free=""
			fi
		done
		[[ -n $free ]] && todo+=("$svc")
	done
	((busy == 0)) || exit 1

	if ((${#todo[@]})); then
		log "starting: ${todo[*]}"
		# Three things at once: the checker compiles, Maven resolves the
		# jars, apt installs the packages.
		build_checker &
		local build_pid=$! mvn_pid="" want_jvm=""
		[[ " ${todo[*]} " == *" kafka "* || " ${todo[*]} " == *" sqs "* ]] && want_jvm=1
		if [[ -n $want_jvm ]] && command -v java >/dev/null && command -v mvn >/dev/null; then
			resolve_classpaths &
			mvn_pid=$!
		fi
		ensure_packages
		if [[ -n $want_jvm ]]; then
			if [[ -n $mvn_pid ]]; then
				wait "$mvn_pid" || exit 1
			else
				resolve_classpaths
			fi
		fi

		local pids=() names=()
		for svc in "${todo[@]}"; do
			("start_$svc") &
			pids+=($!) names+=("$svc")
		done
		local i failed=0
		for i in "${!pids[@]}"; do
			if ! wait "${pids[$i]}"; then
				log "error: starting ${names[$i]} failed"
				failed=1
			fi
		done
		if ((failed)); then
			for svc in "${todo[@]}"; do tail_logs "$svc" 30; done
			exit 1
		fi
		wait "$build_pid" || exit 1
	else
		build_checker
	fi

	# The checker gives up on a service whose process died.
	local out rc=0 watch=()
	for svc in "${todo[@]}"; do
		watch+=("-pid=$svc=$(started_pid "$svc")")
	done
	out=$("$CHECKER" -wait "${UP_TIMEOUT}s" $(versions) $(kafka_ca_flag) "${watch[@]}" "${SERVICES[@]}") || rc=$?
	for svc in "${SERVICES[@]}"; do
		local line
		line=$(grep "^$svc " <<<"$out" || true)
		if [[ $line == *" ready" ]]; then
			if [[ " ${todo[*]} " == *" $svc "* ]]; then echo "$line"; else echo "$line (already running)"; fi
		else
			echo "$line"
			tail_logs "$svc" 30
			rc=1
		fi
	done
	((rc == 0)) || die "not every broker is ready (logs: integration/brokers.sh logs)"
	kafka_extras
	rabbit_extras
}

cmd_down() {
	if (($#)); then
		(($# == 1)) || die "down: name no service, or one of the optional ones alone: $RABBIT4, $RABBITC, $KAFKAC"
		if use_docker; then
			# shellcheck disable=SC2046 # the services are words
			docker_compose --profile cluster rm -sfv $(docker_services "$1")
			return
		fi
		setup_state
		case $1 in
		"$RABBIT4") stop_rabbitmq4 ;;
		"$RABBITC") stop_rabbitmq_cluster ;;
		"$KAFKAC") stop_kafka_cluster ;;
		*) die "down: name no service, or one of the optional ones alone: $RABBIT4, $RABBITC, $KAFKAC" ;;
		esac
		return
	fi
	if use_docker; then
		docker_compose --profile cluster down -v
		return
	fi
	[[ -d $STATE ]] || return 0
	setup_state
	local svc
	for svc in "${SERVICES[@]}"; do
		stop_service "$svc" &
	done
	stop_rabbitmq4 &
	stop_rabbitmq_cluster &
	stop_kafka_cluster &
	wait
	rabbit4_unmount
}

# cmd_restart SERVICE...: stop and start only the named services (a broker
# restart in a fault test), leaving the others running, and wait until the
# restarted ones answer.
cmd_restart() {
	(($#)) || die "restart: name the services to restart (one of: ${SERVICES[*]})"
	use_docker && {
		docker_compose restart "$@"
		return
	}
	setup_state
	if [[ $* == "$RABBIT4" ]]; then
		stop_rabbitmq4 >/dev/null
		up_rabbitmq4
		return
	fi
	if [[ $* == "$RABBITC" ]]; then
		stop_rabbitmq_cluster >/dev/null
		up_rabbitmq_cluster
		return
	fi
	if [[ $* == "$KAFKAC" ]]; then
		stop_kafka_cluster >/dev/null
		up_kafka_cluster
		return
	fi
	local svc out rc=0 watch=() line
	for svc in "$@"; do
		[[ -n $(port_of "$svc") ]] || die "unknown service $svc (one of: ${SERVICES[*]}; $RABBIT4 alone)"
	done
	build_checker
	for svc in "$@"; do
		stop_service "$svc" >/dev/null
		local port
		for port in $(ports_of "$svc"); do
			port_open "$port" && die "port $port ($svc) is still held by $(port_owner "$port") after stopping"
		done
		"start_$svc" || die "starting $svc failed"
		watch+=("-pid=$svc=$(started_pid "$svc")")
	done
	out=$("$CHECKER" -wait "${UP_TIMEOUT}s" $(versions) $(kafka_ca_flag) "${watch[@]}" "$@") || rc=$?
	for svc in "$@"; do
		line=$(grep "^$svc " <<<"$out" || true)
		echo "$line"
		[[ $line == *" ready" ]] || {
			tail_logs "$svc" 30
			rc=1
		}
	done
	return $rc
}

# cmd_kill_node CLUSTER [SECONDS]: SIGKILL one running node of CLUSTER
# (kafka-cluster or rabbitmq-cluster), chosen at random, wait SECONDS
# (default 5) and start it again, waiting until the cluster is whole: a node
# that dies and comes back, as the chaos run's -cluster setting asks.
cmd_kill_node() {
	local svc=${1:-} secs=${2:-5} n pid running=()
	if use_docker; then
		docker_kill_node "$svc" "$secs"
		return
	fi
	setup_state
	case $svc in
	"$KAFKAC")
		for n in "${KAFKAC_NODES[@]}"; do kafkac_pid "$n" >/dev/null && running+=("$n"); done
		;;
	"$RABBITC")
		for n in "${RABBITC_NODES[@]}"; do rabbitc_pid "$n" >/dev/null && running+=("$n"); done
		;;
	*) die "kill-node: name $KAFKAC or $RABBITC" ;;
	esac
	# A node is killed only from a whole cluster: a second loss would take
	# the quorum (and, with every RabbitMQ node down, up makes the cluster
	# anew, its messages gone).
	((${#running[@]} == 3)) || die "kill-node: $svc has ${#running[@]} of 3 nodes running; up $svc first"
	n=${running[RANDOM % 3]}
	if [[ $svc == "$KAFKAC" ]]; then pid=$(kafkac_pid "$n") || true; else pid=$(rabbitc_pid "$n") || true; fi
	[[ -n $pid ]] || die "kill-node: node $n of $svc stopped by itself"
	kill -KILL "$pid"
	log "$svc: node $n (pid $pid) killed; starting it again in ${secs}s"
	sleep "$secs"
	if [[ $svc == "$KAFKAC" ]]; then up_kafka_cluster; else up_rabbitmq_cluster; fi
}

cmd_status() {
	if ! use_docker; then
		[[ -d $STATE ]] && setup_state
	fi
	build_checker
	local out rc=0 svc line pid
	out=$("$CHECKER" $(versions) $(kafka_ca_flag) "${SERVICES[@]}") || rc=$?
	for svc in "${SERVICES[@]}"; do
		line=$(grep "^$svc " <<<"$out" || true)
		if pid=$(pid_of "$svc"); then line+=" (pid $pid)"; fi
		echo "$line"
	done
	# The optional 4.0 node counts only while it runs.
	if ! use_docker; then
		if pid=$(rabbit4_pid); then
			line=$(rabbit4_check) || rc=1
			echo "$line (pid $pid)"
		else
			printf '%-9s 127.0.0.1:%-13s -                  not started (optional: integration/brokers.sh up %s)\n' "$RABBIT4" "$RABBIT4_PORT" "$RABBIT4"
		fi
		if rabbitc_running; then
			local n
			for n in "${RABBITC_NODES[@]}"; do
				if pid=$(rabbitc_pid "$n"); then
					line=$(FERRY_AMQP_URL="amqp://guest:guest@127.0.0.1:$((5690 + n))/" "$CHECKER" rabbitmq) || rc=1
					echo "$(sed "s/^rabbitmq /rabbitc$n /" <<<"$line") (pid $pid, $RABBITC)"
				else
					echo "rabbitc$n  127.0.0.1:$((5690 + n))         -                  NOT RUNNING ($RABBITC)"
					rc=1
				fi
			done
		else
			printf '%-9s 127.0.0.1:%-13s -                  not started (optional: integration/brokers.sh up %s)\n' "rabbitc1-3" "5691-5693" "$RABBITC"
		fi
		if kafkac_running; then
			for n in "${KAFKAC_NODES[@]}"; do
				if pid=$(kafkac_pid "$n"); then
					line=$(FERRY_KAFKA_BROKERS="127.0.0.1:$((19090 + n))" "$CHECKER" $(versions) kafka) || rc=1
					echo "$(sed "s/^kafka    /kafkac$n  /" <<<"$line") (pid $pid, $KAFKAC)"
				else
					echo "kafkac$n   127.0.0.1:$((19090 + n))        -                  NOT RUNNING ($KAFKAC)"
					rc=1
				fi
			done
		else
			printf '%-9s 127.0.0.1:%-13s -                  not started (optional: integration/brokers.sh up %s)\n' "kafkac1-3" "19091-19093" "$KAFKAC"
		fi
	fi
	return $rc
}

cmd_logs() {
	if use_docker; then
		docker_compose logs --tail 50 "$@"
		return
	fi
	[[ -d $STATE ]] || die "no state folder ${STATE}: the brokers never ran here"
	setup_state
	local svc
	(($#)) || set -- "${SERVICES[@]}"
	for svc in "$@"; do
		[[ -n $(port_of "$svc") || $svc == "$RABBIT4" || $svc == "$RABBITC" || $svc == "$KAFKAC" ]] ||
			die "unknown service $svc (one of: ${SERVICES[*]} $RABBIT4 $RABBITC $KAFKAC)"
		tail_logs "$svc" 50 2>&1
	done
}

case ${1:-} in
up)
	shift
	cmd_up "$@"
	;;
down)
	shift
	cmd_down "$@"
	;;
status) cmd_status ;;
kill-node)
	shift
	cmd_kill_node "$@"
	;;
restart)
	shift
	cmd_restart "$@"
	;;
logs)
	shift
	cmd_logs "$@"
	;;
-h | --help | help)
	usage
	exit 0
	;;
*)
	usage
	exit 2
	;;
esac
