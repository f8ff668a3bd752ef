package idempotency_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMemoryStore(t *testing.T) {
	storetest.Run(t, storetest.Config{
		NewStore: func(*testing.T) idempotency.Store { return idempotency.NewMemoryStore() },
	})
}
