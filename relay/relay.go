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
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// Relay drains one schema's staged_jobs into Redis. Create it with New and
// start it with Run.
type Relay struct {
	cfg Config
	log *zap.Logger
	// drainLog is log.Named("drain"), made once: a hot fleet's shared
	// drain logs through it for each schema of each drain.
	drainLog *zap.Logger
	pgCfg    *pgx.ConnConfig
	sql      tableSQL // src's statements, the claim due-only for dueOnly
	src      source
	target   target
	tracer   *batchTracer // nil: tracing off
	// dueOnly: the target has no scheduler, so rows are claimed only once
	// their run_at is due, and the drain loop wakes for the next one.
	dueOnly bool
	handoff *handoff.Handoff
	bp      *backpressure // what backpressure pauses (backpressure.go)
	// poisoned lists the poison rows a source that does not bury them
	// left staged in this leadership: every claim skips them. Read and
	// written by the drain loop only; reset when leadership starts.
	poisoned []int64
	// excluded are the queues the drain in progress leaves out of its
	// claims (backpressure.excluded); set by the drain loop at each
	// drain's start, read by its claims.
	excluded []string
	holder   string // names this relay in the fence hash
	lockKey  string
	// group is the sorted, comma-joined Config.Queues; "" for all queues.
	group string
	// claimArgs are the claim's arguments after the first three: the
	// queues, for a relay with Config.Queues.
	claimArgs []any
	version   int // the schema version this binary needs: its latest migration
	// tenancy is what the fleet gave a fleet's schema; nil for a relay
	// of one schema.
	tenancy *tenancy

	// mark is where claims start (lowwater.go), nil when off; set by the
	// drain loop at each leadership's start.
	mark atomic.Pointer[lowWater]

	// fleet, for a relay with Config.Schemas, runs a Relay per schema
	// (fleet.go); nil for a relay of one schema.
	fleet *fleet
	// heldBack is true while backpressure holds a queue back (gate.paused),
	// for a hot fleet's poll, which leaves such a schema to its own
	// retries and notifications.
	heldBack atomic.Bool
	// inFlight is the highest id a hot fleet's shared drain in flight
	// claimed from this schema, 0 when none is: the fleet's hot poll looks
	// above it (pollArgs), so that the rows being pushed are not found
	// again, and drained again by an empty claim, before their commit.
	inFlight atomic.Int64
	// sharedIDs are the ids the last shared drain of this schema deleted
	// and when (sharedClaimed), nil if it failed.
	sharedIDs atomic.Pointer[sharedDeleted]
	// sharedMarkAt is when a shared claim last read what the schema's
	// low-water mark needs (sharedMarkEvery); under drainMu.
	sharedMarkAt time.Time
	// sharedEnd is the error that ends the schema's lead, set by a shared
	// drain whose push of its batch was refused for good (the fence taken
	// by another leader, or another cluster's): its drain loop returns it
	// before it claims again, as it returns its own push's, and no shared
	// drain takes the schema meanwhile (sharable). Its handoff would
	// otherwise take the fence back at its next push, and lead on beside
	// the relay that took it. Under drainMu.
	sharedEnd error
	// drainMu is held by the drain loop while it drains, and by a hot
	// fleet's shared drain while it drains this schema (fleetdrain.go):
	// one of them at a time works on the schema's batches and state.
	drainMu sync.Mutex
	// drainOpen is true while the drain loop runs (under drainMu): a
	// shared drain takes no batch of a schema whose leadership is ending.
	drainOpen bool
	// tidyLater asks the drain loop to tidy the handoff record in a while
	// (under drainMu, while drainOpen): a shared drain's batch left it.
	tidyLater chan struct{}
	// markLater asks the drain loop to claim from the low-water mark in a
	// while (under drainMu, while drainOpen): a shared drain claimed from
	// the schema, and only a later claim confirms it (drainLoop's confirm).
	markLater chan struct{}
	// deaf is true while no listener session has LISTENed on the schema's
	// channel (at start, and from a listener's failure until it LISTENs
	// again): the relay does not go idle then, since a commit's
	// notification would reach nobody (gate.heldAwake).
	deaf atomic.Bool
	// gate is the wake gate of the lead in progress, nil between leads;
	// set and cleared under the lock connection's mutex. A fleet going
	// hot releases its schemas' idle locks through it
	// (fleetSession.holdAwake).
	gate atomic.Pointer[gate]

	// settings are what the relay was built with beside its Config: a
	// relay of one schema's defaults, or its fleet's (newRelay).
	settings
	// syncStandby says that synchronous_standby_names was set at the last
	// look (after each batch's commit): the drain then waits for the
	// synchronous standbys before it pushes (standby.go). syncWarned says
	// that it logged, once, that it cannot read their positions.
	// syncKnown says that syncStandby was read in this leadership.
	syncStandby, syncWarned, syncKnown bool
	// walLast is the last read of walPositionsSQL in this leadership: a
	// batch's commit within walFresh of it reads the insert position
	// alone (drain.go, finish).
	walLast walCache
	// listens counts the listener's completed LISTENs, for hooks.idle.
	listens atomic.Int64
	// summary counts what the drain did for the info line logged every
	// summaryEvery, and feeds metrics (metrics.go), the Prometheus metrics
	// of MetricsHandler.
	summary summary
	metrics *metrics
	// backlog is the leader's sample of the backlog, for the summary line
	// and the backlog gauges.
	backlog backlog

	// state is what Status and CheckReady report (health.go).
	state state
}

