package relay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
)

// A relay with Config.Schemas drains many schemas from one process: a
// fleet. Each schema it finds gets a Relay of its own (a tenant), with the
// schema's leader lock, fence and handoff record, wake gate, dead letters,
// source and metrics, exactly as a relay of that one schema. What they
// share is the process's connections:
//
//   - one lock connection, which holds every leader lock the process has
//     and the gate locks of each schema it leads while that one is idle
//     (each lead gives its gate locks back when it ends: the connection
//     stays open); the count of the fleet's members every
//     LeaderInterval/2 is its keepalive (as keepLock's ping is a single
//     relay's): if it fails, every schema it led is let go at once, as
//     PostgreSQL releases its locks;
//   - one listener, LISTENing on every schema's channel;
//   - one drain pool of fleetDrainConns connections, from which each
//     leading schema claims and commits its batches (at most two at a time,
//     one pushed while the next is claimed), so a schema with a long
//     backlog holds at most two and the others' claims wait for at most
//     one batch;
//   - one fallback poll: statements of 16 schemas each (pollChunk), in one
//     round trip, that ask which led schemas have rows staged, and wake only
//     those;
//   - while the fleet runs hot (fleethot.go), one shared drain: the schemas
//     a hot poll finds are claimed, pushed and committed together, in one
//     transaction (fleetdrain.go), on a session of its own
//     (sharedDrainPool), closed once the fleet has been cool a minute.
//
// Relays with the same Schemas and Queues are members of one fleet: each
// holds a shared advisory lock on the fleet's name, and counts the
// members in pg_locks every LeaderInterval. Each leads at most its share,
// ceil(schemas / members): one that leads more lets the rest go (it
// finishes their batches in flight and unlocks them), and one that leads
// fewer tries the locks of the schemas nobody leads, in one statement. So
// a second process takes half the schemas within a few LeaderIntervals of
// starting, and when one dies the others take its share as soon as its
// lock connection closes (at most 2.5 LeaderIntervals for a frozen one).

// fleetDrainConns is the size of the drain pool that a fleet's schemas
// share.
const fleetDrainConns = 4

// sharedDrainIdle is how long the shared drain's session stays open
// unused (sharedDrainPool): a fleet that has cooled closes it within
// about a minute more (pgxpool's health check runs every minute).
const sharedDrainIdle = time.Minute

// sharedLockTimeout bounds each lock wait of the shared drain's session
// (sharedDrainPool): a shared drain takes milliseconds.
const sharedLockTimeout = 200 * time.Millisecond

// sharedDrainPool is the session of the fleet's shared drain
// (fleetdrain.go), apart from the drain pool's: its statements are two per
// schema (its claim and its read for the low-water mark), and a schema's
// own drain uses two others (its claim, its probe). Over 200 schemas the
// four did not fit pgx's cache of 512 prepared statements per session:
// after a hot phase, every cool claim prepared its statement again until
// the hot ones aged out (p99 6.9-13.3 ms at 100-1,000 jobs/s, against 1.4
// ms for a fleet that had not run hot). It is connected at the first
// shared drain (a hot poll's finds, or a notified schema's), and closed
// once it has been idle for sharedDrainIdle, so a fleet holds one more
// connection only while its commits come, or just after.
func sharedDrainPool(ctx context.Context, drain *pgxpool.Pool) (*pgxpool.Pool, error) {
	cfg := drain.Config()
	cfg.MaxConns, cfg.MinConns = 1, 0
	cfg.MaxConnIdleTime = sharedDrainIdle
	// A lock one schema's table is under (the app's ALTER TABLE or CREATE
	// INDEX on one tenant, a migration) would hold every other schema's
	// batch of a shared drain, and every shared drain after it, until
	// released: past sharedLockTimeout the shared drain fails, and each of
	// its schemas drains on its own, that one's drain alone waiting for
	// the lock (the drain pool has no lock_timeout). For the session, not
	// the transaction: pgx prepares a statement it has not cached (each
	// schema's claim, at its first shared drain) before the batch's BEGIN,
	// and the prepare takes the table's lock too.
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = millis(sharedLockTimeout)
	pool, err := pgxpool.NewWithConfig(ctx, cfg) // connects lazily
	if err != nil {
		return nil, fmt.Errorf("shared drain pool: %w", err)
	}
	return pool, nil
}

type fleet struct {
	r     *Relay // the process's: its config, logger, state and counters
	table string // the source's table, which a schema must hold

	mu      sync.Mutex // guards tenants for Status and the metrics
	tenants map[string]*tenant

	// hot is true while the fleet runs hot: it holds every schema it
	// leads awake and polls them all at once (fleetHot). noted counts the
	// commits' notifications, and found the jobs the schemas' drains find,
	// for the session loop to decide.
	hot   atomic.Bool
	noted atomic.Int64
	found atomic.Int64
	// The thresholds, hotEnter, hotWaitFrom, hotAlways and hotLeave
	// (tests change them).
	hotEnter, hotWaitFrom, hotAlways, hotLeave float64
	hotProbe                                   time.Duration

	// The shared drains' counters (fleetdrain.go), and the heat's
	// (fleethot.go), of the process.
	sharedCommits, sharedBatches prometheus.Counter
	hotGauge                     prometheus.Gauge
	hotEntries                   *prometheus.CounterVec
	// sharedWAL is the shared drains' last full read of the WAL positions
	// (walFresh); their goroutine's only.
	sharedWAL walCache

	memberKey string // the fleet's lock name (fleetLockName)
	system    string // PostgreSQL's system_identifier, for every fence
	missing   map[string]bool
}

