package rabbit

import (
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// AckFrames is how many basic.ack frames d, a driver of Broker.Driver,
// sent.
func AckFrames(d driver.Driver) int64 { return d.(*queueDriver).ackFrames.Load() }

// NodeURLs splits a URL naming several nodes into one URL a node.
var NodeURLs = nodeURLs

// SetOrphanCheck sets how often b counts ferry.delay.orphans, before its
// first delayed publish.
func SetOrphanCheck(b *Broker, every time.Duration) { b.orphans.every = every }
