package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A hot fleet drains the schemas one poll finds together: one transaction
// claims a batch from each, pushes each through its own schema's handoff
// record, the pushes in one Redis pipeline, and commits them all
// (fleetdrain.go). Checked by the fleet's counters of shared commits and
// of the batches in them, by the push scripts of several schemas seen in
// one pipeline, and by every job delivered exactly once: those of the
// commits that made the fleet run hot, and three staged in three schemas by
// one app transaction, which the next poll finds at once.
func TestFleetHotDrainsSchemasTogether(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 4)
	cfg := fh.fleetConfig()
	rdb := redis.NewClient(fh.rdb.Options())
	t.Cleanup(func() { rdb.Close() })
	pipes := &scriptPipes{}
	rdb.AddHook(pipes)
	cfg.Redis = rdb
	r, bc := startHotFleet(t, fh, cfg)
	fh.waitJIDs("busy", bc.stop())

	before := pipes.most.Load()
	untilShared(t, r, func(run int) {
		q := fmt.Sprintf("together%d", run)
		fh.waitJIDs(q, fh.stageAcross(context.Background(), fh.schemas[:3], q))
	})
	if !relay.FleetHot(r) {
		t.Fatal("the fleet cooled: its schemas' drains, not the hot poll's, may have delivered")
	}
	if most := pipes.most.Load(); most < 2 {
		t.Fatalf("at most %d push scripts in one Redis pipeline (%d before the last runs), want a shared drain's pushes together", most, before)
	}
	for _, schema := range fh.schemas {
		var n int
		if err := fh.conn.QueryRow(context.Background(), fmt.Sprintf(`SELECT count(*) FROM %q.staged_jobs`, schema)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Fatalf("%s still stages %d rows, all delivered", schema, n)
		}
		// Each schema's handoff record ends empty: tidied after the
		// shared drains (at once, or by its drain loop's timer).
		_, record := relay.HandoffKeys(fh.ns, fh.conn.Config().Database, schema)
		testenv.WaitFor(t, 15*time.Second, schema+"'s handoff record empty", func() (bool, string) {
			m, err := fh.rdb.HGetAll(context.Background(), record).Result()
			if err != nil {
				return false, err.Error()
			}
			return len(m) == 0, fmt.Sprintf("%d fields", len(m))
		})
	}
}

