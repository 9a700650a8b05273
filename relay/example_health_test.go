package relay_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// Migrate creates the schema, staged_jobs, staged_jobs_dead and the wake
// trigger, applying each file of sql/ the schema lacks; run again, it
// applies nothing. Deploy scripts run it (stagedrain migrate) before the
// relays start: Run refuses a schema it has not migrated.
func ExampleMigrate() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, relaytest.DatabaseURL())
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	opt, err := redis.ParseURL(relaytest.RedisURL())
	if err != nil {
		panic(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	schema, _, drop := scratch(ctx, conn, rdb)
	defer drop()

	res, err := relay.Migrate(ctx, conn, schema)
	if err != nil {
		panic(err)
	}
	fmt.Println("a fresh schema:", res.Applied)
	again, err := relay.Migrate(ctx, conn, schema)
	if err != nil {
		panic(err)
	}
	fmt.Println("again:", len(again.Applied), "applied, same version:", again.Current == res.Current)

	rows, err := conn.Query(ctx, `SELECT tablename::text FROM pg_tables WHERE schemaname = $1 ORDER BY 1`, schema)
	if err != nil {
		panic(err)
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		panic(err)
	}
	fmt.Println("tables:", tables)
	// Output:
	// a fresh schema: [wake_009.sql baseline_009.sql 010_wake_when_idle.sql 011_id_after_xid.sql 012_wake_one_notifier.sql 013_run_at_index.sql 014_wake_behind.sql 015_wake_one_look.sql 016_options_check_one_const.sql 017_last_id_plpgsql.sql 018_id_default_inline.sql]
	// again: 0 applied, same version: true
	// tables: [staged_jobs staged_jobs_dead stagedrain_migrations]
}

// CheckReady is the readiness probe (what stagedrain run's /readyz
// serves): nil while the relay leads or stands by and PostgreSQL and Redis
// answer. Status is a snapshot of the relay's state, with no I/O. A
// second relay on the schema stands by, ready too, and leads once the
// first stops.
func ExampleRelay_CheckReady() {
	ctx := context.Background()
	databaseURL := relaytest.DatabaseURL()
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	opt, err := redis.ParseURL(relaytest.RedisURL())
	if err != nil {
		panic(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	schema, ns, drop := scratch(ctx, conn, rdb)
	defer drop()
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		panic(err)
	}

	// start runs a relay until stop is called; stop returns what Run did.
	start := func() (r *relay.Relay, stop func() error) {
		r, err := relay.New(relay.Config{DatabaseURL: databaseURL, Redis: rdb, Schema: schema, RedisNamespace: ns})
		if err != nil {
			panic(err)
		}
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(runCtx) }()
		return r, func() error { cancel(); return <-done }
	}
	// waitFor polls what a dashboard or an orchestrator would, until role
	// and readiness are as wanted.
	waitFor := func(r *relay.Relay, role relay.Role) {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		deadline := time.After(15 * time.Second)
		for r.Status().Role != role || r.CheckReady(ctx) != nil {
			select {
			case <-tick.C:
			case <-deadline:
				panic(fmt.Sprintf("no %s within 15s: %+v, %v", role, r.Status(), r.CheckReady(ctx)))
			}
		}
	}

	first, stopFirst := start()
	waitFor(first, relay.RoleLeader)
	fmt.Println("first:", first.Status().Role, first.CheckReady(ctx))

	second, stopSecond := start()
	defer stopSecond()
	waitFor(second, relay.RoleStandby)
	fmt.Println("second:", second.Status().Role, second.CheckReady(ctx))

	if err := stopFirst(); err != nil {
		panic(err)
	}
	err = first.CheckReady(ctx)
	fmt.Println("first, stopped:", first.Status().Role, err, errors.Is(err, relay.ErrNotReady))
	waitFor(second, relay.RoleLeader)
	fmt.Println("second:", second.Status().Role, second.CheckReady(ctx))
	// Output:
	// first: leader <nil>
	// second: standby <nil>
	// first, stopped: stopped not ready: stopped true
	// second: leader <nil>
}

// ParseSchemas reads a list of schema names and '*' patterns, for
// Config.Schemas: one relay then drains every schema the list names.
func ExampleParseSchemas() {
	schemas, err := relay.ParseSchemas("public, tenant_*")
	fmt.Printf("%q %v\n", schemas, err)
	_, err = relay.ParseSchemas("public,,tenant_*")
	var fe *relay.FieldError
	fmt.Println(errors.As(err, &fe), fe.Field+":", fe.Reason)
	// Output:
	// ["public" "tenant_*"] <nil>
	// true Schemas: must not hold an empty item (a doubled or trailing comma?)
}
