package relay_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The missed wake-up, driven exactly: a transaction checks the gate while
// the relay is awake (nobody holds "idle", so it will not NOTIFY) and
// commits only after the relay has gone idle (taken "idle") and its drain
// loop waits. The relay noted it as in progress when it went idle, sees it
// end, and drains: the job arrives within the bound of
// sql/010_wake_when_idle.sql (007's: twice the lag after the relay went
// idle, plus the check), with the poll a minute away and no notification,
// as the wake-up cause late_commit shows.
func TestLateCommitIsDrainedWithoutNotifyOrPoll(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()

	// Two jobs committed before the relay starts, drained one per batch:
	// the relay marks itself awake from a drain's second batch on, and the
	// hook holds it there.
	h.stage(relay.Job{Name: "First"})
	second := h.stage(relay.Job{Name: "Second"})
	cfg := h.config()
	cfg.PollInterval = time.Minute
	cfg.BatchSize = 1
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	held, unblock := h.holdAwake(r)
	idle := idleEvents(r)
	ts := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(ts.Close)
	h.run(r)
	h.waitHeld(held)
	if held := h.advisoryLocks(relay.IdleLockName(h.schema), "ExclusiveLock", true); held != 0 {
		t.Fatalf("idle lock held exclusively by %d sessions during the second batch, want none (the relay is awake)", held)
	}

	// The app's transaction runs the gate check now (its WHEN looks at
	// INSERT; SET CONSTRAINTS ALL IMMEDIATE would run the function there
	// too) and sees the relay awake: it keeps no lock and will not notify.
	appConn := testenv.Conn(t, testenv.DatabaseURL())
	tx, err := appConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	late, err := h.stager.Stage(ctx, tx, relay.Job{Name: "Late"})
	if err != nil {
		t.Fatal(err)
	}
	var appLocks int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&appLocks); err != nil {
		t.Fatal(err)
	}
	if appLocks != 0 {
		t.Fatalf("the app's transaction holds %d advisory locks after the gate check, want none", appLocks)
	}

	// Let the relay finish: its next claim is empty, it goes idle, claims
	// once more (empty: the app's row is not committed) and its drain loop
	// waits, after a drain that began once its listener was LISTENing (the
	// LISTEN wakes the drain once more: a drain still to come could find
	// the app's row by itself). Only then does the app commit.
	unblocked := time.Now()
	unblock()
	h.waitIdleAfterListen(idle)
	if n := h.advisoryLocks(relay.IdleLockName(h.schema), "ExclusiveLock", true); n != 1 {
		t.Fatalf("%d sessions hold the idle lock after the drain went idle, want 1 (the relay)", n)
	}
	if got := h.queueJIDs("default"); len(got) != 2 {
		t.Fatalf("queue holds %v before the late commit, want the 2 earlier jobs", got)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	committed := time.Now()
	h.waitQueueLen("default", 3, 15*time.Second)
	delivered := time.Now()
	if got := h.queueJIDs("default"); got[1] != second || got[2] != late {
		t.Fatalf("delivered %v, want the late job %s last", got, late)
	}
	// The relay went idle after unblocked, so the commit's lag is at most
	// committed - unblocked, and the job is due by twice that after the
	// relay went idle: at most the lag again after the commit. The slack
	// covers the check's own round trip on a busy machine; the poll, the
	// only other way the job could come, is a minute away.
	lag := committed.Sub(unblocked)
	if took := delivered.Sub(committed); took > lag+5*time.Second {
		t.Errorf("the late job took %s after its commit (lag %s after the relay went idle), want at most the lag (+5s slack; the poll is 1m)", took, lag)
	}
	s := scrapeMetrics(t, ts.URL+"/metrics")
	if v := s.value("stagedrain_wakeups_total", "cause", "late_commit"); v < 1 {
		t.Errorf("wakeups_total{cause=late_commit} = %v, want >= 1: the check of late commits delivered the job", v)
	}
	if v := s.value("stagedrain_wakeups_total", "cause", "notify"); v != 0 {
		t.Errorf("wakeups_total{cause=notify} = %v, want 0: the late commit saw the relay awake", v)
	}
}

