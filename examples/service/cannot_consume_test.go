package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/examples/internal/exampletest"
	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/internal/testenv"
)

// When the service cannot consume, it says so everywhere an operator
// looks, on every broker: a WARN line naming the source within seconds,
// /readyz 503 with the state and its cause, and ferry_consumer_health at
// the state's value. /livez stays 200 for what a restart cannot cure (a
// missing source, a broker that is down, an open breaker, a dead-letter
// destination that refuses). Refused credentials stop the consumer for
// good: the service logs why and exits non-zero.
func TestServiceSaysWhenItCannotConsume(t *testing.T) {
	bin := exampletest.Build(t)
	for _, kind := range []ferrytest.Kind{ferrytest.Kafka, ferrytest.SQS, ferrytest.RabbitMQ} {
		t.Run(string(kind)+"/source missing", func(t *testing.T) {
			name := testenv.UniqueName(t, "svc-missing")
			svc := startUnready(t, bin, ferrytest.URL(kind), name, "")
			svc.waitState(t, consumer.HealthDisconnected, "source not found", true)
			svc.checkWarned(t, "cannot consume: the source does not exist")
		})
		t.Run(string(kind)+"/broker unreachable", func(t *testing.T) {
			svc := startUnready(t, bin, unreachableURL(t, kind), "orders", "")
			svc.waitState(t, consumer.HealthDisconnected, "unreachable", true)
			svc.checkWarned(t, "cannot consume: the broker is unreachable")
		})
		t.Run(string(kind)+"/credentials refused", func(t *testing.T) {
			u, ok := refusedURL(t, kind)
			if !ok {
				t.Skip("ElasticMQ checks no credentials (the refusal codes are tested in package sqs)")
			}
			// The consumer stops for good: the service says why and exits
			// non-zero, for its orchestrator to show (a restart loop of a
			// container with bad credentials is what an operator sees).
			svc := startUnready(t, bin, u, "orders", "")
			if err := svc.p.Wait(30 * time.Second); err == nil {
				t.Fatalf("the service exited 0 with its credentials refused; log:\n%s", svc.p.Stderr())
			}
			svc.checkLogged(t, "ERROR", "service failed", "refused by the broker")
			svc.checkLogged(t, "ERROR", "broker failed for good", "refused by the broker")
		})
		t.Run(string(kind)+"/breaker open", func(t *testing.T) {
			b := ferrytest.Open(t, kind)
			src := b.Queue(t, "svc-breaker", ferrytest.Partitions(3))
			dlq := b.Queue(t, "svc-breaker-dlq")
			down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "payments are down", http.StatusServiceUnavailable)
			}))
			t.Cleanup(down.Close)
			svc := startService(t, bin, []string{"FERRY_BROKER_URL=" + ferrytest.URL(kind), "FERRY_SOURCE=" + src.Name,
				"FERRY_DESTINATION=" + src.Destination, "FERRY_DLQ=" + dlq.Destination, "FERRY_CONSUMER=billing-" + randomHex(),
				"FERRY_PAYMENTS_URL=" + down.URL})
			for i := 1; i <= 12; i++ {
				svc.placeOrder(t, orderID(i), 100)
			}
			svc.waitState(t, consumer.HealthProtected, "breaker", true)
			svc.checkWarned(t, "ferry: circuit breaker opened; holding messages (they keep their attempts)")
		})
		t.Run(string(kind)+"/dead-letter destination missing", func(t *testing.T) {
			b := ferrytest.Open(t, kind)
			src := b.Queue(t, "svc-nodlq", ferrytest.Partitions(1))
			missing := testenv.UniqueName(t, "svc-nodlq-dlq") // on RabbitMQ the publish is unroutable
			svc := startService(t, bin, []string{"FERRY_BROKER_URL=" + ferrytest.URL(kind), "FERRY_SOURCE=" + src.Name,
				"FERRY_DESTINATION=" + src.Destination, "FERRY_DLQ=" + missing, "FERRY_CONSUMER=billing-" + randomHex()})
			// Not an order: a permanent error, for the dead-letter destination.
			if err := src.Publish(t.Context(), consumer.Message{Key: "poison", Body: []byte("not json")}); err != nil {
				t.Fatal(err)
			}
			svc.waitState(t, consumer.HealthDeadLetterFailing, "dead-letter", true)
			svc.checkWarned(t, "ferry: dead-letter publish failed; the message stays unacknowledged")
		})
	}
}

