package relay_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap/zapcore"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

var jidRE = regexp.MustCompile(`^[0-9a-f]{24}$`)

// A job staged in an open transaction stays out of Redis until the
// transaction commits; a rolled-back job never arrives; what arrives is a
// payload a Sidekiq worker runs.
func TestCommitGatesDelivery(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.start(h.config())
	h.waitLog("listening", 1)
	ctx := context.Background()

	// An open transaction with a staged job, and another one to roll back.
	open, err := testenv.Conn(t, testenv.DatabaseURL()).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pendingJID, err := h.stager.Stage(ctx, open, relay.Job{Name: "PendingJob", Args: []any{1}})
	if err != nil {
		t.Fatal(err)
	}
	doomed, err := testenv.Conn(t, testenv.DatabaseURL()).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	doomedJID, err := h.stager.Stage(ctx, doomed, relay.Job{Name: "DoomedJob", Args: []any{2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := doomed.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// A job committed after them: once it has arrived, the relay has
	// drained with the other two rows in the table.
	markerJID := h.stage(relay.Job{Name: "MarkerJob", Args: []any{3}})
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queue("default"); got[0].jid() != markerJID {
		t.Fatalf("queue:default = %v, want only the marker job %s", got, markerJID)
	}

	if err := open.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 2, 10*time.Second)
	jobs := h.queue("default")
	if jobs[1].jid() != pendingJID {
		t.Fatalf("second job jid = %s, want the committed pending job %s", jobs[1].jid(), pendingJID)
	}
	for _, j := range jobs {
		if j.jid() == doomedJID {
			t.Fatalf("rolled-back job %s was delivered", doomedJID)
		}
	}
	h.waitStaged(0) // the last batch's delete commits just after its push
	members, err := h.rdb.SMembers(ctx, h.key("queues")).Result()
	if err != nil || !slices.Equal(members, []string{"default"}) {
		t.Fatalf("SMEMBERS queues = %v (%v), want [default]", members, err)
	}
}

// The payload has every field a Sidekiq worker reads, with the options
// merged in.
func TestSidekiqPayload(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.start(h.config())
	before := float64(time.Now().UnixMicro())/1e6 - 1

	jid := h.stage(relay.Job{
		Name:    "Billing::ChargeJob",
		Args:    []any{42, "eur", map[string]any{"cents": 1999}},
		Queue:   "billing",
		Options: map[string]any{"retry": 3, "tags": []string{"vip"}},
	})
	if !jidRE.MatchString(jid) {
		t.Fatalf("jid = %q, want 24 lowercase hex characters", jid)
	}
	h.waitQueueLen("billing", 1, 10*time.Second)
	j := h.queue("billing")[0]
	after := float64(time.Now().UnixMicro())/1e6 + 1

	want := map[string]any{
		"class": "Billing::ChargeJob",
		"queue": "billing",
		"jid":   jid,
		"retry": float64(3),
	}
	for k, v := range want {
		if j[k] != v {
			t.Errorf("payload[%q] = %#v, want %#v", k, j[k], v)
		}
	}
	if args, _ := j["args"].([]any); len(args) != 3 || args[0] != float64(42) || args[1] != "eur" {
		t.Errorf("payload args = %#v, want [42 eur {cents:1999}]", j["args"])
	}
	if tags, _ := j["tags"].([]any); len(tags) != 1 || tags[0] != "vip" {
		t.Errorf("payload tags = %#v, want [vip]", j["tags"])
	}
	for _, k := range []string{"created_at", "enqueued_at"} {
		ts, ok := j[k].(float64)
		if !ok || ts < before || ts > after {
			t.Errorf("payload[%q] = %#v, want float epoch seconds in [%f, %f]", k, j[k], before, after)
		}
	}
}

// With the fallback poll at a minute, a committed job still arrives at
// once: NOTIFY woke the relay.
func TestNotifyWakesRelay(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.PollInterval = time.Minute
	_, idle := h.startSignaled(cfg)
	h.waitIdleAfterListen(idle)
	// From here on only a notification or the poll, a minute away, can
	// wake the relay.
	jid := h.stage(relay.Job{Name: "WakeJob"})
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queue("default")[0].jid(); got != jid {
		t.Fatalf("delivered jid %s, want %s", got, jid)
	}
}

// Jobs committed while the listener's connection is down are drained by
// the backlog drain after it reconnects, not by the (minute-long) poll.
func TestListenerReconnectDrainsBacklog(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.PollInterval = time.Minute
	_, idle := h.startSignaled(cfg)
	// Idle after a drain that began once the listener LISTENed: the drain
	// at start is over, and no transaction of the test was in progress
	// when the relay went idle, so none is drained as a late commit.
	h.waitIdleAfterListen(idle)
	ctx := context.Background()

	// Kill the listener and commit jobs in the same transaction: its
	// NOTIFY goes out at COMMIT, after the listener is gone.
	tx, err := h.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	jids, err := h.stager.StageMany(ctx, tx, []relay.Job{{Name: "A"}, {Name: "B"}, {Name: "C"}})
	if err != nil {
		t.Fatal(err)
	}
	// Find the pid first: pg_terminate_backend in a WHERE clause may run
	// before the other conditions filter the rows.
	rows, err := tx.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE query IN ($1, '-- ' || $1)`,
		"listen "+pgx.Identifier{relay.ChannelName(h.schema)}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil || len(pids) != 1 {
		t.Fatalf("found listener backends %v (%v), want one", pids, err)
	}
	var ok bool
	if err := tx.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pids[0]).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend(%d) = %v, %v", pids[0], ok, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	h.waitLog("listener reconnected", 1)
	h.waitQueueLen("default", 3, 15*time.Second)
	got := h.queueJIDs("default")
	if !slices.Equal(got, jids) {
		t.Fatalf("delivered %v, want %v in that order", got, jids)
	}
}

// A failure after the push and before the delete commits rolls the batch
// back; the handoff record says the push delivered its rows, so the retry
// deletes them without pushing them again: each job arrives once.
func TestCrashBetweenPushAndDeleteIsNotRepeated(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	calls := failFirstPush(r)
	jids := h.stageMany(relay.Job{Name: "A"}, relay.Job{Name: "B"})
	h.run(r)

	h.waitLog("batch failed, retrying", 1)
	h.waitStaged(0)
	h.waitLog("batch drained", 1) // the retry; the failed batch logged no such line
	h.waitLog("batch succeeded after retries", 1)
	got := h.queueJIDs("default")
	if !slices.Equal(got, jids) {
		t.Fatalf("delivered %v, want %v: each job once", got, jids)
	}
	if calls.Load() < 2 {
		t.Fatalf("afterPush ran %d times, want at least 2: the failed batch and its retry", calls.Load())
	}
	h.waitRecordEmpty()
}

// While one batch is pushed the next is already claimed; when the first
// fails, the claimed one is rolled back too, and every job still arrives
// once, in order.
func TestFailureWithNextBatchClaimed(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.BatchSize = 2
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	failFirstPush(r)
	var jobs []relay.Job
	for i := range 7 {
		jobs = append(jobs, relay.Job{Name: "Pipelined", Args: []any{i}})
	}
	jids := h.stageMany(jobs...)
	h.run(r)

	h.waitStaged(0)
	h.waitQueueLen("default", 7, 15*time.Second)
	if got := h.queueJIDs("default"); !slices.Equal(got, jids) {
		t.Fatalf("delivered\n %v\nwant\n %v", got, jids)
	}
	h.waitRecordEmpty()
}

// failFirstPush makes r's first batch fail between its push and its delete,
// as a crash there would, and counts the batches that got that far.
func failFirstPush(r *relay.Relay) *atomic.Int32 {
	var calls atomic.Int32
	relay.SetAfterPush(r, func(context.Context) error {
		if calls.Add(1) == 1 {
			return errors.New("injected crash after push")
		}
		return nil
	})
	return &calls
}

// A drain of full batches claims from after the last batch's id, not from
// the table's start; a row with a lower id that commits meanwhile is still
// delivered by the same drain (its rescan from the start), with neither a
// notification (the trigger is dropped) nor a poll (a minute away).
func TestLowIDCommittedDuringDrainIsDelivered(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	if _, err := h.conn.Exec(ctx, "DROP TRIGGER stagedrain_wake ON "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	late, err := testenv.Conn(t, testenv.DatabaseURL()).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)                                           //nolint:errcheck // committed below
	lateJID, err := h.stager.Stage(ctx, late, relay.Job{Name: "Late"}) // the lowest id
	if err != nil {
		t.Fatal(err)
	}
	var early []relay.Job
	for range 10 {
		early = append(early, relay.Job{Name: "Early"})
	}
	h.stageMany(early...)

	cfg := h.config()
	cfg.PollInterval = time.Minute
	cfg.BatchSize = 2
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var pushes atomic.Int32
	relay.SetAfterPush(r, func(ctx context.Context) error {
		if pushes.Add(1) == 1 {
			return late.Commit(ctx) // below the cursor of the claims to come
		}
		return nil
	})
	h.run(r)
	h.waitQueueLen("default", 11, 10*time.Second)
	if got := h.queueJIDs("default"); !slices.Contains(got, lateJID) {
		t.Fatalf("delivered %v, want the late job %s among them", got, lateJID)
	}
}

// While jobs flow, the leader logs one info line per interval saying what
// it did; every such line counts work (an idle window logs nothing), and
// together they count every job.
func TestSummaryLine(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	relay.SetSummaryEvery(r, 50*time.Millisecond)
	h.run(r)
	var jobs []relay.Job
	for range 30 {
		jobs = append(jobs, relay.Job{Name: "Summarized"})
	}
	h.stageMany(jobs...)
	h.waitQueueLen("default", 30, 10*time.Second)
	testenv.WaitFor(t, 10*time.Second, "summary lines counting 30 jobs", func() (bool, string) {
		total := 0
		for _, e := range h.logs.FilterMessage("drained").All() {
			total += int(e.ContextMap()["jobs"].(int64))
		}
		return total == 30, fmt.Sprintf("%d jobs in %d lines", total, h.logs.FilterMessage("drained").Len())
	})
	for _, e := range h.logs.FilterMessage("drained").All() {
		f := e.ContextMap()
		if e.Level != zapcore.InfoLevel || f["jobs"].(int64) == 0 || f["batches"].(int64) == 0 ||
			f["p99_latency"] == nil || f["backlog"] == nil {
			t.Errorf("summary line %v %v: want info with jobs, batches, p99_latency and backlog", e.Level, f)
		}
	}
}

// Drains that come often leave the handoff record to their pushes, which
// delete the fields done with; a schema's record is tidied (a WAL read and
// an HDEL each) only TidyEvery after its last drain. Here jobs are staged
// one after the other for two seconds, each as soon as the last one
// arrived: no drain's end tidies (before, one tidied each second), and once
// the jobs stop the drain loop's timer does, which empties the record.
func TestBusyDrainsLeaveTheTidyToTheirPushes(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	var atEnd, byTimer atomic.Int32
	relay.SetOnTidy(r, func(end bool) {
		if end {
			atEnd.Add(1)
		} else {
			byTimer.Add(1)
		}
	})
	h.run(r)
	start := time.Now()
	var n int
	for n = 1; time.Since(start) < 2*time.Second; n++ {
		h.stage(relay.Job{Name: "Busy", Args: []any{n}})
		h.waitQueueLen("default", int64(n), 15*time.Second)
	}
	if got := atEnd.Load(); got != 0 {
		t.Fatalf("%d tidies at a drain's end while %d jobs came one after the other, want none: their pushes delete the fields", got, n-1)
	}
	testenv.WaitFor(t, 15*time.Second, "a tidy by the drain loop's timer", func() (bool, string) {
		return byTimer.Load() > 0, fmt.Sprintf("%d at a drain's end, %d by the timer", atEnd.Load(), byTimer.Load())
	})
	h.waitRecordEmpty()
}
