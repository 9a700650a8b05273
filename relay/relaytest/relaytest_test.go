package relaytest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeTB records failures instead of failing the test; Fatalf ends the
// goroutine it runs in, as the testing package's does.
type fakeTB struct {
	testing.TB
	mu     sync.Mutex
	errors []string
	fatal  bool
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errors = append(f.errors, fmt.Sprintf(format, args...))
}

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.Errorf(format, args...)
	f.mu.Lock()
	f.fatal = true
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *fakeTB) Fatal(args ...any) { f.Fatalf("%s", fmt.Sprint(args...)) }

func (f *fakeTB) Failed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.errors) > 0
}

// failure runs fn with a fakeTB in a goroutine of its own and returns what
// it reported; the test fails if fn did not call Fatalf.
func failure(t *testing.T, fn func(tb testing.TB)) string {
	t.Helper()
	f := &fakeTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.fatal {
		t.Fatalf("want a Fatalf, got errors %q", f.errors)
	}
	msg := strings.Join(f.errors, "\n")
	t.Logf("failure message: %s", msg)
	return msg
}

func checkContains(t *testing.T, msg string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("failure message %q does not contain %q", msg, w)
		}
	}
}

// migrated returns a fresh migrated schema and a connection.
func migrated(t *testing.T) (string, *pgx.Conn) {
	t.Helper()
	schema := relaytest.Schema(t, testenv.DatabaseURL())
	conn := relaytest.Conn(t, testenv.DatabaseURL())
	if _, err := relay.Migrate(context.Background(), conn, schema); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return schema, conn
}

// begin opens a transaction rolled back when the test ends.
func begin(t *testing.T, conn *pgx.Conn) pgx.Tx {
	t.Helper()
	tx, err := conn.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

func TestRequireStaged(t *testing.T) {
	t.Parallel()
	schema, conn := migrated(t)
	tx := begin(t, conn)
	ctx := context.Background()
	runAt := time.Now().Add(time.Hour).Round(0)
	stager := relay.NewStager(schema)
	jid, err := stager.Stage(ctx, tx, relay.Job{Name: "WelcomeEmailJob", Args: []any{42, "ada"}, Queue: "mailers",
		Options: map[string]any{"retry": 5, "tags": []string{"signup"}}})
	if err != nil {
		t.Fatal(err)
	}
	laterJID, err := stager.Stage(ctx, tx, relay.Job{Name: "ReminderJob", RunAt: runAt})
	if err != nil {
		t.Fatal(err)
	}
	// Stored as JSON the app wrote itself: other spellings of the same values.
	if _, err := tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{schema, "staged_jobs"}.Sanitize()+
		` (job_name, job_args) VALUES ('ImportJob', '[4.2e1, {"b": 1, "a": [1.50]}]')`); err != nil {
		t.Fatal(err)
	}
	in := relaytest.WithSchema(schema)

	got := relaytest.RequireStaged(t, tx, relaytest.Job{Name: "WelcomeEmailJob"}, in)
	if got.JID != jid || got.Queue != "mailers" || string(got.Args) != `[42, "ada"]` {
		t.Errorf("RequireStaged returned %+v, want jid %s, queue mailers, args [42, \"ada\"]", got, jid)
	}
	relaytest.RequireStaged(t, tx, relaytest.Job{Name: "WelcomeEmailJob", Args: []any{42, "ada"}, Queue: "mailers",
		Options: map[string]any{"tags": []any{"signup"}}, JID: jid}, in)
	later := relaytest.RequireStaged(t, tx, relaytest.Job{Name: "ReminderJob", RunAt: runAt, Args: []any{}}, in)
	if later.JID != laterJID || !later.RunAt.Equal(runAt.Truncate(time.Microsecond)) {
		t.Errorf("RequireStaged returned %+v, want jid %s, run_at %s", later, laterJID, runAt)
	}
	relaytest.RequireStaged(t, tx, relaytest.Job{Name: "ImportJob", Args: []any{42, map[string]any{"a": []float64{1.5}, "b": 1}}}, in)

	relaytest.RequireStagedMany(t, tx, []relaytest.Job{
		{Name: "WelcomeEmailJob", Args: []any{42, "ada"}},
		{Name: "ReminderJob"},
		{Name: "ImportJob"},
	}, in)
	relaytest.RequireNotStaged(t, tx, relaytest.Job{Name: "WelcomeEmailJob", Queue: "default"}, in)
	relaytest.RequireNotStaged(t, tx, relaytest.Job{Name: "NoSuchJob"}, in)

	// Outside the transaction, nothing is committed yet.
	relaytest.RequireNotStaged(t, relaytest.Conn(t, testenv.DatabaseURL()), relaytest.Job{}, in)
}

