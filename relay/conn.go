package relay

import (
	"context"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// How the relay's PostgreSQL sessions notice that the other end is gone,
// and how soon. A relay that dies closes its connections, and PostgreSQL
// releases what they held at once; one that is frozen (SIGSTOP, a long VM
// pause) or whose host vanishes closes nothing, so each session kind has a
// bound of its own:
//
//   - Every connection keeps TCP alive from both ends: the relay's socket
//     probes after KeepAlive's Idle of silence (a vanished PostgreSQL host is
//     found within about 11s), and the server's socket does the same
//     (tcp_keepalives_*, unless the URL sets them), which frees the sessions
//     of a vanished relay host. A connect gives up after connectTimeout
//     unless the URL sets connect_timeout.
//   - The lock connection ("leader", leader.go) has idle_session_timeout
//     lockIdleTimeout: a leader that stops pinging it loses the session, and
//     with it every leader lock and gate lock it holds, so a standby takes
//     over. A lead that ends while the session lives on (a fleet's, which
//     lets a schema go or steps down from one and keeps the others) gives
//     back its gate locks and then its leader lock itself (leadWith,
//     fleetSession.after): the session's end is not what releases them.
//   - The drain pool's sessions ("drain") have
//     idle_in_transaction_session_timeout drainIdleInTx: a batch claimed by
//     a relay that then froze is rolled back, and its rows can be claimed
//     again.
//   - The listener (listen.go, a pgxlisten.Listener) has tcp_user_timeout
//     too, and its LISTEN a deadline; after listenerHeartbeat (30s)
//     without a notification the relay sends it a heartbeat NOTIFY from
//     the drain pool, and closes its socket when that does not arrive
//     within lockQueryTimeout (a frozen backend that still answers TCP).

const (
	// connectTimeout bounds a connect (TCP, TLS, authentication) unless the
	// URL sets connect_timeout.
	connectTimeout = 10 * time.Second

	// drainIdleInTx is the drain sessions' idle_in_transaction_session_timeout.
	// A batch's transaction is idle while its jobs are pushed to Redis (or,
	// for the batch claimed ahead, while the one before it is pushed and
	// committed): milliseconds normally, and at most about 21s for a push
	// that go-redis gives up on (two tries, each a 5s dial and a 5s read,
	// as stagedrain run configures it), so 30s ends only a batch whose
	// relay is gone or frozen. Its rows can then be claimed again; a push
	// that did reach Redis before is repeated with the same jids.
	drainIdleInTx = 30 * time.Second
)

// KeepAlive is the TCP keepalive policy of every connection the relay
// opens to PostgreSQL: probe after 5s of silence, then every 2s, and give
// up after 3 probes unanswered, so a peer that vanished is found within
// about 11s. stagedrain run dials Redis with it too.
func KeepAlive() net.KeepAliveConfig {
	return net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3}
}

// lockIdleTimeout is the lock connection's idle_session_timeout: 2.5 x
// LeaderInterval (1.25s by default), at least 1s. The leader pings the
// connection every LeaderInterval/2, jittered by up to 25% (at most 312ms
// by default), and a standby tries for the lock every LeaderInterval
// (at most 625ms), so a healthy relay leaves it idle for at most half the
// timeout and has the rest (about 0.9s) as slack for a slow scheduler. A
// frozen leader loses the lock within lockIdleTimeout of its last ping,
// and a standby takes it within another 1.25 x LeaderInterval: 1.9s at
// most by default.
func lockIdleTimeout(leaderInterval time.Duration) time.Duration {
	return max(leaderInterval*5/2, time.Second)
}

// lockQueryTimeout bounds every statement on the lock connection: a ping,
// a try for the lock, the gate's locks, the schema version check. One that
// takes longer means the connection (or the server) is stuck: the leader
// steps down.
func lockQueryTimeout(leaderInterval time.Duration) time.Duration {
	return max(2*time.Second, 4*leaderInterval)
}

// connConfig is a copy of the database config for one role: named so a DBA
// (and stagedrain status) can tell our sessions apart in pg_stat_activity,
// unless the URL names them already ("stagedrain <role> <host>:<pid>"), and
// with keepalives and a connect timeout (see above).
func (r *Relay) connConfig(role string) *pgx.ConnConfig {
	c := r.pgCfg.Copy()
	if c.RuntimeParams["application_name"] == "" {
		c.RuntimeParams["application_name"] = applicationName(role)
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = connectTimeout
	}
	ka := KeepAlive()
	c.DialFunc = (&net.Dialer{Timeout: c.ConnectTimeout, KeepAliveConfig: ka}).DialContext
	for name, v := range map[string]int{
		"tcp_keepalives_idle":     int(ka.Idle / time.Second),
		"tcp_keepalives_interval": int(ka.Interval / time.Second),
		"tcp_keepalives_count":    ka.Count,
	} {
		if c.RuntimeParams[name] == "" {
			c.RuntimeParams[name] = strconv.Itoa(v)
		}
	}
	return c
}