// tenant is one schema of a fleet.
type tenant struct {
	schema string
	r      *Relay
	wake   chan struct{}

	// The session loop's alone.
	leading  bool
	joined   bool // took its group locks on this session's lock connection
	cancel   context.CancelFunc
	done     chan struct{} // closed when its lead has returned
	err      error         // lead's, once done
	released bool          // let go on purpose: balance, or the schema went away
	gone     bool          // the schema no longer holds the table
	attempt  int           // failures in a row
	retryAt  time.Time
}

// fleetLockName names a fleet: its members have the same Schemas and
// group.
func fleetLockName(items []string, group string) string {
	return "stagedrain-fleet:" + strings.Join(slices.Sorted(slices.Values(items)), ",") + ":queues=" + group
}

const (
	// memberLockSQL joins the fleet named $1 (a one-key lock, taken
	// shared: it never waits).
	memberLockSQL = `SELECT pg_advisory_lock_shared(` + lockKeySQL + `)`
	// membersSQL counts the fleet's members. A one-key advisory lock
	// shows in pg_locks as classid (high half) and objid (low half) with
	// objsubid 1.
	membersSQL = `WITH k AS (SELECT ` + lockKeySQL + ` AS key)
		SELECT count(*) FROM pg_locks l, k
		WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ShareLock'
			AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND l.classid::bigint = (k.key >> 32) & 4294967295 AND l.objid::bigint = k.key & 4294967295`
	// tryLocksSQL tries the leader locks $1 in order and stops after
	// taking $2 of them (the scan under LIMIT stops pulling rows); it
	// returns the names it took.
	tryLocksSQL = `SELECT k FROM unnest($1::text[]) WITH ORDINALITY AS t(k, i)
		WHERE pg_try_advisory_lock(hashtextextended(k, 0)) LIMIT $2`
)

// newFleet returns the Relay of a fleet for cfg (New, for a cfg with
// Schemas). Each schema it finds gets a Relay from newRelay, with the
// fleet's settings (tenantSettings).
func newFleet(cfg Config) (*Relay, error) {
	r, _, err := newBase(cfg, defaultSettings())
	if err != nil {
		return nil, err
	}
	cfg = r.cfg
	// The process's own counters: the Redis PING at start, the lock
	// session and the listener. Served without a schema label.
	r.metrics = newMetrics(string(cfg.Target), "", "", &r.backlog, &r.summary.mu)
	r.metrics.reg = prometheus.NewRegistry()
	r.metrics.reg.MustRegister(r.metrics.errs, r.metrics.horizonAge)
	r.state.init(prometheus.NewGauge(prometheus.GaugeOpts{Name: "unused"}))
	f := &fleet{r: r, tenants: map[string]*tenant{}, missing: map[string]bool{},
		memberKey: fleetLockName(cfg.Schemas, r.group), table: "staged_jobs",
		hotEnter: hotEnter, hotWaitFrom: hotWaitFrom, hotAlways: hotAlways, hotLeave: hotLeave, hotProbe: hotProbe}
	if cfg.Source == SourceSidekiqStagedPush {
		f.table = "sidekiq_staged_push_jobs"
	}
	f.sharedCommits = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "stagedrain_fleet_shared_commits_total",
		Help: "Transactions of a hot fleet that drained the batches of several schemas together (one claim round trip, one commit).",
	})
	f.sharedBatches = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "stagedrain_fleet_shared_batches_total",
		Help: "Schemas' batches drained by those transactions, one per schema with rows.",
	})
	f.hotGauge = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "stagedrain_fleet_hot",
		Help: "1 while the fleet runs hot (polls its schemas; no commit notifies), else 0.",
	})
	f.hotEntries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "stagedrain_fleet_hot_entries_total",
		Help: "Times the fleet went hot, by why: rate (its commits' rate alone) or waits (commits queued for the notify lock).",
	}, []string{"reason"})
	r.metrics.reg.MustRegister(f.sharedCommits, f.sharedBatches, f.hotGauge, f.hotEntries)
	r.fleet = f
	return r, nil
}

// tenantConfig is the config of a fleet's Relay for schema.
func (f *fleet) tenantConfig(schema string) Config {
	c := f.r.cfg
	c.Schemas, c.Schema = nil, schema
	c.Logger = f.r.log.With(zap.String("schema", schema))
	return c
}

// tenantSettings are the settings of a fleet's Relays: the fleet's own
// (which tests may have changed before Run), and its heat.
func (f *fleet) tenantSettings() settings {
	s := f.r.settings
	s.hot, s.found = &f.hot, &f.found
	return s
}

