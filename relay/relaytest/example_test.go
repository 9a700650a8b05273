package relaytest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// signUp is the application code under test: it creates a user and, in the
// same transaction, stages the welcome email.
func signUp(ctx context.Context, tx pgx.Tx, schema, email string) error {
	if _, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "users"}.Sanitize()+` (email) VALUES ($1)`, email); err != nil {
		return err
	}
	_, err := relay.NewStager(schema).Stage(ctx, tx, relay.Job{Name: "WelcomeEmail", Args: []any{email}, Queue: "mailers"})
	return err
}

// setUp gives a test a migrated schema of its own, with the app's users
// table, and a connection: what an application's test helper would do.
func setUp(t testing.TB) (*pgx.Conn, string) {
	t.Helper()
	schema := relaytest.Schema(t, relaytest.DatabaseURL()) // dropped when the test ends
	conn := relaytest.Conn(t, relaytest.DatabaseURL())
	if _, err := relay.Migrate(t.Context(), conn, schema); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := conn.Exec(t.Context(), `CREATE TABLE `+pgx.Identifier{schema, "users"}.Sanitize()+` (email text PRIMARY KEY)`); err != nil {
		t.Fatalf("create users: %v", err)
	}
	return conn, schema
}

// In a test, RequireStaged checks what the code under test staged, as its
// own transaction sees it, before (or without) a commit; RequireNotStaged
// checks that a rollback took the job with it. Here t stands in for the
// test's *testing.T.
func Example_requireStaged() {
	t := newExampleT()
	defer t.done()
	ctx := t.Context()
	conn, schema := setUp(t)

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	if err := signUp(ctx, tx, schema, "ada@example.com"); err != nil {
		t.Fatalf("sign up: %v", err)
	}
	job := relaytest.RequireStaged(t, tx, relaytest.Job{Name: "WelcomeEmail", Args: []any{"ada@example.com"}, Queue: "mailers"},
		relaytest.WithSchema(schema))
	fmt.Println("staged:", job.Name, string(job.Args), job.Queue)

	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("rollback: %v", err)
	}
	relaytest.RequireNotStaged(t, conn, relaytest.Job{Name: "WelcomeEmail"}, relaytest.WithSchema(schema))
	fmt.Println("after the rollback: none staged")
	// Output:
	// staged: WelcomeEmail ["ada@example.com"] mailers
	// after the rollback: none staged
}

// Drain runs the real relay until what the test committed is in Redis,
// where the test reads it as its workers would. Here t stands in for the
// test's *testing.T.
func Example_drain() {
	t := newExampleT()
	defer t.done()
	ctx := t.Context()
	conn, schema := setUp(t)
	rdb, ns := relaytest.Redis(t) // keys under "<ns>:", deleted when the test ends

	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return signUp(ctx, tx, schema, "grace@example.com") })
	if err != nil {
		t.Fatalf("sign up: %v", err)
	}
	pushed := relaytest.Drain(ctx, t, relaytest.DrainConfig{
		DatabaseURL:    relaytest.DatabaseURL(),
		Schema:         schema,
		Redis:          rdb,
		RedisNamespace: ns,
	})
	fmt.Println("pushed:", pushed)

	raw, err := rdb.LRange(ctx, ns+":queue:mailers", 0, -1).Result()
	if err != nil {
		t.Fatalf("read the queue: %v", err)
	}
	for _, r := range raw {
		var job struct {
			Class string `json:"class"`
			Args  []any  `json:"args"`
		}
		if err := json.Unmarshal([]byte(r), &job); err != nil {
			t.Fatalf("a job of queue:mailers: %v", err)
		}
		fmt.Println("queue:mailers:", job.Class, job.Args)
	}
	// Output:
	// pushed: 1
	// queue:mailers: WelcomeEmail [grace@example.com]
}

// exampleT stands in for the *testing.T of a test, which go test does not
// give an example: it has the methods relaytest calls (any other panics,
// as the embedded TB is nil), fails the example by panicking with the
// failure, and runs the test's cleanups at done, failed or not.
type exampleT struct {
	testing.TB
	ctx      context.Context
	cancel   context.CancelFunc
	cleanups []func()
}

func newExampleT() *exampleT {
	ctx, cancel := context.WithCancel(context.Background())
	return &exampleT{ctx: ctx, cancel: cancel}
}

func (t *exampleT) Helper()                  {}
func (t *exampleT) Context() context.Context { return t.ctx }
func (t *exampleT) Cleanup(f func())         { t.cleanups = append(t.cleanups, f) }
func (t *exampleT) Errorf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}
func (t *exampleT) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}

// done runs the cleanups, last registered first, as testing does; the
// context ends before them, as a test's does.
func (t *exampleT) done() {
	t.cancel()
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}
