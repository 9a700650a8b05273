package relay

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// ChannelName is the NOTIFY channel of schema's staged_jobs trigger:
// "stagedrain_" + schema, or "stagedrain_" + md5(schema) when that would pass
// PostgreSQL's 63-byte limit. The trigger (sql/001_staged_jobs.sql) computes
// the same name.
func ChannelName(schema string) string {
	if name := "stagedrain_" + schema; len(name) <= 63 {
		return name
	}
	sum := md5.Sum([]byte(schema))
	return "stagedrain_" + hex.EncodeToString(sum[:])
}

// listenerQuiet is how long the listener waits for a notification before
// it checks that its session still answers. A connection can die without a
// word: the server's host gone (TCP keepalives find that within about 11s,
// see conn.go), a firewall or NAT dropping the idle flow, a stuck backend.
// So after listenerQuiet without a notification the listener sends an
// empty statement, a comment naming its LISTEN (l.checkSQL). The server
// runs it as an empty transaction (no transaction id, snapshot or lock),
// which it adds to pg_stat_database only when the session flushes other
// statistics: for this session, which touches no table, when it ends. A
// LISTEN, as before, counted in pg_stat_database every 2s as it ran. And
// pg_stat_activity still shows what the session is for. One that
// gets no answer within lockQueryTimeout (2s by default) is closed, logged
// at warn, and replaced: a dead listener is found within about 4s, and the
// reconnect drains what it may have missed.
const listenerQuiet = 2 * time.Second

// listen holds a LISTEN connection until ctx ends, and replaces it when it
// fails, after a capped exponential backoff (the first wait, after a
// session that did LISTEN, is the shortest). Each LISTEN, first or after a
// reconnect, is followed by a drain for what was committed while nobody
// listened. A notification only signals the drain, never drains: the
// listening connection keeps reading, so the NOTIFY queue never backs up.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) error {
	l := &listener{r: r, log: r.log.Named("listener"), wake: wake, channel: ChannelName(r.cfg.Schema)}
	// pg_stat_activity shows a session's last statement: this one, for the
	// listener (tests find it by that).
	l.listenSQL = "listen " + pgx.Identifier{l.channel}.Sanitize()
	l.checkSQL = "-- " + l.listenSQL
	for attempt := 0; ; {
		listened, err := l.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if listened {
			attempt = 0
		}
		attempt++
		wait := backoff(attempt, r.cfg.MaxBackoff)
		r.metrics.errPostgres.Inc()
		l.log.Warn("listener error, reconnecting", zap.Error(err), zap.Int("attempt", attempt), zap.Duration("wait", wait))
		if !sleep(ctx, wait) {
			return nil
		}
	}
}

type listener struct {
	r         *Relay
	log       *zap.Logger
	wake      chan<- struct{}
	channel   string
	listenSQL string
	checkSQL  string // the liveness check: an empty statement
	connects  int64  // sessions that LISTENed
}

// session connects, LISTENs, wakes the drain, and then waits for
// notifications until the connection fails (an error) or ctx ends (nil).
// listened reports whether its LISTEN succeeded.
func (l *listener) session(ctx context.Context) (listened bool, err error) {
	conn, err := pgx.ConnectConfig(ctx, l.r.connConfig("listener"))
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	defer func() { _ = withTimeout(ctx, time.Second, conn.Close) }()
	timeout := lockQueryTimeout(l.r.cfg.LeaderInterval)
	if err := l.exec(ctx, conn, l.listenSQL, timeout); err != nil {
		return false, fmt.Errorf("listen %q: %w", l.channel, err)
	}
	l.r.listens.Add(1)
	l.r.metrics.wakeReconnect.Inc()
	if l.connects++; l.connects == 1 {
		l.log.Info("listening", zap.String("channel", l.channel))
	} else {
		l.log.Info("listener reconnected", zap.String("channel", l.channel), zap.Int64("reconnects", l.connects-1))
	}
	trySendWakeup(l.wake)
	for {
		// Notifications that arrive during the LISTEN below are kept by
		// the connection and returned by the next WaitForNotification.
		err := withDeadline(ctx, listenerQuiet, func(ctx context.Context) error {
			_, err := conn.WaitForNotification(ctx)
			return err
		})
		switch {
		case err == nil:
			l.r.metrics.wakeNotify.Inc()
			trySendWakeup(l.wake)
		case ctx.Err() != nil:
			return true, nil
		case !pgconn.Timeout(err):
			return true, fmt.Errorf("wait for notification: %w", err)
		default:
			if err := l.exec(ctx, conn, l.checkSQL, timeout); err != nil {
				return true, fmt.Errorf("no answer from the listener's session after %s without a notification: %w", listenerQuiet, err)
			}
		}
	}
}

// exec runs sql (the LISTEN, or its check), given at most timeout. The
// simple protocol: a comment alone is an empty query, which the extended
// protocol would first try to prepare.
func (l *listener) exec(ctx context.Context, conn *pgx.Conn, sql string, timeout time.Duration) error {
	return withDeadline(ctx, timeout, func(ctx context.Context) error {
		_, err := conn.Exec(ctx, sql, pgx.QueryExecModeSimpleProtocol)
		return err
	})
}
