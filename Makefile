# Ferry's build and test entry points. See docs/TESTING.md.
GO        ?= go
GOFLAGS_TEST ?= -race -count=1 -timeout 20m
PKGS      ?= ./...

.PHONY: chaos-cluster test test-rabbit4 test-cluster test-restarts restart-loop unit brokers brokers-down brokers-status bench bench-compare bench-test examples-test tools-test vet chaos chaos-short

## test: start the brokers, then run every test (unit and integration) with -race;
## then, alone, the tests that restart a shared broker, the rabbit suite again on
## RabbitMQ 4.0 (test-rabbit4), the cluster fault tests (test-cluster), the bench module's short
## check that every benchmark variant loses no message, the examples module's
## tests (each example run against the real brokers) and (for the whole module)
## the chaos run's short setting (chaos-short)
test: brokers
	$(GO) test $(GOFLAGS_TEST) $(PKGS)
	$(MAKE) test-restarts
	$(if $(NATIVE_ROOT),$(MAKE) test-rabbit4,@echo "make test: test-rabbit4 skipped: $(NATIVE_ROOT_WHY)")
	$(if $(NATIVE_ROOT),$(MAKE) test-cluster,@echo "make test: test-cluster skipped: $(NATIVE_ROOT_WHY)")
	$(MAKE) restart-loop RESTARTS=$(TEST_RESTARTS)
	$(MAKE) bench-test
	$(MAKE) examples-test
	$(MAKE) tools-test
	$(if $(filter ./...,$(PKGS)),$(MAKE) chaos-short)

# The RabbitMQ 4.0 nodes run natively from a chroot: make test runs
# test-rabbit4 and test-cluster as root and without FERRY_BROKERS=docker only
# (CI runs as root; run them by hand elsewhere).
NATIVE_ROOT := $(if $(filter docker,$(FERRY_BROKERS)),,$(filter 0,$(shell id -u)))
NATIVE_ROOT_WHY := they run RabbitMQ 4.0 natively from a Debian root entered with chroot, which needs root and not FERRY_BROKERS=docker

## test-restarts: the tests that stop and start a shared broker (Kafka, RabbitMQ),
## run when nothing else uses it
test-restarts: brokers
	FERRY_TEST_KAFKA_RESTART=1 $(GO) test $(GOFLAGS_TEST) -run '^TestBrokerRestart$$' ./kafka/
	FERRY_TEST_RABBIT_RESTART=1 $(GO) test $(GOFLAGS_TEST) -run '^TestBrokerRestart(ResumesConsumersAndPublishers|KeepsDelayedMessages)$$' ./rabbit/

## test-rabbit4: the rabbit package's whole suite, restart test included, on a
## RabbitMQ 4.0 node of its own (integration/brokers.sh up rabbitmq4: AMQP on 5682,
## amqps on 5681, run from a Debian trixie root that the script makes once with
## debootstrap; Debian bookworm ships only 3.10, which make test's rabbit run uses)
BROKERS_DIR ?= $(or $(FERRY_BROKERS_DIR),$(CURDIR)/.brokers)
RABBIT4_ENV = FERRY_AMQP_URL=amqp://guest:guest@127.0.0.1:5682/ \
	FERRY_AMQPS_URL=amqps://guest:guest@127.0.0.1:5681/ \
	FERRY_AMQP_TENANT_URL=amqp://ferry-tenant:ferry-tenant-secret@127.0.0.1:5682/ferry-tenant \
	FERRY_AMQPS_CA=$(BROKERS_DIR)/rabbitmq/tls/cert.pem \
	FERRY_RABBITMQCTL=$(BROKERS_DIR)/rabbitmq4/rabbitmqctl FERRY_RABBITMQ_NODE=rabbit4@localhost \
	FERRY_RABBITMQ_VERSION=4.0
test-rabbit4:
	integration/brokers.sh up rabbitmq4
	$(RABBIT4_ENV) $(GO) test $(GOFLAGS_TEST) ./rabbit/ && \
		$(RABBIT4_ENV) FERRY_TEST_RABBIT_RESTART=1 $(GO) test $(GOFLAGS_TEST) -run '^TestBrokerRestart(ResumesConsumersAndPublishers|KeepsDelayedMessages)$$' ./rabbit/; \
		rc=$$?; integration/brokers.sh down rabbitmq4; exit $$rc

## test-cluster: the fault tests of broker clusters (TestCluster* in rabbit/ and
## kafka/, -v: each case logs what it counted): three RabbitMQ 4.0 nodes as one
## cluster (integration/brokers.sh up rabbitmq-cluster, 127.0.0.1:5691-5693) and
## three Kafka nodes (up kafka-cluster, 127.0.0.1:19091-19093, replication factor
## 3, min.insync.replicas 2), nodes SIGKILLed under busy consumers and publishers;
## each cluster is stopped after its tests, pass or fail
RABBITC_ENV = FERRY_RABBIT_CLUSTER_URL=amqp://guest:guest@127.0.0.1:5691,127.0.0.1:5692,127.0.0.1:5693/ \
	FERRY_RABBIT_CLUSTER_DIR=$(BROKERS_DIR)/rabbitmq4/root/ferry \
	FERRY_RABBIT_CLUSTER_UP="$(CURDIR)/integration/brokers.sh up rabbitmq-cluster" \
	FERRY_RABBITMQCTL=$(BROKERS_DIR)/rabbitmq4/rabbitmqctl