// holdAwake makes r stop after its second push until the returned unblock
// is called (or the test ends): a drain marks the relay awake from its
// second batch on, so with BatchSize 1 and two jobs staged the relay is
// held awake once held is closed (waitHeld waits for it).
func (h *harness) holdAwake(r *relay.Relay) (held <-chan struct{}, unblock func()) {
	return h.holdAfterPush(r, 2)
}

// holdAfterPush makes r stop after its nth successful push (counted over
// its leads) until the returned unblock is called (or the test ends).
func (h *harness) holdAfterPush(r *relay.Relay, n int32) (held <-chan struct{}, unblock func()) {
	h.t.Helper()
	var pushes atomic.Int32
	nthPushed := make(chan struct{})
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock = func() { releaseOnce.Do(func() { close(release) }) }
	h.t.Cleanup(unblock) // before the relay's own cleanup, which waits for Run
	relay.SetAfterPush(r, func(context.Context) error {
		if pushes.Add(1) == n {
			close(nthPushed)
			<-release
		}
		return nil
	})
	return nthPushed, unblock
}

func (h *harness) waitHeld(held <-chan struct{}) {
	h.t.Helper()
	select {
	case <-held:
	case <-time.After(15 * time.Second):
		h.t.Fatalf("the second batch was not pushed within 15s; logs: %v", messages(h.logs))
	}
}

// advisoryLocks counts the sessions holding (granted) or waiting for (not
// granted) a shard of the gate lock name in mode.
func (h *harness) advisoryLocks(name, mode string, granted bool) int {
	h.t.Helper()
	var n int
	err := h.conn.QueryRow(context.Background(), `SELECT count(DISTINCT pid) FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND mode = $2 AND granted = $3
		  AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296`,
		name, mode, granted).Scan(&n)
	if err != nil {
		h.t.Fatalf("read pg_locks: %v", err)
	}
	return n
}

// holdIdle takes on conn the locks a relay of schema (of queues, or of
// all queues when there are none) holds while it is idle, as the relay
// takes them, so that commits notify it.
func holdIdle(t *testing.T, conn *pgx.Conn, schema string, queues ...string) {
	t.Helper()
	if err := relay.HoldGateLocks(context.Background(), conn, schema, queues...); err != nil {
		t.Fatal(err)
	}
}

// releaseIdle gives back what holdIdle took on conn.
func releaseIdle(t *testing.T, conn *pgx.Conn, schema string, queues ...string) {
	t.Helper()
	if err := relay.ReleaseGateLocks(context.Background(), conn, schema, queues...); err != nil {
		t.Fatal(err)
	}
}

// checkDidNotNotify checks that the commits to schema made before it sent
// listener (LISTENing since before them) no notification: it notifies
// schema's channel from a session of its own, and that must be the first
// notification to arrive, since notifications arrive in commit order.
// what names those commits in the failure.
func checkDidNotNotify(t *testing.T, listener *pgx.Conn, schema, what string) {
	t.Helper()
	marker := testenv.ConnTo(t, listener.Config().ConnString())
	if _, err := marker.Exec(context.Background(), `SELECT pg_notify($1, 'marker')`, relay.ChannelName(schema)); err != nil {
		t.Fatal(err)
	}
	if pid := nextNotifier(t, listener); pid != marker.PgConn().PID() {
		t.Fatalf("the first notification came from backend %d, before the marker's (%d): %s notified", pid, marker.PgConn().PID(), what)
	}
}

// appLocks returns the advisory locks conn's session holds.
func appLocks(t *testing.T, conn *pgx.Conn) []string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `SELECT classid || '/' || objid || '/' || objsubid || ' ' || mode FROM pg_locks
		WHERE locktype = 'advisory' AND pid = pg_backend_pid()`)
	if err != nil {
		t.Fatal(err)
	}
	locks, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return locks
}

