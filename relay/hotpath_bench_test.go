package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// BenchmarkBatchBuild measures building a 1000-job batch for Redis, every
// payload and the grouping by queue (4 queues, a tenth of the jobs
// scheduled) and its commands for the push step, without the network: one
// op is one job. After the first batch the target's buffers are reused, so it should not allocate per job.
func BenchmarkBatchBuild(b *testing.B) {
	now := time.Now()
	later := now.Add(time.Hour)
	batch := make([]stagedJob, 1000)
	for i := range batch {
		batch[i] = stagedJob{id: int64(i), name: "WelcomeEmailJob", args: []byte(`[42, "welcome", {"locale": "en"}]`),
			queue: fmt.Sprintf("q%d", i%4), jid: "0123456789abcdef01234567", createdAt: now, options: []byte(`{}`)}
		if i%10 == 0 {
			batch[i].runAt = &later
		}
	}
	s := builtin(TargetSidekiq, targets.Options{MaxPayload: defaultMaxPayloadBytes})
	var u handoff.Unit
	var res pushResult
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		if n%len(batch) == 0 {
			res = pushResult{queues: res.queues[:0]}
			u.Reset()
			s.add(&u, batch, now, &res)
		}
		n++
	}
	if len(res.rejected) != 0 {
		b.Fatalf("%d jobs rejected", len(res.rejected))
	}
}

// BenchmarkClaim measures claiming (and deleting, then rolling back) a
// 1000-row batch with the relay's claim statement: one op is one job.
func BenchmarkClaim(b *testing.B) {
	ctx := context.Background()
	schema := testenv.Schema(b)
	conn := testenv.Conn(b, testenv.DatabaseURL())
	if _, err := Migrate(ctx, conn, schema); err != nil {
		b.Fatal(err)
	}
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	if _, err := conn.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args, queue)
		SELECT 'BenchJob', jsonb_build_array(g, 'some argument'), 'q' || (g % 4) FROM generate_series(1, 1000) g`); err != nil {
		b.Fatal(err)
	}
	// As the relay's drain sessions run it (relay.go).
	for name, value := range drainPlanSettings {
		if _, err := conn.Exec(ctx, "SELECT set_config($1, $2, false)", name, value); err != nil {
			b.Fatal(err)
		}
	}
	sql := newTableSQL(schema, false).claim
	var buf []stagedJob
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		if n%1000 == 0 {
			var err error
			if buf, err = claimBatch(ctx, conn, sql, nil, 1000, nil, fromStart, buf, []string{}); err != nil {
				b.Fatal(err)
			}
			if len(buf) != 1000 {
				b.Fatalf("claimed %d rows, want 1000", len(buf))
			}
			if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
				b.Fatal(err)
			}
		}
		n++
	}
}

// BenchmarkBatchRecord measures recording a committed 1000-job batch (4
// queues) as finish does, in one summary.batch call: the summary line's
// latency buckets, and with metrics the Prometheus latency histogram, the
// per-queue counters and the batch histograms. One op is one job; neither
// should allocate.
func BenchmarkBatchRecord(b *testing.B) {
	now := time.Now()
	batch := make([]stagedJob, 1000)
	for i := range batch {
		batch[i] = stagedJob{id: int64(i), queue: fmt.Sprintf("q%d", i%4), createdAt: now.Add(-time.Duration(i) * 10 * time.Microsecond)}
	}
	none := func(int64) bool { return false }
	for _, withMetrics := range []bool{false, true} {
		b.Run(fmt.Sprintf("metrics=%v", withMetrics), func(b *testing.B) {
			var s summary
			if withMetrics {
				s.metrics = newMetrics(string(TargetSidekiq), "public", "", &backlog{}, &s.mu)
			}
			b.ReportAllocs()
			n := 0
			for b.Loop() {
				if n%len(batch) == 0 {
					s.batch(batch, none, now, now, 0)
				}
				n++
			}
		})
	}
}

// BenchmarkFleetPoll measures a hot fleet's poll over 200 schemas with
// nothing staged, on one session of the drain pool's configuration: one op
// is one poll (pollSQL's statements in one round trip). A hot fleet of 200
// polls every 4 ms (hotStep), so this is the share of a PostgreSQL
// session's time that polling takes.
func BenchmarkFleetPoll(b *testing.B) {
	ctx := context.Background()
	suffixes := make([]string, 200)
	for i := range suffixes {
		suffixes[i] = fmt.Sprintf("%03d", i)
	}
	r, led, _ := pollTenants(b, "bpoll", suffixes)
	s, _ := pollSession(b, r)
	for b.Loop() {
		if n, err := s.poll(ctx, led, true); err != nil || n != 0 {
			b.Fatalf("the poll found %d schemas with rows, want 0; error: %v", n, err)
		}
	}
}
