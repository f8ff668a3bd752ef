package main

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferrymq/ferry/internal/testenv"
)

// An order is the broker's loss only on a broker that can lose what it
// acknowledged (SQS, whose stand-in ElasticMQ persists after answering),
// only if the broker acknowledged its event within a restart, and only if
// no consumer ever received it; any other missing order stays Ferry's.
func TestBrokerLossIsOnlyWhatARestartTookBeforeAnyDelivery(t *testing.T) {
	testenv.Require(t, testenv.Postgres)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	admin, err := pgxpool.New(ctx, testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	schema := "chaos_test_" + newRunID()
	if _, err := admin.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`) })
	u, err := withSearchPath(testenv.PostgresURL(), schema)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, schemaSQL); err != nil {
		t.Fatal(err)
	}

	restart := time.Now().Add(-time.Minute).Truncate(time.Millisecond)
	stop := window{From: restart, To: restart.Add(8 * time.Second)}
	orders := []struct {
		id        string
		poison    bool
		published []time.Time
		delivered int
	}{
		{"in-restart", false, []time.Time{restart.Add(time.Second)}, 0},                           // the broker's
		{"just-before", false, []time.Time{restart.Add(-2 * time.Second)}, 0},                     // the broker's (its persistence lags)
		{"poison-in-restart", true, []time.Time{restart.Add(time.Second)}, 0},                     // the broker's
		{"delivered-once", false, []time.Time{restart.Add(time.Second)}, 1},                       // Ferry's: a consumer had it
		{"long-before", false, []time.Time{restart.Add(-30 * time.Second)}, 0},                    // Ferry's: persisted long before
		{"after", false, []time.Time{restart.Add(20 * time.Second)}, 0},                           // Ferry's
		{"twice", false, []time.Time{restart.Add(time.Second), restart.Add(20 * time.Second)}, 0}, // Ferry's: its second copy was safe
		{"never-published", false, nil, 0},                                                        // Ferry's
	}
	for i, o := range orders {
		if _, err := pool.Exec(ctx, `INSERT INTO orders (seq, id, amount_cents, poison) VALUES ($1, $2, 1, $3)`, i, o.id, o.poison); err != nil {
			t.Fatal(err)
		}
		for _, at := range o.published {
			if _, err := pool.Exec(ctx, `INSERT INTO published (event_id, relay, at) VALUES ($1, 'relay-0', $2)`, "ev-"+o.id, at); err != nil {
				t.Fatal(err)
			}
		}
		for range o.delivered {
			if _, err := pool.Exec(ctx, `INSERT INTO deliveries (event_id, consumer, attempt) VALUES ($1, 'billing-0', 1)`, "ev-"+o.id); err != nil {
				t.Fatal(err)
			}
		}
	}
	missing := func() *result {
		r := &result{BrokerStops: []window{stop}}
		for _, o := range orders {
			if o.poison {
				r.PoisonMissing = append(r.PoisonMissing, o.id)
			} else {
				r.Unpaid = append(r.Unpaid, o.id)
			}
		}
		return r
	}

	r := missing()
	r.Kind = "sqs"
	if err := r.attributeBrokerLoss(ctx, pool); err != nil {
		t.Fatal(err)
	}
	slices.Sort(r.Unpaid)
	if want := []string{"after", "delivered-once", "long-before", "never-published", "twice"}; !slices.Equal(r.Unpaid, want) {
		t.Errorf("sqs: Ferry's losses %v, want %v", r.Unpaid, want)
	}
	if len(r.PoisonMissing) != 0 {
		t.Errorf("sqs: poison missing %v, want the one lost in the restart attributed to the broker", r.PoisonMissing)
	}
	if len(r.LostByBroker) != 3 {
		t.Errorf("sqs: lost by the broker %q, want in-restart, just-before and poison-in-restart", r.LostByBroker)
	}

	for _, kind := range []string{"kafka", "rabbitmq"} {
		r := missing()
		r.Kind = kind
		if err := r.attributeBrokerLoss(ctx, pool); err != nil {
			t.Fatal(err)
		}
		if len(r.LostByBroker) != 0 || len(r.Unpaid) != 7 || len(r.PoisonMissing) != 1 {
			t.Errorf("%s: lost by the broker %q, Ferry's %v and %v: want every loss Ferry's", kind, r.LostByBroker, r.Unpaid, r.PoisonMissing)
		}
	}
}