// settings are what a Relay takes beside its Config, the same for every
// schema of a fleet: its tenants are built with the fleet's (newRelay),
// which tests may have changed (export_test.go) before Run.
type settings struct {
	// Test hooks (export_test.go); nil outside tests.
	hooks testHooks
	// gateTimeout is the lock_timeout of the leader's lock connection: the
	// longest the gate waits, going idle, for commits looking at it.
	gateTimeout time.Duration
	// summaryEvery is how often the summary line is logged (a field so
	// that tests can shorten it).
	summaryEvery time.Duration
	// drainIdleInTx is the drain sessions'
	// idle_in_transaction_session_timeout (a field so that tests can
	// shorten it; see conn.go).
	drainIdleInTx time.Duration
	// listenerHeartbeat is how long the listener may hear nothing before
	// the relay sends it a heartbeat (a field so that tests can shorten
	// it; see listen.go).
	listenerHeartbeat time.Duration
	// hot, for a fleet's schema, is the fleet's fleetHot: true while it
	// polls its schemas and holds them awake. nil otherwise.
	hot *atomic.Bool
	// found, for a fleet's schema, is the fleet's: it counts the jobs the
	// schema's drains find in short batches (fleetHot). nil otherwise.
	found *atomic.Int64
}

// defaultSettings are the settings of a relay New returns.
func defaultSettings() settings {
	return settings{
		gateTimeout:       defaultGateTimeout,
		summaryEvery:      summaryEvery,
		drainIdleInTx:     drainIdleInTx,
		listenerHeartbeat: listenerHeartbeat,
	}
}

// tenancy is what a fleet gives each schema's Relay beside its settings;
// nil for a relay of one schema.
type tenancy struct {
	// system is PostgreSQL's system_identifier, which names the cluster
	// in every fence (the fleet reads it once).
	system string
}

