package dlqcmd

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/ferrymq/ferry/consumer"
)

// Story is one dead-lettered message and what the ferry-dlq-* headers
// written by consumer.DeadLetter say of it.
type Story struct {
	ID           string            `json:"id"`
	Key          string            `json:"key,omitempty"`
	Source       string            `json:"source,omitempty"`
	MessageID    string            `json:"message_id,omitempty"` // the original message's id
	Lane         string            `json:"lane,omitempty"`
	Offset       string            `json:"offset,omitempty"`
	Reason       string            `json:"reason,omitempty"`
	Attempts     int               `json:"attempts"`
	Deliveries   int               `json:"deliveries"`
	Unseen       int               `json:"unseen_deliveries,omitempty"`
	Error        string            `json:"error,omitempty"`
	ErrorKind    string            `json:"error_kind,omitempty"`
	ErrorType    string            `json:"error_type,omitempty"`
	FirstFailure *time.Time        `json:"first_failure,omitempty"`
	LastFailure  *time.Time        `json:"last_failure,omitempty"`
	PublishedAt  *time.Time        `json:"published_at,omitempty"` // of the original
	Consumer     string            `json:"consumer,omitempty"`
	Host         string            `json:"host,omitempty"`
	Headers      map[string]string `json:"headers,omitempty"` // the message's own headers, without ferry-dlq-*
	Body         string            `json:"body"`
	BodyBase64   bool              `json:"body_base64,omitempty"` // Body is base64: the body is not UTF-8
	BodySize     int               `json:"body_size"`
}

// storyOf reads the story of a dead-lettered message.
func storyOf(m consumer.Message) Story {
	h := m.Headers
	s := Story{
		ID: m.ID, Key: m.Key, Source: h[consumer.HeaderDLQSource], MessageID: h[consumer.HeaderDLQMessageID],
		Lane: h[consumer.HeaderDLQLane], Offset: h[consumer.HeaderDLQOffset], Reason: h[consumer.HeaderDLQReason],
		Error: h[consumer.HeaderDLQError], ErrorKind: h[consumer.HeaderDLQErrorKind], ErrorType: h[consumer.HeaderDLQErrorType],
		Consumer: h[consumer.HeaderDLQConsumer], Host: h[consumer.HeaderDLQHost], BodySize: len(m.Body),
	}
	s.Attempts, _ = strconv.Atoi(h[consumer.HeaderDLQAttempts])
	s.Deliveries, _ = strconv.Atoi(h[consumer.HeaderDLQDeliveries])
	s.Unseen, _ = strconv.Atoi(h[consumer.HeaderDLQUnseenDeliveries])
	s.FirstFailure = timeOf(h[consumer.HeaderDLQFirstFailure])
	s.LastFailure = timeOf(h[consumer.HeaderDLQLastFailure])
	s.PublishedAt = timeOf(h[consumer.HeaderDLQPublishedAt])
	if k := h[consumer.HeaderDLQKey]; s.Key == "" {
		s.Key = k
	}
	for k, v := range h {
		if strings.HasPrefix(k, dlqPrefix) {
			continue
		}
		if s.Headers == nil {
			s.Headers = map[string]string{}
		}
		s.Headers[k] = v
	}
	if utf8.Valid(m.Body) {
		s.Body = string(m.Body)
	} else {
		b, _ := json.Marshal(m.Body) // a JSON string of base64
		s.Body, s.BodyBase64 = strings.Trim(string(b), `"`), true
	}
	return s
}

// dlqPrefix starts the headers DeadLetter writes.
const dlqPrefix = "ferry-dlq-"

func timeOf(v string) *time.Time {
	if v == "" {
		return nil
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return nil
	}
	return &t
}

// writeTable writes the stories as a table, one line each, the last error
// cut to fit.
func writeTable(w io.Writer, stories []Story) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSOURCE\tKEY\tREASON\tATTEMPTS\tFIRST FAILURE\tLAST FAILURE\tLAST ERROR")
	for _, s := range stories {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
			cut(s.ID, 36), dash(s.Source), dash(cut(s.Key, 24)), dash(s.Reason), attempts(s),
			when(s.FirstFailure), when(s.LastFailure), dash(cut(oneLine(s.Error), 60)))
	}
	return tw.Flush()
}

func attempts(s Story) string {
	if s.Attempts == 0 && s.Reason == "" {
		return "-"
	}
	a := strconv.Itoa(s.Attempts)
	if s.Unseen > 0 {
		a += "~" // some runs were inferred from unseen deliveries
	}
	return a
}

func when(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

func cut(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}
