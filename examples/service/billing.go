package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/outbox"
)

// OrderPlaced is the event the order API writes to the outbox for each
// order, and billing pays.
type OrderPlaced struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
}

// eventID is the id of an order's OrderPlaced event. An order is placed
// once, so its event has one id for good, whoever publishes it and however
// often: the inbox keys on it.
func eventID(orderID string) string { return "order-placed/" + orderID }

// billing pays orders.
type billing struct {
	st       *store
	payments string // the provider's charge endpoint; "" records only
	client   *http.Client
	log      *slog.Logger
}

func newBilling(st *store, paymentsURL string, log *slog.Logger) *billing {
	return &billing{st: st, payments: paymentsURL, client: &http.Client{Timeout: 20 * time.Second}, log: log}
}

// handler returns billing's handler: it charges the order, then records
// the payment through record, the transactional inbox over b.record, where
// the payment row and the event's key commit together, once per event id.
//
// The charge comes first, outside the inbox's transaction, because no
// transaction should stay open across a call to another service (on
// SQLite it would hold every writer back). A delivery of an event already
// paid therefore asks the provider again, with the same Idempotency-Key,
// and the provider answers without charging twice; the inbox then finds
// the key and records nothing.
func (b *billing) handler(record consumer.Handler) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		o, err := decodeOrder(m)
		if err != nil {
			return err
		}
		if err := b.charge(ctx, m.Headers[outbox.EventIDHeader], o); err != nil {
			return err
		}
		return record.Handle(ctx, m)
	})
}

// decodeOrder decodes an OrderPlaced event. One that does not decode is a
// permanent error: it is dead-lettered at once.
func decodeOrder(m *consumer.Message) (OrderPlaced, error) {
	var o OrderPlaced
	if err := json.Unmarshal(m.Body, &o); err != nil {
		return o, consumer.Permanent(fmt.Errorf("order event %q: %w", m.ID, err))
	}
	if o.OrderID == "" || o.AmountCents <= 0 {
		return o, consumer.Permanent(fmt.Errorf("order event %q: needs an order_id and a positive amount_cents", m.ID))
	}
	return o, nil
}

// record runs in the inbox's transaction, once per event id: it records
// the payment in tx, which commits with the event's key.
func (b *billing) record(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
	o, err := decodeOrder(m)
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, b.st.q(`INSERT INTO payments (order_id, event_id, amount_cents, paid_at) VALUES (?, ?, ?, ?)`),
		o.OrderID, m.Headers[outbox.EventIDHeader], o.AmountCents, time.Now().UTC().Format(time.RFC3339Nano)); err != nil {
		return fmt.Errorf("record payment of %s: %w", o.OrderID, err)
	}
	b.log.InfoContext(ctx, "order paid", "order_id", o.OrderID, "amount_cents", o.AmountCents, "attempt", m.Attempt,
		"trace_id", trace.SpanContextFromContext(ctx).TraceID().String())
	return nil
}

// charge asks the payment provider to charge the order, with the event id
// as the Idempotency-Key: every delivery of the event (a redelivery after a
// crash, a duplicate) asks with the same key, and the provider charges
// once.
func (b *billing) charge(ctx context.Context, key string, o OrderPlaced) error {
	if b.payments == "" {
		return nil
	}
	body, _ := json.Marshal(o)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.payments, bytes.NewReader(body))
	if err != nil {
		return consumer.Permanent(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := b.client.Do(req)
	if err != nil {
		return fmt.Errorf("charge %s: %w", o.OrderID, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	switch {
	case resp.StatusCode < 300:
		return nil
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		err := fmt.Errorf("charge %s: the payment provider answered %s", o.OrderID, resp.Status)
		if s, perr := strconv.Atoi(resp.Header.Get("Retry-After")); perr == nil && s > 0 {
			return consumer.RetryAfter(err, time.Duration(s)*time.Second)
		}
		return err
	default:
		// The provider refused the charge itself: no retry changes that.
		return consumer.Permanent(fmt.Errorf("charge %s: the payment provider refused it: %s", o.OrderID, resp.Status))
	}
}
