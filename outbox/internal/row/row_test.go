package row

import (
	"errors"
	"maps"
	"slices"
	"testing"
)

func TestHeadersRoundTrip(t *testing.T) {
	for _, h := range []map[string]string{
		nil,
		{"": ""},
		{"a": "b", "h\xff": "v\xff\xfe", "h\xfe": "v\x00", "\x00": "\xff"},
		{"long": string(make([]byte, 1000))},
	} {
		got, err := DecodeHeaders(EncodeHeaders(h))
		if err != nil {
			t.Fatalf("%q: %v", h, err)
		}
		if len(h) == 0 && got != nil || !maps.Equal(got, h) {
			t.Fatalf("decoded %q, want %q", got, h)
		}
	}
}

func TestDecodeHeadersRefusesCorruptBytes(t *testing.T) {
	for _, b := range [][]byte{{2}, {1, 5, 'a'}, {1, 1, 'a'}, {1, 1, 'a', 3, 'b'}, {1, 0xff}} {
		if _, err := DecodeHeaders(b); !errors.Is(err, ErrCorruptHeaders) {
			t.Errorf("DecodeHeaders(%q) = %v, want ErrCorruptHeaders", b, err)
		}
	}
}

func FuzzHeaders(f *testing.F) {
	f.Add("k", "v", "k\xff", "\x00")
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		h := map[string]string{k1: v1, k2: v2}
		got, err := DecodeHeaders(EncodeHeaders(h))
		if err != nil || !maps.Equal(got, h) {
			t.Fatalf("decoded %q, %v; want %q", got, err, h)
		}
		DecodeHeaders([]byte(k1 + v1)) // must not panic
	})
}

func TestChunksBoundRowsAndBytes(t *testing.T) {
	rows := make([]Row, 10)
	for i := range rows {
		rows[i].Body = make([]byte, 100)
	}
	rows[4].Body = make([]byte, 1000) // alone over the limit: a chunk of its own
	var got []int
	for _, c := range Chunks(rows, 3, 250) {
		got = append(got, len(c))
	}
	if want := []int{2, 2, 1, 2, 2, 1}; !slices.Equal(got, want) {
		t.Fatalf("chunk sizes %v, want %v", got, want)
	}
	got = got[:0]
	for _, c := range Chunks(rows[:7], 3, 1<<20) {
		got = append(got, len(c))
	}
	if want := []int{3, 3, 1}; !slices.Equal(got, want) {
		t.Fatalf("chunk sizes %v, want %v", got, want)
	}
}
