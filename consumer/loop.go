package consumer

import (
	"context"
	"errors"

	"github.com/ferrymq/ferry/consumer/driver"
)

// Loop is the delivery loop over one driver: the Consumer every broker
// adapter returns. Build one with New.
type Loop struct {
	drv driver.Driver
	cfg config
}

// Stats is a snapshot of a Loop's counters.
type Stats struct {
	Fetched      int64 // deliveries taken from the broker
	Acked        int64 // deliveries acknowledged
	Returned     int64 // deliveries returned to the broker for redelivery
	Failed       int64 // handler runs that returned an error (panics included)
	Panics       int64 // handler runs that panicked
	Held         int64 // handler runs held by a breaker (not attempts)
	Retried      int64 // in-place re-runs (brokers that cannot redeliver)
	Revoked      int64 // deliveries let go because the broker revoked their lane
	FetchErrors  int64 // failed fetches
	SettleErrors int64 // failed settle or extend calls
	InFlight     int64 // deliveries held now, unsettled
	Running      int64 // handlers running now
}

// New returns a delivery loop over drv. It fails with a *ConfigError naming
// the field when an option is invalid or drv is nil.
func New(drv driver.Driver, opts ...Option) (*Loop, error) {
	if drv == nil {
		return nil, configErr("Driver", "must not be nil")
	}
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	return &Loop{drv: drv, cfg: cfg}, nil
}

// Run delivers messages to h until ctx ends. See the package documentation
// for what is acknowledged when.
func (l *Loop) Run(ctx context.Context, h Handler) error {
	if h == nil {
		return configErr("Handler", "must not be nil")
	}
	return errors.New("not implemented yet")
}
