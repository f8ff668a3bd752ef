package consumer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
)

// DecodeError says why a message body did not decode, naming the field or
// the byte offset where decoding failed. JSON handlers return it wrapped in
// Permanent, so the message goes to the dead-letter destination with this as
// its reason instead of being retried.
type DecodeError struct {
	// Field is the dotted path of the field that had the wrong type, or "".
	Field string
	// Offset is the byte offset in the body where decoding failed, or -1.
	Offset int64
	// Err is the decoder's own error.
	Err error
}

func (e *DecodeError) Error() string {
	switch {
	case e.Field != "":
		return fmt.Sprintf("decode JSON body: field %q (at byte %d): %v", e.Field, e.Offset, e.Err)
	case e.Offset >= 0:
		return fmt.Sprintf("decode JSON body: at byte %d: %v", e.Offset, e.Err)
	}
	return "decode JSON body: " + e.Err.Error()
}

// Unwrap returns the decoder's error.
func (e *DecodeError) Unwrap() error { return e.Err }

// errEmptyBody is the reason an empty body does not decode as JSON.
var errEmptyBody = errors.New("empty body")

// errNullBody is the reason a body of JSON null is refused.
var errNullBody = errors.New("body is null")

// JSON returns a Handler that decodes each message body as JSON into a T and
// calls fn with it. A body that does not decode is a permanent error (a
// *DecodeError naming the field or byte offset, wrapped in Permanent): no
// retry can fix it, so it goes to the dead-letter destination at once and fn
// is not called. An empty body and a body of JSON null do not decode: a
// producer that sent nothing sent no T. A Loop refuses to run JSON of a nil
// function.
func JSON[T any](fn func(ctx context.Context, v T, m *Message) error) Handler {
	return jsonHandler[T](fn)
}

type jsonHandler[T any] func(ctx context.Context, v T, m *Message) error

func (fn jsonHandler[T]) Handle(ctx context.Context, m *Message) error {
	var v T
	if err := decodeJSON(m.Body, &v); err != nil {
		return Permanent(err)
	}
	return fn(ctx, v, m)
}

func (fn jsonHandler[T]) isNil() bool { return fn == nil }

func decodeJSON(body []byte, v any) error {
	if len(body) == 0 {
		return &DecodeError{Offset: 0, Err: errEmptyBody}
	}
	if t := bytes.TrimSpace(body); string(t) == "null" {
		return &DecodeError{Offset: int64(bytes.Index(body, t)), Err: errNullBody}
	}
	err := json.Unmarshal(body, v)
	if err == nil {
		return nil
	}
	var (
		syn *json.SyntaxError
		typ *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &typ):
		return &DecodeError{Field: typ.Field, Offset: typ.Offset, Err: err}
	case errors.As(err, &syn):
		return &DecodeError{Offset: syn.Offset, Err: err}
	}
	return &DecodeError{Offset: -1, Err: err}
}
