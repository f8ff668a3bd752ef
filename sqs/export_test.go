package sqs

import (
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// SetMaxVisibility shortens the visibility limit after one receive (SQS's
// 12 hours) of a driver made by Broker.Driver, so that a test can reach it.
// Call it before the driver is used.
func SetMaxVisibility(d driver.Driver, v time.Duration) { d.(*sqsDriver).maxVis = v }
