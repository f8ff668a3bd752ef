package kafka

import (
	"github.com/twmb/franz-go/pkg/kgo"
)

// HeaderMessageID is the record header that carries [consumer.Message.ID]
// when a publisher sets one. A consumed record without it gets the ID
// topic/partition/offset. It is the ID on the consuming side, not one of
// Message.Headers, as the other brokers' message ids are.
const HeaderMessageID = "ferry-message-id"

// readHeaders returns a consumed record's [HeaderMessageID] (the last, if the
// record has several) and its other headers, nil when it has none: most
// records carry only the id, and building a map costs more than the rest
// of turning a record into a message.
func readHeaders(r *kgo.Record) (id string, headers map[string]string) {
	others := 0
	for i := range r.Headers {
		if h := &r.Headers[i]; h.Key == HeaderMessageID {
			id = string(h.Value)
		} else {
			others++
		}
	}
	if others == 0 {
		return id, nil
	}
	headers = make(map[string]string, others)
	for i := range r.Headers {
		if h := &r.Headers[i]; h.Key != HeaderMessageID {
			headers[h.Key] = string(h.Value)
		}
	}
	return id, headers
}
