package outbox_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/sqliteoutbox"
)

// An order row and its event commit together in SQLite; a relay publishes
// the event to the in-memory broker, with its id in the ferry-event-id
// header.
func Example() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "outbox-example")
	defer os.RemoveAll(dir)

	db, err := sqliteoutbox.Open(filepath.Join(dir, "shop.db"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	if err := sqliteoutbox.Migrate(ctx, db); err != nil {
		panic(err)
	}
	db.ExecContext(ctx, `CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)`)

	w, _ := sqliteoutbox.NewWriter()
	tx, _ := db.BeginTx(ctx, nil)
	tx.ExecContext(ctx, `INSERT INTO orders VALUES ('o-1', 4200)`)
	if err := w.Add(ctx, tx, outbox.Event{
		ID:          "evt-1",
		Destination: "orders",
		Key:         "o-1",
		Body:        []byte(`{"order":"o-1","total":4200}`),
	}); err != nil {
		panic(err) // roll back: neither the row nor the event is written
	}
	if err := tx.Commit(); err != nil {
		panic(err)
	}

	broker, err := memory.New()
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	store, _ := sqliteoutbox.NewStore(db)
	relay, _ := outbox.NewRelay(store, broker)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- relay.Run(rctx) }()
	for len(broker.Messages("orders")) == 0 {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	<-done

	m := broker.Messages("orders")[0]
	fmt.Println(m.Header(outbox.EventIDHeader), m.Key, string(m.Body))
	// Output: evt-1 o-1 {"order":"o-1","total":4200}
}