// startUnready starts the service on brokerURL and source, and waits only
// until it serves its probes: a service that cannot consume is never ready.
func startUnready(t *testing.T, bin, brokerURL, source, dlq string) *service {
	t.Helper()
	if dlq == "" {
		dlq = source + "-dlq"
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	env := []string{"FERRY_BROKER_URL=" + brokerURL, "FERRY_SOURCE=" + source, "FERRY_DLQ=" + dlq,
		"FERRY_CONSUMER=billing-" + randomHex(), "FERRY_HTTP_ADDR=" + addr}
	s := &service{p: exampletest.Start(t, bin, env), base: "http://" + addr}
	waitUntil(t, 60*time.Second, "/livez to answer", func() bool {
		code, _ := s.get(t, "/livez")
		return code != 0
	})
	return s
}

// waitState waits, for at most 20 s, until /readyz reports want with an
// error or reason containing cause, and checks the probes and the health
// gauge then: /readyz 503, /livez 200 when live.
func (s *service) waitState(t *testing.T, want consumer.HealthState, cause string, live bool) {
	t.Helper()
	var last string
	var h consumer.Health
	ok := false
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		code, body := s.get(t, "/readyz")
		last = fmt.Sprintf("%d %s", code, body)
		var out struct{ Consumers []consumer.Health }
		if json.Unmarshal([]byte(body), &out) == nil && len(out.Consumers) == 1 {
			h = out.Consumers[0]
			if h.State == want && code == http.StatusServiceUnavailable &&
				strings.Contains(strings.ToLower(h.Error+" "+h.Reason), strings.ToLower(cause)) {
				ok = true
				break
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !ok {
		t.Fatalf("/readyz never said %q with %q within 20 s; last: %s\nlog:\n%s", want, cause, last, s.p.Stderr())
	}
	wantLive := http.StatusOK
	if !live {
		wantLive = http.StatusServiceUnavailable
	}
	if code, body := s.get(t, "/livez"); code != wantLive {
		t.Errorf("/livez = %d %s in state %q, want %d", code, body, want, wantLive)
	}
	if h.Live != live || h.Ready {
		t.Errorf("health %+v: live %v, ready %v; want live %v, not ready", h, h.Live, h.Ready, live)
	}
	if want != consumer.HealthStopped || live {
		if g := s.metric(t, "ferry_consumer_health", ""); g < 1 {
			t.Errorf("ferry_consumer_health = %v in state %q, want its state's value", g, want)
		}
	}
}

// checkWarned checks that the log has a WARN or ERROR line whose message
// contains msg.
func (s *service) checkWarned(t *testing.T, msg string) {
	t.Helper()
	for _, l := range s.logs(t) {
		if m, _ := l["msg"].(string); strings.Contains(m, msg) && (l["level"] == "WARN" || l["level"] == "ERROR") {
			return
		}
	}
	t.Errorf("no WARN line %q; the log:\n%s", msg, s.p.Stderr())
}

// checkLogged checks that the log has a line at level whose message
// contains msg and whose text contains cause.
func (s *service) checkLogged(t *testing.T, level, msg, cause string) {
	t.Helper()
	for _, l := range s.logs(t) {
		m, _ := l["msg"].(string)
		if l["level"] == level && strings.Contains(m, msg) && strings.Contains(fmt.Sprint(l), cause) {
			return
		}
	}
	t.Errorf("no %s line %q naming %q; the log:\n%s", level, msg, cause, s.p.Stderr())
}

// unreachableURL is kind's URL with a port nothing listens on.
func unreachableURL(t *testing.T, kind ferrytest.Kind) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	switch kind {
	case ferrytest.Kafka:
		return fmt.Sprintf("kafka://127.0.0.1:%d", port)
	case ferrytest.SQS:
		return fmt.Sprintf("sqs://x:x@127.0.0.1:%d?tls=false&region=us-east-1", port)
	}
	return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)
}

// refusedURL is kind's URL with a password the broker refuses; false where
// the broker checks none.
func refusedURL(t *testing.T, kind ferrytest.Kind) (string, bool) {
	switch kind {
	case ferrytest.Kafka:
		return "kafka://" + testenv.KafkaSCRAMUser + ":wrong-password@" + testenv.KafkaSASLBrokers()[0] +
			"?sasl=SCRAM-SHA-512&ca_file=" + testenv.KafkaCAFile(), true
	case ferrytest.RabbitMQ:
		return "amqp://guest:wrong-password@" + strings.TrimPrefix(strings.TrimPrefix(ferrytest.URL(kind), "amqp://"), "guest:guest@"), true
	}
	return "", false
}
