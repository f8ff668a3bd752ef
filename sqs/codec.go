package sqs

import (
	"cmp"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// This file maps a [consumer.Message] onto an SQS message and back.
//
// SQS takes a body of XML characters (no NUL, no invalid UTF-8, not empty),
// at most ten message attributes with names of a limited alphabet and
// non-empty values, and on a FIFO queue a message group id and a
// deduplication id of printable ASCII. Ferry's messages carry any bytes in
// the body, any number of headers of any name and value, and any key. What
// does not fit SQS's shape travels in one binary attribute, [MetaAttribute]:
//
//   - a body that is not SQS text goes base64-encoded (an empty one as "-"),
//     and the meta attribute says so;
//   - headers go as String attributes when their name and value are valid
//     ones, as many as fit (user headers before ferry-* ones, by name); the
//     rest are packed into the meta attribute;
//   - the key goes as the FIFO message group id when it is a valid one, and
//     in the meta attribute otherwise (the group id is then a hash of it),
//     and always on a standard queue.

// MetaAttribute is the name of the binary message attribute in which Ferry
// carries what does not fit SQS's own fields: the headers beyond the ten
// attributes SQS allows, headers whose names or values SQS refuses, the key
// on a standard queue, and how the body is encoded. It is present only when
// something needs it. A header of this name is always carried packed.
const MetaAttribute = "ferry"

const (
	metaVersion    = 1
	flagBase64     = 1 << 0
	flagEmptyBody  = 1 << 1
	flagKey        = 1 << 2
	emptyBody      = "-"
	hashedPrefix   = "~"
	maxGroupID     = 128
	maxAttrName    = 256
	binaryType     = "Binary"
	stringType     = "String"
	ferryHdrPrefix = "ferry-"
)

// outgoing is one message encoded for SendMessageBatch.
type outgoing struct {
	index int    // in the Publish call
	key   string // orders the message (the caller's key)
	entry types.SendMessageBatchRequestEntry
	size  int // as SQS counts it: body and attribute names, types and values
}

// encode maps m onto a SendMessageBatch entry for q; fair sends the Key as
// the message group id on a standard queue too (WithFairQueues).
func encode(q *queueInfo, m *consumer.Message, fair bool) (outgoing, error) {
	out := outgoing{key: m.Key}
	var flags byte
	body := ""
	switch {
	case len(m.Body) == 0:
		flags |= flagEmptyBody
		body = emptyBody
	case isText(m.Body):
		body = string(m.Body)
	default:
		flags |= flagBase64
		body = base64.StdEncoding.EncodeToString(m.Body)
	}
	carryKey := false
	if q.fifo {
		if m.Key == "" {
			return out, fmt.Errorf("%w: Key (the message group) must not be empty on FIFO queue %q", ErrInvalidMessage, q.name)
		}
		group := m.Key
		if !validGroupID(group) {
			group = hashID(group)
			carryKey = true
		}
		out.entry.MessageGroupId = aws.String(group)
		switch {
		case m.ID != "" && validGroupID(m.ID):
			out.entry.MessageDeduplicationId = aws.String(m.ID)
		case m.ID != "":
			out.entry.MessageDeduplicationId = aws.String(hashID(m.ID))
		case !q.contentDedup:
			out.entry.MessageDeduplicationId = aws.String(randomID())
		}
	} else if m.Key != "" {
		carryKey = true
		if fair {
			group := m.Key
			if !validGroupID(group) {
				group = hashID(group)
			}
			out.entry.MessageGroupId = aws.String(group)
		}
	}
	if carryKey {
		flags |= flagKey
	}

	// Headers: native where they can be, packed otherwise.
	var native, packed []string
	for k, v := range m.Headers {
		if validAttrName(k) && v != "" && isText([]byte(v)) {
			native = append(native, k)
		} else {
			packed = append(packed, k)
		}
	}
	slots := MaxAttributes
	needMeta := flags != 0 || len(packed) > 0 || len(native) > MaxAttributes
	if needMeta {
		slots--
	}
	if len(native) > slots {
		slices.SortFunc(native, func(a, b string) int {
			af, bf := strings.HasPrefix(a, ferryHdrPrefix), strings.HasPrefix(b, ferryHdrPrefix)
			if af != bf {
				if af {
					return 1
				}
				return -1
			}
			return cmp.Compare(a, b)
		})
		packed = append(packed, native[slots:]...)
		native = native[:slots]
	}
	if len(native) > 0 || needMeta {
		out.entry.MessageAttributes = make(map[string]types.MessageAttributeValue, len(native)+1)
	}
	size := len(body)
	for _, k := range native {
		v := m.Headers[k]
		out.entry.MessageAttributes[k] = types.MessageAttributeValue{DataType: aws.String(stringType), StringValue: aws.String(v)}
		size += len(k) + len(stringType) + len(v)
	}
	if needMeta {
		slices.Sort(packed)
		meta := make([]byte, 0, 64)
		meta = append(meta, metaVersion, flags)
		if carryKey {
			meta = appendString(meta, m.Key)
		}
		for _, k := range packed {
			meta = appendString(meta, k)
			meta = appendString(meta, m.Headers[k])
		}
		out.entry.MessageAttributes[MetaAttribute] = types.MessageAttributeValue{DataType: aws.String(binaryType), BinaryValue: meta}
		size += len(MetaAttribute) + len(binaryType) + len(meta)
	}
	out.entry.MessageBody = aws.String(body)
	out.size = size
	if size > q.maxSize {
		how := ""
		if flags&flagBase64 != 0 {
			how = fmt.Sprintf(" (a body of %d bytes that is not text, base64-encoded to %d)", len(m.Body), len(body))
		}
		return out, fmt.Errorf("%w: %d bytes of body and attributes%s exceed the %d bytes queue %q takes",
			ErrMessageTooLarge, size, how, q.maxSize, q.name)
	}
	return out, nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func readString(b []byte) (string, []byte, bool) {
	n, w := binary.Uvarint(b)
	if w <= 0 || uint64(len(b)-w) < n {
		return "", nil, false
	}
	return string(b[w : w+int(n)]), b[w+int(n):], true
}

var errBadMeta = errors.New("sqs: malformed " + MetaAttribute + " attribute")

// decode maps a received SQS message onto a [driver.Message]. A message with a
// malformed meta attribute (not written by Ferry) is delivered with its body
// and attributes as SQS gave them, and the returned error says why.
func decode(q *queueInfo, m *types.Message, dm *driver.Message) error {
	dm.ID = aws.ToString(m.MessageId)
	dm.Source = q.name
	dm.Offset = -1
	body := aws.ToString(m.Body)
	dm.Deliveries = 1
	if v, err := strconv.Atoi(m.Attributes[string(types.MessageSystemAttributeNameApproximateReceiveCount)]); err == nil && v > 0 {
		dm.Deliveries = v
	}
	if v, err := strconv.ParseInt(m.Attributes[string(types.MessageSystemAttributeNameSentTimestamp)], 10, 64); err == nil {
		dm.PublishedAt = time.UnixMilli(v)
	}
	if q.fifo {
		dm.Lane = m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
		dm.Key = dm.Lane
	}
	n := len(m.MessageAttributes)
	if n > 0 {
		dm.Headers = make(map[string]string, n)
	}
	var meta []byte
	for k, v := range m.MessageAttributes {
		switch {
		case k == MetaAttribute && v.BinaryValue != nil:
			meta = v.BinaryValue
		case v.StringValue != nil:
			dm.Headers[k] = *v.StringValue
		case v.BinaryValue != nil:
			dm.Headers[k] = string(v.BinaryValue)
		}
	}
	var err error
	if meta != nil {
		if err = decodeMeta(meta, &body, dm); err != nil {
			dm.Headers[MetaAttribute] = string(meta)
			dm.Body, dm.Key = nil, dm.Lane
		}
	}
	if dm.Body == nil {
		dm.Body = []byte(body)
	}
	return err
}

func decodeMeta(meta []byte, body *string, dm *driver.Message) error {
	if len(meta) < 2 || meta[0] != metaVersion {
		return errBadMeta
	}
	flags, rest := meta[1], meta[2:]
	var ok bool
	switch {
	case flags&flagEmptyBody != 0:
		dm.Body = []byte{}
	case flags&flagBase64 != 0:
		b, err := base64.StdEncoding.DecodeString(*body)
		if err != nil {
			return fmt.Errorf("%w: body: %w", errBadMeta, err)
		}
		dm.Body = b
	}
	if flags&flagKey != 0 {
		if dm.Key, rest, ok = readString(rest); !ok {
			return errBadMeta
		}
	}
	for len(rest) > 0 {
		var k, v string
		if k, rest, ok = readString(rest); ok {
			v, rest, ok = readString(rest)
		}
		if !ok {
			return errBadMeta
		}
		dm.Headers[k] = v
	}
	return nil
}

// isText reports whether b is a valid SQS message body or string value:
// UTF-8 of the characters XML allows (#x9, #xA, #xD, #x20 to #xD7FF,
// #xE000 to #xFFFD, #x10000 to #x10FFFF).
func isText(b []byte) bool {
	for i := 0; i < len(b); {
		c := b[i]
		if c < utf8.RuneSelf {
			if c < 0x20 && c != '\t' && c != '\n' && c != '\r' {
				return false
			}
			i++
			continue
		}
		r, w := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && w == 1 {
			return false
		}
		if (r >= 0xD800 && r <= 0xDFFF) || r == 0xFFFE || r == 0xFFFF {
			return false
		}
		i += w
	}
	return true
}

// validAttrName reports whether SQS takes name as a message attribute
// name, other than MetaAttribute.
func validAttrName(name string) bool {
	if name == "" || len(name) > maxAttrName || name == MetaAttribute {
		return false
	}
	if name[0] == '.' || name[len(name)-1] == '.' || strings.Contains(name, "..") {
		return false
	}
	lower := strings.ToLower(name)
	if strings.HasPrefix(lower, "aws.") || strings.HasPrefix(lower, "amazon.") {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return false
		}
	}
	return true
}

// validGroupID reports whether SQS takes s as a message group id or a
// deduplication id (1 to 128 printable ASCII characters), and it is not
// one of Ferry's hashed forms.
func validGroupID(s string) bool {
	if s == "" || len(s) > maxGroupID || strings.HasPrefix(s, hashedPrefix) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// hashID maps a key or id SQS would refuse onto one it takes: the same
// input always gives the same id, so a key keeps its group.
func hashID(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hashedPrefix + base64.RawURLEncoding.EncodeToString(sum[:])
}

func randomID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
