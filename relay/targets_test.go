package relay_test

import (
	"slices"
	"testing"

	"github.com/stagedrain/stagedrain/relay"
)

// Targets lists the five built-in targets in their order, with why those
// that cannot run on Redis Cluster cannot (the command line's check).
func TestTargetsList(t *testing.T) {
	t.Parallel()
	var names, noCluster []relay.Target
	for _, ti := range relay.Targets() {
		names = append(names, ti.Name)
		if ti.Help == "" {
			t.Errorf("%s: no help", ti.Name)
		}
		if ti.NoCluster != "" {
			noCluster = append(noCluster, ti.Name)
		}
	}
	want := []relay.Target{relay.TargetSidekiq, relay.TargetAsynq, relay.TargetStreams, relay.TargetBullMQ, relay.TargetCelery}
	if !slices.Equal(names, want) {
		t.Fatalf("Targets() = %v, want %v", names, want)
	}
	if !slices.Equal(noCluster, []relay.Target{relay.TargetSidekiq, relay.TargetCelery}) {
		t.Fatalf("targets refused on Redis Cluster: %v, want sidekiq and celery", noCluster)
	}
}
