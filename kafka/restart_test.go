package kafka_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// envRestart allows TestBrokerRestart to stop and start the test Kafka
// (integration/brokers.sh restart kafka; set FERRY_BROKERS_DIR when the
// brokers run from another checkout). It is off by default because every
// other test using Kafka at the same time (go test ./... runs packages in
// parallel) would see the broker go away.
const envRestart = "FERRY_TEST_KAFKA_RESTART"

// TestBrokerRestart: Kafka is stopped and started while a consumer runs and
// a publisher publishes; both resume by themselves, every Publish returns
// nil in the end, and every published record is handled: in a consumer
// group of either protocol, and in a share group.
func TestBrokerRestart(t *testing.T) {
	if os.Getenv(envRestart) != "1" {
		t.Skipf("restarts the shared Kafka: set %s=1 (and FERRY_BROKERS_DIR) to run it", envRestart)
	}
	forProtocols(t, testBrokerRestart)
	t.Run(kafka.Share.String(), func(t *testing.T) { testBrokerRestart(t, kafka.Share) })
}

func testBrokerRestart(t *testing.T, proto kafka.GroupProtocol) {
	b := newBroker(t, groupOpts(proto)...)
	topic := newTopic(t, b, "restart", 3)
	group := testenv.UniqueName(t, "restart-group")

	var mu sync.Mutex
	handled := map[string]bool{}
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		handled[string(m.Body)] = true
		mu.Unlock()
		return nil
	}))

	// A publisher that never stops during the restart: each call must end
	// with nil, however long the broker is away.
	stop := make(chan struct{})
	var published int
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		for i := 0; ; i += 10 {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			var msgs []consumer.Message
			for j := i; j < i+10; j++ {
				msgs = append(msgs, consumer.Message{Key: "k" + strconv.Itoa(j%7), Body: []byte(strconv.Itoa(j))})
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			err := b.Publish(ctx, topic, msgs...)
			cancel()
			if err != nil {
				t.Errorf("publish %d..%d: %v", i, i+9, err)
				return
			}
			published = i + 10
		}
	}()
	testenv.WaitFor(t, 60*time.Second, "records to flow", func() bool { mu.Lock(); defer mu.Unlock(); return len(handled) >= 100 })

	script := filepath.Join("..", "integration", "brokers.sh")
	cmd := exec.Command("bash", script, "restart", "kafka")
	cmd.Stdout, cmd.Stderr = t.Output(), t.Output()
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s restart kafka: %v", script, err)
	}
	t.Logf("Kafka restarted in %s", time.Since(start).Round(time.Millisecond))
	time.Sleep(2 * time.Second) // records published after the restart too
	close(stop)
	<-pubDone
	if t.Failed() {
		return
	}
	testenv.WaitFor(t, 120*time.Second, "every published record to be handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for i := 0; i < published; i++ {
			if !handled[strconv.Itoa(i)] {
				return false
			}
		}
		return true
	})
	t.Logf("%d records published across the restart, all handled", published)
}
