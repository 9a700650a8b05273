package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zapcore"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// deadRow is a row of staged_jobs_dead.
type deadRow struct {
	id       int64
	jobName  *string
	jid      *string
	queue    *string
	reason   string
	attempts int
	failedAt time.Time
}

// dead returns the rows of staged_jobs_dead, by id.
func (h *harness) dead() []deadRow {
	h.t.Helper()
	rows, err := h.conn.Query(context.Background(),
		"SELECT id, job_name, jid, queue, reason, attempts, failed_at FROM "+
			pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()+" ORDER BY id")
	if err != nil {
		h.t.Fatalf("read staged_jobs_dead: %v", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (deadRow, error) {
		var d deadRow
		err := r.Scan(&d.id, &d.jobName, &d.jid, &d.queue, &d.reason, &d.attempts, &d.failedAt)
		return d, err
	})
	if err != nil {
		h.t.Fatalf("read staged_jobs_dead: %v", err)
	}
	return out
}

// checkDead checks that staged_jobs_dead holds exactly the jobs jids, each
// with attempts 1 and a reason containing reason, and that each was logged
// once at error as dead-lettered.
func (h *harness) checkDead(reason string, jids ...string) {
	h.t.Helper()
	rows := h.dead()
	var got []string
	for _, d := range rows {
		jid := "<NULL>"
		if d.jid != nil {
			jid = *d.jid
		}
		got = append(got, jid)
		if !strings.Contains(d.reason, reason) || d.attempts != 1 || d.failedAt.IsZero() {
			h.t.Errorf("dead row %d: reason %q, attempts %d, failed_at %v; want a reason containing %q, attempts 1, a failed_at",
				d.id, d.reason, d.attempts, d.failedAt, reason)
		}
	}
	if !slices.Equal(got, jids) {
		h.t.Fatalf("staged_jobs_dead holds jids %v, want %v", got, jids)
	}
	// The line is written after the commit that made the rows dead.
	h.waitLog("job dead-lettered", len(jids))
	logged := h.logs.FilterMessage("job dead-lettered").All()
	if len(logged) != len(jids) {
		h.t.Fatalf("%d \"job dead-lettered\" lines, want one per dead row (%d): %v", len(logged), len(jids), messages(h.logs))
	}
	for _, e := range logged {
		f := e.ContextMap()
		if e.Level != zapcore.ErrorLevel || !strings.Contains(fmt.Sprint(f["reason"]), reason) || f["id"] == nil || f["queue"] == nil {
			h.t.Errorf("dead-lettered line %v at %s, want error level with id, jid, queue and a reason containing %q", f, e.Level, reason)
		}
	}
}

// The reproduction: with batches of 2, two jobs to a queue whose key
// holds a string (WRONGTYPE) make a batch Redis refuses whole. They move to
// staged_jobs_dead, and the good job behind them is delivered at once, not
// on a poll a minute away.
func TestPoisonBatchDoesNotBlockTheQueue(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	if err := h.rdb.Set(ctx, h.key("queue:broken"), "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	bad := h.stageMany(relay.Job{Name: "Bad", Queue: "broken"}, relay.Job{Name: "Bad", Queue: "broken"})
	good := h.stage(relay.Job{Name: "Good"})
	cfg := h.config()
	cfg.BatchSize = 2
	cfg.PollInterval = time.Minute
	h.start(cfg)

	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queueJIDs("default"); got[0] != good {
		t.Fatalf("queue:default holds %v, want %s", got, good)
	}
	h.waitStaged(0)
	h.checkDead("WRONGTYPE", bad...)
	if n := h.logs.FilterMessage("batch failed, retrying").Len(); n != 0 {
		t.Errorf("%d failed batches, want none: poison is not retried (%v)", n, messages(h.logs))
	}
}

// A queue whose Redis key holds the wrong type refuses its jobs; the jobs
// of the other queues in the same batch are delivered, and the refused one
// is dead-lettered.
func TestRefusedQueueDoesNotBlockOthers(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	if err := h.rdb.Set(ctx, h.key("queue:broken"), "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	jids := h.stageMany(
		relay.Job{Name: "Stuck", Queue: "broken"},
		relay.Job{Name: "Fine", Queue: "default"},
		relay.Job{Name: "AlsoFine", Queue: "other"},
	)
	h.start(h.config())

	h.waitQueueLen("default", 1, 10*time.Second)
	h.waitQueueLen("other", 1, 10*time.Second)
	h.waitStaged(0)
	h.checkDead("WRONGTYPE", jids[0])
	for q, want := range map[string]string{"default": jids[1], "other": jids[2]} {
		if jobs := h.queue(q); len(jobs) != 1 || jobs[0].jid() != want {
			t.Fatalf("queue:%s = %v, want only %s (no duplicate)", q, jobs, want)
		}
	}
}

// A payload over MaxPayloadBytes is dead-lettered; its neighbours, in the
// same batch, are delivered.
func TestOversizedPayloadIsDeadLettered(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	jids := h.stageMany(
		relay.Job{Name: "Before"},
		relay.Job{Name: "Huge", Args: []any{strings.Repeat("x", 600)}},
		relay.Job{Name: "After"},
	)
	cfg := h.config()
	cfg.MaxPayloadBytes = 500
	h.start(cfg)

	h.waitQueueLen("default", 2, 10*time.Second)
	if got := h.queueJIDs("default"); !slices.Equal(got, []string{jids[0], jids[2]}) {
		t.Fatalf("queue:default holds %v, want %v", got, []string{jids[0], jids[2]})
	}
	h.waitStaged(0)
	h.checkDead("over the limit of 500", jids[1])
}

// A NULL job_name, possible in a table made by hand without NOT NULL, is
// dead-lettered with its NULL kept; the rows around it are delivered.
func TestNullColumnIsDeadLettered(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	if _, err := h.conn.Exec(ctx, "ALTER TABLE "+table+" ALTER COLUMN job_name DROP NOT NULL, DROP CONSTRAINT staged_jobs_job_name_check"); err != nil {
		t.Fatal(err)
	}
	before := h.stage(relay.Job{Name: "Before"})
	var nullJID string
	if err := h.conn.QueryRow(ctx, "INSERT INTO "+table+" (job_name, job_args) VALUES (NULL, '[]') RETURNING jid").Scan(&nullJID); err != nil {
		t.Fatal(err)
	}
	after := h.stage(relay.Job{Name: "After"})
	h.start(h.config())

	h.waitQueueLen("default", 2, 10*time.Second)
	if got := h.queueJIDs("default"); !slices.Equal(got, []string{before, after}) {
		t.Fatalf("queue:default holds %v, want %v", got, []string{before, after})
	}
	h.waitStaged(0)
	h.checkDead("job_name is NULL", nullJID)
	if d := h.dead()[0]; d.jobName != nil {
		t.Fatalf("dead row's job_name = %q, want NULL as staged", *d.jobName)
	}
}

// Redis out of memory (OOM) is not poison: the row stays staged, nothing is
// dead-lettered, the batch is retried with backoff, and the job is delivered
// once memory is freed.
func TestOOMIsTransient(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
	h := newHarness(t)
	opts := func() *redis.Options {
		return testenv.RedisOptions(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port)})
	}
	h.rdb = redis.NewClient(opts())
	t.Cleanup(func() { _ = h.rdb.Close() })
	relayRedis := redis.NewClient(opts())
	t.Cleanup(func() { _ = relayRedis.Close() })
	ctx := context.Background()

	// Fill Redis, in small values whose transient buffers do not matter,
	// until it refuses an LPUSH as the relay's.
	filler := strings.Repeat("f", 1<<10)
	for i := 0; ; i++ {
		if i > 10_000 {
			t.Fatal("Redis with --maxmemory 1mb took 10 MiB without OOM")
		}
		err := h.rdb.Set(ctx, fmt.Sprintf("filler:%d", i), filler, 0).Err()
		if err == nil {
			continue
		}
		if !strings.HasPrefix(err.Error(), "OOM") {
			t.Fatalf("filling Redis: %v, want OOM at last", err)
		}
		err = h.rdb.LPush(ctx, h.key("queue:probe"), "x").Err()
		if err != nil && strings.HasPrefix(err.Error(), "OOM") {
			break
		}
		if err != nil {
			t.Fatalf("LPUSH to a full Redis: %v, want OOM", err)
		}
	}

	cfg := h.config()
	cfg.Redis = relayRedis
	h.start(cfg)
	jid := h.stage(relay.Job{Name: "Patient"})
	// Redis refuses the script's writes (OOM): the batch fails whole, and
	// the error names the OOM.
	testenv.WaitFor(t, 15*time.Second, "two batches failed with OOM", func() (bool, string) {
		return h.logs.FilterMessage("batch failed, retrying").Len() >= 2, fmt.Sprint(messages(h.logs))
	})
	for _, e := range h.logs.FilterMessage("batch failed, retrying").All() {
		if err := fmt.Sprint(e.ContextMap()["error"]); !strings.Contains(err, "OOM") {
			t.Fatalf("a batch failed with %s, want an error naming the OOM", err)
		}
	}
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged while Redis is out of memory, want 1", n)
	}
	if d := h.dead(); len(d) != 0 {
		t.Fatalf("staged_jobs_dead holds %v while Redis is out of memory, want nothing: OOM is not poison", d)
	}

	// Free memory: drop the filler, and raise the limit above what an empty
	// Redis with a few clients already takes.
	if err := h.rdb.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := h.rdb.ConfigSet(ctx, "maxmemory", "64mb").Err(); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 1, 15*time.Second)
	if got := h.queueJIDs("default"); got[0] != jid {
		t.Fatalf("queue:default holds %v, want %s", got, jid)
	}
	h.waitStaged(0)
	if d := h.dead(); len(d) != 0 {
		t.Fatalf("staged_jobs_dead holds %v, want nothing", d)
	}
	if n := h.logs.FilterMessage("job dead-lettered").Len(); n != 0 {
		t.Fatalf("%d dead-lettered lines, want none", n)
	}
}

