package main

import (
	"testing"
	"time"
)

// The chaos verdict bounds how long delivery stood still outside the
// faults' own windows: overlapping windows count once, a poison plant
// (no hold) not at all, and a gap's part before or after them does.
func TestDeliveryGapOutsideFaults(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	g := deliveryGap{spans: []gapSpan{
		{at(10), at(45)}, // 35s: faults cover 12-20, 18-30 (merged: 12-30) and 40-50 (40-45): 23s; 12s left
		{at(60), at(75)}, // 15s: only a poison plant inside: 15s left
	}}
	ran := []chaosRun{
		{fault: "pause-all", from: at(12), to: at(20)},
		{fault: "redis-stall", from: at(18), to: at(30)},
		{fault: "sigstop", from: at(40), to: at(50)},
		{fault: "poison", from: at(61), to: at(70)},
	}
	longest, ended := g.unplanned(ran)
	if longest != 15*time.Second || !ended.Equal(at(75)) {
		t.Errorf("unplanned = %s ending at +%s, want 15s ending at +75s", longest, ended.Sub(t0))
	}
	g.spans = g.spans[:1]
	if longest, _ := g.unplanned(ran); longest != 12*time.Second {
		t.Errorf("unplanned = %s, want 12s (35s less 18s and 5s of faults)", longest)
	}
}
