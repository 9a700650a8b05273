package handoff

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// On a cluster, each slot's fence refuses a deposed leader once the new
// leader has claimed the slot; a deposed leader's push to a slot the new
// leader has not claimed yet succeeds, but is in the slot's record when the
// new leader claims it, before its first push there: those rows are known
// as delivered, not pushed again.
func TestClusterFenceRefusesTheDeposedLeader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := testenv.StartRedisCluster(t).Client(t)
	keys := newHandoffKeys("", "test", "fenced", "")
	listA, listB := "{qa}:list", "{qb}:list"
	if KeySlot(listA) == KeySlot(listB) {
		t.Fatal("the two lists share a slot")
	}
	old1, old2, cur := New(rdb, keys), New(rdb, keys), New(rdb, keys)
	for _, h := range []*Handoff{old1, old2, cur} {
		if !h.cluster {
			t.Fatal("a handoff on a ClusterClient is not in cluster mode")
		}
		if err := h.acquire(ctx, "h"); err != nil {
			t.Fatal(err)
		}
	}
	if !(old1.epoch < old2.epoch && old2.epoch < cur.epoch) {
		t.Fatalf("epochs %d, %d, %d, want increasing", old1.epoch, old2.epoch, cur.epoch)
	}
	// build makes h's unit one op that delivers ids to list, and claims
	// its slot: again says the slot's record holds some of ids.
	build := func(h *Handoff, list string, ids ...int64) (again bool, err error) {
		u := &h.unit
		u.Reset()
		u.Begin(ids)
		for range ids {
			u.Command("RPUSH", list, "job")
		}
		return h.Claim(ctx, u, "h")
	}
	push := func(h *Handoff, list string, ids ...int64) error {
		if again, err := build(h, list, ids...); err != nil || again {
			return errors.Join(err, errors.New("the record holds some ids"))
		}
		_, err := h.Push(ctx, &h.unit)
		return err
	}
	llen := func(list string) int64 { return rdb.LLen(ctx, list).Val() }

	if err := push(cur, listA, 1); err != nil {
		t.Fatalf("the leader's push: %v", err)
	}
	// Slot A is the leader's: the deposed one is refused, whole.
	if err := push(old1, listA, 2); !errors.Is(err, ErrFenced) {
		t.Fatalf("a deposed leader's push to a claimed slot: %v, want ErrFenced", err)
	}
	if n := llen(listA); n != 1 {
		t.Fatalf("list A holds %d jobs, want the leader's 1", n)
	}
	// Slot B is not claimed yet: the deposed leader's push goes through...
	if err := push(old2, listB, 7, 8); err != nil {
		t.Fatalf("a deposed leader's push to an unclaimed slot: %v", err)
	}
	// ...and the leader sees it as it claims slot B, before pushing there.
	again, err := build(cur, listB, 7, 8, 9)
	if err != nil || !again {
		t.Fatalf("the leader's claim of slot B: again %v, %v; want the record's rows 7 and 8", again, err)
	}
	if !cur.WasDelivered(7) || !cur.WasDelivered(8) || cur.WasDelivered(9) {
		t.Fatalf("delivered %v, want 7 and 8", cur.delivered)
	}
	if err := push(cur, listB, 9); err != nil {
		t.Fatalf("the leader's push to slot B: %v", err)
	}
	if err := push(old2, listB, 10); !errors.Is(err, ErrFenced) {
		t.Fatalf("the deposed leader's push once slot B is claimed: %v, want ErrFenced", err)
	}
	if n := llen(listB); n != 3 {
		t.Fatalf("list B holds %d jobs, want 7, 8 and 9 once each", n)
	}
	rec, err := rdb.HGetAll(ctx, keys.slot(KeySlot(listB)).Record).Result()
	if err != nil || len(rec) != 2 {
		t.Fatalf("slot B's record %v, %v; want the two pushes' fields", rec, err)
	}
}

