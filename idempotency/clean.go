package idempotency

import (
	"context"
	"log/slog"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// CleanEvery runs c.Cleanup every interval until ctx ends, logging failures
// and how many keys each run removed to logger (slog.Default() when nil). It
// blocks: run it in a goroutine that you stop by cancelling ctx. It returns
// ctx's error. Any number of processes may clean one shared store at once.
func CleanEvery(ctx context.Context, c Cleaner, interval time.Duration, logger *slog.Logger) error {
	if c == nil {
		return consumer.ConfigErrorf("Cleaner", "must not be nil")
	}
	if interval <= 0 {
		return consumer.ConfigErrorf("Interval", "must be > 0, got %s", interval)
	}
	if logger == nil {
		logger = slog.Default()
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		n, err := c.Cleanup(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			logger.WarnContext(ctx, "idempotency: cleanup failed", "error", err)
		case n > 0:
			logger.DebugContext(ctx, "idempotency: cleanup", "removed", n)
		}
	}
}