// A mismatch fails the test with what was wanted and every row seen.
func TestRequireStagedFailures(t *testing.T) {
	t.Parallel()
	schema, conn := migrated(t)
	tx := begin(t, conn)
	ctx := context.Background()
	stager := relay.NewStager(schema)
	jid, err := stager.Stage(ctx, tx, relay.Job{Name: "WelcomeEmailJob", Args: []any{42}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stager.Stage(ctx, tx, relay.Job{Name: "AuditJob", Args: []any{"x"}, Options: map[string]any{"retry": false}}); err != nil {
		t.Fatal(err)
	}
	in := relaytest.WithSchema(schema)
	other := relaytest.Conn(t, testenv.DatabaseURL())

	tests := []struct {
		name string
		fn   func(tb testing.TB)
		want []string
	}{
		{"other args", func(tb testing.TB) {
			relaytest.RequireStaged(tb, tx, relaytest.Job{Name: "WelcomeEmailJob", Args: []any{43}}, in)
		}, []string{`want 1 staged job matching {Name "WelcomeEmailJob", Args [43]}`, "found 0", "staged (2):",
			"WelcomeEmailJob args [42] queue default jid " + jid, `AuditJob args ["x"]`, `options {"retry": false}`}},
		{"other queue", func(tb testing.TB) {
			relaytest.RequireStaged(tb, tx, relaytest.Job{Name: "WelcomeEmailJob", Queue: "mailers"}, in)
		}, []string{`Queue "mailers"`, "found 0", "queue default"}},
		{"other option", func(tb testing.TB) {
			relaytest.RequireStaged(tb, tx, relaytest.Job{Name: "AuditJob", Options: map[string]any{"retry": true}}, in)
		}, []string{`Options {"retry":true}`, "found 0", `options {"retry": false}`}},
		{"scheduled", func(tb testing.TB) {
			relaytest.RequireStaged(tb, tx, relaytest.Job{Name: "WelcomeEmailJob", RunAt: time.Now().Add(time.Hour)}, in)
		}, []string{"RunAt ", "found 0"}},
		{"other schema", func(tb testing.TB) {
			relaytest.RequireStaged(tb, tx, relaytest.Job{Name: "WelcomeEmailJob"}, relaytest.WithSchema(schema+"_x"))
		}, []string{`no table "` + schema + `_x"."staged_jobs"`, "WithSchema"}},
		{"committed only", func(tb testing.TB) {
			relaytest.RequireStaged(tb, other, relaytest.Job{Name: "WelcomeEmailJob"}, in)
		}, []string{"found 0", "nothing is staged"}},
		{"many, wrong order", func(tb testing.TB) {
			relaytest.RequireStagedMany(tb, tx, []relaytest.Job{{Name: "AuditJob"}, {Name: "WelcomeEmailJob"}}, in)
		}, []string{`job 0: want {Name "AuditJob"}, found id `, `job 1: want {Name "WelcomeEmailJob"}`, "want, in order:"}},
		{"many, too few wanted", func(tb testing.TB) {
			relaytest.RequireStagedMany(tb, tx, []relaytest.Job{{Name: "WelcomeEmailJob"}}, in)
		}, []string{"want 1 staged jobs, found 2", "AuditJob"}},
		{"not staged", func(tb testing.TB) {
			relaytest.RequireNotStaged(tb, tx, relaytest.Job{Name: "AuditJob"}, in)
		}, []string{`want no staged job matching {Name "AuditJob"}`, "found 1", `AuditJob args ["x"]`}},
		{"nothing staged", func(tb testing.TB) {
			relaytest.RequireNotStaged(tb, tx, relaytest.Job{}, in)
		}, []string{"{any job}", "found 2"}},
		{"no name", func(tb testing.TB) {
			relaytest.RequireStaged(tb, tx, relaytest.Job{Args: []any{42}}, in)
		}, []string{"Job.Name is empty"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkContains(t, failure(t, tt.fn), tt.want...)
		})
	}

	t.Run("two match", func(t *testing.T) {
		if _, err := stager.Stage(ctx, tx, relay.Job{Name: "WelcomeEmailJob", Args: []any{7}}); err != nil {
			t.Fatal(err)
		}
		msg := failure(t, func(tb testing.TB) {
			relaytest.RequireStaged(tb, tx, relaytest.Job{Name: "WelcomeEmailJob"}, in)
		})
		checkContains(t, msg, "found 2", "RequireStagedMany", "args [7]")
	})
}

// Drain pushes every committed job through the relay into the namespace
// given, scheduled ones included, and leaves staged_jobs empty.
func TestDrain(t *testing.T) {
	t.Parallel()
	schema, conn := migrated(t)
	opts, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	ns := relaytest.RedisNamespace(t, rdb)
	ctx := context.Background()
	cfg := relaytest.DrainConfig{DatabaseURL: testenv.DatabaseURL(), Schema: schema, Redis: rdb, RedisNamespace: ns}

	if n := relaytest.Drain(ctx, t, cfg); n != 0 {
		t.Errorf("Drain of an empty table returned %d, want 0", n)
	}

	var jids []string
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		var err error
		jids, err = relay.NewStager(schema).StageMany(ctx, tx, []relay.Job{
			{Name: "WelcomeEmailJob", Args: []any{42}},
			{Name: "WelcomeEmailJob", Args: []any{43}},
			{Name: "ReminderJob", RunAt: time.Now().Add(time.Hour)},
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := relaytest.Drain(ctx, t, cfg); n != 3 {
		t.Errorf("Drain returned %d, want 3", n)
	}
	relaytest.RequireNotStaged(t, conn, relaytest.Job{}, relaytest.WithSchema(schema))

	queue, err := rdb.LRange(ctx, ns+":queue:default", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for i := len(queue) - 1; i >= 0; i-- { // workers BRPOP from the right
		var job struct {
			JID  string `json:"jid"`
			Args []int  `json:"args"`
		}
		if err := json.Unmarshal([]byte(queue[i]), &job); err != nil {
			t.Fatalf("payload is not JSON: %v: %s", err, queue[i])
		}
		got = append(got, job.JID)
	}
	if len(got) != 2 || got[0] != jids[0] || got[1] != jids[1] {
		t.Errorf("%s:queue:default holds jids %v, want %v", ns, got, jids[:2])
	}
	scheduled, err := rdb.ZRange(ctx, ns+":schedule", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(scheduled) != 1 || !strings.Contains(scheduled[0], jids[2]) {
		t.Errorf("%s:schedule holds %v, want the job %s", ns, scheduled, jids[2])
	}
}

// Drain fails the test, with the relay's reason, when the relay cannot
// drain the schema.
func TestDrainFailure(t *testing.T) {
	t.Parallel()
	schema := relaytest.Schema(t, testenv.DatabaseURL()) // never migrated
	rdb, ns := testenv.Redis(t)
	msg := failure(t, func(tb testing.TB) {
		relaytest.Drain(context.Background(), tb, relaytest.DrainConfig{
			DatabaseURL: testenv.DatabaseURL(), Schema: schema, Redis: rdb, RedisNamespace: ns})
	})
	checkContains(t, msg, "relaytest: Drain: the relay stopped", "run 'stagedrain migrate' first")
}

// Drain fails the test, naming the reason, when the relay dead-letters a
// job: here one to a queue whose key holds a string (WRONGTYPE).
func TestDrainFailsOnDeadLetter(t *testing.T) {
	t.Parallel()
	schema, conn := migrated(t)
	rdb, ns := testenv.Redis(t)
	ctx := context.Background()
	if err := rdb.Set(ctx, ns+":queue:broken", "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := relay.NewStager(schema).Stage(ctx, conn, relay.Job{Name: "Bounced", Queue: "broken"}); err != nil {
		t.Fatal(err)
	}
	msg := failure(t, func(tb testing.TB) {
		relaytest.Drain(ctx, tb, relaytest.DrainConfig{
			DatabaseURL: testenv.DatabaseURL(), Schema: schema, Redis: rdb, RedisNamespace: ns})
	})
	checkContains(t, msg, "relaytest: Drain: 1 jobs dead-lettered", "staged_jobs_dead", "WRONGTYPE")
}

// A $TEST_DATABASE_URL that names no sslmode speaks plain text to the test
// server (pgx's default, prefer, is TLS where the server has it on); one
// that names an sslmode keeps it.
func TestDatabaseURLWithoutSSLMode(t *testing.T) {
	for _, tt := range []struct{ env, want string }{
		{"postgres://root@127.0.0.1:5432/test", "postgres://root@127.0.0.1:5432/test?sslmode=disable"},
		{"postgresql://u@h/db?connect_timeout=3", "postgresql://u@h/db?connect_timeout=3&sslmode=disable"},
		{"postgres://u@h/db?sslmode=require", "postgres://u@h/db?sslmode=require"},
		{"host=127.0.0.1 user=root dbname=test", "host=127.0.0.1 user=root dbname=test sslmode=disable"},
		{"host=127.0.0.1 sslmode=prefer", "host=127.0.0.1 sslmode=prefer"},
	} {
		t.Setenv("TEST_DATABASE_URL", tt.env)
		if got := relaytest.DatabaseURL(); got != tt.want {
			t.Errorf("TEST_DATABASE_URL=%q: DatabaseURL() = %q, want %q", tt.env, got, tt.want)
		}
	}
	t.Setenv("TEST_DATABASE_URL", "")
	if got := relaytest.DatabaseURL(); got != "postgres://postgres@127.0.0.1:5432/test?sslmode=disable" {
		t.Errorf("TEST_DATABASE_URL unset: DatabaseURL() = %q", got)
	}
}

// A private Redis started with --appendonly yes keeps what it acknowledged
// across Stop and Start (the same port and directory), as a test that
// kills Redis to see what survives needs.
func TestStartRedisRestartsWithItsData(t *testing.T) {
	t.Parallel()
	srv := relaytest.StartRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	client := func() *redis.Client {
		opts, err := redis.ParseURL(srv.URL())
		if err != nil {
			t.Fatal(err)
		}
		opts.DisableIdentity = true
		rdb := redis.NewClient(opts)
		t.Cleanup(func() { _ = rdb.Close() })
		return rdb
	}
	ctx := context.Background()
	if err := client().Set(ctx, "kept", "yes", 0).Err(); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	if err := client().Ping(ctx).Err(); err == nil {
		t.Fatal("PING answered after Stop, want nothing listening")
	}
	srv.Start()
	if got, err := client().Get(ctx, "kept").Result(); err != nil || got != "yes" {
		t.Fatalf("GET kept after Stop and Start = %q, %v; want \"yes\"", got, err)
	}
}
