package handoff

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Of two handoffs that took the fence one after the other, the first is
// refused whole: none of its commands runs, nothing is recorded. The second
// pushes, and records what it delivered.
func TestFenceRefusesTheDeposedLeader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	keys := newHandoffKeys(ns, "test", "fenced", "")
	old, cur := New(rdb, keys), New(rdb, keys)
	if err := old.acquire(ctx, "old"); err != nil {
		t.Fatal(err)
	}
	if err := cur.acquire(ctx, "current"); err != nil {
		t.Fatal(err)
	}
	list := ns + ":list"
	build := func(u *Unit, ids []int64) {
		u.Reset()
		u.Begin(nil, "")
		u.Command("SADD", ns+":set", "x")
		u.Begin(ids, "")
		u.Variadic("LPUSH", list, 1, []any{"a", "b"})
	}
	build(&old.unit, []int64{1, 2})
	if _, err := old.Push(ctx, &old.unit); !errors.Is(err, ErrFenced) {
		t.Fatalf("the deposed leader's push: %v, want ErrFenced", err)
	}
	if n, _ := rdb.Exists(ctx, list, ns+":set", keys.Record).Result(); n != 0 {
		t.Fatalf("%d keys written by a refused push, want none", n)
	}
	build(&cur.unit, []int64{3, 4})
	field, err := cur.Push(ctx, &cur.unit)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := rdb.LRange(ctx, list, 0, -1).Result(); len(got) != 2 {
		t.Fatalf("list %v after the leader's push, want its 2 values", got)
	}
	if rec, _ := rdb.HGetAll(ctx, keys.Record).Result(); rec[field] != "3,4" || len(rec) != 1 {
		t.Fatalf("record %v, want {%s: 3,4}", rec, field)
	}
}

// An op whose command Redis refuses (WRONGTYPE) is reported and not
// recorded; the other ops of the push run and are recorded. Long commands
// are split at maxCommandArgs; a guarded op whose key exists is skipped and
// counts as done.
func TestPushUnitOps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	keys := newHandoffKeys(ns, "test", "ops", "")
	h := New(rdb, keys)
	if err := h.acquire(ctx, "me"); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, ns+":string", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	many := make([]any, 2500)
	manyIDs := make([]int64, 2500)
	for i := range many {
		many[i], manyIDs[i] = i, int64(100+i)
	}
	u := &h.unit
	u.Reset()
	u.Begin([]int64{1}, "")
	u.Variadic("LPUSH", ns+":string", 1, []any{"refused"})
	u.Begin(manyIDs, "")
	u.Variadic("LPUSH", ns+":many", 1, many)
	u.Begin([]int64{2}, ns+":string") // exists: skipped
	u.Command("LPUSH", ns+":skipped", "never")
	u.Begin([]int64{3}, ns+":absent", ns+":string") // the second exists: skipped
	u.Command("LPUSH", ns+":skipped", "never")
	u.Begin([]int64{4}, ns+":absent", "") // none exists: runs
	u.Command("LPUSH", ns+":guarded", "ran")
	field, err := h.Push(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	if u.ops[0].Err == nil || u.ops[1].Err != nil || u.ops[2].Err != nil {
		t.Fatalf("outcomes %v %v %v, want WRONGTYPE, nil, nil", u.ops[0].Err, u.ops[1].Err, u.ops[2].Err)
	}
	if !Permanent(u.ops[0].Err) {
		t.Fatalf("%v counted transient", u.ops[0].Err)
	}
	if n, _ := rdb.LLen(ctx, ns+":many").Result(); n != 2500 {
		t.Fatalf("%d values pushed in split commands, want 2500", n)
	}
	if n, _ := rdb.Exists(ctx, ns+":skipped").Result(); n != 0 {
		t.Fatal("a guarded op ran although its key exists")
	}
	if !u.ops[3].Skipped || u.ops[3].Reply != ns+":string" || u.ops[4].Skipped {
		t.Fatalf("op with guards absent, string: skipped %v by %v; op with guard absent: skipped %v; want skipped by %s, then run",
			u.ops[3].Skipped, u.ops[3].Reply, u.ops[4].Skipped, ns+":string")
	}
	if got, _ := rdb.LRange(ctx, ns+":guarded", 0, -1).Result(); len(got) != 1 {
		t.Fatalf("list %v, want the value of the op whose guard key does not exist", got)
	}
	rec, _ := rdb.HGet(ctx, keys.Record, field).Result()
	if len(rec) == 0 || rec[:4] != "100," || rec[len(rec)-6:] != ",2,3,4" {
		t.Fatalf("record %q, want the ids of the two ops that delivered", rec)
	}
	// The next push deletes the records of committed batches.
	h.Committed(field, nil, 100, 100)
	if err := h.Tidy(ctx, func([]int64) ([]int64, error) { return nil, nil }, func() (uint64, uint64, error) { return 100, 100, nil }); err != nil {
		t.Fatal(err)
	}
	if n, _ := rdb.Exists(ctx, keys.Record).Result(); n != 0 {
		t.Fatal("record left after its batch committed and tidy ran")
	}
}

