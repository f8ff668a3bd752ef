package rabbit

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
)

// Topology is the exchanges, queues and bindings a Broker declares when it
// connects and again after every reconnect, in that order. Everything is
// durable. Declaring what exists with the same arguments does nothing;
// with other arguments the broker refuses it (406 PRECONDITION_FAILED) and
// Dial fails.
//
// Declaring an exchange does not make its name a Publish destination: a
// plain destination is a queue whatever the Topology says, and an exchange
// of it is published to as ToExchange(name).
type Topology struct {
	Exchanges []Exchange
	Queues    []Queue
	Bindings  []Binding
}

// Exchange is a durable exchange.
type Exchange struct {
	// Name of the exchange.
	Name string
	// Kind is "direct", "topic", "fanout", "headers" or a plugin's kind such
	// as "x-consistent-hash". Default "topic".
	Kind string
	// Args are extra declare arguments.
	Args amqp.Table
}

// Queue is a durable queue. The zero value of every field but Name is a
// quorum queue with no dead-letter exchange and no delivery limit.
type Queue struct {
	// Name of the queue.
	Name string
	// Classic declares a classic queue instead of a quorum queue. Classic
	// queues count no deliveries (no x-delivery-count) and have no
	// delivery limit.
	Classic bool
	// DeadLetterExchange takes messages the queue dead-letters: rejected
	// without requeue, or past DeliveryLimit. A quorum queue without one
	// drops such messages; a Broker that consumes such a queue with a
	// delivery limit logs a warning (see the package documentation).
	DeadLetterExchange string
	// DeadLetterRoutingKey replaces the routing key of dead-lettered
	// messages; empty keeps it.
	DeadLetterRoutingKey string
	// DeliveryLimit dead-letters a message delivered more than this many
	// times (quorum queues only; x-delivery-limit). Zero sets none: on
	// RabbitMQ 3.x there is then no limit, on 4.x the broker's default of
	// 20 applies.
	DeliveryLimit int
	// SingleActiveConsumer lets one consumer at a time take deliveries
	// (x-single-active-consumer); the others wait as standbys. Consumers of
	// such a queue see Message.Lane set to the message's Key, so the loop
	// keeps each key's order while running keys in parallel.
	SingleActiveConsumer bool
	// Args are extra declare arguments.
	Args amqp.Table
}

// Binding routes messages from an exchange to a queue.
type Binding struct {
	// Exchange is the exchange messages come from.
	Exchange string
	// Queue is the queue they go to.
	Queue string
	// Key is the binding key: a routing key pattern for direct and topic
	// exchanges, the weight for a consistent-hash exchange.
	Key string
	// Args are extra binding arguments (a headers exchange's match).
	Args amqp.Table
}

// Partitioned returns the topology of per-key partitioning over the
// consistent-hash exchange (plugin rabbitmq_consistent_hash_exchange): an
// exchange named exchange and n queues exchange.0 … exchange.n-1, each bound
// with weight 1 and each a single-active-consumer quorum queue, so each
// partition is consumed by one consumer at a time in order. Publish to
// ToExchange(exchange), with Message.Key as the routing key; every message
// of a key lands in the same partition. q is the template for the partition queues (its
// Name is ignored).
func Partitioned(exchange string, n int, q Queue) Topology {
	t := Topology{Exchanges: []Exchange{{Name: exchange, Kind: "x-consistent-hash"}}}
	for i := range n {
		p := q
		p.Name = PartitionQueue(exchange, i)
		p.SingleActiveConsumer = true
		t.Queues = append(t.Queues, p)
		t.Bindings = append(t.Bindings, Binding{Exchange: exchange, Queue: p.Name, Key: "1"})
	}
	return t
}

// PartitionQueue is the name of partition i of Partitioned(exchange, …).
func PartitionQueue(exchange string, i int) string {
	return exchange + "." + strconv.Itoa(i)
}

// Merge returns the topology with everything of o added.
func (t Topology) Merge(o Topology) Topology {
	return Topology{
		Exchanges: append(append([]Exchange(nil), t.Exchanges...), o.Exchanges...),
		Queues:    append(append([]Queue(nil), t.Queues...), o.Queues...),
		Bindings:  append(append([]Binding(nil), t.Bindings...), o.Bindings...),
	}
}

func (t Topology) validate() error {
	for i, e := range t.Exchanges {
		if e.Name == "" {
			return consumer.ConfigErrorf(fmt.Sprintf("Topology.Exchanges[%d].Name", i), "must not be empty")
		}
	}
	for i, q := range t.Queues {
		if q.Name == "" {
			return consumer.ConfigErrorf(fmt.Sprintf("Topology.Queues[%d].Name", i), "must not be empty")
		}
		if q.DeliveryLimit < 0 {
			return consumer.ConfigErrorf(fmt.Sprintf("Topology.Queues[%d].DeliveryLimit", i), "must be >= 0, got %d", q.DeliveryLimit)
		}
		if q.Classic && q.DeliveryLimit > 0 {
			return consumer.ConfigErrorf(fmt.Sprintf("Topology.Queues[%d].DeliveryLimit", i), "needs a quorum queue (Classic is set)")
		}
	}
	for i, b := range t.Bindings {
		if b.Exchange == "" || b.Queue == "" {
			return consumer.ConfigErrorf(fmt.Sprintf("Topology.Bindings[%d]", i), "needs an Exchange and a Queue")
		}
	}
	return nil
}

// hasExchange reports whether the topology declares an exchange named name.
func (t Topology) hasExchange(name string) bool {
	for _, e := range t.Exchanges {
		if e.Name == name {
			return true
		}
	}
	return false
}

