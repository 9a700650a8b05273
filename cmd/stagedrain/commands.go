package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/stagedrain/stagedrain/relay"
)

// commonFlags are the flags of both migrate and run.
type commonFlags struct {
	databaseURL string
	schema      string
	source      string
	logFormat   string
	logLevel    string
}

func (c *commonFlags) register(f *flagSet) {
	c.registerDatabase(f)
	defer f.required("log-format", "log-level", "source")
	f.fs.StringVar(&c.source, "source", string(relay.SourceStagedJobs), "the `table` drained: staged_jobs, or sidekiq_staged_push (the sidekiq-staged_push gem's sidekiq_staged_push_jobs)")
	f.env("source", "STAGEDRAIN_SOURCE")
	f.fs.StringVar(&c.logFormat, "log-format", "json", "log `format`: json or console")
	f.env("log-format", "STAGEDRAIN_LOG_FORMAT")
	f.fs.StringVar(&c.logLevel, "log-level", "info", "log `level`: debug (a line per batch), info, warn or error")
	f.env("log-level", "STAGEDRAIN_LOG_LEVEL")
}

// registerDatabase declares --database-url and --schema alone (for dead).
func (c *commonFlags) registerDatabase(f *flagSet) {
	defer f.required("database-url", "schema")
	f.fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL connection `URL` (required; never logged)")
	f.env("database-url", "DATABASE_URL")
	f.fs.StringVar(&c.schema, "schema", "public", "PostgreSQL `schema` of the staged_jobs table")
	f.env("schema", "STAGEDRAIN_SCHEMA")
}

func (c *commonFlags) check(f *flagSet) error {
	if c.databaseURL == "" {
		return usagef("%s: --database-url or $DATABASE_URL is required", f.cmd)
	}
	if err := relay.CheckDatabaseURL(c.databaseURL); err != nil {
		return usagef("%s: %s: %s", f.cmd, f.source("database-url"), err)
	}
	if err := relay.CheckSchema(c.schema); err != nil {
		reason := err.Error()
		if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
			reason = fe.Reason
		}
		return usagef("%s: %s %s", f.cmd, f.source("schema"), reason)
	}
	if f.fs.Lookup("source") != nil {
		if err := relay.CheckSource(relay.Source(c.source)); err != nil {
			reason := err.Error()
			if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
				reason = fe.Reason
			}
			return usagef("%s: %s %s", f.cmd, f.source("source"), reason)
		}
	}
	return nil
}

// logger builds the process logger: JSON (or console) lines on stdout.
func (c *commonFlags) logger(cmd string, stdout io.Writer) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(c.logLevel)
	if err != nil {
		return nil, usagef("%s: --log-level must be debug, info, warn or error, got %q", cmd, c.logLevel)
	}
	var enc zapcore.Encoder
	switch c.logFormat {
	case "json":
		ec := zap.NewProductionEncoderConfig()
		ec.TimeKey = "time"
		ec.EncodeTime = zapcore.RFC3339NanoTimeEncoder
		ec.EncodeDuration = zapcore.StringDurationEncoder
		enc = zapcore.NewJSONEncoder(ec)
	case "console":
		ec := zap.NewDevelopmentEncoderConfig()
		ec.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
		enc = zapcore.NewConsoleEncoder(ec)
	default:
		return nil, usagef("%s: --log-format must be json or console, got %q", cmd, c.logFormat)
	}
	core := zapcore.NewCore(enc, zapcore.Lock(zapcore.AddSync(stdout)), level)
	// Every line names the process, so the lines of several relays (a
	// leader and its standbys) can be told apart in one log stream.
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	return zap.New(oneLineErrors{core}).Named("stagedrain").With(zap.String("host", host), zap.Int("pid", os.Getpid())), nil
}

// migrateFlags are migrate's flags.
type migrateFlags struct {
	commonFlags
	schemas string
}

// newMigrateFlags declares migrate's flags.
func newMigrateFlags() (*flagSet, *migrateFlags) {
	f := newFlagSet("migrate", "Create the schema (if missing), the staged_jobs table and its NOTIFY trigger,\n"+
		"or upgrade them; with --source sidekiq_staged_push, add only the trigger to the\n"+
		"gem's table. Safe to run again, and from several processes at once.")
	c := new(migrateFlags)
	c.register(f)
	registerSchemas(f, &c.schemas, "migrate these `schemas` instead of --schema: a comma list of names (created if missing) and patterns with '*' (tenant_*), which match the schemas that exist (with --source sidekiq_staged_push, those holding the gem's table)")
	return f, c
}

