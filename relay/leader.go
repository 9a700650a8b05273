package relay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// One relay per schema drains; the rest are standbys. The leader holds a
// session-level advisory lock on a connection that does nothing else, and
// PostgreSQL releases it the moment that connection dies, with the process
// or without it. Standbys try for it every LeaderInterval.
//
// A leader that is frozen (SIGSTOP, a long pause) or cut off keeps its
// connection open, so the connection has idle_session_timeout
// lockIdleTimeout (conn.go): the leader pings it every LeaderInterval/2,
// and one that stops loses the session, and the lock, within
// lockIdleTimeout. Should it wake up, its next use of the connection
// fails and it steps down.

// The lock's name is leaderLockName's, its statements tryLockSQL and
// unlockSQL (locks.go).

var errLostLock = errors.New("lock connection lost")

// campaign connects the lock connection, waits until it holds the lock, and
// leads until ctx ends or the connection fails. connected is when the lock
// connection was established (zero if it never was), so the caller can tell
// a session that stayed healthy for a while from one that failed at once.
//
// It becomes leader as a fleet's schema does (fleet.go), through the same
// steps: openLockConn, checkToLead, becomeLeader, and leadWith.
func (r *Relay) campaign(ctx context.Context, pool *pgxpool.Pool) (connected time.Time, err error) {
	conn, ended, connected, err := r.openLockConn(ctx)
	if err != nil {
		return connected, err
	}
	defer func() {
		_ = withTimeout(ctx, time.Second, conn.Close)
	}()
	if err := r.checkToLead(ctx, conn, false); err != nil {
		return connected, err
	}
	if err := readSystem(ctx, conn, &r.handoff.System); err != nil {
		return connected, err
	}

	standby := false
	for {
		var got bool
		err := withDeadline(ctx, lockQueryTimeout(r.cfg.LeaderInterval), func(ctx context.Context) error {
			return conn.QueryRow(ctx, tryLockSQL, r.lockKey).Scan(&got)
		})
		if err != nil {
			return connected, fmt.Errorf("try leader lock: %w", err)
		}
		r.state.pgAnswered()
		if got {
			break
		}
		if !standby {
			r.state.setRole(RoleStandby)
			r.log.Info("standby: another relay is draining this schema", zap.String("schema", r.cfg.Schema),
				zap.Strings("queues", r.cfg.Queues))
			standby = true
		}
		if !sleep(ctx, jitter(r.cfg.LeaderInterval)) {
			return connected, ctx.Err()
		}
	}
	if standby {
		// The schema may have been migrated, or a conflicting relay
		// started, while this relay waited.
		if err := r.checkToLead(ctx, conn, true); err != nil {
			return connected, err // closing conn releases the lock
		}
	}

	var lockMu sync.Mutex
	r.becomeLeader(conn, &lockMu)
	err = r.leadWith(ctx, conn, &lockMu, pool, nil)
	r.backlog.detach()
	if ctx.Err() != nil {
		// Closing the connection would release the lock as well; unlock
		// first so a standby need not wait for the server to notice.
		_ = withTimeout(ctx, time.Second, func(c context.Context) error { return r.unlockLeader(c, conn) })
		r.log.Info("released leadership")
		return connected, ctx.Err()
	}
	err = explainEnded(err, ended)
	r.steppedDown(err)
	return connected, err
}

// openLockConn connects a lock connection (lockConnConfig), the one a
// relay of one schema holds its leader lock on, or a fleet all of its
// own, and checks that the server accepts writes (checkWritable). ended
// is for explainEnded. connected is when it connected (zero if it did
// not); on an error, conn is closed or was never open.
func (r *Relay) openLockConn(ctx context.Context) (conn *pgx.Conn, ended *atomic.Pointer[pgconn.PgError], connected time.Time, err error) {
	ended = new(atomic.Pointer[pgconn.PgError])
	conn, err = pgx.ConnectConfig(ctx, r.lockConnConfig(ended))
	if err != nil {
		return nil, nil, time.Time{}, fmt.Errorf("connect: %w", err)
	}
	connected = time.Now()
	r.state.pgAnswered()
	if err := checkWritable(ctx, conn); err != nil {
		_ = withTimeout(ctx, time.Second, conn.Close)
		return nil, nil, connected, err
	}
	return conn, ended, connected, nil
}

// readSystem reads PostgreSQL's system_identifier into *system, unless it
// was read already: the fence names the PostgreSQL cluster
// (ErrForeignFence).
func readSystem(ctx context.Context, conn *pgx.Conn, system *string) error {
	if *system != "" {
		return nil
	}
	if err := conn.QueryRow(ctx, `SELECT system_identifier::text FROM pg_control_system()`).Scan(system); err != nil {
		return fmt.Errorf("read system_identifier: %w", err)
	}
	return nil
}

