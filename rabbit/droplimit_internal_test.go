package rabbit

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// dropLimit names a drop only for a quorum queue with no dead-letter
// exchange and a delivery limit: its own, or RabbitMQ 4's default.
func TestDropLimitOnlyWhereAMessageCanBeDropped(t *testing.T) {
	for _, c := range []struct {
		name      string
		q         Queue
		server    string
		limit     int64
		byDefault bool
		drops     bool
	}{
		{"quorum, limit, no dead-letter exchange", Queue{Name: "q", DeliveryLimit: 5}, "3.10.8", 5, false, true},
		{"quorum, limit in Args", Queue{Name: "q", Args: amqp.Table{"x-delivery-limit": int32(7)}}, "3.10.8", 7, false, true},
		{"quorum, no limit, RabbitMQ 3", Queue{Name: "q"}, "3.10.8", 0, false, false},
		{"quorum, no limit, RabbitMQ 4: the default of 20", Queue{Name: "q"}, "4.1.0", 20, true, true},
		{"quorum, unlimited on RabbitMQ 4", Queue{Name: "q", Args: amqp.Table{"x-delivery-limit": int64(-1)}}, "4.1.0", 0, false, false},
		{"quorum, negative limit on RabbitMQ 3: taken as 0", Queue{Name: "q", Args: amqp.Table{"x-delivery-limit": int64(-1)}}, "3.10.8", 0, false, true},
		{"quorum, limit 0 in Args", Queue{Name: "q", Args: amqp.Table{"x-delivery-limit": int64(0)}}, "4.0.5", 0, false, true},
		{"quorum, no limit, version unknown", Queue{Name: "q"}, "", 0, false, false},
		{"quorum, limit, dead-letter exchange", Queue{Name: "q", DeliveryLimit: 5, DeadLetterExchange: "dlx"}, "4.1.0", 0, false, false},
		{"quorum, limit, the default exchange by routing key", Queue{Name: "q", DeliveryLimit: 5, DeadLetterRoutingKey: "q-dlq"}, "3.10.8", 0, false, false},
		{"quorum, limit, dead-letter exchange in Args", Queue{Name: "q", DeliveryLimit: 5, Args: amqp.Table{"x-dead-letter-exchange": "dlx"}}, "3.10.8", 0, false, false},
		{"classic", Queue{Name: "q", Classic: true}, "4.1.0", 0, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			limit, byDefault, drops := dropLimit(c.q, c.server)
			if limit != c.limit || byDefault != c.byDefault || drops != c.drops {
				t.Errorf("dropLimit = %d, %v, %v; want %d, %v, %v", limit, byDefault, drops, c.limit, c.byDefault, c.drops)
			}
		})
	}
}
