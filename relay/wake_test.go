package relay_test

import (
	"context"
	"fmt"
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
// relay has gone idle. The relay's barrier waits for that commit, and its
// last drain delivers the job, with the poll a minute away.
func TestGateWaitsForCommitThatSawItAwake(t *testing.T) {
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
	relay.SetGateTimeout(r, time.Minute) // only the commit, never the timeout, ends the wait
	var pushes atomic.Int32
	secondPushed := make(chan struct{})
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before the relay's own cleanup, which waits for Run
	relay.SetAfterPush(r, func(context.Context) error {
		if pushes.Add(1) == 2 {
			close(secondPushed)
			<-release
		}
		return nil
	})
	h.run(r)
	select {
	case <-secondPushed:
	case <-time.After(15 * time.Second):
		t.Fatalf("the second batch was not pushed within 15s; logs: %v", messages(h.logs))
	}
	if held := h.advisoryLocks(relay.AwakeLockName(h.schema), "ExclusiveLock", true); held != 1 {
		t.Fatalf("awake lock held exclusively by %d sessions during the second batch, want 1 (the relay)", held)
	}

	// The app's transaction runs the gate check now (SET CONSTRAINTS ALL
	// IMMEDIATE runs the deferred trigger at INSERT) and sees the relay
	// awake: it holds the barrier and will not notify.
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
	if held := h.advisoryLocks(relay.BarrierLockName(h.schema), "ShareLock", true); held != 1 {
		t.Fatalf("barrier held shared by %d sessions after the gate check, want 1 (the app's)", held)
	}
	if held := h.advisoryLocks(relay.AwakeLockName(h.schema), "ShareLock", true); held != 0 {
		t.Fatalf("awake lock held shared by %d sessions: the app's transaction decided to notify", held)
	}

	// Let the relay finish: its next claim is empty, it goes idle and its
	// barrier waits for the app's transaction.
	unblock()
	testenv.WaitFor(t, 15*time.Second, "the relay to wait on the barrier", func() (bool, string) {
		n := h.advisoryLocks(relay.BarrierLockName(h.schema), "ExclusiveLock", false)
		return n == 1, fmt.Sprintf("%d waiting; queue: %v", n, h.queueJIDs("default"))
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 3, 10*time.Second)
	if got := h.queueJIDs("default"); got[1] != second || got[2] != late {
		t.Fatalf("delivered %v, want the late job %s last", got, late)
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

// With the relay idle, a commit notifies; with it awake, the trigger takes
// the branch that does not notify (seen by the gate lock the committing
// transaction holds: the barrier, not the awake lock); idle again, commits
// notify again.
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
	tx, err := h.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (job_name, job_args) VALUES ('WhileAwake', '[]'), ('AndAnother', '[]')"); err != nil {
		t.Fatal(err)
	}
	if held := h.advisoryLocks(relay.AwakeLockName(h.schema), "ShareLock", true); held != 0 {
		t.Fatalf("awake lock held shared by %d sessions while the relay is awake, want 0", held)
	}
	if held := h.advisoryLocks(relay.BarrierLockName(h.schema), "ShareLock", true); held != 1 {
		t.Fatalf("barrier held shared by %d sessions, want 1 (the committing transaction)", held)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := relayConn.Exec(ctx, `SELECT pg_advisory_unlock(hashtext($1), s) FROM generate_series(0, 15) s`, relay.AwakeLockName(h.schema)); err != nil {
		t.Fatal(err)
	}
	// Idle again: the next commit notifies once more.
	h.stage(relay.Job{Name: "IdleAgain"})
	wctx2, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	if _, err := listener.WaitForNotification(wctx2); err != nil {
		t.Fatalf("no notification for a commit after the relay went idle: %v", err)
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
	if err := h.conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query = $1`,
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

// The trigger (migration 005) holds no gate lock when it notifies, so a
// notifying commit never makes the relay wait, going awake or idle; when
// the relay is awake it holds only 'barrier', shared, to the end of the
// transaction, and does not notify. Checked on the trigger itself, fired at
// INSERT with SET CONSTRAINTS ALL IMMEDIATE, through pg_locks.
func TestTriggerHoldsNoGateLockWhenItNotifies(t *testing.T) {
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
					WHEN hashtext($1)::oid THEN 'awake'
					WHEN hashtext($2)::oid THEN 'barrier' ELSE 'other' END || ' ' || mode
				FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() ORDER BY 1`,
				relay.AwakeLockName(schema), relay.BarrierLockName(schema))
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
	if held := fire(); len(held) != 1 || held[0] != "barrier ShareLock" {
		t.Fatalf("a commit that found the relay awake holds %v, want only barrier, shared", held)
	}
	if notified() {
		t.Fatal("a commit that found the relay awake notified")
	}
}