// checkToLead makes the checks a relay makes on its lock connection before
// it leads its schema, a relay of one schema and a fleet's alike: its
// privileges, the schema's version, and its queue group. joined says that
// conn holds the relay's group locks already (joinGroup): then it looks
// for a conflicting relay only. A relay of one schema makes them before it
// tries for its leader lock, and again when it takes the lock after
// standing by; a fleet, each time it takes a schema's lock.
func (r *Relay) checkToLead(ctx context.Context, conn *pgx.Conn, joined bool) error {
	if err := r.checkPrivileges(ctx, conn); err != nil {
		return err
	}
	if err := r.checkVersion(ctx, conn); err != nil {
		return err
	}
	if joined {
		return r.checkGroup(ctx, conn)
	}
	return r.joinGroup(ctx, conn)
}

// becomeLeader makes the relay its schema's leader, on the lock
// connection conn (mu guards it), which holds its leader lock and passed
// checkToLead: the backlog gauges are the leader's, sampled on conn, until
// the lead returns (backlog.detach).
func (r *Relay) becomeLeader(conn *pgx.Conn, mu *sync.Mutex) {
	r.backlog.attach(conn, mu)
	r.state.setRole(RoleLeader)
	if r.tenancy != nil {
		// A fleet's logger names the schema already (tenantConfig): a
		// second "schema" would be a JSON line with a key twice, which
		// some log pipelines refuse.
		r.log.Info("became leader", zap.Strings("queues", r.cfg.Queues))
		return
	}
	r.log.Info("became leader", zap.String("schema", r.cfg.Schema), zap.Strings("queues", r.cfg.Queues))
}

// unlockLeader releases the relay's leader lock on conn.
func (r *Relay) unlockLeader(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, unlockSQL, r.lockKey)
	return err
}

// steppedDown says why the relay stopped leading, err being why its lead
// failed.
func (r *Relay) steppedDown(err error) {
	r.log.Warn("stepped down", zap.String("reason", stepDownReason(err)), zap.Error(err))
}

// explainEnded adds to err, the failure of a lock connection's session,
// PostgreSQL's word on why it ended the session (lockConnConfig), unless
// err is PostgreSQL's own.
func explainEnded(err error, ended *atomic.Pointer[pgconn.PgError]) error {
	var pgErr *pgconn.PgError
	if why := ended.Load(); why != nil && err != nil && !errors.As(err, &pgErr) {
		return fmt.Errorf("%w (%w)", err, why)
	}
	return err
}

// lockConnConfig is the lock connection's config. ended keeps
// PostgreSQL's word on why it ended the session: the statement that meets
// it may be the summary's, not keepLock's ping, which then sees only "conn
// closed"; the step-down line gives it.
func (r *Relay) lockConnConfig(ended *atomic.Pointer[pgconn.PgError]) *pgx.ConnConfig {
	cc := r.connConfig("leader")
	// The gate's lock waits (wake.go) give up after this; no other
	// statement on this connection waits for a lock.
	cc.RuntimeParams["lock_timeout"] = millis(r.gateTimeout)
	cc.RuntimeParams["idle_session_timeout"] = millis(lockIdleTimeout(r.cfg.LeaderInterval))
	cc.OnPgError = func(_ *pgconn.PgConn, pgErr *pgconn.PgError) bool {
		if strings.EqualFold(pgErr.Severity, "FATAL") {
			ended.CompareAndSwap(nil, pgErr)
			return false // close the connection, as pgx does by default
		}
		return true
	}
	return cc
}

// checkVersion checks, through the source, that the table is ready for
// this binary: for staged_jobs, the schema version Migrate recorded; for
// the gem's table, the table and its wake trigger. Waiting cannot fix
// either (ErrNotMigrated, ErrSchemaTooNew).
func (r *Relay) checkVersion(ctx context.Context, conn *pgx.Conn) error {
	return withDeadline(ctx, lockQueryTimeout(r.cfg.LeaderInterval), func(ctx context.Context) error {
		return r.src.check(ctx, conn)
	})
}