// testHooks are called at points tests synchronize on, in the manner of
// River's testsignal: a test waits on the exact code point, not on a log
// line written near it.
type testHooks struct {
	// beforePush runs before each batch's push script, after the fence
	// is taken and the record read.
	beforePush func(ctx context.Context)
	// standbyBehind runs each time a batch, before its push, finds that
	// the standbys have not flushed the WAL up to lsn (standby.go).
	standbyBehind func(lsn uint64)
	// afterPush runs between a batch's push and its delete; an error it
	// returns fails the batch there.
	afterPush func(ctx context.Context) error
	// idle runs when the drain loop has drained and gone idle (the gate
	// released, the last drain empty). listens is how many LISTENs had
	// completed before that last drain began.
	idle func(listens int64)
	// listenerConnected runs when the listener has connected, before its
	// LISTEN, with its backend's pid.
	listenerConnected func(pid uint32)
	// probeFound runs when the probe below the low-water mark found a
	// row, with its id (lowwater.go).
	probeFound func(id int64)
	// probeEvery, when set, replaces probeEvery (lowwater.go).
	probeEvery time.Duration
	// probeTurn runs at each turn of the probe below the low-water mark,
	// with the schema and the time since the turn before (or since the
	// probe began).
	probeTurn func(schema string, since time.Duration)
	// claimed runs after each claim of the schema's own drain, with the
	// number of rows it took (0: it came back empty).
	claimed func(jobs int)
	// tidied runs after each tidy of the handoff record: atEnd at a
	// drain's end, else by the drain loop's timer.
	tidied func(atEnd bool)
	// markConfirm runs when the drain loop claims from the low-water mark
	// after a shared drain (drainLoop's confirm), before the claim. A
	// fleet's schemas get their fleet's.
	markConfirm func()
}

// New checks cfg and returns a Relay. It starts nothing and connects to
// nothing.
func New(cfg Config) (*Relay, error) {
	if len(cfg.Schemas) > 0 {
		return newFleet(cfg)
	}
	return newRelay(cfg, defaultSettings(), nil)
}

// parseConfig fills in cfg's defaults, checks it, and returns it with its
// DatabaseURL's connection config and the schema version this binary
// needs.
func parseConfig(cfg Config) (Config, *pgx.ConnConfig, int, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return cfg, nil, 0, fmt.Errorf("relay config: %w", err)
	}
	pgCfg, err := pgx.ParseConfig(cfg.DatabaseURL)
	if err != nil { // Validate parsed it already
		return cfg, nil, 0, fmt.Errorf("relay config: DatabaseURL: %w", redactErr(err))
	}
	if len(pgCfg.Fallbacks) > 0 && pgCfg.ValidateConnect == nil && !strings.Contains(cfg.DatabaseURL, "target_session_attrs") {
		// Several hosts and no target_session_attrs: connect to the one
		// that accepts writes, the primary, as after a failover.
		pgCfg.ValidateConnect = pgconn.ValidateConnectTargetSessionAttrsReadWrite
	}
	version, err := latestVersion()
	if err != nil {
		return cfg, nil, 0, fmt.Errorf("read migrations: %w", err)
	}
	return cfg, pgCfg, version, nil
}

// newBase returns what every Relay has, a relay of one schema's or a
// fleet's: its config, checked (parseConfig), and settings s. queues are
// Config.Queues, sorted.
func newBase(cfg Config, s settings) (r *Relay, queues []string, err error) {
	cfg, pgCfg, version, err := parseConfig(cfg)
	if err != nil {
		return nil, nil, err
	}
	queues = slices.Sorted(slices.Values(cfg.Queues))
	return &Relay{
		cfg:      cfg,
		log:      cfg.Logger,
		pgCfg:    pgCfg,
		version:  version,
		group:    strings.Join(queues, ","),
		holder:   applicationName("leader"),
		settings: s,
	}, queues, nil
}