func migrateCmd(ctx context.Context, args []string, stdout io.Writer) error {
	f, c := newMigrateFlags()
	if err := f.parse(args, stdout); err != nil {
		return err
	}
	if err := c.check(f); err != nil {
		return err
	}
	items, err := schemasFlag(f, c.schemas)
	if err != nil {
		return err
	}
	log, err := c.logger("migrate", stdout)
	if err != nil {
		return err
	}
	warnUnknownEnv(log)
	if items != nil {
		return migrateSchemas(ctx, c.databaseURL, items, relay.Source(c.source), log)
	}
	return migrate(ctx, c.databaseURL, c.schema, relay.Source(c.source), log)
}

func migrate(ctx context.Context, databaseURL, schema string, src relay.Source, log *zap.Logger) error {
	conn, err := connectDB(ctx, databaseURL, "stagedrain migrate")
	if err != nil {
		return fmt.Errorf("migrate: connect to %s: %w", relay.DescribeDatabase(databaseURL), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	res, err := relay.Migrate(ctx, conn, schema, relay.WithSource(src))
	if err != nil {
		return err
	}
	logMigrated(log, schema, src, res)
	return nil
}

// logMigrated writes migrate's line for a schema it migrated.
func logMigrated(log *zap.Logger, schema string, src relay.Source, res relay.MigrateResult) {
	if src == relay.SourceSidekiqStagedPush {
		log.Info("migrated", zap.String("schema", schema), zap.String("source", string(src)),
			zap.Strings("applied", res.Applied), zap.Int("version", res.Current))
		return
	}
	log.Info("migrated", zap.String("schema", schema), zap.Strings("applied", res.Applied), zap.Int("version", res.Current))
}

// warnUnknownEnv logs, at warn, each STAGEDRAIN_* variable of the
// environment that no command reads: a typo, or a setting this version does
// not have, would otherwise be ignored in silence. Never its value.
func warnUnknownEnv(log *zap.Logger) {
	for _, name := range unknownEnv(os.Environ()) {
		log.Warn("unknown environment variable, ignored", zap.String("name", name))
	}
}

// runFlags maps each flag of run onto relay.Config.
type runFlags struct {
	commonFlags
	redisURL         string
	redisMode        string
	target           string
	redisNamespace   string
	streamMaxLen     int64
	maxQueueLength   int64
	memoryRatio      float64
	batchSize        int
	pollInterval     time.Duration
	timestampFormat  string
	leaderInterval   time.Duration
	maxBackoff       time.Duration
	shutdownTimeout  time.Duration
	maxPayloadBytes  int
	waitReplicas     int
	waitTimeout      time.Duration
	waitForStandby   bool
	standbyRetention time.Duration
	horizonWarnAfter time.Duration
	pollOnly         bool
	queues           string
	schemas          string
	tenantKey        string
	migrate          bool
	metricsAddr      string
}

// flagOfField names the run flag behind each relay.Config field, so a
// Validate error reads as a flag error.
var flagOfField = map[string]string{
	"DatabaseURL":         "database-url",
	"Schema":              "schema",
	"Source":              "source",
	"BatchSize":           "batch-size",
	"PollInterval":        "poll-interval",
	"TimestampFormat":     "timestamp-format",
	"LeaderInterval":      "leader-interval",
	"MaxBackoff":          "max-backoff",
	"ShutdownTimeout":     "shutdown-timeout",
	"MaxPayloadBytes":     "max-payload-bytes",
	"Target":              "target",
	"RedisNamespace":      "redis-namespace",
	"StreamMaxLen":        "stream-maxlen",
	"MaxQueueLength":      "max-queue-length",
	"RedisMaxMemoryRatio": "redis-max-memory-ratio",
	"Queues":              "queues",
	"Schemas":             "schemas",
	"TenantKey":           "tenant-key",
	"RedisWaitReplicas":   "redis-wait-replicas",
	"RedisWaitTimeout":    "redis-wait-timeout",
	"StandbyRetention":    "standby-retention",
	"HorizonWarnAfter":    "horizon-warn-after",
}

// newRunFlags declares run's flags.
func newRunFlags() (*flagSet, *runFlags) {
	f := newFlagSet("run", "Drain committed staged jobs into Redis until SIGINT or SIGTERM. One relay per\n"+
		"schema drains; more wait as standbys and take over when it dies.")
	c := new(runFlags)
	c.register(f)
	f.fs.StringVar(&c.redisURL, "redis-url", "redis://127.0.0.1:6379/0", "Redis `URL` (password never logged)")
	f.env("redis-url", "REDIS_URL")
	f.fs.StringVar(&c.redisMode, "redis-mode", "single", "the `mode` of --redis-url: single (one server), cluster (Redis Cluster: redis://h1:p1?addr=h2:p2) or sentinel (redis://sentinel1:26379/0?master_name=mymaster&addr=sentinel2:26379)")
	f.env("redis-mode", "STAGEDRAIN_REDIS_MODE")
	f.fs.StringVar(&c.target, "target", "sidekiq", "the job `system` jobs are written for: "+targetsHelp())
	f.env("target", "STAGEDRAIN_TARGET")
	f.fs.StringVar(&c.redisNamespace, "redis-namespace", "", "prefix every Redis key with `namespace`: (Sidekiq 6 redis-namespace apps; not with --target asynq; BullMQ's prefix with --target bullmq, bull when unset)")
	f.env("redis-namespace", "STAGEDRAIN_REDIS_NAMESPACE")
	f.fs.Int64Var(&c.streamMaxLen, "stream-maxlen", 0, "with --target streams, trim each stream to about this many `entries` (XADD MAXLEN ~); 0 keeps every entry")
	f.env("stream-maxlen", "STAGEDRAIN_STREAM_MAXLEN")
	f.fs.Int64Var(&c.maxQueueLength, "max-queue-length", 0, "backpressure: push no more jobs to a queue that holds this many `jobs` (LLEN of Sidekiq's queue:<q> or asynq's pending list; a stream: entries its consumer groups have not acknowledged, Redis 7.0+); its jobs stay staged until it is below; 0 is off")
	f.env("max-queue-length", "STAGEDRAIN_MAX_QUEUE_LENGTH")
	f.fs.Float64Var(&c.memoryRatio, "redis-max-memory-ratio", 0, "backpressure: pause every push while Redis's used_memory / maxmemory is at or above this `ratio` (0-1, read every 500ms); off when 0 or Redis has no maxmemory")
	f.env("redis-max-memory-ratio", "STAGEDRAIN_REDIS_MAX_MEMORY_RATIO")
	f.fs.IntVar(&c.batchSize, "batch-size", 1000, "most jobs claimed, pushed and deleted per batch (1-100000)")
	f.env("batch-size", "STAGEDRAIN_BATCH_SIZE")
	f.fs.DurationVar(&c.pollInterval, "poll-interval", time.Second, "mean `interval` of the jittered fallback poll")
	f.env("poll-interval", "STAGEDRAIN_POLL_INTERVAL")
	f.fs.StringVar(&c.timestampFormat, "timestamp-format", "seconds", "created_at/enqueued_at `format`: seconds (float, Sidekiq 6/7/8) or millis (integer, Sidekiq 8 only)")
	f.env("timestamp-format", "STAGEDRAIN_TIMESTAMP_FORMAT")
	f.fs.DurationVar(&c.leaderInterval, "leader-interval", 500*time.Millisecond, "how often a standby tries to take over; the leader pings its lock twice as often and loses it after 2.5 intervals (at least 1s) of silence")
	f.env("leader-interval", "STAGEDRAIN_LEADER_INTERVAL")
	f.fs.DurationVar(&c.maxBackoff, "max-backoff", 5*time.Second, "cap of the exponential backoff between retries after a PostgreSQL or Redis failure")
	f.env("max-backoff", "STAGEDRAIN_MAX_BACKOFF")
	f.fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", 10*time.Second, "how long the batch in flight at SIGTERM may take to finish before it is rolled back")
	f.env("shutdown-timeout", "STAGEDRAIN_SHUTDOWN_TIMEOUT")
	f.fs.IntVar(&c.maxPayloadBytes, "max-payload-bytes", 1<<20, "largest job payload (JSON `bytes`) pushed; a bigger one moves to staged_jobs_dead")
	f.env("max-payload-bytes", "STAGEDRAIN_MAX_PAYLOAD_BYTES")
	f.fs.IntVar(&c.waitReplicas, "redis-wait-replicas", 0, "delete a batch's rows only once this many Redis `replicas` acknowledged its push (WAIT); with fewer, the rows stay staged and the batch is retried. 0: once the primary answered")
	f.env("redis-wait-replicas", "STAGEDRAIN_REDIS_WAIT_REPLICAS")
	f.fs.DurationVar(&c.waitTimeout, "redis-wait-timeout", time.Second, "how long WAIT waits for --redis-wait-replicas (keep it below the Redis read timeout, 3s by default)")
	f.env("redis-wait-timeout", "STAGEDRAIN_REDIS_WAIT_TIMEOUT")
	f.fs.BoolVar(&c.waitForStandby, "wait-for-standby", false, "push a job only once a PostgreSQL standby has flushed its commit (the synchronous ones when synchronous_standby_names is set, else every connected one), so a failover cannot take back the data of a job that ran; costs the replication lag; needs pg_monitor")
	f.env("wait-for-standby", "STAGEDRAIN_WAIT_FOR_STANDBY")
	f.fs.DurationVar(&c.standbyRetention, "standby-retention", 10*time.Second, "when the role cannot read the standbys' positions (no pg_monitor), keep each handoff record field this long after its delete, so a standby promoted within it does not bring its jobs back to be pushed twice; 0: none")
	f.env("standby-retention", "STAGEDRAIN_STANDBY_RETENTION")
	f.fs.DurationVar(&c.horizonWarnAfter, "horizon-warn-after", 30*time.Second, "log one warn line naming the session, prepared transaction, replication slot or standby that has held the database's xmin horizon back this long (dead rows of staged_jobs cannot be removed meanwhile); its age is stagedrain_xmin_horizon_age_seconds either way; 0: no check")
	f.env("horizon-warn-after", "STAGEDRAIN_HORIZON_WARN_AFTER")
	f.fs.BoolVar(&c.pollOnly, "poll-only", false, "drain on the fallback poll alone: no LISTEN, no wake-up gate (for PgBouncer in transaction pooling mode; pair with a short --poll-interval)")
	f.env("poll-only", "STAGEDRAIN_POLL_ONLY")
	f.fs.StringVar(&c.queues, "queues", "", "drain only these `queues` (comma list), as a group with a leader lock of its own; relays of a schema must have equal or disjoint lists (default: all queues)")
	f.env("queues", "STAGEDRAIN_QUEUES")
	registerSchemas(f, &c.schemas, "drain many schemas from one process: a comma `list` of schema names and patterns such as tenant_* (a schema is drained once it holds the table; new ones are found within --poll-interval); instead of --schema")
	f.fs.StringVar(&c.tenantKey, "tenant-key", "", "put the name of each job's schema into the job under this `key` (such as apartment, for apartment-sidekiq): a key of Sidekiq's job hash, an asynq header, a stream field; a row whose options name another tenant under it is dead-lettered (default: off)")
	f.env("tenant-key", "STAGEDRAIN_TENANT_KEY")
	f.fs.BoolVar(&c.migrate, "migrate", false, "run migrate before draining (retried until PostgreSQL answers)")
	f.env("migrate", "STAGEDRAIN_MIGRATE")
	registerMetricsAddr(f, &c.metricsAddr)
	f.required("redis-url", "timestamp-format", "target", "tenant-key")
	return f, c
}

// config checks run's flags and returns the relay's configuration, but
// for its Redis client and logger, and the options of that client. It
// connects to nothing.
func (c *runFlags) config(f *flagSet) (relay.Config, func() redis.UniversalClient, error) {
	if err := c.check(f); err != nil {
		return relay.Config{}, nil, err
	}
	// relay.Config reads 0 as "the default"; on the command line 0 is a
	// mistake, so say so instead.
	if c.batchSize < 1 {
		return relay.Config{}, nil, usagef("run: %s must be between 1 and 100000, got %d", f.source("batch-size"), c.batchSize)
	}
	if c.maxPayloadBytes < 1 {
		return relay.Config{}, nil, usagef("run: %s must be positive, got %d", f.source("max-payload-bytes"), c.maxPayloadBytes)
	}
	for _, d := range []struct {
		name string
		d    time.Duration
	}{
		{"poll-interval", c.pollInterval}, {"leader-interval", c.leaderInterval},
		{"max-backoff", c.maxBackoff}, {"shutdown-timeout", c.shutdownTimeout},
		{"redis-wait-timeout", c.waitTimeout},
	} {
		if d.d <= 0 {
			return relay.Config{}, nil, usagef("run: %s must be positive, got %s", f.source(d.name), d.d)
		}
	}
	var queues []string
	if c.queues != "" {
		queues = strings.Split(c.queues, ",")
		for i, q := range queues {
			queues[i] = strings.TrimSpace(q)
		}
	}
	schemas, err := schemasFlag(f, c.schemas)
	if err != nil {
		return relay.Config{}, nil, err
	}
	newRedis, err := c.redisClient(f)
	if err != nil {
		return relay.Config{}, nil, err
	}
	if !metricsOff(c.metricsAddr) {
		if err := checkMetricsAddr(c.metricsAddr); err != nil {
			return relay.Config{}, nil, usagef("run: %s %s", f.source("metrics-addr"), err)
		}
	}
	cfg := relay.Config{
		DatabaseURL:         c.databaseURL,
		Schema:              c.schema,
		Source:              relay.Source(c.source),
		Target:              relay.Target(c.target),
		RedisNamespace:      c.redisNamespace,
		StreamMaxLen:        c.streamMaxLen,
		MaxQueueLength:      c.maxQueueLength,
		RedisMaxMemoryRatio: c.memoryRatio,
		BatchSize:           c.batchSize,
		PollInterval:        c.pollInterval,
		TimestampFormat:     relay.TimestampFormat(c.timestampFormat),
		LeaderInterval:      c.leaderInterval,
		MaxBackoff:          c.maxBackoff,
		ShutdownTimeout:     c.shutdownTimeout,
		MaxPayloadBytes:     c.maxPayloadBytes,
		RedisWaitReplicas:   c.waitReplicas,
		RedisWaitTimeout:    c.waitTimeout,
		WaitForStandby:      c.waitForStandby,
		StandbyRetention:    c.standbyRetention,
		HorizonWarnAfter:    c.horizonWarnAfter,
		PollOnly:            c.pollOnly,
		Queues:              queues,
		Schemas:             schemas,
		TenantKey:           c.tenantKey,
	}
	if len(schemas) > 0 {
		cfg.Schema = ""
	}
	if cfg.StandbyRetention == 0 {
		cfg.StandbyRetention = -1 // the library's "none"; its 0 is the default
	}
	switch {
	case c.horizonWarnAfter < 0:
		return relay.Config{}, nil, usagef("run: %s must not be negative, got %s", f.source("horizon-warn-after"), c.horizonWarnAfter)
	case c.horizonWarnAfter == 0:
		cfg.HorizonWarnAfter = -1 // the library's "off"; its 0 is the default
	}
	// Validate only checks that a client is set; the caller makes it.
	check := cfg
	check.Redis = (*redis.Client)(nil)
	if err := check.WithDefaults().Validate(); err != nil {
		var fe *relay.FieldError
		if errors.As(err, &fe) && flagOfField[fe.Field] != "" {
			return relay.Config{}, nil, usagef("run: %s %s", f.source(flagOfField[fe.Field]), fe.Reason)
		}
		return relay.Config{}, nil, err
	}
	return cfg, newRedis, nil
}

func runCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	f, c := newRunFlags()
	if err := f.parse(args, stdout); err != nil {
		return err
	}
	cfg, newRedis, err := c.config(f)
	if err != nil {
		return err
	}
	log, err := c.logger("run", stdout)
	if err != nil {
		return err
	}
	defer log.Sync() //nolint:errcheck // stdout
	warnUnknownEnv(log)

	// Spans (console) go to stderr, beside the logs on stdout.
	tp, flushTraces, err := tracerProvider(ctx, os.Getenv, stderr)
	if err != nil {
		return err
	}
	if tp != nil { // tracing.go: an exporter is chosen by OTEL_* variables
		cfg.TracerProvider = tp
		defer func() { _ = withTimeout(context.WithoutCancel(ctx), 5*time.Second, flushTraces) }()
	}
	rdb := newRedis()
	defer rdb.Close()
	cfg.Redis, cfg.Logger = rdb, log
	r, err := relay.New(cfg)
	if err != nil {
		return err // config checked it
	}
	// Listen before migrating, so that /healthz answers (and /readyz says
	// "starting") while --migrate waits for PostgreSQL.
	var l net.Listener
	if !metricsOff(c.metricsAddr) {
		if l, err = listenMetrics(f, c.metricsAddr); err != nil {
			return err
		}
		defer l.Close() // after Serve, a no-op; it closes it too
	}
	if c.migrate && len(cfg.Schemas) > 0 {
		// A schema that fails to migrate is logged, and the relay drains
		// the others (it sets that one aside, with its error, until it is
		// migrated); so is a list that matches no schema yet.
		err := retryMigrate(ctx, c.maxBackoff, log, func() error {
			return migrateSchemas(ctx, c.databaseURL, cfg.Schemas, relay.Source(c.source), log)
		})
		if se := (*schemasError)(nil); errors.As(err, &se) {
			log.Warn("migrate did not migrate every schema; draining those that are", zap.Error(err))
		} else if err != nil {
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
	} else if c.migrate {
		if err := migrateWithRetry(ctx, c.databaseURL, c.schema, relay.Source(c.source), c.maxBackoff, log); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return nil // stopped while waiting for PostgreSQL
		}
	}
	return runRelay(ctx, r, l, log)
}

// migrateWithRetry runs migrate until it succeeds, ctx ends, or it fails for
// a reason other than an unreachable server.
func migrateWithRetry(ctx context.Context, databaseURL, schema string, src relay.Source, maxBackoff time.Duration, log *zap.Logger) error {
	return retryMigrate(ctx, maxBackoff, log, func() error { return migrate(ctx, databaseURL, schema, src, log) })
}

// retryMigrate runs migrate until it succeeds, ctx ends (nil), or it fails
// for a reason other than an unreachable server.
func retryMigrate(ctx context.Context, maxBackoff time.Duration, log *zap.Logger, migrate func() error) error {
	wait := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := migrate()
		if err == nil || ctx.Err() != nil {
			return nil
		}
		if se := (*schemasError)(nil); errors.As(err, &se) || !transient(err) {
			return err // the server answered and said no: waiting will not help
		}
		log.Warn("migrate failed, retrying", zap.Error(err), zap.Int("attempt", attempt), zap.Duration("wait", wait))
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		wait = min(2*wait, maxBackoff)
	}
}