// sharedCounters reads the fleet r's counters of shared commits and of the
// schemas' batches in them.
func sharedCounters(t *testing.T, r *relay.Relay) (commits, batches float64) {
	t.Helper()
	fams, err := r.MetricsGatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		switch f.GetName() {
		case "stagedrain_fleet_shared_commits_total":
			commits = f.GetMetric()[0].GetCounter().GetValue()
		case "stagedrain_fleet_shared_batches_total":
			batches = f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return commits, batches
}

// A shared drain whose push fails for one schema rolls back every batch it
// claimed, the pushed ones too: their rows stay staged, and their handoff
// records say they were delivered, so that each schema's own drain, woken,
// deletes them without pushing them again. Here the third schema's fence
// is taken by another relay (as a new leader does) just before one app
// transaction stages a job in each of three schemas: the first two are
// pushed, the third is refused, the shared transaction rolls back, and
// still every job reaches Redis exactly once (the third once its relay has
// stepped down and led again).
func TestFleetSharedDrainRollsBackAsOne(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 4)
	ctx := context.Background()
	cfg := fh.fleetConfig()
	_, bc := startHotFleet(t, fh, cfg)
	fh.waitJIDs("busy", bc.stop())

	fence, _ := relay.HandoffKeys(fh.ns, fh.conn.Config().Database, fh.schemas[2])
	var jids []string
	// A schema's own drain may take the jobs instead of the fleet's poll:
	// one still awake from the busy load, or woken when a transaction it
	// saw in progress ends. Then the third schema's own drain is fenced
	// off, steps down and leads again (its fence its own once more), and
	// the jobs arrive; stage again until a shared drain carried them.
	for attempt := 1; fh.logs.FilterMessage(sharedFailed).Len() == 0; attempt++ {
		if attempt > 5 {
			t.Fatalf("5 times a job in each of three schemas, and no shared drain failed on the fence; logs: %v", messages(fh.logs))
		}
		if err := fh.rdb.HSet(ctx, fence, "token", "another-leader").Err(); err != nil {
			t.Fatal(err)
		}
		jids = append(jids, fh.stageAcross(ctx, fh.schemas[:3], "together")...)
		fh.waitJIDs("together", jids)
	}
	for _, schema := range fh.schemas {
		testenv.WaitFor(t, 15*time.Second, schema+" drained", func() (bool, string) {
			var n int
			if err := fh.conn.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %q.staged_jobs`, schema)).Scan(&n); err != nil {
				return false, err.Error()
			}
			return n == 0, fmt.Sprintf("%d rows staged", n)
		})
	}
	// Nothing came twice, late: the queue holds each job once.
	if got := fh.queueJIDs("together"); len(got) != len(jids) {
		t.Fatalf("queue together holds %d jobs %v, want %v once each", len(got), got, jids)
	}
	failed := fh.logs.FilterMessage(sharedFailed).All()[0]
	if msg := fmt.Sprint(failed.ContextMap()["error"]); !strings.Contains(msg, fh.schemas[2]) || !strings.Contains(msg, "fenced off") {
		t.Fatalf("the shared drain failed with %q, want %s's fence's refusal", msg, fh.schemas[2])
	}
}

// The shared drain crossed with a group of queues and a poison row: each
// schema's batch is claimed by its own claim, of the group's queues only,
// and the poison of one schema is buried in its own dead-letter table by
// the shared commit, while the other schemas' jobs are delivered. One app
// transaction stages a job of the group in a first schema, an oversized
// one in a second, and a job of a queue outside the group in a third.
func TestFleetSharedDrainWithQueuesAndPoison(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 3)
	ctx := context.Background()
	cfg := fh.fleetConfig()
	cfg.Queues = []string{"busy", "together"}
	cfg.MaxPayloadBytes = 500
	r, bc := startHotFleet(t, fh, cfg)
	fh.waitJIDs("busy", bc.stop())

	var goods, others []string
	untilShared(t, r, func(int) {
		var good, huge, other string
		err := pgx.BeginFunc(ctx, fh.conn, func(tx pgx.Tx) error {
			var err error
			if good, err = relay.NewStager(fh.schemas[0]).Stage(ctx, tx, relay.Job{Name: "W", Queue: "together"}); err != nil {
				return err
			}
			if huge, err = relay.NewStager(fh.schemas[1]).Stage(ctx, tx, relay.Job{Name: "Huge", Queue: "together", Args: []any{strings.Repeat("x", 600)}}); err != nil {
				return err
			}
			other, err = relay.NewStager(fh.schemas[2]).Stage(ctx, tx, relay.Job{Name: "W", Queue: "other"})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		goods, others = append(goods, good), append(others, other)
		fh.waitJIDs("together", goods)
		testenv.WaitFor(t, 15*time.Second, "the oversized job dead-lettered", func() (bool, string) {
			var reason string
			err := fh.conn.QueryRow(ctx, fmt.Sprintf(`SELECT reason FROM %q.staged_jobs_dead WHERE jid = $1`, fh.schemas[1]), huge).Scan(&reason)
			if err != nil {
				return false, err.Error()
			}
			return strings.Contains(reason, "over the limit of 500"), reason
		})
	})
	var staged []string
	rows, err := fh.conn.Query(ctx, fmt.Sprintf(`SELECT jid FROM %q.staged_jobs`, fh.schemas[2]))
	if err != nil {
		t.Fatal(err)
	}
	if staged, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(slices.Sorted(slices.Values(staged)), slices.Sorted(slices.Values(others))) {
		t.Fatalf("%s stages %v, want the other queue's jobs %v, left to its own group", fh.schemas[2], staged, others)
	}
	if got := fh.queueJIDs("other"); len(got) != 0 {
		t.Fatalf("queue other holds %v: the group's relay pushed a queue outside it", got)
	}
}

// untilShared runs stage (run 0, 1, ...), which stages jobs in several schemas of the hot
// fleet r in one transaction and waits until they are delivered, until
// one run's jobs took a shared commit of more than one schema's batch, 5
// runs at most. A schema's own drain, when it runs at that moment (woken
// every second to tidy its handoff record), drains its schema's job
// instead; a second run then meets it idle.
func untilShared(t *testing.T, r *relay.Relay, stage func(run int)) {
	t.Helper()
	var c, b float64
	for run := range 5 {
		commits, batches := sharedCounters(t, r)
		stage(run)
		c, b = sharedCounters(t, r)
		c, b = c-commits, b-batches
		if c >= 1 && b > c {
			return
		}
	}
	t.Fatalf("the last run's jobs took %v shared commits of %v batches; want a commit of more than one schema's batch", c, b)
}

// A shared drain moves each schema's low-water mark (lowwater.go) as the
// schema's own drain does, and never past an id whose transaction is still
// open: here one transaction holds a low id in a schema while the hot
// fleet drains later jobs of every schema together; the mark stays below
// that id until it commits, then the row is drained and the mark passes
// it.
func TestFleetSharedDrainKeepsTheMarkBelowAnOpenID(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 3)
	ctx := context.Background()
	cfg := fh.fleetConfig()
	r, bc := startHotFleet(t, fh, cfg)
	defer bc.stop()
	schema := fh.schemas[1]
	tenant := relay.FleetTenant(r, schema)

	late := testenv.Conn(t, testenv.DatabaseURL())
	tx, err := late.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var lateID int64
	var lateJID string
	if err := tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{schema, "staged_jobs"}.Sanitize()+
		` (job_name, job_args, queue) VALUES ('Late', '[]', 'late') RETURNING id, jid`).Scan(&lateID, &lateJID); err != nil {
		t.Fatal(err)
	}
	// Later ids of the schema, drained by shared drains, with the other
	// schemas' busy jobs.
	commits, _ := sharedCounters(t, r)
	testenv.WaitFor(t, 30*time.Second, "shared drains of the schema's later ids", func() (bool, string) {
		var top int64
		if err := fh.conn.QueryRow(ctx, `SELECT last_value FROM `+pgx.Identifier{schema, "staged_jobs_id_seq"}.Sanitize()).Scan(&top); err != nil {
			return false, err.Error()
		}
		c, _ := sharedCounters(t, r)
		return top > lateID+20 && c > commits+20, fmt.Sprintf("last id %d (late %d), %v shared commits since", top, lateID, c-commits)
	})
	if l, _ := relay.LowWater(tenant); l >= lateID {
		t.Fatalf("low-water mark %d passed id %d, whose transaction is still open", l, lateID)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	fh.waitJIDs("late", []string{lateJID})
	waitMark(t, tenant, lateID)
	fh.waitJIDs("busy", bc.stop())
}

// startHotFleet runs a fleet relay of cfg whose fallback poll is an hour
// away (only the hot poll finds what does not notify), hot for good once
// hot, and returns it once it leads every schema and a shared drain has
// committed jobs of the busy commits it starts in every schema (stop them
// with bc.stop).
func startHotFleet(t *testing.T, fh *fleetHarness, cfg relay.Config) (*relay.Relay, *busyCommits) {
	t.Helper()
	cfg.PollInterval = time.Hour
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetFleetHotLeave(r, 0)
	relay.SetFleetHotOnRate(r)
	fh.run(r)
	fh.waitLeadsAll(r)
	bc := commitBusy(t, fh.schemas)
	testenv.WaitFor(t, 30*time.Second, "a shared commit of the busy schemas' jobs", func() (bool, string) {
		c, _ := sharedCounters(t, r)
		return relay.FleetHot(r) && c > 0, fmt.Sprintf("hot %v, %v shared commits", relay.FleetHot(r), c)
	})
	return r, bc
}

// stageAcross commits, in one transaction (in ctx, for its trace), a job
// of queue q in each of schemas, and returns their jids.
func (fh *fleetHarness) stageAcross(ctx context.Context, schemas []string, q string) []string {
	fh.t.Helper()
	var jids []string
	err := pgx.BeginFunc(ctx, fh.conn, func(tx pgx.Tx) error {
		for _, schema := range schemas {
			jid, err := relay.NewStager(schema).Stage(ctx, tx, relay.Job{Name: "W", Queue: q, Args: []any{schema}})
			if err != nil {
				return err
			}
			jids = append(jids, jid)
		}
		return nil
	})
	if err != nil {
		fh.t.Fatalf("stage across %v: %v", schemas, err)
	}
	return jids
}

// scriptPipes is a go-redis hook that keeps the most scripts (EVALSHA or
// EVAL: the handoff's push) seen in one pipeline.
type scriptPipes struct{ most atomic.Int64 }

func (*scriptPipes) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (*scriptPipes) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (p *scriptPipes) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var n int64
		for _, c := range cmds {
			if name := c.Name(); name == "evalsha" || name == "eval" {
				n++
			}
		}
		for {
			most := p.most.Load()
			if n <= most || p.most.CompareAndSwap(most, n) {
				break
			}
		}
		return next(ctx, cmds)
	}
}

// A cool fleet drains together the schemas whose commits notify at about
// the same time: the listener hands each notification to the fleet's
// shared drain (sharedDrainer.notify), which takes every schema notified
// while the drain before it ran, each claim with its schema's look
// (sharedClaim). One app transaction stages a job in each of four
// schemas, and their four notifications come together; the fleet stays
// cool (no hot poll found them; the fallback poll is a minute away), and
// a shared commit carries more than one schema's batch.
func TestFleetCoolDrainsNotifiedSchemasTogether(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 4)
	ctx := context.Background()
	r := startCoolFleet(t, fh)
	fh.waitIdleAll()
	var jids []string
	untilShared(t, r, func(run int) {
		more := fh.stageAcross(ctx, fh.schemas, "together")
		jids = append(jids, more...)
		fh.waitJIDs("together", jids)
	})
	if relay.FleetHot(r) {
		t.Fatal("the fleet ran hot: its hot poll, not the notifications, may have found the jobs")
	}
	for _, schema := range fh.schemas {
		testenv.WaitFor(t, 15*time.Second, schema+" drained", func() (bool, string) {
			var n int
			if err := fh.conn.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %q.staged_jobs`, schema)).Scan(&n); err != nil {
				return false, err.Error()
			}
			return n == 0, fmt.Sprintf("%d rows staged", n)
		})
		// Each schema went idle again after the shared drains: later
		// commits notify it.
		if held := idleHoldersOf(t, schema, nil); len(held) == 0 {
			t.Fatalf("%s: nobody holds its idle lock after the shared drains, want the relay idle", schema)
		}
	}
}