// session connects the lock connection and runs the fleet on it until ctx
// ends or it fails: it finds the schemas, leads its share of them, and
// lets them all go before it returns.
func (f *fleet) session(ctx context.Context, pool *pgxpool.Pool) (connected time.Time, err error) {
	r := f.r
	conn, ended, connected, err := r.openLockConn(ctx)
	if err != nil {
		return connected, err
	}
	defer func() { _ = withTimeout(ctx, time.Second, conn.Close) }()
	defer func() { err = explainEnded(err, ended) }()

	var mu sync.Mutex // guards conn
	if err := readSystem(ctx, conn, &f.system); err != nil {
		return connected, err
	}
	if _, err := conn.Exec(ctx, memberLockSQL, f.memberKey); err != nil {
		return connected, fmt.Errorf("join the fleet: %w", err)
	}
	var seesWaits bool
	if err := conn.QueryRow(ctx, seesWaitsSQL).Scan(&seesWaits); err != nil {
		return connected, fmt.Errorf("read the role's privileges: %w", err)
	}
	s := &fleetSession{f: f, conn: conn, mu: &mu, pool: pool, seesWaits: seesWaits, lockTimeout: pollLockTimeout,
		ended: make(chan *tenant), stop: make(chan struct{}),
		late: lateCommits{window: r.cfg.PollInterval}}
	defer s.drops.Wait()
	defer s.late.stop()
	defer s.letAllGo()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if !r.cfg.PollOnly { // a poll-only fleet neither runs hot nor is notified: no shared drain
		shared, err := sharedDrainPool(sctx, pool)
		if err != nil {
			return connected, err
		}
		defer closePool(r.log, "shared drain", shared)
		s.drainer = f.startSharedDrainer(sctx, shared)
		defer func() { cancel(); s.drainer.wait() }()
	}
	for _, t := range f.tenants {
		t.joined = false
	}
	r.state.setRole(RoleStandby)

	if err := s.discover(sctx); err != nil {
		return connected, err
	}
	discover := time.NewTimer(jitter(r.cfg.PollInterval))
	defer discover.Stop()
	balance := time.NewTimer(0)
	defer balance.Stop()
	polls := time.NewTimer(jitter(r.cfg.PollInterval))
	defer polls.Stop()
	heat := fleetHeat{probeFirst: f.hotProbe}
	heatC := heat.start(r.cfg.PollOnly)
	defer heat.stop()
	defer s.cool() // the fleet's schemas are let go (letAllGo) as it ends
	for {
		select {
		case <-heatC:
			s.weigh(sctx, &heat)
			continue
		case <-s.late.C():
			s.checkLate(sctx)
			continue
		case <-heat.pollC():
			led := s.led()
			found, err := s.poll(sctx, led, true)
			heat.polled(found, err)
			heat.pollAgain(len(led))
			if tableGone(err) {
				discover.Reset(0) // see tableGone
			}
			continue
		case <-ctx.Done():
			return connected, ctx.Err()
		case t := <-s.ended:
			if err := s.after(sctx, t); err != nil {
				return connected, err
			}
		case <-discover.C:
			if err := s.discover(sctx); err != nil {
				return connected, err
			}
			discover.Reset(jitter(r.cfg.PollInterval))
		case <-balance.C:
			if err := s.balance(sctx); err != nil {
				return connected, err
			}
			// Also the lock connection's keepalive: at keepLock's pace,
			// so that idle_session_timeout never ends it.
			balance.Reset(jitter(r.cfg.LeaderInterval / 2))
		case <-polls.C:
			if _, err := s.poll(sctx, fallbackPolled(s.led(), heat.hot), false); tableGone(err) {
				discover.Reset(0)
			}
			polls.Reset(jitter(r.cfg.PollInterval))
		}
	}
}

// tableGone reports whether err, a poll's, says a table or schema it read
// no longer exists (dropped since the last discover). The poll is one
// statement over every schema led, so it fails for all of them until
// discover leaves that schema out: the session discovers at once rather
// than at its next turn, a poll interval away.
func tableGone(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000")
}

// pollTimeout bounds a fleet poll: a third of the lock connection's
// idle_session_timeout (lockIdleTimeout, 417ms by default). The poll runs
// in the fleet session's loop, which also keeps that connection alive
// (balance, every LeaderInterval/2, jittered): a poll that waited longer
// than the timeout less a ping's interval let PostgreSQL end the
// connection, and with it every schema's lead. A poll waits that long
// for a lock on one tenant's table (the app's ALTER TABLE, a CREATE INDEX
// that is not CONCURRENTLY, LOCK TABLE); it waited up to
// lockQueryTimeout (2s). A poll cut short wakes every schema it was for,
// as a failed one does, and the next comes at the next interval.
func pollTimeout(leaderInterval time.Duration) time.Duration {
	return lockIdleTimeout(leaderInterval) / 3
}

// fallbackPolled are the schemas of led that the fallback poll looks at:
// all of them while the fleet is cool; while it runs hot, those the hot
// poll leaves out (backpressure holds them back). The hot poll looks at the
// others every few milliseconds and hands those with rows to the shared
// drain, and a fallback poll would wake each of their own drains too: over
// 200 schemas at 2,600 jobs/s, about 130 claims a second that the shared
// drains would have made.
func fallbackPolled(led []*tenant, hot bool) []*tenant {
	if !hot {
		return led
	}
	return slices.DeleteFunc(led, func(t *tenant) bool { return !t.r.heldBack.Load() })
}

// fleetSession is one lock connection's run of a fleet.
type fleetSession struct {
	f    *fleet
	conn *pgx.Conn
	mu   *sync.Mutex
	pool *pgxpool.Pool

	ended chan *tenant  // a tenant's lead returned
	stop  chan struct{} // closed when the session ends: no more ended sends

	listenStop context.CancelFunc
	listenDone chan struct{}

	// drainer drains together the schemas a hot poll finds (nil with
	// PollOnly).
	drainer *sharedDrainer

	// pollFor, pollSQL and hotPollSQL: the poll's statements for the
	// schemas pollFor, cool and hot (session loop only).
	pollFor    []*tenant
	pollSQL    []string
	hotPollSQL []string

	// seesWaits is true when the role sees other roles' wait events: the
	// fleet then runs hot between hotEnter and hotAlways commits a second
	// only while commits wait for the notify lock (fleethot.go).
	seesWaits bool

	// late are the transactions in progress when the fleet cooled
	// (coolDown; session loop only).
	late lateCommits

	// lockTimeout bounds a poll's wait for a table's lock (0: none), and
	// lockedOut are the schemas the polls leave out, and when to look
	// again whether their table is still locked (pollLockTimeout; session
	// loop only).
	lockTimeout time.Duration
	lockedOut   map[*tenant]time.Time

	// hotWokeAll is when a failed hot poll last woke every schema it
	// asked about (poll; session loop only).
	hotWokeAll time.Time

	// drops are the deletes of gone schemas' handoff records in flight
	// (forget); the session waits for them before it returns.
	drops sync.WaitGroup
}

