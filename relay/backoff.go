package relay

import (
	"context"
	"math/rand/v2"
	"time"
)

// backoff returns the wait before retry number attempt (1-based): 100ms
// doubling up to max, less up to 25% jitter so that relays restarted
// together do not retry in step. The jitter only shortens the wait, so it
// never exceeds max.
func backoff(attempt int, max time.Duration) time.Duration {
	d := minBackoff
	for i := 1; i < attempt && d < max; i++ {
		d *= 2
	}
	d = min(d, max)
	return d - time.Duration(rand.Int64N(int64(d)/4+1))
}

// jitter returns d scaled by a random factor in [0.75, 1.25).
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.75 + rand.Float64()/2))
}

// sleep waits for d or until ctx ends, and reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
