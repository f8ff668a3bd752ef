package rabbit

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer/driver"
)

// toMessage turns a delivery into the loop's message.
func (d *queueDriver) toMessage(dv *amqp.Delivery) driver.Message {
	m := driver.Message{
		ID:     dv.MessageId,
		Key:    dv.RoutingKey,
		Body:   dv.Body,
		Source: d.queue,
		Offset: -1,
	}
	if dv.Exchange == "" || strings.HasPrefix(dv.Exchange, scheduleExchangePrefix) {
		// Through the default exchange the routing key is the queue's
		// name, not a key, and through the delay levels it spells the
		// delay: a keyed message has its Key in HeaderKey.
		m.Key = ""
	}
	if !dv.Timestamp.IsZero() {
		m.PublishedAt = dv.Timestamp
	}
	carried := 0
	var xdc int64 = -1
	if len(dv.Headers) > 0 {
		m.Headers = make(map[string]string, len(dv.Headers))
		for k, v := range dv.Headers {
			switch k {
			case HeaderKey:
				if s, ok := v.(string); ok {
					m.Key = s
				}
				continue
			case headerDeliveries:
				if s, ok := v.(string); ok {
					carried, _ = strconv.Atoi(s)
				}
				continue
			case headerHistory:
				if s, ok := v.(string); ok {
					m.Known = parseHistory(s)
				}
				continue
			case "x-delivery-count":
				xdc = toInt64(v)
			}
			if s, ok := headerString(v); ok {
				m.Headers[k] = s
			}
		}
		dropScheduleDeaths(m.Headers, dv.Headers["x-death"])
		if len(m.Headers) == 0 {
			m.Headers = nil
		}
	}
	switch {
	case xdc >= 0: // a quorum queue, after the first delivery
		m.Deliveries = carried + int(xdc) + 1
	case dv.Redelivered: // a classic queue counts no further
		m.Deliveries = carried + 2
	default:
		m.Deliveries = carried + 1
	}
	if m.ID == "" {
		// No message id: a stable one from what the message is.
		h := sha256.New()
		h.Write([]byte(dv.Exchange))
		h.Write([]byte{0})
		h.Write([]byte(dv.RoutingKey))
		h.Write([]byte{0})
		h.Write(dv.Body)
		m.ID = "sha256:" + hex.EncodeToString(h.Sum(nil)[:16])
	}
	if d.laneKey {
		m.Lane = m.Key
	}
	return m
}

func toInt64(v any) int64 {
	switch n := v.(type) {
	case int64:
		return n
	case int32:
		return int64(n)
	case int16:
		return int64(n)
	case int8:
		return int64(n)
	case int:
		return int64(n)
	case uint8:
		return int64(n)
	case uint16:
		return int64(n)
	case uint32:
		return int64(n)
	}
	return -1
}

// headerString turns a header value into a string header, where it is a
// scalar; tables and arrays (x-death) are left to Message.As.
func headerString(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case []byte:
		return string(x), true
	case bool:
		return strconv.FormatBool(x), true
	case time.Time:
		return x.UTC().Format(time.RFC3339), true
	case float32:
		return strconv.FormatFloat(float64(x), 'g', -1, 32), true
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64), true
	}
	switch v.(type) {
	case int64, int32, int16, int8, int, uint8, uint16, uint32:
		return strconv.FormatInt(toInt64(v), 10), true
	}
	return "", false
}

func formatHistory(h driver.History) string {
	ff := int64(0)
	if !h.FirstFailure.IsZero() {
		ff = h.FirstFailure.UnixNano()
	}
	return fmt.Sprintf("%d,%d,%d,%d", h.Runs, h.Deliveries, h.Unseen, ff)
}

func parseHistory(s string) driver.History {
	f := strings.Split(s, ",")
	if len(f) != 4 {
		return driver.History{}
	}
	var n [4]int64
	for i, x := range f {
		v, err := strconv.ParseInt(x, 10, 64)
		if err != nil || v < 0 {
			return driver.History{}
		}
		n[i] = v
	}
	h := driver.History{Runs: int(n[0]), Deliveries: int(n[1]), Unseen: int(n[2])}
	if n[3] > 0 {
		h.FirstFailure = time.Unix(0, n[3])
	}
	return h
}

// dropScheduleDeaths takes the delay levels of delayed publish out of the
// first and last death headers (a level's queue dead-letters a message when
// its time there is up, and a delayed message is not a dead-lettered one).
// Where a level is named, both are set again from the deaths of xDeath (the
// x-death table, newest first) that are not a level's, or removed when
// there are none; RabbitMQ 3.10 sets only the first death, which a delayed
// message always had in a level. The x-death table keeps every record, for
// Message.As.
func dropScheduleDeaths(headers map[string]string, xDeath any) {
	if !strings.HasPrefix(headers["x-first-death-queue"], scheduleLevelPrefix) &&
		!strings.HasPrefix(headers["x-last-death-queue"], scheduleLevelPrefix) {
		return
	}
	for _, which := range [...]string{"x-first-death-", "x-last-death-"} {
		delete(headers, which+"queue")
		delete(headers, which+"exchange")
		delete(headers, which+"reason")
	}
	deaths, _ := xDeath.([]any)
	var real []amqp.Table
	for _, d := range deaths {
		if t, ok := d.(amqp.Table); ok {
			if q, _ := t["queue"].(string); q != "" && !strings.HasPrefix(q, scheduleLevelPrefix) {
				real = append(real, t)
			}
		}
	}
	if len(real) == 0 {
		return
	}
	set := func(which string, t amqp.Table) {
		for _, f := range [...]string{"queue", "exchange", "reason"} {
			if v, ok := t[f].(string); ok {
				headers[which+f] = v
			}
		}
	}
	set("x-first-death-", real[len(real)-1])
	set("x-last-death-", real[0])
}