// The push script is safe to run twice: a second run of the same batch
// (same token, same record field) runs none of its commands and answers
// what the first run delivered. An op the first run refused (WRONGTYPE
// here) is reported as refused-for-now (TRYAGAIN), never as delivered.
func TestPushScriptRunsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	h := New(rdb, newHandoffKeys(ns, "test", "twice", ""))
	if err := h.acquire(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, ns+":string", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	build := func() {
		h.unit.Reset()
		h.unit.Begin([]int64{1, 2}, "")
		h.unit.Variadic("LPUSH", ns+":list", 1, []any{"a", "b"})
		h.unit.Begin([]int64{3}, "")
		h.unit.Command("LPUSH", ns+":string", "c")
	}
	build()
	first, err := h.Push(ctx, &h.unit)
	if err != nil {
		t.Fatal(err)
	}
	if h.unit.ops[0].Err != nil || h.unit.ops[1].Err == nil {
		t.Fatalf("first run: ops %v, %v; want delivered, then WRONGTYPE", h.unit.ops[0].Err, h.unit.ops[1].Err)
	}
	h.seq-- // the same batch again, as a resent command would be
	build()
	again, err := h.Push(ctx, &h.unit)
	if err != nil || again != first {
		t.Fatalf("second run: field %q, %v; want %q", again, err, first)
	}
	if n, _ := rdb.LLen(ctx, ns+":list").Result(); n != 2 {
		t.Fatalf("list holds %d values after two runs of one push, want 2", n)
	}
	if h.unit.ops[0].Err != nil || h.unit.ops[1].Err != errReplayRefused {
		t.Fatalf("second run: ops %v, %v; want delivered, then %v", h.unit.ops[0].Err, h.unit.ops[1].Err, errReplayRefused)
	}
}

