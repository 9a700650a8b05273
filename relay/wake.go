package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// A wake-up is a token in a channel of capacity 1: any number of
// notifications, polls and reconnects that arrive while a drain runs fold
// into one more drain after it, and none is ever lost.
func trySendWakeup(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// poll wakes the drain every jittered interval until ctx ends: the fallback
// that makes a lost notification cost latency, never a job. It counts each
// wake-up in polls.
func poll(ctx context.Context, interval time.Duration, wake chan<- struct{}, polls prometheus.Counter) {
	for sleep(ctx, jitter(interval)) {
		polls.Inc()
		trySendWakeup(wake)
	}
}

// armDue sets due to fire when the earliest future run_at of staged_jobs
// is due, or after the poll interval if that is sooner (the poll wakes the
// drain then anyway, and the next drain arms due again), and returns its
// channel; nil when no row waits for its run_at. For a target with no
// scheduler, whose claim skips rows not yet due: without it, a job due in
// 200ms would wait for the next poll. PostgreSQL computes the wait from
// its own clock, the one the claim's run_at <= now() reads.
//
// With the low-water mark w, the same round trip looks below the mark for
// rows that came due since the last look (lowwater.go): found, it lowers
// the mark below the lowest and returns again, and the drain claims once
// more at once.
func (r *Relay) armDue(ctx context.Context, pool *pgxpool.Pool, due *time.Timer, w *lowWater, log *zap.Logger) (dueC <-chan time.Time, again bool) {
	var us, below *int64
	var err error
	if w == nil {
		err = pool.QueryRow(ctx, r.sql.nextDue).Scan(&us)
	} else {
		var now time.Time
		mark, _ := w.from()
		args := append([]any{mark, w.lookSince()}, r.claimArgs...)
		if err = pool.QueryRow(ctx, r.sql.nextDueLook, args...).Scan(&us, &below, &now); err == nil {
			w.looked = now
		}
	}
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("could not read the next run_at; the poll wakes for it", zap.Error(err))
		}
		return nil, false
	}
	if below != nil {
		w.lower(*below)
		again = true
	}
	if us == nil {
		return nil, again
	}
	due.Reset(min(time.Duration(*us)*time.Microsecond, r.cfg.PollInterval))
	return due.C, again
}

// gate tells committing transactions whether to NOTIFY (see
// sql/010_wake_when_idle.sql, and 007 and 009 before it): a commit notifies
// only while the relay holds the schema's "idle" advisory lock, that is
// while it is idle and listening. While it drains, while a failed drain
// waits to retry (Redis down or hung), while memory backpressure pauses it,
// in poll-only mode and while nobody leads, nobody holds "idle", and
// commits do not notify: the relay finds their rows by itself,
// or the next leader's drain at start does. Notifying commits are
// serialized by PostgreSQL's notify lock; a relay that is not idle keeps
// that cost off the app, and while it is idle one commit of the schema
// notifies at a time (sql/012_wake_one_notifier.sql): the others see
// another's notification on its way. A drain that starts idle may drain
// one batch and stay idle, without going through sleep, so its first claim
// reads the transactions in progress too, before its snapshot, when a
// commit holds the schema's 'behind' lock (behindLook,
// sql/014_wake_behind.sql), into late: a commit that did not notify is
// then seen by that claim or drained when it ends, as a commit that saw
// the relay awake is.
//
// Going idle, the relay takes "idle" and, in the same round trip, reads the
// ids of the transactions in progress: a commit that saw it awake has ended
// by then, and the drain that follows sees its rows, or is one of them, and
// the relay drains again as soon as one of them ends (late, and its timer).
// No commit is left without either a notification or a drain that sees it;
// a commit that ends later than the fallback poll's interval after the
// relay went idle waits for the poll. Going awake only releases "idle".
//
// The locks live on the leader's lock connection, which can outlive the
// lead: a fleet's schemas share one that stays open while it lets a schema
// go, steps down from one, or leads it again, and advisory locks count up
// (a second lead would take them twice and release them once). So every
// lead ends with release, whatever ended it, before its leader lock is
// unlocked; a relay of one schema then closes the connection too. In
// poll-only mode the relay never goes idle (pinned): no commit notifies,
// and the fallback poll does all the waking.
//
// The gate's statements run to their end when the lead's context ends,
// within the gate's timeout: pgx closes a connection whose statement is
// cancelled, and a fleet's lock connection holds every schema's locks.
//
// A relay with Config.Queues holds the locks of its queues instead
// ("idle:<queue>"), exclusively: a schema-wide "idle" would make commits
// to other groups' queues notify a relay that does not drain them. It
// holds the schema's "idle" too, shared (gateKeys): a commit's trigger
// looks at that lock alone, and runs the precise looks only while some
// relay of the schema holds it (sql/015_wake_one_look.sql).
type gate struct {
	mu       *sync.Mutex // guards conn, shared with keepLock
	conn     *pgx.Conn
	idleKeys gateKeys // the schema's lock, or one per queue of Config.Queues and the schema's shared
	// awake is true while the relay holds no "idle" lock: commits do not
	// notify. A lead starts awake, and goes idle at the end of its first
	// drain. Changed only under mu, with the locks: by the drain loop, or
	// by a fleet going hot (fleetSession.holdAwake), which releases every
	// idle schema's locks at once.
	awake  atomic.Bool
	pinned bool // poll-only: never goes idle
	// held, when set and true, holds the relay awake: a fleet running hot
	// (fleethot.go) finds its schemas' rows by polling them all at
	// once, and no commit need notify.
	held *atomic.Bool
	// deaf, when true, holds the relay awake too: its listener is not
	// LISTENing (Relay.deaf), and an idle relay would only make commits
	// notify nobody.
	deaf *atomic.Bool
	// paused is true while backpressure holds a queue back: the relay
	// then goes idle and is notified as a relay of one schema, hot fleet
	// or not (its rows held back would otherwise keep the hot poll
	// waking it, for nothing, every step).
	paused  bool
	idleAt  time.Time     // when the relay last went idle, or a drain ended
	timeout time.Duration // bounds each statement: lock_timeout plus the lock connection's query timeout
	late    lateCommits
}

