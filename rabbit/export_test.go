package rabbit

// AckFrames is how many basic.ack frames d sent.
func AckFrames(d *Driver) int64 { return d.ackFrames.Load() }