// keepLock pings the lock connection every LeaderInterval/2 (jittered),
// which keeps it from going idle for lockIdleTimeout, and returns
// errLostLock when a ping fails: the lock went with the connection, a
// standby may take over, and this relay must stop draining. Whatever else
// uses the connection (the gate, the summary) holds mu for one statement at
// a time, during which the session is not idle either.
func (r *Relay) keepLock(ctx context.Context, conn *pgx.Conn, mu *sync.Mutex) error {
	timeout := lockQueryTimeout(r.cfg.LeaderInterval)
	idle := lockIdleTimeout(r.cfg.LeaderInterval)
	last := time.Now() // the last ping that answered (or the start)
	for sleep(ctx, jitter(r.cfg.LeaderInterval/2)) {
		woke := time.Now()
		mu.Lock()
		err := withTimeout(ctx, timeout, conn.Ping)
		mu.Unlock()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return lostLock(err, woke.Sub(last), idle)
		}
		last = time.Now()
		r.state.pgAnswered()
	}
	return nil
}

// errIdledOut says that keepLock's ping came later than the lock
// connection's idle_session_timeout after the last one that answered.
var errIdledOut = errors.New("no ping for longer than idle_session_timeout")

// lostLock is keepLock's error for a ping that failed (err) since after
// the last one that answered: errLostLock, and errIdledOut when that was
// longer than idle (the connection's idle_session_timeout). A ping due every
// half LeaderInterval comes that late only when this process was paused
// (SIGSTOP, a suspended VM) or starved of CPU: PostgreSQL has ended the
// session, whatever error the ping got. Woken from a pause, its own
// deadline can fire before it reads PostgreSQL's message (57P05), and it
// fails with a timeout (TestFrozenLeaderLosesLead, on a busy machine).
func lostLock(err error, since, idle time.Duration) error {
	if since > idle {
		return fmt.Errorf("%w: %w (%s): %w", errLostLock, errIdledOut, since.Round(time.Millisecond), err)
	}
	return fmt.Errorf("%w: %w", errLostLock, err)
}

// stepDownReason says in words why a leader stopped leading.
func stepDownReason(err error) string {
	var pgErr *pgconn.PgError
	switch {
	case !errors.Is(err, errLostLock):
		return "draining failed in a way that retrying cannot fix"
	case errors.As(err, &pgErr) && pgErr.Code == "57P05", // idle_session_timeout
		errors.Is(err, errIdledOut):
		return "the lock connection was idle past idle_session_timeout, so PostgreSQL ended it: " +
			"this process was paused or cut off, and a standby may have taken over"
	case errors.As(err, &pgErr) && pgErr.Code == "57P01": // admin_shutdown: pg_terminate_backend, server stopping
		return "PostgreSQL terminated the lock connection"
	case pgconn.Timeout(err):
		return "the lock connection did not answer in time"
	}
	return "the lock connection failed"
}

// withDeadline runs f with ctx, given at most d more.
func withDeadline(ctx context.Context, d time.Duration, f func(context.Context) error) error {
	c, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return f(c)
}

// joinGroup takes this relay's group locks on conn and checks for a
// conflicting relay (see groupLockSQL).
func (r *Relay) joinGroup(ctx context.Context, conn *pgx.Conn) error {
	if _, err := conn.Exec(ctx, groupLockSQL, r.cfg.Schema, r.group, r.cfg.Queues, groupNameWords(r.group)); err != nil {
		return fmt.Errorf("take the group locks: %w", err)
	}
	return r.checkGroup(ctx, conn)
}

// checkGroup returns an ErrQueueConflict naming the first conflicting
// relay found, if any.
func (r *Relay) checkGroup(ctx context.Context, conn *pgx.Conn) error {
	var app, queue string
	err := conn.QueryRow(ctx, groupConflictSQL, r.cfg.Schema, r.group, r.cfg.Queues).Scan(&app, &queue)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("check for conflicting relays: %w", err)
	}
	if app == "" {
		app = "another relay"
	} else {
		app = fmt.Sprintf("relay %q", app)
	}
	mine := "all queues"
	if r.group != "" {
		mine = "queues " + r.group
	}
	switch {
	case queue != "":
		return fmt.Errorf("%w in schema %q: %s drains queue %q with a different set of queues than this relay's (%s); relays must have equal or disjoint --queues",
			ErrQueueConflict, r.cfg.Schema, app, queue, mine)
	case r.group == "":
		return fmt.Errorf("%w in schema %q: %s drains a list of queues (--queues), and this relay drains all queues; give every relay of the schema a list",
			ErrQueueConflict, r.cfg.Schema, app)
	default:
		return fmt.Errorf("%w in schema %q: %s drains all queues, and this relay drains a list (%s); give every relay of the schema a list",
			ErrQueueConflict, r.cfg.Schema, app, mine)
	}
}