// exec runs f on the lock connection, under its mutex, within the lock
// connection's query timeout.
func (s *fleetSession) exec(ctx context.Context, f func(ctx context.Context, conn *pgx.Conn) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return withDeadline(ctx, lockQueryTimeout(s.f.r.cfg.LeaderInterval), func(ctx context.Context) error {
		return f(ctx, s.conn)
	})
}

// discover lists the schemas; new ones become tenants (not yet led), and
// the tenants of schemas gone are let go. The listener follows the set.
func (s *fleetSession) discover(ctx context.Context) error {
	f, r := s.f, s.f.r
	var found []string
	err := s.exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		var err error
		found, err = listSchemas(ctx, conn, r.cfg.Schemas, f.table)
		return err
	})
	if err != nil {
		return err
	}
	r.state.pgAnswered()
	for _, name := range schemaNames(r.cfg.Schemas) {
		_, ok := slices.BinarySearch(found, name)
		if !ok && !f.missing[name] {
			r.log.Warn("a schema named by Schemas has no table to drain yet: waiting for it (stagedrain migrate --schemas)",
				zap.String("schema", name), zap.String("table", f.table))
		}
		f.missing[name] = !ok
	}
	// A pattern that matches nothing yet (a typo, or no tenant migrated)
	// would leave the relay silent after "starting": say so once, until it
	// matches. f.missing holds patterns too: a name has no '*'.
	for _, pattern := range r.cfg.Schemas {
		if !isSchemaPattern(pattern) {
			continue
		}
		ok := slices.ContainsFunc(found, func(s string) bool { return matchSchemaPattern(pattern, s) })
		if !ok && !f.missing[pattern] {
			r.log.Warn("no schema matches a pattern of Schemas yet: waiting for one (stagedrain migrate --schemas)",
				zap.String("pattern", pattern), zap.String("table", f.table))
		}
		f.missing[pattern] = !ok
	}
	changed := false
	for _, name := range found {
		if f.tenants[name] != nil {
			continue
		}
		c, err := newRelay(f.tenantConfig(name), f.tenantSettings(), &tenancy{system: f.system})
		if err != nil {
			return fmt.Errorf("schema %q: %w", name, err)
		}
		c.hooks.markConfirm = r.hooks.markConfirm
		c.hooks.probeEvery, c.hooks.probeTurn = r.hooks.probeEvery, r.hooks.probeTurn
		f.mu.Lock()
		f.tenants[name] = &tenant{schema: name, r: c, wake: make(chan struct{}, 1)}
		f.mu.Unlock()
		r.log.Info("schema found", zap.String("schema", name))
		changed = true
	}
	for name, t := range f.tenants {
		if _, ok := slices.BinarySearch(found, name); ok || t.gone {
			continue
		}
		t.gone, changed = true, true
		if t.leading {
			t.released = true
			t.cancel()
			continue // forgotten once its lead has returned (after)
		}
		s.forget(t)
	}
	if changed {
		s.relisten(ctx)
	}
	return nil
}

// forget drops a tenant whose schema is gone, which the session does not
// lead, with its fence and handoff record when its last lead left them
// settled (dropHandoff).
func (s *fleetSession) forget(t *tenant) {
	f := s.f
	// Not on the session's loop: the delete waits for Redis (up to 2s
	// when it hangs), and the loop keeps the lock connection alive, whose
	// idle_session_timeout is 2.5 leader intervals (417ms by default):
	// waiting there, the fleet lost every schema's lead when Redis hung
	// as a tenant's schema was dropped (TestFleetSchemaGoneWhileRedisHangs).
	// The tenant is no one else's once forgotten: a schema created again
	// under its name is a new tenant, with a handoff of its own, and the
	// delete takes the fence only while it still holds this one's token.
	s.drops.Go(func() { s.dropHandoff(t) })
	f.mu.Lock()
	delete(f.tenants, t.schema)
	f.mu.Unlock()
	t.r.state.setRole(RoleStopped)
	f.r.log.Info("schema gone: let go", zap.String("schema", t.schema), zap.String("table", f.table))
}

// dropHandoff deletes the fence and handoff record of t, whose schema is
// gone and which the session does not lead, when its last lead in this
// process left nothing unsettled in the record and no relay took the fence
// since (handoff.drop): else they stay in Redis, as a relay of the schema
// would need them. That lead may have ended before the schema was seen
// gone: its drains failed on the missing table.
func (s *fleetSession) dropHandoff(t *tenant) {
	var dropped bool
	err := withTimeout(context.Background(), 2*time.Second, func(ctx context.Context) error {
		var err error
		dropped, err = t.r.handoff.Drop(ctx)
		return err
	})
	switch {
	case err != nil:
		t.r.log.Warn("could not delete the handoff record of a schema gone", zap.Error(redactErr(err)))
	case dropped:
		t.r.log.Info("deleted the handoff record of a schema gone")
	}
}

// forgetAll drops every tenant, when Run returns.
func (f *fleet) forgetAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, t := range f.tenants {
		t.r.state.setRole(RoleStopped)
	}
}

// relisten replaces the listener with one for the current schemas (none
// with PollOnly, or while no schema is found). Its first LISTEN wakes
// every schema led, which drains what came in between.
func (s *fleetSession) relisten(ctx context.Context) {
	s.stopListening()
	f := s.f
	if f.r.cfg.PollOnly {
		return
	}
	routes := map[string]route{}
	for name, t := range f.tenants {
		if !t.gone {
			rt := route{r: t.r, wake: t.wake}
			if d := s.drainer; d != nil {
				rt.notified = func() { d.notify(t) }
			}
			routes[ChannelName(name)] = rt
		}
	}
	if len(routes) == 0 {
		return
	}
	lctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	s.listenStop, s.listenDone = cancel, done
	go func() {
		defer close(done)
		_ = f.r.listenAll(lctx, routes, s.pool)
	}()
}

