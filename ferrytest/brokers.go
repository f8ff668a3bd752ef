package ferrytest

// The kit opens every broker through [ferry.Open], which opens only the
// brokers whose packages the program links: this links all of them.
import _ "github.com/ferrymq/ferry/brokers"
