package sqs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

var (
	// ErrClosed is returned (wrapped) by every call on a closed Broker or
	// driver. A consumer whose driver is closed ends its Run with it, marked
	// driver.Fatal.
	ErrClosed = errors.New("sqs: closed")

	// ErrMessageTooLarge is wrapped by the error of a message whose body and
	// attributes exceed the queue's MaximumMessageSize. Publish refuses such
	// a message before any call to SQS; it never truncates one.
	ErrMessageTooLarge = errors.New("sqs: message too large")

	// ErrInvalidMessage is wrapped by the error of a message the queue
	// cannot take as it is: a message without a Key on a FIFO queue.
	ErrInvalidMessage = errors.New("sqs: invalid message")

	// ErrNotSent is wrapped by the error of a message that was not sent
	// because an earlier message of the same key in the same Publish call
	// failed: sending it would let it overtake the failed one.
	ErrNotSent = errors.New("sqs: not sent: an earlier message of its key failed")
)

// EntryError is one entry of a batch call (SendMessageBatch,
// DeleteMessageBatch, ChangeMessageVisibilityBatch) that SQS refused while
// the call as a whole succeeded: SQS answers such calls with HTTP 200 and a
// list of failed entries.
type EntryError struct {
	// Op is the batch action, such as "SendMessageBatch".
	Op string
	// Queue is the queue's name.
	Queue string
	// Code is SQS's error code for the entry, such as
	// "ReceiptHandleIsInvalid" or "InternalError".
	Code string
	// Message is SQS's explanation.
	Message string
	// SenderFault is true when the request was at fault (retrying it
	// unchanged fails again) and false when SQS was (retrying may succeed).
	SenderFault bool
}

func (e *EntryError) Error() string {
	return fmt.Sprintf("sqs: %s on %q: entry failed: %s: %s", e.Op, e.Queue, e.Code, e.Message)
}

func entryError(op, queue string, f types.BatchResultErrorEntry) *EntryError {
	e := &EntryError{Op: op, Queue: queue, SenderFault: f.SenderFault}
	if f.Code != nil {
		e.Code = *f.Code
	}
	if f.Message != nil {
		e.Message = *f.Message
	}
	return e
}

// visibilityLimit reports whether a ChangeMessageVisibility entry failed
// because it would keep the message invisible past SQS's 12 hours after its
// receive: InvalidParameterValue, "Value 43201 for parameter
// VisibilityTimeout is invalid. Reason: Total VisibilityTimeout for the
// message is beyond the limit [43200 seconds]." (An expired handle is
// InvalidParameterValue too, for parameter ReceiptHandle.)
func (e *EntryError) visibilityLimit() bool {
	return e.Code == "InvalidParameterValue" &&
		(strings.Contains(e.Message, "parameter VisibilityTimeout") || strings.Contains(e.Message, "beyond the limit"))
}

// expiredHandle reports whether a batch entry failed because its receipt
// handle is no longer good: the visibility ran out (another receive may hold
// the message now) or the message is gone.
func (e *EntryError) expiredHandle() bool {
	switch e.Code {
	case "ReceiptHandleIsInvalid", "InvalidParameterValue", "MessageNotInflight",
		"AWS.SimpleQueueService.MessageNotInflight":
		return true
	}
	return false
}

// refusalCodes are the error codes of a request SQS refused for good: the
// credentials or the signature are not accepted, the caller may not act on
// the queue, or the queue's configuration (its KMS key, HTTPS only) refuses
// this client. No retry makes them succeed; only a change of configuration
// does. An expired session token (ExpiredToken) is not one: the SDK's
// credential cache fetches fresh credentials once the expiry it was told
// passes, and consuming resumes by itself.
var refusalCodes = map[string]bool{
	"InvalidClientTokenId":         true,
	"UnrecognizedClientException":  true,
	"SignatureDoesNotMatch":        true,
	"InvalidSignatureException":    true,
	"IncompleteSignature":          true,
	"MissingAuthenticationToken":   true,
	"InvalidAccessKeyId":           true,
	"AccessDenied":                 true,
	"AccessDeniedException":        true,
	"NotAuthorized":                true,
	"OptInRequired":                true,
	"InvalidSecurity":              true,
	"KMS.AccessDeniedException":    true,
	"KMS.DisabledException":        true,
	"KMS.NotFoundException":        true,
	"KMS.InvalidKeyUsageException": true,
	"KMS.InvalidStateException":    true,
	"KMS.OptInRequired":            true,
}

