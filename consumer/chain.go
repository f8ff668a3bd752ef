package consumer

import (
	"context"
	"errors"
)

// This file is what the loop learns from the handler chain it is given
// before it runs it: that no layer of it is nil, and which circuit breakers
// it holds. It follows the Unwrap() Handler method that every middleware in
// Ferry has (and that middleware of the user's own should have: see
// Handler).

// unwrapper is a Handler that wraps another.
type unwrapper interface {
	Unwrap() Handler
}

// gate is a Handler that may hold a message instead of running it: a
// Breaker's. In at-most-once mode the loop asks each gate for its call
// before it acks the message, so that a message a gate would hold is kept,
// not acked and dropped.
type gate interface {
	breaker() *Breaker
}

// nilHandler is implemented by handlers that can tell they would call a nil
// function (JSON of nil).
type nilHandler interface {
	isNil() bool
}

// maxChainDepth bounds the walk down a chain, against an Unwrap that
// returns its own handler.
const maxChainDepth = 1000

// chainParts is what the loop found in a handler chain: the middleware
// whose state it reports in Health, and the breakers it asks before an
// at-most-once ack.
type chainParts struct {
	breakers    []*Breaker
	retries     []*Retry
	deadLetters []*DeadLetter
	metrics     []MetricsSource // other layers' counters (idempotency)
}

// retrier and deadLetterer are the handlers of Retry and DeadLetter.
type retrier interface{ retrier() *Retry }
type deadLetterer interface{ deadLetterer() *DeadLetter }

// Parts is the middleware a handler chain holds, as the loop finds it
// (through the Unwrap methods of its layers), outermost first, each once.
type Parts struct {
	Breakers    []*Breaker
	Retries     []*Retry
	DeadLetters []*DeadLetter
}

// Inspect returns the middleware in h's chain, for a layer of one's own
// that must know it (the Kafka adapter's retry topics keep a record in
// place while a breaker of the chain is not closed). It fails, with a
// *ConfigError, on what Run refuses: a nil handler, or a chain with a nil
// handler inside.
func Inspect(h Handler) (Parts, error) {
	p, err := inspectChain(h)
	return Parts{Breakers: p.breakers, Retries: p.retries, DeadLetters: p.deadLetters}, err
}

// inspectChain walks h down its Unwrap methods, refusing a nil layer, and
// returns the breakers, retries and dead-letter middleware in it, outermost
// first, each once.
func inspectChain(h Handler) (chainParts, error) {
	var p chainParts
	for depth := 0; depth < maxChainDepth; depth++ {
		switch f := h.(type) {
		case nil:
			if depth == 0 {
				return p, ConfigErrorf("Handler", "must not be nil")
			}
			return p, ConfigErrorf("Handler", "middleware at depth %d wraps a nil Handler", depth)
		case HandlerFunc:
			if f == nil {
				return p, ConfigErrorf("Handler", "is a nil HandlerFunc (at depth %d)", depth)
			}
		}
		if n, ok := h.(nilHandler); ok && n.isNil() {
			return p, ConfigErrorf("Handler", "calls a nil function (at depth %d)", depth)
		}
		if g, ok := h.(gate); ok {
			p.breakers = appendOnce(p.breakers, g.breaker())
		}
		if r, ok := h.(retrier); ok {
			p.retries = appendOnce(p.retries, r.retrier())
		}
		if d, ok := h.(deadLetterer); ok {
			p.deadLetters = appendOnce(p.deadLetters, d.deadLetterer())
		}
		if m, ok := h.(metricsSourcer); ok {
			if src := m.MetricsSource(); src != nil {
				p.metrics = appendOnce(p.metrics, src)
			}
		}
		u, ok := h.(unwrapper)
		if !ok {
			break
		}
		h = u.Unwrap()
	}
	return p, nil
}

func appendOnce[T comparable](s []T, v T) []T {
	for _, x := range s {
		if x == v {
			return s
		}
	}
	return append(s, v)
}

// errGateUnused is what an at-most-once reservation that no breaker took
// reports: the call was not made, and the breaker does not count it.
var errGateUnused = errors.New("ferry: breaker reservation unused")

// reservation is one breaker call taken before an at-most-once ack.
type reservation struct {
	b    *Breaker
	call breakerCall // call.done is nil once a run took it
}

// reserveGates takes one call from every breaker of the chain for d. When
// one would hold it, it gives back the calls taken and returns the hold.
func (dp *dispatcher) reserveGates(d *delivery) error {
	for _, b := range dp.breakers {
		call, hold := b.allow(&d.msg, &d.rec)
		if hold != nil {
			dp.releaseReservations(d)
			return hold
		}
		d.reserved = append(d.reserved, reservation{b: b, call: call})
	}
	return nil
}

// releaseReservations gives back the calls that no breaker took.
func (dp *dispatcher) releaseReservations(d *delivery) {
	for _, res := range d.reserved {
		if res.call.done != nil {
			res.call.done(errGateUnused)
		}
	}
	d.reserved = nil
}

// takeReservation returns the call reserved for b before the ack of the
// delivery behind ctx, once; ok is false when there is none.
func takeReservation(ctx context.Context, b *Breaker) (call breakerCall, ok bool) {
	d, found := ctx.Value(reservationKey{}).(*delivery)
	if !found || len(d.reserved) == 0 {
		return breakerCall{}, false
	}
	for i := range d.reserved {
		if res := &d.reserved[i]; res.b == b && res.call.done != nil {
			call = res.call
			res.call.done = nil
			return call, true
		}
	}
	return breakerCall{}, false
}
