package relay_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The missed wake-up, driven exactly: a transaction checks the gate while
// the relay is awake (so it will not NOTIFY) and commits only after the
// relay has gone idle and its drain loop waits. The relay noted it as in
// progress when it went idle, sees it end, and drains: the job arrives within the bound
// of sql/007_wake_no_barrier.sql (twice the lag after the relay went idle,
// plus the check), with the poll a minute away and no notification, as the
// wake-up cause late_commit shows.
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
	idle := make(chan struct{}, 1)
	relay.SetOnIdle(r, func(int64) {
		select {
		case idle <- struct{}{}:
		default:
		}
	})
	ts := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(ts.Close)
	h.run(r)
	h.waitHeld(held)
	if held := h.advisoryLocks(relay.AwakeLockName(h.schema), "ExclusiveLock", true); held != 1 {
		t.Fatalf("awake lock held exclusively by %d sessions during the second batch, want 1 (the relay)", held)
	}

	// The app's transaction runs the gate check now (SET CONSTRAINTS ALL
	// IMMEDIATE runs the deferred trigger at INSERT) and sees the relay
	// awake: it takes no lock and will not notify.
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
	// waits. Only then does the app commit.
	unblocked := time.Now()
	unblock()
	select {
	case <-idle:
	case <-time.After(15 * time.Second):
		t.Fatalf("the relay did not go idle within 15s; logs: %v", messages(h.logs))
	}
	if n := h.advisoryLocks(relay.AwakeLockName(h.schema), "ExclusiveLock", true); n != 0 {
		t.Fatalf("%d sessions hold awake after the drain went idle, want 0", n)
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
	h.t.Helper()
	var pushes atomic.Int32
	secondPushed := make(chan struct{})
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock = func() { releaseOnce.Do(func() { close(release) }) }
	h.t.Cleanup(unblock) // before the relay's own cleanup, which waits for Run
	relay.SetAfterPush(r, func(context.Context) error {
		if pushes.Add(1) == 2 {
			close(secondPushed)
			<-release
		}
		return nil
	})
	return secondPushed, unblock
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

// With the relay idle, a commit notifies; with it awake, the trigger does
// not notify; idle again, commits notify again. Told apart by the sending
// backend of the notifications that arrive.
func TestGateNotifiesOnlyWhileIdle(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	listener := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := listener.Exec(ctx, "LISTEN "+pgx.Identifier{relay.ChannelName(h.schema)}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	// Idle: nobody holds the awake lock, so the commit notifies.
	h.stage(relay.Job{Name: "WhileIdle"})
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := listener.WaitForNotification(wctx); err != nil {
		t.Fatalf("no notification for a commit while the relay is idle: %v", err)
	}

	// Awake: a session holds the awake lock as the relay does.
	relayConn := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relayConn.Exec(ctx, `SELECT pg_advisory_lock(hashtext($1), s) FROM generate_series(0, 15) s`, relay.AwakeLockName(h.schema)); err != nil {
		t.Fatal(err)
	}
	awakeApp := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := awakeApp.Exec(ctx, "INSERT INTO "+table+" (job_name, job_args) VALUES ('WhileAwake', '[]'), ('AndAnother', '[]')"); err != nil {
		t.Fatal(err)
	}
	if _, err := relayConn.Exec(ctx, `SELECT pg_advisory_unlock(hashtext($1), s) FROM generate_series(0, 15) s`, relay.AwakeLockName(h.schema)); err != nil {
		t.Fatal(err)
	}
	// Idle again: the next commit notifies once more, and it is the first
	// notification since the one while idle (notifications arrive in
	// commit order): the commit while awake sent none.
	h.stage(relay.Job{Name: "IdleAgain"})
	wctx2, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	n, err := listener.WaitForNotification(wctx2)
	if err != nil {
		t.Fatalf("no notification for a commit after the relay went idle: %v", err)
	}
	if n.PID == awakeApp.PgConn().PID() {
		t.Fatal("the commit while the relay was awake notified")
	}
	if n.PID != h.conn.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the idle commit's %d", n.PID, h.conn.PgConn().PID())
	}
}

// In poll-only mode the relay opens no listener and marks itself awake for
// good: commits take the branch that does not notify, and the poll
// delivers.
func TestPollOnlyNeitherListensNorIsNotified(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	cfg := h.config()
	cfg.PollOnly = true
	cfg.PollInterval = 50 * time.Millisecond
	h.start(cfg)
	testenv.WaitFor(t, 15*time.Second, "the relay to mark itself awake", func() (bool, string) {
		n := h.advisoryLocks(relay.AwakeLockName(h.schema), "ExclusiveLock", true)
		return n == 1, fmt.Sprintf("%d sessions hold it", n)
	})
	var listeners int
	if err := h.conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query IN ($1, '-- ' || $1)`,
		"listen "+pgx.Identifier{relay.ChannelName(h.schema)}.Sanitize()).Scan(&listeners); err != nil || listeners != 0 {
		t.Fatalf("%d sessions LISTEN on the schema's channel (%v), want none in poll-only mode", listeners, err)
	}

	tx, err := h.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	jid, err := h.stager.Stage(ctx, tx, relay.Job{Name: "Polled"})
	if err != nil {
		t.Fatal(err)
	}
	if held := h.advisoryLocks(relay.AwakeLockName(h.schema), "ShareLock", true); held != 0 {
		t.Fatalf("awake lock held shared by %d sessions: the commit would notify", held)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queueJIDs("default"); got[0] != jid {
		t.Fatalf("delivered %v, want %s", got, jid)
	}
}

// The trigger (migration 007) holds no gate lock after it ran, whether it
// notified (the relay idle) or not (awake): a commit never makes the relay
// wait, going awake or idle, and pays for no lock it keeps. Checked on the
// trigger itself, fired at INSERT with SET CONSTRAINTS ALL IMMEDIATE,
// through pg_locks.
func TestTriggerHoldsNoGateLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testenv.Schema(t)
	app := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relay.Migrate(ctx, app, schema); err != nil {
		t.Fatal(err)
	}
	listener := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := listener.Exec(ctx, "LISTEN "+pgx.Identifier{relay.ChannelName(schema)}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	stager := relay.NewStager(schema)
	// fire stages a job with the trigger run at once, and returns the
	// advisory locks the transaction holds after it, then commits.
	fire := func() []string {
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
					WHEN hashtext($1)::oid THEN 'awake' ELSE 'other' END || ' ' || mode
				FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() ORDER BY 1`,
				relay.AwakeLockName(schema))
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
	notified := func() bool {
		c, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		_, err := listener.WaitForNotification(c)
		return err == nil
	}

	// Idle: nobody holds 'awake'.
	if held := fire(); len(held) != 0 {
		t.Fatalf("a commit that found the relay idle holds %v, want no gate lock", held)
	}
	if !notified() {
		t.Fatal("a commit that found the relay idle did not notify")
	}

	// Awake: another session (the relay) holds every shard of 'awake'.
	relayConn := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relayConn.Exec(ctx, `SELECT pg_advisory_lock(hashtext($1), s) FROM generate_series(0, 15) s`,
		relay.AwakeLockName(schema)); err != nil {
		t.Fatal(err)
	}
	if held := fire(); len(held) != 0 {
		t.Fatalf("a commit that found the relay awake holds %v, want no gate lock", held)
	}
	if notified() {
		t.Fatal("a commit that found the relay awake notified")
	}
}
