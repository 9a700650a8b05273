package relay

import (
	"context"
	"time"
)

// A wake-up is a token in a channel of capacity 1: any number of
// notifications, polls and reconnects that arrive while a drain runs fold
// into one more drain after it, and none is ever lost.
func trySendWakeup(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// poll wakes the drain every jittered interval until ctx ends: the fallback
// that makes a lost notification cost latency, never a job.
func poll(ctx context.Context, interval time.Duration, wake chan<- struct{}) {
	for sleep(ctx, jitter(interval)) {
		trySendWakeup(wake)
	}
}