// newRelay returns the Relay of the one schema cfg.Schema: a relay of
// that schema's own (New), or a fleet's tenant (ten, from the fleet, with
// the fleet's settings s). Nothing is set on it after.
func newRelay(cfg Config, s settings, ten *tenancy) (*Relay, error) {
	r, queues, err := newBase(cfg, s)
	if err != nil {
		return nil, err
	}
	cfg, group := r.cfg, r.group
	r.handoff = handoff.New(cfg.Redis, newHandoffKeys(cfg.RedisNamespace, r.pgCfg.Database, cfg.Schema, group)).
		WaitFor(cfg.RedisWaitReplicas, cfg.RedisWaitTimeout)
	r.lockKey = leaderLockName(cfg.Schema, group)
	r.deaf.Store(true)
	if r.src, err = newSource(cfg, r.version); err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	r.sql = r.src.statements()
	if group != "" {
		// A lock of the group's own: relays with the same queues, in any
		// order, are its leader and standbys.
		r.claimArgs = []any{queues}
		r.cfg.Queues = queues
	}
	tenant := newTenantTag(cfg.TenantKey, cfg.Schema) // a fleet's tenant: its own schema
	r.target = newTarget(cfg, tenant)
	if cfg.Target.spec().DueOnly { // no scheduler the relay can write to (internal/target)
		r.sql.claim, r.dueOnly = r.sql.claimDue, true
		// From the mark too: the future rows a claim leaves below it are
		// found when due (lowwater.go).
		r.sql.claimMark, r.sql.probe = r.sql.claimDueMark, r.sql.probeDue
		r.sql.backlogMark = r.sql.backlogDueMark // the backlog counts them
	}
	r.tracer = newBatchTracer(cfg.TracerProvider, cfg.Target)
	r.backlog.sql, r.backlog.ttl = r.sql.backlog, backlogTTL
	// With the low-water mark on (a mark of this leadership), samples count
	// from it: the summary's sample runs on the lock connection, which the
	// gate waits for, and from the index's start it walked every dead row a
	// long transaction elsewhere keeps (up to its 1s timeout, each 10s).
	r.backlog.markSQL = r.sql.backlogMark
	r.backlog.mark = func() int64 { from, _ := r.mark.Load().from(); return from }
	if group != "" {
		r.backlog.args = []any{queues}
	}
	r.metrics = newMetrics(string(cfg.Target), cfg.Schema, group, &r.backlog, &r.summary.mu)
	r.summary.metrics = r.metrics
	r.drainLog = r.log.Named("drain")
	r.bp = newBackpressure(cfg, r.metrics.backpressure, r.drainLog)
	r.bp.state = &r.state
	r.state.init(r.metrics.leader)
	if ten != nil {
		r.tenancy = ten
		r.handoff.System = ten.system
		// The horizon is the database's: the fleet's own registry serves it.
		r.metrics.labelled.Unregister(r.metrics.horizonAge)
		r.state.setRole(RoleStandby)
	}
	return r, nil
}

// Run drains until ctx ends, then finishes or rolls back the batch in flight,
// releases leadership and returns nil. Lost connections to PostgreSQL or
// Redis are logged and retried with capped exponential backoff; Run returns
// an error only for what waiting cannot fix: rejected credentials, a missing
// database, a schema that Migrate has not brought up to this version
// (ErrNotMigrated), or one a newer stagedrain has migrated past it
// (ErrSchemaTooNew), a role without a privilege the relay needs
// (ErrPermission: checked at start, and fatal when refused later); or, at
// start, before it campaigns to lead, a Redis that refuses its credentials
// or DB (mid-run, such refusals are logged at error and retried).
//
// A Relay runs one Run at a time; to run standbys, create more Relays (in
// other processes, normally).
func (r *Relay) Run(ctx context.Context) error {
	r.state.setRole(RoleStarting)
	defer r.state.setRole(RoleStopped)
	// A relay of one schema: one batch pushed while the next is claimed.
	conns, session := int32(2), r.campaign
	about := []zap.Field{zap.String("schema", r.cfg.Schema), zap.String("channel", ChannelName(r.cfg.Schema)),
		zap.String("timestamp_format", string(r.cfg.TimestampFormat))}
	if f := r.fleet; f != nil {
		defer f.forgetAll()
		conns, session = fleetDrainConns, f.session
		about = []zap.Field{zap.Strings("schemas", r.cfg.Schemas), zap.Int("drain_conns", fleetDrainConns)}
	}
	r.log.Info("starting", append(about,
		zap.String("database", DescribeDatabase(r.cfg.DatabaseURL)),
		zap.String("redis", DescribeRedis(r.cfg.Redis)),
		zap.String("source", string(r.cfg.Source)),
		zap.String("target", string(r.cfg.Target)),
		zap.Int("batch_size", r.cfg.BatchSize),
		zap.Duration("poll_interval", r.cfg.PollInterval),
		zap.Bool("poll_only", r.cfg.PollOnly),
		zap.String("tracing", describeTracing(r.cfg.TracerProvider)),
	)...)
	if err := r.checkRedis(ctx); err != nil {
		return err
	}
	if ctx.Err() != nil {
		r.log.Info("stopped")
		return nil
	}
	return r.runSessions(ctx, conns, session)
}

