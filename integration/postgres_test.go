package integration_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferrymq/ferry/internal/testenv"
)

// TestPostgresRoundTrip writes and reads a row in a transaction, and checks
// LISTEN/NOTIFY, which the outbox relay wakes on: a notification sent in a
// transaction arrives only after the commit.
func TestPostgresRoundTrip(t *testing.T) {
	t.Parallel()
	url := testenv.RequirePostgres(t)
	ctx := testenv.Context(t, 30*time.Second)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	defer conn.Close(ctx)
	listener, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(ctx)

	table := pgx.Identifier{testenv.UniqueName(t, "t")}.Sanitize()
	channel := testenv.UniqueName(t, "c")
	if _, err := conn.Exec(ctx, "create table "+table+" (id bigserial primary key, body text not null)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Exec(testenv.Context(t, 5*time.Second), "drop table if exists "+table) })
	if _, err := listener.Exec(ctx, "listen "+pgx.Identifier{channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := tx.QueryRow(ctx, "insert into "+table+" (body) values ($1) returning id", "hello").Scan(&id); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "select pg_notify($1, $2)", channel, "hello"); err != nil {
		t.Fatal(err)
	}
	early, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	if n, err := listener.WaitForNotification(early); err == nil {
		t.Fatalf("notification %q arrived before the commit", n.Payload)
	}
	cancel()
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	n, err := listener.WaitForNotification(ctx)
	if err != nil || n.Payload != "hello" {
		t.Fatalf("notification after commit: %v, %+v", err, n)
	}

	var body string
	if err := conn.QueryRow(ctx, "select body from "+table+" where id = $1", id).Scan(&body); err != nil || body != "hello" {
		t.Fatalf("read back: %q, %v", body, err)
	}
}
