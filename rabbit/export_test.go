package rabbit

import "github.com/ferrymq/ferry/consumer/driver"

// AckFrames is how many basic.ack frames d, a driver of Broker.Driver,
// sent.
func AckFrames(d driver.Driver) int64 { return d.(*queueDriver).ackFrames.Load() }

// NodeURLs splits a URL naming several nodes into one URL a node.
var NodeURLs = nodeURLs