// runSessions runs session (a relay's campaign, or a fleet's session) on
// a drain pool of maxConns connections until ctx ends (nil) or it fails
// for a reason retrying cannot fix; other failures are counted, logged and
// retried with capped exponential backoff.
func (r *Relay) runSessions(ctx context.Context, maxConns int32, session func(context.Context, *pgxpool.Pool) (time.Time, error)) error {
	poolCfg, err := r.drainPoolConfig()
	if err != nil {
		return err
	}
	poolCfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg) // connects lazily
	if err != nil {
		return fmt.Errorf("pool: %w", err)
	}
	defer closePool(r.log, "drain", pool)
	// The database's xmin horizon, for the whole process (horizon.go).
	w := &horizonWatch{table: "staged_jobs"}
	if r.cfg.Source == SourceSidekiqStagedPush {
		w.table = "sidekiq_staged_push_jobs"
	}
	if r.fleet == nil {
		w.schemas = []string{r.cfg.Schema}
	}
	defer r.startHorizonWatch(ctx, pool, w)()

	attempt := 0
	readOnly := false // logged once until a session gets past the check
	for {
		connected, err := session(ctx, pool)
		if ctx.Err() != nil {
			r.log.Info("stopped")
			return nil
		}
		if errors.Is(err, errReadOnly) {
			// A standby (or a URL naming one): look again soon, as a
			// promotion makes it writable (standby.go).
			r.state.setRole(RoleStarting)
			if !readOnly {
				r.log.Warn("connected to a read-only PostgreSQL (a standby, or default_transaction_read_only): not draining, looking again",
					zap.String("database", DescribeDatabase(r.cfg.DatabaseURL)), zap.Duration("every", readOnlyRetry))
				readOnly = true
			}
			if !sleep(ctx, readOnlyRetry) {
				r.log.Info("stopped")
				return nil
			}
			continue
		}
		readOnly = false
		r.state.setRole(RoleStarting)
		r.state.failed(err)
		r.metrics.sessionFailed(err)
		if isFatal(err) {
			return explainPermission(err)
		}
		// Only a session that stayed up for a while (it led or stood by)
		// restarts the backoff: one that fails right after connecting (say,
		// its version check timing out on a lock a migration holds) would
		// otherwise retry every 100ms for as long as that lasts.
		if !connected.IsZero() && time.Since(connected) >= healthySession {
			attempt = 0
		}
		attempt++
		wait := backoff(attempt, r.cfg.MaxBackoff)
		if len(r.pgCfg.Fallbacks) > 0 {
			// Several hosts: a failover is expected, and the promoted
			// standby must be found within a second or two of its
			// promotion (standby.go).
			wait = min(wait, failoverRetry)
		}
		r.log.Warn("database session failed, retrying", zap.Error(err),
			zap.Int("attempt", attempt), zap.Duration("wait", wait))
		if !sleep(ctx, wait) {
			r.log.Info("stopped")
			return nil
		}
	}
}

