package relay

import (
	"errors"
	"testing"
	"time"
)

// A fleet enters hot on a rate sustained over 500ms, or on a burst of
// 1.25 times the rate in one 100ms window, not on one window of Poisson noise
// at half the rate: at 100 commits a second over 20 or 200 schemas, a
// single window of 20 made the fleet run hot every few seconds, and each
// turn hot and back woke every schema's drain.
func TestFleetEntersHotOnASustainedRate(t *testing.T) {
	windows := func(counts ...int) (entered int) {
		var h fleetHeat
		for i, n := range counts {
			if h.count(n); h.over(hotEnter) {
				return i
			}
		}
		return -1
	}
	for _, c := range []struct {
		name   string
		counts []int
		want   int // the window that enters, -1 for none
	}{
		// 100 commits a second with noise: one window of 20, as the rule
		// before entered on.
		{"noise at half the rate", []int{8, 20, 11, 9, 12, 7, 20, 10, 9, 13}, -1},
		{"just under the rate, sustained", []int{19, 19, 19, 19, 19, 19, 19, 19}, -1},
		{"the rate, sustained", []int{20, 20, 20, 20, 20, 20}, 4},
		{"1.25 times the rate in one window", []int{3, 25}, 1},
		{"just under 1.25 times the rate in one window", []int{3, 24, 3}, -1},
		{"ten times the rate", []int{200}, 0},
	} {
		if got := windows(c.counts...); got != c.want {
			t.Errorf("%s %v: entered at window %d, want %d", c.name, c.counts, got, c.want)
		}
	}
}

