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
func (r *Relay) campaign(ctx context.Context, pool *pgxpool.Pool) (connected time.Time, err error) {
	var ended atomic.Pointer[pgconn.PgError]
	cc := r.lockConnConfig(&ended)
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return time.Time{}, fmt.Errorf("connect: %w", err)
	}
	connected = time.Now()
	r.state.pgAnswered()
	defer func() {
		_ = withTimeout(ctx, time.Second, conn.Close)
	}()

	if err := checkWritable(ctx, conn); err != nil {
		return connected, err
	}
	if err := r.checkPrivileges(ctx, conn); err != nil {
		return connected, err
	}
	if err := r.checkVersion(ctx, conn); err != nil {
		return connected, err
	}
	if err := r.joinGroup(ctx, conn); err != nil {
		return connected, err
	}
	if r.handoff.System == "" {
		// The fence names the PostgreSQL cluster (ErrForeignFence).
		if err := conn.QueryRow(ctx, `SELECT system_identifier::text FROM pg_control_system()`).Scan(&r.handoff.System); err != nil {
			return connected, fmt.Errorf("read system_identifier: %w", err)
		}
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
		// The schema may have been migrated while this relay waited.
		if err := r.checkVersion(ctx, conn); err != nil {
			return connected, err // closing conn releases the lock
		}
		if err := r.checkGroup(ctx, conn); err != nil {
			return connected, err
		}
	}

	// The backlog gauges are the leader's, sampled on its lock connection.
	var lockMu sync.Mutex
	r.backlog.attach(conn, &lockMu)
	r.state.setRole(RoleLeader)
	r.log.Info("became leader", zap.String("schema", r.cfg.Schema), zap.Strings("queues", r.cfg.Queues))
	err = r.lead(ctx, conn, &lockMu, pool)
	r.backlog.detach()
	if ctx.Err() != nil {
		// Closing the connection would release the lock as well; unlock
		// first so a standby need not wait for the server to notice.
		_ = withTimeout(ctx, time.Second, func(c context.Context) error {
			_, err := conn.Exec(c, unlockSQL, r.lockKey)
			return err
		})
		r.log.Info("released leadership")
		return connected, ctx.Err()
	}
	var pgErr *pgconn.PgError
	if why := ended.Load(); why != nil && !errors.As(err, &pgErr) {
		err = fmt.Errorf("%w (%w)", err, why)
	}
	r.log.Warn("stepped down", zap.String("reason", stepDownReason(err)), zap.Error(err))
	return connected, err
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
	for sleep(ctx, jitter(r.cfg.LeaderInterval/2)) {
		mu.Lock()
		err := withTimeout(ctx, timeout, conn.Ping)
		mu.Unlock()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("%w: %w", errLostLock, err)
		}
		r.state.pgAnswered()
	}
	return nil
}

// stepDownReason says in words why a leader stopped leading.
func stepDownReason(err error) string {
	var pgErr *pgconn.PgError
	switch {
	case !errors.Is(err, errLostLock):
		return "draining failed in a way that retrying cannot fix"
	case errors.As(err, &pgErr) && pgErr.Code == "57P05": // idle_session_timeout
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
