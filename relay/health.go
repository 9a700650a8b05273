package relay

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Role is what a Relay is doing.
type Role string

const (
	// RoleStarting: Run has not begun, or is (re)connecting: waiting for
	// Redis at start, or for PostgreSQL after a lost session.
	RoleStarting Role = "starting"
	// RoleStandby: connected, waiting for the leader lock.
	RoleStandby Role = "standby"
	// RoleLeader: holds the leader lock and drains.
	RoleLeader Role = "leader"
	// RoleStopped: Run has returned.
	RoleStopped Role = "stopped"
)

// Status is a snapshot of a Relay's state, as Relay.Status returns it.
type Status struct {
	Role  Role
	Since time.Time // when the relay took Role

	// LastDrain is when this relay last finished a drain (all committed
	// rows pushed, or none found) without error; zero if it never did,
	// such as a standby. A leader drains at least every PollInterval.
	LastDrain time.Time

	// LastError is the last failure of a database session, of the Redis
	// PING a starting relay waits on, or of a readiness check's Redis PING,
	// "" if none; LastErrorAt is when.
	LastError   string
	LastErrorAt time.Time

	// Paused lists what backpressure pauses now (Config.MaxQueueLength,
	// Config.RedisMaxMemoryRatio), by queue; nil when nothing is. A paused
	// relay is still ready: its jobs wait in PostgreSQL.
	Paused []Paused

	// Schemas, for a relay with Config.Schemas, is every schema it has
	// found, in byte order, with its own Status; Role above is the
	// process's: RoleLeader while it leads any of them. Nil for a relay
	// of one schema.
	Schemas []SchemaRole
}

// Paused is a queue whose pushes backpressure pauses: Queue "*" and Reason
// "memory" for Redis's memory, which pauses every queue; Reason
// "queue_length" for a queue that holds Config.MaxQueueLength jobs or more.
type Paused struct {
	Queue, Reason string
}

// setPaused publishes what backpressure pauses, sorted by queue.
func (s *state) setPaused(paused map[string]string) {
	var p []Paused
	for q, reason := range paused {
		p = append(p, Paused{Queue: q, Reason: reason})
	}
	slices.SortFunc(p, func(a, b Paused) int { return strings.Compare(a.Queue, b.Queue) })
	s.mu.Lock()
	s.status.Paused = p // a new slice: a copy of Status may hold the old one
	s.mu.Unlock()
}

// state is a Relay's Status and the times its connections last answered,
// shared by Run's goroutines and the callers of Status and CheckReady.
type state struct {
	mu     sync.Mutex
	status Status
	pgOK   time.Time        // the lock connection last answered
	leader prometheus.Gauge // stagedrain_leader: 1 while Role is RoleLeader
	// waiting is why a starting relay does not go on, nil if nothing holds
	// it: Redis unreachable at start (Run waits for it before it campaigns).
	waiting error

	// The Redis PING of CheckReady, at most one every redisCheckTTL.
	redisMu   sync.Mutex
	redisAt   time.Time
	redisErr  error
	redisBusy chan struct{} // closed when the PING in flight ends; nil if none
}

// redisCheckTTL is how long CheckReady reuses a Redis PING's result, so that
// frequent probes cost Redis at most one PING a second per relay.
const redisCheckTTL = time.Second

func (s *state) init(leader prometheus.Gauge) {
	s.status = Status{Role: RoleStarting, Since: time.Now()}
	s.leader = leader
}

// setRole records a change of role; same role, no change.
func (s *state) setRole(role Role) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.status.Role != role {
		s.status.Role, s.status.Since = role, time.Now()
		if role == RoleLeader {
			s.leader.Set(1)
		} else {
			s.leader.Set(0)
		}
	}
}

// pgAnswered records that the lock connection answered just now.
func (s *state) pgAnswered() {
	s.mu.Lock()
	s.pgOK = time.Now()
	s.mu.Unlock()
}

// drained records a successful drain.
func (s *state) drained() {
	s.mu.Lock()
	s.status.LastDrain = time.Now()
	s.mu.Unlock()
}

func (s *state) failed(err error) {
	s.mu.Lock()
	s.status.LastError, s.status.LastErrorAt = err.Error(), time.Now()
	s.mu.Unlock()
}

// waitFor records why a starting relay waits (a failure, also its last
// error), or, with nil, that it waits no more.
func (s *state) waitFor(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waiting = err
	if err != nil {
		s.status.LastError, s.status.LastErrorAt = err.Error(), time.Now()
	}
}

