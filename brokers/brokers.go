// Package brokers links every broker Ferry runs on into a program, so
// that ferry.Open opens each of their URLs:
//
//	import (
//		"github.com/ferrymq/ferry"
//		_ "github.com/ferrymq/ferry/brokers" // kafka://, sqs://, amqp://, amqps://
//	)
//
// Each adapter registers its own URL schemes when it is imported, as a
// database/sql driver does, so that a program links only the SDKs of the
// brokers it imports: a service that runs on Kafka alone imports
// github.com/ferrymq/ferry/kafka (or uses it) and links neither the AWS
// SDK nor amqp091-go. This package is for a program that takes any
// broker's URL, such as the ferry command, at the cost of linking all of
// them: franz-go (package kafka), the AWS SDK (package sqs) and
// amqp091-go (package rabbit). mem:// needs no import.
package brokers

import (
	_ "github.com/ferrymq/ferry/kafka"  // kafka://
	_ "github.com/ferrymq/ferry/rabbit" // amqp://, amqps://
	_ "github.com/ferrymq/ferry/sqs"    // sqs://, SQS queue URLs
)
