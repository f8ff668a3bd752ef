package sqs

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"
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

// fatalCodes are the error codes after which consuming cannot go on by
// itself: the queue is gone, the credentials are wrong, or the caller may not
// act on the queue. Retrying them only hides the problem.
var fatalCodes = map[string]bool{
	"AWS.SimpleQueueService.NonExistentQueue": true,
	"QueueDoesNotExist":                       true,
	"InvalidClientTokenId":                    true,
	"UnrecognizedClientException":             true,
	"SignatureDoesNotMatch":                   true,
	"IncompleteSignature":                     true,
	"MissingAuthenticationToken":              true,
	"InvalidAccessKeyId":                      true,
	"AccessDenied":                            true,
	"AccessDeniedException":                   true,
	"KMS.AccessDeniedException":               true,
	"KMS.DisabledException":                   true,
	"KMS.NotFoundException":                   true,
	"OptInRequired":                           true,
	"InvalidSecurity":                         true,
}

// isFatal reports whether err says that the queue, the credentials or the
// permissions are wrong, as opposed to a failure worth retrying. Typed
// errors are matched with errors.As, the rest by their API error code.
func isFatal(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var (
		noQueue  *types.QueueDoesNotExist
		kms      *types.KmsAccessDenied
		kmsOff   *types.KmsDisabled
		kmsGone  *types.KmsNotFound
		security *types.InvalidSecurity
	)
	if errors.As(err, &noQueue) || errors.As(err, &kms) || errors.As(err, &kmsOff) ||
		errors.As(err, &kmsGone) || errors.As(err, &security) {
		return true
	}
	var api smithy.APIError
	return errors.As(err, &api) && fatalCodes[api.ErrorCode()]
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
