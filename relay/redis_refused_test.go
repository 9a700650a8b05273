package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zapcore"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

const redisPassword = "s3cret-redis-pw"

// A Redis that refuses the relay's credentials or DB at start: Run returns
// an error naming the Redis target without the password, before the relay
// leads, and every job stays staged.
func TestRedisRefusedAtStart(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, "--requirepass", redisPassword)
	shared, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	private := fmt.Sprintf("127.0.0.1:%d", srv.Port)
	tests := []struct {
		name   string
		opts   *redis.Options
		target string
		want   string
	}{
		{"wrong password", &redis.Options{Addr: private, Password: "wrong-" + redisPassword}, private + "/0", "WRONGPASS"},
		{"no password", &redis.Options{Addr: private}, private + "/0", "NOAUTH"},
		{"unknown user", &redis.Options{Addr: private, Username: "nobody", Password: redisPassword}, private + "/0", "WRONGPASS"},
		{"DB out of range", &redis.Options{Addr: shared.Addr, Password: shared.Password, DB: 99}, shared.Addr + "/99", "ERR DB index is out of range"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			rdb := redis.NewClient(testenv.RedisOptions(tc.opts))
			t.Cleanup(func() { _ = rdb.Close() })
			h.stage(relay.Job{Name: "NeverLost"})

			cfg := h.config()
			cfg.Redis = rdb
			r, err := relay.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			err = r.Run(ctx)
			if err == nil || ctx.Err() != nil {
				t.Fatalf("Run = %v (ctx %v), want an error at once", err, ctx.Err())
			}
			if want := "redis " + tc.target + ": "; !strings.HasPrefix(err.Error(), want) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Run = %q, want %q... containing %q", err, want, tc.want)
			}
			if n := h.logs.FilterMessage("became leader").Len(); n != 0 {
				t.Fatalf("the relay became leader before Redis accepted it")
			}
			if n := h.staged(); n != 1 {
				t.Fatalf("%d rows staged, want 1", n)
			}
			starting := h.logs.FilterMessage("starting").All()
			if len(starting) != 1 || starting[0].ContextMap()["redis"] != tc.target {
				t.Fatalf("starting lines %v, want one naming redis %s", starting, tc.target)
			}
			checkNoPassword(t, h, err)
		})
	}
}

// checkNoPassword fails if the Redis password shows in err or any log line.
func checkNoPassword(t *testing.T, h *harness, err error) {
	t.Helper()
	if err != nil && strings.Contains(err.Error(), redisPassword) {
		t.Errorf("error %q shows the password", err)
	}
	for _, e := range h.logs.All() {
		if s := fmt.Sprint(e.Message, e.ContextMap()); strings.Contains(s, redisPassword) {
			t.Errorf("log line shows the password: %s", s)
		}
	}
}

// The password changes on the server mid-run: batches fail, logged at
// error and retried, the rows stay staged, and they drain once the password
// is set back.
func TestRedisPasswordChangedMidRun(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, "--requirepass", redisPassword)
	h := newHarness(t)
	opts := func() *redis.Options {
		return testenv.RedisOptions(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port), Password: redisPassword})
	}
	h.rdb = redis.NewClient(opts())
	t.Cleanup(func() { _ = h.rdb.Close() })
	relayRedis := redis.NewClient(opts())
	t.Cleanup(func() { _ = relayRedis.Close() })
	// One connection that stays authenticated whatever the password becomes.
	adminClient := redis.NewClient(opts())
	t.Cleanup(func() { _ = adminClient.Close() })
	admin := adminClient.Conn()
	t.Cleanup(func() { _ = admin.Close() })
	ctx := context.Background()
	if err := admin.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	cfg := h.config()
	cfg.Redis = relayRedis
	h.start(cfg)
	first := h.stage(relay.Job{Name: "Before"})
	h.waitQueueLen("default", 1, 15*time.Second)

	if err := admin.ConfigSet(ctx, "requirepass", "other-"+redisPassword).Err(); err != nil {
		t.Fatalf("CONFIG SET requirepass: %v", err)
	}
	// Changing the password keeps connections open: close the relay's, so
	// that its next push must authenticate again.
	if err := admin.Do(ctx, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
		t.Fatalf("CLIENT KILL: %v", err)
	}
	second := h.stage(relay.Job{Name: "During"})
	refused := func() int {
		n := 0
		for _, e := range h.logs.FilterMessage("batch failed, retrying").All() {
			if e.Level == zapcore.ErrorLevel && strings.Contains(fmt.Sprint(e.ContextMap()["error"]), "WRONGPASS") {
				n++
			}
		}
		return n
	}
	testenv.WaitFor(t, 15*time.Second, "two failed batches logged at error with WRONGPASS", func() (bool, string) {
		return refused() >= 2, fmt.Sprint(messages(h.logs))
	})
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged while Redis refuses the password, want 1", n)
	}

	if err := admin.ConfigSet(ctx, "requirepass", redisPassword).Err(); err != nil {
		t.Fatalf("CONFIG SET requirepass back: %v", err)
	}
	h.waitStaged(0)
	h.waitQueueLen("default", 2, 15*time.Second)
	if got := h.queueJIDs("default"); got[0] != first || got[1] != second {
		t.Fatalf("queue:default holds %v, want %s then %s", got, first, second)
	}
	checkNoPassword(t, h, nil)
}

