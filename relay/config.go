package relay

import (
	"cmp"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
)

// TimestampFormat selects how created_at and enqueued_at are written into a
// Sidekiq payload.
type TimestampFormat string

const (
	// TimestampSeconds writes float epoch seconds (1732891234.123456), as
	// Sidekiq 6.x and 7.x do. Sidekiq 8 reads it too, so it is the default.
	TimestampSeconds TimestampFormat = "seconds"
	// TimestampMillis writes integer epoch milliseconds (1732891234123), as
	// Sidekiq 8 does. Sidekiq 7.x misreads it: use it only for an all-8 fleet.
	TimestampMillis TimestampFormat = "millis"
)

// Target names the job system whose Redis layout the relay writes. One
// relay writes one target.
type Target string

const (
	// TargetSidekiq writes Sidekiq's queues and schedule (internal/target/sidekiq.go). The
	// default.
	TargetSidekiq Target = "sidekiq"
	// TargetAsynq writes asynq's tasks (internal/target/asynq.go): hibiken/asynq servers
	// process them. asynq's key names are fixed: RedisNamespace must be "".
	TargetAsynq Target = "asynq"
	// TargetStreams appends an entry to the Redis stream stream:<queue> per
	// job (internal/target/streams.go). Streams have no scheduler: a job whose run_at is in
	// the future stays staged until it is due.
	TargetStreams Target = "streams"
	// TargetBullMQ adds BullMQ 6 jobs (internal/target/bullmq.go), as Queue.add does: a
	// BullMQ Worker runs them. RedisNamespace is BullMQ's prefix ("" means
	// its default, "bull").
	TargetBullMQ Target = "bullmq"
	// TargetCelery LPUSHes a Celery task message (protocol 2, Kombu's
	// Redis transport) per job onto the list of its queue (internal/target/celery.go). A
	// job whose run_at is in the future stays staged until it is due. Not
	// on Redis Cluster.
	TargetCelery Target = "celery"
)

