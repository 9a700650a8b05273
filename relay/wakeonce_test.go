package relay_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The tests of sql/009_wake_once.sql, as 010 keeps it.

// listen LISTENs on schema's channel on a session of its own.
func listen(t *testing.T, url, schema string) *pgx.Conn {
	t.Helper()
	c := testenv.ConnTo(t, url)
	if _, err := c.Exec(context.Background(), "LISTEN "+pgx.Identifier{relay.ChannelName(schema)}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	return c
}

// nextNotifier waits for listener's next notification, past a relay's
// listener heartbeats, and returns the backend that sent it.
func nextNotifier(t *testing.T, listener *pgx.Conn) uint32 {
	t.Helper()
	pid, err := notifierWithin(listener, 10*time.Second)
	if err != nil {
		t.Fatalf("no notification: %v", err)
	}
	return pid
}

// notifierWithin is nextNotifier, waiting at most d; on a timeout the
// listener stays usable.
func notifierWithin(listener *pgx.Conn, d time.Duration) (uint32, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		n, err := listener.WaitForNotification(ctx)
		if err != nil {
			return 0, err
		}
		if n.Payload != "heartbeat" {
			return n.PID, nil
		}
	}
}

// notifiesBesideIdle runs stage, a commit by the app's session appPID,
// beside the idle relay whose lock connection is holderPID, until one such
// commit notifies (notifiesWhenIdle).
func notifiesBesideIdle(t *testing.T, h *harness, listener *pgx.Conn, holderPID, appPID uint32, stage func()) {
	t.Helper()
	notifiesWhenIdle(t, listener, appPID, func() (uint32, string) {
		got := idleHolders(t, h.conn, h.schema)
		if slices.Equal(got, []uint32{holderPID}) {
			return holderPID, ""
		}
		return 0, fmt.Sprintf("its idle lock held by %v, want %d", got, holderPID)
	}, stage)
}

// notifiesWhenIdle checks that a commit beside an idle relay notifies: it
// waits until idle reports the relay idle (the backend of its lock
// connection, holding its idle lock as an idle relay does; 0 and what it
// sees otherwise), runs stage, one commit by the app's session appPID,
// and waits for its notification. It fails on a notification from
// another backend. It returns how many commits it staged: one, unless a
// commit did not notify while the relay may have left idle around it,
// which it logs and tries again, up to maxIdleCommits.
//
// The relay leaves idle now and then by itself on a busy machine (a push
// that takes over 100ms marks it awake, its listener goes deaf, a batch
// fails, its lock connection times out, a fleet runs hot), and a commit
// made then rightly does not notify: the relay finds the row itself. So
// a missing notification fails at once only when the relay provably was
// idle throughout the commit: its lock connection held the idle lock
// between two looks at pg_stat_activity, before and after the commit,
// and ran no statement in between (its state_change did not move; the
// relay takes and gives back the lock only with statements on that
// connection, and the commit's trigger ran between the looks). Anything
// the lock connection ran meanwhile (its keepalive pings too) leaves it
// open, and the commit is tried again.
func notifiesWhenIdle(t *testing.T, listener *pgx.Conn, appPID uint32, idle func() (uint32, string), stage func()) int {
	t.Helper()
	looks := testenv.ConnTo(t, listener.Config().ConnString())
	var tries []string
	for try := 1; ; try++ {
		var holder uint32
		testenv.WaitFor(t, 15*time.Second, "the relay idle, its lock connection holding its idle lock", func() (bool, string) {
			var what string
			holder, what = idle()
			return holder != 0, what
		})
		before := testenv.SessionStateOf(t, looks, holder)
		still, _ := idle()
		stage()
		after := testenv.SessionStateOf(t, looks, holder)
		pid, err := notifierWithin(listener, 5*time.Second)
		switch {
		case err == nil && pid != appPID:
			t.Fatalf("notification from backend %d, want the commit beside the idle relay (%d)", pid, appPID)
		case err == nil:
			return try
		case still == holder && before.State == "idle" && after == before:
			t.Fatalf("a commit beside the idle relay did not notify (%v): its lock connection %d held the idle lock and ran no statement from before the commit to after it (%s); commits before it: [%s]",
				err, holder, before, strings.Join(tries, "; "))
		}
		tries = append(tries, fmt.Sprintf("%d: lock connection %d %s, then %s; the idle lock held by %d after the first look", try, holder, before, after, still))
		if try == maxIdleCommits {
			t.Fatalf("none of %d commits beside the idle relay notified (%v), the relay not provably idle around any: %s", try, err, strings.Join(tries, "; "))
		}
		t.Logf("commit %d beside the idle relay did not notify (%v), and the relay may have left idle around it (%s): try again", try, err, tries[len(tries)-1])
	}
}

