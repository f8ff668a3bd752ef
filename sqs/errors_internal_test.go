package sqs

import "testing"

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