// A cool fleet's shared drain, woken by a notification, looks for the
// commits behind the notifier as a schema's own drain does: here a commit
// that did not notify because another was notifying ends only after the
// notifier's job is in Redis, and is delivered without the poll (a minute
// away). The shared claim's look lists it, and wakes the schema's own
// drain, which looks again and waits for it to end; without the look,
// nothing would drain it. Repeated until a shared drain, not the
// schema's own, took the notifier's job (its own drain may be running,
// say to tidy, when the notification comes).
func TestFleetSharedDrainLooksBehindTheNotifier(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	ctx := context.Background()
	url := testenv.DatabaseURL()
	cfg := fh.fleetConfig()
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	idle := idleEvents(r)
	fh.run(r)
	fh.waitLeadsAll(r)
	schema := fh.schemas[0]
	// A first job, drained by the schema's own drain: the shared drain
	// waits for a leadership's first push.
	fh.waitJIDs("warm", []string{fh.stageIn(schema, "warm")})
	stage := stagerStage(relay.NewStager(schema))
	for attempt := int64(1); ; attempt++ {
		if attempt > 5 {
			t.Fatal("5 notifiers' jobs, none drained by a shared drain")
		}
		testenv.WaitFor(t, 15*time.Second, "the relay idle on the schema", func() (bool, string) {
			held := idleHoldersOf(t, schema, nil)
			return len(held) > 0, fmt.Sprintf("idle lock holders %v", held)
		})
		before, _ := sharedCounters(t, r)
		n := beginStaged(t, url, stage, "Notifier")
		behind := beginStaged(t, url, stage, "BehindTheNotifier")
		for len(idle) > 0 {
			<-idle
		}
		if err := n.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		testenv.WaitFor(t, 15*time.Second, "the notifier's job in Redis", func() (bool, string) {
			got := fh.queueLenNow("default")
			return got == 2*attempt-1, fmt.Sprintf("%d jobs", got)
		})
		select {
		case <-idle: // the schema's own drain, woken by the look, is idle again
		case <-time.After(15 * time.Second):
			t.Fatal("the schema's own drain did not run within 15s of the notifier's job: the look did not see the commit behind it")
		}
		if err := behind.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		testenv.WaitFor(t, 15*time.Second, "the job behind the notifier in Redis (the poll is a minute away)", func() (bool, string) {
			got := fh.queueLenNow("default")
			return got == 2*attempt, fmt.Sprintf("%d jobs", got)
		})
		if c, _ := sharedCounters(t, r); c > before {
			return
		}
	}
}