// Config configures a Relay. The zero value of every field but DatabaseURL
// and Redis means its default; WithDefaults fills them in.
type Config struct {
	// DatabaseURL is the PostgreSQL connection string (URL or key=value form).
	// Required. The listener needs a direct connection (not PgBouncer in
	// transaction mode), as LISTEN is session state.
	DatabaseURL string

	// Redis is the client jobs are pushed through. Required. The relay does
	// not close it. A *redis.Client (also from redis.NewFailoverClient, for
	// Sentinel) is one server; a *redis.ClusterClient makes each batch's
	// push one atomic step per hash slot (internal/handoff), and is refused with
	// TargetSidekiq, whose keys have no hash tags. A *redis.Ring is refused. Run PINGs it before campaigning to lead: a refusal of
	// its credentials or DB is returned then (mid-run it is retried), and an
	// unreachable Redis is waited for. Logs and errors name it with
	// DescribeRedis, never with its password. The relay retries failed batches itself, with logged
	// backoff; a client with DialerRetries: 1 and MaxRetries: 1 (as
	// stagedrain run uses) reports a dead Redis at once instead of spending
	// seconds on its own retries first.
	Redis redis.UniversalClient

	// Schema is the PostgreSQL schema holding staged_jobs (or, with
	// SourceSidekiqStagedPush, the gem's table). Default "public".
	Schema string

	// Schemas, when set, makes one relay drain many schemas instead of
	// Schema (which must then be empty): each item a schema name or a
	// pattern with '*' (ParseSchemas), such as "tenant_*". The relay
	// drains every schema they name that holds the source's table, looks
	// again every PollInterval (a new schema is picked up, a dropped one
	// let go), and shares among them one lock connection, one listener
	// and a drain pool of 4 connections. Each schema keeps its own leader
	// lock, fence and handoff record, wake gate and dead letters; relays
	// with the same Schemas (and Queues) split the schemas between them,
	// each leading its share (fleet.go). Default none: Schema.
	Schemas []string

	// Source is the table drained: SourceStagedJobs (<Schema>.staged_jobs,
	// made by Migrate) or SourceSidekiqStagedPush (the sidekiq-staged_push
	// gem's <Schema>.sidekiq_staged_push_jobs, given its wake trigger by
	// Migrate with WithSource). Default SourceStagedJobs. One relay drains
	// a schema at a time, whatever its source.
	Source Source

	// Target is the job system the jobs are written for: TargetSidekiq,
	// TargetAsynq, TargetStreams, TargetBullMQ or TargetCelery. Default
	// TargetSidekiq.
	Target Target

	// RedisNamespace, when set, prefixes every Redis key with
	// RedisNamespace + ":": Sidekiq's (the redis-namespace layout of
	// Sidekiq 6 apps), the streams', Celery's lists (its workers set
	// Kombu's global_keyprefix to RedisNamespace + ":"), and the relay's
	// own fence and handoff record. Default "" (no prefix, as Sidekiq 7
	// and later use). asynq's key names are fixed, so it must be "" with
	// TargetAsynq. With TargetBullMQ it is BullMQ's prefix of the queues'
	// keys, "bull" when "" (the relay's own keys then have none).
	RedisNamespace string

	// StreamMaxLen, for TargetStreams, trims each stream to about this many
	// entries as it is written (XADD MAXLEN ~). Default 0: no trimming.
	StreamMaxLen int64

	// MaxQueueLength, when positive, is backpressure per destination
	// queue: the relay pushes no more jobs to a queue that holds this many
	// or more (Sidekiq's queue:<q> and asynq's pending list by LLEN, a
	// BullMQ queue by its wait and paused lists and prioritized set
	// together, a Celery queue by the LLEN of its list and its priority
	// lists; a
	// stream by the entries its slowest consumer group has not
	// acknowledged, pending plus lag, which needs Redis 7.0 or later (Run
	// refuses an older one), or by XLEN while it has no group; checked in
	// the push script, so a queue overshoots by at most one batch). Its
	// rows stay staged, other queues flow, and it resumes once the queue is
	// below the limit. Sidekiq's schedule and asynq's scheduled sets are
	// not limited. Default 0: off.
	MaxQueueLength int64

	// RedisMaxMemoryRatio, when positive, pauses every push while Redis's
	// used_memory / maxmemory (INFO memory, read at most every 500ms) is
	// at or above it; rows stay staged until it is below. Off when Redis
	// has no maxmemory. Between 0 and 1; default 0: off.
	RedisMaxMemoryRatio float64

	// BatchSize is the most rows claimed, pushed and deleted per batch.
	// Default 1000.
	BatchSize int

	// PollInterval is the mean of the jittered fallback poll that drains
	// even when no notification arrives. Default 1s.
	PollInterval time.Duration

	// PollOnly makes the relay neither LISTEN nor go idle for the wake
	// trigger (it never takes the gate's idle lock, so commits never
	// NOTIFY): it drains on the fallback poll alone, every
	// PollInterval. For a DatabaseURL that goes through PgBouncer in
	// transaction pooling mode, where LISTEN does not work. Default false.
	PollOnly bool

	// TimestampFormat is how created_at and enqueued_at are written into a
	// Sidekiq payload; TargetAsynq writes no such field, and TargetStreams
	// writes integer epoch milliseconds, so for them it must be
	// TimestampSeconds. Default TimestampSeconds.
	TimestampFormat TimestampFormat

	// LeaderInterval is how often a standby tries to take the leader lock;
	// the leader pings its lock connection twice as often. A leader that
	// stops pinging (frozen, or cut off) loses the connection, and the lock,
	// after 2.5 x LeaderInterval (at least 1s): PostgreSQL's
	// idle_session_timeout, which needs PostgreSQL 14. A standby then takes
	// over within 1.25 x LeaderInterval more. Default 500ms: takeover within
	// 1.9s of a freeze.
	LeaderInterval time.Duration

	// MaxBackoff caps the exponential backoff between retries after a
	// PostgreSQL or Redis failure. Retries start at 100ms; jitter only
	// shortens a wait, so none exceeds MaxBackoff. Default 5s.
	MaxBackoff time.Duration

	// MaxPayloadBytes is the largest job payload the relay pushes: a
	// Sidekiq job's JSON, an asynq task's encoded message, the sum of a
	// stream entry's field values, a Celery task message's JSON. A row
	// whose payload is bigger is poison: it moves to staged_jobs_dead
	// instead of into Redis. Default 1 MiB (1048576); at most 512 MiB,
	// Redis's own limit on a string.
	MaxPayloadBytes int

	// Queues, when set, makes the relay drain only the rows whose queue is
	// one of these, as one group of relays: relays with the same set (in
	// any order) are its leader and standbys, with a leader lock, fence
	// and handoff record of their own, so several groups share one table.
	// A relay refuses to run (ErrQueueConflict) beside a relay whose set
	// overlaps its own without being equal, or beside a relay for all
	// queues (Queues empty). Names must be non-empty and distinct. Default
	// none: every queue.
	Queues []string

	// RedisWaitReplicas, when above 0, makes every batch's delete wait for
	// Redis's WAIT: the push is acknowledged by at least this many replicas
	// within RedisWaitTimeout, or the batch's rows stay staged and the
	// relay retries (logged, with backoff). A failover to a replica, or an
	// OS crash of the primary, then cannot lose a job whose row was
	// deleted. Needs a *redis.Client (one server, or Sentinel); refused
	// with a ClusterClient. Default 0: the delete commits once the primary
	// answered.
	RedisWaitReplicas int

	// RedisWaitTimeout is how long WAIT waits for RedisWaitReplicas
	// replicas. Default 1s.
	RedisWaitTimeout time.Duration

	// WaitForStandby makes the relay push a batch only once a standby has
	// flushed the commits of its rows: the synchronous standbys when
	// synchronous_standby_names is set, otherwise every connected
	// physical standby (at least one). A failover then cannot take back
	// the data of a job that ran. It costs each batch the replication lag,
	// and a batch that no standby covers within 5s is rolled back and
	// retried. Needs pg_monitor (or pg_read_all_stats) for
	// pg_stat_replication's positions (a role without it is refused, as
	// it starts). With synchronous replication the relay waits for the
	// synchronous standbys without this option too, when its role can
	// read their positions (a commit whose wait for the standby was
	// cancelled is visible without being on it). Default false
	// (standby.go).
	WaitForStandby bool

	// StandbyRetention is how long a handoff record field is kept after
	// the delete it covers committed, when standbys are connected whose
	// flush positions the role cannot read (it lacks pg_monitor or
	// pg_read_all_stats): a standby promoted within it has the delete, or
	// its rows are recognised and deleted, not pushed twice. Where the
	// positions can be read, fields are kept until every standby has the
	// delete, and this is not used. Costs Redis about 8 bytes per job
	// pushed within the window (20,000 jobs/s for 10s: about 1.6 MB).
	// Default 10s; -1 keeps none past the local flush.
	StandbyRetention time.Duration

	// ShutdownTimeout bounds how long a batch in flight when the context
	// ends may take to finish; past it the batch is rolled back (its rows
	// stay staged). Default 10s.
	ShutdownTimeout time.Duration

	// TenantKey, when set, puts the name of the schema each job was staged
	// in into the job under this key, so that a worker of a
	// schema-per-tenant app switches to the right tenant (tenant.go): a
	// top-level key of the Sidekiq job hash (apartment-sidekiq reads
	// "apartment"), a header of the asynq task, a field of the stream
	// entry, a header of the Celery task message. With Schemas, each job
	// gets its own schema's name. A row whose options already name
	// another tenant under the key is poison (moved to staged_jobs_dead;
	// SourceSidekiqStagedPush: left staged and skipped); one naming its
	// own schema passes. It may not be a key the
	// Target's format owns (class, args, retry, ...). Default "": off.
	TenantKey string

	// Logger receives structured logs. Default zap.NewNop().
	Logger *zap.Logger

	// TracerProvider, when set, makes the relay trace each batch (claim,
	// push, commit) as one span, linked to the spans that staged its jobs
	// (trace.go). Default nil: no spans, and nothing spent per job on
	// them. Jobs carry their trace context to the workers either way.
	TracerProvider trace.TracerProvider

	// HorizonWarnAfter is how long something (a session's snapshot or
	// transaction, a prepared transaction, a replication slot, a standby's
	// hot_standby_feedback) may hold the database's xmin horizon back
	// before the relay logs one warn line naming it and the dead rows of
	// its table (horizon.go; README, "A long transaction elsewhere"). The
	// age is the metric stagedrain_xmin_horizon_age_seconds either way.
	// Naming a session of another role needs pg_read_all_stats (or
	// pg_monitor). Default 30s; -1 turns the check off.
	HorizonWarnAfter time.Duration
}

