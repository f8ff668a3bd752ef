package main

// A child opens its broker with ferry.Open from the run's BrokerURL, which
// may name any broker: this links all of them.
import _ "github.com/ferrymq/ferry/brokers"
