package admin_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// scratch returns a prefix of schema names no other example or test uses,
// and a function that drops every schema named with it. An operator's
// tool has its own schemas instead.
func scratch(ctx context.Context, conn *pgx.Conn) (prefix string, drop func()) {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	prefix = "example_" + hex.EncodeToString(b) + "_"
	return prefix, func() {
		rows, err := conn.Query(ctx, `SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)`, prefix)
		if err != nil {
			log.Print(err)
			return
		}
		schemas, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			log.Print(err)
		}
		for _, s := range schemas {
			if _, err := conn.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{s}.Sanitize()+` CASCADE`); err != nil {
				log.Print(err)
			}
		}
	}
}

// ListDead shows the jobs the relay could never push (stagedrain dead
// list); RetryDead moves the ones fixed back into staged_jobs, with their
// id and jid, for the relay to push again (stagedrain dead retry).
func ExampleListDead() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, relaytest.DatabaseURL())
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	prefix, drop := scratch(ctx, conn)
	defer drop()
	schema := prefix + "app"
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		panic(err)
	}
	// A job Redis refused, dead-lettered as the relay does it.
	if _, err := conn.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()+`
		(id, job_name, job_args, queue, jid, created_at, options, reason, attempts)
		VALUES (7, 'WelcomeEmail', '[42]', 'mailers', 'b1c9a24e5a2f4b6e8d0c1f3a', now(), '{}',
			'WRONGTYPE Operation against a key holding the wrong kind of value', 1)`); err != nil {
		panic(err)
	}

	res, err := admin.ListDead(ctx, conn, admin.ListDeadParams{Schema: schema})
	if err != nil {
		panic(err)
	}
	for _, j := range res.Jobs {
		fmt.Println(j.ID, *j.JobName, string(j.JobArgs), *j.Queue, *j.JID, "attempts", j.Attempts)
		fmt.Println("  reason:", j.Reason)
	}

	// Once the cause is fixed (here, the key of queue:mailers), retry it.
	moved, err := admin.RetryDead(ctx, conn, admin.RetryDeadParams{Schema: schema, IDs: []int64{7}})
	if err != nil {
		panic(err)
	}
	var id int64
	var jid string
	if err := conn.QueryRow(ctx, `SELECT id, jid FROM `+pgx.Identifier{schema, "staged_jobs"}.Sanitize()).Scan(&id, &jid); err != nil {
		panic(err)
	}
	fmt.Println("moved", moved.Moved, "back: staged", id, jid)

	_, err = admin.RetryDead(ctx, conn, admin.RetryDeadParams{Schema: schema, IDs: []int64{7}})
	fmt.Println(err)
	// Output:
	// 7 WelcomeEmail [42] mailers b1c9a24e5a2f4b6e8d0c1f3a attempts 1
	//   reason: WRONGTYPE Operation against a key holding the wrong kind of value
	// moved 1 back: staged 7 b1c9a24e5a2f4b6e8d0c1f3a
	// no dead row with id 7: nothing changed
}

// ReadStatus is what stagedrain status prints: the backlog by queue, the
// dead letters, and the leader of the schema's relays (none runs here).
func ExampleReadStatus() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, relaytest.DatabaseURL())
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	prefix, drop := scratch(ctx, conn)
	defer drop()
	schema := prefix + "app"
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		panic(err)
	}
	stager := relay.NewStager(schema)
	if _, err := stager.StageMany(ctx, conn, []relay.Job{
		{Name: "WelcomeEmail", Args: []any{42}, Queue: "mailers"},
		{Name: "WelcomeEmail", Args: []any{43}, Queue: "mailers"},
		{Name: "ChargeCard", Args: []any{42, 1999}},
	}); err != nil {
		panic(err)
	}

	st, err := admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: schema})
	if err != nil {
		panic(err)
	}
	fmt.Println("staged:", st.Staged, "dead:", *st.Dead, "leader:", st.Leader)
	for _, q := range st.Queues {
		fmt.Println(" ", q.Queue, q.Staged)
	}

	_, err = admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: prefix + "unmigrated"})
	fmt.Println(strings.ReplaceAll(err.Error(), prefix, "<prefix>"))
	// Output:
	// staged: 3 dead: 0 leader: <nil>
	//   default 1
	//   mailers 2
	// "<prefix>unmigrated"."staged_jobs" does not exist: run 'stagedrain migrate' first
}

// ListSchemas lists the schemas a list of names and '*' patterns names,
// as a relay with Config.Schemas finds them: with a table, only the
// schemas that hold it (here, the migrated ones).
func ExampleListSchemas() {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, relaytest.DatabaseURL())
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	prefix, drop := scratch(ctx, conn)
	defer drop()
	for _, tenant := range []string{"tenant_acme", "tenant_globex"} {
		if _, err := relay.Migrate(ctx, conn, prefix+tenant); err != nil {
			panic(err)
		}
	}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{prefix + "tenant_new"}.Sanitize()); err != nil {
		panic(err)
	}

	items, err := relay.ParseSchemas(prefix + "tenant_*")
	if err != nil {
		panic(err)
	}
	for _, table := range []string{"staged_jobs", ""} {
		schemas, err := admin.ListSchemas(ctx, conn, items, table)
		if err != nil {
			panic(err)
		}
		for i, s := range schemas {
			schemas[i] = strings.TrimPrefix(s, prefix)
		}
		fmt.Printf("with table %q: %v\n", table, schemas)
	}
	// Output:
	// with table "staged_jobs": [tenant_acme tenant_globex]
	// with table "": [tenant_acme tenant_globex tenant_new]
}