// A commit notifies only while a session holds the gate's "idle" lock, as
// an idle relay does: with nobody holding it (no relay, or a relay that is
// draining) the trigger does not notify; held, it does; given back, it
// does not again. Told apart by the sending backend of the first
// notification to arrive after each step (they arrive in commit order).
func TestGateNotifiesOnlyWhileIdle(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	listener := listen(t, testenv.DatabaseURL(), h.schema)

	// Nobody idle: the commit (h.conn's) does not notify.
	h.stage(relay.Job{Name: "NobodyIdle"})

	// Idle: a session holds every shard of "idle", as an idle relay does,
	// and the commit notifies; it is the first notification to arrive.
	relayConn := testenv.Conn(t, testenv.DatabaseURL())
	holdIdle(t, relayConn, h.schema)
	idleApp := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := idleApp.Exec(ctx, "INSERT INTO "+table+" (job_name, job_args) VALUES ('WhileIdle', '[]'), ('AndAnother', '[]')"); err != nil {
		t.Fatal(err)
	}
	if pid := nextNotifier(t, listener); pid != idleApp.PgConn().PID() {
		t.Fatalf("first notification from backend %d, want the commit while idle (%d); the commit with nobody idle is %d",
			pid, idleApp.PgConn().PID(), h.conn.PgConn().PID())
	}

	// Awake again (the lock given back): no notification.
	releaseIdle(t, relayConn, h.schema)
	h.stage(relay.Job{Name: "AwakeAgain"})
	checkDidNotNotify(t, listener, h.schema, "the commit with the idle lock given back")
}

// One commit of a schema notifies at a time (sql/012_wake_one_notifier.sql):
// while a transaction N holds the schema's "notifying" lock (its deferred
// trigger ran, it notifies when it commits), another commit T that sees
// the relay idle does not notify, and waits on nobody; N's notification
// is the one that arrives, although T committed first (notifications
// arrive in commit order, so T's would have come before it). Once N has
// ended, a commit notifies again.
//
// The same holds for a group's relay (--queues), idle on its queue's lock.
func TestOneCommitNotifiesAtATime(t *testing.T) {
	t.Parallel()
	t.Run("all queues", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		testOneNotifier(t, h)
	})
	t.Run("a group of queues", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		// The jobs' queue is "default" (relay.Job's zero Queue).
		testOneNotifier(t, h, "default")
	})
}

// testOneNotifier is TestOneCommitNotifiesAtATime with a relay of queues
// (of all queues when there are none) idle.
func testOneNotifier(t *testing.T, h *harness, queues ...string) {
	ctx := context.Background()
	listener := listen(t, testenv.DatabaseURL(), h.schema)
	holdIdle(t, testenv.Conn(t, testenv.DatabaseURL()), h.schema, queues...)

	n := notifierInCommit(t, h, "Notifier")
	app := testenv.Conn(t, testenv.DatabaseURL())
	stageOn(t, h, app, "WhileAnotherNotifies")
	checkDidNotNotify(t, listener, h.schema, "the commit while another transaction held the notifying lock")
	if err := n.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if pid := nextNotifier(t, listener); pid != n.Conn().PgConn().PID() {
		t.Fatalf("notification from backend %d, want the notifier's (%d)", pid, n.Conn().PgConn().PID())
	}

	// N has ended: the next commit notifies.
	stageOn(t, h, app, "AfterTheNotifier")
	if pid := nextNotifier(t, listener); pid != app.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the commit after the notifier ended (%d)", pid, app.PgConn().PID())
	}
}