// redisNotReady says why Redis, as described, keeps the relay from being
// ready: "redis unreachable: <redis>: <error>" when it did not answer (no
// server, a dial or a read that failed or timed out), "redis <redis>:
// <error>" when it answered with an error (LOADING, a refusal).
func redisNotReady(desc string, err error) error {
	err = redactErr(err)
	var answer redis.Error
	if errors.As(err, &answer) {
		return fmt.Errorf("redis %s: %w", desc, err)
	}
	return fmt.Errorf("redis unreachable: %s: %w", desc, err)
}

// Status returns r's state. It does no I/O, and is safe to call at any
// time, from any goroutine, also before and after Run.
func (r *Relay) Status() Status {
	r.state.mu.Lock()
	st := r.state.status
	r.state.mu.Unlock()
	if r.fleet != nil {
		st.Schemas = r.fleet.statuses()
	}
	return st
}

// CheckReady reports whether r can do its part, nil if so: it is the leader
// or a standby, its lock connection to PostgreSQL answered within the last
// max(2s, 4 x LeaderInterval) (the leader pings it every LeaderInterval/2,
// and a standby tries the lock every LeaderInterval), and Redis answers a
// PING through the configured client. The PING's result is reused for a
// second, and concurrent callers share one PING, so probes cost Redis at
// most one PING a second; it waits at most until ctx ends. Otherwise it
// returns an error wrapping ErrNotReady that says why: for a relay starting
// while Redis does not answer, "redis unreachable: <redis>: <error>", as for
// one that leads or stands by when Redis stops answering.
func (r *Relay) CheckReady(ctx context.Context) error {
	r.state.mu.Lock()
	st, pgOK, waiting := r.state.status, r.state.pgOK, r.state.waiting
	r.state.mu.Unlock()
	if st.Role == RoleStarting && waiting != nil {
		return fmt.Errorf("%w: %w", ErrNotReady, waiting)
	}
	if st.Role != RoleLeader && st.Role != RoleStandby {
		if st.LastError != "" {
			return fmt.Errorf("%w: %s (last error: %s)", ErrNotReady, st.Role, st.LastError)
		}
		return fmt.Errorf("%w: %s", ErrNotReady, st.Role)
	}
	if stale := lockQueryTimeout(r.cfg.LeaderInterval); time.Since(pgOK) > stale {
		return fmt.Errorf("%w: postgresql: lock connection silent for %s", ErrNotReady, time.Since(pgOK).Round(time.Millisecond))
	}
	if err := r.checkRedisCached(ctx); err != nil {
		return fmt.Errorf("%w: %w", ErrNotReady, redisNotReady(DescribeRedis(r.cfg.Redis), err))
	}
	return nil
}

// checkRedisCached PINGs Redis, or returns the result of a PING that ended
// less than redisCheckTTL ago, or waits for the one in flight.
func (r *Relay) checkRedisCached(ctx context.Context) error {
	s := &r.state
	for {
		s.redisMu.Lock()
		if !s.redisAt.IsZero() && time.Since(s.redisAt) < redisCheckTTL {
			err := s.redisErr
			s.redisMu.Unlock()
			return err
		}
		if busy := s.redisBusy; busy != nil {
			s.redisMu.Unlock()
			select {
			case <-busy:
				continue
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		busy := make(chan struct{})
		s.redisBusy = busy
		s.redisMu.Unlock()

		// Not cut short by this caller's ctx: others may wait for it.
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		err := r.cfg.Redis.Ping(pctx).Err()
		cancel()
		if err != nil {
			err = redactErr(err)
			s.failed(fmt.Errorf("redis ping: %w", err))
			r.metrics.errRedis.Inc()
		}
		s.redisMu.Lock()
		s.redisAt, s.redisErr, s.redisBusy = time.Now(), err, nil
		s.redisMu.Unlock()
		close(busy)
		return err
	}
}

// maxApplicationName is the most bytes of application_name PostgreSQL keeps
// (NAMEDATALEN - 1); it cuts longer names short.
const maxApplicationName = 63

// applicationName is "stagedrain <role> <host>:<pid>", which shows in
// pg_stat_activity and tells stagedrain status which process leads. A long
// host name is cut short so that the pid survives.
func applicationName(role string) string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	prefix := "stagedrain " + role + " "
	pid := ":" + strconv.Itoa(os.Getpid())
	if room := maxApplicationName - len(prefix) - len(pid); len(host) > room {
		host = host[:max(room, 0)]
	}
	return prefix + host + pid
}