// Redis frozen past the client's read timeout: go-redis (MaxRetries 3, its
// default) sends the push again on new connections, which the frozen
// server accepts and buffers, and returns an error. On SIGCONT every copy
// runs, but only the first pushes. The next push first takes a new token
// and reads the record, which holds the batch.
func TestResentPushRunsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	addr := fmt.Sprintf("127.0.0.1:%d", srv.Port)
	rdb := redis.NewClient(&redis.Options{Addr: addr, DisableIdentity: true,
		ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond})
	defer rdb.Close()
	keys := newHandoffKeys("", "test", "resent", "")
	h := New(rdb, keys)
	if err := h.acquire(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	// A first push loads the script: a resent EVALSHA of a script the
	// server does not know would only be refused (NOSCRIPT).
	h.unit.Reset()
	h.unit.Begin([]int64{9}, "")
	h.unit.Command("LPUSH", "warm", "w")
	if _, err := h.Push(ctx, &h.unit); err != nil {
		t.Fatal(err)
	}
	testenv.WarmPool(t, rdb, 4)
	h.unit.Reset()
	h.unit.Begin([]int64{1, 2}, "")
	h.unit.Variadic("LPUSH", "list", 1, []any{"a", "b"})
	srv.Signal(syscall.SIGSTOP)
	_, err := h.Push(ctx, &h.unit)
	srv.Signal(syscall.SIGCONT)
	if err == nil {
		t.Fatal("a push to a frozen Redis succeeded")
	}
	// Every copy has run once its connection is gone: the client closed
	// each after its timeout, and Redis reads a closed connection's
	// buffered commands before its end.
	_ = rdb.Close()
	check := redis.NewClient(&redis.Options{Addr: addr, DisableIdentity: true, MaxRetries: -1})
	defer check.Close()
	testenv.WaitFor(t, 10*time.Second, "the resent copies to run", func() (bool, string) {
		info, err := check.Info(ctx, "clients").Result()
		return err == nil && strings.Contains(info, "connected_clients:1\r"), info
	})
	if n, _ := check.LLen(ctx, "list").Result(); n != 2 {
		t.Fatalf("list holds %d values, want the batch's 2 once", n)
	}
	h.rdb = check
	if err := h.Ready(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	if h.epoch != 2 || !h.WasDelivered(1) || !h.WasDelivered(2) {
		t.Fatalf("after the failed push: epoch %d, delivered %v; want a new token (epoch 2) and rows 1, 2 delivered", h.epoch, h.delivered)
	}
}

// A record field outlives its batch's COMMIT until the WAL is flushed past
// it: the drain commits with synchronous_commit = off, and a PostgreSQL
// crash before the flush would bring the rows back. They must then still
// be recorded, to be deleted rather than pushed again.
func TestRecordFieldWaitsForTheWALFlush(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	h := New(rdb, newHandoffKeys(ns, "test", "flush", ""))
	h.Committed("1:1", nil, 500, 400) // committed at 500, flushed to 400
	if len(h.clear) != 0 {
		t.Fatalf("clear %v right after an unflushed commit, want nothing", h.clear)
	}
	h.Committed("1:2", nil, 600, 500) // the flush reached the first
	if len(h.clear) != 1 || h.clear[0] != "1:1" {
		t.Fatalf("clear %v, want only the first batch's field", h.clear)
	}
	h.clear = h.clear[:0]
	h.flushed(599)
	if len(h.clear) != 0 {
		t.Fatalf("clear %v with the WAL flushed short of the second commit", h.clear)
	}
	// An idle drain's tidy reads the flush position itself.
	if err := rdb.HSet(ctx, h.keys.Record, "1:2", "7").Err(); err != nil {
		t.Fatal(err)
	}
	err := h.Tidy(ctx, func([]int64) ([]int64, error) { return nil, nil },
		func() (uint64, uint64, error) { return 700, 600, nil })
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := rdb.Exists(ctx, h.keys.Record).Result(); n != 0 || len(h.unflushed) != 0 {
		t.Fatalf("record left (%d) or fields still waiting (%v) after the flush passed them", n, h.unflushed)
	}
}

// A crash of PostgreSQL that undoes a batch's delete (committed with
// synchronous_commit = off, not yet flushed) brings its rows back, and the
// next leadership reads them from the record as delivered. The field must
// then stay in Redis until they are deleted again and that is durable: the
// WAL position noted at the first commit is of the crashed server's WAL,
// which the new server's passes long before (it goes on from where the
// flushed WAL ended). Before, the field went at the first flush past that
// position, with the rows deleted again perhaps only in memory: a second
// crash then brought them back unrecorded, and they were pushed twice.
func TestRecordFieldOutlivesACrashThatUndidItsDelete(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	h := New(rdb, newHandoffKeys(ns, "test", "crash", ""))
	if err := h.acquire(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	h.unit.Reset()
	h.unit.Begin([]int64{7, 8}, "")
	h.unit.Variadic("LPUSH", h.keys.Record+":list", 1, []any{"a", "b"})
	field, err := h.Push(ctx, &h.unit)
	if err != nil {
		t.Fatal(err)
	}
	h.Committed(field, nil, 500, 400) // committed at 500, flushed to 400: then the crash

	// The crash ends the leadership; the next one reads the record.
	h.Reset()
	if err := h.Ready(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	if !h.WasDelivered(7) || !h.WasDelivered(8) {
		t.Fatalf("rows 7 and 8 not delivered after the record was read again: %v", h.delivered)
	}
	// The new server's WAL passes 500 before the rows are deleted again.
	h.flushed(600)
	if slices.Contains(h.clear, field) {
		t.Fatalf("field %s to be deleted (clear %v) while its rows are not deleted again", field, h.clear)
	}
	// Deleted again (asynchronously) at 700, the WAL flushed to 650: the
	// field waits for 700.
	h.Committed("", []int64{7, 8}, 700, 650)
	if slices.Contains(h.clear, field) {
		t.Fatalf("field %s to be deleted (clear %v) before the second delete is flushed", field, h.clear)
	}
	h.flushed(700)
	if !slices.Contains(h.clear, field) {
		t.Fatalf("field %s not to be deleted (clear %v) once the second delete is flushed", field, h.clear)
	}
}

// The fence and record of a schema gone are deleted after its last lead
// when the record holds no batch whose rows may still be staged: here one
// delivered whose delete committed (its WAL not yet seen flushed, so the
// field is still in Redis). They stay when a batch delivered rows whose
// delete did not commit, when another leadership took the fence since, and
// before this leadership took it (it has not read the record).
func TestDropDeletesASettledRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	push := func(h *Handoff, ids ...int64) string {
		t.Helper()
		h.unit.Reset()
		h.unit.Begin(ids, "")
		h.unit.Command("LPUSH", ns+":list", "job")
		field, err := h.Push(ctx, &h.unit)
		if err != nil {
			t.Fatal(err)
		}
		return field
	}
	exists := func(h *Handoff) int64 {
		t.Helper()
		n, err := rdb.Exists(ctx, h.keys.Fence, h.keys.Record).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	drop := func(h *Handoff, want bool) {
		t.Helper()
		got, err := h.Drop(ctx)
		if err != nil || got != want {
			t.Fatalf("drop: %v, %v; want %v", got, err, want)
		}
	}

	settled := New(rdb, newHandoffKeys(ns, "test", "settled", ""))
	drop(settled, false) // never took the fence: knows nothing of the record
	if err := settled.acquire(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	settled.Committed(push(settled, 1, 2), nil, 500, 400)
	if n := exists(settled); n != 2 {
		t.Fatalf("%d of the fence and record exist after a push, want both", n)
	}
	drop(settled, true)
	if n := exists(settled); n != 0 {
		t.Errorf("%d of the fence and record left after a settled drop, want none", n)
	}

	unsettled := New(rdb, newHandoffKeys(ns, "test", "unsettled", ""))
	if err := unsettled.acquire(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	unsettled.Uncommitted(push(unsettled, 3), []int64{3})
	drop(unsettled, false)
	if n := exists(unsettled); n != 2 {
		t.Errorf("%d of the fence and record left with row 3 delivered and its delete not committed, want both", n)
	}

	keys := newHandoffKeys(ns, "test", "deposed", "")
	old, cur := New(rdb, keys), New(rdb, keys)
	if err := old.acquire(ctx, "old"); err != nil {
		t.Fatal(err)
	}
	old.Committed(push(old, 4), nil, 500, 400)
	if err := cur.acquire(ctx, "current"); err != nil {
		t.Fatal(err)
	}
	drop(old, false)
	if n := exists(old); n != 2 {
		t.Errorf("%d of the fence and record left after a deposed leadership's drop, want both", n)
	}
}

// A drain's end tidies the record only while delivered rows wait; the
// drain loop's timer tidies TidyEvery after the last drain.
func TestTidyDue(t *testing.T) {
	h := New(nil, newHandoffKeys("ns", "test", "tidy", ""))
	if h.TidyDue() {
		t.Fatal("a drain with no delivered row waiting tidies")
	}
	h.delivered[7] = "1:1"
	if !h.TidyDue() {
		t.Fatal("a drain with delivered rows waiting does not tidy")
	}
}