// A shared drain does not wait for a lock one schema's table is under
// (the app's ALTER TABLE or CREATE INDEX on one tenant): past its
// lock_timeout it fails, and each of its schemas drains on its own, the
// locked one's drain alone waiting. Here a job of the first schema is
// staged without its trigger (no notification; the poll is a minute
// away), a transaction holds that table in ACCESS EXCLUSIVE mode, and one
// app transaction notifies the first schema's channel and then stages a
// job in the second: the shared drain woken by the first notification
// claims from the locked table. The second schema's job arrives while the
// lock is held, and the first's once it is released.
func TestFleetSharedDrainDoesNotWaitForOneSchemasLock(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	ctx := context.Background()
	startCoolFleet(t, fh)
	locked, other := fh.schemas[0], fh.schemas[1]
	// Each schema's first push, by its own drain: the shared drain
	// waits for a leadership's first push.
	fh.waitJIDs("warm", []string{fh.stageIn(locked, "warm"), fh.stageIn(other, "warm")})
	fh.waitIdleAll()
	// And its tidy, a second after that drain: the locked schema's own
	// drain, tidying, would hold the schema, and the shared drain would
	// leave it to it without claiming from its table.
	_, record := relay.HandoffKeys(fh.ns, fh.conn.Config().Database, locked)
	testenv.WaitFor(t, 15*time.Second, locked+"'s handoff record tidied", func() (bool, string) {
		m, err := fh.rdb.HGetAll(ctx, record).Result()
		if err != nil {
			return false, err.Error()
		}
		return len(m) == 0, fmt.Sprintf("%d fields", len(m))
	})
	quiet := fh.stageAfter(ctx, locked, "blocked", "SET LOCAL session_replication_role = replica") // no trigger
	lockTx := testenv.LockTable(t, locked, "staged_jobs")
	free := fh.stageAfter(ctx, other, "free", "SELECT pg_notify($1, 'commit')", relay.ChannelName(locked))
	fh.waitJIDs("free", []string{free})
	testenv.WaitFor(t, 15*time.Second, "the shared drain's lock timeout logged", func() (bool, string) {
		for _, e := range fh.logs.FilterMessage(sharedFailed).All() {
			if msg := fmt.Sprint(e.ContextMap()["error"]); strings.Contains(msg, "lock timeout") {
				return true, msg
			}
		}
		return false, fmt.Sprintf("%d shared drains failed", fh.logs.FilterMessage(sharedFailed).Len())
	})
	if err := lockTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	fh.waitJIDs("blocked", []string{quiet})
}

