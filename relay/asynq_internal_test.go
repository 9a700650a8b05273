package relay

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The asynq target writes, for each kind of job and option, the very keys
// and values asynq's own Client writes for the same task: byte for byte the
// same encoded TaskMessage, the same hash fields, list, sorted set and
// uniqueness lock. One private Redis gets asynq.Client's writes, the other
// the relay's push.
func TestAsynqLayoutMatchesClient(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	theirs := privateRedis(t)
	ours := privateRedis(t)
	client := asynq.NewClientFromRedisClient(theirs)
	t.Cleanup(func() { _ = client.Close() })
	h := handoff.New(ours, newHandoffKeys("", "test", "asynq", ""))
	if err := h.Ready(ctx, "me"); err != nil {
		t.Fatal(err)
	}
	target := builtin(TargetAsynq, targets.Options{MaxPayload: 1 << 20})
	later := time.Now().Add(time.Hour).Truncate(time.Second).Add(300 * time.Millisecond)
	deadline := time.Now().Add(2 * time.Hour).Unix()
	cases := []struct {
		name    string
		args    string
		queue   string
		runAt   *time.Time
		options string
		theirs  []asynq.Option
	}{
		{"plain", `[42, "ada"]`, "default", nil, `{}`, nil},
		{"empty args", `[]`, "critical", nil, `{}`, nil},
		{"options", `[{"user": 7}]`, "critical", nil,
			`{"retry": 3, "timeout": 60, "retention": 3600, "unique": 300, "headers": {"trace": "abc"}}`,
			[]asynq.Option{asynq.MaxRetry(3), asynq.Timeout(60 * time.Second), asynq.Retention(time.Hour), asynq.Unique(300 * time.Second)}},
		{"no retry, a deadline", `[1]`, "default", nil, fmt.Sprintf(`{"retry": false, "deadline": %d}`, deadline),
			[]asynq.Option{asynq.MaxRetry(0), asynq.Deadline(time.Unix(deadline, 0))}},
		{"scheduled", `[2]`, "default", &later, `{}`, []asynq.Option{asynq.ProcessAt(later)}},
		{"scheduled unique", `[3]`, "low", &later, `{"unique": 600}`,
			[]asynq.Option{asynq.ProcessAt(later), asynq.Unique(600 * time.Second)}},
	}
	for i, c := range cases {
		jid := fmt.Sprintf("jid-%d", i)
		job := stagedJob{id: int64(i + 1), name: "Welcome", args: []byte(c.args), queue: c.queue,
			runAt: c.runAt, jid: jid, createdAt: time.Now(), options: []byte(c.options)}
		var headers map[string]string
		if strings.Contains(c.options, "headers") {
			headers = map[string]string{"trace": "abc"}
		}
		opts := append([]asynq.Option{asynq.TaskID(jid), asynq.Queue(c.queue)}, c.theirs...)
		if _, err := client.Enqueue(asynq.NewTaskWithHeaders("Welcome", []byte(c.args), headers), opts...); err != nil {
			t.Fatalf("%s: asynq enqueue: %v", c.name, err)
		}
		u := h.Unit()
		u.Reset()
		var res pushResult
		target.add(u, []stagedJob{job}, time.Now(), &res)
		if len(res.rejected) > 0 {
			t.Fatalf("%s: rejected: %v", c.name, res.rejected)
		}
		if _, err := h.Push(ctx, u); err != nil {
			t.Fatalf("%s: push: %v", c.name, err)
		}
		for _, op := range u.Ops() {
			if op.Err != nil || op.Skipped {
				t.Fatalf("%s: op %v: err %v, skipped %v", c.name, op.IDs, op.Err, op.Skipped)
			}
		}
	}
	want, got := dumpAsynq(t, theirs), dumpAsynq(t, ours)
	for _, k := range slices.Sorted(mapKeys(want, got)) {
		if want[k] != got[k] {
			t.Errorf("key %s:\n asynq.Client wrote %s\n the relay wrote  %s", k, want[k], got[k])
		}
	}
}

// privateRedis starts a redis-server of the test's own, for asynq's keys,
// which no namespace can separate, and returns a client of it.
func privateRedis(t *testing.T) *redis.Client {
	srv := testenv.StartRedis(t)
	opts, _ := redis.ParseURL(srv.URL())
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

func mapKeys(ms ...map[string]string) func(func(string) bool) {
	return func(yield func(string) bool) {
		seen := map[string]bool{}
		for _, m := range ms {
			for k := range m {
				if !seen[k] && !yield(k) {
					return
				}
				seen[k] = true
			}
		}
	}
}

// dumpAsynq describes every asynq:* key of rdb: its type and value, with
// times that differ between two writers (pending_since, a lock's TTL)
// rounded.
func dumpAsynq(t *testing.T, rdb *redis.Client) map[string]string {
	t.Helper()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "asynq:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]string)
	for _, k := range keys {
		typ := rdb.Type(ctx, k).Val()
		var v string
		switch typ {
		case "hash":
			m := rdb.HGetAll(ctx, k).Val()
			if ps, ok := m["pending_since"]; ok {
				ns, err := strconv.ParseInt(ps, 10, 64)
				if err != nil || time.Since(time.Unix(0, ns)) > time.Minute || time.Since(time.Unix(0, ns)) < 0 {
					t.Errorf("%s pending_since %q is not a recent time in unix nanoseconds", k, ps)
				}
				m["pending_since"] = "(recent)"
			}
			for _, f := range slices.Sorted(mapKeys(m)) {
				v += fmt.Sprintf("%s=%q ", f, m[f])
			}
		case "list":
			v = fmt.Sprint(rdb.LRange(ctx, k, 0, -1).Val())
		case "set":
			v = fmt.Sprint(slices.Sorted(slices.Values(rdb.SMembers(ctx, k).Val())))
		case "zset":
			v = fmt.Sprint(rdb.ZRangeWithScores(ctx, k, 0, -1).Val())
		case "string":
			ttl := rdb.TTL(ctx, k).Val()
			v = fmt.Sprintf("%q ttl %ds", rdb.Get(ctx, k).Val(), (ttl+5*time.Second)/(10*time.Second)*10)
		}
		out[k] = typ + " " + v
	}
	return out
}
