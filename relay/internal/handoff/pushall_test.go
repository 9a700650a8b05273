package handoff

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// PushAll runs the pushes of several handoffs in one pipeline, each as its
// own Push would: each is fenced on its own (a deposed one is refused, the
// others deliver), each records its own field, a script Redis no longer
// has is loaded and run, and TidyAll then deletes the committed fields of
// all of them.
func TestPushAllIsEachPush(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	const n = 3
	hs := make([]*Handoff, n)
	us := make([]*Unit, n)
	for i := range hs {
		hs[i] = New(rdb, newHandoffKeys(ns, "test", fmt.Sprintf("s%d", i), ""))
		if err := hs[i].acquire(ctx, "me"); err != nil {
			t.Fatal(err)
		}
		us[i] = &hs[i].unit
	}
	// Schema 1's fence taken by another leadership since.
	if err := New(rdb, hs[1].keys).acquire(ctx, "other"); err != nil {
		t.Fatal(err)
	}
	list := func(i int) string { return fmt.Sprintf("%s:list%d", ns, i) }
	build := func() {
		for i, u := range us {
			u.Reset()
			u.Begin([]int64{int64(10*i + 1), int64(10*i + 2)}, "")
			u.Variadic("LPUSH", list(i), 1, []any{"a", "b"})
		}
	}
	build()
	// The first pipeline's scripts are not loaded: each runs by its
	// source instead.
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	fields, errs := PushAll(ctx, hs, us)
	if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], ErrFenced) {
		t.Fatalf("errors %v, want nil, ErrFenced, nil", errs)
	}
	for _, i := range []int{0, 2} {
		if got, _ := rdb.LLen(ctx, list(i)).Result(); got != 2 {
			t.Fatalf("list %d holds %d values after PushAll, want 2", i, got)
		}
		want := fmt.Sprintf("%d,%d", 10*i+1, 10*i+2)
		if rec, _ := rdb.HGetAll(ctx, hs[i].keys.Record).Result(); rec[fields[i]] != want || len(rec) != 1 {
			t.Fatalf("record of schema %d: %v, want {%s: %s}", i, rec, fields[i], want)
		}
		if u := us[i]; u.ops[0].Err != nil {
			t.Fatalf("schema %d's op: %v", i, u.ops[0].Err)
		}
	}
	if got, _ := rdb.Exists(ctx, list(1), hs[1].keys.Record).Result(); got != 0 {
		t.Fatal("the fenced handoff's push wrote to Redis")
	}

	// A second round, the script loaded: one pipeline, each delivering
	// again under a field of its own.
	hs, us = []*Handoff{hs[0], hs[2]}, []*Unit{us[0], us[2]}
	build()
	fields2, errs := PushAll(ctx, hs, us)
	for i, err := range errs {
		if err != nil {
			t.Fatalf("second PushAll, handoff %d: %v", i, err)
		}
	}
	for i, h := range hs {
		if fields2[i] == fields[2*i] {
			t.Fatalf("handoff %d pushed twice under field %s", i, fields2[i])
		}
		h.Committed(fields[2*i], nil, 100, 100)
		h.Committed(fields2[i], nil, 100, 100)
	}
	var staged []int
	errs = TidyAll(ctx, hs, func(i int, ids []int64) ([]int64, error) {
		staged = append(staged, i)
		return nil, nil
	}, func(int) (uint64, uint64, error) { return 100, 100, nil })
	for i, err := range errs {
		if err != nil {
			t.Fatalf("TidyAll, handoff %d: %v", i, err)
		}
	}
	for i, h := range hs {
		if got, _ := rdb.Exists(ctx, h.keys.Record).Result(); got != 0 || len(h.clear) != 0 {
			t.Fatalf("handoff %d: record left (%d), fields still to clear %v after TidyAll", i, got, h.clear)
		}
	}
	if len(staged) != 0 {
		t.Fatalf("TidyAll read the staged rows of %v, with no row delivered and not deleted", staged)
	}
}