// checkRedis pings Redis through the configured client until it answers,
// before the relay campaigns to lead. A refusal that waiting cannot fix
// (isRedisRefusal: credentials, DB) is returned; anything else, such as
// Redis not listening yet, is logged and retried with backoff. It returns
// nil when ctx ends. The same refusals later, mid-run, fail batches, which
// are logged and retried: only a relay that never reached Redis can tell a
// misconfiguration from an operator's change in progress.
func (r *Relay) checkRedis(ctx context.Context) error {
	defer r.state.waitFor(nil)
	for attempt := 1; ; attempt++ {
		err := r.cfg.Redis.Ping(ctx).Err()
		if err == nil {
			if err := r.checkClusterNode(ctx); err != nil {
				return err
			}
			return r.checkStreamLag(ctx)
		}
		if ctx.Err() != nil {
			return nil
		}
		r.metrics.errRedis.Inc()
		if isRedisRefusal(err) {
			return fmt.Errorf("redis %s: %w", DescribeRedis(r.cfg.Redis), err)
		}
		// CheckReady says so, rather than just "starting".
		r.state.waitFor(redisNotReady(DescribeRedis(r.cfg.Redis), err))
		wait := backoff(attempt, r.cfg.MaxBackoff)
		r.log.Warn("redis unreachable, retrying", zap.String("redis", DescribeRedis(r.cfg.Redis)),
			zap.Error(err), zap.Int("attempt", attempt), zap.Duration("wait", wait))
		if !sleep(ctx, wait) {
			return nil
		}
	}
}

// checkClusterNode refuses a client of one server (not a ClusterClient)
// whose server is a Redis Cluster node: each batch's push would fail on
// keys of other slots (MOVED, CROSSSLOT), forever. A server that does not
// answer INFO (renamed, a proxy) is taken as it is.
func (r *Relay) checkClusterNode(ctx context.Context) error {
	if isCluster(r.cfg.Redis) {
		return nil
	}
	info, err := r.cfg.Redis.Info(ctx, "cluster").Result()
	if err == nil && strings.Contains(info, "cluster_enabled:1") {
		return fmt.Errorf("redis %s is a Redis Cluster node: the relay needs a cluster client to push per hash slot (stagedrain run --redis-mode cluster, or a *redis.ClusterClient)", DescribeRedis(r.cfg.Redis))
	}
	return nil
}

// checkStreamLag refuses MaxQueueLength with TargetStreams on a Redis
// older than 7.0: a stream's length guard counts the entries its consumer
// groups have not acknowledged, from XINFO GROUPS' lag, which Redis reports
// since 7.0 (XLEN counts consumed entries too, so a paused stream would
// never resume). A server that does not answer INFO server (renamed, a
// proxy) is taken as it is; a cluster is checked through one of its nodes.
func (r *Relay) checkStreamLag(ctx context.Context) error {
	if !strings.Contains(r.cfg.Target.spec().Length, "XUNACKED") || r.cfg.MaxQueueLength <= 0 {
		return nil
	}
	info, err := r.cfg.Redis.Info(ctx, "server").Result()
	if err != nil {
		return nil
	}
	return streamLagSupported(info, DescribeRedis(r.cfg.Redis))
}

// streamLagSupported reads redis_version from an INFO server reply, and
// returns checkStreamLag's refusal, in one line, for a version below 7.0;
// nil when it is 7.0 or later, or is not there to read.
func streamLagSupported(info, server string) error {
	version := ""
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			version = v
		}
	}
	major, _, _ := strings.Cut(version, ".")
	if n, err := strconv.Atoi(major); err != nil || n >= 7 {
		return nil
	}
	return fmt.Errorf("redis %s is version %s: --max-queue-length (MaxQueueLength) with --target streams needs Redis 7.0 or later, "+
		"whose XINFO GROUPS gives each consumer group's lag (XLEN counts the entries consumers took too)", server, version)
}

