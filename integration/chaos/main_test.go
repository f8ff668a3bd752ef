package main

import (
	"slices"
	"strings"
	"testing"
)

// TestClusterFlagBreaksOnlyClusters: -cluster runs kafka and rabbitmq, the
// brokers with a cluster to break, kills nodes through brokers.sh
// kill-node, and refuses a broker without one and a restart command of the
// user's.
func TestClusterFlagBreaksOnlyClusters(t *testing.T) {
	c, err := parseFlags([]string{"-cluster", "-short"})
	if err != nil {
		t.Fatal(err)
	}
	if !c.Cluster || !slices.Equal(c.Brokers, []string{"kafka", "rabbitmq"}) {
		t.Errorf("-cluster: brokers %v, cluster %v; want kafka and rabbitmq", c.Brokers, c.Cluster)
	}
	if !strings.Contains(c.RestartCmd, "kill-node") || !strings.Contains(c.RestartCmd, "$FERRY_CHAOS_SERVICE-cluster") {
		t.Errorf("-cluster restart command %q, want brokers.sh kill-node of the service's cluster", c.RestartCmd)
	}
	for _, args := range [][]string{
		{"-cluster", "-broker", "sqs"},
		{"-cluster", "-broker", "kafka-share"},
		{"-cluster", "-restart-cmd", "true"},
	} {
		if _, err := parseFlags(args); err == nil {
			t.Errorf("parseFlags(%q) accepted it", args)
		}
	}
	if c, err := parseFlags([]string{"-short"}); err != nil || c.Cluster || c.RestartCmd != "" {
		t.Errorf("without -cluster: %+v, %v", c, err)
	}
}
