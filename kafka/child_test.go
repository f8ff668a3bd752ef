package kafka_test

const childEnv = "FERRY_KAFKA_TEST_CHILD"

func runChild() int { return 0 }
