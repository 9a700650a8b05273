package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// BenchmarkDrain measures the relay's throughput from committed rows to
// Redis: each op is one job. b.N jobs are staged while no relay runs, then
// the timer covers a relay draining them all (claim, push, delete).
func BenchmarkDrain(b *testing.B) {
	for _, batch := range []int{100, 1000} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			h := newBenchHarness(b)
			ctx := context.Background()
			jobs := make([]relay.Job, 0, 5000)
			for staged := 0; staged < b.N; {
				jobs = jobs[:0]
				for i := 0; i < 5000 && staged < b.N; i++ {
					jobs = append(jobs, relay.Job{Name: "BenchJob", Args: []any{staged, "some argument"}, Queue: fmt.Sprintf("q%d", staged%4)})
					staged++
				}
				if err := pgx.BeginFunc(ctx, h.conn, func(tx pgx.Tx) error {
					_, err := h.stager.StageMany(ctx, tx, jobs)
					return err
				}); err != nil {
					b.Fatal(err)
				}
			}
			cfg := h.config()
			cfg.BatchSize = batch
			r, err := relay.New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			runCtx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			b.ResetTimer()
			start := time.Now()
			go func() { done <- r.Run(runCtx) }()
			// Watch Redis, not the table: counting rows would take
			// PostgreSQL's time from the relay being measured.
			testenv.WaitFor(b, 10*time.Minute, "all jobs in Redis", func() (bool, string) {
				var n int64
				for q := range 4 {
					l, _ := h.rdb.LLen(ctx, fmt.Sprintf("%s:queue:q%d", h.ns, q)).Result()
					n += l
				}
				return n == int64(b.N), fmt.Sprint(n, " in Redis")
			})
			elapsed := time.Since(start)
			b.StopTimer()
			// The last batch's delete commits just after its push.
			testenv.WaitFor(b, time.Minute, "staged_jobs to empty", func() (bool, string) {
				var staged int
				err := h.conn.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()).Scan(&staged)
				return err == nil && staged == 0, fmt.Sprint(staged, " staged ", err)
			})
			cancel()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
		})
	}
}

// BenchmarkCommitToQueue measures the latency a worker sees: each op
// commits one job and waits, in a BRPOP like a Sidekiq worker's, until it
// arrives. The fallback poll is a minute, so NOTIFY is what wakes the relay.
func BenchmarkCommitToQueue(b *testing.B) {
	h := newBenchHarness(b)
	cfg := h.config()
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testenv.WaitFor(b, 10*time.Second, "relay to listen", func() (bool, string) {
		return h.logs.FilterMessage("listening").Len() > 0, ""
	})
	bg := context.Background()
	b.ResetTimer()
	for i := range b.N {
		if _, err := h.stager.Stage(bg, h.conn, relay.Job{Name: "LatencyJob", Args: []any{i}}); err != nil {
			b.Fatal(err)
		}
		if _, err := h.rdb.BRPop(bg, 10*time.Second, h.ns+":queue:default").Result(); err != nil {
			b.Fatalf("job %d did not arrive: %v", i, err)
		}
	}
	b.StopTimer()
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}

// newBenchHarness is newHarness for a benchmark: a migrated schema, a Redis
// namespace and a quiet logger.
func newBenchHarness(b *testing.B) *harness {
	b.Helper()
	h := &harness{schema: testenv.Schema(b)}
	h.rdb, h.ns = testenv.Redis(b)
	h.conn = testenv.Conn(b, testenv.DatabaseURL())
	if _, err := relay.Migrate(context.Background(), h.conn, h.schema); err != nil {
		b.Fatal(err)
	}
	h.stager = relay.NewStager(h.schema)
	return h
}
