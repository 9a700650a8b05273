package relay

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
	"github.com/prometheus/client_golang/prometheus"
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

// wakeHandler is the listener's handler: it only signals, never drains, so
// the listening connection keeps reading and the NOTIFY queue never backs up.
type wakeHandler struct {
	wake     chan<- struct{}
	log      *zap.Logger
	connects atomic.Int64  // LISTENs that succeeded
	failures atomic.Int64  // connect attempts failed in a row
	listens  *atomic.Int64 // the Relay's count of LISTENs, for testHooks.idle
	channel  string

	notifies, reconnects prometheus.Counter // wake-ups by cause
}

func (h *wakeHandler) HandleNotification(context.Context, *pgconn.Notification, *pgx.Conn) error {
	h.notifies.Inc()
	trySendWakeup(h.wake)
	return nil
}

// HandleBacklog runs after every LISTEN, first or after a reconnect: what was
// committed while nobody listened is drained now.
func (h *wakeHandler) HandleBacklog(context.Context, string, *pgx.Conn) error {
	h.failures.Store(0)
	h.listens.Add(1)
	if n := h.connects.Add(1); n == 1 {
		h.log.Info("listening", zap.String("channel", h.channel))
	} else {
		h.log.Info("listener reconnected", zap.String("channel", h.channel), zap.Int64("reconnects", n-1))
	}
	h.reconnects.Inc()
	trySendWakeup(h.wake)
	return nil
}

// listen runs pgxlisten until ctx ends. Connection failures are retried with
// capped exponential backoff; pgxlisten's own one-minute default delay is
// replaced by the shortest step of that backoff.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) error {
	log := r.log.Named("listener")
	h := &wakeHandler{wake: wake, log: log, listens: &r.listens, channel: ChannelName(r.cfg.Schema),
		notifies: r.metrics.wakeNotify, reconnects: r.metrics.wakeReconnect}
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			if n := h.failures.Load(); n > 0 && !sleep(ctx, backoff(int(n), r.cfg.MaxBackoff)) {
				return nil, ctx.Err()
			}
			conn, err := pgx.ConnectConfig(ctx, r.connConfig("listener"))
			if err != nil {
				h.failures.Add(1)
				return nil, err
			}
			return conn, nil
		},
		LogError: func(ctx context.Context, err error) {
			if ctx.Err() != nil {
				return // shutting down
			}
			r.metrics.errPostgres.Inc()
			log.Warn("listener error, reconnecting", zap.Error(err), zap.Int64("attempt", h.failures.Load()))
		},
		ReconnectDelay: minBackoff,
	}
	l.Handle(h.channel, h)
	err := l.Listen(ctx)
	if ctx.Err() != nil {
		return nil
	}
	return err
}
