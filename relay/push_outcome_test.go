package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// replyErr is an error reply from Redis, as go-redis hands it over.
type replyErr string

func (e replyErr) Error() string { return string(e) }
func (replyErr) RedisError()     {}

// txOutcome counts a job as pushed only on positive evidence: EXEC ran (the
// PING queued last answered PONG) and the job's command has a success reply
// in range. Every other shape leaves the whole batch staged, except a Redis
// error on one command of an executed transaction, which refuses only it.
func TestTxOutcome(t *testing.T) {
	ctx := context.Background()
	intCmd := func(name string, val int64, err error) *redis.IntCmd {
		c := redis.NewIntCmd(ctx, name, "k")
		if err != nil {
			c.SetErr(err)
		} else {
			c.SetVal(val)
		}
		return c
	}
	unexecutedInt := func(name string) *redis.IntCmd { return redis.NewIntCmd(ctx, name, "k") }
	pong := func() *redis.StatusCmd { c := redis.NewStatusCmd(ctx, "ping"); c.SetVal("PONG"); return c }
	unexecutedPing := func() *redis.StatusCmd { return redis.NewStatusCmd(ctx, "ping") }
	pingErr := func(err error) *redis.StatusCmd { c := redis.NewStatusCmd(ctx, "ping"); c.SetErr(err); return c }

	wrongType := replyErr("WRONGTYPE Operation against a key holding the wrong kind of value")
	selectRefused := replyErr("ERR DB index is out of range")
	wrongPass := replyErr("WRONGPASS invalid username-password pair or user is disabled.")
	noAuth := replyErr("NOAUTH Authentication required.")
	execAbort := replyErr("EXECABORT Transaction discarded because of previous errors.")
	timeout := errors.New("i/o timeout")
	parseErr := errors.New("redis: can't parse int reply: \"+OK\"")

	// A batch of two queues (2 and 1 payloads) and one scheduled job.
	type batch struct {
		sadd1, sadd2 *redis.IntCmd
		lpush1       *redis.IntCmd
		lpush2       *redis.IntCmd
		zadd         *redis.IntCmd
		ping         *redis.StatusCmd
	}
	ok := func() batch {
		return batch{intCmd("sadd", 1, nil), intCmd("sadd", 0, nil), intCmd("lpush", 2, nil), intCmd("lpush", 7, nil), intCmd("zadd", 1, nil), pong()}
	}
	with := func(f func(*batch)) batch { b := ok(); f(&b); return b }
	unexecuted := batch{unexecutedInt("sadd"), unexecutedInt("sadd"), unexecutedInt("lpush"), unexecutedInt("lpush"), unexecutedInt("zadd"), unexecutedPing()}
	stamped := func(err error) batch {
		return batch{intCmd("sadd", 0, err), intCmd("sadd", 0, err), intCmd("lpush", 0, err), intCmd("lpush", 0, err), intCmd("zadd", 0, err), pingErr(err)}
	}

	tests := []struct {
		name    string
		b       batch
		execErr error
		want    []error // per job command (lpush1, lpush2, zadd) when the batch counts
		wantErr string  // otherwise: the error push must return
	}{
		{"all pushed", ok(), nil, []error{nil, nil, nil}, ""},
		{"ZADD of an already scheduled payload adds 0", with(func(b *batch) { b.zadd = intCmd("zadd", 0, nil) }), nil, []error{nil, nil, nil}, ""},
		{"WRONGTYPE on one LPUSH refuses only its queue", with(func(b *batch) { b.lpush2 = intCmd("lpush", 0, wrongType) }), wrongType, []error{nil, wrongType, nil}, ""},
		{"WRONGTYPE on SADD queues does not refuse the jobs", with(func(b *batch) { b.sadd1 = intCmd("sadd", 0, wrongType) }), wrongType, []error{nil, nil, nil}, ""},
		{"SELECT refused at connection setup", unexecuted, selectRefused, nil, "DB index is out of range"},
		{"AUTH refused at connection setup, wrapped", unexecuted, errors.Join(errors.New("failed to authenticate"), wrongPass), nil, "WRONGPASS"},
		{"NOAUTH on MULTI, stamped on every command", stamped(noAuth), noAuth, nil, "NOAUTH"},
		{"EXECABORT", stamped(execAbort), execAbort, nil, "EXECABORT"},
		{"EXECABORT names the command Redis would not queue", func() batch {
			b := stamped(execAbort)
			b.lpush1 = intCmd("lpush", 0, replyErr("OOM command not allowed when used memory > 'maxmemory'."))
			return b
		}(), execAbort, nil, "EXECABORT Transaction discarded because of previous errors. (OOM command not allowed"},
		{"timeout before any reply", stamped(timeout), timeout, nil, "i/o timeout"},
		{"timeout after some replies", with(func(b *batch) {
			b.lpush2, b.zadd, b.ping = intCmd("lpush", 0, timeout), intCmd("zadd", 0, timeout), pingErr(timeout)
		}), timeout, nil, "i/o timeout"},
		{"PING not answered though no error", with(func(b *batch) { b.ping = unexecutedPing() }), nil, nil, "no reply proves"},
		{"PING answered, an error no command carries", ok(), selectRefused, nil, "DB index is out of range"},
		{"PING answered, a transport error", ok(), timeout, nil, "i/o timeout"},
		{"LPUSH reply missing", with(func(b *batch) { b.lpush1 = unexecutedInt("lpush") }), nil, nil, "lpush: reply 0, want 2"},
		{"LPUSH reply below its payload count", with(func(b *batch) { b.lpush1 = intCmd("lpush", 1, nil) }), nil, nil, "lpush: reply 1, want 2"},
		{"ZADD reply above its member count", with(func(b *batch) { b.zadd = intCmd("zadd", 2, nil) }), nil, nil, "zadd: reply 2, want 0 to 1"},
		{"LPUSH reply of the wrong type", with(func(b *batch) { b.lpush1 = intCmd("lpush", 0, parseErr) }), parseErr, nil, "can't parse int reply"},
		{"LPUSH wrong type, exec error elsewhere", with(func(b *batch) { b.lpush1, b.sadd1 = intCmd("lpush", 0, parseErr), intCmd("sadd", 0, wrongType) }), wrongType, nil, "lpush: redis: can't parse"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.b
			executed := []redis.Cmder{b.sadd1, b.lpush1, b.sadd2, b.lpush2, b.zadd, b.ping}
			jobs := []jobCmd{{b.lpush1, 2, math.MaxInt64}, {b.lpush2, 1, math.MaxInt64}, {b.zadd, 0, 1}}
			got, err := txOutcome(nil, executed, tc.execErr, jobs)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("txOutcome = %v, %v; want an error containing %q, so that every row stays staged", got, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("txOutcome error = %v, want the batch to count", err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("txOutcome = %v, want %v", got, tc.want)
			}
			for i := range got {
				if !errors.Is(got[i], tc.want[i]) || (got[i] == nil) != (tc.want[i] == nil) {
					t.Fatalf("txOutcome = %v, want %v", got, tc.want)
				}
			}
		})
	}
}