func (s *fleetSession) stopListening() {
	if s.listenStop != nil {
		s.listenStop()
		<-s.listenDone
		s.listenStop, s.listenDone = nil, nil
	}
}

// balance counts the fleet's members (which keeps the lock connection from
// going idle), lets go of the schemas led past this
// process's share, and tries for the schemas nobody leads, up to it.
func (s *fleetSession) balance(ctx context.Context) error {
	f, r := s.f, s.f.r
	var members int
	err := s.exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, membersSQL, f.memberKey).Scan(&members)
	})
	if err != nil {
		return fmt.Errorf("%w: count the fleet's members: %w", errLostLock, err)
	}
	r.state.pgAnswered()
	var leading, idle []string
	live := 0
	for _, name := range slices.Sorted(maps.Keys(f.tenants)) {
		t := f.tenants[name]
		switch {
		case t.gone:
			continue
		case t.leading:
			if !t.released {
				leading = append(leading, name)
			}
		case time.Now().After(t.retryAt):
			idle = append(idle, name)
		}
		live++
	}
	plan := planBalance(members, live, leading, idle, r.holder)
	for _, name := range plan.release {
		t := f.tenants[name]
		t.released = true
		t.cancel()
		r.log.Info("letting a schema go to another member of the fleet", zap.String("schema", t.schema),
			zap.Int("members", members), zap.Int("share", plan.share))
	}
	if len(plan.try) == 0 {
		return nil
	}
	keys := make([]string, len(plan.try))
	byKey := make(map[string]*tenant, len(plan.try))
	for i, name := range plan.try {
		t := f.tenants[name]
		keys[i] = t.r.lockKey
		byKey[t.r.lockKey] = t
	}
	var got []string
	err = s.exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		rows, err := conn.Query(ctx, tryLocksSQL, keys, plan.want)
		if err != nil {
			return err
		}
		got, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		return fmt.Errorf("try leader locks: %w", err)
	}
	// Every check first, then every lead: the leads' first drains use the
	// lock connection too, and would hold up the checks of the rest.
	var ready []*tenant
	for _, k := range got {
		ok, err := s.check(ctx, byKey[k])
		if err != nil {
			return err
		}
		if ok {
			ready = append(ready, byKey[k])
		}
	}
	for _, t := range ready {
		s.launch(ctx, t)
	}
	return nil
}

// check makes the checks a relay makes before it leads, for t, whose
// leader lock the session has just taken: ok when t may lead. A check that
// fails unlocks t and sets it aside for a backoff. An error is the lock
// connection's.
func (s *fleetSession) check(ctx context.Context, t *tenant) (ok bool, err error) {
	err = s.exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		if err := t.r.checkToLead(ctx, conn, t.joined); err != nil {
			return err
		}
		t.joined = true
		return nil
	})
	if err != nil {
		if uerr := s.unlock(ctx, t); uerr != nil {
			return false, uerr
		}
		s.failed(t, err)
		return false, nil
	}
	return true, nil
}

// launch leads t, which check passed, on a goroutine of its own.
func (s *fleetSession) launch(ctx context.Context, t *tenant) {
	c := t.r
	c.becomeLeader(s.conn, s.mu)
	s.f.r.state.setRole(RoleLeader)
	tctx, cancel := context.WithCancel(ctx)
	t.leading, t.released, t.cancel, t.done = true, false, cancel, make(chan struct{})
	go func() {
		t.err = c.leadWith(tctx, s.conn, s.mu, s.pool, t.wake)
		c.backlog.detach()
		close(t.done)
		select {
		case s.ended <- t:
		case <-s.stop:
		}
	}()
}

// after handles the end of t's lead, which gave back its gate locks
// (leadWith): it unlocks t's leader lock, and says why it stopped. An
// error is the lock connection's.
func (s *fleetSession) after(ctx context.Context, t *tenant) error {
	c := t.r
	t.leading = false
	t.cancel()
	if s.closed() {
		// Not %w of t.err: a schema's failure (its table dropped, say)
		// must not read as the whole process's (isFatal).
		return fmt.Errorf("%w (schema %q stopped: %v)", errLostLock, t.schema, t.err)
	}
	if err := s.unlock(ctx, t); err != nil {
		return err
	}
	c.state.setRole(RoleStandby)
	s.roleFromTenants()
	switch {
	case t.gone:
		s.forget(t)
	case t.released:
		c.log.Info("released leadership")
		// Not right back: another member is to take it.
		t.retryAt = time.Now().Add(2 * c.cfg.LeaderInterval)
	case t.err == nil:
		// Ended without an error while the session goes on: only the
		// session's own context ends a lead that way.
	default:
		c.steppedDown(t.err)
		s.failed(t, t.err)
	}
	return nil
}

// failed sets t aside after a failure, for a capped exponential backoff;
// a failure waiting cannot fix (a schema not migrated, a missing GRANT) is
// logged at error, as it needs an operator, and retried at the cap.
func (s *fleetSession) failed(t *tenant, err error) {
	c := t.r
	c.state.failed(err)
	c.metrics.sessionFailed(err)
	t.attempt++
	wait := backoff(t.attempt, c.cfg.MaxBackoff)
	if isFatal(err) {
		wait = c.cfg.MaxBackoff
		c.log.Error("cannot drain this schema; retrying later",
			zap.Error(explainPermission(err)), zap.Duration("wait", wait))
	}
	t.retryAt = time.Now().Add(wait)
}

// closed reports whether the lock connection is closed.
func (s *fleetSession) closed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn.IsClosed()
}

