package bench

import (
	"fmt"

	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/internal/testenv"
)

// Brokers are the suites' brokers, in the order they run: ferrytest.Kinds
// but Kafka's share groups, which have no suite yet.
var Brokers = []ferrytest.Kind{ferrytest.Memory, ferrytest.Kafka, ferrytest.SQS, ferrytest.RabbitMQ}

// NewSuite builds the suite of broker, at the addresses the test
// environment names (FERRY_KAFKA_BROKERS, FERRY_SQS_ENDPOINT,
// FERRY_SQS_REGION, FERRY_AMQP_URL, or their defaults). run goes into the
// names of the topics and queues it creates.
func NewSuite(broker ferrytest.Kind, run string) (*Suite, error) {
	switch broker {
	case ferrytest.Memory:
		return MemorySuite()
	case ferrytest.Kafka:
		return KafkaSuite(testenv.KafkaBrokers(), run)
	case ferrytest.SQS:
		return SQSSuite(SQSConfig{Endpoint: testenv.SQSEndpoint(), Region: testenv.SQSRegion(),
			AccessKey: testenv.SQSAccessKey, SecretKey: testenv.SQSSecretKey}, run)
	case ferrytest.RabbitMQ:
		return RabbitSuite(testenv.AMQPURL(), run)
	}
	return nil, fmt.Errorf("unknown broker %q (want one of %v)", broker, Brokers)
}
