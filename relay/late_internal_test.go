package relay

import (
	"slices"
	"testing"
	"time"
)

// The schedule of the checks of late commits: 0.2ms after the relay went
// idle, then each time the youngest transaction's age doubles; a
// transaction that ends leaves the set (and reports it); one older than
// the window is dropped; one that stays open is checked only as its age
// doubles, even while the relay goes idle again and again with new ones.
func TestLateCommitsSchedule(t *testing.T) {
	l := lateCommits{window: time.Second}
	t.Cleanup(l.stop)
	idle := time.Unix(0, 0)
	at := func(d time.Duration) time.Time { return idle.Add(d) }
	wantNext := func(now time.Time, want time.Duration) {
		t.Helper()
		got, ok := l.next(now)
		if !ok || got != want {
			t.Fatalf("next check at +%s: %s (%v), want %s", now.Sub(idle), got, ok, want)
		}
	}

	l.add([]int64{10, 11}, idle)
	wantNext(idle, lateFirstCheck)
	// At 0.2ms both are in progress: next at 0.4ms, 0.8ms, ... (doubling).
	if l.checked([]int64{10, 11}, at(200*time.Microsecond)) {
		t.Fatal("checked reported an end with both still in progress")
	}
	wantNext(at(200*time.Microsecond), 200*time.Microsecond)
	wantNext(at(800*time.Microsecond), 800*time.Microsecond)
	// 11 ends: reported, and 10 stays.
	if !l.checked([]int64{10}, at(1600*time.Microsecond)) {
		t.Fatal("checked did not report 11's end")
	}
	if got := l.ids(); !slices.Equal(got, []int64{10}) {
		t.Fatalf("ids after 11 ended = %v, want [10]", got)
	}
	// The relay goes idle again at 100ms with a new transaction, 12: the
	// next check is 0.2ms later, for 12; once 12 ends, 10 alone is checked
	// when its age doubles again, not every 0.2ms.
	l.add([]int64{10, 12}, at(100*time.Millisecond))
	wantNext(at(100*time.Millisecond), lateFirstCheck)
	if !l.checked([]int64{10}, at(100*time.Millisecond+lateFirstCheck)) {
		t.Fatal("checked did not report 12's end")
	}
	wantNext(at(100*time.Millisecond+lateFirstCheck), 100*time.Millisecond+lateFirstCheck)
	// Past the window, 10 is dropped: the fallback poll covers it.
	if _, ok := l.next(at(time.Second + time.Millisecond)); ok {
		t.Fatal("a transaction older than the window is still checked")
	}
	if l.C() != nil {
		t.Fatal("C is not nil with nothing to check")
	}
}
