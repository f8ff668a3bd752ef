package sqlitestore

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/ferrymq/ferry/consumer"
)

// An error no retry can fix (here SQLite's own SQLITE_TOOBIG) is permanent;
// one that a retry can fix (the database closed, then reopened) is not.
func TestUnfixableErrorsArePermanent(t *testing.T) {
	db, err := Open(filepath.Join(t.TempDir(), "ferry.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var n int
	err = db.QueryRowContext(context.Background(), "SELECT length(zeroblob(?))", int64(1)<<40).Scan(&n)
	if err == nil {
		t.Fatal("a blob of 1 TiB was accepted")
	}
	if e := storeErr("claim", err); !consumer.IsPermanent(e) || !errors.Is(e, err) {
		t.Errorf("storeErr(%v) = %v, want permanent, wrapping it", err, e)
	}
	db.Close()
	err = db.PingContext(context.Background())
	if e := storeErr("claim", err); err == nil || consumer.IsPermanent(e) {
		t.Errorf("storeErr(%v) = %v, want a plain error", err, e)
	}
}
