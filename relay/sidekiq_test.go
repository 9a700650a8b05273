package relay

import (
	"strings"
	"testing"
	"time"
)

func TestChannelName(t *testing.T) {
	if got := ChannelName("public"); got != "stagedrain_public" {
		t.Fatalf("ChannelName(public) = %q", got)
	}
	long := strings.Repeat("s", 63)
	if got := ChannelName(long); len(got) > 63 || got == ChannelName(long[:62]) {
		t.Fatalf("ChannelName(63 bytes) = %q: want at most 63 bytes, distinct from a shorter schema's", got)
	}
}

func TestBackoff(t *testing.T) {
	max := 2 * time.Second
	prevMax := time.Duration(0)
	for attempt := 1; attempt <= 10; attempt++ {
		d := backoff(attempt, max)
		nominal := min(minBackoff<<(attempt-1), max)
		if d < nominal*3/4 || d > nominal {
			t.Fatalf("backoff(%d) = %s, want between 75%% of %s and %s", attempt, d, nominal, nominal)
		}
		prevMax = nominal
	}
	if prevMax != max {
		t.Fatalf("backoff never reached the cap %s", max)
	}
}

// Jitter never takes a wait above the cap, whatever the cap and attempt.
func TestBackoffNeverAboveMax(t *testing.T) {
	for _, max := range []time.Duration{minBackoff, 150 * time.Millisecond, 500 * time.Millisecond, 5 * time.Second, time.Minute} {
		for attempt := 1; attempt <= 64; attempt++ {
			for range 200 {
				if d := backoff(attempt, max); d > max || d < max/2 && attempt > 20 {
					t.Fatalf("backoff(%d, %s) = %s, want at most %s (and near it once capped)", attempt, max, d, max)
				}
			}
		}
	}
}
