package memory

// Waiting reports how many fetches wait on the queue, so that tests can
// start an action only once a fetch is blocked.
func Waiting(b *Broker, queue string) int {
	q := b.lookup(queue)
	if q == nil {
		return 0
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.waiting
}