// unlock releases t's leader lock on the lock connection.
func (s *fleetSession) unlock(ctx context.Context, t *tenant) error {
	err := s.exec(context.WithoutCancel(ctx), func(ctx context.Context, conn *pgx.Conn) error {
		return t.r.unlockLeader(ctx, conn)
	})
	if err != nil {
		return fmt.Errorf("%w: unlock schema %q: %w", errLostLock, t.schema, err)
	}
	return nil
}

// roleFromTenants sets the process's role: leader while it leads a
// schema, else standby.
func (s *fleetSession) roleFromTenants() {
	for _, t := range s.f.tenants {
		if t.leading {
			s.f.r.state.setRole(RoleLeader)
			return
		}
	}
	s.f.r.state.setRole(RoleStandby)
}

// letAllGo ends every lead of the session (each finishes or rolls back its
// batch in flight) and the listener, and unlocks what it can: the lock
// connection may be gone, which released the locks anyway.
func (s *fleetSession) letAllGo() {
	s.stopListening()
	close(s.stop)
	released := 0
	for _, t := range s.f.tenants {
		if !t.leading {
			continue
		}
		t.cancel()
		<-t.done
		t.leading = false
		t.r.state.setRole(RoleStandby)
		if !s.closed() {
			_ = withTimeout(context.Background(), time.Second, func(ctx context.Context) error {
				s.mu.Lock()
				defer s.mu.Unlock()
				return t.r.unlockLeader(ctx, s.conn)
			})
		}
		released++
	}
	if released > 0 {
		s.f.r.log.Info("released leadership", zap.Int("schemas", released))
	}
}

// led are the tenants the session leads, in the order of their schemas'
// names: the poll's statement is built again whenever the list changes
// (pollSQL), and a map's order changes at every range. Unsorted, a hot
// fleet of 200 schemas prepared and planned a new poll statement nearly
// every poll (20-60 ms of PostgreSQL's time each, against 1.4 ms to run
// it).
func (s *fleetSession) led() []*tenant {
	var led []*tenant
	for _, t := range s.f.tenants {
		if t.leading && !t.released {
			led = append(led, t)
		}
	}
	slices.SortFunc(led, func(a, b *tenant) int { return strings.Compare(a.schema, b.schema) })
	return led
}

// poll asks, in one round trip, which of the schemas led have rows staged,
// wakes their drains (or, hot, hands them to the shared drain) and returns
// how many; the fallback poll, and a hot fleet's (hot: counted as
// hot_poll). The schemas whose table is locked are left out (see
// pollLockTimeout).
func (s *fleetSession) poll(ctx context.Context, led []*tenant, hot bool) (found int, err error) {
	s.recheckLocked(ctx)
	asked, found, err := s.pollOnce(ctx, led, hot)
	if err != nil && ctx.Err() == nil && s.lockTimeout > 0 && s.leaveOutLocked(ctx, asked) {
		// The others, at once.
		asked, found, err = s.pollOnce(ctx, led, hot)
	}
	if err != nil && ctx.Err() == nil {
		// A hot poll comes again a hotStep later. Beside a saturated
		// server its polls can time out one after the other (every 450ms
		// in the bench's app-cost fleet of 200), and each failure that
		// woke every schema sent a claim of each at that server; a table
		// dropped failed every hot poll, every few milliseconds, until
		// the next discover. While hot polls keep failing, they wake
		// every schema once a PollInterval, as the fallback poll would.
		if hot && time.Since(s.hotWokeAll) < s.f.r.cfg.PollInterval {
			s.f.r.log.Debug("hot fleet poll failed; polling again, every schema woken within the poll interval", zap.Error(err))
			return found, err
		}
		if hot {
			s.hotWokeAll = time.Now()
		}
		// A table dropped between discover and now, or the pool's
		// sessions failing, which the drains report: wake them all, as
		// the poll of one schema does.
		s.f.r.log.Debug("fleet poll failed; waking every schema led", zap.Error(err))
		for _, t := range asked {
			t.r.metrics.wakePoll.Inc()
			trySendWakeup(t.wake)
		}
	}
	return found, err
}

// pollOnce is one poll over the schemas of led not left out (asked).
func (s *fleetSession) pollOnce(ctx context.Context, led []*tenant, hot bool) (asked []*tenant, found int, err error) {
	led = slices.DeleteFunc(slices.Clone(led), func(t *tenant) bool {
		_, locked := s.lockedOut[t]
		return locked || hot && t.r.heldBack.Load()
	})
	if len(led) == 0 {
		return nil, 0, nil
	}
	if !slices.Equal(led, s.pollFor) {
		s.pollFor, s.pollSQL, s.hotPollSQL = slices.Clone(led), pollSQL(led, s.f.table, false), pollSQL(led, s.f.table, true)
	}
	stmts := s.pollSQL
	if hot {
		stmts = s.hotPollSQL
	}
	args := pollArgs(led, s.f.r.cfg.Queues, hot)
	// Cancelled on the server past its timeout: the session and its
	// prepared polls stay (drainWatcher).
	err = withDeadline(cancelOnServer(ctx), pollTimeout(s.f.r.cfg.LeaderInterval), func(ctx context.Context) error {
		// Prepared (pgx's statement cache): a hot fleet polls hundreds
		// of times a second, and planning a union over 200 schemas each
		// time cost PostgreSQL more than the probes. They change only with
		// the schemas led.
		b := &pgx.Batch{}
		if s.lockTimeout > 0 {
			// For this poll's implicit transaction only: the drain pool's
			// sessions have no lock_timeout (a schema's own drain waits for
			// its table's lock).
			b.Queue(lockTimeoutSQL, strconv.FormatInt(s.lockTimeout.Milliseconds(), 10))
		}
		for i, sql := range stmts {
			b.Queue(sql, args[i]...)
		}
		br := s.pool.SendBatch(ctx, b)
		if s.lockTimeout > 0 {
			if _, err := br.Exec(); err != nil {
				_ = br.Close()
				return err
			}
		}
		var staged []polled
		for range stmts {
			rows, err := br.Query()
			if err != nil {
				_ = br.Close()
				return err
			}
			more, err := pgx.CollectRows(rows, pgx.RowToStructByPos[polled])
			if err != nil {
				_ = br.Close()
				return err
			}
			staged = append(staged, more...)
		}
		if err := br.Close(); err != nil {
			return err
		}
		var shared []*tenant
		var sharedIDs []int64
		for _, p := range staged {
			t := led[p.I]
			if hot && t.r.sharedClaimed(p.ID) {
				// Deleted by the shared drain that just committed, after
				// this poll's snapshot: not found again.
				continue
			}
			found++
			if hot {
				t.r.metrics.wakeHot.Inc()
				if s.drainer != nil {
					shared = append(shared, t)
					sharedIDs = append(sharedIDs, p.ID)
					continue
				}
			} else {
				t.r.metrics.wakePoll.Inc()
			}
			trySendWakeup(t.wake)
		}
		if len(shared) > 0 {
			s.drainer.offer(shared, sharedIDs)
		}
		return nil
	})
	return led, found, err
}