// isRefusal reports whether err says that the credentials, the permissions
// or the queue's configuration refuse this client. Typed errors are matched
// with errors.As, the rest by their API error code.
func isRefusal(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var (
		kms      *types.KmsAccessDenied
		kmsOff   *types.KmsDisabled
		kmsGone  *types.KmsNotFound
		kmsUsage *types.KmsInvalidKeyUsage
		kmsState *types.KmsInvalidState
		kmsOptIn *types.KmsOptInRequired
		security *types.InvalidSecurity
	)
	if errors.As(err, &kms) || errors.As(err, &kmsOff) || errors.As(err, &kmsGone) ||
		errors.As(err, &kmsUsage) || errors.As(err, &kmsState) || errors.As(err, &kmsOptIn) ||
		errors.As(err, &security) {
		return true
	}
	var api smithy.APIError
	return errors.As(err, &api) && refusalCodes[api.ErrorCode()]
}

// isUnreachable reports whether err says that SQS did not answer: the
// request could not be sent (a refused or failed dial, a DNS failure), the
// connection broke before the answer, or no answer came in time. An error
// SQS answered with (an API error, a 5xx) is not one: SQS was reached.
func isUnreachable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	var api smithy.APIError
	if errors.As(err, &api) {
		return false
	}
	var (
		send    *smithyhttp.RequestSendError
		timeout *awshttp.ResponseTimeoutError
		netErr  net.Error
	)
	return errors.As(err, &send) || errors.As(err, &timeout) || errors.As(err, &netErr) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// kindOf returns the consumer error that a failed call to SQS stands for
// ([consumer.ErrSourceNotFound], ErrRefused or ErrUnreachable), or nil for a
// failure of another kind (throttling, a 5xx, a bad request).
func kindOf(err error) error {
	switch {
	case err == nil:
		return nil
	case isQueueGone(err):
		return consumer.ErrSourceNotFound
	case isRefusal(err):
		return consumer.ErrRefused
	case isUnreachable(err):
		return consumer.ErrUnreachable
	}
	return nil
}

// callError is the error of a call to SQS about one queue, naming the
// call, the queue and the endpoint it was sent to (never a credential), and
// wrapping both the consumer error it stands for (see kindOf), so that
// errors.Is tells the cases apart as on every broker, and the SDK's error,
// so that errors.As reaches the AWS error inside. A refusal is marked
// [driver.Fatal]: a consumer cannot go on until someone changes its
// configuration. last is what the SDK's last attempt saw, when the call
// ended on its deadline while the SDK waited to try again.
func callError(op, queue, endpoint string, err, last error) error {
	if err == nil {
		return nil
	}
	at := ""
	if endpoint != "" {
		at = " at " + endpoint
	}
	if last != nil && last != err && errors.Is(err, context.DeadlineExceeded) &&
		!errors.Is(last, context.DeadlineExceeded) && !errors.Is(last, context.Canceled) {
		err = fmt.Errorf("%w (last attempt: %w)", err, last)
	}
	kind := kindOf(err)
	if kind == nil {
		return fmt.Errorf("sqs: %s %q%s: %w", op, queue, at, err)
	}
	err = fmt.Errorf("sqs: %s %q%s: %w: %w", op, queue, at, kind, err)
	if kind == consumer.ErrRefused {
		return driver.Fatal(err)
	}
	return err
}

// isQueueGone reports whether err says the queue does not exist.
func isQueueGone(err error) bool {
	var noQueue *types.QueueDoesNotExist
	if errors.As(err, &noQueue) {
		return true
	}
	var api smithy.APIError
	return errors.As(err, &api) && (api.ErrorCode() == "AWS.SimpleQueueService.NonExistentQueue" || api.ErrorCode() == "QueueDoesNotExist")
}
