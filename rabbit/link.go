package rabbit

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
)

// This file sorts what the client meets reaching the broker and the queue
// into the three kinds every broker of Ferry reports ([consumer.ErrUnreachable],
// [consumer.ErrSourceNotFound], [consumer.ErrRefused]), so that the loop retries
// the first two with backoff and ends Run on the third, as on Kafka and SQS.

// linkKind returns the kind err already carries, or nil.
func linkKind(err error) error {
	for _, k := range []error{consumer.ErrRefused, consumer.ErrSourceNotFound, consumer.ErrUnreachable} {
		if errors.Is(err, k) {
			return k
		}
	}
	return nil
}

// stage is where an error was met, which decides what some codes mean.
type stage uint8

const (
	// stageHandshake: opening the connection (TCP, TLS, the AMQP
	// handshake, the vhost).
	stageHandshake stage = iota
	// stageDeclare: declaring or binding the queue, its exchanges, or the
	// Topology: a 406 there is a declaration the broker rejects (other
	// arguments than the existing queue's).
	stageDeclare
	// stageRunning: a channel or connection closed while in use, or a
	// channel method failing on it.
	stageRunning
)

// classify returns the kind of err, met at st; nil when it is none of them
// (a channel closed for an ack timeout, 405 RESOURCE_LOCKED on another
// connection's exclusive queue: reported as they are, and retried).
// connectedBefore says whether the Broker ever opened a connection: a vhost
// refused at the first connect is a wrong URL, and on a reconnect what a
// restarting node answers before its vhosts are up.
func classify(err error, st stage, connectedBefore bool) error {
	if err == nil {
		return nil
	}
	if k := linkKind(err); k != nil {
		return k
	}
	if errors.Is(err, amqp.ErrVhost) {
		return vhostKind(connectedBefore)
	}
	if errors.Is(err, amqp.ErrCredentials) || errors.Is(err, amqp.ErrSASL) {
		return consumer.ErrRefused
	}
	if isTLSRefusal(err) {
		return consumer.ErrRefused
	}
	var ae *amqp.Error
	if !errors.As(err, &ae) {
		// A dial refused or timed out, a reset, an EOF, a deadline: the
		// broker is not there, or not yet.
		return consumer.ErrUnreachable
	}
	switch ae.Code {
	case amqp.AccessRefused:
		return consumer.ErrRefused
	case amqp.NotAllowed:
		return vhostKind(connectedBefore)
	case amqp.NotFound:
		return consumer.ErrSourceNotFound
	case amqp.PreconditionFailed:
		if st == stageDeclare {
			return consumer.ErrRefused
		}
		return nil
	case amqp.FrameError, amqp.SyntaxError, amqp.CommandInvalid, amqp.UnexpectedFrame:
		if st == stageHandshake && !ae.Server {
			// What answered is not AMQP 0-9-1: a TLS listener reached
			// with amqp://, or another protocol on that port.
			return consumer.ErrRefused
		}
		return consumer.ErrUnreachable
	case amqp.ConnectionForced, amqp.ChannelError, amqp.ResourceError, amqp.InternalError:
		return consumer.ErrUnreachable
	}
	if st == stageHandshake {
		// No connection came of it, whatever the broker said.
		return consumer.ErrUnreachable
	}
	return nil
}

func vhostKind(connectedBefore bool) error {
	if connectedBefore {
		return consumer.ErrUnreachable
	}
	return consumer.ErrRefused
}

// isTLSRefusal reports whether err is a TLS handshake no retry can fix: a
// certificate not trusted or not for the host, an alert from the server,
// or a plaintext listener reached with amqps://.
func isTLSRefusal(err error) bool {
	var (
		cv  *tls.CertificateVerificationError
		rh  tls.RecordHeaderError
		al  tls.AlertError
		ua  x509.UnknownAuthorityError
		he  x509.HostnameError
		ci  x509.CertificateInvalidError
		sys x509.SystemRootsError
	)
	return errors.As(err, &cv) || errors.As(err, &rh) || errors.As(err, &al) || errors.As(err, &ua) ||
		errors.As(err, &he) || errors.As(err, &ci) || errors.As(err, &sys)
}

// withKind returns err wrapping its kind (see classify) when it does not
// already, its text then "<kind>: <err>".
func withKind(err error, st stage, connectedBefore bool) error {
	if err == nil || linkKind(err) != nil {
		return err
	}
	if k := classify(err, st, connectedBefore); k != nil {
		return fmt.Errorf("%w: %w", k, err)
	}
	return err
}
