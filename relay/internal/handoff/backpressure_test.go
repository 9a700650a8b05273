package handoff

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A length guard over several keys adds up their lengths, one command per
// key: one command for all of them (target/celery.go's lists) or a sum with a term
// per key (target/bullmq.go's LLEN+LLEN+ZCARD); both reach the script as the sum.
func TestPushLengthGuardSums(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	keys := newHandoffKeys(ns, "test", "lensum", "")
	h := New(rdb, keys)
	if err := h.acquire(ctx, "me"); err != nil {
		t.Fatal(err)
	}
	l1, l2, l3, z := ns+":l1", ns+":l2", ns+":l3", ns+":z"
	_ = rdb.LPush(ctx, l1, "a").Err()
	_ = rdb.LPush(ctx, l2, "a").Err()
	_ = rdb.ZAdd(ctx, z, redis.Z{Score: 1, Member: "m"}).Err()
	u := &h.unit
	u.Reset()
	u.MaxLen = 3
	u.Begin([]int64{1})
	u.Limit("lists", "LLEN", l1, l2, l3) // 1 + 1 + 0 = 2: runs
	u.Command("LPUSH", l3, "x")
	u.Begin([]int64{2})
	u.Limit("mixed", "LLEN+LLEN+ZCARD", l1, l2, z) // 1 + 1 + 1 = 3: stopped
	u.Command("LPUSH", l1, "y")
	u.Begin([]int64{3})
	u.Limit("lists", "LLEN", l1, l2, l3) // now 1 + 1 + 1 = 3: stopped
	u.Command("LPUSH", l3, "z")
	if g := u.args[u.ops[0].a0]; g != "0 LLEN+LLEN+LLEN 3" {
		t.Fatalf("guard %q, want the sum \"0 LLEN+LLEN+LLEN 3\"", g)
	}
	if _, err := h.Push(ctx, u); err != nil {
		t.Fatal(err)
	}
	if op := u.ops[0]; op.Over || op.Err != nil {
		t.Fatalf("op below the summed limit: over %v, err %v; want run", op.Over, op.Err)
	}
	want := "BACKPRESSURE " + l1 + " (with 2 more keys) holds 3 >= --max-queue-length 3"
	for i := 1; i <= 2; i++ {
		if op := u.ops[i]; !op.Over || op.Err == nil || op.Err.Error() != want {
			t.Fatalf("op %d: over %v, err %v; want %q", i, op.Over, op.Err, want)
		}
	}
	if n1, n3 := rdb.LLen(ctx, l1).Val(), rdb.LLen(ctx, l3).Val(); n1 != 1 || n3 != 1 {
		t.Fatalf("lists hold %d and %d, want 1 and 1 (only the first op ran)", n1, n3)
	}
}

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
	h := New(rdb, keys)
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
	u.Reset()
	u.MaxLen = 2
	u.Begin([]int64{1, 2})
	u.Limit("full", "LLEN", full)
	u.Variadic("LPUSH", full, 1, []any{"c", "d"})
	u.Begin([]int64{3, 4})
	u.Limit("below", "LLEN", below)
	u.Variadic("LPUSH", below, 1, []any{"b", "c", "d"}) // one below: all go
	u.Begin([]int64{5})
	u.Limit("s", "XLEN", stream)
	u.Command("XADD", stream, "*", "jid", "x")
	u.Begin([]int64{6}, ns+":absent")
	u.Limit("z", "ZCARD", zset) // empty: runs
	u.Command("ZADD", zset, 1, "m")
	field, err := h.Push(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	want := "BACKPRESSURE " + full + " holds 2 >= --max-queue-length 2"
	if op := u.ops[0]; !op.Over || op.Err == nil || op.Err.Error() != want || Permanent(op.Err) {
		t.Fatalf("full queue's op: over %v, err %v; want over, %q, not permanent", op.Over, op.Err, want)
	}
	if u.ops[1].Over || u.ops[1].Err != nil || u.ops[3].Over || u.ops[3].Err != nil {
		t.Fatalf("ops below the limit: %v %v, want run", u.ops[1].Err, u.ops[3].Err)
	}
	if op := u.ops[2]; !op.Over || !strings.HasPrefix(op.Err.Error(), "BACKPRESSURE "+stream+" holds 2") {
		t.Fatalf("full stream's op: over %v, err %v", op.Over, op.Err)
	}
	if n := rdb.LLen(ctx, full).Val(); n != 2 {
		t.Fatalf("full queue holds %d, want 2 (nothing pushed)", n)
	}
	if n := rdb.LLen(ctx, below).Val(); n != 4 {
		t.Fatalf("queue below the limit holds %d, want 4 (the whole op)", n)
	}
	if rec := rdb.HGet(ctx, keys.Record, field).Val(); rec != "3,4,6" {
		t.Fatalf("record %q, want 3,4,6: the stopped ops' rows are not recorded", rec)
	}

	// A resent copy of the same push (after the queue was consumed) runs
	// nothing: the first run's stopped rows stay staged.
	_ = rdb.Del(ctx, full).Err()
	k := append([]string{keys.Fence, keys.Record}, u.keys...)
	args := append([]any{h.token, field, 0}, u.args...)
	reply, err := handoffScript.Run(ctx, rdb, k, args...).Slice()
	if err != nil {
		t.Fatal(err)
	}
	if err := u.settle(nil, reply); err != nil {
		t.Fatal(err)
	}
	if u.ops[0].Err != errReplayRefused || u.ops[1].Err != nil || u.ops[2].Err != errReplayRefused {
		t.Fatalf("replayed outcomes %v %v %v, want refused, delivered, refused", u.ops[0].Err, u.ops[1].Err, u.ops[2].Err)
	}
	if n := rdb.Exists(ctx, full).Val(); n != 0 {
		t.Fatal("the replay pushed the stopped op")
	}
}