// queue finds the queue named name.
func (t Topology) queue(name string) (Queue, bool) {
	for _, q := range t.Queues {
		if q.Name == name {
			return q, true
		}
	}
	return Queue{}, false
}

func (q Queue) args() amqp.Table {
	a := amqp.Table{}
	for k, v := range q.Args {
		a[k] = v
	}
	if !q.Classic {
		a["x-queue-type"] = "quorum"
	}
	if q.DeadLetterExchange != "" || q.DeadLetterRoutingKey != "" {
		a["x-dead-letter-exchange"] = q.DeadLetterExchange
	}
	if q.DeadLetterRoutingKey != "" {
		a["x-dead-letter-routing-key"] = q.DeadLetterRoutingKey
	}
	if q.DeliveryLimit > 0 {
		a["x-delivery-limit"] = int64(q.DeliveryLimit)
	}
	if q.SingleActiveConsumer {
		a["x-single-active-consumer"] = true
	}
	return a
}

// declareQueue declares q on ch.
func declareQueue(ch *amqp.Channel, q Queue) error {
	if _, err := ch.QueueDeclare(q.Name, true, false, false, false, q.args()); err != nil {
		return fmt.Errorf("queue %q: %w", q.Name, err)
	}
	return nil
}

// defaultDeliveryLimit is the delivery limit RabbitMQ 4.0 and later give a
// quorum queue declared without one.
const defaultDeliveryLimit = 20

// dropLimit says whether RabbitMQ can drop messages of q, a queue of the
// topology, while they are consumed, and past how many deliveries. A
// message is dropped when the queue dead-letters it and has no
// dead-letter exchange: when it passes the queue's delivery limit, or is
// rejected without requeue, which the driver does only past DeliveryLimit.
// Classic queues have no limit. The limit is DeliveryLimit, else an
// x-delivery-limit of Args, else on a broker of version 4.0 or later
// (server, the version it announces) the default of 20 (byDefault). An
// x-delivery-limit of 0 drops a message the first time it goes back; a
// negative one is no limit on 4.x but is taken as 0 by 3.x (both checked
// against the brokers). Policies are not seen: a dead-letter exchange or a
// delivery limit set by a policy is taken for none.
func dropLimit(q Queue, server string) (limit int64, byDefault, drops bool) {
	if q.Classic || q.args()["x-dead-letter-exchange"] != nil {
		return 0, false, false
	}
	if q.DeliveryLimit > 0 {
		return int64(q.DeliveryLimit), false, true
	}
	major := serverMajor(server)
	if v, ok := q.Args["x-delivery-limit"]; ok {
		if n, isInt := intArg(v); isInt {
			switch {
			case n < 0 && major >= 4:
				return 0, false, false
			case n < 0:
				return 0, false, true
			default:
				return n, false, true
			}
		}
	}
	if major >= 4 {
		return defaultDeliveryLimit, true, true
	}
	return 0, false, false
}

// serverMajor is the major version of a broker that announces version
// server, or 0 when it cannot be read.
func serverMajor(server string) int {
	major, _, _ := strings.Cut(server, ".")
	m, err := strconv.Atoi(major)
	if err != nil {
		return 0
	}
	return m
}

// intArg reads an integer declare argument.
func intArg(v any) (int64, bool) {
	switch n := v.(type) {
	case int:
		return int64(n), true
	case int8:
		return int64(n), true
	case int16:
		return int64(n), true
	case int32:
		return int64(n), true
	case int64:
		return n, true
	case uint8:
		return int64(n), true
	case uint16:
		return int64(n), true
	case uint32:
		return int64(n), true
	}
	return 0, false
}

// declare declares the topology on a channel of its own.
func (t Topology) declare(conn *amqp.Connection) error {
	if len(t.Exchanges)+len(t.Queues)+len(t.Bindings) == 0 {
		return nil
	}
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	for _, e := range t.Exchanges {
		kind := e.Kind
		if kind == "" {
			kind = "topic"
		}
		if err := ch.ExchangeDeclare(e.Name, kind, true, false, false, false, e.Args); err != nil {
			return fmt.Errorf("exchange %q: %w", e.Name, err)
		}
	}
	for _, q := range t.Queues {
		if err := declareQueue(ch, q); err != nil {
			return err
		}
	}
	for _, b := range t.Bindings {
		if err := ch.QueueBind(b.Queue, b.Key, b.Exchange, false, b.Args); err != nil {
			return fmt.Errorf("binding %q -> %q (%q): %w", b.Exchange, b.Queue, b.Key, err)
		}
	}
	return nil
}

// bindingsOf returns the bindings to queue.
func (t Topology) bindingsOf(queue string) []Binding {
	var bs []Binding
	for _, b := range t.Bindings {
		if b.Queue == queue {
			bs = append(bs, b)
		}
	}
	return bs
}

// exchangesOf returns the exchanges bound to queue.
func (t Topology) exchangesOf(queue string) []Exchange {
	var es []Exchange
	for _, b := range t.bindingsOf(queue) {
		for _, e := range t.Exchanges {
			if e.Name == b.Exchange {
				es = append(es, e)
			}
		}
	}
	return es
}

// delayQueueName is the delay queue of source for delay d.
func delayQueueName(source string, d time.Duration) string {
	return source + ".ferry-delay." + strconv.FormatInt(d.Milliseconds(), 10) + "ms"
}

// delayQueue is the classic queue that holds retries of source for d, then
// dead-letters them back to source through the default exchange.
func delayQueue(source string, d time.Duration) Queue {
	return Queue{
		Name:                 delayQueueName(source, d),
		Classic:              true,
		DeadLetterExchange:   "",
		DeadLetterRoutingKey: source,
		Args:                 amqp.Table{"x-message-ttl": d.Milliseconds()},
	}
}