const (
	// The ids of the transactions in progress: a transaction's id shows
	// in pg_stat_activity.backend_xid from when it gets one (before it
	// inserts a row) until its commit is visible (PostgreSQL clears it
	// from its PGPROC as it ends), and a prepared transaction's in
	// pg_prepared_xacts until COMMIT PREPARED. pg_current_snapshot() would
	// not do: it does not list the ids above the last one to end. Nor
	// pg_locks (each transaction's lock on its own id), which this read
	// before issue 23: it holds every partition of PostgreSQL's lock
	// table while it copies it, so the app's lock requests (the trigger's
	// looks at the gate among them) wait for it, and it copies every
	// advisory lock held, 16 per idle schema (3,200 for a fleet of 200):
	// 3-4.5ms a read against 0.06ms for this, prepared, on this machine.
	// Every role may read both (backend_xid is not among the columns
	// pg_stat_activity hides from other roles). xid as text as bigint:
	// pgx has no xid array type.
	inProgressSQL = `SELECT coalesce(array_agg(DISTINCT x), '{}') FROM (
		SELECT backend_xid::text::bigint FROM pg_stat_activity WHERE backend_xid IS NOT NULL
		UNION ALL SELECT transaction::text::bigint FROM pg_prepared_xacts) t(x)`
	// Which of $1 are still in progress.
	stillInProgressSQL = `SELECT coalesce(array_agg(DISTINCT x), '{}') FROM (
		SELECT backend_xid::text::bigint FROM pg_stat_activity WHERE backend_xid IS NOT NULL
		UNION ALL SELECT transaction::text::bigint FROM pg_prepared_xacts) t(x)
		WHERE x = ANY($1::bigint[])`
)

// behindLook is what a drain that starts idle reads before its first
// claim (Relay.claim): the transactions in progress, if a commit of the
// schema did not notify because another was notifying.
type behindLook struct {
	schema string
	xids   []int64
}

// lookBehindSQL returns the transactions in progress (inProgressSQL) when
// a commit of the schema $1 holds its 'behind' lock, which a commit that
// sees a relay idle takes before it tries 'notifying' and holds until it
// ends (sql/014_wake_behind.sql), and none otherwise. The relay holds
// 'behind' only within this expression; a commit that finds it held then
// notifies.
const lookBehindSQL = `SELECT CASE WHEN pg_try_advisory_lock(hashtext('stagedrain-behind:' || $1::text), 0)
		AND pg_advisory_unlock(hashtext('stagedrain-behind:' || $1::text), 0)
	THEN '{}'::bigint[] ELSE (` + inProgressSQL + `) END`