// A commit that would not notify, because another holds the notifying
// lock, takes the schema's 'behind' lock first and holds it until it ends
// (sql/014_wake_behind.sql), so that the relay woken by the other's
// notification lists it; and while the relay holds 'behind' (it looks, in
// one expression) such a commit notifies after all.
func TestCommitBehindANotifierHoldsBehind(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	url := testenv.DatabaseURL()
	listener := listen(t, url, h.schema)
	holdIdle(t, testenv.Conn(t, url), h.schema)
	notifying, behind := "stagedrain-notifying:"+h.schema, "stagedrain-behind:"+h.schema
	// Another commit notifying: a session holds the notifying lock.
	if _, err := testenv.Conn(t, url).Exec(ctx, `SELECT pg_advisory_lock(hashtext($1), 0)`, notifying); err != nil {
		t.Fatal(err)
	}
	app := testenv.Conn(t, url)
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := h.stager.Stage(ctx, tx, relay.Job{Name: "Behind"}); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	// The relay's look: 'behind' cannot be taken while the commit holds it.
	looker := testenv.Conn(t, url)
	var free bool
	if err := looker.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtext($1), 0) AND pg_advisory_unlock(hashtext($1), 0)`, behind).Scan(&free); err != nil {
		t.Fatal(err)
	}
	if free {
		t.Fatal("the relay's look took 'behind' while a commit that did not notify is in progress, want it held")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	checkDidNotNotify(t, listener, h.schema, "the commit behind another notifier")
	if err := looker.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtext($1), 0) AND pg_advisory_unlock(hashtext($1), 0)`, behind).Scan(&free); err != nil {
		t.Fatal(err)
	}
	if !free {
		t.Fatal("'behind' still held after the commit ended")
	}

	// The relay looking at this moment: the commit cannot take 'behind',
	// and notifies though another holds the notifying lock.
	if _, err := looker.Exec(ctx, `SELECT pg_advisory_lock(hashtext($1), 0)`, behind); err != nil {
		t.Fatal(err)
	}
	stageOn(t, h, app, "WhileTheRelayLooks")
	if pid := nextNotifier(t, listener); pid != app.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the commit made while the relay held 'behind' (%d)", pid, app.PgConn().PID())
	}
}

