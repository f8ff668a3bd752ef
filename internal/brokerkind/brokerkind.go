// Package brokerkind is the one spelling of "which broker": the names
// ferrytest.Kind, testenv.Service, the ferry command's cli.Kind and the
// benchmarks use for the brokers Ferry supports. It is a package of its own,
// importing nothing, so that the ferry command can name a broker without
// linking the test helpers (testenv and ferrytest import testing).
package brokerkind

// The brokers, as every package that names one spells them.
const (
	// Memory is the in-process broker of package memory.
	Memory = "memory"
	// Kafka is Apache Kafka.
	Kafka = "kafka"
	// SQS is Amazon SQS or a compatible server (ElasticMQ).
	SQS = "sqs"
	// RabbitMQ is RabbitMQ, spoken to over AMQP 0-9-1.
	RabbitMQ = "rabbitmq"
)