// A schema's table under a lock (the app's ALTER TABLE or CREATE INDEX on
// one tenant, LOCK TABLE, a migration) held up a hot poll of every schema:
// each poll waited for it until pollTimeout and failed, and each failure
// woke the drain of every schema led, 200 claims over 200 schemas, twice a
// second while the lock was held, while the other schemas' jobs waited for
// those wake-ups instead of the next poll (a fleet of 200 at 1,000 jobs/s,
// one table locked for 4 s: the other schemas' jobs took 236-278 ms at
// p50 and 642-760 ms at p99, against 5.1-8.5 and 33-41 ms since). So a poll waits at most pollLockTimeout for a lock; when it
// fails, lockedTables looks in pg_locks for the tables of the poll that
// are locked, or wait for a lock, in ACCESS EXCLUSIVE mode (the one mode a
// read conflicts with): their drains are woken, and wait for the lock on
// their own as a relay of one schema does, the poll runs again without
// them, and the polls leave them out until pg_locks, read again every
// lockedRecheck, shows the lock gone. (A poll that looked at such a table
// again failed at its deadline, not its lock_timeout: pgx prepares a
// statement it has not cached on that session before the batch, and the
// prepare waits for the lock too.)
const (
	pollLockTimeout = 10 * time.Millisecond
	lockedRecheck   = time.Second
)

// lockTimeoutSQL sets lock_timeout to $1 (milliseconds) for the rest of
// the transaction: of a batch's implicit one, until its Sync.
const lockTimeoutSQL = `SELECT set_config('lock_timeout', $1, true)`

// lockedTablesSQL returns the positions (from 1) in $1 of the tables
// locked, or waited for, in ACCESS EXCLUSIVE mode. Casting a name to
// regclass takes no lock on the table.
const lockedTablesSQL = `SELECT u.i::int FROM unnest($1::regclass[]) WITH ORDINALITY u(rel, i)
WHERE EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'relation' AND l.relation = u.rel
  AND l.mode = 'AccessExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))`

// lockedTables returns the schemas of ts whose table is locked (see
// lockedTablesSQL).
func (s *fleetSession) lockedTables(ctx context.Context, ts []*tenant) ([]*tenant, error) {
	names := make([]string, len(ts))
	for i, t := range ts {
		names[i] = pgx.Identifier{t.schema, s.f.table}.Sanitize()
	}
	var locked []*tenant
	err := withDeadline(cancelOnServer(ctx), pollTimeout(s.f.r.cfg.LeaderInterval), func(ctx context.Context) error {
		rows, err := s.pool.Query(ctx, lockedTablesSQL, names)
		if err != nil {
			return err
		}
		at, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		for _, i := range at {
			locked = append(locked, ts[i-1])
		}
		return err
	})
	return locked, err
}

// leaveOutLocked handles a failed poll over led: it reports whether
// tables of led are locked, whose schemas it then leaves out of the polls
// and wakes.
func (s *fleetSession) leaveOutLocked(ctx context.Context, led []*tenant) bool {
	locked, err := s.lockedTables(ctx, led)
	if err != nil || len(locked) == 0 {
		return false
	}
	if s.lockedOut == nil {
		s.lockedOut = make(map[*tenant]time.Time)
	}
	again := time.Now().Add(lockedRecheck)
	var schemas []string
	for _, t := range locked {
		s.lockedOut[t] = again
		schemas = append(schemas, t.schema)
		t.r.metrics.wakePoll.Inc()
		trySendWakeup(t.wake)
	}
	s.f.r.log.Debug("the fleet's poll leaves out schemas whose table is locked; each drains on its own",
		zap.Strings("schemas", schemas))
	return true
}

// recheckLocked reads pg_locks again for the schemas left out whose time
// has come (lockedRecheck), and gives those no longer locked back to the
// polls; those whose lead ended are forgotten.
func (s *fleetSession) recheckLocked(ctx context.Context) {
	now := time.Now()
	var due []*tenant
	for t, at := range s.lockedOut {
		switch {
		case !t.leading || t.released:
			delete(s.lockedOut, t)
		case !now.Before(at):
			due = append(due, t)
		}
	}
	if len(due) == 0 {
		return
	}
	locked, err := s.lockedTables(ctx, due)
	if err != nil {
		// Polled again: a lock still held fails that poll, which looks
		// again.
		locked = nil
	}
	again := now.Add(lockedRecheck)
	for _, t := range due {
		if slices.Contains(locked, t) {
			s.lockedOut[t] = again
			continue
		}
		delete(s.lockedOut, t)
		s.f.r.log.Debug("a schema's table is no longer locked; the fleet's poll looks at it again", zap.String("schema", t.schema))
	}
}