// Between hotWaitFrom and hotAlways commits a second a fleet runs hot only
// while the app's commits wait for the notify lock (counted as sessions
// waiting for a lock on an object, at each window's end); from hotAlways
// on the rate alone; and on the rate from hotEnter when the role cannot
// see other roles' waits (issue 23: hot costs latency, cool costs the app
// only when its notifying commits queue). Waits count from hotWaitFrom,
// not hotEnter: on a disk that flushes slowly the notifying commits queue
// at under hotEnter a second, and a fleet that waited for hotEnter stayed
// cool while the app kept a fifth of its TPS.
func TestFleetRunsHotOnWaits(t *testing.T) {
	perWindow := func(perSec float64) int { return int(perSec * hotWindow.Seconds()) }
	type step struct {
		n     int // commits in the window
		waits int // sessions waiting at its end; -1: must not be asked
	}
	run := func(steps []step, sees bool) (entered int) {
		var h fleetHeat
		now := time.Now()
		for i, st := range steps {
			var waiters func() (int, error)
			if sees {
				waiters = func() (int, error) {
					if st.waits < 0 {
						t.Fatalf("window %d: waits counted at %d commits a window", i, st.n)
					}
					return st.waits, nil
				}
			}
			now = now.Add(hotWindow)
			if hot, _ := h.heats(now, st.n, hotEnter, hotWaitFrom, hotAlways, waiters); hot {
				if !h.hot {
					t.Fatalf("window %d: heats said hot, the heat is cool", i)
				}
				return i
			}
		}
		return -1
	}
	mid := perWindow(1000) // 1,000 commits a second: between the two
	slow := perWindow(100) // under hotEnter, over hotWaitFrom
	rep := func(n, waits, times int) []step {
		s := make([]step, times)
		for i := range s {
			s[i] = step{n, waits}
		}
		return s
	}
	for _, c := range []struct {
		name  string
		steps []step
		sees  bool
		want  int
	}{
		{"1,000/s, nobody waiting", rep(mid, 0, 50), true, -1},
		{"1,000/s, a waiter at the end of 6 windows of 10", []step{{mid, 1}, {mid, 0}, {mid, 1}, {mid, 1}, {mid, 0}, {mid, 1}, {mid, 1}, {mid, 0}, {mid, 1}, {mid, 0}, {mid, 0}, {mid, 0}}, true, -1},
		{"1,000/s, a waiter at the end of 7 windows of 10", []step{{mid, 1}, {mid, 0}, {mid, 1}, {mid, 1}, {mid, 0}, {mid, 1}, {mid, 1}, {mid, 0}, {mid, 1}, {mid, 1}}, true, 9},
		{"1,000/s, waiters in 7 windows, but not of the last 10", []step{{mid, 1}, {mid, 1}, {mid, 1}, {mid, 1}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, -1}, {0, -1}, {0, -1}, {mid, 1}, {mid, 1}, {mid, 1}}, true, -1},
		{"1,000/s, hotWaitHeavy waiting over 3 windows", []step{{mid, 0}, {mid, 3}, {mid, 0}, {mid, hotWaitHeavy - 3}}, true, 3},
		{"1,000/s, hotWaitHeavy waiting at once", []step{{mid, 0}, {mid, hotWaitHeavy}}, true, 1},
		{"1,000/s, hotWaitHeavy-1 over 3 windows, and as many 3 windows on", []step{{mid, 0}, {mid, 4}, {mid, 0}, {mid, hotWaitHeavy - 5}, {mid, 0}, {mid, 0}, {mid, hotWaitHeavy - 1}, {mid, 0}}, true, -1},
		{"hotAlways sustained, nobody waiting", rep(perWindow(hotAlways), 0, 6), true, 4},
		{"twice hotAlways sustained, nobody waiting", rep(perWindow(2*hotAlways), 0, 5), true, 2},
		// An app that stalled and catches up: a burst, its commits
		// notifying one after the other without queueing.
		{"a burst of twice hotAlways in one window, nobody waiting", []step{{mid, 0}, {perWindow(2 * hotAlways), 0}, {mid, 0}, {mid, 0}}, true, -1},
		{"a burst of twice hotAlways in one window, hotWaitHeavy waiting", []step{{mid, 0}, {perWindow(2 * hotAlways), hotWaitHeavy}}, true, 1},
		{"the role sees no waits: a burst of twice hotAlways", []step{{slow, -1}, {perWindow(2 * hotAlways), -1}}, false, 1},
		{"under hotWaitFrom, waiters not asked", rep(perWindow(hotWaitFrom)/2, -1, 20), true, -1},
		// A disk that flushes slowly holds notifying commits under hotEnter
		// a second, queued for the notify lock; counted from hotWaitFrom.
		{"100/s, nobody waiting", rep(slow, 0, 50), true, -1},
		{"100/s, a waiter at the end of 7 windows of 10", []step{{slow, 1}, {slow, 0}, {slow, 1}, {slow, 1}, {slow, 0}, {slow, 1}, {slow, 1}, {slow, 0}, {slow, 1}, {slow, 1}}, true, 9},
		{"100/s, hotWaitHeavy waiting over 3 windows", []step{{slow, 0}, {slow, 3}, {slow, 2}, {slow, hotWaitHeavy - 5}}, true, 3},
		{"the role sees no waits: 100/s", rep(slow, -1, 20), false, -1},
		{"the role sees no waits: hotEnter, sustained", rep(perWindow(hotEnter), -1, 6), false, 4},
	} {
		if got := run(c.steps, c.sees); got != c.want {
			t.Errorf("%s: hot at window %d, want %d", c.name, got, c.want)
		}
	}

	// A count that fails leaves the fleet cool.
	var h fleetHeat
	if hot, _ := h.heats(time.Now(), mid, hotEnter, hotWaitFrom, hotAlways, func() (int, error) { return 0, errors.New("gone") }); hot {
		t.Error("hot on a failed count of waits")
	}
}

