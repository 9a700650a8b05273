// Package relay is stagedrain as a Go library: it stages jobs in PostgreSQL
// inside the caller's transaction, and drains the committed ones into Redis
// job queues (Sidekiq's layout by default; asynq's, or Redis Streams). The
// stagedrain binary (cmd/stagedrain) is flags and logs around this package.
// The README says what the relay promises and how to operate it; this is the
// API.
//
// # Staging jobs
//
// A Stager INSERTs jobs into one schema's staged_jobs through the caller's
// transaction, so a job reaches Redis only if that transaction commits:
//
//	stager := relay.NewStager("public")
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		if _, err := tx.Exec(ctx, `INSERT INTO users (id, email) VALUES ($1, $2)`, 42, "ada@example.com"); err != nil {
//			return err
//		}
//		jid, err := stager.Stage(ctx, tx, relay.Job{Name: "WelcomeEmailJob", Args: []any{42}})
//		if err != nil {
//			return err
//		}
//		log.Printf("staged %s", jid)
//		return nil
//	})
//
// [Stager.Stage] returns the job's jid (fixed at INSERT, the same on every
// redelivery); [Stager.StageMany] stages a slice of jobs in one round trip
// and returns their jids in order (see ExampleStager_StageMany). A [Job] has
// Name (the worker class), Args (marshaled into a JSON array), Queue
// ("default" when empty), RunAt (the zero time: now; a future time
// schedules the job) and Options (extra payload fields, such as retry; the
// keys the relay writes from columns are refused). Any [Querier] will do:
// pgx.Tx, *pgx.Conn or *pgxpool.Pool, though only a transaction ties the job
// to the caller's other writes. Plain SQL works as well:
//
//	tx.Exec(ctx, "INSERT INTO staged_jobs (job_name, job_args) VALUES ($1, $2)", "WelcomeEmailJob", []any{42})
//
// # The schema
//
// [Migrate] creates the schema if missing, staged_jobs, its dead-letter
// table staged_jobs_dead and the wake trigger, applying in one transaction
// each migration of sql/ not yet recorded in <schema>.stagedrain_migrations.
// It is idempotent and safe from several processes at once, and it fails
// rather than wait more than 5s for a table lock. [MigrateResult] says what
// it applied and the version reached. With [WithSource] it migrates a
// [Source]: for [SourceSidekiqStagedPush] it adds the wake trigger and the
// low-water mark's statement trigger (sql/gem_002.sql) to the
// sidekiq-staged_push gem's table, and changes none of its columns. A fresh schema gets the baseline
// (sql/baseline_009.sql) and later migrations; an existing one the
// migrations it lacks: both end with identical catalogs. See
// ExampleMigrate.
//
// # Running a relay
//
// [New] checks a [Config] and returns a [Relay]; it connects to nothing.
// [Relay.Run] drains until its context ends, then finishes (or, after
// Config.ShutdownTimeout, rolls back) the batch in flight, releases the
// leader lock and returns nil:
//
//	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
//	r, err := relay.New(relay.Config{
//		DatabaseURL: "postgres://app@db.internal:5432/app?sslmode=verify-full",
//		Redis:       rdb,
//		Logger:      logger, // a *zap.Logger; none logs nothing
//	})
//	if err != nil {
//		return err // a *FieldError names the field
//	}
//	return r.Run(ctx)
//
// See ExampleNew. Only DatabaseURL (a direct connection: LISTEN does not
// work through PgBouncer in transaction mode, see Config.PollOnly) and Redis
// are required; [Config.WithDefaults] fills in the rest, and each field's
// comment gives its default and its flag's meaning (the README's flag table
// maps flags to fields). Config.Redis may be a *redis.Client (one server, or
// Sentinel through redis.NewFailoverClient) or a *redis.ClusterClient (not
// with [TargetSidekiq] or [TargetCelery]); the relay does not close it.
// Config.Target picks [TargetSidekiq], [TargetAsynq], [TargetStreams],
// [TargetBullMQ] or [TargetCelery]; Config.Source picks
// [SourceStagedJobs] or [SourceSidekiqStagedPush].
//
// Run retries lost connections to PostgreSQL and Redis with capped
// backoff, and returns an error only for what waiting cannot fix:
// rejected credentials or a missing database, [ErrNotMigrated] (run Migrate
// first), [ErrSchemaTooNew] (a newer stagedrain migrated the schema),
// [ErrPermission] (the role lacks a grant the README's "Least-privilege
// role" lists), [ErrQueueConflict] (Config.Queues overlaps another relay's
// without being equal) and [ErrForeignFence] (the Redis fence belongs to
// another PostgreSQL cluster), or, at start, Redis refusing the credentials
// or the DB. Run as many Relays per schema as you like, in other processes:
// one leads and drains, the others stand by and take over.
//
// # Many schemas
//
// With Config.Schemas (names and '*' patterns, as [ParseSchemas] reads
// them) instead of Config.Schema, one Relay drains every schema that holds
// the source's table, finds new ones and lets dropped ones go without a
// restart, and shares one lock connection, one listener and a drain pool
// of four connections among them; each schema keeps its own leader lock,
// fence, wake gate and dead letters, and its own error when it cannot be
// drained (Status().Schemas). Relays with the same Schemas split the
// schemas between them. Package relay/admin's ListSchemas lists the
// schemas a list names, as a relay finds them, for admin tools.
//
// # Health and metrics
//
// [Relay.Status] is a snapshot of what the relay is doing (a [Role], since
// when, its last drain and last error), with no I/O; [Relay.CheckReady]
// returns nil when it leads or stands by and PostgreSQL and Redis answer,
// else an error wrapping [ErrNotReady]: what stagedrain run's /readyz
// serves. [Relay.MetricsHandler] serves the relay's Prometheus metrics (each
// Relay has a registry of its own); [Relay.MetricsGatherer] adds them to
// yours, prometheus.Gatherers{r.MetricsGatherer(), reg}. [DescribeDatabase]
// and [DescribeRedis] name a server without its password, for logs. See
// ExampleRelay_CheckReady.
//
// # Operating a schema
//
// Package relay/admin (github.com/stagedrain/stagedrain/relay/admin) reads
// and repairs a schema as an operator does, whether a relay runs or not:
// its backlog and leaders (ReadStatus), its dead letters
// (ListDead, RetryDead, PurgeDead), what backpressure pauses (ReadPaused,
// from Redis) and the schemas a list names (ListSchemas). stagedrain
// status and dead are those functions and a printer; an application that
// stages jobs and runs relays needs none of them.
//
// # Testing an application
//
// Package relaytest (github.com/stagedrain/stagedrain/relay/relaytest)
// checks what the code under test staged, as its transaction sees it, and
// runs the real relay for a test that needs the jobs in Redis:
//
//	func TestSignup(t *testing.T) {
//		ctx := t.Context()
//		dbURL := "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
//		schema := relaytest.Schema(t, dbURL) // fresh, dropped when the test ends
//		conn := relaytest.Conn(t, dbURL)
//		if _, err := relay.Migrate(ctx, conn, schema); err != nil {
//			t.Fatal(err)
//		}
//		var job relaytest.StagedJob
//		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
//			if err := signup(ctx, tx, relay.NewStager(schema), "ada@example.com"); err != nil {
//				return err
//			}
//			// As the transaction sees it, before it commits:
//			job = relaytest.RequireStaged(t, tx, relaytest.Job{Name: "WelcomeEmailJob", Args: []any{42}},
//				relaytest.WithSchema(schema))
//			return nil
//		})
//		if err != nil {
//			t.Fatal(err)
//		}
//		rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
//		t.Cleanup(func() { rdb.Close() })
//		ns := relaytest.RedisNamespace(t, rdb) // its keys are deleted when the test ends
//		n := relaytest.Drain(ctx, t, relaytest.DrainConfig{
//			DatabaseURL: dbURL, Schema: schema, Redis: rdb, RedisNamespace: ns,
//		})
//		queued, _ := rdb.LRange(ctx, ns+":queue:default", 0, -1).Result()
//		if n != 1 || len(queued) != 1 || !strings.Contains(queued[0], job.JID) {
//			t.Fatalf("drained %d jobs, queue:default holds %q; want the job %s", n, queued, job.JID)
//		}
//	}
//
// RequireStaged wants exactly one matching row and returns it: fields of
// relaytest.Job left zero match anything, Args are compared as JSON
// ([]any{42} matches [42]) and Options key by key. RequireStagedMany checks
// every staged row in order, and RequireNotStaged that none matches; a
// failure lists the rows seen. Drain runs relay.New(...).Run until
// staged_jobs is empty, stops it and returns how many jobs it pushed; it
// fails the test if the relay cannot drain (an unmigrated schema, Redis out
// of memory, another relay leading) or dead-letters a job. WaitFor polls a
// condition with a deadline, for tests that run a relay of their own; Role
// makes a database role with no privileges, to run the relay as. Its
// server starters (StartRedis, StartPostgres, ...) are stagedrain's own
// test helpers, not a stable API.
//
// # Inside
//
// The data flows through these files: listen.go (LISTEN, through
// jackc/pgxlisten) -> wake.go (wake and poll) -> drain.go (one batch) ->
// claim.go (the claim-and-delete SQL of the source, source.go) -> push.go
// (the atomic push step, internal/handoff, with the commands of the target's
// Builder: a file per target in internal/target, keys and all, read through
// targets.go); leader.go chooses which relay drains; summary.go and metrics.go count what it did. The wake-up
// gate's mechanism and its proof are in the comments of
// sql/009_wake_once.sql. What relay/admin shares with the relay (the
// columns, the gem's table, lock names, schema lists, the paused key) is
// in relay/internal/pgschema and relay/internal/keys, named here in
// shared.go.
package relay
