package main

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/testenv"
)

// TestMain runs a child process's role when this test binary is started as
// one (the run starts its processes from its own executable).
func TestMain(m *testing.M) {
	if role := os.Getenv(envRole); role != "" {
		os.Exit(runChild(role))
	}
	os.Exit(m.Run())
}

// envChaos gates the tests that run the chaos: they restart brokers, which
// would break the tests of other packages running at the same time, so make
// test runs them in a step of their own, after the others.
const envChaos = "FERRY_CHAOS"

func requireChaos(t *testing.T) {
	t.Helper()
	if os.Getenv(envChaos) != "1" {
		t.Skipf("set %s=1 to run the chaos (make test runs it after the other packages: it restarts brokers)", envChaos)
	}
	for _, s := range []testenv.Service{testenv.Postgres, testenv.Kafka, testenv.SQS, testenv.RabbitMQ} {
		testenv.Require(t, s)
	}
}

// shortConfig is the short setting, on every broker, with flags as the
// command line would give them.
func shortConfig(t *testing.T, args ...string) config {
	t.Helper()
	cfg, err := parseFlags(append([]string{"-short", "-quiet"}, args...))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestChaosShortSettingKeepsEveryInvariant is the short setting of make
// chaos: on each broker, 10,000 orders over a minute through two relays and
// three billing consumers, with SIGKILLs, one broker restart, a 10s
// payments outage, poison and a slow consumer. Every invariant must hold.
// FERRY_CHAOS_FLAGS adds flags ("-broker kafka -seed 7").
func TestChaosShortSettingKeepsEveryInvariant(t *testing.T) {
	requireChaos(t)
	cfg := shortConfig(t, strings.Fields(os.Getenv("FERRY_CHAOS_FLAGS"))...)
	results, err := run(t.Context(), cfg, t.Output())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range results {
		if !r.OK() {
			t.Errorf("%s: %s", r.Kind, r.verdictWord())
		}
	}
}

// TestChaosFailsWithAPlantedFault checks that the run can fail: with
// idempotency off, the events written twice are paid twice; with a consumer
// that acks before its handler, the orders a killed consumer held are lost.
// Each must name the invariant it broke (the orders an at-most-once
// consumer loses may be poison ones too).
func TestChaosFailsWithAPlantedFault(t *testing.T) {
	requireChaos(t)
	for _, tc := range []struct {
		fault, broken string
		extra         []string
	}{
		{faultNoIdem, CheckExactlyOnce, nil},
		{faultAckFirst, CheckNothingLost, []string{"-drain-timeout", "20s"}},
	} {
		t.Run(tc.fault, func(t *testing.T) {
			args := append([]string{"-broker", "rabbitmq", "-fault", tc.fault, "-orders", "400", "-duration", "8s",
				"-broker-restarts", "0", "-outage", "0", "-kill-every", "2s", "-keep-failed=false"}, tc.extra...)
			cfg := shortConfig(t, args...)
			start := time.Now()
			results, err := run(t.Context(), cfg, t.Output())
			if err != nil {
				t.Fatal(err)
			}
			r := results[0]
			if r.OK() {
				t.Fatalf("the run passed with the fault %s planted", tc.fault)
			}
			for _, c := range r.Checks {
				switch {
				case c.Name == tc.broken && c.OK:
					t.Errorf("check %q held with the fault %s planted", c.Name, tc.fault)
				case c.Name == CheckNoGoodDeadLettered && !c.OK:
					t.Errorf("check %q broke too: %s", c.Name, c.Detail)
				}
			}
			t.Logf("failed as it must in %s: %s", time.Since(start).Round(time.Second), r.verdictWord())
		})
	}
}
