package relay

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
)

// summaryEvery is how often a leader that pushed anything logs one info
// line of what it did; an idle one logs nothing.
const summaryEvery = 10 * time.Second

// latencyBounds are the upper bounds of the latency histogram's buckets: a
// job's time from created_at (its INSERT statement's start) to its push.
var latencyBounds = [...]time.Duration{
	time.Millisecond, 2 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond,
	20 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond,
	500 * time.Millisecond, time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second,
	30 * time.Second, time.Minute,
}

// summary counts what the drain did since the last summary line. It does
// not allocate per job: latencies go into fixed buckets.
//
// It also feeds the Prometheus metrics of each batch (metrics.go), when
// metrics is set, so that the drain records a batch in one call.
type summary struct {
	mu      sync.Mutex
	metrics *metrics // nil: no Prometheus metrics (unit tests)
	jobs    int
	batches int
	dead    int
	// poison counts poison rows left staged (by a source that does not
	// bury them) in this window; poisonStaged, in this leadership.
	poison       int
	poisonStaged int
	buckets      [len(latencyBounds) + 1]int // the last: above every bound
}

// batch records a finished batch, claimed at start and committed now:
// pushed jobs' latencies at pushedAt (the jobs whose ids are not in
// notPushed), and how many were dead-lettered.
func (s *summary) batch(jobs []stagedJob, notPushed func(id int64) bool, start, pushedAt time.Time, dead int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batches++
	s.dead += dead
	for i := range jobs {
		if notPushed(jobs[i].id) {
			continue
		}
		s.jobs++
		lat := pushedAt.Sub(jobs[i].createdAt)
		b := 0
		for b < len(latencyBounds) && lat > latencyBounds[b] {
			b++
		}
		s.buckets[b]++
		if s.metrics != nil {
			s.metrics.job(&jobs[i], lat)
		}
	}
	if s.metrics != nil {
		s.metrics.batch(len(jobs), dead, time.Since(start))
	}
}

// poisonKept records n more poison rows left staged and skipped, total in
// this leadership.
func (s *summary) poisonKept(n, total int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.poison += n
	s.poisonStaged = total
}

// summaryWindow is what take returns: one window's counts.
type summaryWindow struct {
	jobs, batches, dead  int
	poison, poisonStaged int
	p99                  time.Duration // the bucket bound that 99% of jobs are within; -1: above every bound
}

// take returns the counts since the last take and starts a new window.
func (s *summary) take() summaryWindow {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := summaryWindow{jobs: s.jobs, batches: s.batches, dead: s.dead, p99: -1,
		poison: s.poison, poisonStaged: s.poisonStaged}
	need, seen := (99*s.jobs+99)/100, 0 // ceil(0.99 x jobs)
	for b, n := range s.buckets {
		seen += n
		if seen >= need && b < len(latencyBounds) {
			w.p99 = latencyBounds[b]
			break
		}
	}
	s.jobs, s.batches, s.dead, s.poison, s.buckets = 0, 0, 0, 0, [len(latencyBounds) + 1]int{}
	return w
}

// summarize logs, every interval, one info line of what the drain did,
// while it does anything: jobs pushed, batches, jobs dead-lettered, the
// p99 of created_at-to-push latency (as a histogram bucket's bound), and the
// backlog and its oldest job's age. The backlog query (backlog.sample)
// counts at most backlogCap rows and reads the oldest of the lowest ids, so
// it stays cheap on a large table; it runs only for a line that is logged.
func (r *Relay) summarize(ctx context.Context, interval time.Duration) {
	for sleep(ctx, interval) {
		w := r.summary.take()
		if w.jobs == 0 && w.dead == 0 && w.poison == 0 {
			continue
		}
		fields := []zap.Field{
			zap.Int("jobs", w.jobs), zap.Int("batches", w.batches), zap.Int("dead_lettered", w.dead),
			zap.Duration("interval", interval),
		}
		if w.poisonStaged > 0 {
			// Poison rows a source without a dead-letter table left in
			// its table (skipped; counted in the backlog too).
			fields = append(fields, zap.Int("poison_staged", w.poisonStaged))
		}
		if w.p99 >= 0 {
			fields = append(fields, zap.String("p99_latency", "<= "+w.p99.String()))
		} else {
			fields = append(fields, zap.String("p99_latency", "> "+latencyBounds[len(latencyBounds)-1].String()))
		}
		b, err := r.backlog.sample(ctx, 0)
		switch {
		case err != nil:
			fields = append(fields, zap.String("backlog", fmt.Sprintf("unknown: %v", err)))
		case b.count > backlogCap-1:
			fields = append(fields, zap.String("backlog", fmt.Sprintf("%d+", backlogCap-1)))
		default:
			fields = append(fields, zap.Int("backlog", b.count))
		}
		if err == nil && !b.oldest.IsZero() {
			fields = append(fields, zap.Duration("oldest_age", b.at.Sub(b.oldest).Round(time.Millisecond)))
		}
		r.log.Info("drained", fields...)
	}
}

// backlogCap bounds the summary's count of staged rows (it reports
// "10000+" past it).
const backlogCap = 10_001
