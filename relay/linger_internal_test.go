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
	// At 1,000 jobs/s jobs come about 1ms apart: the relay must go idle
	// between them (README, "The wake-up"), not claim every few hundred
	// microseconds until the next one.
	if lingerFor >= time.Millisecond {
		t.Fatalf("lingerFor = %s: the relay would stay awake between jobs 1ms apart", lingerFor)
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

// Claims are paced at most 5ms apart up to 5,000 jobs/s, then up to 10ms,
// in proportion to the flow, at twice that.
func TestPaceCapGrowsWithTheFlow(t *testing.T) {
	for _, tc := range []struct {
		perSec float64
		want   time.Duration
	}{
		{0, 5 * time.Millisecond},
		{1000, 5 * time.Millisecond},
		{5000, 5 * time.Millisecond},
		{7500, 7500 * time.Microsecond},
		{10000, 10 * time.Millisecond},
		{50000, 10 * time.Millisecond},
	} {
		var f flowRate
		// One full window at the rate.
		start := time.Unix(0, 0)
		f.found(0, start)
		f.found(int(tc.perSec/50), start.Add(rateWindow))
		if got := f.maxPace(); got != tc.want {
			t.Errorf("pace cap at %.0f jobs/s = %s, want %s", tc.perSec, got, tc.want)
		}
	}
}

// From fastFlow jobs/s on, claims after a short batch are at least
// flowPace apart; below it there is no floor (a job should take about a
// millisecond from its COMMIT).
func TestPaceFloorFromFastFlow(t *testing.T) {
	for _, tc := range []struct {
		perSec float64
		want   time.Duration
	}{
		{0, 0},
		{1000, 0},
		{fastFlow - 50, 0},
		{fastFlow, flowPace},
		{20000, flowPace},
	} {
		var f flowRate
		start := time.Unix(0, 0)
		f.found(0, start)
		f.found(int(tc.perSec/50), start.Add(rateWindow))
		if got := f.minPace(); got != tc.want {
			t.Errorf("pace floor at %.0f jobs/s = %s, want %s", tc.perSec, got, tc.want)
		}
	}
}