// wake marks the relay awake: it releases "idle", so that commits stop
// notifying. It never waits for the app.
func (g *gate) wake(ctx context.Context) error {
	if g.awake.Load() {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.awake.Load() { // a fleet going hot released the locks meanwhile
		return nil
	}
	err := withTimeout(ctx, g.timeout, func(ctx context.Context) error {
		_, err := g.conn.Exec(ctx, gateUnlockSQL, g.idleKeys.args()...)
		return err
	})
	if err != nil {
		// Still idle: the locks may be held, and release tries again
		// (unlocking a shard not held only raises a WARNING).
		return fmt.Errorf("%w: mark awake: %w", errLostLock, err)
	}
	g.awake.Store(true)
	return nil
}

// slowPush is how long a push may take, from an idle relay, before the
// relay marks itself awake until it ends (awakeIfSlow). A push takes about
// a millisecond; one that takes this long is most likely waiting on a Redis
// that does not answer, for as long as the client's read timeout (3s by
// default), and meanwhile every commit would notify a relay that cannot
// drain.
const slowPush = 100 * time.Millisecond

// awakeIfSlow marks the relay awake, from another goroutine, if it is idle
// and the work that starts now (a batch's push) is still running after
// slowPush; done waits for that and returns its error. The caller touches
// no other field of g until done returns.
func (g *gate) awakeIfSlow(ctx context.Context) (done func() error) {
	if g.awake.Load() {
		return func() error { return nil }
	}
	woke := make(chan error, 1)
	t := time.AfterFunc(slowPush, func() { woke <- g.wake(ctx) })
	return func() error {
		if t.Stop() {
			return nil
		}
		return <-woke
	}
}

// heldAwake reports whether the relay must not go idle: its listener is
// not LISTENing, or a hot fleet holds it awake (hot).
func (g *gate) heldAwake() bool {
	return g.deaf != nil && g.deaf.Load() || g.hot()
}

// hot reports whether a hot fleet holds the relay awake, and finds its
// rows by its poll (unless backpressure holds a queue back).
func (g *gate) hot() bool {
	return g.held != nil && g.held.Load() && !g.paused
}

// release gives back the gate's locks at the end of a lead, whatever ended
// it: ctx (a fleet letting the schema go, or shutting down), a step-down
// (fenced, lost lock, a fatal error). Without it a fleet's lock
// connection, which stays open, would keep the schema's commits notifying
// a relay that no longer drains it, and keep the next leader from going
// idle. No drain follows, nor a look at the transactions in progress: the
// next leader's drain at start, and its own look (drainLoop), see the
// commits that did not notify. It runs after ctx has ended, within the
// gate's timeout.
func (g *gate) release(ctx context.Context) error {
	g.pinned = false
	if err := g.wake(ctx); err != nil {
		return fmt.Errorf("release the wake gate: %w", err)
	}
	return nil
}

// sleep marks the relay idle and adds the transactions then in progress
// to g.late: the caller drains next, which sees every commit that saw the
// relay awake and has ended, and the drain loop drains again when one of
// the others ends.
func (g *gate) sleep(ctx context.Context) error {
	if !g.awake.Load() || g.pinned || g.heldAwake() {
		return nil
	}
	g.idleAt = time.Now()
	return g.inProgress(ctx, true)
}

// inProgress adds the transactions in progress to g.late, taking "idle"
// first when lock is set; in one round trip. If commits looking at the gate
// hold a shard of "idle" past the lock connection's lock_timeout, the
// relay gives back the shards it took and stays awake: the caller's next
// empty claim tries again.
func (g *gate) inProgress(ctx context.Context, lock bool) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if lock && g.heldAwake() {
		// A fleet went hot since the caller looked, and may have
		// released every idle lock already (fleetSession.holdAwake).
		return nil
	}
	b := &pgx.Batch{}
	if lock {
		b.Queue(gateLockSQL, g.idleKeys.args()...)
	}
	var xids []int64
	b.Queue(inProgressSQL).QueryRow(func(row pgx.Row) error { return row.Scan(&xids) })
	err := withTimeout(ctx, g.timeout, func(ctx context.Context) error {
		return g.conn.SendBatch(ctx, b).Close()
	})
	if lock && isLockTimeout(err) {
		err = withTimeout(ctx, g.timeout, func(ctx context.Context) error {
			_, err := g.conn.Exec(ctx, gateUnlockSQL, g.idleKeys.args()...)
			return err
		})
		if err == nil {
			return nil
		}
	}
	if lock {
		// Idle even when the batch failed after its lock statement: the
		// locks may be held, and release gives them back.
		g.awake.Store(false)
	}
	if err != nil {
		return fmt.Errorf("%w: mark idle: %w", errLostLock, err)
	}
	g.late.add(xids, time.Now())
	return nil
}