// pollArgs are the arguments of pollSQL's statements, one list for each:
// the low-water mark of each of its schemas (below it
// are only dead index entries, every row drained since a long transaction
// elsewhere began to hold the horizon, and the rows its probe finds), and
// the queues of Config.Queues.
//
// A hot poll looks above the rows a shared drain in flight claimed
// (Relay.inFlight) instead, when that is higher: a hot fleet polls every few
// milliseconds and a shared drain takes tens of them, so each row was found
// again by the polls during its push, and drained again by a claim that
// came back empty: 34-37% of the shared drains' claims over 200 schemas at
// 2,600 jobs/s. A row below that id that the claim did not take (it
// committed after the claim's snapshot) is found by the first poll after
// the shared drain ends, which goes back to the mark. The other polls (the
// fallback poll, the one after cooling, those after a late commit) look
// from the mark: they are how such a row is found when no hot poll follows.
func pollArgs(led []*tenant, queues []string, hot bool) [][]any {
	var out [][]any
	for start := 0; start < len(led); start += pollChunk {
		end := min(start+pollChunk, len(led))
		args := make([]any, 0, end-start+1)
		for _, t := range led[start:end] {
			mark, _ := t.r.mark.Load().from()
			if hot {
				mark = max(mark, t.r.inFlight.Load())
			}
			args = append(args, mark)
		}
		if len(queues) > 0 {
			args = append(args, queues)
		}
		out = append(out, args)
	}
	return out
}

// polled is a row of pollSQL: a schema's index in led, and its lowest id
// staged above its id in the arguments.
type polled struct {
	I  int32
	ID int64
}

// pollSQL are the poll's statements over led, each over pollChunk schemas
// at most: one row, its index in led and the id found, for each schema with
// rows staged above its id in the arguments (pollArgs: $k, a bigint, for
// the statement's k-th schema), of the queues in the last argument (a
// text[]) with Config.Queues. The index scan from that id (ORDER BY ...
// LIMIT 1 in a subquery: PostgreSQL drops both from an EXISTS) never walks
// the dead entries below it.
//
// One bigint each, not one bigint[] over all of led subscripted in each
// probe, as before: PostgreSQL received the whole array in each statement
// and built each probe's index key from it. A poll over 200 schemas took
// 1.35-1.37 ms that way and 0.87-0.97 ms this way (BenchmarkFleetPoll, two
// runs each, 2026-12-05); a hot fleet of 200 polls every 4 ms.
//
// Hot, a schema whose target has no scheduler (streams, celery) is asked for
// the rows its claim would take only, those whose run_at is due: a future
// row its drain cannot claim was found by every hot poll, every few
// milliseconds, for as long as it stayed above the mark (the mark off, or
// held below the row by a transaction in progress), and each find woke the
// drain to claim nothing and counted towards keeping the fleet hot. Its
// drain learns of such a row from the poll as the fleet cools and from the
// fallback poll, which find every row (and wake it to arm its wake-up for
// the row's run_at); the hot poll finds the row once it is due.
func pollSQL(led []*tenant, table string, hot bool) []string {
	var out []string
	for start := 0; start < len(led); start += pollChunk {
		out = append(out, pollChunkSQL(led, start, min(start+pollChunk, len(led)), table, hot))
	}
	return out
}

// pollChunk is how many schemas one statement of the poll looks at. A
// prepared statement is planned again whenever one of its tables changes
// (autovacuum's VACUUM and ANALYZE do), and planning a union over 200
// schemas took 20-60 ms: at 1,000 commits a second over 200 schemas some
// table changed every few polls, and most of the poll's time went into
// planning. A chunk of 16 is planned again alone.
const pollChunk = 16

func pollChunkSQL(led []*tenant, start, end int, table string, hot bool) string {
	var sql strings.Builder
	for i := start; i < end; i++ {
		t := led[i]
		if i > start {
			sql.WriteString(" UNION ALL ")
		}
		fmt.Fprintf(&sql, "SELECT %d, id FROM (SELECT id FROM %s t WHERE id > $%d::bigint", i, pgx.Identifier{t.schema, table}.Sanitize(), i-start+1)
		if len(t.r.cfg.Queues) > 0 {
			fmt.Fprintf(&sql, " AND queue = ANY($%d::text[])", end-start+1)
		}
		if hot && t.r.dueOnly {
			sql.WriteString(t.r.sql.pollDue)
		}
		sql.WriteString(" ORDER BY id LIMIT 1) s")
	}
	return sql.String()
}

// fleetStatus is Status for a fleet: the process's role, and each
// schema's.
func (f *fleet) statuses() []SchemaRole {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]SchemaRole, 0, len(f.tenants))
	for _, name := range slices.Sorted(maps.Keys(f.tenants)) {
		out = append(out, SchemaRole{Schema: name, Status: f.tenants[name].r.Status()})
	}
	return out
}

// SchemaRole is one schema's Status, of a relay with Config.Schemas.
type SchemaRole struct {
	Schema string
	Status
}

// gatherer serves the metrics of the process and of every schema.
type fleetGatherer struct{ f *fleet }

func (g fleetGatherer) Gather() ([]*dto.MetricFamily, error) {
	g.f.mu.Lock()
	gs := prometheus.Gatherers{g.f.r.metrics.reg}
	for _, t := range g.f.tenants {
		gs = append(gs, t.r.metrics.reg)
	}
	g.f.mu.Unlock()
	return gs.Gather()
}