// A hot fleet tries cool hotProbe after it went hot, while its rate is
// under hotAlways, however many schemas its polls find; each try that ends
// hot again within hotProbeFail doubles the interval, up to hotProbeMax,
// and hotProbeReset cool brings it back to hotProbe. From hotAlways it
// does not try; under hotLeave schemas a second it cools as before.
func TestFleetTriesCool(t *testing.T) {
	const leave, always = hotLeave, hotAlways
	now := time.Now()
	var h fleetHeat
	heat := func() {
		t.Helper()
		heatUp(t, &h, &now, 1000)
	}
	// second runs one hot second finding hits schemas and jobs jobs.
	second := func(hits, jobs int) (cool, trying bool) {
		now = now.Add(hotLeaveAfter)
		return h.cools(now, hits, jobs, leave, always)
	}
	heat()
	start := now
	for now.Add(hotLeaveAfter).Before(start.Add(hotProbe)) {
		if cool, _ := second(800, 1000); cool {
			t.Fatalf("cooled %s after going hot, want a try at %s", now.Sub(start), hotProbe)
		}
	}
	if cool, trying := second(800, 1000); !cool || !trying {
		t.Fatalf("at %s: cool %v, trying %v; want a try", now.Sub(start), cool, trying)
	}
	// Hot again at once: the next try is twice as far.
	heat()
	if h.probeEvery != 2*hotProbe {
		t.Errorf("after a try that went hot again: interval %s, want %s", h.probeEvery, 2*hotProbe)
	}
	for range 10 {
		h.probeAt = now // due
		if cool, _ := second(800, 1000); !cool {
			t.Fatal("no try when due")
		}
		heat()
	}
	if h.probeEvery != hotProbeMax {
		t.Errorf("after many tries: interval %s, want at most %s", h.probeEvery, hotProbeMax)
	}
	// From hotAlways a second, no try.
	h.probeAt = now
	if cool, _ := second(800, int(always)+100); cool {
		t.Error("tried cool at hotAlways jobs a second")
	}
	// Under hotLeave schemas a second it cools, not as a try.
	if cool, trying := second(int(leave)-1, 0); !cool || trying {
		t.Errorf("under hotLeave: cool %v, trying %v; want cool, no try", cool, trying)
	}
	// A minute cool: the interval starts over.
	now = now.Add(hotProbeReset)
	heat()
	if h.probeEvery != hotProbe {
		t.Errorf("after %s cool: interval %s, want %s", hotProbeReset, h.probeEvery, hotProbe)
	}
}

// A hot fleet whose poll failed in a window does not cool on that
// window's quiet: the failed poll found nothing, most often because it
// timed out beside a saturated server. The next window without a failure
// is weighed as before.
func TestFleetStaysHotThroughFailedPolls(t *testing.T) {
	now := time.Now()
	var h fleetHeat
	heatUp(t, &h, &now, 1000)
	// Hot polls that failed, one in each window, for 3s (past the first
	// try's time): nothing found, no commits seen.
	for range 3 {
		for range int(hotLeaveAfter / hotWindow) {
			h.polled(0, errors.New("timeout"))
			now = now.Add(hotWindow)
			if cool, trying := h.cools(now, 0, 0, hotLeave, hotAlways); cool {
				t.Fatalf("cooled (trying %v) on a window whose hot poll failed", trying)
			}
		}
	}
	// A quiet second with no failure cools it.
	cooled := false
	for range int(hotLeaveAfter/hotWindow) + 1 {
		now = now.Add(hotWindow)
		if cool, _ := h.cools(now, 0, 0, hotLeave, hotAlways); cool {
			cooled = true
			break
		}
	}
	if !cooled {
		t.Fatal("a quiet second whose polls succeeded did not cool the fleet")
	}
}

// A fleet that tries cool (hotProbe) runs hot again on hotProbeWaits
// waiting over 2 windows, within hotProbeFail of the try: it went hot on
// the app's commits queueing a few seconds before, so two windows of them
// queueing again say the try failed. The rule for a fleet cool for other
// reasons needs more (hotWaitHeavy over 3 windows, or 7 windows of 10
// with a waiter), and each window it takes is a window of the app's
// commits queueing: in the bench's app-cost fleet of 200 (relay log at
// debug), a failed try took 0.3-1.8s to run hot again.
func TestFleetTryingCoolRunsHotAgainOnFewerWaits(t *testing.T) {
	mid := int(1000 * hotWindow.Seconds())
	waits2 := func(n int) func() (int, error) { return func() (int, error) { return n, nil } }
	// cooled returns a heat that ran hot and then cooled at now, on a try
	// or not.
	cooled := func(now time.Time, trying bool) *fleetHeat {
		h := &fleetHeat{}
		for i := 0; !h.hot; i++ {
			if i > hotEnterWindows {
				t.Fatal("not hot")
			}
			h.heats(now.Add(-time.Minute+time.Duration(i)*hotWindow), mid, hotEnter, hotWaitFrom, hotAlways, waits2(hotWaitHeavy))
		}
		h.hot, h.probing, h.cooledAt = false, trying, now
		return h
	}
	// enters reports the window (1 or 2) after now at which the heat runs
	// hot on windows with half of hotProbeWaits waiting each, 0 for none.
	enters := func(h *fleetHeat, now time.Time) int {
		for i := 1; i <= 2; i++ {
			if hot, _ := h.heats(now.Add(time.Duration(i)*hotWindow), mid, hotEnter, hotWaitFrom, hotAlways, waits2(hotProbeWaits/2)); hot {
				return i
			}
		}
		return 0
	}
	now := time.Now()
	if got := enters(cooled(now, true), now); got != 2 {
		t.Errorf("cooled on a try: hot at window %d, want 2", got)
	}
	if got := enters(cooled(now, false), now); got != 0 {
		t.Errorf("cooled as quiet: hot at window %d, want none", got)
	}
	old := now.Add(-hotProbeFail)
	if got := enters(cooled(old, true), now); got != 0 {
		t.Errorf("cooled on a try %s ago: hot at window %d, want none", hotProbeFail, got)
	}
}

