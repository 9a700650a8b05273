package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
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

const (
	tryLockSQL = `SELECT pg_try_advisory_lock(hashtextextended($1, 0))`
	unlockSQL  = `SELECT pg_advisory_unlock(hashtextextended($1, 0))`
)

var errLostLock = errors.New("lock connection lost")

// campaign connects the lock connection, waits until it holds the lock, and
// leads until ctx ends or the connection fails. connected is when the lock
// connection was established (zero if it never was), so the caller can tell
// a session that stayed healthy for a while from one that failed at once.
func (r *Relay) campaign(ctx context.Context, pool *pgxpool.Pool) (connected time.Time, err error) {
	cc := r.connConfig("leader")
	// The gate's lock waits (wake.go) give up after this; no other
	// statement on this connection waits for a lock.
	cc.RuntimeParams["lock_timeout"] = strconv.FormatInt(r.gateTimeout.Milliseconds(), 10)
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return time.Time{}, fmt.Errorf("connect: %w", err)
	}
	connected = time.Now()
	r.state.pgAnswered()
	defer func() {
		_ = withTimeout(ctx, time.Second, conn.Close)
	}()

	if err := r.checkPrivileges(ctx, conn); err != nil {
		return connected, err
	}
	if err := r.checkVersion(ctx, conn); err != nil {
		return connected, err
	}

	standby := false
	for {
		var got bool
		if err := conn.QueryRow(ctx, tryLockSQL, r.lockKey).Scan(&got); err != nil {
			return connected, fmt.Errorf("try leader lock: %w", err)
		}
		r.state.pgAnswered()
		if got {
			break
		}
		if !standby {
			r.state.setRole(RoleStandby)
			r.log.Info("standby: another relay is draining this schema", zap.String("schema", r.cfg.Schema))
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
	}

	r.state.setRole(RoleLeader)
	r.log.Info("became leader", zap.String("schema", r.cfg.Schema))
	err = r.lead(ctx, conn, pool)
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
	r.log.Warn("stepped down", zap.Error(err))
	return connected, err
}

// checkVersion compares the schema version that Migrate recorded with the
// one this binary needs, in one query: a schema Migrate never ran on, or one
// it has not brought up to date (ErrNotMigrated), would fail every drain
// with an error retrying cannot fix, and so would a schema a newer stagedrain
// has changed (ErrSchemaTooNew).
func (r *Relay) checkVersion(ctx context.Context, conn *pgx.Conn) error {
	var have *int // nil: no version recorded
	err := conn.QueryRow(ctx, r.sql.version).Scan(&have)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") {
		err = nil // no stagedrain_migrations table, or no schema: never migrated
	}
	if err != nil {
		return fmt.Errorf("check schema version: %w", err)
	}
	switch {
	case have == nil:
		return fmt.Errorf("%w in %q: no schema version recorded (this stagedrain needs %d): run 'stagedrain migrate' first",
			ErrNotMigrated, r.cfg.Schema, r.version)
	case *have < r.version:
		return fmt.Errorf("%w in %q: schema version %d is older than this stagedrain needs (%d): run 'stagedrain migrate' first",
			ErrNotMigrated, r.cfg.Schema, *have, r.version)
	case *have > r.version:
		return fmt.Errorf("%w in %q: schema version %d is newer than this stagedrain knows (%d): upgrade stagedrain",
			ErrSchemaTooNew, r.cfg.Schema, *have, r.version)
	}
	return nil
}

// keepLock checks the lock connection every LeaderInterval and returns
// errLostLock when it fails: the lock went with it, a standby may take over,
// and this relay must stop draining.
func (r *Relay) keepLock(ctx context.Context, conn *pgx.Conn, mu *sync.Mutex) error {
	timeout := max(2*time.Second, 4*r.cfg.LeaderInterval)
	for sleep(ctx, jitter(r.cfg.LeaderInterval)) {
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
