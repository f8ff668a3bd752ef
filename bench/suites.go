package bench

import (
	"fmt"

	"github.com/ferrymq/ferry/internal/testenv"
)

// Brokers are the suites' names, in the order they run.
var Brokers = []string{"memory", "kafka", "sqs", "rabbitmq"}

// NewSuite builds the suite of broker, at the addresses the test
// environment names (FERRY_KAFKA_BROKERS, FERRY_SQS_ENDPOINT,
// FERRY_SQS_REGION, FERRY_AMQP_URL, or their defaults). run goes into the
// names of the topics and queues it creates.
func NewSuite(broker, run string) (*Suite, error) {
	switch broker {
	case "memory":
		return MemorySuite()
	case "kafka":
		return KafkaSuite(testenv.KafkaBrokers(), run)
	case "sqs":
		return SQSSuite(SQSConfig{Endpoint: testenv.SQSEndpoint(), Region: testenv.SQSRegion(),
			AccessKey: testenv.SQSAccessKey, SecretKey: testenv.SQSSecretKey}, run)
	case "rabbitmq":
		return RabbitSuite(testenv.AMQPURL(), run)
	}
	return nil, fmt.Errorf("unknown broker %q (want one of %v)", broker, Brokers)
}

// Service is the test environment's service of broker (none for memory).
func Service(broker string) (testenv.Service, bool) {
	switch broker {
	case "kafka":
		return testenv.Kafka, true
	case "sqs":
		return testenv.SQS, true
	case "rabbitmq":
		return testenv.RabbitMQ, true
	}
	return "", false
}