// A hot fleet whose try is due tries cool at the end of the third window
// in a row under half of hotAlways's rate (the app's load dropped), not at
// the end of its second: after a full-speed load it stayed hot 1-2s more,
// and every job of that time was found by a hot poll. Not before the try
// is due, not on a window whose poll failed, and not on a dip to half of
// hotAlways.
func TestFleetTriesCoolWhenTheRateDrops(t *testing.T) {
	full := int(2 * hotAlways * hotWindow.Seconds()) // jobs a window at twice hotAlways
	low := int(100 * hotWindow.Seconds())            // 100 jobs a second
	dip := int(hotDrop * hotAlways * hotWindow.Seconds())
	now := time.Now()
	var h fleetHeat
	heatUp(t, &h, &now, full)
	// window runs one hot window whose polls find n schemas and its
	// drains n jobs; failed, with one poll failing.
	window := func(n int, failed bool) (cool, trying bool) {
		var err error
		if failed {
			err = errors.New("timeout")
		}
		h.polled(n, err)
		now = now.Add(hotWindow)
		return h.cools(now, 0, n, hotLeave, hotAlways)
	}
	// Dropped before the try is due: hot.
	for range hotDropWindows + 1 {
		if cool, trying := window(low, false); cool {
			t.Fatalf("cooled (trying %v) %s after going hot, before the try's time %s", trying, now.Sub(h.since), hotProbe)
		}
	}
	for now.Before(h.probeAt) {
		if cool, _ := window(full, false); cool {
			t.Fatal("cooled at full speed")
		}
	}
	// Due: a dip to half of hotAlways, and a drop whose first window's
	// poll failed, are no try.
	for i := range 2 * hotDropWindows {
		if cool, _ := window(dip, false); cool {
			t.Fatalf("tried cool on window %d of a dip to %d jobs a window", i+1, dip)
		}
	}
	if cool, _ := window(full, false); cool {
		t.Fatal("cooled at full speed")
	}
	if cool, _ := window(low, true); cool {
		t.Fatal("tried cool on a window whose poll failed")
	}
	for i := 1; ; i++ {
		cool, trying := window(low, false)
		if cool {
			if !trying || i != hotDropWindows {
				t.Fatalf("cooled at clean window %d of the drop (trying %v); want a try at window %d", i, trying, hotDropWindows)
			}
			break
		}
		if i > hotDropWindows {
			t.Fatalf("still hot %d windows after the rate dropped", i)
		}
	}
}

// heatUp weighs windows of n commits each, hotWaitHeavy waiting at the end
// of each, from *now on, until h runs hot.
func heatUp(t *testing.T, h *fleetHeat, now *time.Time, n int) {
	t.Helper()
	for i := 0; !h.hot; i++ {
		if i > hotEnterWindows {
			t.Fatal("not hot")
		}
		*now = now.Add(hotWindow)
		h.heats(*now, n, hotEnter, hotWaitFrom, hotAlways, func() (int, error) { return hotWaitHeavy, nil })
	}
}