const (
	defaultSchema           = "public"
	defaultBatchSize        = 1000
	defaultPollInterval     = time.Second
	defaultLeaderInterval   = 500 * time.Millisecond
	defaultMaxBackoff       = 5 * time.Second
	defaultShutdownTimeout  = 10 * time.Second
	defaultRedisWaitTimeout = time.Second
	defaultStandbyRetention = 10 * time.Second
	defaultMaxPayloadBytes  = 1 << 20
	defaultHorizonWarnAfter = 30 * time.Second
	maxMaxPayloadBytes      = 512 << 20
	minBackoff              = 100 * time.Millisecond
)

// WithDefaults returns a copy of c with every unset field set to its default.
func (c Config) WithDefaults() Config {
	if len(c.Schemas) == 0 {
		c.Schema = cmp.Or(c.Schema, defaultSchema)
	}
	c.Source = cmp.Or(c.Source, SourceStagedJobs)
	c.Target = cmp.Or(c.Target, TargetSidekiq)
	c.BatchSize = cmp.Or(c.BatchSize, defaultBatchSize)
	c.PollInterval = cmp.Or(c.PollInterval, defaultPollInterval)
	c.TimestampFormat = cmp.Or(c.TimestampFormat, TimestampSeconds)
	c.LeaderInterval = cmp.Or(c.LeaderInterval, defaultLeaderInterval)
	c.MaxBackoff = cmp.Or(c.MaxBackoff, defaultMaxBackoff)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, defaultShutdownTimeout)
	c.MaxPayloadBytes = cmp.Or(c.MaxPayloadBytes, defaultMaxPayloadBytes)
	c.RedisWaitTimeout = cmp.Or(c.RedisWaitTimeout, defaultRedisWaitTimeout)
	c.StandbyRetention = cmp.Or(c.StandbyRetention, defaultStandbyRetention)
	c.HorizonWarnAfter = cmp.Or(c.HorizonWarnAfter, defaultHorizonWarnAfter)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// FieldError names the Config field that failed Validate.