// sharedFailed is the log line of a shared drain that failed.
const sharedFailed = "a shared drain failed: each of its schemas drains on its own"

// stageAfter commits, in one transaction, sql (with args) and then a job
// of queue q in schema, and returns its jid.
func (fh *fleetHarness) stageAfter(ctx context.Context, schema, q, sql string, args ...any) string {
	fh.t.Helper()
	var jid string
	err := pgx.BeginFunc(ctx, fh.conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sql, args...); err != nil {
			return err
		}
		var err error
		jid, err = relay.NewStager(schema).Stage(ctx, tx, relay.Job{Name: "W", Queue: q})
		return err
	})
	if err != nil {
		fh.t.Fatal(err)
	}
	return jid
}

// startCoolFleet runs a relay of fh's schemas whose fallback poll is a
// minute away (commits are found by their notifications), and waits
// until it leads every schema.
func startCoolFleet(t *testing.T, fh *fleetHarness, setup ...func(*relay.Relay)) *relay.Relay {
	t.Helper()
	cfg := fh.fleetConfig()
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range setup {
		f(r) // before Run: hooks
	}
	fh.run(r)
	fh.waitLeadsAll(r)
	return r
}

// waitIdleAll waits until the relay holds every schema's idle lock.
func (fh *fleetHarness) waitIdleAll() {
	fh.t.Helper()
	for _, schema := range fh.schemas {
		testenv.WaitFor(fh.t, 15*time.Second, schema+" idle", func() (bool, string) {
			held := idleHoldersOf(fh.t, schema, nil)
			return len(held) > 0, fmt.Sprintf("idle lock holders %v", held)
		})
	}
}