// healthySession is how long a database session must last before its
// failure counts as a new outage, retried after minBackoff, rather than one
// more failure of the same outage, retried after a longer wait. It is above
// the default MaxBackoff, so sessions that keep failing after a few seconds
// still back off to the cap.
const healthySession = 10 * time.Second

// lead runs the leader's work until ctx ends (nil) or the lock connection
// fails (an error): the listener, the fallback poll, the drain loop, and a
// watch on the lock connection. lockMu guards lockConn, which they share.
func (r *Relay) lead(ctx context.Context, lockConn *pgx.Conn, lockMu *sync.Mutex, pool *pgxpool.Pool) error {
	return r.leadWith(ctx, lockConn, lockMu, pool, nil)
}

// leadWith is lead; for a schema of a relay with Config.Schemas, shared is
// its wake channel, signalled by the listener and poll the schemas share,
// and the lock connection's watch is theirs too (fleet.go).
//
// Whatever ends it, it gives back the wake gate's locks before it returns
// (gate.release), while the caller still holds the leader lock: the lock
// connection may stay open (a fleet's), and the next lead of the schema,
// here or elsewhere, must find the gate as a relay that is not draining
// leaves it.
func (r *Relay) leadWith(ctx context.Context, lockConn *pgx.Conn, lockMu *sync.Mutex, pool *pgxpool.Pool, shared chan struct{}) (err error) {
	r.handoff.Reset() // a new leadership takes the fence at its first push
	r.poisoned = nil  // and looks at every row again
	r.syncKnown = false
	r.walLast = walCache{} // the first commit reads every position
	r.summary.poisonKept(0, 0)
	// Awake at first (commits do not notify): the drain at start goes idle
	// when it has found nothing left; in poll-only mode it never does,
	// since nobody listens.
	gt := &gate{mu: lockMu, conn: lockConn, pinned: r.cfg.PollOnly,
		held:     r.hot,
		deaf:     &r.deaf,
		idleKeys: gateLockNames(r.cfg.Schema, r.cfg.Queues),
		timeout:  r.gateTimeout + lockQueryTimeout(r.cfg.LeaderInterval),
		late:     lateCommits{window: r.cfg.PollInterval}}
	gt.awake.Store(true)
	r.gate.Store(gt)
	defer func(ctx context.Context) {
		lockMu.Lock()
		r.gate.Store(nil) // under the gates' mutex: holdAwake sees it or not
		lockMu.Unlock()
		if rerr := gt.release(ctx); rerr != nil && err == nil {
			err = rerr
		}
	}(ctx)
	g, ctx := errgroup.WithContext(ctx)
	wake := shared
	if wake == nil {
		wake = make(chan struct{}, 1)
	}
	trySendWakeup(wake) // drain at start
	if !r.cfg.PollOnly && shared == nil {
		g.Go(func() error { return r.listen(ctx, wake, pool) })
	}
	if shared == nil {
		g.Go(func() error { poll(ctx, r.cfg.PollInterval, wake, r.metrics.wakePoll); return nil })
		g.Go(func() error { return r.keepLock(ctx, lockConn, lockMu) })
	}
	g.Go(func() error { return r.drainLoop(ctx, pool, wake, gt) })
	g.Go(func() error { r.summarize(ctx, r.summaryEvery); return nil })
	err = g.Wait()
	r.bp.reset() // the drain has returned
	return err
}