// An op whose keys are in two slots is refused, not run: no script could
// run it atomically.
func TestClusterRefusesACrossSlotOp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := testenv.StartRedisCluster(t).Client(t)
	h := New(rdb, newHandoffKeys("", "test", "cross", ""))
	if err := h.acquire(ctx, "h"); err != nil {
		t.Fatal(err)
	}
	u := &h.unit
	u.Begin([]int64{1})
	u.Command("RPUSH", "{qa}:list", "job")
	u.Command("RPUSH", "{qb}:list", "job")
	u.Begin([]int64{2})
	u.Command("RPUSH", "{qa}:list", "job")
	if _, err := h.Claim(ctx, u, "h"); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Push(ctx, u); err != nil {
		t.Fatal(err)
	}
	if u.ops[0].Err != errCrossSlot || u.ops[1].Err != nil {
		t.Fatalf("op errors %v, %v; want CROSSSLOT, nil", u.ops[0].Err, u.ops[1].Err)
	}
	if n := rdb.LLen(ctx, "{qa}:list").Val() + rdb.LLen(ctx, "{qb}:list").Val(); n != 1 {
		t.Fatalf("%d jobs pushed, want the second op's 1", n)
	}
}

// On a cluster, drop deletes the global fence and, for each slot this
// leadership claimed, its fence and record, once every batch is settled.
func TestClusterDropDeletesSettledRecords(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := testenv.StartRedisCluster(t).Client(t)
	keys := newHandoffKeys("", "test", "dropped", "")
	h := New(rdb, keys)
	if err := h.acquire(ctx, "h"); err != nil {
		t.Fatal(err)
	}
	all := []string{keys.Fence}
	for i, list := range []string{"{qa}:list", "{qb}:list"} {
		u := &h.unit
		u.Reset()
		u.Begin([]int64{int64(i + 1)})
		u.Command("RPUSH", list, "job")
		if again, err := h.Claim(ctx, u, "h"); err != nil || again {
			t.Fatalf("claim: %v, %v", again, err)
		}
		field, err := h.Push(ctx, u)
		if err != nil {
			t.Fatal(err)
		}
		h.Committed(field, nil, 500, 400)
		k := keys.slot(KeySlot(list))
		all = append(all, k.Fence, k.Record)
	}
	exists := func() int {
		n := 0
		for _, k := range all {
			n += int(rdb.Exists(ctx, k).Val())
		}
		return n
	}
	if n := exists(); n != len(all) {
		t.Fatalf("%d of the fences and records %v exist after the pushes, want all", n, all)
	}
	if dropped, err := h.Drop(ctx); err != nil || !dropped {
		t.Fatalf("drop: %v, %v; want true", dropped, err)
	}
	if n := exists(); n != 0 {
		t.Errorf("%d of the fences and records %v left after the drop, want none", n, all)
	}
}

// On a cluster too, a slot's record field whose delete a crash undid stays
// once the slot's record is read again, until its rows are deleted again
// and that is flushed (TestRecordFieldOutlivesACrashThatUndidItsDelete).
func TestClusterRecordFieldOutlivesACrashThatUndidItsDelete(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := testenv.StartRedisCluster(t).Client(t)
	h := New(rdb, newHandoffKeys("", "test", "crash", ""))
	if err := h.acquire(ctx, "h"); err != nil {
		t.Fatal(err)
	}
	const list = "{qa}:list"
	push := func(ids ...int64) string {
		u := &h.unit
		u.Reset()
		u.Begin(ids)
		u.Command("RPUSH", list, "job")
		if again, err := h.Claim(ctx, u, "h"); err != nil || again {
			t.Fatalf("claim: %v, %v", again, err)
		}
		field, err := h.Push(ctx, u)
		if err != nil {
			t.Fatal(err)
		}
		return field
	}
	field := push(7)
	ref := slotRef(KeySlot(list), field)
	h.Committed(field, nil, 500, 400) // then the crash

	h.Reset()
	if err := h.Ready(ctx, "h"); err != nil {
		t.Fatal(err)
	}
	// The next batch of the slot claims it again and reads its record.
	push(9)
	if !h.WasDelivered(7) {
		t.Fatalf("row 7 not delivered after the slot's record was read again: %v", h.delivered)
	}
	h.flushed(600)
	if slices.Contains(h.clear, ref) {
		t.Fatalf("%s to be deleted (clear %v) while its row is not deleted again", ref, h.clear)
	}
	h.Committed("", []int64{7}, 700, 650)
	h.flushed(700)
	if !slices.Contains(h.clear, ref) {
		t.Fatalf("%s not to be deleted (clear %v) once the second delete is flushed", ref, h.clear)
	}
}
