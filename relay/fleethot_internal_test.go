package relay

import "testing"

// A fleet enters hot on a rate sustained over 500ms, or on a burst of
// 1.25 times the rate in one 100ms window, not on one window of Poisson noise
// at half the rate: at 100 commits a second over 20 or 200 schemas, a
// single window of 20 made the fleet run hot every few seconds, and each
// turn hot and back woke every schema's drain.
func TestFleetEntersHotOnASustainedRate(t *testing.T) {
	windows := func(counts ...int) (entered int) {
		var h fleetHeat
		for i, n := range counts {
			if h.enters(n, hotEnter) {
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
