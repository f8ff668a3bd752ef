#!/usr/bin/env bash
# The test certificates of docker-compose.yml, made with openssl, once, into
# the brokers' state folder (the first argument: .brokers/, or
# FERRY_BROKERS_DIR), where the tests look for them. They are the files
# integration/brokers.sh makes there, so that either way of starting the
# brokers takes over the other's:
#
#   rabbitmq/tls/cert.pem, key.pem   the amqps listener's, self-signed for
#                                    127.0.0.1 and localhost; clients trust cert.pem
#   kafka/tls/ca.pem                 the SASL_SSL listener's certificate, self-signed
#                                    for 127.0.0.1: what clients trust (FERRY_KAFKA_CA)
#   kafka/tls/server.pem             its PKCS#8 key and certificate (brokers.sh's keystore)
#
# and, for the apache/kafka image, whose start script asks for a keystore
# with a password in a file (Kafka refuses a password on a PEM keystore):
#
#   kafka/tls/server.p12             server.pem as a PKCS#12 keystore
#   kafka/tls/keystore-password      its password
#
# Test certificates with test keys: everyone may read them, because the
# brokers' containers run as users of their own (rabbitmq, appuser).
set -euo pipefail

dir=${1:?usage: compose-certs.sh STATE_DIR}
r=$dir/rabbitmq/tls
k=$dir/kafka/tls
mkdir -p "$r" "$k"

if [[ ! -s $r/cert.pem || ! -s $r/key.pem ]]; then
	openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=127.0.0.1 \
		-addext subjectAltName=IP:127.0.0.1,DNS:localhost \
		-keyout "$r/key.pem" -out "$r/cert.pem" 2>/dev/null
	echo "made $r/cert.pem"
fi

if [[ ! -s $k/server.pem || ! -s $k/ca.pem ]]; then
	openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=127.0.0.1 \
		-addext subjectAltName=IP:127.0.0.1 -keyout "$k/key.pem" -out "$k/ca.pem" 2>/dev/null
	openssl pkcs8 -topk8 -nocrypt -in "$k/key.pem" -out "$k/key8.pem"
	cat "$k/key8.pem" "$k/ca.pem" >"$k/server.pem"
	rm -f "$k/key.pem" "$k/key8.pem" "$k/server.p12"
	echo "made $k/ca.pem"
fi

if [[ ! -s $k/server.p12 || ! -s $k/keystore-password ]]; then
	printf '%s' ferry-keystore-test >"$k/keystore-password"
	openssl pkcs12 -export -name kafka -in "$k/server.pem" -inkey "$k/server.pem" \
		-passout "file:$k/keystore-password" -out "$k/server.p12"
	echo "made $k/server.p12"
fi

chmod 755 "$dir" "$dir/rabbitmq" "$dir/kafka" "$r" "$k"
chmod 644 "$r/cert.pem" "$r/key.pem" "$k/ca.pem" "$k/server.pem" "$k/server.p12" "$k/keystore-password"
