package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
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

	// The backlog gauges are the leader's, sampled on its lock connection.
	var lockMu sync.Mutex
	r.backlog.attach(conn, &lockMu)
	r.state.setRole(RoleLeader)
	r.log.Info("became leader", zap.String("schema", r.cfg.Schema))
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
	r.log.Warn("stepped down", zap.Error(err))
	return connected, err
}

// checkVersion checks, through the source, that the table is ready for
// this binary: for staged_jobs, the schema version Migrate recorded; for
// the gem's table, the table and its wake trigger. Waiting cannot fix
// either (ErrNotMigrated, ErrSchemaTooNew).
func (r *Relay) checkVersion(ctx context.Context, conn *pgx.Conn) error {
	return r.src.check(ctx, conn)
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