// notifierInCommit begins a transaction that stages a job and runs its
// deferred wake trigger at once (SET CONSTRAINTS ALL IMMEDIATE), as a
// commit does just before it commits: with a relay idle, it holds the
// schema's notifying lock and has queued its notification, sent when it
// commits. The caller commits it; the test's end rolls it back otherwise.
func notifierInCommit(t *testing.T, h *harness, name string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := testenv.Conn(t, testenv.DatabaseURL()).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := h.stager.Stage(ctx, tx, relay.Job{Name: name}); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	var held bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
		AND objsubid = 2 AND objid = 0 AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296)`,
		"stagedrain-notifying:"+h.schema).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if !held {
		t.Fatal("the notifier's trigger took no notifying lock (is the relay idle?)")
	}
	return tx
}

// The relay delivers the job of a commit that did not notify because
// another was notifying (TestOneCommitNotifiesAtATime), on that other's
// notification, without waiting for the poll (a minute away): 012's proof.
func TestCommitBehindANotifierIsDrained(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	cfg := h.config()
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	idle := idleEvents(r)
	h.run(r)
	h.waitIdleAfterListen(idle)

	n := notifierInCommit(t, h, "Notifier")
	behind := stageOn(t, h, testenv.Conn(t, testenv.DatabaseURL()), "BehindTheNotifier")
	if err := n.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 2, 15*time.Second)
	if got := h.queueJIDs("default"); !slices.Contains(got, behind) {
		t.Fatalf("delivered %v, want the job behind the notifier (%s) among them", got, behind)
	}
}

// A commit that did not notify because another was notifying, and that
// ends only after the relay has drained that other's job, is delivered
// too, without waiting for the poll (a minute away): it holds the
// schema's 'behind' lock, and the relay's drain that starts idle reads the
// transactions in progress when it is held, and drains again when one of
// them ends (sql/014_wake_behind.sql). For a relay of all queues, a group
// of queues, and a fleet's schema.
func TestCommitEndingAfterTheNotifiersDrainIsDrained(t *testing.T) {
	t.Parallel()
	t.Run("all queues", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		cfg := h.config()
		cfg.PollInterval = time.Minute
		testBehindTheNotifier(t, h.harnessRun(cfg), h.schema, stagerStage(h.stager), func() int64 { return h.queueLenNow("default") })
	})
	t.Run("a group of queues", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		cfg := h.config()
		cfg.PollInterval = time.Minute
		cfg.Queues = []string{"default"}
		testBehindTheNotifier(t, h.harnessRun(cfg), h.schema, stagerStage(h.stager), func() int64 { return h.queueLenNow("default") })
	})
	t.Run("the sidekiq-staged_push table", func(t *testing.T) {
		t.Parallel()
		h := newStagedPushHarness(t)
		if _, err := relay.Migrate(context.Background(), h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
			t.Fatal(err)
		}
		cfg := h.config()
		cfg.Source = relay.SourceSidekiqStagedPush
		cfg.PollInterval = time.Minute
		stage := func(tx pgx.Tx, name string) error {
			_, err := tx.Exec(context.Background(), `INSERT INTO `+h.gemTable()+` (payload, created_at, updated_at)
				VALUES (json_build_object('class', $1::text, 'args', '[]'::json), now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC')`, name)
			return err
		}
		testBehindTheNotifier(t, h.harnessRun(cfg), h.schema, stage, func() int64 { return h.queueLenNow("default") })
	})
	t.Run("a fleet's schema", func(t *testing.T) {
		t.Parallel()
		fh := newFleetHarness(t, 2)
		cfg := fh.fleetConfig()
		cfg.PollInterval = time.Minute
		run := func(r *relay.Relay) {
			fh.run(r)
			testenv.WaitFor(t, 15*time.Second, "the relay leads both schemas", func() (bool, string) {
				got := leads(r)
				return len(got) == 2, fmt.Sprintf("leads %q", got)
			})
		}
		schema := fh.schemas[0]
		testBehindTheNotifier(t, relayRun{cfg: cfg, run: run}, schema, stagerStage(relay.NewStager(schema)), func() int64 { return fh.queueLenNow("default") })
	})
}

// relayRun is a relay's config and how a test starts it.
type relayRun struct {
	cfg relay.Config
	run func(r *relay.Relay)
}

// harnessRun is h.run for cfg.
func (h *harness) harnessRun(cfg relay.Config) relayRun {
	return relayRun{cfg: cfg, run: h.run}
}

// queueLenNow is the length of queue q now.
func (h *harness) queueLenNow(q string) int64 {
	h.t.Helper()
	n, err := h.rdb.LLen(context.Background(), h.key("queue:"+q)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		h.t.Fatal(err)
	}
	return n
}

// stagerStage stages a job named name with stager.
func stagerStage(stager *relay.Stager) func(tx pgx.Tx, name string) error {
	return func(tx pgx.Tx, name string) error {
		_, err := stager.Stage(context.Background(), tx, relay.Job{Name: name})
		return err
	}
}

