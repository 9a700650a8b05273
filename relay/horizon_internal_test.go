package relay

import (
	"testing"
	"time"
)

// The age of what holds the horizon is never below 0: horizonSQL's now()
// is its own transaction's start, and an app's transaction that began
// after it read -0.008 s in stagedrain_xmin_horizon_age_seconds.
func TestHolderAgeIsNeverNegative(t *testing.T) {
	read := func(s float64) *float64 { return &s }
	for _, c := range []struct {
		read *float64
		seen time.Duration
		want time.Duration
	}{
		{read(-0.008), time.Second, 0},
		{read(32.5), time.Second, 32500 * time.Millisecond},
		{nil, 40 * time.Second, 40 * time.Second},
		{nil, -time.Millisecond, 0},
	} {
		if got := holderAge(c.read, c.seen); got != c.want {
			t.Errorf("holderAge(%v, %v) = %v, want %v", c.read, c.seen, got, c.want)
		}
	}
}