// drainPoolConfig is the configuration of the drain's connection pool.
func (r *Relay) drainPoolConfig() (*pgxpool.Config, error) {
	poolCfg, err := pgxpool.ParseConfig("")
	if err != nil {
		return nil, fmt.Errorf("pool config: %w", err)
	}
	poolCfg.ConnConfig = r.connConfig("drain")
	// A batch's COMMIT need not wait for its WAL to reach disk: if
	// PostgreSQL crashes before it does (within about 3 x wal_writer_delay,
	// 600ms by default), the claim's delete is undone and the same jobs
	// are pushed again with the same jids. Never a lost job; the app's own
	// commits are unaffected. This takes an fsync off every batch.
	poolCfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	// A batch claimed by a relay that then froze or lost its host is rolled
	// back by PostgreSQL after drainIdleInTx, and its rows can be claimed
	// again (see conn.go).
	poolCfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = millis(r.drainIdleInTx)
	maps.Copy(poolCfg.ConnConfig.RuntimeParams, drainPlanSettings)
	poolCfg.ConnConfig.BuildContextWatcherHandler = newDrainWatcher
	// pgxpool pings a connection idle for over a second before handing it
	// out. The idle relay's fallback poll comes every 0.75-1.25
	// PollInterval, so that was a ping before every other poll: a round
	// trip, and a transaction in pg_stat_database (an empty statement is
	// one), 0.5/s of an idle relay's 2. A connection idle longer than two
	// polls is still pinged; one that broke since its last use fails its
	// claim, which is retried, as after any failure.
	pingAfter := max(2*r.cfg.PollInterval, time.Second)
	poolCfg.ShouldPing = func(_ context.Context, p pgxpool.ShouldPingParams) bool {
		return p.IdleDuration > pingAfter
	}
	return poolCfg, nil
}

// drainPlanSettings are the planner settings of the drain's sessions.
//
// The claim deletes the rows it locked by ctid (claim.go). On a small
// table, or one whose statistics lag, the planner would rather scan the
// whole table and test each row against the claimed ctids (a cost that
// grows with every page the app's inserts and the drain's deletes left
// since the last vacuum, times the batch) than fetch them by TID. No
// statement of the drain needs a sequential scan where another path
// exists, so they are ruled out.
//
// And PostgreSQL would plan the claim again at every execution (its custom
// plans cost less than its estimate of the generic one), about as long as
// it takes to run on a short batch. The generic plan is the same index
// scan and TID scan: a million-job backlog drained 5% faster with it (4 of
// 4 alternating runs; README, "Performance").
//
// No JIT: with sequential scans ruled out, any statement that must scan a
// relation whole (a sequence read as a table, SELECT last_value FROM
// staged_jobs_id_seq) is costed above 10^10, past jit_above_cost, and
// the whole claim was then compiled: 15 functions, 30-240 ms a claim
// (EXPLAIN ANALYZE: "JIT: Functions: 15"). The claim reads the sequence
// through a function instead (lowwater.go); this keeps any other statement
// from paying for it.
var drainPlanSettings = map[string]string{
	"enable_seqscan":  "off",
	"plan_cache_mode": "force_generic_plan",
	"jit":             "off",
}

// defaultGateTimeout bounds how long the relay, going idle, waits for the
// commits that are looking at the gate in that very instant (see wake.go);
// a commit that looks while it waits does not wait, and notifies.
const defaultGateTimeout = 200 * time.Millisecond

// isFatal reports whether err is one that retrying cannot fix.
func isFatal(err error) bool {
	if errors.Is(err, ErrNotMigrated) || errors.Is(err, ErrSchemaTooNew) || errors.Is(err, ErrPermission) || errors.Is(err, ErrQueueConflict) || errors.Is(err, ErrForeignFence) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code[:2] == "28": // invalid authorization: bad user or password
			return true
		case pgErr.Code == "3D000": // database does not exist
			return true
		case pgErr.Code == "42P01" || pgErr.Code == "3F000": // table or schema gone
			return true
		case pgErr.Code == "42501": // insufficient_privilege: needs a GRANT
			return true
		}
	}
	return false
}

// withTimeout runs f with a context that is not cancelled with ctx but
// gives up after d: for cleanup that must run while shutting down.
func withTimeout(ctx context.Context, d time.Duration, f func(context.Context) error) error {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), d)
	defer cancel()
	return f(c)
}