// A row that dies while a dead row with its id is still there (copied back
// by hand rather than moved by dead retry) replaces that row and counts one
// more attempt, instead of failing the batch, and so the queue, for good.
func TestPoisonRowDyingAgainCountsAttempts(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	if err := h.rdb.Set(ctx, h.key("queue:broken"), "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	dead := pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()
	if _, err := h.conn.Exec(ctx, "INSERT INTO "+dead+` (id, job_name, job_args, queue, jid, created_at, options, reason, attempts)
		VALUES (1000, 'Bounced', '[]', 'broken', 'aaaaaaaaaaaaaaaaaaaaaaaa', now(), '{}', 'an earlier death', 1)`); err != nil {
		t.Fatal(err)
	}
	if _, err := h.conn.Exec(ctx, "INSERT INTO "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+
		` (id, job_name, job_args, queue, jid) VALUES (1000, 'Bounced', '[]', 'broken', 'aaaaaaaaaaaaaaaaaaaaaaaa')`); err != nil {
		t.Fatal(err)
	}
	good := h.stage(relay.Job{Name: "Good"})
	h.start(h.config())

	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queueJIDs("default"); got[0] != good {
		t.Fatalf("queue:default holds %v, want %s", got, good)
	}
	h.waitStaged(0)
	rows := h.dead()
	if len(rows) != 1 || rows[0].id != 1000 || rows[0].attempts != 2 || !strings.Contains(rows[0].reason, "WRONGTYPE") {
		t.Fatalf("staged_jobs_dead holds %+v, want row 1000 with attempts 2 and a WRONGTYPE reason", rows)
	}
}