// Against real servers that refuse the connection's setup (SELECT of a DB
// the server lacks; a wrong or missing password), push reports an error and
// counts no job as pushed.
func TestPushToRefusingRedis(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, "--requirepass", "secret")
	shared, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	private := fmt.Sprintf("127.0.0.1:%d", srv.Port)
	tests := []struct {
		name string
		opts *redis.Options
		want string
	}{
		{"DB out of range", &redis.Options{Addr: shared.Addr, Password: shared.Password, DB: 99}, "DB index is out of range"},
		{"wrong password", &redis.Options{Addr: private, Password: "wrong"}, "WRONGPASS"},
		{"no password", &redis.Options{Addr: private}, "NOAUTH"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rdb := redis.NewClient(testenv.RedisOptions(tc.opts))
			defer rdb.Close()
			now := time.Now()
			later := now.Add(time.Hour)
			batch := []stagedJob{
				{id: 1, name: "Lost", args: []byte(`[1]`), queue: "default", jid: "0123456789abcdef01234567", createdAt: now},
				{id: 2, name: "Lost", args: []byte(`[2]`), queue: "other", jid: "0123456789abcdef01234568", createdAt: now},
				{id: 3, name: "Lost", args: []byte(`[3]`), queue: "default", jid: "0123456789abcdef01234569", createdAt: now, runAt: &later},
			}
			s := newSidekiqSink(rdb, testenv.Name("sdtest_"), TimestampSeconds, defaultMaxPayloadBytes)
			res, err := s.push(context.Background(), batch, now)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("push = %+v, %v; want an error containing %q", res, err, tc.want)
			}
			if len(res.pushed) != 0 {
				t.Fatalf("push counted ids %v as pushed to a Redis that refused the connection", res.pushed)
			}
		})
	}
}

// A Redis error reply to one job's command is transient (the rows wait and
// are retried) when waiting may fix it, and poison (dead-lettered) when the
// same job would be refused again.
func TestIsTransientReply(t *testing.T) {
	tests := []struct {
		reply     string
		transient bool
	}{
		{"WRONGTYPE Operation against a key holding the wrong kind of value", false},
		{"ERR string exceeds maximum allowed size (proto-max-bulk-len)", false},
		{"ERR value is not a valid float", false},
		{"OOM command not allowed when used memory > 'maxmemory'.", true},
		{"READONLY You can't write against a read only replica.", true},
		{"LOADING Redis is loading the dataset in memory", true},
		{"BUSY Redis is busy running a script.", true},
		{"TRYAGAIN Multiple keys request during rehashing of slot", true},
		{"CLUSTERDOWN The cluster is down", true},
		{"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", true},
		{"NOREPLICAS Not enough good replicas to write.", true},
		{"MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", true},
		{"NOPERM User relay has no permissions to access the 'queue:x' key", true},
		{"OOMPH not a code we know", false},
	}
	for _, tc := range tests {
		if got := isTransientReply(replyErr(tc.reply)); got != tc.transient {
			t.Errorf("isTransientReply(%q) = %v, want %v", tc.reply, got, tc.transient)
		}
	}
}
