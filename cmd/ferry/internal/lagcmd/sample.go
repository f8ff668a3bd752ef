package lagcmd

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/brokerkind"
	"github.com/ferrymq/ferry/kafka"
)

// sampler reads the lag of a group on a source through a Loop that never
// runs: its driver answers Lag without fetching (a Kafka driver joins its
// group only on its first Fetch).
type sampler struct {
	b        ferry.Broker
	kind     string
	source   string
	group    string
	l        *consumer.Loop
	progress int64 // a queue's samples with messages taken by consumers
	// peekGroup, when set, reads the records past the group's offsets in
	// place of the Kafka broker's PeekGroup (a test's failing read).
	peekGroup func(ctx context.Context, topic, group string, perPartition int) ([]consumer.Message, error)
}

func newSampler(ctx context.Context, b ferry.Broker, source, group string) (*sampler, error) {
	name := group
	if name == "" {
		name = "ferry-lag"
	}
	l, err := b.NewConsumer(ctx, source, consumer.WithName(name))
	if err != nil {
		return nil, fmt.Errorf("lag of %s: %w", source, err)
	}
	return &sampler{b: b, kind: cli.Kind(b), source: source, group: group, l: l}, nil
}

func (s *sampler) sample(ctx context.Context) (Sample, error) {
	lag, err := s.l.Lag(ctx)
	if err != nil {
		return Sample{}, fmt.Errorf("lag of %s: %w", s.source, err)
	}
	out := Sample{At: time.Now(), InFlight: lag.InFlight, OldestAge: lag.OldestAge}
	if len(lag.Lanes) > 0 {
		// Kafka: lag and committed offset per partition.
		out.Lanes, out.Positions = lag.Lanes, lag.Positions
		if out.Positions == nil {
			out.Positions = map[string]int64{}
		}
		out.InFlight = -1 // the driver's own fetched records: none, it never fetches
		if kb, ok := s.b.(*kafka.Broker); ok && kb.GroupProtocol() == kafka.Share {
			// A share group acknowledges records one by one: the broker
			// tells which are not done only as a count, so no record is
			// the oldest waiting one.
			return out, nil
		}
		out.OldestAge, err = s.oldestKafka(ctx, lag.Lanes)
		if err != nil {
			return Sample{}, err
		}
		return out, nil
	}
	if s.kind == brokerkind.RabbitMQ {
		out.InFlight = -1 // the driver counts its own deliveries only
	} else if lag.InFlight > 0 {
		s.progress++
	}
	// Not yet done, as a consumer's Health.Lag and its lag metric count:
	// waiting, and taken by consumers and not yet settled where the broker
	// tells it (SQS).
	out.Lanes = map[string]int64{"": lag.Messages + max(out.InFlight, 0)}
	out.Positions = map[string]int64{"": s.progress}
	return out, nil
}

// oldestKafka is the age of the oldest record past the group's committed
// offsets, of the partitions that lag.
func (s *sampler) oldestKafka(ctx context.Context, lanes map[string]int64) (time.Duration, error) {
	peek := s.peekGroup
	if peek == nil {
		kb, ok := s.b.(*kafka.Broker)
		if !ok {
			return 0, nil
		}
		peek = kb.PeekGroup
	}
	recs, err := peek(ctx, s.source, s.group, 1)
	if errors.Is(err, kafka.ErrPeekShort) {
		// A partition did not move for a few seconds (an open
		// transaction, a stalled broker): the age is unknown this time,
		// and the lag, which is what the verdict rests on, still counts.
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("backlog age of %s: %w", s.source, err)
	}
	var oldest time.Time
	for _, r := range recs {
		if lanes[r.Lane] == 0 || r.PublishedAt.IsZero() {
			continue
		}
		if oldest.IsZero() || r.PublishedAt.Before(oldest) {
			oldest = r.PublishedAt
		}
	}
	if oldest.IsZero() {
		return 0, nil
	}
	return max(time.Since(oldest), time.Nanosecond), nil
}