// testBehindTheNotifier is TestCommitEndingAfterTheNotifiersDrainIsDrained
// for a relay of rr that drains schema, whose jobs stage stages (in the
// default queue), and whose default queue's length is queueLen.
func testBehindTheNotifier(t *testing.T, rr relayRun, schema string, stage func(tx pgx.Tx, name string) error, queueLen func() int64) {
	ctx := context.Background()
	url := testenv.DatabaseURL()
	r, err := relay.New(rr.cfg)
	if err != nil {
		t.Fatal(err)
	}
	idle := idleEvents(r)
	rr.run(r)
	testenv.WaitFor(t, 15*time.Second, "the relay idle on the schema", func() (bool, string) {
		held := idleHoldersOf(t, schema, rr.cfg.Queues)
		return len(held) > 0, fmt.Sprintf("idle lock holders %v", held)
	})

	// The notifier, in its commit: its trigger has run, the relay idle.
	n := beginStaged(t, url, stage, "Notifier")
	var held bool
	if err := n.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
		AND objsubid = 2 AND objid = 0 AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296)`,
		"stagedrain-notifying:"+schema).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if !held {
		t.Fatal("the notifier's trigger took no notifying lock (is the relay idle?)")
	}
	// The commit behind it: its trigger has run (the notifying lock
	// taken by n), and it commits after n's job is in.
	behindTx := beginStaged(t, url, stage, "BehindTheNotifier")
	for len(idle) > 0 {
		<-idle
	}
	if err := n.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 15*time.Second, "the notifier's job in Redis", func() (bool, string) {
		got := queueLen()
		return got == 1, fmt.Sprintf("%d jobs", got)
	})
	// The drain that delivered it has ended: the relay is idle again.
	select {
	case <-idle:
	case <-time.After(15 * time.Second):
		t.Fatal("the drain of the notifier's job did not end within 15s")
	}
	if err := behindTx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 15*time.Second, "the job behind the notifier in Redis (the poll is a minute away)", func() (bool, string) {
		got := queueLen()
		return got == 2, fmt.Sprintf("%d jobs", got)
	})
}

// beginStaged begins a transaction on a connection of its own that stages
// a job with stage and runs its deferred wake trigger at once (SET
// CONSTRAINTS ALL IMMEDIATE), as a commit does just before it commits. The
// caller commits it; the test's end rolls it back otherwise.
func beginStaged(t *testing.T, url string, stage func(tx pgx.Tx, name string) error, name string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := testenv.Conn(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := stage(tx, name); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	return tx
}

// idleHoldersOf are the backends holding schema's idle lock (of queues'
// group, if any).
func idleHoldersOf(t *testing.T, schema string, queues []string) []uint32 {
	t.Helper()
	name := relay.IdleLockName(schema)
	if len(queues) > 0 {
		name += ":" + queues[0]
	}
	var pids []uint32
	err := testenv.Conn(t, testenv.DatabaseURL()).QueryRow(context.Background(), `SELECT coalesce(array_agg(DISTINCT pid), '{}') FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND mode = 'ExclusiveLock'
		AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296`, name).Scan(&pids)
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// In poll-only mode the relay opens no listener and never goes idle: while
// it leads, nobody holds its "idle" lock, after every drain (checked from
// the idle hook, on the drain goroutine, when the drain has just ended),
// so commits do not notify, and the poll delivers.
func TestPollOnlyNeitherListensNorIsNotified(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	url := testenv.DatabaseURL()
	cfg := h.config()
	cfg.PollOnly = true
	cfg.PollInterval = 50 * time.Millisecond
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	locks := testenv.ConnTo(t, url) // the hook's
	type look struct {
		holders []uint32
		err     error
	}
	looks := make(chan look, 1000)
	relay.SetOnIdle(r, func(int64) {
		got, err := readIdleHolders(locks, h.schema)
		select {
		case looks <- look{got, err}:
		default:
		}
	})
	h.run(r)
	// checkDrains checks the idle lock after n more drains.
	checkDrains := func(n int) {
		t.Helper()
		for range n {
			select {
			case l := <-looks:
				if l.err != nil {
					t.Fatal(l.err)
				}
				if len(l.holders) != 0 {
					t.Fatalf("the idle lock is held by backends %v after a poll-only drain, want nobody", l.holders)
				}
			case <-time.After(15 * time.Second):
				t.Fatalf("no drain ended within 15s; logs: %v", messages(h.logs))
			}
		}
	}
	checkDrains(3)
	if st := r.Status(); st.Role != relay.RoleLeader {
		t.Fatalf("role %s after 3 drains, want leader", st.Role)
	}
	var listeners int
	if err := h.conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query IN ($1, '-- ' || $1)`,
		"listen "+pgx.Identifier{relay.ChannelName(h.schema)}.Sanitize()).Scan(&listeners); err != nil || listeners != 0 {
		t.Fatalf("%d sessions LISTEN on the schema's channel (%v), want none in poll-only mode", listeners, err)
	}

	listener := listen(t, url, h.schema)
	jid := h.stage(relay.Job{Name: "Polled"})
	checkDidNotNotify(t, listener, h.schema, "the commit beside a poll-only relay")
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queueJIDs("default"); got[0] != jid {
		t.Fatalf("delivered %v, want %s", got, jid)
	}
	checkDrains(2) // after the drain that delivered it
}

