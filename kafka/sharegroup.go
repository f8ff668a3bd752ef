package kafka

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// The share group settings Ferry reads and sets (group configuration,
// KIP-932 and KIP-1191).
const (
	shareAutoOffsetReset = "share.auto.offset.reset"
	shareLockDuration    = "share.record.lock.duration.ms"
	shareDeliveryLimit   = "share.delivery.count.limit"
	shareDeadLetterTopic = "errors.deadletterqueue.topic.name"
)

// shareGroupConfig is what a share consumer needs of its group's
// configuration: the values in effect, the broker's defaults included.
type shareGroupConfig struct {
	lock            time.Duration
	limit           int
	deadLetterTopic string
	// reset is the group's share.auto.offset.reset: where it starts,
	// "earliest" or "latest"; resetIsDefault is true when nobody set it
	// on the group (it then starts at the latest records).
	reset          string
	resetIsDefault bool
}

// readShareGroupConfig describes group's configuration. A group that does
// not exist yet has the broker's defaults.
func readShareGroupConfig(ctx context.Context, cl *kgo.Client, group string) (shareGroupConfig, error) {
	out := shareGroupConfig{lock: defaultShareLock, limit: defaultShareLimit}
	req := kmsg.NewPtrDescribeConfigsRequest()
	r := kmsg.NewDescribeConfigsRequestResource()
	r.ResourceType = kmsg.ConfigResourceTypeGroupConfig
	r.ResourceName = group
	req.Resources = append(req.Resources, r)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return out, err
	}
	if len(resp.Resources) != 1 {
		return out, fmt.Errorf("configuration of share group %q: %d resources in the answer", group, len(resp.Resources))
	}
	res := resp.Resources[0]
	if err := kerr.ErrorForCode(res.ErrorCode); err != nil {
		return out, fmt.Errorf("configuration of share group %q: %w", group, err)
	}
	for _, c := range res.Configs {
		v := ""
		if c.Value != nil {
			v = *c.Value
		}
		switch c.Name {
		case shareAutoOffsetReset:
			out.reset = v
			out.resetIsDefault = c.Source == kmsg.ConfigSourceDefaultConfig
		case shareLockDuration:
			if ms, err := strconv.Atoi(v); err == nil && ms > 0 {
				out.lock = time.Duration(ms) * time.Millisecond
			}
		case shareDeliveryLimit:
			if n, err := strconv.Atoi(v); err == nil && n > 0 {
				out.limit = n
			}
		case shareDeadLetterTopic:
			out.deadLetterTopic = v
		}
	}
	return out, nil
}

// alterShareGroupConfig sets group's configuration keys to values,
// leaving the others alone.
func alterShareGroupConfig(ctx context.Context, cl *kgo.Client, group string, set map[string]string) error {
	req := kmsg.NewPtrIncrementalAlterConfigsRequest()
	r := kmsg.NewIncrementalAlterConfigsRequestResource()
	r.ResourceType = kmsg.ConfigResourceTypeGroupConfig
	r.ResourceName = group
	for k, v := range set {
		c := kmsg.NewIncrementalAlterConfigsRequestResourceConfig()
		c.Name = k
		c.Value = kmsg.StringPtr(v)
		c.Op = kmsg.IncrementalAlterConfigOpSet
		r.Configs = append(r.Configs, c)
	}
	req.Resources = append(req.Resources, r)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return err
	}
	for _, res := range resp.Resources {
		if err := kerr.ErrorForCode(res.ErrorCode); err != nil {
			msg := ""
			if res.ErrorMessage != nil {
				msg = ": " + *res.ErrorMessage
			}
			return fmt.Errorf("configuration of share group %q%s: %w", group, msg, err)
		}
	}
	return nil
}