// A stream's length guard (XUNACKED) counts what its slowest consumer
// group has not acknowledged, pending plus lag, not XLEN: entries a group
// read and acknowledged stay in the stream. With no group every entry
// counts; a lag Redis cannot tell (an unread entry deleted) is counted by
// XRANGE; within one run each op that ran counts one entry more.
func TestPushStreamUnackedGuard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	keys := newHandoffKeys(ns, "test", "unacked", "")
	h := New(rdb, keys)
	if err := h.acquire(ctx, "me"); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	add := func(stream string, n int) []string {
		t.Helper()
		var ids []string
		for range n {
			id, err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"jid", "old"}}).Result()
			must(err)
			ids = append(ids, id)
		}
		return ids
	}
	// read has group read n entries as consumer c, and acknowledges acked of them.
	read := func(stream, group string, n, acked int) {
		t.Helper()
		res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "c", Streams: []string{stream, ">"}, Count: int64(n), Block: -1}).Result()
		must(err)
		if got := len(res[0].Messages); got != n {
			t.Fatalf("%s read %d entries of %s, want %d", group, got, stream, n)
		}
		for _, m := range res[0].Messages[:acked] {
			must(rdb.XAck(ctx, stream, group, m.ID).Err())
		}
	}
	group := func(stream, name, start string) { must(rdb.XGroupCreateMkStream(ctx, stream, name, start).Err()) }

	noGroup, acked, pending, twoGroups, unknownLag, below, absent :=
		ns+":stream:nogroup", ns+":stream:acked", ns+":stream:pending", ns+":stream:two", ns+":stream:unknown", ns+":stream:below", ns+":stream:absent"
	add(noGroup, 2)
	group(acked, "workers", "0")
	add(acked, 5)
	read(acked, "workers", 5, 5) // XLEN 5, nothing unacknowledged
	group(pending, "workers", "0")
	add(pending, 3)
	read(pending, "workers", 2, 1) // 1 pending + 1 lag
	group(twoGroups, "fast", "0")
	group(twoGroups, "slow", "0")
	add(twoGroups, 2)
	read(twoGroups, "fast", 2, 2) // slow: lag 2
	group(unknownLag, "workers", "0")
	ids := add(unknownLag, 4)
	read(unknownLag, "workers", 1, 1)
	must(rdb.XDel(ctx, unknownLag, ids[2]).Err()) // an unread entry deleted: lag unknown, 2 unread
	group(below, "workers", "0")
	ids = add(below, 4)
	read(below, "workers", 1, 1)
	must(rdb.XDel(ctx, below, ids[2], ids[3]).Err()) // 1 unread
	for _, s := range []string{unknownLag, below} {
		g, err := rdb.XInfoGroups(ctx, s).Result()
		must(err)
		if g[0].Lag != -1 { // go-redis reads a nil lag as -1
			t.Fatalf("%s: lag %d, want nil (unknown), the case XRANGE counts", s, g[0].Lag)
		}
	}

	u := &h.unit
	u.Reset()
	u.MaxLen = 2
	op := func(id int64, stream string) {
		u.Begin([]int64{id})
		u.Limit("q", "XUNACKED", stream)
		u.Command("XADD", stream, "*", "jid", strconv.FormatInt(id, 10))
	}
	op(1, noGroup)
	op(2, acked) // 0: runs, then 1
	op(3, acked) // 1: runs, then 2
	op(4, acked) // 2: stopped
	op(5, pending)
	op(6, twoGroups)
	op(7, unknownLag)
	op(8, below)
	op(9, absent)
	if _, err := h.Push(ctx, u); err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{
		"BACKPRESSURE " + noGroup + " holds 2 and has no consumer group >= --max-queue-length 2",
		"", "",
		"BACKPRESSURE " + acked + `: consumer group "workers" has 2 entries not acknowledged (lag + pending) >= --max-queue-length 2`,
		"BACKPRESSURE " + pending + `: consumer group "workers" has 2 entries not acknowledged (lag + pending) >= --max-queue-length 2`,
		"BACKPRESSURE " + twoGroups + `: consumer group "slow" has 2 entries not acknowledged (lag + pending) >= --max-queue-length 2`,
		"BACKPRESSURE " + unknownLag + `: consumer group "workers" has 2 entries not acknowledged (lag + pending) >= --max-queue-length 2`,
		"", "",
	} {
		op := u.ops[i]
		switch {
		case want == "" && (op.Over || op.Err != nil):
			t.Errorf("op %d: over %v, err %v; want it run", i+1, op.Over, op.Err)
		case want != "" && (!op.Over || op.Err == nil || op.Err.Error() != want):
			t.Errorf("op %d: over %v, err %v; want over, %q", i+1, op.Over, op.Err, want)
		}
	}
	if n := rdb.XLen(ctx, acked).Val(); n != 7 {
		t.Fatalf("%s holds %d entries, want 7 (5 acknowledged, 2 added)", acked, n)
	}
}