// checkLate asks which of the transactions in g.late are still in
// progress, and reports whether any of them ended since the last check
// (the caller drains then). It re-arms g.late's timer, or drops the rest
// once the window is over.
func (g *gate) checkLate(ctx context.Context) (ended bool, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var left []int64
	err = withTimeout(ctx, g.timeout, func(ctx context.Context) error {
		return g.conn.QueryRow(ctx, stillInProgressSQL, g.late.ids()).Scan(&left)
	})
	if err != nil {
		return false, fmt.Errorf("%w: check late commits: %w", errLostLock, err)
	}
	return g.late.checked(left, time.Now()), nil
}

// lateCommits are the transactions that were in progress when the relay
// went idle: any of them may have seen it awake, not notified, and
// committed after its last drain. The relay checks them lateFirstCheck
// after going idle, and then each time the youngest of them has doubled
// its age (the time since the relay first saw it in progress), and drains
// when any has ended. A transaction older than window (the fallback poll's
// interval) is no longer checked, as the poll covers it. So a commit is
// drained at most about twice as long after the relay went idle as it took
// to end (and lateFirstCheck), and never later than the poll; and an app
// transaction that stays open long costs a check each time its age
// doubles, not one per idle moment.
type lateCommits struct {
	xids   []lateXid
	window time.Duration
	timer  *time.Timer
}

type lateXid struct {
	id    int64
	since time.Time // when the relay first saw it in progress, going idle
}

const lateFirstCheck = 200 * time.Microsecond

// add adds the transactions in progress when the relay went idle at now.
func (l *lateCommits) add(xids []int64, now time.Time) {
	for _, x := range xids {
		if !slices.ContainsFunc(l.xids, func(lx lateXid) bool { return lx.id == x }) {
			l.xids = append(l.xids, lateXid{id: x, since: now})
		}
	}
	l.arm(now)
}

// ids are the transactions to check.
func (l *lateCommits) ids() []int64 {
	ids := make([]int64, len(l.xids))
	for i, x := range l.xids {
		ids[i] = x.id
	}
	return ids
}

// checked keeps the transactions still in progress (left) and reports
// whether any ended.
func (l *lateCommits) checked(left []int64, now time.Time) bool {
	n := len(l.xids)
	l.xids = slices.DeleteFunc(l.xids, func(x lateXid) bool { return !slices.Contains(left, x.id) })
	ended := len(l.xids) < n
	l.arm(now)
	return ended
}

// next is the wait until the next check at now, and false when there is
// nothing left to check (what is older than the window is dropped).
func (l *lateCommits) next(now time.Time) (time.Duration, bool) {
	l.xids = slices.DeleteFunc(l.xids, func(x lateXid) bool { return now.Sub(x.since) > l.window })
	if len(l.xids) == 0 {
		return 0, false
	}
	youngest := now.Sub(l.xids[0].since)
	for _, x := range l.xids[1:] {
		youngest = min(youngest, now.Sub(x.since))
	}
	return max(youngest, lateFirstCheck), true
}

// arm sets the timer for the next check, or stops it.
func (l *lateCommits) arm(now time.Time) {
	wait, ok := l.next(now)
	if !ok {
		l.stop()
		return
	}
	if l.timer == nil {
		l.timer = time.NewTimer(wait)
	} else {
		l.timer.Reset(wait)
	}
}

// C is the timer's channel while there are transactions to check, nil
// otherwise.
func (l *lateCommits) C() <-chan time.Time {
	if len(l.xids) == 0 || l.timer == nil {
		return nil
	}
	return l.timer.C
}

func (l *lateCommits) stop() {
	if l.timer != nil {
		l.timer.Stop()
	}
}

func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03" // lock_not_available
}
