package relay

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgxlisten"
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

// listenerHeartbeat is how long the listener may go without a notification
// before the relay checks that its session still delivers them: it sends a
// heartbeat, a pg_notify on its own channel (payload heartbeatPayload), from
// the drain pool. A session can stop delivering without a word: its backend
// frozen (SIGSTOP, a stuck process) while the server's kernel still answers
// TCP, so neither keepalives nor tcp_user_timeout see anything, and
// pgxlisten's wait for a notification has no deadline. A heartbeat that
// has not come through within the lock connection's query timeout (2s by
// default) after it was sent gets the listener's socket closed: pgxlisten
// logs, reconnects and drains (HandleBacklog). A frozen listener is so
// found within about 32s, and meanwhile the fallback poll still drains.
//
// Each heartbeat is a transaction with a transaction id and a commit
// record, so it is rare, and only sent when nothing came through for that
// long: any notification, a commit's or another relay's heartbeat, proves
// the session alive. An idle relay sends one every 30s; a listener
// that keeps hearing commits sends none. (The listener before pgxlisten
// sent an empty statement on its own session after 2s quiet, which took no
// transaction id; pgxlisten holds its connection, so it cannot.)
const listenerHeartbeat = 30 * time.Second

// heartbeatPayload tells a heartbeat from a commit's notification (the
// trigger's payload is empty): it proves the session alive, and wakes no
// drain.
const heartbeatPayload = "heartbeat"

// heartbeatSQL sends a heartbeat: $1 the channel, $2 heartbeatPayload.
const heartbeatSQL = "SELECT pg_notify($1, $2)"

// listen holds a LISTEN connection until ctx ends (pgxlisten.Listener), and
// replaces it when it fails, after a capped exponential backoff (the first
// wait, after a session that did LISTEN, is the shortest). Each LISTEN,
// first or after a reconnect, is followed by a drain for what was committed
// while nobody listened (HandleBacklog). A notification only signals the
// drain, never drains: the listening connection keeps reading, so the
// NOTIFY queue never backs up. Beside it, watch sends the heartbeats
// (see listenerHeartbeat) on pool.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}, pool *pgxpool.Pool) error {
	return r.listenAll(ctx, map[string]route{ChannelName(r.cfg.Schema): {r: r, wake: wake}}, pool)
}

// route is where a channel's notifications go: the relay of its schema
// (for its counters) and that relay's drain loop.
type route struct {
	r    *Relay
	wake chan<- struct{}
	// notified, when set, takes a commit's notification instead of wake:
	// a fleet's shared drain (sharedDrainer.notify).
	notified func()
}

// listenAll is listen for many channels on one session (a relay with
// Config.Schemas): each routed to its schema's drain loop. r is the relay
// that owns the session: its config, hooks and error counter. The
// heartbeat goes to the first channel in byte order.
func (r *Relay) listenAll(ctx context.Context, routes map[string]route, pool *pgxpool.Pool) error {
	channels := slices.Sorted(maps.Keys(routes))
	l := &listener{r: r, log: r.log.Named("listener"), routes: routes, channel: channels[0],
		seen: make(chan struct{}, 1), timeout: lockQueryTimeout(r.cfg.LeaderInterval)}
	pl := &pgxlisten.Listener{
		Connect:  l.connect,
		LogError: l.logError,
		// The backoff is the relay's (see connect): pgxlisten's own wait,
		// a fixed delay (its zero value a minute), is off.
		ReconnectDelay: -1,
	}
	for _, ch := range channels {
		pl.Handle(ch, l)
	}
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { l.watch(wctx, pool) })
	err := pl.Listen(ctx)
	stop()
	wg.Wait()
	l.deafen() // nobody LISTENs for these routes now
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// listener is the relay's pgxlisten handler and what its Connect and
// LogError keep. Connect, LogError and the handler's methods run on
// pgxlisten's goroutine, watch on its own; mu guards what they share.
type listener struct {
	r       *Relay // the session's owner
	log     *zap.Logger
	routes  map[string]route // by channel
	channel string           // the heartbeat's
	timeout time.Duration    // bounds each LISTEN, and a heartbeat's arrival

	// seen gets a token for every notification and every LISTEN: the
	// session delivers. Capacity 1; sends never block.
	seen chan struct{}

	mu     sync.Mutex
	sock   net.Conn // the session's socket, from connect to logError
	live   bool     // its LISTEN completed
	closed error    // why watch closed sock, for logError

	// pgxlisten's goroutine only.
	listened bool          // the current session LISTENed on every channel
	backlogs int           // channels the current session LISTENed on
	attempt  int           // failures since the last session that LISTENed
	wait     time.Duration // before the next connect
	connects int64         // sessions that LISTENed
}

