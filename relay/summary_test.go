package relay

import (
	"testing"
	"time"
)

// The window's p99 is the bound of the bucket that holds the 99th
// percentile; take starts a new, empty window; jobs not pushed do not count.
func TestSummaryWindow(t *testing.T) {
	var s summary
	now := time.Now()
	var jobs []stagedJob
	for i := range 100 {
		lat := 500 * time.Microsecond // 99 jobs within 1ms
		if i == 99 {
			lat = 30 * time.Millisecond
		}
		jobs = append(jobs, stagedJob{id: int64(i), createdAt: now.Add(-lat)})
	}
	jobs = append(jobs, stagedJob{id: 1000, createdAt: now.Add(-time.Hour)}) // left staged
	s.batch(jobs, func(id int64) bool { return id == 1000 }, now, now, 2)
	w := s.take()
	if w.jobs != 100 || w.batches != 1 || w.dead != 2 || w.p99 != time.Millisecond {
		t.Fatalf("window = %+v, want 100 jobs, 1 batch, 2 dead, p99 1ms", w)
	}
	s.batch(jobs[99:100], func(int64) bool { return false }, now, now, 0)
	if w := s.take(); w.jobs != 1 || w.p99 != 50*time.Millisecond {
		t.Fatalf("second window = %+v, want 1 job with p99 50ms", w)
	}
	if w := s.take(); w.jobs != 0 || w.batches != 0 || w.dead != 0 {
		t.Fatalf("empty window = %+v, want zeros", w)
	}
}
