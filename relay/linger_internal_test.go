package relay

import (
	"testing"
	"time"
)

// The relay lingers lingerFast once a full window of claims found jobs at
// fastFlow or more, and lingerFor otherwise; a slower window brings it back.
func TestFlowRateLinger(t *testing.T) {
	var f flowRate
	start := time.Unix(0, 0)
	if got := f.linger(); got != lingerFor {
		t.Fatalf("linger before any job = %s, want %s", got, lingerFor)
	}
	// 20 jobs over 20ms: 1,000/s, below fastFlow.
	for i := range 21 {
		f.found(1, start.Add(time.Duration(i)*time.Millisecond))
	}
	if got := f.linger(); got != lingerFor {
		t.Fatalf("linger at 1,000 jobs/s = %s, want %s", got, lingerFor)
	}
	// 100 jobs over the next 20ms: 5,000/s.
	for i := range 100 {
		f.found(1, start.Add(20*time.Millisecond+time.Duration(i+1)*200*time.Microsecond))
	}
	if got := f.linger(); got != lingerFast {
		t.Fatalf("linger at 5,000 jobs/s = %s, want %s", got, lingerFast)
	}
	// Then 2 jobs over the next 40ms: 50/s.
	f.found(1, start.Add(60*time.Millisecond))
	f.found(1, start.Add(80*time.Millisecond))
	if got := f.linger(); got != lingerFor {
		t.Fatalf("linger at 50 jobs/s = %s, want %s", got, lingerFor)
	}
}

// An empty claim while awake is followed by another a quarter of the quiet
// time later, between minLingerStep and maxLingerStep.
func TestLingerStepAfter(t *testing.T) {
	for _, tc := range []struct{ quiet, want time.Duration }{
		{0, minLingerStep},
		{200 * time.Microsecond, minLingerStep},
		{2 * time.Millisecond, 500 * time.Microsecond},
		{10 * time.Millisecond, maxLingerStep},
	} {
		if got := lingerStepAfter(tc.quiet); got != tc.want {
			t.Errorf("lingerStepAfter(%s) = %s, want %s", tc.quiet, got, tc.want)
		}
	}
}