// connect is pgxlisten's Connect: after the backoff that logError chose, a
// new connection of the relay's listener config. Its socket is kept for
// watch, and has a deadline until the LISTEN completes (HandleBacklog
// lifts it): pgxlisten's LISTEN has none, and a frozen backend would hold
// it forever.
func (l *listener) connect(ctx context.Context) (*pgx.Conn, error) {
	if !sleep(ctx, l.wait) {
		return nil, ctx.Err()
	}
	l.wait = 0
	conn, err := pgx.ConnectConfig(ctx, l.r.listenerConnConfig())
	if err != nil {
		return nil, err
	}
	if l.r.hooks.listenerConnected != nil {
		l.r.hooks.listenerConnected(conn.PgConn().PID())
	}
	sock := conn.PgConn().Conn()
	if err := sock.SetDeadline(time.Now().Add(l.timeout)); err != nil {
		_ = withTimeout(ctx, time.Second, conn.Close)
		return nil, fmt.Errorf("set the LISTEN's deadline: %w", err)
	}
	l.mu.Lock()
	l.sock, l.live, l.closed = sock, false, nil
	l.mu.Unlock()
	l.listened, l.backlogs = false, 0
	return conn, nil
}

// listenerConnConfig is the listener's connection config: connConfig's,
// and tcp_user_timeout as long as keepalives take to give up (11s), unless
// the URL sets it. The server's end of a listener whose host vanished has
// notifications to send, and while they go unacknowledged Linux sends no
// keepalive probe but retransmits for about 15 minutes; meanwhile that
// backend holds the NOTIFY queue's tail (pg_notification_queue_usage).
func (r *Relay) listenerConnConfig() *pgx.ConnConfig {
	c := r.connConfig("listener")
	if c.RuntimeParams["tcp_user_timeout"] == "" {
		ka := KeepAlive()
		c.RuntimeParams["tcp_user_timeout"] = strconv.FormatInt((ka.Idle + ka.Interval*time.Duration(ka.Count)).Milliseconds(), 10)
	}
	return c
}

// logError is pgxlisten's LogError. Its errors are a session's end (the
// connect, the LISTEN or the wait for a notification failed; the handler's
// methods return none): each is logged at warn, counted, and sets the
// backoff before the next connect.
func (l *listener) logError(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return // Listen ends with ctx
	}
	l.mu.Lock()
	if l.closed != nil {
		err = fmt.Errorf("%w: %w", l.closed, err)
	}
	l.sock, l.live, l.closed = nil, false, nil
	l.mu.Unlock()
	if l.listened {
		l.attempt = 0
	}
	l.listened = false
	l.attempt++
	l.wait = backoff(l.attempt, l.r.cfg.MaxBackoff)
	l.r.metrics.errPostgres.Inc()
	l.deafen()
	l.log.Warn("listener error, reconnecting", zap.Error(err), zap.Int("attempt", l.attempt), zap.Duration("wait", l.wait))
}

// deafen marks every route's relay as not listened for, and wakes its
// drain, which then gives back its idle lock (gate.heldAwake): a commit
// that saw it idle would notify nobody. The next LISTEN undoes it
// (HandleBacklog).
func (l *listener) deafen() {
	for _, rt := range l.routes {
		if !rt.r.deaf.Swap(true) {
			trySendWakeup(rt.wake)
		}
	}
}

