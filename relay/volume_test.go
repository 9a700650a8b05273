package relay_test

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// 10,000 jobs over four queues, a fifth of them scheduled, staged in one big
// transaction and in many small concurrent ones: each is delivered exactly
// once, exactly where it belongs, and nothing is left staged.
func TestTenThousandJobsLandWhereTheyBelong(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.BatchSize = 500 // several batches even from the big transaction
	h.start(cfg)
	ctx := context.Background()

	queues := []string{"default", "mail", "billing", "low"}
	future := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	type placed struct {
		queue string
		runAt time.Time // zero: immediate
	}
	job := func(i int) (relay.Job, placed) {
		p := placed{queue: queues[i%len(queues)]}
		j := relay.Job{Name: "VolumeJob", Args: []any{i}, Queue: p.queue}
		if i%5 == 0 {
			p.runAt = future.Add(time.Duration(i) * time.Millisecond)
			j.RunAt = p.runAt
		}
		return j, p
	}

	var mu sync.Mutex
	want := make(map[string]placed, 10_000)
	record := func(jids []string, ps []placed) {
		mu.Lock()
		defer mu.Unlock()
		for i, jid := range jids {
			want[jid] = ps[i]
		}
	}

	// 5,000 in one transaction.
	var jobs []relay.Job
	var ps []placed
	for i := range 5000 {
		j, p := job(i)
		jobs, ps = append(jobs, j), append(ps, p)
	}
	err := pgx.BeginFunc(ctx, h.conn, func(tx pgx.Tx) error {
		jids, err := h.stager.StageMany(ctx, tx, jobs)
		record(jids, ps)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	// 5,000 more from 8 writers, 25 jobs per transaction.
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := pgx.Connect(ctx, testenv.DatabaseURL())
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close(ctx)
			for b := range 25 {
				var jobs []relay.Job
				var ps []placed
				for k := range 25 {
					j, p := job(5000 + w*625 + b*25 + k)
					jobs, ps = append(jobs, j), append(ps, p)
				}
				err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					jids, err := h.stager.StageMany(ctx, tx, jobs)
					if err == nil {
						record(jids, ps)
					}
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(want) != 10_000 {
		t.Fatalf("staged %d distinct jids, want 10000", len(want))
	}

	testenv.WaitFor(t, 60*time.Second, "all 10000 jobs pushed", func() (bool, string) {
		n := h.staged()
		return n == 0, fmt.Sprintf("%d rows staged", n)
	})

	seen := make(map[string]int, 10_000)
	for _, q := range queues {
		for _, j := range h.queue(q) {
			seen[j.jid()]++
			p, ok := want[j.jid()]
			switch {
			case !ok:
				t.Fatalf("queue:%s holds unknown jid %s", q, j.jid())
			case p.queue != q || !p.runAt.IsZero():
				t.Fatalf("jid %s in queue:%s, want queue %s scheduled at %v", j.jid(), q, p.queue, p.runAt)
			}
			if _, ok := j["enqueued_at"]; !ok {
				t.Fatalf("immediate job %s has no enqueued_at", j.jid())
			}
		}
	}
	sched, scores := h.scheduled()
	for i, j := range sched {
		seen[j.jid()]++
		p, ok := want[j.jid()]
		if !ok || p.runAt.IsZero() {
			t.Fatalf("schedule holds jid %s, which is not a scheduled job", j.jid())
		}
		if wantScore := float64(p.runAt.UnixMicro()) / 1e6; math.Abs(scores[i]-wantScore) > 1e-6 {
			t.Fatalf("jid %s scheduled at %f, want %f", j.jid(), scores[i], wantScore)
		}
		if j["queue"] != p.queue {
			t.Fatalf("scheduled jid %s has queue %v, want %s", j.jid(), j["queue"], p.queue)
		}
		if _, ok := j["enqueued_at"]; ok {
			t.Fatalf("scheduled job %s has enqueued_at", j.jid())
		}
	}
	if len(seen) != 10_000 {
		t.Fatalf("delivered %d distinct jids, want 10000", len(seen))
	}
	for jid, n := range seen {
		if n != 1 {
			t.Fatalf("jid %s delivered %d times, want once", jid, n)
		}
	}
	if len(sched) != 2000 {
		t.Fatalf("%d scheduled jobs, want 2000", len(sched))
	}
}