// A lock on one tenant's table (the app's ALTER TABLE, LOCK TABLE) makes
// the fleet's fallback poll wait. The poll runs in the loop that keeps
// the fleet's lock connection alive, and it waited up to 2s, past that
// connection's idle_session_timeout (2.5 leader intervals): PostgreSQL
// ended it, and the relay lost every schema's lead. Now the poll gives up
// well within the timeout, and the fleet leads on.
func TestFleetPollBlockedByOneTenantsLockKeepsTheLead(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	ctx := context.Background()
	cfg := fh.fleetConfig()
	cfg.PollInterval = 100 * time.Millisecond
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fh.run(r)
	fh.waitLeadsAll(r)
	locked, other := fh.schemas[0], fh.schemas[1]
	lockTx := testenv.LockTable(t, locked, "staged_jobs")
	lockedAt := time.Now()
	// Held for three of the lock connection's idle timeouts (2.5 leader
	// intervals, at least 1s), while polls wait for it.
	hold := 3 * max(cfg.LeaderInterval*5/2, time.Second)
	// A poll waits for the lock pollLockTimeout (10ms), then leaves the
	// schema out and wakes its drain, which may wait for the lock too, or
	// find nothing to claim without reading the table: a sample of
	// pg_stat_activity can miss the poll's wait on a busy machine, and
	// the relay's log line of it cannot.
	const leftOut = "the fleet's poll leaves out schemas whose table is locked; each drains on its own"
	waited := false
	testenv.WaitFor(t, hold+30*time.Second, "a poll waiting for the lock, the lock held "+hold.String(), func() (bool, string) {
		if !waited && fh.logs.FilterMessage(leftOut).Len() > 0 {
			waited = true
		}
		if !waited {
			var n int
			err := fh.conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND application_name LIKE 'stagedrain%' AND query LIKE '%' || $1 || '%'`, locked).Scan(&n)
			if err != nil {
				return false, err.Error()
			}
			waited = n > 0
		}
		return waited && time.Since(lockedAt) >= hold, fmt.Sprintf("a poll waited: %v; held %s", waited, time.Since(lockedAt).Round(time.Millisecond))
	})
	if err := lockTx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	fh.waitJIDs("after", []string{fh.stageIn(locked, "after"), fh.stageIn(other, "after")})
	if n := fh.logs.FilterMessage("database session failed, retrying").Len(); n != 0 {
		t.Fatalf("the fleet's session failed %d times while one tenant's table was locked: %v", n, fh.logs.FilterMessage("database session failed, retrying").All()[0].ContextMap())
	}
	if got := leads(r); len(got) != len(fh.schemas) {
		t.Fatalf("the relay leads %v, want every schema %v", got, fh.schemas)
	}
}

// A shared drain that takes a schema's last job leaves the low-water mark
// below it: its claim's candidate waits for a later claim to confirm it,
// and a shared claim reads S once a second at most, so it may have made
// none (lowwater.go). With no later commit no claim came, and the mark
// stayed below that job for good (TestFleetClaimCostDoesNotGrowWithDeadRows
// waited for it in vain when a shared drain took the last rows). The
// schema's own drain now claims from the mark a while after the shared
// drain, and again while candidates wait, and the mark reaches the job.
func TestFleetMarkFollowsASharedDrain(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	ctx := context.Background()
	confirms := make(chan struct{}, 100)
	r := startCoolFleet(t, fh, func(r *relay.Relay) {
		relay.SetOnMarkConfirm(r, func() {
			select {
			case confirms <- struct{}{}:
			default:
			}
		})
	})
	schema := fh.schemas[0]
	tenant := relay.FleetTenant(r, schema)
	// A first job, drained by the schema's own drain: the shared drain
	// waits for a leadership's first push.
	fh.waitJIDs("warm", []string{fh.stageIn(schema, "warm")})
	var jids []string
	for attempt := 1; ; attempt++ {
		if attempt > 5 {
			t.Fatal("5 jobs, none drained by a shared drain")
		}
		fh.waitIdleAll()
		before, _ := sharedCounters(t, r)
		jids = append(jids, fh.stageIn(schema, "default"))
		fh.waitJIDs("default", jids)
		if c, _ := sharedCounters(t, r); c == before {
			continue // the schema's own drain took it
		}
		break
	}
	// The claim after the shared drain, which other claims (a wake-up
	// for a notification the shared drain took) need not make.
	select {
	case <-confirms:
	case <-time.After(30 * time.Second):
		t.Fatal("no claim from the mark within 30s of a shared drain")
	}
	var last int64
	if err := fh.conn.QueryRow(ctx, "SELECT last_value FROM "+pgx.Identifier{schema, "staged_jobs_id_seq"}.Sanitize()).Scan(&last); err != nil {
		t.Fatal(err)
	}
	waitMark(t, tenant, last)
}