// maxIdleCommits bounds notifiesWhenIdle's commits.
const maxIdleCommits = 5

// A COMMIT cancelled while it runs the wake trigger's function (as a
// driver cancels when the app's context ends) leaves the app's session
// holding no advisory lock: the look at 'idle' takes and releases its
// shard in one expression, and PostgreSQL acts on a cancel only between
// statements (or while waiting). With the take and the release in two
// statements, as in 007, some of these cancels land between them, and the
// session keeps the shard after the failed COMMIT.
//
// Relays of the queues q0 and q1 are idle (a session holds their idle
// locks, and the schema's shared) and nobody holds the schema's
// exclusively: so each row queues the trigger,
// and the function's look at the schema's 'idle' succeeds, taking and
// releasing a shard, before its look at the queue's fails and it notifies.
//
// Each COMMIT's rows alternate between two queues, so that each row
// queues the trigger (one event per change of queue) and the COMMIT runs
// the function 2,000 times, for tens of milliseconds; another session
// cancels it with pg_cancel_backend as soon as pg_stat_activity shows it
// running. The test counts only the cancels whose error comes from inside
// the function (its context names it), and wants 40 of them.
// (statement_timeout cannot do this: PostgreSQL stops its timer before it
// runs the COMMIT's deferred triggers.)
func TestCancelledCommitLeavesNoGateLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testenv.Schema(t)
	app := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relay.Migrate(ctx, app, schema); err != nil {
		t.Fatal(err)
	}
	killer := testenv.Conn(t, testenv.DatabaseURL())
	relayConn := testenv.Conn(t, testenv.DatabaseURL())
	holdIdle(t, relayConn, schema, "q0", "q1")
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	insert := `INSERT INTO ` + table + ` (job_name, job_args, queue)
		SELECT 'Cancelled', '[]', 'q' || (i % 2) FROM generate_series(1, 2000) i`
	// commit stages the rows and commits while killer cancels the
	// COMMIT as soon as it runs; it returns the COMMIT's error.
	commit := func() error {
		t.Helper()
		// The simple protocol: each statement one message, so that a
		// cancel meant for the COMMIT cannot land between the Parse and the
		// Execute of an extended-protocol COMMIT and abort the transaction
		// before it starts.
		for _, q := range []string{"BEGIN", insert} {
			if _, err := app.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		done := make(chan error, 1)
		go func() {
			_, err := app.Exec(ctx, "COMMIT", pgx.QueryExecModeSimpleProtocol)
			done <- err
		}()
		for {
			select {
			case err := <-done:
				return err
			default:
			}
			var cancelled bool
			if err := killer.QueryRow(ctx, `SELECT coalesce(bool_or(pg_cancel_backend(pid)), false) FROM pg_stat_activity
				WHERE pid = $1 AND state = 'active' AND query = 'COMMIT'`, app.PgConn().PID()).Scan(&cancelled); err != nil {
				t.Fatal(err)
			}
			if cancelled {
				return <-done
			}
		}
	}
	held := func() []string {
		t.Helper()
		for {
			rows, err := app.Query(ctx, `SELECT classid || '/' || objid || ' ' || mode FROM pg_locks
				WHERE locktype = 'advisory' AND pid = pg_backend_pid()`)
			if err != nil {
				t.Fatal(err)
			}
			locks, err := pgx.CollectRows(rows, pgx.RowTo[string])
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "57014" {
				continue // a cancel that came after its COMMIT had ended
			}
			if errors.As(err, &pgErr) && pgErr.Code == "25P02" {
				// Seen under load: the session is left in an aborted
				// transaction. A leaked gate lock is a session lock,
				// which ROLLBACK keeps: end it and look again.
				if _, err := app.Exec(ctx, "ROLLBACK"); err != nil {
					t.Fatal(err)
				}
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			return locks
		}
	}

	const want = 40
	inTrigger, attempts := 0, 0
	for inTrigger < want {
		attempts++
		if attempts > 10*want {
			t.Fatalf("only %d of %d COMMITs were cancelled inside stagedrain_wake(); the test proves nothing", inTrigger, attempts)
		}
		err := commit()
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			if _, err := app.Exec(ctx, "TRUNCATE "+table, pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatal(err)
			}
		case errors.As(err, &pgErr) && pgErr.Code == "57014":
			if strings.Contains(pgErr.Where, "stagedrain_wake()") {
				inTrigger++
			}
		case errors.As(err, &pgErr) && pgErr.Code == "25P02":
			// Seen only under the full suite's load: the transaction was
			// already aborted when COMMIT ran (a cancel that landed before
			// it). Not one of the cancels counted; end it, and check the
			// locks all the same.
			if _, err := app.Exec(ctx, "ROLLBACK", pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("COMMIT: %v", err)
		}
		if locks := held(); len(locks) != 0 {
			t.Fatalf("after a cancelled COMMIT (%v; %d cancelled inside the trigger so far), the app's session holds advisory locks %v, want none",
				err, inTrigger, locks)
		}
	}
	t.Logf("%d COMMITs, %d cancelled inside stagedrain_wake(), no lock left", attempts, inTrigger)
}

// With the relay idle (a session holds the schema's idle lock), a
// transaction that stages many rows of one queue runs the wake function
// once (fired here by SET CONSTRAINTS ALL IMMEDIATE, as at COMMIT, and
// counted by track_functions), and a queue change queues it once more;
// the commit notifies. 007 ran it once per row. With nobody idle it runs
// it never, and the commit does not notify.
func TestTriggerRunsOncePerTransactionAndQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testenv.Schema(t)
	app := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relay.Migrate(ctx, app, schema); err != nil {
		t.Fatal(err)
	}
	listener := listen(t, testenv.DatabaseURL(), schema)
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	fn := pgx.Identifier{schema, "stagedrain_wake"}.Sanitize() + "()"
	relayConn := testenv.Conn(t, testenv.DatabaseURL())
	stage := func(tx pgx.Tx, queue string, n int) {
		t.Helper()
		if _, err := tx.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args, queue)
			SELECT 'Bulk', '[]', $1 FROM generate_series(1, $2)`, queue, n); err != nil {
			t.Fatal(err)
		}
	}
	count := func(tx pgx.Tx) int { return xactCalls(t, tx, fn) }
	var before int
	calls := func(tx pgx.Tx) int {
		t.Helper()
		if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
			t.Fatal(err)
		}
		return count(tx) - before
	}
	run := func(f func(tx pgx.Tx)) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL track_functions = 'pl'"); err != nil {
				return err
			}
			before = count(tx)
			f(tx)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}

	// Nobody idle: no row queues the trigger.
	run(func(tx pgx.Tx) {
		stage(tx, "default", 1000)
		stage(tx, "other", 10)
		if n := calls(tx); n != 0 {
			t.Errorf("rows staged with nobody idle ran stagedrain_wake() %d times, want never", n)
		}
	})
	checkDidNotNotify(t, listener, schema, "the commit with nobody idle")

	// Idle from here on: 10,000 rows in one statement, then 100
	// statements of 100.
	holdIdle(t, relayConn, schema)
	run(func(tx pgx.Tx) {
		stage(tx, "default", 10000)
		for range 100 {
			stage(tx, "default", 100)
		}
		if n := calls(tx); n != 1 {
			t.Errorf("20,000 rows of one queue ran stagedrain_wake() %d times, want once", n)
		}
	})
	if pid := nextNotifier(t, listener); pid != app.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the app's %d", pid, app.PgConn().PID())
	}

	// Three runs of two queues: once per run. A savepoint rolled back
	// takes its event and the setting with it: the row after it queues
	// the trigger again.
	run(func(tx pgx.Tx) {
		stage(tx, "a", 100)
		stage(tx, "b", 100)
		stage(tx, "b", 100)
		stage(tx, "a", 100)
		if n := calls(tx); n != 3 {
			t.Errorf("rows of a, b, b, a ran stagedrain_wake() %d times, want 3", n)
		}
	})
	nextNotifier(t, listener)
	run(func(tx pgx.Tx) {
		if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL DEFERRED"); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SAVEPOINT s"); err != nil {
			t.Fatal(err)
		}
		stage(tx, "a", 10)
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
			t.Fatal(err)
		}
		stage(tx, "a", 10)
		if n := calls(tx); n != 1 {
			t.Errorf("rows of a after a savepoint rolled back ran stagedrain_wake() %d times, want once", n)
		}
	})
	if pid := nextNotifier(t, listener); pid != app.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the app's %d", pid, app.PgConn().PID())
	}
}

// The flag that spares a transaction's later rows the trigger is per queue
// and per table: a transaction's first rows going to an awake relay's
// queue do not keep its rows of another queue, or of another schema's
// table, from notifying their idle relays; rows only of the awake queue do
// not notify. Told apart, as in TestGateNotifiesOnlyWhileIdle, by which
// commit's notification arrives first. The relays of schema A's queue b
// and of schema B's queue b are idle (a session holds their idle locks);
// nobody holds A's queue a's, nor either schema's.
func TestTriggerFlagIsPerQueueAndTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	schemaA, schemaB := testenv.Schema(t), testenv.Schema(t)
	app := testenv.Conn(t, url)
	other := testenv.Conn(t, url)
	for _, s := range []string{schemaA, schemaB} {
		if _, err := relay.Migrate(ctx, app, s); err != nil {
			t.Fatal(err)
		}
	}
	listenA, listenB := listen(t, url, schemaA), listen(t, url, schemaB)
	// The relay of schema A's queue a is awake; those of b are idle.
	relayConn := testenv.ConnTo(t, url)
	holdIdle(t, relayConn, schemaA, "b")
	holdIdle(t, relayConn, schemaB, "b")
	insert := func(schema, queue string) string {
		return `INSERT INTO ` + pgx.Identifier{schema, "staged_jobs"}.Sanitize() +
			` (job_name, job_args, queue) SELECT 'Flag', '[]', '` + queue + `' FROM generate_series(1, 100)`
	}
	commit := func(c *pgx.Conn, stmts ...string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
			for _, q := range stmts {
				if _, err := tx.Exec(ctx, q); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}

	// Only a's rows: a's relay will find them, no notification; the next
	// commit's (the other session's) is the first to arrive.
	commit(app, insert(schemaA, "a"))
	commit(other, insert(schemaA, "b"))
	if pid := nextNotifier(t, listenA); pid != other.PgConn().PID() {
		t.Fatalf("first notification on A from backend %d, want %d: the commit of only a's rows notified", pid, other.PgConn().PID())
	}
	// a's rows, then b's: b's relay is idle, so the commit notifies.
	commit(app, insert(schemaA, "a"), insert(schemaA, "b"))
	if pid := nextNotifier(t, listenA); pid != app.PgConn().PID() {
		t.Fatalf("notification on A from backend %d, want the commit of a's and b's rows (%d)", pid, app.PgConn().PID())
	}
	// A's rows of b, then B's of b: both relays are idle, both notified.
	commit(app, insert(schemaA, "b"), insert(schemaB, "b"))
	if pid := nextNotifier(t, listenA); pid != app.PgConn().PID() {
		t.Fatalf("notification on A from backend %d, want %d", pid, app.PgConn().PID())
	}
	if pid := nextNotifier(t, listenB); pid != app.PgConn().PID() {
		t.Fatalf("notification on B from backend %d, want the commit that staged rows in A and then B (%d)", pid, app.PgConn().PID())
	}
}

// A transaction that will be prepared (two-phase commit) opts out of the
// notification with SET LOCAL stagedrain.notify = 'off': PREPARE
// TRANSACTION then succeeds while the relay is idle, and the relay's poll
// delivers the job after COMMIT PREPARED. Without it, PREPARE fails, as
// the trigger notifies: the test does exercise the trigger. On a private
// server, with max_prepared_transactions > 0.
func TestPreparedTransactionOptsOutOfNotify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.StartPostgres(t, "max_prepared_transactions=2")
	h := &harness{t: t, schema: "sdtest_2pc", conn: testenv.ConnTo(t, pg.URL())}
	h.rdb, h.ns = testenv.Redis(t)
	if _, err := relay.Migrate(ctx, h.conn, h.schema); err != nil {
		t.Fatal(err)
	}
	h.stager = relay.NewStager(h.schema)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.PollInterval = 50 * time.Millisecond
	r, idle := h.startSignaled(cfg)
	ts := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(ts.Close)
	h.waitIdleAfterListen(idle)

	app := testenv.ConnTo(t, pg.URL())
	// prepare stages a job in a transaction that runs setup first, and
	// prepares it as gid; it returns the job's jid and PREPARE's error.
	prepare := func(gid string, setup ...string) (string, error) {
		t.Helper()
		if _, err := app.Exec(ctx, "BEGIN"); err != nil {
			t.Fatal(err)
		}
		for _, q := range setup {
			if _, err := app.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		jid, err := h.stager.Stage(ctx, app, relay.Job{Name: "TwoPhase"})
		if err != nil {
			t.Fatal(err)
		}
		if n := h.advisoryLocks(relay.IdleLockName(h.schema), "ExclusiveLock", true); n != 1 {
			t.Fatalf("%d sessions hold the idle lock, want 1: the relay is not idle", n)
		}
		_, err = app.Exec(ctx, "PREPARE TRANSACTION '"+gid+"'")
		return jid, err
	}

	// Without the opt-out: the trigger notifies, PREPARE fails.
	_, err := prepare("sd_notify")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "0A000" || !strings.Contains(pgErr.Message, "NOTIFY") {
		t.Fatalf("PREPARE TRANSACTION after staging a job with the relay idle: %v, want the NOTIFY error (0A000)", err)
	}
	_, _ = app.Exec(ctx, "ROLLBACK") // the failed PREPARE rolled it back already

	// With it: prepared, committed, and delivered by the poll.
	jid, err := prepare("sd_optout", "SET LOCAL stagedrain.notify = 'off'")
	if err != nil {
		t.Fatalf("PREPARE TRANSACTION with stagedrain.notify off: %v", err)
	}
	if _, err := app.Exec(ctx, "COMMIT PREPARED 'sd_optout'"); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 1, 10*time.Second)
	if got := h.queueJIDs("default"); got[0] != jid {
		t.Fatalf("delivered %v, want %s", got, jid)
	}
	s := scrapeMetrics(t, ts.URL+"/metrics")
	if v := s.value("stagedrain_wakeups_total", "cause", "notify"); v != 0 {
		t.Errorf("wakeups_total{cause=notify} = %v, want 0: the prepared transaction opted out", v)
	}
}

// The trigger's WHEN looks at the schema's idle lock alone
// (sql/015_wake_one_look.sql), and only while a relay holds it, of either
// kind, does a row call stagedrain_wake_once, which lets the first row of
// each queue in a transaction queue stagedrain_wake(). Counted by
// track_functions, 100 rows in each commit, in each state:
//   - nobody idle (no relay, or relays awake): no call of either function,
//     no notification;
//   - a relay of all queues idle: stagedrain_wake_once for every row,
//     stagedrain_wake() once, and the commit notifies;
//   - a relay of the group of queue b idle: b's rows, the same; a's rows
//     call both too (the relay of b holds the schema's lock shared, and
//     stagedrain_wake() asks which queue's relay is idle), and do not
//     notify;
//   - the group's relay awake again: no call.
func TestTriggerLooksOnceWhileNobodyIdle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testenv.Schema(t)
	app := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relay.Migrate(ctx, app, schema); err != nil {
		t.Fatal(err)
	}
	listener := listen(t, testenv.DatabaseURL(), schema)
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	once := pgx.Identifier{schema, "stagedrain_wake_once"}.Sanitize() + "(text, text)"
	wake := pgx.Identifier{schema, "stagedrain_wake"}.Sanitize() + "()"
	relayConn := testenv.Conn(t, testenv.DatabaseURL())
	count := func(tx pgx.Tx) (onceCalls, wakeCalls int) {
		return xactCalls(t, tx, once), xactCalls(t, tx, wake)
	}
	// commit stages 100 rows of each queue, one statement each, and
	// checks the calls they made (the function fired by SET CONSTRAINTS
	// ALL IMMEDIATE, as at COMMIT).
	commit := func(what string, wantOnce, wantWake int, queues ...string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL track_functions = 'pl'"); err != nil {
				return err
			}
			o0, w0 := count(tx)
			for _, q := range queues {
				if _, err := tx.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args, queue)
					SELECT 'Look', '[]', $1 FROM generate_series(1, 100)`, q); err != nil {
					return err
				}
			}
			if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
				return err
			}
			o, w := count(tx)
			if o-o0 != wantOnce || w-w0 != wantWake {
				t.Errorf("%s: stagedrain_wake_once called %d times and stagedrain_wake %d, want %d and %d",
					what, o-o0, w-w0, wantOnce, wantWake)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}

	commit("nobody idle", 0, 0, "a", "b")
	checkDidNotNotify(t, listener, schema, "the commit with nobody idle")

	holdIdle(t, relayConn, schema)
	commit("a relay of all queues idle", 100, 1, "a")
	if pid := nextNotifier(t, listener); pid != app.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the app's %d", pid, app.PgConn().PID())
	}
	releaseIdle(t, relayConn, schema)

	holdIdle(t, relayConn, schema, "b")
	commit("rows of a while b's relay is idle", 100, 1, "a")
	checkDidNotNotify(t, listener, schema, "the commit of a's rows while only b's relay is idle")
	commit("rows of b while b's relay is idle", 100, 1, "b")
	if pid := nextNotifier(t, listener); pid != app.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the app's %d (rows of b)", pid, app.PgConn().PID())
	}
	releaseIdle(t, relayConn, schema, "b")

	commit("b's relay awake again", 0, 0, "a", "b")
	checkDidNotNotify(t, listener, schema, "the commit with b's relay awake again")
}