KAFKAC_ENV = FERRY_KAFKA_CLUSTER_BROKERS=127.0.0.1:19091,127.0.0.1:19092,127.0.0.1:19093 \
	FERRY_KAFKA_CLUSTER_DIR=$(BROKERS_DIR)/kafka-cluster \
	FERRY_KAFKA_CLUSTER_UP="$(CURDIR)/integration/brokers.sh up kafka-cluster"
test-cluster:
	integration/brokers.sh up rabbitmq-cluster
	$(RABBITC_ENV) $(GO) test $(GOFLAGS_TEST) -run '^TestCluster' -v ./rabbit/; \
		rc=$$?; integration/brokers.sh down rabbitmq-cluster; exit $$rc
	integration/brokers.sh up kafka-cluster
	$(KAFKAC_ENV) $(GO) test $(GOFLAGS_TEST) -run '^TestCluster' -v ./kafka/; \
		rc=$$?; integration/brokers.sh down kafka-cluster; exit $$rc

## restart-loop: restart Kafka, ElasticMQ and RabbitMQ RESTARTS times each (default
## 20) while a busy loop holds every core; fails on the first restart that does
## not come back ready (the fault tests and the chaos run rely on brokers.sh restart).
## make test runs TEST_RESTARTS rounds (default 5): at about a minute a round on
## two cores, 20 rounds were a third of the CI run's 45-minute budget.
RESTARTS ?= 20
TEST_RESTARTS ?= 5
restart-loop: brokers
	integration/restart-loop.sh -n $(RESTARTS)

## chaos-short: the short setting of the chaos run on every broker (10,000 orders, one
## broker restart, a 10s outage) and its planted-fault runs, as tests. It runs after the
## other packages, alone, because it restarts brokers; without -race (its six processes
## per broker share two cores in CI).
chaos-short:
	FERRY_CHAOS=1 $(GO) test -count=1 -timeout 25m -v -run '^TestChaos' ./integration/chaos

## chaos-cluster: the chaos run's short setting on the clusters (go run
## ./integration/chaos -cluster -short: kafka and rabbitmq, each broker restart a
## SIGKILL of a random node of three, started again 5s later), as make chaos
## CHAOS_FLAGS='-cluster -short' does, and stops the clusters after
chaos-cluster: brokers
	$(GO) run ./integration/chaos -cluster -short $(CHAOS_FLAGS); \
		rc=$$?; integration/brokers.sh down kafka-cluster; integration/brokers.sh down rabbitmq-cluster; exit $$rc

## chaos: break it on every broker: 100k orders each, kills, two broker restarts, a 30s
## outage, poison, a slow consumer (CHAOS_FLAGS="-broker kafka -orders 10000" and so on;
## go run ./integration/chaos -h lists the flags)
chaos: brokers
	$(GO) run ./integration/chaos $(CHAOS_FLAGS)

## unit: run the tests without starting brokers (integration tests skip)
unit:
	$(GO) test -race -count=1 $(PKGS)

## brokers: start RabbitMQ, Kafka, ElasticMQ (SQS), PostgreSQL and Redis
brokers:
	integration/brokers.sh up

## brokers-down: stop them (their state is kept in .brokers/)
brokers-down:
	integration/brokers.sh down

## brokers-status: one line per broker
brokers-status:
	integration/brokers.sh status

## bench: run the benchmarks (start the brokers first for the broker ones)
bench:
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

## bench-compare: Ferry against the raw clients and Watermill on every broker (start
## the brokers first); writes BENCHMARKS.md and docs/benchmarks.svg. BENCH_FLAGS
## passes flags, e.g. BENCH_FLAGS='-n 100000 -runs 5' (go run ./cmd/bench-compare -h in bench/); the samples
## are saved in docs/benchmarks.json (BENCH_FLAGS=-from ../docs/benchmarks.json renders them again)
BENCH_FLAGS ?=
bench-compare:
	cd bench && $(GO) run ./cmd/bench-compare -out ../BENCHMARKS.md -chart ../docs/benchmarks.svg -data ../docs/benchmarks.json $(BENCH_FLAGS)

## tools-test: the tools module's tests: docs/METRICS.md and docs/alerts.yml
## against what Ferry registers, docker-compose.yml against brokers.sh
tools-test:
	cd tools && $(GO) test -race -count=1 ./...

## bench-test: the bench module's test in short mode (every variant, a few hundred
## messages each, checked for lost messages), with -race
bench-test:
	cd bench && $(GO) test -short -race -count=1 -timeout 5m ./...

## examples-test: the examples module's tests (each example built and run against
## the real brokers and PostgreSQL), with -race
examples-test:
	cd examples && $(GO) test -race -count=1 ./...

## vet: go vet, staticcheck (a tool of tools/go.mod) and a gofmt check, over the
## module and over the bench, examples and tools modules
vet:
	$(GO) vet $(PKGS)
	staticcheck=$$(cd tools && $(GO) tool -n staticcheck) && $$staticcheck $(PKGS)
	cd bench && $(GO) vet ./...
	staticcheck=$$(cd tools && $(GO) tool -n staticcheck) && cd bench && $$staticcheck ./...
	cd examples && $(GO) vet ./...
	staticcheck=$$(cd tools && $(GO) tool -n staticcheck) && cd examples && $$staticcheck ./...
	cd tools && $(GO) vet ./...
	staticcheck=$$(cd tools && $(GO) tool -n staticcheck) && cd tools && $$staticcheck ./...
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './.brokers/*')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