// HandleBacklog runs after each LISTEN: it wakes the channel's drain for
// what was committed while nobody listened. After the session's last
// channel it lifts the LISTENs' deadline and counts the session as live;
// until then each LISTEN gets l.timeout more.
func (l *listener) HandleBacklog(_ context.Context, channel string, conn *pgx.Conn) error {
	rt := l.routes[channel]
	rt.r.deaf.Store(false) // before the wake: the drain it starts may go idle
	rt.r.listens.Add(1)
	rt.r.metrics.wakeReconnect.Inc()
	trySendWakeup(rt.wake)
	if l.backlogs++; l.backlogs < len(l.routes) {
		if err := conn.PgConn().Conn().SetDeadline(time.Now().Add(l.timeout)); err != nil {
			l.log.Warn("could not extend the LISTENs' deadline", zap.Error(err))
		}
		return nil
	}
	if err := conn.PgConn().Conn().SetDeadline(time.Time{}); err != nil {
		// The connection is unusable; the wait that follows fails.
		l.log.Warn("could not lift the LISTEN's deadline", zap.Error(err))
	}
	l.mu.Lock()
	l.live = true
	l.mu.Unlock()
	l.listened = true
	if l.r != rt.r {
		l.r.listens.Add(1)
	}
	channel = l.channel
	var extra []zap.Field
	if len(l.routes) > 1 {
		channel, extra = "", []zap.Field{zap.Int("channels", len(l.routes))}
	}
	if l.connects++; l.connects == 1 {
		l.log.Info("listening", append(extra, zap.String("channel", channel))...)
	} else {
		l.log.Info("listener reconnected", append(extra, zap.String("channel", channel), zap.Int64("reconnects", l.connects-1))...)
	}
	trySendWakeup(l.seen)
	return nil
}

// HandleNotification only signals: watch that the session delivers, and,
// for a commit's notification, the channel's drain.
func (l *listener) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	trySendWakeup(l.seen)
	if n.Payload != heartbeatPayload {
		if f := l.r.fleet; f != nil {
			f.noted.Add(1)
		}
		rt := l.routes[n.Channel]
		rt.r.metrics.wakeNotify.Inc()
		if rt.notified != nil {
			rt.notified()
		} else {
			trySendWakeup(rt.wake)
		}
	}
	return nil
}

// watch sends a heartbeat after the relay's heartbeat period without a
// notification or a LISTEN, while a session listens, and closes that
// session's socket when the heartbeat has not come through within
// l.timeout of being sent. It returns when ctx ends.
func (l *listener) watch(ctx context.Context, pool *pgxpool.Pool) {
	every := l.r.listenerHeartbeat
	quiet := time.NewTimer(every)
	defer quiet.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.seen:
			quiet.Reset(every)
			continue
		case <-quiet.C:
		}
		quiet.Reset(every)
		l.mu.Lock()
		sock := l.sock
		if !l.live {
			sock = nil
		}
		l.mu.Unlock()
		if sock == nil {
			continue // no session listens: its LISTEN, when it comes, signals seen
		}
		if err := l.heartbeat(ctx, pool); err != nil {
			if ctx.Err() == nil {
				// Not the listener's failure: the drain pool's sessions
				// were busy (a batch's push to a slow Redis) or failed,
				// which the drain reports. The next quiet period tries
				// again.
				l.log.Debug("could not send the listener's heartbeat", zap.Error(err))
			}
			continue
		}
		arrival := time.NewTimer(l.timeout)
		select {
		case <-ctx.Done():
			arrival.Stop()
			return
		case <-l.seen:
			arrival.Stop()
			quiet.Reset(every)
			continue
		case <-arrival.C:
		}
		l.mu.Lock()
		if l.sock == sock {
			l.closed = fmt.Errorf("no heartbeat came through within %s of being sent, after %s without a notification: closed the connection", l.timeout, every)
			_ = sock.Close()
		}
		l.mu.Unlock()
		quiet.Reset(every)
	}
}

// heartbeat notifies the relay's channel from pool, within l.timeout.
func (l *listener) heartbeat(ctx context.Context, pool *pgxpool.Pool) error {
	err := withDeadline(ctx, l.timeout, func(ctx context.Context) error {
		_, err := pool.Exec(ctx, heartbeatSQL, l.channel, heartbeatPayload)
		return err
	})
	if err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	return nil
}

var _ pgxlisten.BacklogHandler = (*listener)(nil)
