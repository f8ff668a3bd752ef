package sqs

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// TestVisibilityLimitIsNotAnExpiredHandle: SQS answers an extension past
// its 12 hours with InvalidParameterValue, the code it also gives an
// expired receipt handle; the driver tells them apart by the parameter
// named, so the first counts as VisibilityCapped and not as LeasesLost.
// (ElasticMQ does not enforce the 12 hours, so the messages are SQS's.)
func TestVisibilityLimitIsNotAnExpiredHandle(t *testing.T) {
	capped := &EntryError{Code: "InvalidParameterValue", Message: "Value 43201 for parameter VisibilityTimeout is invalid. Reason: Total VisibilityTimeout for the message is beyond the limit [43200 seconds]."}
	if !capped.visibilityLimit() {
		t.Errorf("%q not taken for the visibility limit", capped.Message)
	}
	expired := &EntryError{Code: "InvalidParameterValue", Message: "Value AQEB for parameter ReceiptHandle is invalid. Reason: Message does not exist or is not available for visibility timeout change."}
	if expired.visibilityLimit() || !expired.expiredHandle() {
		t.Errorf("%q: visibilityLimit %v, expiredHandle %v; want an expired handle", expired.Message, expired.visibilityLimit(), expired.expiredHandle())
	}
}

// sdkError wraps apiErr as the SDK returns an error SQS answered with: an
// operation error around the HTTP response error.
func sdkError(op string, status int, apiErr error) error {
	return &smithy.OperationError{ServiceID: "SQS", OperationName: op, Err: &awshttp.ResponseError{
		ResponseError: &smithyhttp.ResponseError{Response: &smithyhttp.Response{Response: &http.Response{StatusCode: status}}, Err: apiErr},
		RequestID:     "f0e1d2c3",
	}}
}

// TestRefusalCodesAreFatal: every error SQS answers when it refuses the
// client for good (credentials, signature, permissions, the queue's KMS
// key or HTTPS policy), as the SDK returns it, is classified as a refusal:
// marked driver.Fatal, wrapping consumer.ErrRefused and the SDK's error,
// naming the call, the queue and the endpoint. Errors worth retrying (a
// missing queue, throttling, SQS's own failures, an unreachable endpoint)
// are not fatal, and say which of them they are. ElasticMQ checks no
// credentials, so these are the SDK's error values, built as it builds
// them.
func TestRefusalCodesAreFatal(t *testing.T) {
	refused := []error{
		&smithy.GenericAPIError{Code: "InvalidClientTokenId", Message: "The security token included in the request is invalid.", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "UnrecognizedClientException", Message: "The security token included in the request is invalid.", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "SignatureDoesNotMatch", Message: "The request signature we calculated does not match the signature you provided.", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "InvalidSignatureException", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "IncompleteSignature", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "MissingAuthenticationToken", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "InvalidAccessKeyId", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "AccessDenied", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "AccessDeniedException", Message: "User: arn:aws:iam::123456789012:user/app is not authorized to perform: sqs:receivemessage", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "NotAuthorized", Fault: smithy.FaultClient},
		&smithy.GenericAPIError{Code: "OptInRequired", Fault: smithy.FaultClient},
		&types.InvalidSecurity{Message: aws.String("The request was not made over HTTPS or did not use SigV4 for signing.")},
		&types.KmsAccessDenied{Message: aws.String("The caller doesn't have the required KMS access.")},
		&types.KmsDisabled{}, &types.KmsNotFound{}, &types.KmsInvalidKeyUsage{}, &types.KmsInvalidState{}, &types.KmsOptInRequired{},
		// The query-compatible code SQS sends in x-amzn-query-error.
		&smithy.GenericAPIError{Code: "KMS.AccessDeniedException", Fault: smithy.FaultClient},
	}
	for _, apiErr := range refused {
		err := callError("ReceiveMessage", "orders", "sqs.eu-west-1.amazonaws.com", sdkError("ReceiveMessage", 403, apiErr), nil)
		var api smithy.APIError
		if !driver.IsFatal(err) || !errors.Is(err, consumer.ErrRefused) || !errors.As(err, &api) || api.ErrorCode() != apiErr.(smithy.APIError).ErrorCode() {
			t.Errorf("%T %v: classified %v; want fatal, wrapping consumer.ErrRefused and the API error", apiErr, apiErr, err)
		}
		if msg := err.Error(); !strings.Contains(msg, `ReceiveMessage "orders" at sqs.eu-west-1.amazonaws.com`) {
			t.Errorf("%q does not name the call, the queue and the endpoint", msg)
		}
	}

	dial := &smithyhttp.RequestSendError{Err: &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9324}, Err: syscall.ECONNREFUSED}}
	for _, tc := range []struct {
		name string
		err  error
		kind error // nil: none of the three
	}{
		{"missing queue, typed", sdkError("ReceiveMessage", 400, &types.QueueDoesNotExist{Message: aws.String("The specified queue does not exist.")}), consumer.ErrSourceNotFound},
		{"missing queue, query code", sdkError("GetQueueUrl", 400, &smithy.GenericAPIError{Code: "AWS.SimpleQueueService.NonExistentQueue"}), consumer.ErrSourceNotFound},
		{"refused dial", &smithy.OperationError{ServiceID: "SQS", OperationName: "ReceiveMessage", Err: dial}, consumer.ErrUnreachable},
		{"no answer in time", &smithy.OperationError{ServiceID: "SQS", OperationName: "ReceiveMessage", Err: &aws.RequestCanceledError{Err: context.DeadlineExceeded}}, consumer.ErrUnreachable},
		{"connection cut", &smithy.OperationError{ServiceID: "SQS", OperationName: "ReceiveMessage", Err: &smithyhttp.RequestSendError{Err: io.ErrUnexpectedEOF}}, consumer.ErrUnreachable},
		{"throttled", sdkError("ReceiveMessage", 400, &types.RequestThrottled{}), nil},
		{"SQS failing", sdkError("ReceiveMessage", 500, &smithy.GenericAPIError{Code: "InternalFailure", Fault: smithy.FaultServer}), nil},
		{"expired session token", sdkError("ReceiveMessage", 400, &smithy.GenericAPIError{Code: "ExpiredToken", Fault: smithy.FaultClient}), nil},
	} {
		err := callError("ReceiveMessage", "orders", "127.0.0.1:9324", tc.err, nil)
		if driver.IsFatal(err) || errors.Is(err, consumer.ErrRefused) {
			t.Errorf("%s: %v is fatal; want it retried", tc.name, err)
		}
		for _, kind := range []error{consumer.ErrSourceNotFound, consumer.ErrUnreachable} {
			if errors.Is(err, kind) != (kind == tc.kind) {
				t.Errorf("%s: %v wraps %v: %v, want %v", tc.name, err, kind, errors.Is(err, kind), kind == tc.kind)
			}
		}
		if !errors.Is(err, tc.err) {
			t.Errorf("%s: %v does not wrap the SDK's error", tc.name, err)
		}
	}

	// A call that ended on its deadline while the SDK waited to try again
	// says what the last attempt saw.
	err := callError("ReceiveMessage", "orders", "127.0.0.1:9324",
		&smithy.OperationError{ServiceID: "SQS", OperationName: "ReceiveMessage", Err: &aws.RequestCanceledError{Err: context.DeadlineExceeded}}, dial)
	if !strings.Contains(err.Error(), "connection refused") || !errors.Is(err, consumer.ErrUnreachable) {
		t.Errorf("%v: want the last attempt's refused dial named", err)
	}
}