// A session that fails right after connecting (its version check gives up
// on a lock that a migration in progress holds) does not restart the
// backoff: the attempt count and the wait grow to the cap instead of
// retrying every 100ms.
func TestBackoffGrowsWhenSessionsFailAtOnce(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	// As migrate holds it: the version check waits for the lock connection's
	// lock_timeout, then fails, each session soon after it connected.
	lock, err := h.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lock.Rollback(ctx) })
	if _, err := lock.Exec(ctx, "LOCK TABLE "+pgx.Identifier{h.schema, "stagedrain_migrations"}.Sanitize()+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatalf("lock: %v", err)
	}
	cfg := h.config()
	cfg.MaxBackoff = 800 * time.Millisecond
	h.start(cfg)

	const n = 5
	h.waitLog("database session failed, retrying", n)
	lines := h.logs.FilterMessage("database session failed, retrying").All()[:n]
	for i, e := range lines {
		f := e.ContextMap()
		attempt, _ := f["attempt"].(int64)
		wait, _ := f["wait"].(time.Duration)
		nominal := min(100*time.Millisecond<<i, cfg.MaxBackoff)
		if attempt != int64(i+1) || wait < nominal*3/4 || wait > nominal {
			t.Fatalf("retry %d logged attempt %d and wait %s, want attempt %d and a wait between 75%% of %s and %s (error %v)",
				i+1, attempt, wait, i+1, nominal, nominal, f["error"])
		}
		if !strings.Contains(fmt.Sprint(f["error"]), "lock timeout") {
			t.Fatalf("retry %d failed with %v, want a lock timeout", i+1, f["error"])
		}
	}
}

// A command the relay's ACL user may not run, refused inside the push
// script (Redis 7.0: "ERR The user executing the script can't run this
// command or subcommand"; 7.2: "ERR ACL failure in script: ..."; 6.2:
// "@user_script: <line>: The user executing the script ..."), is not
// poison: the operator's fix serves every job alike. The job stays staged,
// nothing is dead-lettered, the batch is retried with backoff, and once the
// ACL allows LPUSH the job is delivered.
func TestACLDeniedCommandWaits(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t)
	h := newHarness(t)
	addr := fmt.Sprintf("127.0.0.1:%d", srv.Port)
	h.rdb = redis.NewClient(testenv.RedisOptions(&redis.Options{Addr: addr})) // the default user: all allowed
	t.Cleanup(func() { _ = h.rdb.Close() })
	ctx := context.Background()
	if err := h.rdb.Do(ctx, "ACL", "SETUSER", "relay", "on", ">"+redisPassword, "~*", "&*", "+@all", "-lpush").Err(); err != nil {
		t.Fatal(err)
	}
	relayRedis := redis.NewClient(testenv.RedisOptions(&redis.Options{Addr: addr, Username: "relay", Password: redisPassword}))
	t.Cleanup(func() { _ = relayRedis.Close() })

	cfg := h.config()
	cfg.Redis = relayRedis
	h.start(cfg)
	jid := h.stage(relay.Job{Name: "Patient"})
	denied := func() int {
		n := 0
		for _, e := range h.logs.FilterMessage("batch failed, retrying").All() {
			if err := fmt.Sprint(e.ContextMap()["error"]); strings.Contains(err, "can't run this command") || strings.Contains(err, "ACL failure") {
				n++
			}
		}
		return n
	}
	testenv.WaitFor(t, 15*time.Second, "two batches failed naming the ACL's denial", func() (bool, string) {
		return denied() >= 2, fmt.Sprint(messages(h.logs), h.dead())
	})
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged while the ACL denies LPUSH, want 1", n)
	}
	if d := h.dead(); len(d) != 0 {
		t.Fatalf("staged_jobs_dead holds %v while the ACL denies LPUSH, want nothing: a denial is not poison", d)
	}

	if err := h.rdb.Do(ctx, "ACL", "SETUSER", "relay", "+lpush").Err(); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 1, 15*time.Second)
	if got := h.queueJIDs("default"); got[0] != jid {
		t.Fatalf("queue:default holds %v, want %s", got, jid)
	}
	h.waitStaged(0)
	if d := h.dead(); len(d) != 0 {
		t.Fatalf("staged_jobs_dead holds %v, want nothing", d)
	}
	checkNoPassword(t, h, nil)
}
