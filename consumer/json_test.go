package consumer

import (
	"context"
	"errors"
	"strings"
	"testing"
)

type order struct {
	ID    string `json:"id"`
	Total int    `json:"total"`
	Lines []struct {
		SKU string `json:"sku"`
		Qty int    `json:"qty"`
	} `json:"lines"`
}

func TestJSONDecodesAndCallsTheHandler(t *testing.T) {
	var got order
	h := JSON(func(ctx context.Context, o order, m *Message) error { got = o; return nil })
	err := h.Handle(context.Background(), &Message{Body: []byte(`{"id":"o-1","total":42,"lines":[{"sku":"a","qty":2}]}`)})
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != "o-1" || got.Total != 42 || len(got.Lines) != 1 || got.Lines[0].Qty != 2 {
		t.Fatalf("decoded %+v", got)
	}
}

func TestJSONBadBodyIsPermanentAndNamesTheProblem(t *testing.T) {
	cases := []struct {
		body, wantField string
		wantInText      string
	}{
		{`{"id":"o-1","total":"lots"}`, "total", `field "total"`},
		{`{"id":"o-1","lines":[{"sku":"a","qty":"two"}]}`, "lines.qty", `field "lines.qty"`},
		{`{"id":"o-1",`, "", "at byte"},
		{`{"id": o-1}`, "", "at byte 8"},
		{``, "", "empty body"},
	}
	for _, c := range cases {
		called := false
		h := JSON(func(ctx context.Context, o order, m *Message) error { called = true; return nil })
		err := h.Handle(context.Background(), &Message{Body: []byte(c.body)})
		if called {
			t.Errorf("%q: handler called for a body that does not decode", c.body)
		}
		if !IsPermanent(err) {
			t.Errorf("%q: error %v is not permanent", c.body, err)
		}
		var de *DecodeError
		if !errors.As(err, &de) {
			t.Fatalf("%q: error %v is not a DecodeError", c.body, err)
		}
		if de.Field != c.wantField {
			t.Errorf("%q: Field = %q, want %q", c.body, de.Field, c.wantField)
		}
		if !strings.Contains(err.Error(), c.wantInText) {
			t.Errorf("%q: error %q does not say %q", c.body, err, c.wantInText)
		}
	}
}

func TestOutcomesAreCheckableWithErrorsIsAndAs(t *testing.T) {
	base := errors.New("downstream 503")
	if !IsPermanent(Permanent(base)) || !errors.Is(Permanent(base), base) {
		t.Error("Permanent does not match ErrPermanent and its cause")
	}
	if Permanent(nil) != nil || RetryAfter(nil, 1) != nil || Hold(nil, 1) != nil {
		t.Error("an outcome of a nil error is not nil")
	}
	var ra *RetryAfterError
	if err := RetryAfter(base, 5e9); !errors.As(err, &ra) || ra.Delay != 5e9 || !errors.Is(err, base) {
		t.Errorf("RetryAfter: %v", err)
	}
	if err := Hold(base, 1e9); !errors.Is(err, ErrHeld) || !errors.Is(err, base) {
		t.Errorf("Hold: %v", err)
	}
	pe := &PublishError{Failed: []FailedMessage{{Index: 2, Err: base}}}
	if !errors.Is(pe, base) || !strings.Contains(pe.Error(), "#2") {
		t.Errorf("PublishError: %v", pe)
	}
	order := []string{}
	mw := func(name string) Middleware {
		return func(next Handler) Handler {
			return HandlerFunc(func(ctx context.Context, m *Message) error {
				order = append(order, name)
				return next.Handle(ctx, m)
			})
		}
	}
	_ = Chain(HandlerFunc(func(context.Context, *Message) error { order = append(order, "h"); return nil }), mw("a"), mw("b")).
		Handle(context.Background(), &Message{})
	if strings.Join(order, ",") != "a,b,h" {
		t.Errorf("Chain ran %v, want the first listed outermost", order)
	}
}

// A body of JSON null is no T: it is refused as a permanent error, like an
// empty body, and the function is not called.
func TestJSONRefusesANullBody(t *testing.T) {
	called := false
	h := JSON(func(context.Context, struct{ A int }, *Message) error { called = true; return nil })
	for _, body := range []string{"null", "  null\n"} {
		err := h.Handle(context.Background(), &Message{Body: []byte(body)})
		var de *DecodeError
		if !IsPermanent(err) || !errors.As(err, &de) {
			t.Errorf("body %q: %v, want a permanent *DecodeError", body, err)
		}
	}
	if called {
		t.Fatal("the function ran for a null body")
	}
}
