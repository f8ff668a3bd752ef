package sqlitestore_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/sqlitestore"
)

func report(b *testing.B, n int, raw, ours time.Duration, unit string) {
	if n == 0 || raw <= 0 || ours <= 0 {
		return
	}
	r, o := float64(n)/raw.Seconds(), float64(n)/ours.Seconds()
	b.ReportMetric(r, "raw/s")
	b.ReportMetric(o, unit)
	b.ReportMetric(o/r, "ratio")
}

// BenchmarkClaimComplete measures the store's claim+complete cycle against
// the raw single statement (a prepared INSERT ... ON CONFLICT DO NOTHING) on
// the same database file, interleaved. ratio = cycles/s ÷ raw/s.
func BenchmarkClaimComplete(b *testing.B) {
	db := openDB(b)
	ctx := context.Background()
	s, err := sqlitestore.NewStore(db)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	if _, err := db.Exec("CREATE TABLE raw (key TEXT PRIMARY KEY) WITHOUT ROWID"); err != nil {
		b.Fatal(err)
	}
	raw, err := db.Prepare("INSERT INTO raw (key) VALUES (?) ON CONFLICT DO NOTHING")
	if err != nil {
		b.Fatal(err)
	}
	defer raw.Close()
	var rawDur, cycleDur time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		key := fmt.Sprint(i)
		i++
		t0 := time.Now()
		if _, err := raw.ExecContext(ctx, key); err != nil {
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
	report(b, i, rawDur, cycleDur, "cycles/s")
}

// BenchmarkInbox measures a handler that inserts one row through the inbox
// against the same insert in a plain transaction, interleaved.
func BenchmarkInbox(b *testing.B) {
	db := openDB(b)
	ctx := context.Background()
	newEffect(b, db)
	ins, err := db.Prepare(effectInsert)
	if err != nil {
		b.Fatal(err)
	}
	h, err := sqlitestore.NewInbox(db, "bench", func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
		_, err := tx.StmtContext(ctx, ins).ExecContext(ctx, []byte(m.ID))
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	plain := func(key string) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if _, err := tx.StmtContext(ctx, ins).ExecContext(ctx, key); err != nil {
			return err
		}
		return tx.Commit()
	}
	var rawDur, inboxDur time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		key := fmt.Sprint(i)
		i++
		t0 := time.Now()
		if err := plain(key); err != nil {
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
	report(b, i, rawDur, inboxDur, "msgs/s")
}
