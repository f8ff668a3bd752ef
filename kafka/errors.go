package kafka

import (
	"errors"
)

// Errors returned by the adapter. Match them with errors.Is.
var (
	// ErrClosed is returned by every call on a closed Broker. A consumer's
	// Fetch wraps it with driver.Fatal, so its Run ends.
	ErrClosed = errors.New("kafka: broker closed")

	// ErrAuthentication is wrapped by the error of any call the broker
	// refused because the client could not authenticate (a wrong SASL user
	// or password, a TLS handshake that failed on a certificate), along
	// with consumer.ErrRefused. A consumer's Run ends with it (it is marked
	// driver.Fatal) instead of retrying for ever. The error never carries
	// the password.
	ErrAuthentication = errors.New("kafka: authentication failed")

	// ErrFenced is wrapped by the error that ends a consumer's Run when
	// another member joined its group with the same instance id
	// (WithInstanceID): the coordinator fenced this one, and rejoining would
	// fence the other in turn. Two processes were given one id.
	ErrFenced = errors.New("kafka: fenced by another member with this instance id")

	// ErrPeekShort is wrapped by Peek's error when it could not read a
	// partition up to the end offset it listed: nothing more came for a
	// few seconds. The error names each partition and how far it got.
	ErrPeekShort = errors.New("kafka: peek stopped short of the end")
)