// millis is d as a PostgreSQL time setting in milliseconds.
func millis(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }

// poolCloseWait bounds how long closing a pool waits for its connections.
//
// pgxpool's Close waits until every connection has closed, and pgx (since
// v5.12) closes a connection whose statement was interrupted (the relay
// stopping mid-statement, a statement's own timeout) by sending Terminate
// and reading until the server hangs up, for up to 15s. The server never
// hangs up when it is stalled, or when the Terminate could not be sent: a
// TLS connection whose write was interrupted by the statement's deadline
// refuses every write after (crypto/tls), and the backend waits for the
// next message. Seen: a relay on sslmode=prefer, stopped beside the app's
// full write load, took 15s to exit after SIGTERM. Past poolCloseWait the
// relay goes on without those connections: their goroutines end within
// the 15s, or with the process, and PostgreSQL ends a backend whose
// client is gone (a transaction it held is rolled back, as after a
// crash, which the relay is built to survive).
const poolCloseWait = 2 * time.Second

// closePool closes pool, waiting for its connections at most
// poolCloseWait (logged at warn past it).
func closePool(log *zap.Logger, name string, pool *pgxpool.Pool) {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		pool.Close()
	}()
	t := time.NewTimer(poolCloseWait)
	defer t.Stop()
	select {
	case <-closed:
	case <-t.C:
		log.Warn("a connection of the "+name+" pool is still closing: not waiting for it",
			zap.Duration("waited", poolCloseWait))
	}
}

// cancelOnServer marks ctx: a statement of the drain pools whose context
// ends is cancelled by PostgreSQL (a cancel request), and its session
// stays; see drainWatcher.
func cancelOnServer(ctx context.Context) context.Context {
	return context.WithValue(ctx, cancelOnServerKey{}, true)
}

type cancelOnServerKey struct{}

// cancelDeadlineDelay is how long a statement cancelled on the server
// may take to end before its socket is cut after all (a server that does
// not answer). Within a fleet poll's budget: pollTimeout plus this, plus
// the 100ms pgx waits after a cancel request, stays under the lock
// connection's idle_session_timeout less a keepalive's interval.
const cancelDeadlineDelay = 200 * time.Millisecond

// drainWatcher is how a drain pool's connection stops a statement whose
// context ended. pgx's default cuts the socket (a deadline), which ends
// the session: the pool dials a new one, whose statement cache starts
// empty. That is what a drain wants: a claim whose context ended is
// abandoned, its transaction rolled back with the session.
//
// A fleet's poll is one statement over every schema it leads, prepared
// once (fleetSession.poll). Beside an app at full speed, polls over 200
// schemas timed out (pollTimeout) every ~450 ms: each timed-out poll took
// its session with it, the next one planned the union again on a new
// session, past the timeout again, and each failure woke every schema's
// own drain (issue 23). A context marked by cancelOnServer is stopped by a
// cancel request instead: PostgreSQL ends the statement, and the session
// and its prepared statements stay. If the server does not answer, the
// socket is cut cancelDeadlineDelay later, as before.
type drainWatcher struct {
	deadline pgconn.DeadlineContextWatcherHandler
	cancel   pgconn.CancelRequestContextWatcherHandler
	onServer bool // the statement being stopped was cancelled on the server
}

func newDrainWatcher(c *pgconn.PgConn) ctxwatch.Handler {
	return &drainWatcher{
		deadline: pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()},
		cancel:   pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: cancelDeadlineDelay},
	}
}

func (w *drainWatcher) HandleCancel(ctx context.Context) {
	w.onServer = ctx.Value(cancelOnServerKey{}) != nil
	if w.onServer {
		w.cancel.HandleCancel(ctx)
		return
	}
	w.deadline.HandleCancel(ctx)
}

func (w *drainWatcher) HandleUnwatchAfterCancel() {
	if w.onServer {
		w.cancel.HandleUnwatchAfterCancel()
		return
	}
	w.deadline.HandleUnwatchAfterCancel()
}
