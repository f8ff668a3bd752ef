package dlqcmd

import (
	"context"
	"errors"
	"fmt"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/rabbit"
)

// defaultExchangePrefix is the deprecated rabbit.QueuePrefix: users'
// --to and headers written before a plain name was a queue still say
// amq.default/QUEUE.
const defaultExchangePrefix = "amq.default/"

// rabbitTarget is the destination the rabbit adapter's Publish takes for
// a redrive's source name. A bare name is a queue to Publish, as the
// source a dead letter names (and what a user types as --to) is: it is the
// queue of that name when one exists, else, as a convenience of the
// command, the exchange of that name (rabbit.ToExchange). An explicit
// amq.exchange/EXCHANGE is taken as it is, and the older amq.default/QUEUE
// as the QUEUE it names.
func rabbitTarget(ctx context.Context, b ferry.Broker, name string) (string, error) {
	if strings.HasPrefix(name, rabbit.ExchangePrefix) {
		return name, nil
	}
	if q, ok := strings.CutPrefix(name, defaultExchangePrefix); ok {
		return q, nil
	}
	d, err := cli.Driver(ctx, b, name, "", 1)
	if err != nil {
		return "", err
	}
	defer d.Close()
	lr, ok := d.(driver.LagReporter)
	if !ok {
		return "", fmt.Errorf("cannot ask whether %s is a queue: the driver does not report depth", name)
	}
	// Lag declares the queue passively: it fails with 404 when there is
	// none, and creates nothing.
	lctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	_, err = lr.Lag(lctx)
	var ae *amqp.Error
	switch {
	case err == nil:
		return name, nil
	case errors.As(err, &ae) && ae.Code == amqp.NotFound:
		return rabbit.ToExchange(name), nil
	}
	return "", fmt.Errorf("asking whether %s is a queue: %w", name, err)
}
