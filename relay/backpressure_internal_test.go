package relay

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A length guard (Config.MaxQueueLength) stops an op whose key holds the
// limit or more, by LLEN, XLEN or ZCARD, with a BACKPRESSURE reason that is
// deferred, not poison; an op below the limit runs whole (a batch's
// overshoot). Stopped ops are not recorded, and a second run of the same
// push answers from the record: the stopped op's rows stay staged.
func TestPushLengthGuard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	keys := newHandoffKeys(ns, "test", "lenguard", "")
	h := newHandoff(rdb, keys)
	if err := h.acquire(ctx, "me"); err != nil {
		t.Fatal(err)
	}
	full, below, stream, zset := ns+":queue:full", ns+":queue:below", ns+":stream:s", ns+":z"
	if err := rdb.LPush(ctx, full, "a", "b").Err(); err != nil {
		t.Fatal(err)
	}
	_ = rdb.LPush(ctx, below, "a").Err()
	for range 2 {
		_ = rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"jid", "old"}}).Err()
	}
	u := &h.unit
	u.reset()
	u.maxLen = 2
	u.begin([]int64{1, 2})
	u.limit("full", "LLEN", full)
	u.variadic("LPUSH", full, 1, []any{"c", "d"})
	u.begin([]int64{3, 4})
	u.limit("below", "LLEN", below)
	u.variadic("LPUSH", below, 1, []any{"b", "c", "d"}) // one below: all go
	u.begin([]int64{5})
	u.limit("s", "XLEN", stream)
	u.command("XADD", stream, "*", "jid", "x")
	u.begin([]int64{6}, ns+":absent")
	u.limit("z", "ZCARD", zset) // empty: runs
	u.command("ZADD", zset, 1, "m")
	field, err := h.push(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	want := "BACKPRESSURE " + full + " holds 2 >= --max-queue-length 2"
	if op := u.ops[0]; !op.over || op.err == nil || op.err.Error() != want || isPermanentReply(op.err) {
		t.Fatalf("full queue's op: over %v, err %v; want over, %q, not permanent", op.over, op.err, want)
	}
	if u.ops[1].over || u.ops[1].err != nil || u.ops[3].over || u.ops[3].err != nil {
		t.Fatalf("ops below the limit: %v %v, want run", u.ops[1].err, u.ops[3].err)
	}
	if op := u.ops[2]; !op.over || !strings.HasPrefix(op.err.Error(), "BACKPRESSURE "+stream+" holds 2") {
		t.Fatalf("full stream's op: over %v, err %v", op.over, op.err)
	}
	if n := rdb.LLen(ctx, full).Val(); n != 2 {
		t.Fatalf("full queue holds %d, want 2 (nothing pushed)", n)
	}
	if n := rdb.LLen(ctx, below).Val(); n != 4 {
		t.Fatalf("queue below the limit holds %d, want 4 (the whole op)", n)
	}
	if rec := rdb.HGet(ctx, keys.record, field).Val(); rec != "3,4,6" {
		t.Fatalf("record %q, want 3,4,6: the stopped ops' rows are not recorded", rec)
	}

	// A resent copy of the same push (after the queue was consumed) runs
	// nothing: the first run's stopped rows stay staged.
	_ = rdb.Del(ctx, full).Err()
	k := append([]string{keys.fence, keys.record}, u.keys...)
	args := append([]any{h.token, field, 0}, u.args...)
	reply, err := handoffScript.Run(ctx, rdb, k, args...).Slice()
	if err != nil {
		t.Fatal(err)
	}
	if err := u.settle(nil, reply); err != nil {
		t.Fatal(err)
	}
	if u.ops[0].err != errReplayRefused || u.ops[1].err != nil || u.ops[2].err != errReplayRefused {
		t.Fatalf("replayed outcomes %v %v %v, want refused, delivered, refused", u.ops[0].err, u.ops[1].err, u.ops[2].err)
	}
	if n := rdb.Exists(ctx, full).Val(); n != 0 {
		t.Fatal("the replay pushed the stopped op")
	}
}

// Validate refuses a negative MaxQueueLength, a RedisMaxMemoryRatio outside
// 0-1, and a ratio with a Redis Cluster client.
func TestValidateBackpressure(t *testing.T) {
	t.Parallel()
	base := Config{DatabaseURL: "postgres://127.0.0.1/test", Redis: redis.NewClient(&redis.Options{})}.WithDefaults()
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	t.Cleanup(func() { _ = base.Redis.Close(); _ = cluster.Close() })
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		field string // "" valid
	}{
		{"off", func(*Config) {}, ""},
		{"on", func(c *Config) { c.MaxQueueLength, c.RedisMaxMemoryRatio = 1000, 0.8 }, ""},
		{"negative length", func(c *Config) { c.MaxQueueLength = -1 }, "MaxQueueLength"},
		{"ratio above 1", func(c *Config) { c.RedisMaxMemoryRatio = 1.5 }, "RedisMaxMemoryRatio"},
		{"negative ratio", func(c *Config) { c.RedisMaxMemoryRatio = -0.1 }, "RedisMaxMemoryRatio"},
		{"ratio on a cluster", func(c *Config) { c.Target, c.Redis, c.RedisMaxMemoryRatio = TargetStreams, cluster, 0.5 }, "RedisMaxMemoryRatio"},
	} {
		c := base
		tc.edit(&c)
		err := c.Validate()
		var fe *FieldError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: %v, want valid", tc.name, err)
		case tc.field != "" && (!errors.As(err, &fe) || fe.Field != tc.field):
			t.Errorf("%s: %v, want a FieldError on %s", tc.name, err, tc.field)
		}
	}
}
