package demo

// Run takes any broker's URL (Config.Broker), and ferry.Open opens only
// the brokers whose packages the program links: this links all of them.
import _ "github.com/ferrymq/ferry/brokers"