// transient reports whether migrate failed for a reason that waiting may
// fix: no answer from the server, or an answer that it cannot take a
// session now (starting up, shutting down, out of connections, the
// connection broken).
func transient(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return true // no answer: unreachable
	}
	switch pgErr.Code {
	case "57P03", // cannot_connect_now: starting up, shutting down, in recovery
		"57P01", // admin_shutdown
		"57P02", // crash_shutdown
		"53300": // too_many_connections
		return true
	}
	return strings.HasPrefix(pgErr.Code, "08") // connection_exception
}

// runRedisOptions are the options of run's Redis client in single mode,
// from its URL.
func runRedisOptions(url string) (*redis.Options, error) {
	ropts, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	tuneRedisClient(&ropts.ClientName, &ropts.DisableIdentity, &ropts.DialerRetries, &ropts.MaxRetries)
	ropts.Dialer = redisDialer(ropts.DialTimeout, ropts.TLSConfig)
	return ropts, nil
}

// tuneRedisClient sets what run's Redis client has in every --redis-mode:
// its name, no CLIENT SETINFO (unknown to Redis < 7.2), one dial and no
// retries (MaxRetries -1, whatever the URL says). The relay retries failed
// batches with its own logged backoff, after settling an unanswered push
// from its record under a new fence token (relay/internal/handoff). go-redis
// would resend a push whose reply timed out, on a new connection, while the
// first copy may still run: the script is safe to run twice, and is not
// resent at all.
func tuneRedisClient(name *string, noIdentity *bool, dialerRetries, maxRetries *int) {
	*name, *noIdentity, *dialerRetries, *maxRetries = "stagedrain", true, 1, -1
}