type FieldError struct {
	Field  string // the Config field, e.g. "BatchSize"
	Reason string // what is wrong, e.g. "must be between 1 and 100000, got 0"
}

func (e *FieldError) Error() string { return e.Field + " " + e.Reason }

func fieldErr(field, format string, args ...any) error {
	return &FieldError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// Validate reports the first field of c that cannot work, as a *FieldError.
// Call it on the result of WithDefaults.
func (c Config) Validate() error {
	switch {
	case c.DatabaseURL == "":
		return fieldErr("DatabaseURL", "is required")
	case c.Redis == nil:
		return fieldErr("Redis", "is required")
	case c.BatchSize < 1 || c.BatchSize > 100_000:
		return fieldErr("BatchSize", "must be between 1 and 100000, got %d", c.BatchSize)
	case c.PollInterval < 10*time.Millisecond:
		return fieldErr("PollInterval", "must be at least 10ms, got %s", c.PollInterval)
	case c.TimestampFormat != TimestampSeconds && c.TimestampFormat != TimestampMillis:
		return fieldErr("TimestampFormat", "must be %q or %q, got %q", TimestampSeconds, TimestampMillis, c.TimestampFormat)
	case c.LeaderInterval < 10*time.Millisecond:
		return fieldErr("LeaderInterval", "must be at least 10ms, got %s", c.LeaderInterval)
	case c.MaxBackoff < minBackoff:
		return fieldErr("MaxBackoff", "must be at least %s, got %s", minBackoff, c.MaxBackoff)
	case c.MaxPayloadBytes < 1 || c.MaxPayloadBytes > maxMaxPayloadBytes:
		return fieldErr("MaxPayloadBytes", "must be between 1 and %d, got %d", maxMaxPayloadBytes, c.MaxPayloadBytes)
	case c.HorizonWarnAfter < 0 && c.HorizonWarnAfter != -1:
		return fieldErr("HorizonWarnAfter", "must be positive, or -1 to turn the check off, got %s", c.HorizonWarnAfter)
	case c.ShutdownTimeout < 0:
		return fieldErr("ShutdownTimeout", "must not be negative, got %s", c.ShutdownTimeout)
	case !c.Target.known():
		return fieldErr("Target", "must be %s, got %q", targetNames(), c.Target)
	case c.Target.spec().FixedKeys != "" && c.RedisNamespace != "":
		return fieldErr("RedisNamespace", "%s", c.Target.spec().FixedKeys)
	case !c.Target.spec().Timestamps && c.TimestampFormat != TimestampSeconds:
		return fieldErr("TimestampFormat", "applies to the sidekiq target only, got %q with the %s target", c.TimestampFormat, c.Target)
	case isCluster(c.Redis) && c.Target.spec().NoCluster != "":
		return fieldErr("Redis", "is a Redis Cluster client, and the %s target cannot run on Redis Cluster: %s", c.Target, c.Target.spec().NoCluster)
	case isRing(c.Redis):
		return fieldErr("Redis", "is a *redis.Ring, which splits keys over shards: the relay's push would not be atomic (use a *redis.Client, a Sentinel FailoverClient or a *redis.ClusterClient)")
	case c.RedisWaitReplicas < 0:
		return fieldErr("RedisWaitReplicas", "must not be negative, got %d", c.RedisWaitReplicas)
	case c.RedisWaitReplicas > 0 && isCluster(c.Redis):
		return fieldErr("RedisWaitReplicas", "needs a single Redis or Sentinel client: with Redis Cluster each slot's primary has replicas of its own, which this relay does not WAIT for")
	case c.RedisWaitTimeout <= 0:
		return fieldErr("RedisWaitTimeout", "must be positive, got %s", c.RedisWaitTimeout)
	case c.MaxQueueLength < 0:
		return fieldErr("MaxQueueLength", "must not be negative, got %d", c.MaxQueueLength)
	case !(c.RedisMaxMemoryRatio >= 0 && c.RedisMaxMemoryRatio <= 1):
		return fieldErr("RedisMaxMemoryRatio", "must be between 0 and 1, got %v", c.RedisMaxMemoryRatio)
	case c.RedisMaxMemoryRatio > 0 && isCluster(c.Redis):
		return fieldErr("RedisMaxMemoryRatio", "needs a single Redis or Sentinel client: each Redis Cluster node has a maxmemory of its own")
	case c.StreamMaxLen < 0:
		return fieldErr("StreamMaxLen", "must not be negative, got %d", c.StreamMaxLen)
	case c.StreamMaxLen > 0 && !c.Target.spec().StreamMaxLen:
		return fieldErr("StreamMaxLen", "applies to the streams target only, got %d with the %s target", c.StreamMaxLen, c.Target)
	}
	if len(c.Schemas) > 0 {
		if c.Schema != "" {
			return fieldErr("Schemas", "and Schema are exclusive: name the one schema in Schemas, or set Schema alone")
		}
		if err := validateSchemas(c.Schemas); err != nil {
			return err
		}
	} else if err := validateSchemaName(c.Schema); err != nil {
		return err
	}
	if err := CheckSource(c.Source); err != nil {
		return err
	}
	if err := validateTenantKey(c.TenantKey, c.Target); err != nil {
		return err
	}
	if err := validateQueues(c.Queues); err != nil {
		return err
	}
	if len(c.Queues) > 0 && c.Source == SourceSidekiqStagedPush {
		return fieldErr("Queues", "cannot be used with the %s source, whose queue is inside each row's payload", SourceSidekiqStagedPush)
	}
	if err := CheckDatabaseURL(c.DatabaseURL); err != nil {
		return fieldErr("DatabaseURL", "%v", err)
	}
	return nil
}

// CheckSchema reports whether schema can name a PostgreSQL schema, as a
// *FieldError of field Schema: what Validate and Migrate check.
func CheckSchema(schema string) error { return validateSchemaName(schema) }

func validateSchemaName(schema string) error {
	if schema == "" || len(schema) > 63 {
		return fieldErr("Schema", "must be 1 to 63 bytes, got %d", len(schema))
	}
	if strings.IndexByte(schema, 0) >= 0 {
		return fieldErr("Schema", "must not contain a NUL byte")
	}
	return nil
}

func isCluster(rdb redis.UniversalClient) bool {
	_, ok := rdb.(*redis.ClusterClient)
	return ok
}

func isRing(rdb redis.UniversalClient) bool {
	_, ok := rdb.(*redis.Ring)
	return ok
}

func validateQueues(queues []string) error {
	seen := make(map[string]bool, len(queues))
	for _, q := range queues {
		switch {
		case q == "":
			return fieldErr("Queues", "must not name an empty queue")
		case strings.ContainsAny(q, ",\x00"):
			return fieldErr("Queues", "must not contain a comma or a NUL byte, got %q", q)
		case seen[q]:
			return fieldErr("Queues", "names queue %q twice", q)
		}
		seen[q] = true
	}
	return nil
}
