package sqlitestore_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/sqlitestore"
)

// The transactional inbox: the payment row and the message's key commit
// together, so the same event delivered three times pays once.
func ExampleNewInbox() {
	dir, err := os.MkdirTemp("", "ferry-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sqlitestore.Open(filepath.Join(dir, "billing.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	if err := sqlitestore.Migrate(ctx, db); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE payments (order_id TEXT NOT NULL)"); err != nil {
		log.Fatal(err)
	}
	h, err := sqlitestore.NewInbox(db, "billing", func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
		_, err := tx.ExecContext(ctx, "INSERT INTO payments (order_id) VALUES (?)", string(m.Body))
		return err // through tx, never db: the inbox holds the only connection
	})
	if err != nil {
		log.Fatal(err)
	}
	for i := range 3 {
		m := &consumer.Message{
			ID:      fmt.Sprintf("broker-id-%d", i),
			Body:    []byte("order-42"),
			Headers: map[string]string{idempotency.EventIDHeader: "order-42-paid"},
		}
		if err := h.Handle(ctx, m); err != nil {
			log.Fatal(err)
		}
	}
	var n int
	if err := db.QueryRowContext(ctx, "SELECT count(*) FROM payments").Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("payments:", n)
	// Output:
	// payments: 1
}
