package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/outbox"
)

// healthRoutes serves the probes of the consumer loop, as package consumer
// recommends wiring them:
//
// /livez is consumer.LivenessHandler: 503 only when the loop is stopped or
// wedged, the states a restart cures. An open circuit breaker must never
// fail it (the orchestrator would restart every replica during the outage
// the breaker rides out), nor a broker that is down.
//
// /readyz is consumer.ReadinessHandler: 503 with the figures for every
// state but steady and downstream slow (starting, disconnected, protected,
// retry storm, ...), and 503 once the shutdown began.
func healthRoutes(mux *http.ServeMux, loop *consumer.Loop, state *lifecycle) {
	// Liveness fails only when the consumer is stopped or wedged (no
	// progress while messages wait): an open breaker or a broker that is
	// down never restarts the pod.
	mux.Handle("GET /livez", consumer.LivenessHandler(loop))
	ready := consumer.ReadinessHandler(loop)
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if state.draining.Load() {
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		}
		ready.ServeHTTP(w, r)
	})
}

// order is an order as the API takes and shows it.
type order struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Payments    *int   `json:"payments,omitempty"` // GET only: payments recorded
	TraceID     string `json:"trace_id,omitempty"` // POST only: the trace that follows it
}

// orderRoutes serves POST /orders, which places an order and writes its
// OrderPlaced event to destination in the same transaction, and GET
// /orders/{id}.
func orderRoutes(mux *http.ServeMux, st *store, tp trace.TracerProvider, destination string, log *slog.Logger) {
	tracer := tp.Tracer("github.com/ferrymq/ferry/examples/service")
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		// The event written inside this span carries its trace context, so
		// the relay's publish and billing's payment join this trace.
		ctx, span := tracer.Start(r.Context(), "POST /orders", trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
		var o order
		dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&o); err != nil {
			http.Error(w, "the body is not an order: "+err.Error(), http.StatusBadRequest)
			return
		}
		if o.OrderID == "" || len(o.OrderID) > 100 || o.AmountCents <= 0 || o.Payments != nil || o.TraceID != "" {
			http.Error(w, "an order needs an order_id (at most 100 bytes) and a positive amount_cents, and nothing else", http.StatusBadRequest)
			return
		}
		span.SetAttributes(attribute.String("order.id", o.OrderID))
		err := placeOrder(ctx, st, destination, o)
		switch {
		case errors.Is(err, errExists):
			http.Error(w, fmt.Sprintf("order %s exists", o.OrderID), http.StatusConflict)
			return
		case err != nil:
			span.SetStatus(codes.Error, err.Error())
			log.ErrorContext(ctx, "place order", "order_id", o.OrderID, "err", err)
			http.Error(w, "the order could not be placed", http.StatusServiceUnavailable)
			return
		}
		log.InfoContext(ctx, "order placed", "order_id", o.OrderID, "amount_cents", o.AmountCents,
			"trace_id", span.SpanContext().TraceID().String())
		writeJSON(w, http.StatusCreated, order{OrderID: o.OrderID, AmountCents: o.AmountCents, TraceID: span.SpanContext().TraceID().String()})
	})
	mux.HandleFunc("GET /orders/{id}", func(w http.ResponseWriter, r *http.Request) {
		o, err := getOrder(r.Context(), st, r.PathValue("id"))
		switch {
		case errors.Is(err, errNotFound):
			http.Error(w, "no such order", http.StatusNotFound)
		case err != nil:
			log.ErrorContext(r.Context(), "get order", "err", err)
			http.Error(w, "the order could not be read", http.StatusServiceUnavailable)
		default:
			writeJSON(w, http.StatusOK, o)
		}
	})
}

// errNotFound is getOrder's error for an unknown order.
var errNotFound = errors.New("no such order")

// errExists is placeOrder's error for an order placed before.
var errExists = errors.New("order exists")

// placeOrder writes the order and its event in one transaction: both
// commit, or neither does.
func placeOrder(ctx context.Context, st *store, destination string, o order) error {
	body, err := json.Marshal(OrderPlaced{OrderID: o.OrderID, AmountCents: o.AmountCents})
	if err != nil {
		return err
	}
	tx, err := st.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }() // a no-op after Commit
	res, err := tx.ExecContext(ctx, st.q(`INSERT INTO orders (order_id, amount_cents, placed_at) VALUES (?, ?, ?) ON CONFLICT (order_id) DO NOTHING`),
		o.OrderID, o.AmountCents, time.Now().UTC().Format(time.RFC3339Nano))
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil {
		return err
	} else if n == 0 {
		return errExists
	}
	// The key keeps an order's events in order (one Kafka partition, one
	// outbox lane).
	ev := outbox.Event{ID: eventID(o.OrderID), Destination: destination, Key: o.OrderID, Body: body}
	if err := st.add(ctx, tx, ev); err != nil {
		return err
	}
	return tx.Commit()
}

// getOrder reads an order and counts its payments.
func getOrder(ctx context.Context, st *store, id string) (order, error) {
	o := order{OrderID: id}
	var payments int
	err := st.db.QueryRowContext(ctx, st.q(`SELECT o.amount_cents, (SELECT count(*) FROM payments p WHERE p.order_id = o.order_id)
FROM orders o WHERE o.order_id = ?`), id).Scan(&o.AmountCents, &payments)
	if errors.Is(err, sql.ErrNoRows) {
		return o, errNotFound
	}
	o.Payments = &payments
	return o, err
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	_ = enc.Encode(v)
}