// An app whose database revokes EXECUTE from PUBLIC by default (ALTER
// DEFAULT PRIVILEGES ... REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC, for the
// role that migrates) still stages rows, with a relay idle or not: its
// INSERT runs stagedrain_wake_once (the trigger's WHEN, 015; PostgreSQL
// checks EXECUTE as it prepares the WHEN, relay idle or not), which
// migration 015 grants to PUBLIC, as it does stagedrain_next_id (the id's
// default from 011 to 018, which writes the function's expression out).
// Without the grant, every INSERT fails. The app's role has only USAGE on the
// schema, INSERT on staged_jobs and USAGE on its sequence.
func TestAppStagesWhereExecuteIsNotGrantedByDefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	owner, ownerURL := testenv.RoleIn(t, url, "sdtest_own_")
	app, appURL := testenv.RoleIn(t, url, "sdtest_app_")
	schema := testenv.Schema(t) // a name, dropped before the roles
	admin := testenv.Conn(t, url)
	q := func(name string) string { return pgx.Identifier{name}.Sanitize() }
	for _, sql := range []string{
		"CREATE SCHEMA " + q(schema) + " AUTHORIZATION " + q(owner),
		"ALTER DEFAULT PRIVILEGES FOR ROLE " + q(owner) + " REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC",
	} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	ownerConn := testenv.ConnTo(t, ownerURL)
	if _, err := relay.Migrate(ctx, ownerConn, schema); err != nil {
		t.Fatal(err)
	}
	for _, sql := range []string{
		"GRANT USAGE ON SCHEMA " + q(schema) + " TO " + q(app),
		"GRANT INSERT ON " + pgx.Identifier{schema, "staged_jobs"}.Sanitize() + " TO " + q(app),
		"GRANT USAGE ON SEQUENCE " + pgx.Identifier{schema, "staged_jobs_id_seq"}.Sanitize() + " TO " + q(app),
	} {
		if _, err := ownerConn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	listener := listen(t, url, schema)
	appConn := testenv.ConnTo(t, appURL)
	stage := func(what string) {
		t.Helper()
		if _, err := appConn.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "staged_jobs"}.Sanitize()+
			` (job_name, job_args) VALUES ('NoExecute', '[]')`); err != nil {
			t.Fatalf("the app's INSERT, %s: %v", what, err)
		}
	}
	stage("nobody idle")
	checkDidNotNotify(t, listener, schema, "the commit with nobody idle")
	holdIdle(t, testenv.Conn(t, url), schema)
	stage("a relay idle")
	if pid := nextNotifier(t, listener); pid != appConn.PgConn().PID() {
		t.Fatalf("notification from backend %d, want the app's %d", pid, appConn.PgConn().PID())
	}
}

// xactCalls is how many times tx's backend has called the function fn (a
// regprocedure, as text) so far, with track_functions on. The calls a
// backend counts are kept until it reports them, when idle outside a
// transaction: a transaction's own are those it adds.
func xactCalls(t *testing.T, tx pgx.Tx, fn string) int {
	t.Helper()
	var n *int
	if err := tx.QueryRow(context.Background(), `SELECT pg_stat_get_xact_function_calls($1::regprocedure)`, fn).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n == nil {
		return 0
	}
	return *n
}
