package relay_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// scratch returns a schema name and a Redis key namespace of their own for
// one example, and a function that drops the schema and deletes the keys.
// An application has its own schema and namespace (or none) instead.
func scratch(ctx context.Context, conn *pgx.Conn, rdb *redis.Client) (schema, ns string, drop func()) {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema = "example_" + hex.EncodeToString(b)
	return schema, schema, func() {
		if _, err := conn.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`); err != nil {
			log.Print(err)
		}
		iter := rdb.Scan(ctx, 0, ns+":*", 100).Iterator()
		for iter.Next(ctx) {
			if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
				log.Print(err)
			}
		}
		if err := iter.Err(); err != nil {
			log.Print(err)
		}
	}
}

// An application stages a job in its own transaction; once that commits, a
// relay pushes it to Redis, where a Sidekiq worker takes it. Here the
// example takes it, with BRPOP, as Sidekiq's fetch does.
func ExampleNew() {
	ctx := context.Background()
	databaseURL := relaytest.DatabaseURL() // e.g. postgres://app@db/app
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

	// Once, at deploy: staged_jobs and its wake trigger.
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		panic(err)
	}

	r, err := relay.New(relay.Config{
		DatabaseURL:    databaseURL,
		Redis:          rdb,
		Schema:         schema,
		RedisNamespace: ns, // keys "<ns>:queue:default", ...; "" for none
	})
	if err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()

	// In the application: the job commits with the app's own writes, or
	// not at all.
	stager := relay.NewStager(schema)
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		// ... INSERT INTO users ...
		_, err := stager.Stage(ctx, tx, relay.Job{Name: "WelcomeEmail", Args: []any{42}})
		return err
	})
	if err != nil {
		panic(err)
	}

	// A worker's fetch: waits until the relay has pushed the job.
	popped, err := rdb.BRPop(ctx, 10*time.Second, ns+":queue:default").Result()
	if err != nil {
		panic(err)
	}
	var job struct {
		Class string `json:"class"`
		Args  []any  `json:"args"`
		Queue string `json:"queue"`
	}
	if err := json.Unmarshal([]byte(popped[1]), &job); err != nil {
		panic(err)
	}
	fmt.Println(job.Class, job.Args, job.Queue)

	stop() // Run releases leadership and returns nil
	if err := <-done; err != nil {
		panic(err)
	}
	// Output: WelcomeEmail [42] default
}

// StageMany stages several jobs with one INSERT, in the caller's
// transaction: all of them commit, or none.
func ExampleStager_StageMany() {
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
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		panic(err)
	}

	stager := relay.NewStager(schema)
	tx, err := conn.Begin(ctx)
	if err != nil {
		panic(err)
	}
	jids, err := stager.StageMany(ctx, tx, []relay.Job{
		{Name: "ChargeCard", Args: []any{7, 1999}},
		{Name: "SendReceipt", Args: []any{7}, Queue: "mailers", RunAt: time.Now().Add(time.Minute)},
	})
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}
	fmt.Println(len(jids), "jids, in the order of the jobs")

	rows, err := conn.Query(ctx, `SELECT job_name, queue, run_at IS NOT NULL FROM `+
		pgx.Identifier{schema, "staged_jobs"}.Sanitize()+` ORDER BY id`)
	if err != nil {
		panic(err)
	}
	var name, queue string
	var scheduled bool
	_, err = pgx.ForEachRow(rows, []any{&name, &queue, &scheduled}, func() error {
		fmt.Println("staged:", name, "queue", queue, "scheduled", scheduled)
		return nil
	})
	if err != nil {
		panic(err)
	}
	// Output:
	// 2 jids, in the order of the jobs
	// staged: ChargeCard queue default scheduled false
	// staged: SendReceipt queue mailers scheduled true
}