// The trigger (migration 010, one-expression looks since 009) holds no
// gate lock after it ran, whether it notified (a relay idle) or not
// (nobody idle): a commit never makes the relay wait, going idle, and
// pays for no lock it keeps. A commit that notifies holds the schema's
// notifying lock (012), a transaction-level one, until it ends, and
// nothing after (not the behind lock of 014, which a commit takes only
// when it does not notify). Checked on the trigger itself, fired at
// INSERT with SET CONSTRAINTS ALL IMMEDIATE, through pg_locks; which
// commit notified is told by the backend of the first notification.
func TestTriggerHoldsNoGateLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testenv.Schema(t)
	url := testenv.DatabaseURL()
	awakeApp, idleApp := testenv.Conn(t, url), testenv.Conn(t, url)
	if _, err := relay.Migrate(ctx, awakeApp, schema); err != nil {
		t.Fatal(err)
	}
	listener := listen(t, url, schema)
	stager := relay.NewStager(schema)
	// fire stages a job on app with the trigger run at once, and returns
	// the advisory locks the transaction holds after it, then commits.
	fire := func(app *pgx.Conn) []string {
		t.Helper()
		var held []string
		err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
				return err
			}
			if _, err := stager.Stage(ctx, tx, relay.Job{Name: "Look"}); err != nil {
				return err
			}
			// Two-key advisory locks show their first key as classid.
			rows, err := tx.Query(ctx, `SELECT CASE classid
					WHEN hashtext($1)::oid THEN 'idle' WHEN hashtext($2)::oid THEN 'notifying'
					WHEN hashtext($3)::oid THEN 'behind' ELSE 'other' END || ' ' || mode
				FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() ORDER BY 1`,
				relay.IdleLockName(schema), "stagedrain-notifying:"+schema, "stagedrain-behind:"+schema)
			if err != nil {
				return err
			}
			held, err = pgx.CollectRows(rows, pgx.RowTo[string])
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return held
	}

	// Nobody idle: the look takes the lock shared and gives it back.
	if held := fire(awakeApp); len(held) != 0 {
		t.Fatalf("a commit that found nobody idle holds %v, want no gate lock", held)
	}
	if held := appLocks(t, awakeApp); len(held) != 0 {
		t.Fatalf("after a commit that found nobody idle, the app's session holds %v, want no advisory lock", held)
	}

	// Idle: another session (the relay) holds every shard of 'idle'.
	relayConn := testenv.Conn(t, url)
	holdIdle(t, relayConn, schema)
	if held := fire(idleApp); !slices.Equal(held, []string{"notifying ExclusiveLock"}) {
		t.Fatalf("a commit that found the relay idle holds %v, want the notifying lock only (no gate lock, no behind lock)", held)
	}
	if held := appLocks(t, idleApp); len(held) != 0 {
		t.Fatalf("after a commit that notified, the app's session holds %v, want no advisory lock", held)
	}
	if pid := nextNotifier(t, listener); pid != idleApp.PgConn().PID() {
		t.Fatalf("first notification from backend %d, want the commit that found the relay idle (%d); the one that found nobody idle is %d",
			pid, idleApp.PgConn().PID(), awakeApp.PgConn().PID())
	}
}