// redisDialer dials Redis as go-redis's default dialer does (dial_timeout,
// default 5s; TLS for rediss://), with the relay's TCP keepalives: a Redis
// host that vanishes is found within about 11s on a connection idle between
// batches, against 45s with go-redis's own. Commands on a busy connection
// have go-redis's read and write timeouts (5s each by default).
func redisDialer(timeout time.Duration, tlsConfig *tls.Config) func(context.Context, string, string) (net.Conn, error) {
	d := &net.Dialer{Timeout: cmp.Or(timeout, 5*time.Second), KeepAliveConfig: relay.KeepAlive()}
	if tlsConfig == nil {
		return d.DialContext
	}
	return (&tls.Dialer{NetDialer: d, Config: tlsConfig}).DialContext
}

// targetsHelp lists the targets for --target's help, as their Specs name
// them: "sidekiq, asynq, ... or celery (Celery task protocol 2)".
func targetsHelp() string {
	var helps []string
	for _, t := range relay.Targets() {
		helps = append(helps, t.Help)
	}
	if len(helps) < 2 {
		return strings.Join(helps, "")
	}
	return strings.Join(helps[:len(helps)-1], ", ") + " or " + helps[len(helps)-1]
}

// redisClient checks --redis-url for --redis-mode and returns what makes
// the client: go-redis's Client (single), ClusterClient (cluster) or
// FailoverClient (sentinel), each with run's retries and keepalives.
func (c *runFlags) redisClient(f *flagSet) (func() redis.UniversalClient, error) {
	switch c.redisMode {
	case "single":
		ropts, err := runRedisOptions(c.redisURL)
		if err != nil {
			return nil, usagef("run: %s cannot be parsed (want redis://[user:password@]host:port/db, or rediss:// for TLS)", f.source("redis-url"))
		}
		return func() redis.UniversalClient { return redis.NewClient(ropts) }, nil
	case "cluster":
		for _, t := range relay.Targets() {
			if string(t.Name) == c.target && t.NoCluster != "" {
				return nil, usagef("run: %s cluster cannot run the %s target: %s", f.source("redis-mode"), t.Name, t.NoCluster)
			}
		}
		ropts, err := redis.ParseClusterURL(c.redisURL)
		if err != nil {
			return nil, usagef("run: %s cannot be parsed as a cluster URL (want redis://[user:password@]host1:port1?addr=host2:port2&addr=host3:port3)", f.source("redis-url"))
		}
		tuneRedisClient(&ropts.ClientName, &ropts.DisableIdentity, &ropts.DialerRetries, &ropts.MaxRetries)
		// A ClusterClient also resends a command that timed out, up to
		// MaxRedirects times: none (-1). A MOVED reply fails the batch,
		// which the relay retries once go-redis has reloaded the slots.
		ropts.MaxRedirects = -1
		ropts.Dialer = redisDialer(ropts.DialTimeout, ropts.TLSConfig)
		return func() redis.UniversalClient { return redis.NewClusterClient(ropts) }, nil
	case "sentinel":
		ropts, err := redis.ParseFailoverURL(c.redisURL)
		if err != nil || ropts.MasterName == "" {
			return nil, usagef("run: %s cannot be parsed as a sentinel URL (want redis://[user:password@]sentinel1:26379/db?master_name=mymaster&addr=sentinel2:26379[&password=...])", f.source("redis-url"))
		}
		tuneRedisClient(&ropts.ClientName, &ropts.DisableIdentity, &ropts.DialerRetries, &ropts.MaxRetries)
		ropts.Dialer = redisDialer(ropts.DialTimeout, ropts.TLSConfig)
		return func() redis.UniversalClient { return redis.NewFailoverClient(ropts) }, nil
	default:
		return nil, usagef("run: %s must be single, cluster or sentinel, got %q", f.source("redis-mode"), c.redisMode)
	}
}
