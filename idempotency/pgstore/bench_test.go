package pgstore_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/pgstore"
	"github.com/ferrymq/ferry/internal/testenv"
)

// BenchmarkClaimComplete measures the store's claim+complete cycle against
// the raw single statement (INSERT ... ON CONFLICT DO NOTHING) on the same
// server, interleaved in the same run, one at a time (so the ratio counts
// round trips). ratio = cycles/s ÷ raw/s; two round trips give about 0.5.
func BenchmarkClaimComplete(b *testing.B) {
	p := testPool(b)
	ctx := context.Background()
	s, err := pgstore.NewStore(p, pgstore.WithTable(freshTable(b, p)))
	if err != nil {
		b.Fatal(err)
	}
	raw := strings.ReplaceAll(testenv.UniqueName(b, "raw"), "-", "_")
	if _, err := p.Exec(ctx, "CREATE TABLE "+raw+" (key text PRIMARY KEY)"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = p.Exec(context.Background(), "DROP TABLE IF EXISTS "+raw) })
	rawSQL := "INSERT INTO " + raw + " (key) VALUES ($1) ON CONFLICT DO NOTHING"
	run := fmt.Sprint(time.Now().UnixNano())
	var rawDur, cycleDur time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		key := run + "-" + fmt.Sprint(i)
		i++
		t0 := time.Now()
		if _, err := p.Exec(ctx, rawSQL, key); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		cl, err := s.Claim(ctx, key, time.Minute)
		if err != nil || cl.Status != idempotency.Claimed {
			b.Fatalf("claim: %v %v", cl.Status, err)
		}
		if err := s.Complete(ctx, key, cl.Token, time.Hour); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		rawDur += t1.Sub(t0)
		cycleDur += t2.Sub(t1)
	}
	reportRatio(b, i, rawDur, cycleDur, "cycles/s")
}

// BenchmarkInbox measures a handler that inserts one row through the inbox
// against the same handler in a plain transaction (begin, insert, commit) on
// the same server, interleaved. The inbox adds the key insert and nothing
// else: four round trips against three, a ratio of about 0.75.
func BenchmarkInbox(b *testing.B) {
	p := testPool(b)
	ctx := context.Background()
	e := newEffect(b, p)
	h, err := pgstore.NewInbox(p, "bench", func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, e.insertSQL(), []byte(m.ID))
		return err
	}, pgstore.WithTable(freshTable(b, p)))
	if err != nil {
		b.Fatal(err)
	}
	plain := func(ctx context.Context, key string) error {
		return pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, e.insertSQL(), []byte(key))
			return err
		})
	}
	run := fmt.Sprint(time.Now().UnixNano())
	var rawDur, inboxDur time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		key := run + "-" + fmt.Sprint(i)
		i++
		t0 := time.Now()
		if err := plain(ctx, key); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := h.Handle(ctx, &consumer.Message{ID: key}); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		rawDur += t1.Sub(t0)
		inboxDur += t2.Sub(t1)
	}
	reportRatio(b, i, rawDur, inboxDur, "msgs/s")
}

func reportRatio(b *testing.B, n int, raw, ours time.Duration, unit string) {
	if n == 0 || raw <= 0 || ours <= 0 {
		return
	}
	rawRate := float64(n) / raw.Seconds()
	ourRate := float64(n) / ours.Seconds()
	b.ReportMetric(rawRate, "raw/s")
	b.ReportMetric(ourRate, unit)
	b.ReportMetric(ourRate/rawRate, "ratio")
}
