# Ferry's build and test entry points. See docs/TESTING.md.
GO        ?= go
GOFLAGS_TEST ?= -race -count=1 -timeout 20m
PKGS      ?= ./...

.PHONY: test test-restarts unit brokers brokers-down brokers-status bench vet

## test: start the brokers, then run every test (unit and integration) with -race,
## then, alone, the tests that restart a shared broker
test: brokers
	$(GO) test $(GOFLAGS_TEST) $(PKGS)
	$(MAKE) test-restarts

## test-restarts: the tests that stop and start a shared broker (Kafka), run
## when nothing else uses it
test-restarts: brokers
	FERRY_TEST_KAFKA_RESTART=1 $(GO) test $(GOFLAGS_TEST) -run '^TestBrokerRestart$$' ./kafka/

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

## vet: go vet, staticcheck (a tool of go.mod) and a gofmt check
vet:
	$(GO) vet $(PKGS)
	$(GO) tool staticcheck $(PKGS)
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './.brokers/*')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
